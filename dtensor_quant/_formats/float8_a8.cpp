// FP8 activations (Float8Rowwise / Float8Tensorwise with an fp8 activation scheme): the two passes around the
// product of the codes, each the bits of dtensor_quant/_core/activations.py's reference arithmetic
// (dtensor_quant/_formats/float8.py loads it through dtensor_quant/_core/native.py; the product itself is the
// float8 tiles' with unit scales, float8.cpp).
//
// stage 1 (quantize_activation): per token row m, amax = max |x| (NaN if the row has one, Inf if an Inf),
// s = amax == 0 ? 1 : amax / 448 (a true division); a static scheme: s = input_scale, NaN for a row holding a NaN
// or an Inf. The code of x is clamp(x / s, -448, 448) (correctly rounded, NaN kept) rounded to e4m3fn, to nearest
// even (normal: 3 mantissa bits; below 2^-6, multiples of 2^-9); written as its value, exactly, in x's dtype (bf16
// or fp32): what the tiles multiply. xscale[m] = s.
// stage 2 (scale_output): out = round_to_out_dtype((float(acc) * s_m) * ws_n) from the tiles' sums acc [M, N]
// (x's dtype).
// stage 3 (bf16 x, AMX with AVX-512 VBMI, K % 32 == 0; acc holds the weight's e4m3 codes [N, K], unit scales):
// the whole linear in one call -- stage 1 into xscale and, a chunk of tokens at a time, straight into the tiles'
// activations (vals unused), the float8 tiles' unit-scale product
// (float8_unit.h, the same sums and rounding to bf16 as float8.cpp's tiles), and stage 2's arithmetic applied to
// each tile's sums as they leave the tiles (f8_store_scaled): the tiles' bf16 output is never written to memory
// and read back, and Python makes no acc and runs one kernel call instead of three. Reports level 0 and does
// nothing where it cannot run.
// flags: 1: x, vals, acc and out are fp32 (else bf16); 2: amax[m] given in stat (tensor parallelism's reduced
// statistic); 4: static scheme, stat[0] the input scale. Level 4: AMX (stage 3); 2: AVX-512; 1: plain C++ (an AVX2
// CPU).
#include "native_prelude.h"
#include "native_tiles.h"
#include "float8_unit.h"
#include "act_rows.h"

// The e4m3fn value nearest v (|v| <= 448 or NaN), ties to even.
static inline float f8_round(float v) {
    if (v != v) return v;
    const float a = std::fabs(v);
    float r;
    if (a < 0x1p-6f) {
        r = std::nearbyint(a * 512.0f) / 512.0f;
    } else {
        uint32_t u;
        std::memcpy(&u, &a, 4);
        u = (u + 0x7FFFFu + ((u >> 20) & 1u)) & 0xFFF00000u;
        std::memcpy(&r, &u, 4);
    }
    return std::copysign(r, v);
}

static inline void f8_put(void* dst, bool f32, int64_t i, float v) {
    if (f32) {
        static_cast<float*>(dst)[i] = v;
    } else {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        static_cast<uint16_t*>(dst)[i] = static_cast<uint16_t>(u >> 16);  // exact: an e4m3 value is a bf16 value
    }
}

// 16 values at a time: f8_round on AVX-512; a bf16 row's 32 values of two steps go out in one 64-byte store (its
// tail 16 at a time). Tried and not kept: multiplying by 1 / s and dividing only the steps with a quotient near an
// e4m3 rounding boundary (the same codes) took 1.10-1.17x the pass's time: the division is not what binds it.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m512 f8_code16(__m512 xv, __m512 vs) {
    const __m512 lo = _mm512_set1_ps(-448.0f), hi = _mm512_set1_ps(448.0f);
    const __m512 small = _mm512_set1_ps(0x1p-6f), up = _mm512_set1_ps(512.0f), down = _mm512_set1_ps(0x1p-9f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    // max(lo, v), min(hi, .): the second operand comes back where one is NaN, so NaN stays NaN
    const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(xv, vs)));
    const __m512 a = _mm512_abs_ps(v);
    const __m512i u = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
    const __m512i n = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFFF))),
                                       _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
    const __m512 sub = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(a, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), down);
    const __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, small, _CMP_LT_OQ), _mm512_castsi512_ps(n), sub);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(v), sign)));
}

