// BlockFloat8's two kernels (dtensor_quant/formats/block_states.py): the torch expressions of quantize and unpack,
// one pass each, the same bits. block_float8_quantize.cpp and block_float8_unpack.cpp are their entry points.
#pragma once
#include "native_noise.h"

// Round to nearest even without a data-dependent branch (random data would mispredict every one): a normal
// value keeps its top fraction bits, rounded at the first dropped one by the carry of an add, and is rebiased;
// a subnormal one is rounded by the FPU (adding 2^23 leaves no fraction bits, under round-to-nearest-even).
// e4m3fn: bias 7, 3 fraction bits, subnormals below 2^-6 (multiples of 2^-9); NaN for NaN; |x| >= 464 (an Inf
// element: finite ones are within 448 and an ulp) saturates to +-448, as torch's conversion does.
static inline uint8_t dq_e4m3(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFFu;
    float f;
    std::memcpy(&f, &a, 4);
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1)) >> 20) - (120u << 3);
    const uint32_t sub = uint32_t((f * 512.0f + 0x1p23f) - 0x1p23f);
    uint32_t code = f < 0x1p-6f ? sub : normal;
    code = f < 464.0f ? code : 0x7Eu;
    code = f == f ? code : 0x7Fu;
    return uint8_t(sign | code);
}

// e5m2: bias 15, 2 fraction bits, subnormals below 2^-14 (multiples of 2^-16); inf from 61440, NaN for NaN.
static inline uint8_t dq_e5m2(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFFu;
    float f;
    std::memcpy(&f, &a, 4);
    const uint32_t normal = ((a + 0xFFFFFu + ((a >> 21) & 1)) >> 21) - (112u << 2);
    const uint32_t sub = uint32_t((f * 65536.0f + 0x1p23f) - 0x1p23f);
    uint32_t code = f < 0x1p-14f ? sub : normal;
    code = f < 61440.0f ? code : 0x7Cu;
    code = f == f ? code : 0x7Fu;
    return uint8_t(sign | code);
}

// Stochastic rounding of the same codes with noise u in [0, 1): a normal value adds the top k bits of u to the k
// fraction bits it drops, then drops them (it rounds up with probability their value); a subnormal one is
// floor(x / 2^-s + u). The largest finite code caps it (a value an ulp above the maximum stays on it); an Inf
// stays Inf in e5m2 (its neighbours are Inf) and saturates in e4m3fn, as the nearest rounding does.
static inline uint8_t dq_f8_sr(float x, float u, bool e5m2) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint32_t sign = (bits >> 24) & 0x80, a = bits & 0x7FFFFFFFu;
    float f;
    std::memcpy(&f, &a, 4);
    const int k = e5m2 ? 21 : 20;
    const uint32_t r = uint32_t(u * float(1u << k));  // exact: u has 24 bits
    const uint32_t normal = ((a + r) >> k) - (e5m2 ? (112u << 2) : (120u << 3));
    const uint32_t sub = uint32_t(std::floor(f * (e5m2 ? 65536.0f : 512.0f) + u));
    uint32_t code = f < (e5m2 ? 0x1p-14f : 0x1p-6f) ? sub : normal;
    const uint32_t top = e5m2 ? 0x7Bu : 0x7Eu;
    code = code < top ? code : top;
    code = (e5m2 && f == INFINITY) ? 0x7Cu : code;
    code = f == f ? code : 0x7Fu;
    return uint8_t(sign | code);
}

// The encoders on 8 lanes (AVX2): the same integer and float operations, lane by lane.
__attribute__((target("avx2")))
static inline __m256i dq_f8_rne8(__m256 y, bool e5m2) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256 f = _mm256_castsi256_ps(a);
    const int k = e5m2 ? 21 : 20;
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, k), _mm256_set1_epi32(1));
    const __m256i half = _mm256_set1_epi32(e5m2 ? 0xFFFFF : 0x7FFFF);
    __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, half), odd), k);
    normal = _mm256_sub_epi32(normal, _mm256_set1_epi32(e5m2 ? (112 << 2) : (120 << 3)));
    const __m256 magic = _mm256_set1_ps(0x1p23f);
    const __m256 t = _mm256_mul_ps(f, _mm256_set1_ps(e5m2 ? 65536.0f : 512.0f));
    const __m256i sub = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, magic), magic));
    const __m256 is_sub = _mm256_cmp_ps(f, _mm256_set1_ps(e5m2 ? 0x1p-14f : 0x1p-6f), _CMP_LT_OQ);
    __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(is_sub));
    const __m256 finite = _mm256_cmp_ps(f, _mm256_set1_ps(e5m2 ? 61440.0f : 464.0f), _CMP_LT_OQ);
    code = _mm256_blendv_epi8(_mm256_set1_epi32(e5m2 ? 0x7C : 0x7E), code, _mm256_castps_si256(finite));
    const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(nan));
    return _mm256_or_si256(code, sign);
}

__attribute__((target("avx2")))
static inline __m256i dq_f8_sr8(__m256 y, __m256 noise, bool e5m2) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256 f = _mm256_castsi256_ps(a);
    const int k = e5m2 ? 21 : 20;
    const __m256i r = _mm256_cvttps_epi32(_mm256_mul_ps(noise, _mm256_set1_ps(float(1u << k))));
    __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(a, r), k);
    normal = _mm256_sub_epi32(normal, _mm256_set1_epi32(e5m2 ? (112 << 2) : (120 << 3)));
    const __m256 t = _mm256_mul_ps(f, _mm256_set1_ps(e5m2 ? 65536.0f : 512.0f));
    const __m256i sub = _mm256_cvttps_epi32(_mm256_floor_ps(_mm256_add_ps(t, noise)));
    const __m256 is_sub = _mm256_cmp_ps(f, _mm256_set1_ps(e5m2 ? 0x1p-14f : 0x1p-6f), _CMP_LT_OQ);
    __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(is_sub));
    code = _mm256_min_epi32(code, _mm256_set1_epi32(e5m2 ? 0x7B : 0x7E));
    if (e5m2) {
        const __m256 inf = _mm256_cmp_ps(f, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ);
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7C), _mm256_castps_si256(inf));
    }
    const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(nan));
    return _mm256_or_si256(code, sign);
}

