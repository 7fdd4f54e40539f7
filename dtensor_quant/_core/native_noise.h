// The counter-based noise of stochastic rounding (dtensor_quant/core/stochastic.py: uniform() gives the same bits):
// dq_noise(key, i, wide) is element i's number in [0, 1), dq_noise8 the numbers of 8 consecutive elements.
#pragma once
#include "native_prelude.h"

static inline uint32_t dq_fmix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x45D9F3Bu;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    return h ^ (h >> 16);
}

static inline float dq_unit(uint32_t h) { return float(int32_t(h >> 8)) * (1.0f / 16777216.0f); }

static inline float dq_noise(uint32_t key, uint64_t i, bool wide) {
    uint32_t h = dq_fmix(uint32_t(i) ^ key);
    return dq_unit(wide ? dq_fmix(h ^ uint32_t(i >> 32)) : h);
}

__attribute__((target("avx2")))
static inline __m256i dq_fmix8(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x45D9F3B));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x2C1B3C6D));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// The numbers of the 8 elements first .. first + 7 (dq_noise's bits).
__attribute__((target("avx2")))
static inline __m256 dq_noise8(uint32_t key, uint64_t first, bool wide) {
    const uint32_t lo = uint32_t(first);
    if (lo > 0xFFFFFFF7u) {  // the low 32 index bits wrap inside these 8: one at a time
        alignas(32) float u[8];
        for (int j = 0; j < 8; ++j) u[j] = dq_noise(key, first + uint64_t(j), wide);
        return _mm256_load_ps(u);
    }
    __m256i h = _mm256_add_epi32(_mm256_set1_epi32(int32_t(lo)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    h = dq_fmix8(_mm256_xor_si256(h, _mm256_set1_epi32(int32_t(key))));
    if (wide) h = dq_fmix8(_mm256_xor_si256(h, _mm256_set1_epi32(int32_t(uint32_t(first >> 32)))));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(1.0f / 16777216.0f));
}