// permute (bf16, K % 32 == 0): each chunk of 32 codes in F8UnitOrder's order, as the tiles read them (stage 3), the
// permutation folded into the shuffle that packs them.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void f8_codes_512(const void* x, bool f32, int64_t K, float s, void* dst, bool permute = false) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t k = 0;
    if (!f32) {  // the high halves of two steps' fp32 results, in order: one store
        alignas(64) uint16_t odd[32];
        for (int i = 0; i < 32; ++i) odd[i] = static_cast<uint16_t>(2 * (permute ? F8UnitOrder::perm(i) : i) + 1);
        const __m512i pick = _mm512_load_si512(odd);
        for (; k + 32 <= K; k += 32) {
            const __m512 r0 = f8_code16(act_load_512(x, false, k, 0xFFFF), vs);
            const __m512 r1 = f8_code16(act_load_512(x, false, k + 16, 0xFFFF), vs);
            _mm512_storeu_si512(static_cast<uint16_t*>(dst) + k,
                                _mm512_permutex2var_epi16(_mm512_castps_si512(r0), pick, _mm512_castps_si512(r1)));
        }
    }
    for (; k < K; k += 16) {
        const __mmask16 m = act_mask(K - k);
        const __m512 r = f8_code16(act_load_512(x, f32, k, m), vs);
        if (f32)
            _mm512_mask_storeu_ps(static_cast<float*>(dst) + k, m, r);
        else
            _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + k, m,
                                     _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r), 16)));
    }
}

// Tokens [0, M) of x (and of xscale, vals): stat as for token 0 (tensor parallelism's maxima offset by the caller).
// permute: as f8_codes_512's (level >= 2, bf16).
static void f8_quantize(const void* x, bool f32, const float* stat, int64_t flags, void* vals, float* xscale,
                        int64_t M, int64_t K, int64_t level, int64_t threads, bool permute = false) {
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        const void* row = act_row(x, f32, m, K);
        void* dst = f32 ? static_cast<void*>(static_cast<float*>(vals) + m * K)
                        : static_cast<void*>(static_cast<uint16_t*>(vals) + m * K);
        const float s = act_row_scale(row, f32, K, stat, flags, m, level, 448.0f);
        xscale[m] = s;
        if (level >= 2) {
            f8_codes_512(row, f32, K, s, dst, permute);
        } else {
            for (int64_t k = 0; k < K; ++k) {
                float v = act_x(row, f32, k) / s;
                v = v != v ? v : v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
                f8_put(dst, f32, k, f8_round(v));
            }
        }
    }
}

static inline float f8_acc(const void* acc, bool f32, int64_t i) { return act_x(acc, f32, i); }

__attribute__((target("avx512f,avx512bw,avx512vl")))
static void f8_epilogue_512(const void* acc, const float* xscale, const float* ws, bool f32, void* out, int64_t M,
                            int64_t N) {
    for (int64_t m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(xscale[m]);
        for (int64_t n = 0; n < N; n += 16) {
            const __mmask16 k = act_mask(N - n);
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(act_load_512(acc, f32, m * N + n, k), xs),
                                           _mm512_maskz_loadu_ps(k, ws + n));
            if (f32)
                _mm512_mask_storeu_ps(static_cast<float*>(out) + m * N + n, k, v);
            else
                dq_store_bf16_512(static_cast<uint16_t*>(out) + m * N + n, k, v);
        }
    }
}

