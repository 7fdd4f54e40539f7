// The float8 formats' kernels (dtensor_quant/formats/float8.py loads them through dtensor_quant/core/native.py;
// Float8Blockwise uses them too, with a scale per row and block of columns). Each weight is float(code) * scale in
// fp32, rounded to bf16 for bf16 activations, as the formats' dequantize computes it; only the order of the fp32
// sum differs from dequantize + mm. NaN codes (0x7F, 0xFF) never reach them: the format's prepare sends such a
// weight to dequantize + mm.
//
// One token (decode): each weight is multiplied by x in fp32 as it is made: the codes are read once, at memory
// speed, and no dense weight is written. Several tokens: native_tiles.h's tiled matmul; a weight whose every scale
// is exactly 1 (the fp8 activations' product) on AMX: float8_unit.h's own loop (faster there; the same bits).
#include "native_prelude.h"
#include "native_tiles.h"
#include "float8_unit.h"

// 32 codes -> their e4m3 values times 2^-120, as fp32: the bf16 bits (sign | magnitude << 4) in each lane's upper
// half. lo holds bytes 8l..8l+3 of every 128-bit lane l, hi bytes 8l+4..8l+7 (dq_x_order says where x goes).
__attribute__((target("avx512f,avx512bw")))
static inline void dq_e4m3_raw(const uint8_t* p, __m512& lo, __m512& hi) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i bits = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x7F0)),
                                   _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(short(0x8000))));
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), bits));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), bits));
}

// The same for 16 codes with AVX2: lo holds bytes 8l..8l+3 of each 128-bit lane, hi bytes 8l+4..8l+7.
__attribute__((target("avx2,fma")))
static inline void dq_e4m3_raw_avx2(const uint8_t* p, __m256& lo, __m256& hi) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i bits = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 4), _mm256_set1_epi16(0x7F0)),
                                   _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(short(0x8000))));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), bits));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), bits));
}

// Integer rounding, exact for any scale. kSmall: every scale of the row below 2^7 in magnitude, so s * 2^120 is
// finite and one multiply gives the exact product, which cannot be NaN (no NaN code, finite scale).
template <bool kSmall>
__attribute__((target("avx2,fma")))
static float dq_f8_row_avx2(const uint8_t* row, const float* s, const float* xf, int64_t K, int64_t g) {
    const __m256 up = _mm256_set1_ps(0x1p120f);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), vs = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        DQ_PREFETCH_AHEAD(row + k);
        if (k % g == 0) vs = _mm256_set1_ps(kSmall ? s[k / g] * 0x1p120f : s[k / g]);
        __m256 lo, hi;
        dq_e4m3_raw_avx2(row + k, lo, hi);
        if (kSmall) {
            lo = dq_round_bf16_256_finite(_mm256_mul_ps(lo, vs));
            hi = dq_round_bf16_256_finite(_mm256_mul_ps(hi, vs));
        } else {
            lo = dq_round_bf16_256(_mm256_mul_ps(_mm256_mul_ps(lo, up), vs));
            hi = dq_round_bf16_256(_mm256_mul_ps(_mm256_mul_ps(hi, up), vs));
        }
        acc0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xf + k), acc0);
        acc1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xf + k + 8), acc1);
    }
    return dq_sum_256(_mm256_add_ps(acc0, acc1));
}

// The same with AVX-512 (value * 2^-120 * 2^120 is exact, subnormal codes too).
template <bool kSmall>
__attribute__((target("avx512f,avx512bw")))
static float dq_f8_row(const uint8_t* row, const float* s, const float* xf, int64_t K, int64_t g) {
    const __m512 up = _mm512_set1_ps(0x1p120f);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), vs = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        DQ_PREFETCH_AHEAD(row + k);
        if (k % g == 0) vs = _mm512_set1_ps(kSmall ? s[k / g] * 0x1p120f : s[k / g]);
        __m512 lo, hi;
        dq_e4m3_raw(row + k, lo, hi);
        if (kSmall) {
            lo = dq_round_bf16_512_finite(_mm512_mul_ps(lo, vs));
            hi = dq_round_bf16_512_finite(_mm512_mul_ps(hi, vs));
        } else {
            lo = dq_round_bf16_512(_mm512_mul_ps(_mm512_mul_ps(lo, up), vs));
            hi = dq_round_bf16_512(_mm512_mul_ps(_mm512_mul_ps(hi, up), vs));
        }
        acc0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xf + k), acc0);
        acc1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xf + k + 16), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Every scale of the row in [2^-117, 2^7): every product is 0 or a normal fp32, where vcvtne2ps2bf16 rounds to
