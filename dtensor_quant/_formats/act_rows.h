// Helpers of the activation-quantizing kernels (int8_w8a8.cpp, float8_a8.cpp): a token row of bf16 or fp32
// activations read as fp32 (bf16 widened exactly), its largest |x| as torch's amax / amin give it, and its scale as
// the scheme takes it (dynamic, given by tensor parallelism, or static), so each kernel keeps only its codes.
#pragma once
#include "native_prelude.h"

static inline float act_x(const void* x, bool f32, int64_t i) {
    return f32 ? static_cast<const float*>(x)[i] : dq_bf16_float(static_cast<const uint16_t*>(x)[i]);
}

// 16 values of x at element i (bf16 widened exactly, or fp32), lanes of mask k (others 0).
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m512 act_load_512(const void* x, bool f32, int64_t i, __mmask16 k) {
    if (f32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(x) + i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(x) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The first min(left, 16) lanes (none for left <= 0).
static inline __mmask16 act_mask(int64_t left) {
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// max |x| of a row: NaN if it holds one, Inf if an Inf (torch's amax / amin propagate NaN). Taken on the magnitudes'
// bits as unsigned integers (their order is the values', NaN above Inf above the finite): one AND and one max a
// vector, 32 values a step for bf16.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static float act_absmax_512(const void* x, bool f32, int64_t K) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    uint32_t bits;
    if (f32) {
        const float* p = static_cast<const float*>(x);
        const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            a0 = _mm512_max_epu32(a0, _mm512_and_si512(_mm512_loadu_si512(p + k), mag));
            a1 = _mm512_max_epu32(a1, _mm512_and_si512(_mm512_loadu_si512(p + k + 16), mag));
        }
        for (; k < K; k += 16) a0 = _mm512_max_epu32(a0, _mm512_and_si512(_mm512_maskz_loadu_epi32(act_mask(K - k), p + k), mag));
        bits = _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1));
        if (bits > 0x7F800000u) return NAN;
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(x);
        const __m512i mag = _mm512_set1_epi16(0x7FFF);
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            a0 = _mm512_max_epu16(a0, _mm512_and_si512(_mm512_loadu_si512(p + k), mag));
            a1 = _mm512_max_epu16(a1, _mm512_and_si512(_mm512_loadu_si512(p + k + 32), mag));
        }
        for (; k < K; k += 32) {
            const __mmask32 m = K - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (K - k)) - 1);
            a0 = _mm512_max_epu16(a0, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, p + k), mag));
        }
        a0 = _mm512_max_epu16(a0, a1);
        bits = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(a0)),
                                                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(a0, 1))));
        if (bits > 0x7F80u) return NAN;
        bits <<= 16;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

__attribute__((target("avx2,fma")))
static inline __m256 act_load_256(const void* x, bool f32, int64_t i) {
    if (f32) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma")))
static float act_absmax_256(const void* x, bool f32, int64_t K) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 acc = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 a = _mm256_and_ps(act_load_256(x, f32, k), mask);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        acc = _mm256_max_ps(acc, a);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float m = 0.0f;
    for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; k < K; ++k) {
        const float a = std::fabs(act_x(x, f32, k));
        if (a != a) any_nan = true;
        else if (a > m) m = a;
    }
    return any_nan ? NAN : m;
}

// Row m of x [M, K] (bf16 or fp32).
static inline const void* act_row(const void* x, bool f32, int64_t m, int64_t K) {
    return f32 ? static_cast<const void*>(static_cast<const float*>(x) + m * K)
               : static_cast<const void*>(static_cast<const uint16_t*>(x) + m * K);
}

// The scale of token row m as the reference takes it (activations.quantize_activation), for a format whose largest
// code is qmax. The statistic, as the kernels' flags say: 2: amax[m] given in stat (tensor parallelism's reduced
// maxima); 4: a static scheme, s = stat[0] (the input scale), NaN for a row holding a NaN or an Inf; else the row's
// own max |x| (level >= 2: AVX-512, else AVX2). A dynamic s is amax == 0 ? 1 : amax / qmax (a true division).
static inline float act_row_scale(const void* row, bool f32, int64_t K, const float* stat, int64_t flags, int64_t m,
                                  int64_t level, float qmax) {
    const float amax = flags & 2 ? stat[m] : level >= 2 ? act_absmax_512(row, f32, K) : act_absmax_256(row, f32, K);
    if (flags & 4) return std::isfinite(amax) ? stat[0] : NAN;
    return amax == 0.0f ? 1.0f : amax / qmax;
}
