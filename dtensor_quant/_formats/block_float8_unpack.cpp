// Entry point of BlockFloat8's unpack (block_float8.h): codes and block maxima -> float32 values.
#include "block_float8.h"

void kernel(const uint8_t* c, const float* a, const float* t, float* o, int64_t r, int64_t n, int64_t b, int64_t s,
            int64_t* l) {
    unpack(c, a, t, o, r, n, b, s, l);
}
