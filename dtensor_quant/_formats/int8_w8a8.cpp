// W8A8 (Int8Rowwise with an int8 activation scheme): the activation quantized per token in one pass, the int8
// products summed exactly in int32, and the scales applied in one pass, each step the bits of
// dtensor_quant/_core/activations.py's reference arithmetic (dtensor_quant/_formats/int8.py loads it through
// dtensor_quant/_core/native.py).
//
// Per token row m (reference: quantize_activation): amax = max |x| (NaN if the row has one, Inf if an Inf),
// s = amax == 0 ? 1 : amax / 127 (fp32, a true division); a static scheme: s = input_scale, NaN for a row holding
// a NaN or an Inf. codes = clamp(round_half_even(x / s), -128, 127), NaN to 0 (x / s correctly rounded in fp32,
// x promoted exactly; see w8_codes_512 for the reciprocal it multiplies by where that gives the same codes).
// Epilogue (scale_output): out = round_to_out_dtype((float(acc) * s_m) * ws_n), float(acc)
// rounded to nearest even as torch's int32 -> fp32 conversion.
//
// stage 0: report the best level here (4: AMX-INT8, 2: AVX-512, 1: AVX2, 0: none); 1: quantize x into codes
// [M, K] and xscale [M]; 2: the epilogue from acc [M, N] int32 (torch._int_mm's) into out; 3: the whole linear on
// AMX-INT8 (TDPBSSD): stage 1, the products of 32 weight rows by 16-token groups a tile at a time (the stored
// weight codes read as they are, the activation codes in the tiles' groups of 4), stage 2 from the tiles' sums;
// it reports 0 and does nothing where it cannot run (no AMX-INT8, K % 64, level capped below 4); 4: each row's
// max |x| into xscale [M] (activations.token_absmax's value: NaN if the row holds one, sign bit clear), the local
// statistic tensor parallelism all-reduces before stage 1 or 3 take it (flag 2).
// flags: 1: x and out are fp32 (else bf16); 2: amax[m] given in stat (the reduced statistic of tensor
// parallelism); 4: static scheme, stat[0] the input scale.
#include "native_prelude.h"
#include "native_tiles.h"
#include "act_rows.h"

static inline bool w8_amx_int8() {
#if DQ_AMX
    static const bool have = [] {
        unsigned a, b, c, d;  // CPUID leaf 7: EDX bit 25 AMX-INT8
        return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1);
    }();
    return have && dq_amx();
#else
    return false;
#endif
}

// The reference's code of one value.
static inline int8_t w8_code(float x, float s) {
    float v = x / s;
    if (v != v) return 0;
    v = std::nearbyint(v);
    v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
    return static_cast<int8_t>(static_cast<int>(v));
}

// A row's scale s for which x * (1 / s) stands in for x / s (w8_code16): 1 / s is a normal fp32 within half an
// ulp of the real reciprocal. Other rows (s subnormal, huge, Inf or NaN: rare) divide.
static inline bool w8_reciprocal_ok(float s) { return std::fabs(s) >= 0x1p-125f && std::fabs(s) <= 0x1p125f; }