// Stage 3's store: out[m0 + m, n0 + r] = bf16((float(bf16(Ct[r][m])) * xscale[m]) * ws[n0 + r]) for the tile's
// rows and tokens -- dq_store_amx's rounding of the sums to bf16 (the tiles' output), then
// f8_epilogue_512's arithmetic on it, in the same order: the same bits as stages 2 after the tiles. A token's 32
// rows go out in one 64-byte store (one cache line: n0 is a multiple of 32), both halves of the tile transposed
// first; the products rounded to bf16 by vcvtne2ps2bf16, both halves at once, where no lane is one it does not
// round as dq_bf16_rne does (subnormal, Inf, NaN: dq_bf16_unsafe_512), else by dq_round_bf16_512.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static void f8_store_scaled(const float* Ct, int64_t ms, int64_t rows, const float* xscale, const float* ws,
                            uint16_t* out, int64_t N, int64_t n0) {
    const int64_t Mp = (ms + 15) / 16 * 16;
    const __mmask32 k = rows >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << rows) - 1);
    const __m512 w0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(k), ws + n0);
    const __m512 w1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(k >> 16), ws + n0 + 16);
    alignas(64) uint16_t odd[32];
    for (int i = 0; i < 32; ++i) odd[i] = static_cast<uint16_t>(2 * i + 1);
    const __m512i pick = _mm512_load_si512(odd);
    __m512i r[16], c0[16], c1[16];
    for (int64_t m0 = 0; m0 < ms; m0 += 16) {
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(Ct + i * Mp + m0);
        dq_transpose16(r, c0);
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(Ct + (16 + i) * Mp + m0);  // rows past `rows`: unused
        dq_transpose16(r, c1);
        for (int j = 0; j < 16 && m0 + j < ms; ++j) {
            const __m512 xs = _mm512_set1_ps(xscale[m0 + j]);
            const __m512 v0 = _mm512_mul_ps(_mm512_mul_ps(dq_round_bf16_512(_mm512_castsi512_ps(c0[j])), xs), w0);
            const __m512 v1 = _mm512_mul_ps(_mm512_mul_ps(dq_round_bf16_512(_mm512_castsi512_ps(c1[j])), xs), w1);
            const __m512i v = dq_bf16_unsafe_512(v0) | dq_bf16_unsafe_512(v1)
                                  ? _mm512_permutex2var_epi16(_mm512_castps_si512(dq_round_bf16_512(v0)), pick,
                                                              _mm512_castps_si512(dq_round_bf16_512(v1)))
                                  : (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  // rows 0-15 from v0, 16-31 from v1
            _mm512_mask_storeu_epi16(out + (m0 + j) * N + n0, k, v);
        }
    }
}

extern "C" void kernel(const void* x, const float* stat, const float* ws, void* vals, float* xscale, const void* acc,
                       void* out, int64_t M, int64_t N, int64_t K, int64_t stage, int64_t flags, int64_t max_level,
                       int64_t threads, int64_t* level) {
    const int64_t best = dq_avx512() ? (dq_amx() && dq_vbmi() ? 4 : 2) : dq_avx2() ? 1 : 0;
    const int64_t lvl = best < max_level ? best : max_level;
    level[0] = lvl;
    if (lvl <= 0 || M <= 0 || stage == 0) return;
    const bool f32 = flags & 1;
    if (stage == 3) {
#if DQ_AMX
        if (f32 || lvl < 4 || K % 32) {
            level[0] = 0;
            return;
        }
        // each chunk of tokens quantized straight into the tiles' column order just before its tiles, while its
        // activations are in cache (vals is not written)
        const uint16_t* xb = static_cast<const uint16_t*>(x);
        uint16_t* o = static_cast<uint16_t*>(out);
        f8_unit_amx(static_cast<const uint8_t*>(acc), M, N, K, threads,
                    [&](int64_t m0, int64_t ms, uint16_t* dst) {
                        f8_quantize(xb + m0 * K, false, flags & 2 ? stat + m0 : stat, flags, dst, xscale + m0, ms,
                                    K, lvl, threads, true);
                    },
                    [&](const float* C, int64_t m0, int64_t ms, int64_t rows, int64_t n0) {
                        f8_store_scaled(C, ms, rows, xscale + m0, ws, o + m0 * N, N, n0);
                    });
#else
        level[0] = 0;
#endif
    } else if (stage == 1) {
        f8_quantize(x, f32, stat, flags, vals, xscale, M, K, lvl, threads);
    } else if (stage == 2 && lvl >= 2) {
        f8_epilogue_512(acc, xscale, ws, f32, out, M, N);
    } else if (stage == 2) {
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
                const float v = f8_acc(acc, f32, m * N + n) * xscale[m] * ws[n];
                if (f32)
                    static_cast<float*>(out)[m * N + n] = v;
                else
                    static_cast<uint16_t*>(out)[m * N + n] = dq_bf16_rne(v);
            }
    }
}
