// Two one-pass helpers of Int8Rowwise's training path, the bits of their torch expressions: each row's largest
// |w| (NaN if any; block_reduce(w.abs(), 1, None, "max")) and float32 values float(q) * s (unpack into float32).
// int8_row_absmax.cpp and int8_values.cpp are their entry points.
#pragma once
#include "native_prelude.h"

__attribute__((target("avx2")))
static float dq_row_absmax_avx2(const float* x, int64_t n) {
    __m256 acc = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + j), mask);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        acc = _mm256_max_ps(acc, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float m = j > 0 ? 0.0f : -INFINITY;
    for (int l = 0; l < 8 && j > 0; ++l) m = lanes[l] > m ? lanes[l] : m;
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; j < n; ++j) {
        const float t = std::fabs(x[j]);
        if (t != t) any_nan = true;
        else if (t > m) m = t;
    }
    return any_nan ? NAN : m;
}

void row_absmax(const float* x, float* out, int64_t rows, int64_t cols, int64_t* level) {
    const bool avx2 = __builtin_cpu_supports("avx2");
    *level = 1;
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        if (avx2) {
            out[r] = dq_row_absmax_avx2(xr, cols);
            continue;
        }
        float m = -INFINITY;
        bool nan = false;
        for (int64_t j = 0; j < cols; ++j) {
            const float t = std::fabs(xr[j]);
            if (t != t) nan = true;
            else if (t > m) m = t;
        }
        out[r] = nan ? NAN : m;
    }
}

void dequant(const int8_t* q, const float* scale, float* out, int64_t rows, int64_t cols, int64_t* level) {
    *level = 1;
    for (int64_t r = 0; r < rows; ++r) {
        const float s = scale[r];
        for (int64_t j = 0; j < cols; ++j) out[r * cols + j] = float(q[r * cols + j]) * s;
    }
}