// 16 codes of x[k..] (lanes of m), as int32 (below -128 where x / s is: the narrowing saturates, see
// w8_codes_512); fast: s passed w8_reciprocal_ok, vr = 1 / s. Dividing costs more than the rest of the row's work
// together, so where the reciprocal r = RN(1 / s) is normal, v = RN(x * r) is |x / s| * (1 + e) with
// |e| < 2^-22.4, and so is the correctly rounded quotient q = RN(x / s): for |v| < 256 they lie within 2^-14.4 of
// each other, so where v is farther than 2^-14 from a half-integer q rounds to the same integer as v; for |v| >= 256
// both clamp alike. The lanes of a step with a v closer than that (about 1 step in 500; |v| >= 256 is counted close
// too, rare and still right) divide, as the reference does; so do NaN and Inf lanes (v - r is NaN: unordered), so
// the fast lanes need neither the NaN mask nor the lower clamp (the saturating narrowing gives -128 below it, also
// for the integer indefinite 0x80000000 that converting v < -2^31 gives).
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m512i w8_code16(const void* x, bool f32, int64_t k, __mmask16 m, bool fast, __m512 vr, __m512 vs) {
    const __m512 lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f), near = _mm512_set1_ps(0.5f - 0x1p-14f);
    const __m512 xv = act_load_512(x, f32, k, m);
    if (fast) {
        const __m512 v = _mm512_mul_ps(xv, vr);
        const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // |v - r| <= 1/2 where finite: close to a half-integer, or NaN (unordered: divide, and get the same NaN)
        if (!_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, r)), near, _CMP_NLE_UQ))
            return _mm512_cvtps_epi32(_mm512_min_ps(r, hi));
    }
    const __m512 v = _mm512_div_ps(xv, vs);
    __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);  // NaN lanes: zeroed by the conversion's mask
    return _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), r);
}

// The codes of a row: 64 a step, narrowed by two saturating packs (int32 -> int16 -> int8, 128-bit lane by lane)
// and one permute back into order (four narrowing conversions and inserts cost three times the shuffles), then 16
// at a time.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void w8_codes_512(const void* x, bool f32, int64_t K, float s, int8_t* dst) {
    const bool fast = w8_reciprocal_ok(s);
    const __m512 vs = _mm512_set1_ps(s), vr = _mm512_set1_ps(1.0f / s);
    // after the packs, 32-bit group 4 * i + j holds codes 4 * i .. 4 * i + 3 of the j-th 16
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i a = w8_code16(x, f32, k, 0xFFFF, fast, vr, vs), b = w8_code16(x, f32, k + 16, 0xFFFF, fast, vr, vs);
        const __m512i c = w8_code16(x, f32, k + 32, 0xFFFF, fast, vr, vs), d = w8_code16(x, f32, k + 48, 0xFFFF, fast, vr, vs);
        const __m512i p = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
        _mm512_storeu_si512(dst + k, _mm512_permutexvar_epi32(order, p));
    }
    for (; k < K; k += 16) {
        const __mmask16 m = act_mask(K - k);
        _mm512_mask_cvtsepi32_storeu_epi8(dst + k, m, w8_code16(x, f32, k, m, fast, vr, vs));
    }
}

__attribute__((target("avx2,fma")))
static void w8_codes_256(const void* x, bool f32, int64_t K, float s, int8_t* dst) {
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_div_ps(act_load_256(x, f32, k), vs);
        __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256i i = _mm256_cvtps_epi32(r);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + k), _mm_packs_epi16(w, w));
    }
    for (; k < K; ++k) dst[k] = w8_code(act_x(x, f32, k), s);
}

// Stage 1: codes [M, K] and xscale [M] of x [M, K].
static void w8_quantize(const void* x, bool f32, const float* stat, int64_t flags, int8_t* codes, float* xscale,
                        int64_t M, int64_t K, int64_t level, int64_t threads) {
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        const void* row = act_row(x, f32, m, K);
        const float s = act_row_scale(row, f32, K, stat, flags, m, level, 127.0f);
        xscale[m] = s;
        if (level >= 2)
            w8_codes_512(row, f32, K, s, codes + m * K);
        else
            w8_codes_256(row, f32, K, s, codes + m * K);
    }
}

// 16 outputs (float(a) * xs) * ws[0..16) stored as out's dtype in the lanes of mask k.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline void w8_out_512(__m512i a, float xs, const float* ws, __mmask16 k, bool f32, void* out, int64_t i) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(xs)),
                                   _mm512_maskz_loadu_ps(k, ws));
    if (f32)
        _mm512_mask_storeu_ps(static_cast<float*>(out) + i, k, v);
    else
        dq_store_bf16_512(static_cast<uint16_t*>(out) + i, k, v);
}

