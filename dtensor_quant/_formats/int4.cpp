// Int4Groupwise's multi-token kernel (dtensor_quant/formats/int4.py loads it through dtensor_quant/core/native.py;
// one token takes torch's own int4 kernel). Every weight is Int4Groupwise.dequantize's: (code - 8) * scale, then
// + zero, each rounded in fp32 (a multiply, then an add: never fused), rounded to bf16 for bf16 activations; only
// the order of the fp32 sum differs from dequantize + mm. The tiled matmul is native_tiles.h's; a group's 16
// possible weights are computed once and each code picks its own (vpermw: 32 bf16 weights at once; vpermps).
#include "int4_rows.h"

// Int4Groupwise's 16 weights of a group for the row writers of int4_rows.h: (code - 8) * s + z.
struct Int4Rows : Int4RowWriters<Int4Rows> {
    // The empty asm keeps the product its own rounding (no FMA).
    __attribute__((target("avx512f,avx512bw")))
    __m512 table(float s, float z) const {
        const __m512 c = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
        __m512 p = _mm512_mul_ps(c, _mm512_set1_ps(s));
        __asm__("" : "+v"(p));
        return _mm512_add_ps(p, _mm512_set1_ps(z));
    }

    __attribute__((target("avx2,fma,f16c")))
    void table(float s, float z, __m256& t0, __m256& t1) const {
        __m256 p0 = _mm256_mul_ps(_mm256_set_ps(-1, -2, -3, -4, -5, -6, -7, -8), _mm256_set1_ps(s));
        __m256 p1 = _mm256_mul_ps(_mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_ps(s));
        __asm__("" : "+x"(p0), "+x"(p1));
        t0 = _mm256_add_ps(p0, _mm256_set1_ps(z));
        t1 = _mm256_add_ps(p1, _mm256_set1_ps(z));
    }
};

// flags: 1: x and out are fp32 (else bf16); 2: the tiles (the only path here); 4: round every weight to bf16.
// Level 1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX. Called with M = 0 it only reports the best level here.
extern "C" void kernel(const uint8_t* codes, const float* scale, const float* zero, const void* x, void* out,
                       int64_t M, int64_t N, int64_t K, int64_t g, int64_t flags, int64_t max_level, int64_t threads,
                       int64_t* level) {
    int64_t best = K % 32 || g % 32 || K % g ? 0 : dq_tiles_best();
    level[0] = !(flags & 2) ? 0 : best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    dq_tiles(Int4Rows{{codes, scale, zero, K, g}}, x, out, M, N, K, flags & 1, flags & 4, level[0], threads);
}