__attribute__((target("avx2")))
static inline void dq_store8(uint8_t* o, __m256i code) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o), _mm_packus_epi16(w, w));
}

// Codes of the whole groups of 8 of a block; returns how many it wrote.
__attribute__((target("avx2")))
static int64_t dq_encode_avx2(const float* x, uint8_t* o, int64_t n, float pre, float factor, float tiny, bool nonneg,
                              bool stochastic, uint32_t key, uint64_t first, bool wide) {
    const __m256 fv = _mm256_set1_ps(factor), tv = _mm256_set1_ps(tiny), pv = _mm256_set1_ps(pre);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 xv = _mm256_loadu_ps(x + j);
        if (pre != 1.0f) xv = _mm256_mul_ps(xv, pv);  // exact: a power of two on values below 2^-64
        __m256 y = _mm256_mul_ps(xv, fv);
        if (nonneg) y = _mm256_max_ps(tv, y);  // max(tiny, y): y where y is NaN, as clamp keeps it
        const __m256i code = stochastic ? dq_f8_sr8(y, dq_noise8(key, first + uint64_t(j), wide), nonneg)
                                        : dq_f8_rne8(y, nonneg);
        dq_store8(o + j, code);
    }
    return j;
}

// codes <- x [rows, cols] in blocks of `block` columns, each scaled by top / its absmax; with given = 0 the absmax
// is computed first (the block's largest finite |x|, at least 2^-149 if it holds an Inf; NaN skipped). A block
// whose absmax is below 2^-64 is first multiplied by 2^64 (exact), so top / absmax never overflows (the torch
// expression BlockFloat8._scaled does the same). nonneg: e5m2 codes, never below tiny. stochastic:
// rounded with the noise of each element's index in the whole state (row0, col0: this block's place in it).
void quantize(const float* x, uint8_t* codes, float* absmax, int64_t rows, int64_t cols, int64_t block,
              int64_t nonneg, int64_t given, int64_t stochastic, int64_t key, int64_t row0, int64_t col0,
              int64_t gcols, int64_t wide, int64_t* level) {
    const bool avx2 = __builtin_cpu_supports("avx2");
    *level = 1;
    const int64_t nb = (cols + block - 1) / block;
    const float top = nonneg ? 57344.0f : 448.0f, tiny = nonneg ? 0x1p-16f : 0x1p-9f;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t c0 = b * block, n = std::min(block, cols - c0);
            const float* xr = x + r * cols + c0;
            float amax = -INFINITY;
            if (given) {
                amax = absmax[r * nb + b];
            } else if (avx2) {
                absmax[r * nb + b] = amax = dq_absmax_avx2(xr, n, 0x1p-149f, false);
            } else {
                for (int64_t j = 0; j < n; ++j) {
                    float t = std::fabs(xr[j]);
                    t = t == INFINITY ? 0x1p-149f : t;
                    if (t > amax) amax = t;  // NaN compares false: skipped
                }
                absmax[r * nb + b] = amax;
            }
            const float pre = amax < 0x1p-64f ? 0x1p64f : 1.0f;
            const float scaled = amax * pre;
            const float factor = scaled > 0.0f ? (1.0f / scaled) * top : 0.0f;  // top / absmax as torch computes it
            uint8_t* o = codes + r * cols + c0;
            const uint64_t first = uint64_t(row0 + r) * uint64_t(gcols) + uint64_t(col0 + c0);
            int64_t j = 0;
            if (avx2) j = dq_encode_avx2(xr, o, n, pre, factor, tiny, nonneg != 0, stochastic != 0, uint32_t(key), first,
                                         wide != 0);
            for (; j < n; ++j) {
                float y = (xr[j] * pre) * factor;
                if (nonneg) y = y < tiny ? tiny : y;  // clamp(min=tiny) keeps NaN
                if (stochastic) o[j] = dq_f8_sr(y, dq_noise(uint32_t(key), first + uint64_t(j), wide != 0), nonneg);
                else o[j] = nonneg ? dq_e5m2(y) : dq_e4m3(y);
            }
        }
    }
}

// out [rows, cols] <- values[codes] * (absmax / top); a block whose absmax is below 2^-64 computes
// (values[codes] * (absmax * 2^64 / top)) * 2^-64, which rounds once into the subnormals.
void unpack(const uint8_t* codes, const float* absmax, const float* values, float* out, int64_t rows,
            int64_t cols, int64_t block, int64_t nonneg, int64_t* level) {
    *level = 1;
    const int64_t nb = (cols + block - 1) / block;
    const float top = nonneg ? 57344.0f : 448.0f;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t c0 = b * block, n = std::min(block, cols - c0);
            const float a = absmax[r * nb + b];
            const float pre = a < 0x1p-64f ? 0x1p64f : 1.0f;
            const float s = (a * pre) / top;
            const uint8_t* cr = codes + r * cols + c0;
            float* o = out + r * cols + c0;
            if (pre == 1.0f) {
                for (int64_t j = 0; j < n; ++j) o[j] = values[cr[j]] * s;
            } else {
                for (int64_t j = 0; j < n; ++j) o[j] = (values[cr[j]] * s) * 0x1p-64f;
            }
        }
    }
}
