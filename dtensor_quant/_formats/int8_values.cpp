// Entry point of dequant (int8_rows.h): int8 codes [rows, cols] and float32 row scales -> float32 values.
#include "int8_rows.h"

void kernel(const int8_t* q, const float* s, float* o, int64_t r, int64_t c, int64_t* l) { dequant(q, s, o, r, c, l); }