// nearest even exactly like dq_bf16_rne, and s * 2^120 is finite, so one multiply gives the exact product;
// vdpbf16ps multiplies the bf16 pairs exactly and accumulates in fp32.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static float dq_f8_row_bf16(const uint8_t* row, const float* s, const uint16_t* xb, int64_t K, int64_t g) {
    __m512 acc = _mm512_setzero_ps(), vs = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        DQ_PREFETCH_AHEAD(row + k);
        if (k % g == 0) vs = _mm512_set1_ps(s[k / g] * 0x1p120f);
        __m512 lo, hi;
        dq_e4m3_raw(row + k, lo, hi);
        __m512bh w = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, vs), _mm512_mul_ps(lo, vs));
        acc = _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_loadu_si512(xb + k));
    }
    return _mm512_reduce_add_ps(acc);
}

// A scale s with |s| < 2^7: s * 2^120 is finite, so one multiply gives a code's exact product (kSmall, mult).
static inline bool dq_f8_small(float s) { return std::fabs(s) < 128; }
// ... and |s| >= 2^-117 too: every product is 0 or normal (|code| from 2^-9 to 448), which vdpbf16ps reads exactly.
// NaN and Inf scales are neither.
static inline bool dq_f8_normal(float s) { return dq_f8_small(s) && std::fabs(s) >= 0x1p-117f; }

// The one-token kernel. scale: [N, K / g], one per row and group of g columns (g = K: per row).
// level 1: AVX2, 2: AVX-512, 3: AVX-512 with BF16 (the rows it is exact for).
static void dq_f8(const uint8_t* codes, const float* scale, const uint16_t* x, uint16_t* out, int64_t M, int64_t N,
                  int64_t K, int64_t g, int64_t lvl, int64_t threads) {
    int64_t level[1] = {lvl};
    const int64_t half = level[0] >= 2 ? 16 : 8;
    uint16_t* xb = new uint16_t[K];  // x in dq_e4m3_raw's order, as bf16 and as fp32
    float* xf = new float[K];
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) {
            xb[k] = x[m * K + k - k % (2 * half) + dq_x_order(k % (2 * half), half)];
            xf[k] = dq_bf16_float(xb[k]);
        }
        #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const float* s = scale + n * (K / g);
            bool small = true, normal = true;
            for (int64_t i = 0; i < K / g; ++i) {
                small &= dq_f8_small(s[i]);
                normal &= dq_f8_normal(s[i]);
            }
            const uint8_t* row = codes + n * K;
            float acc = level[0] == 3 && normal ? dq_f8_row_bf16(row, s, xb, K, g)
                        : level[0] >= 2         ? (small ? dq_f8_row<true>(row, s, xf, K, g)
                                                         : dq_f8_row<false>(row, s, xf, K, g))
                        : small                 ? dq_f8_row_avx2<true>(row, s, xf, K, g)
                                                : dq_f8_row_avx2<false>(row, s, xf, K, g);
            out[m * N + n] = dq_bf16_rne(acc);
        }
    }
    delete[] xb;
    delete[] xf;
}

// code -> float(code) * s in fp32 on 16 lanes (d: the codes, one per 32-bit lane), exactly: the code's bits moved
// into an fp32's (sign, and exponent and mantissa shifted by 20) make float(code) * 2^-120, subnormal codes too;
// raw * s, raw being a code's e4m3 value times 2^-120 (dq_e4m3_raw): vs is s * 2^120 when every |s| of the group is
// below 2^7 (one multiply, exact: the same real product), else s (raw scaled back by 2^120 first).
__attribute__((target("avx512f,avx512bw")))
static inline __m512 dq_e4m3_times_512(__m512 raw, __m512 vs, bool small) {
    return small ? _mm512_mul_ps(raw, vs) : _mm512_mul_ps(_mm512_mul_ps(raw, _mm512_set1_ps(0x1p120f)), vs);
}

__attribute__((target("avx2,fma")))
static inline __m256 dq_e4m3_times_256(__m256 raw, __m256 vs, bool small) {
    return small ? _mm256_mul_ps(raw, vs) : _mm256_mul_ps(_mm256_mul_ps(raw, _mm256_set1_ps(0x1p120f)), vs);
}

// Row n of the weight for native_tiles.h. A chunk of 32 columns is stored in dq_e4m3_raw's order (the lo lanes,
// then the hi ones): 32 codes widen to 16 bits once and split into two fp32 registers with two unpacks.
struct Float8Rows {
    const uint8_t* codes;  // [N, K]
    const float* scale;    // [N, K / g]
    int64_t K, g;

    static int64_t perm(int64_t p) { return dq_x_order(p, 16); }

    // The group's multiplier for dq_e4m3_times_*: s * 2^120 where |s| < 2^7, else s.
    static float mult(float s, bool& small) {
        small = dq_f8_small(s);
        return small ? s * 0x1p120f : s;
    }

