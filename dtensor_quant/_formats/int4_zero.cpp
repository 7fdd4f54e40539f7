// Int4GroupwiseIntZero's kernels (dtensor_quant/formats/int4_zero.py loads them through dtensor_quant/core/native.py).
// Every weight is dequantize's: scale_dtype((c - z) * s) -- (c - z) * s is exact in fp32, fp16 scales round there
// first -- rounded to bf16 for bf16 activations (or a bf16 scale); only the order of the fp32 sum differs from
// dequantize + mm.
//
// One token (decode): per group, the 16 weights its codes can stand for in one AVX-512 register (two with AVX2);
// each code picks its weight with a permute and an FMA adds weight * x in fp32. The codes are read once, at memory
// speed; no dense weight is written. Several tokens: native_tiles.h's tiled matmul, a row at a time from the same
// 16-weight tables (with AVX-512 BF16, vpermw picks 32 bf16 weights at once).
#include "int4_rows.h"

__attribute__((target("avx512f,avx512bw,f16c")))
static float dq_i4z_row(const uint8_t* row, const float* scale, const float* zero, const float* xe, const float* xo,
                        int64_t K, int64_t g, int64_t half) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i mask = _mm512_set1_epi32(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / g; ++b) {
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(zero[b])), _mm512_set1_ps(scale[b]));
        if (half) t = _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512 table = dq_round_bf16_512(t);
        for (int64_t i = b * g / 2; i < (b + 1) * g / 2; i += 16) {  // 16 bytes: 32 weights
            DQ_PREFETCH_AHEAD(row + i);
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
            __m512 low = _mm512_permutexvar_ps(_mm512_and_si512(codes, mask), table);  // weight 2j
            __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);  // weight 2j + 1
            acc0 = _mm512_fmadd_ps(low, _mm512_loadu_ps(xe + i), acc0);
            acc1 = _mm512_fmadd_ps(high, _mm512_loadu_ps(xo + i), acc1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// The same with AVX2: the 16 weights in two registers, a code's bit 3 picks between them.
__attribute__((target("avx2,fma,f16c")))
static float dq_i4z_row_avx2(const uint8_t* row, const float* scale, const float* zero, const float* xe,
                             const float* xo, int64_t K, int64_t g, int64_t half) {
    const __m256 iota0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), iota1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i mask = _mm256_set1_epi32(15);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / g; ++b) {
        const __m256 s = _mm256_set1_ps(scale[b]), z = _mm256_set1_ps(zero[b]);
        __m256 t0 = _mm256_mul_ps(_mm256_sub_ps(iota0, z), s), t1 = _mm256_mul_ps(_mm256_sub_ps(iota1, z), s);
        if (half) {
            t0 = _mm256_cvtph_ps(_mm256_cvtps_ph(t0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            t1 = _mm256_cvtph_ps(_mm256_cvtps_ph(t1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        t0 = dq_round_bf16_256(t0);
        t1 = dq_round_bf16_256(t1);
        for (int64_t i = b * g / 2; i < (b + 1) * g / 2; i += 8) {  // 8 bytes: 16 weights
            DQ_PREFETCH_AHEAD(row + i);
            __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
            __m256i lo = _mm256_and_si256(codes, mask), hi = _mm256_srli_epi32(codes, 4);
            __m256 low = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
            __m256 high = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
            acc0 = _mm256_fmadd_ps(low, _mm256_loadu_ps(xe + i), acc0);
            acc1 = _mm256_fmadd_ps(high, _mm256_loadu_ps(xo + i), acc1);
        }
    }
    return dq_sum_256(_mm256_add_ps(acc0, acc1));
}

// The one-token kernel. level 1: AVX2, 2: AVX-512. scale, zero: [N, K / g] in fp32; half: round each product to
// fp16 first.
static void dq_i4z(const uint8_t* codes, const float* scale, const float* zero, const uint16_t* x, uint16_t* out,
                   int64_t M, int64_t N, int64_t K, int64_t g, int64_t half, int64_t lvl, int64_t threads) {
    int64_t level[1] = {lvl};
    float* xs = new float[K];  // x's even elements (the low nibbles'), then its odd ones
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t i = 0; i < K / 2; ++i) {
            xs[i] = dq_bf16_float(x[m * K + 2 * i]);
            xs[K / 2 + i] = dq_bf16_float(x[m * K + 2 * i + 1]);
        }
        #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* row = codes + n * (K / 2);
            const float* s = scale + n * (K / g);
            const float* z = zero + n * (K / g);
            float acc = level[0] >= 2 ? dq_i4z_row(row, s, z, xs, xs + K / 2, K, g, half)
                                      : dq_i4z_row_avx2(row, s, z, xs, xs + K / 2, K, g, half);
            out[m * N + n] = dq_bf16_rne(acc);
        }
    }
    delete[] xs;
}

// Int4GroupwiseIntZero's 16 weights of a group for the row writers of int4_rows.h: (c - z) * s, exact in fp32,
// rounded to fp16 first for fp16 scales (half).
struct Int4ZeroRows : Int4RowWriters<Int4ZeroRows> {
    bool half;

    __attribute__((target("avx512f,avx512bw")))
    __m512 table(float s, float z) const {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_set1_ps(s));
        return half ? _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) : t;
    }

    __attribute__((target("avx2,fma,f16c")))
    void table(float s, float z, __m256& t0, __m256& t1) const {
        const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
        t0 = _mm256_mul_ps(_mm256_sub_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vz), vs);
        t1 = _mm256_mul_ps(_mm256_sub_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), vz), vs);
        if (half) {
            t0 = _mm256_cvtph_ps(_mm256_cvtps_ph(t0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            t1 = _mm256_cvtph_ps(_mm256_cvtps_ph(t1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
};

// flags: 1: x and out are fp32 (else bf16); 2: several tokens, through the tiles (else the one-token kernel, bf16
// only); 4: round every weight to bf16. Level 1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX (the tiles only); all
// with F16C.
// Called with M = 0 it only reports the best level here.
extern "C" void kernel(const uint8_t* codes, const float* scale, const float* zero, const void* x, void* out,
                       int64_t M, int64_t N, int64_t K, int64_t g, int64_t half, int64_t flags, int64_t max_level,
                       int64_t threads, int64_t* level) {
    const bool tiles = flags & 2, f16c = __builtin_cpu_supports("f16c");
    int64_t best = g % 32 || K % 32 || !f16c ? 0 : dq_tiles_best();
    if (!tiles && best > 2) best = 2;
    level[0] = best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    if (tiles)
        dq_tiles(Int4ZeroRows{{codes, scale, zero, K, g}, half != 0}, x, out, M, N, K, flags & 1, flags & 4, level[0],
                 threads);
    else if (!(flags & 1))
        dq_i4z(codes, scale, zero, static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), M, N, K, g, half,
               level[0], threads);
    else
        level[0] = 0;
}