// Stage 2 on AVX-512 / AVX2: out [M, N] from acc [M, N].
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void w8_epilogue_512(const int32_t* acc, const float* xscale, const float* ws, bool f32, void* out, int64_t M,
                            int64_t N) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; n += 16) {
            const __mmask16 k = act_mask(N - n);
            w8_out_512(_mm512_maskz_loadu_epi32(k, acc + m * N + n), xscale[m], ws + n, k, f32, out, m * N + n);
        }
}

__attribute__((target("avx2,fma")))
static void w8_epilogue_256(const int32_t* acc, const float* xscale, const float* ws, bool f32, void* out, int64_t M,
                            int64_t N) {
    for (int64_t m = 0; m < M; ++m) {
        const __m256 xs = _mm256_set1_ps(xscale[m]);
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + m * N + n));
            const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), xs), _mm256_loadu_ps(ws + n));
            if (f32) {
                _mm256_storeu_ps(static_cast<float*>(out) + m * N + n, v);
            } else {
                const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(dq_round_bf16_256(v)), 16);
                const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + m * N + n), h);
            }
        }
        for (; n < N; ++n) {
            const float v = static_cast<float>(acc[m * N + n]) * xscale[m] * ws[n];
            if (f32)
                static_cast<float*>(out)[m * N + n] = v;
            else
                static_cast<uint16_t*>(out)[m * N + n] = dq_bf16_rne(v);
        }
    }
}

#if DQ_AMX
// This thread's scratch buffer `which` of at least n bytes, 64-byte aligned, kept for its next calls (a fresh one
// would cost its page faults on every call).
struct W8Free {
    void operator()(char* p) const { std::free(p); }
};
static void* w8_buffer(int which, int64_t n) {
    static thread_local std::unique_ptr<char[], W8Free> buffers[2];
    static thread_local int64_t sizes[2] = {0, 0};
    if (sizes[which] < n) {
        buffers[which].reset(static_cast<char*>(std::aligned_alloc(64, (n + 63) / 64 * 64)));
        sizes[which] = n;
    }
    return buffers[which].get();
}

// codes [rows <= 16, K] -> xv [K / 4][16]: 32-bit groups of 4 codes, one row of the TDPBSSD operand per group, the
// tokens past rows zero (K % 64 == 0).
__attribute__((target("avx512f,avx512bw")))
static void w8_group_amx(const int8_t* codes, int64_t rows, int64_t K, int32_t* xv) {
    __m512i r[16], c[16];
    for (int64_t k = 0; k < K; k += 64) {
        for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(codes + i * K + k) : _mm512_setzero_si512();
        dq_transpose16(r, c);
        for (int j = 0; j < 16; ++j) _mm512_store_si512(xv + (k / 4 + j) * 16, c[j]);
    }
}

// C[32][32] int32 (row stride 32) = weight rows w[0..32) (stride K) times the token groups x0 (and x1 with TWO,
// C's columns 16..31), all of K, the sums exact in int32. pf: the next tile's rows (32 * K bytes), prefetched
// into L2 a few lines a step from lines [pf_from, pf_to) (the hardware's prefetcher does not run that far ahead of
// 32 strided rows).
template <bool TWO>
__attribute__((target("amx-tile,amx-int8")))
static void w8_amx_block(const int8_t* w, int64_t K, const int32_t* x0, const int32_t* x1, int32_t* C,
                         const char* pf, int64_t pf_from, int64_t pf_to) {
    _tile_zero(0);
    _tile_zero(2);
    if (TWO) {
        _tile_zero(1);
        _tile_zero(3);
    }
    const int64_t per = (pf_to - pf_from + K / 64 - 1) / (K / 64);
    int64_t line = pf_from;
    for (int64_t k = 0; k < K; k += 64) {
        // each operand loaded just before its first product (3-5% faster than the weight tiles first)
        _tile_loadd(4, w + k, K);
        _tile_loadd(6, x0 + k * 4, 64);
        _tile_dpbssd(0, 4, 6);
        if (TWO) {
            _tile_loadd(7, x1 + k * 4, 64);
            _tile_dpbssd(1, 4, 7);
        }
        _tile_loadd(5, w + 16 * K + k, K);
        _tile_dpbssd(2, 5, 6);
        if (TWO) _tile_dpbssd(3, 5, 7);
        if (pf)
            for (int64_t i = 0; i < per && line < pf_to; ++i, ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T1);
    }
    _tile_stored(0, C, 128);
    _tile_stored(2, C + 16 * 32, 128);
    if (TWO) {
        _tile_stored(1, C + 16, 128);
        _tile_stored(3, C + 16 * 32 + 16, 128);
    }
}

