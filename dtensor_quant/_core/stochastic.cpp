// The noise of stochastic rounding for a block of a weight (dtensor_quant/core/stochastic.py loads it through
// dtensor_quant/core/native.py): element (r, c) of the block draws dq_noise of its global index.
#include "native_noise.h"
// One row: element j has global index first + j.
static void dq_noise_row(float* out, int64_t n, uint64_t first, uint32_t key, bool wide) {
    for (int64_t j = 0; j < n; ++j) out[j] = dq_noise(key, first + uint64_t(j), wide);
}

// 8 elements at a time.
__attribute__((target("avx2")))
static void dq_noise_row_avx2(float* out, int64_t n, uint64_t first, uint32_t key, bool wide) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, dq_noise8(key, first + uint64_t(j), wide));
    dq_noise_row(out + j, n - j, first + uint64_t(j), key, wide);
}

// out: a contiguous float32 [rows, cols] block at (row0, col0) of a weight whose rows have gcols elements.
void kernel(float* out, int64_t key, int64_t row0, int64_t col0, int64_t gcols, int64_t wide,
            int64_t rows, int64_t cols, int64_t* level) {
    bool avx2 = __builtin_cpu_supports("avx2");
    *level = avx2 ? 1 : 0;
    for (int64_t r = 0; r < rows; ++r) {
        uint64_t first = uint64_t(row0 + r) * uint64_t(gcols) + uint64_t(col0);
        if (avx2) dq_noise_row_avx2(out + r * cols, cols, first, uint32_t(key), wide != 0);
        else dq_noise_row(out + r * cols, cols, first, uint32_t(key), wide != 0);
    }
}
