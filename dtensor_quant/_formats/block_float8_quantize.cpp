// Entry point of BlockFloat8's quantize (block_float8.h): float32 x [rows, cols] -> codes and block maxima.
#include "block_float8.h"

void kernel(const float* x, uint8_t* c, float* a, int64_t r, int64_t n, int64_t b, int64_t s, int64_t g, int64_t st,
            int64_t k, int64_t r0, int64_t c0, int64_t gc, int64_t w, int64_t* l) {
    quantize(x, c, a, r, n, b, s, g, st, k, r0, c0, gc, w, l);
}