// out[m0 + j, n0 + r] from C[r][j] (C: 32 rows by 32 tokens; rows r < rows, tokens j < tokens): 16 x 16 blocks
// transposed, scaled, and each token's 32 outputs stored at once (a whole cache line in bf16: the rows of
// successive tokens lie N apart, often 4 KiB, and two half-line stores had their line evicted in between). bf16
// out: VCVTNE2PS2BF16 rounds to nearest even as c10::BFloat16 does, except that it reads subnormals as zero and
// keeps a NaN's sign and payload; a token's 32 values with neither take it (one instruction for the ~16 of the
// integer rounding and narrowing, the epilogue was a seventh of the kernel's time), the others the integer path.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static void w8_store_amx(const int32_t* C, int64_t rows, int64_t tokens, const float* xscale, const float* ws,
                         bool f32, void* out, int64_t N, int64_t n0, int64_t m0, bool stream) {
    __m512i r[16], lo[16], hi[16];
    const __mmask16 k0 = act_mask(rows), k1 = act_mask(rows - 16);
    const __m512 w0 = _mm512_maskz_loadu_ps(k0, ws + n0), w1 = _mm512_maskz_loadu_ps(k1, ws + n0 + 16);
    const __mmask32 k32 = rows >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << rows) - 1);
    for (int64_t j0 = 0; j0 < tokens; j0 += 16) {
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(C + i * 32 + j0);
        dq_transpose16(r, lo);
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(C + (16 + i) * 32 + j0);
        dq_transpose16(r, hi);
        for (int j = 0; j < 16 && j0 + j < tokens; ++j) {
            const int64_t m = m0 + j0 + j;
            const __m512 xs = _mm512_set1_ps(xscale[m]);
            const __m512 a = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo[j]), xs), w0);
            const __m512 b = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi[j]), xs), w1);
            if (f32) {
                float* o = static_cast<float*>(out) + m * N + n0;
                _mm512_mask_storeu_ps(o, k0, a);
                _mm512_mask_storeu_ps(o + 16, k1, b);
            } else if (!(_mm512_fpclass_ps_mask(a, 0xA1) | _mm512_fpclass_ps_mask(b, 0xA1))) {  // NaN, subnormal
                uint16_t* o = static_cast<uint16_t*>(out) + m * N + n0;
                const __m512i v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
                if (stream)
                    _mm512_stream_si512(reinterpret_cast<__m512i*>(o), v);
                else
                    _mm512_mask_storeu_epi16(o, k32, v);
            } else {
                const __m256i ha = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(dq_round_bf16_512(a)), 16));
                const __m256i hb = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(dq_round_bf16_512(b)), 16));
                uint16_t* o = static_cast<uint16_t*>(out) + m * N + n0;
                const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(ha), hb, 1);
                if (stream)
                    _mm512_stream_si512(reinterpret_cast<__m512i*>(o), v);
                else
                    _mm512_mask_storeu_epi16(o, k32, v);
            }
        }
    }
}

