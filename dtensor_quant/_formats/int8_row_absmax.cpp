// Entry point of row_absmax (int8_rows.h): float32 x [rows, cols] -> out [rows].
#include "int8_rows.h"

void kernel(const float* x, float* o, int64_t r, int64_t c, int64_t* l) { row_absmax(x, o, r, c, l); }
