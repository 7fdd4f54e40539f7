// Int8Rowwise.quantize_stochastic in one pass (dtensor_quant/formats/int8.py loads it through
// dtensor_quant/core/native.py): floor(u + w / s) clamped to +-127 (NaN to 0), u the noise of each element's
// global index -- the torch expression's bits (addcdiv divides, then adds).
#include "native_noise.h"
static inline int8_t dq_sr_code(float w, float s, float u) {
    float v = std::floor(u + w / s);
    v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
    return v == v ? int8_t(v) : 0;
}

// 8 codes a step: the same divide, add, floor and clamp in vector lanes.
__attribute__((target("avx2")))
static void dq_sr_row_avx2(const float* w, float s, int8_t* o, int64_t n, uint32_t key, uint64_t first, bool wide) {
    const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 u = dq_noise8(key, first + uint64_t(c), wide);
        __m256 v = _mm256_floor_ps(_mm256_add_ps(u, _mm256_div_ps(_mm256_loadu_ps(w + c), sv)));
        const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        v = _mm256_blendv_ps(v, _mm256_setzero_ps(), nan);
        const __m256i q = _mm256_cvttps_epi32(v);
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(o + c), _mm_packs_epi16(q16, q16));
    }
    for (; c < n; ++c) o[c] = dq_sr_code(w[c], s, dq_noise(key, first + uint64_t(c), wide));
}

void kernel(const float* w, const float* scale, int8_t* out, int64_t rows, int64_t cols, int64_t key,
            int64_t row0, int64_t col0, int64_t gcols, int64_t wide, int64_t* level) {
    const bool avx2 = __builtin_cpu_supports("avx2");
    *level = 1;
    for (int64_t r = 0; r < rows; ++r) {
        const float s = scale[r];
        const uint64_t first = uint64_t(row0 + r) * uint64_t(gcols) + uint64_t(col0);
        const float* wr = w + r * cols;
        int8_t* o = out + r * cols;
        if (avx2) {
            dq_sr_row_avx2(wr, s, o, cols, uint32_t(key), first, wide != 0);
        } else {
            for (int64_t c = 0; c < cols; ++c) {
                o[c] = dq_sr_code(wr[c], s, dq_noise(uint32_t(key), first + uint64_t(c), wide != 0));
            }
        }
    }
}