// Stage 3. Tokens a chunk at a time (W8_CHUNK bytes of codes, 32 to 1024 tokens: every tile of weight rows reads
// all of them, so they must stay in L2; at 5632 columns 512 tokens' codes did not, 0.85x bf16), each group of 16
// quantized and laid out as the tiles' operand; then 32 weight rows a tile (threads over tiles), read as stored,
// times two groups of tokens at a time over all of K (2 x 2 tiles: the most sums 8 tiles hold with each operand
// tile used twice), the sums stored and scaled right away.
//
// Why this shape (measured on a Sapphire Rapids core, one thread, 2048 x 2048, tokens in chunks of 256): each
// k-step loads 4 KiB (two weight tiles, two token tiles) for 64 cycles of TDPBSSD. TDPBSSD alone runs at its
// 1024 MACs a cycle; with every operand in L1, 80-100% of that; with the weight rows in L1 and the tokens streamed
// from L2, ~90%; this loop, both from L2, 50-57%: L2 to L1 carries ~36 B a cycle, so the loop is bound by L2 at
// about half of peak. Keeping one operand in L1 across pairs or tiles did not pay here:
//  * the stored rows of a tile cannot stay in L1 at K = 2048 (rows 2 KiB apart: the 32 rows of a step share two
//    sets, 16 lines a set for 12 ways), so K-blocking with the pairs inside a block of columns, sums reloaded,
//    ran slower (43-50%);
//  * a copy of the tile packed for the tiles (vector copy per block of 512 columns, or the first pair's weight
//    tiles stored packed with TILESTORED, the other pairs reading that copy from L1) ran 45-55%: slower at 32 to
//    128 tokens, +5% at best at 256 (a persistent packed weight, made once, would not pay the copy: left to a
//    later layout);
//  * the tokens of a pair kept in L1 across 4-8 weight tiles (weights streamed): 46-52%, the weight lines evict
//    them; software prefetches of the next steps' lines into L1: slower; the epilogue of a block run a few
//    units a step beside the next block's TDPBSSDs: no faster (slower on a loaded machine), so it is made cheap
//    instead (w8_store_amx).
constexpr int64_t W8_CHUNK = 512 << 10;
// Fewer tokens than this a chunk read all the weight's rows once more for each: at in = 5632 (64 tokens, 8 reads
// of 11 MiB at 512 tokens) that cost more than codes past 512 KiB in L2 (up to twice that: 0.77x the time at 512
// tokens, 0.87x at 128).
constexpr int64_t W8_CHUNK_TOKENS = 128;