    __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
    bool bf16(int64_t n, int64_t k0, int64_t kc, uint16_t* dst) const {
        const uint8_t* row = codes + n * K;
        const float* s = scale + n * (K / g);
        __mmask16 bad = 0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            if (s[gr.b] == 1.0f && dq_vbmi()) {  // unit scale: the codes' values, no product to check
                dq_e4m3_unit_bf16(row + gr.k, gr.end - gr.k, dst + (gr.k - k0));
                continue;
            }
            bool small;
            const __m512 vs = _mm512_set1_ps(mult(s[gr.b], small));
            const bool safe = dq_f8_normal(s[gr.b]);  // no product to check
            for (int64_t k = gr.k; k < gr.end; k += 32) {
                DQ_PREFETCH_AHEAD(row + k);
                __m512 lo, hi;
                dq_e4m3_raw(row + k, lo, hi);
                lo = dq_e4m3_times_512(lo, vs, small);
                hi = dq_e4m3_times_512(hi, vs, small);
                if (!safe) bad |= dq_bf16_unsafe_512(lo) | dq_bf16_unsafe_512(hi);
                _mm512_storeu_si512(dst + (k - k0), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
        return bad == 0;
    }

    __attribute__((target("avx512f,avx512bw")))
    void f32_512(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const uint8_t* row = codes + n * K;
        const float* s = scale + n * (K / g);
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            bool small;
            const __m512 vs = _mm512_set1_ps(mult(s[gr.b], small));
            for (int64_t k = gr.k; k < gr.end; k += 32) {
                __m512 lo, hi;
                dq_e4m3_raw(row + k, lo, hi);
                lo = dq_e4m3_times_512(lo, vs, small);
                hi = dq_e4m3_times_512(hi, vs, small);
                _mm512_storeu_ps(dst + (k - k0), round ? dq_round_bf16_512(lo) : lo);
                _mm512_storeu_ps(dst + (k - k0) + 16, round ? dq_round_bf16_512(hi) : hi);
            }
        }
    }

    // 16 codes a step: dq_e4m3_raw_avx2's lo lanes of codes 16h.. are positions 8h.. of the chunk, its hi lanes
    // positions 16 + 8h.. (the same order as dq_e4m3_raw's).
    __attribute__((target("avx2,fma")))
    void f32_256(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const uint8_t* row = codes + n * K;
        const float* s = scale + n * (K / g);
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            bool small;
            const __m256 vs = _mm256_set1_ps(mult(s[gr.b], small));
            for (int64_t k = gr.k; k < gr.end; k += 32)
                for (int h = 0; h < 2; ++h) {
                    __m256 lo, hi;
                    dq_e4m3_raw_avx2(row + k + 16 * h, lo, hi);
                    lo = dq_e4m3_times_256(lo, vs, small);
                    hi = dq_e4m3_times_256(hi, vs, small);
                    _mm256_storeu_ps(dst + (k - k0) + 8 * h, round ? dq_round_bf16_256(lo) : lo);
                    _mm256_storeu_ps(dst + (k - k0) + 16 + 8 * h, round ? dq_round_bf16_256(hi) : hi);
                }
        }
    }
};

// flags: 1: x and out are fp32 (else bf16); 2: several tokens, through the tiles (else the one-token kernel, bf16
// only); 4: round every weight to bf16. Level 1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX (the tiles). Called
// with M = 0 it only reports the best level here.
extern "C" void kernel(const uint8_t* codes, const float* scale, const void* x, void* out, int64_t M, int64_t N,
                       int64_t K, int64_t g, int64_t flags, int64_t max_level, int64_t threads, int64_t* level) {
    int64_t best = K % 32 || g % 32 || K % g ? 0 : dq_tiles_best();
    if (!(flags & 2) && best > 3) best = 3;  // the one-token kernel's best: AVX-512 BF16
    level[0] = best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
#if DQ_AMX
    if ((flags & 2) && !(flags & 1) && level[0] >= 4 && dq_vbmi() && f8_unit_scales(scale, N * (K / g))) {
        uint16_t* o = static_cast<uint16_t*>(out);
        const uint16_t* xb = static_cast<const uint16_t*>(x);
        f8_unit_amx(codes, M, N, K, threads,
                    [&](int64_t m0, int64_t ms, uint16_t* dst) {
                        dq_prepare_x_512<F8UnitOrder>(xb + m0 * K, false, ms, K, dst, nullptr);
                    },
                    [&](const float* C, int64_t m0, int64_t ms, int64_t rows, int64_t n0) {
                        dq_store_amx(C, ms, rows, o + m0 * N, N, n0);
                    });
        return;
    }
#endif
    if (flags & 2)
        dq_tiles(Float8Rows{codes, scale, K, g}, x, out, M, N, K, flags & 1, flags & 4, level[0], threads);
    else if (!(flags & 1))
        dq_f8(codes, scale, static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), M, N, K, g, level[0],
              threads);
    else
        level[0] = 0;
}
