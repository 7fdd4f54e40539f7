// Helpers of the activation-quantizing kernels (int8_w8a8.cpp, float8_a8.cpp): a token row of bf16 or fp32
// activations read as fp32 (bf16 widened exactly), and its largest |x| as torch's amax / amin give it.
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

// max |x| of a row: NaN if it holds one, Inf if an Inf (torch's amax / amin propagate NaN).
__attribute__((target("avx512f,avx512bw,avx512vl")))
static float act_absmax_512(const void* x, bool f32, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 a = _mm512_abs_ps(act_load_512(x, f32, k, act_mask(K - k)));
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        acc = _mm512_max_ps(acc, a);
    }
    return nan ? NAN : _mm512_reduce_max_ps(acc);
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