static void w8_amx(const void* x, bool f32, const float* stat, int64_t flags, float* xscale, const int8_t* w,
                   const float* ws, void* out, int64_t M, int64_t N, int64_t K, int64_t threads) {
    const bool given = flags & 2;
    int64_t chunk = W8_CHUNK / K;
    if (chunk < W8_CHUNK_TOKENS) chunk = W8_CHUNK_TOKENS < 2 * W8_CHUNK / K ? W8_CHUNK_TOKENS : 2 * W8_CHUNK / K;
    chunk = chunk / 32 * 32;
    chunk = chunk < 32 ? 32 : chunk > 1024 ? 1024 : chunk;
    const int64_t mb = M < chunk ? M : chunk;
    int32_t* xv = static_cast<int32_t*>(w8_buffer(0, (mb + 15) / 16 * 16 * K));
    int8_t* codes = static_cast<int8_t*>(w8_buffer(1, 16 * K));
    // the last tile's rows, past N zero (a tile reads 32 rows)
    const int64_t tail = N % 32 ? N - N % 32 : N;
    int8_t* wt = N % 32 ? static_cast<int8_t*>(std::aligned_alloc(64, 32 * K)) : nullptr;
    if (wt) {
        std::memset(wt, 0, 32 * K);
        std::memcpy(wt, w + tail * K, (N - tail) * K);
    }
    const bool stream = !f32 && M * N * 2 >= (512 << 10) && reinterpret_cast<uintptr_t>(out) % 64 == 0 && N % 32 == 0;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t ms = M - m0 < chunk ? M - m0 : chunk, G = (ms + 15) / 16, pairs = (G + 1) / 2;
        for (int64_t g = 0; g < G; ++g) {  // quantized 16 tokens at a time, into their group of the operand
            const int64_t rows = ms - 16 * g < 16 ? ms - 16 * g : 16, m = m0 + 16 * g;
            const void* xg = f32 ? static_cast<const void*>(static_cast<const float*>(x) + m * K)
                                 : static_cast<const void*>(static_cast<const uint16_t*>(x) + m * K);
            w8_quantize(xg, f32, given ? stat + m : stat, flags, codes, xscale + m, rows, K, 2, 1);
            w8_group_amx(codes, rows, K, xv + g * (K / 4) * 16);
        }
        #pragma omp parallel num_threads(threads) if(threads > 1)
        {
            alignas(64) int32_t C[32 * 32];
            DqAmxScope amx;
            #pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += 32) {
                const int8_t* w0 = n0 == tail ? wt : w + n0 * K;
                const int64_t rows = N - n0 < 32 ? N - n0 : 32;
                // the next tile's stored rows (when whole), a share of them during each group of tokens
                const char* next = n0 + 64 <= N ? reinterpret_cast<const char*>(w + (n0 + 32) * K) : nullptr;
                const int64_t lines = 32 * K / 64;
                for (int64_t g = 0; g < G; g += 2) {
                    const int32_t* x0 = xv + g * (K / 4) * 16;
                    const int64_t from = lines * (g / 2) / pairs, to = lines * (g / 2 + 1) / pairs;
                    if (g + 1 < G)
                        w8_amx_block<true>(w0, K, x0, x0 + (K / 4) * 16, C, next, from, to);
                    else
                        w8_amx_block<false>(w0, K, x0, x0, C, next, from, to);
                    const int64_t tokens = ms - 16 * g < 32 ? ms - 16 * g : 32;
                    w8_store_amx(C, rows, tokens, xscale, ws, f32, out, N, n0, m0 + 16 * g, stream && rows == 32);
                }
            }
        }
    }
    if (stream) _mm_sfence();
    std::free(wt);
}
#endif  // DQ_AMX

static inline int64_t w8_best() {
    return w8_amx_int8() ? 4 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
}

extern "C" void kernel(const void* x, const float* stat, const int8_t* w, const float* ws, int8_t* codes,
                       float* xscale, const int32_t* acc, void* out, int64_t M, int64_t N, int64_t K, int64_t stage,
                       int64_t flags, int64_t max_level, int64_t threads, int64_t* level) {
    const int64_t best = w8_best();
    int64_t lvl = best < max_level ? best : max_level;
    if (stage == 3 && (lvl < 4 || K % 64)) lvl = 0;
    if ((stage == 1 || stage == 2 || stage == 4) && lvl > 2) lvl = 2;  // AVX-512 at most but the AMX linear
    level[0] = lvl;
    if (lvl <= 0 || M <= 0 || stage == 0) return;
    const bool f32 = flags & 1;
    if (stage == 1) w8_quantize(x, f32, stat, flags, codes, xscale, M, K, lvl, threads);
    if (stage == 4)
        for (int64_t m = 0; m < M; ++m) {
            const void* row = act_row(x, f32, m, K);
            xscale[m] = lvl >= 2 ? act_absmax_512(row, f32, K) : act_absmax_256(row, f32, K);
        }
    if (stage == 2) {
        if (lvl >= 2)
            w8_epilogue_512(acc, xscale, ws, f32, out, M, N);
        else
            w8_epilogue_256(acc, xscale, ws, f32, out, M, N);
    }
#if DQ_AMX
    if (stage == 3) w8_amx(x, f32, stat, flags, xscale, w, ws, out, M, N, K, threads);
#endif
}
