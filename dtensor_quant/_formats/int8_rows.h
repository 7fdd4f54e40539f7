// Two one-pass helpers of Int8Rowwise's training path, the bits of their torch expressions: each row's largest
// finite |w| (NaN if any; block_reduce(block_stat_abs(w), 1, None, "max")) and float32 values float(q) * s (unpack into float32).
// int8_row_absmax.cpp and int8_values.cpp are their entry points.
#pragma once
#include "native_prelude.h"

void row_absmax(const float* x, float* out, int64_t rows, int64_t cols, int64_t* level) {
    const bool avx2 = __builtin_cpu_supports("avx2");
    *level = 1;
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        if (avx2) {
            out[r] = dq_absmax_avx2(xr, cols, 0.0f, true);
            continue;
        }
        float m = -INFINITY;
        bool nan = false;
        for (int64_t j = 0; j < cols; ++j) {
            float t = std::fabs(xr[j]);
            t = t == INFINITY ? 0.0f : t;  // an Inf saturates; it does not set the row's scale
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
