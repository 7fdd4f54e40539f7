// NF4's fused one-token kernel (dtensor_quant/formats/nf4.py loads it through dtensor_quant/native.py).
// Each block's 16 weights bf16(level * scale) are one AVX-512 register (two with AVX2), each code picks its
// weight with vpermps, an FMA adds weight * x in fp32. The codes are read once, at memory speed; no dense
// weight is ever written.
#include "native_prelude.h"
// out[m, n] = bf16(sum_k x[m, k] * w[n, k]), w[n, k] = bf16(level[code] * scale[n, k / bs]): NF4.dequantize's values.
__attribute__((target("avx512f,avx512bw")))
static float dq_nf4_row(const uint8_t* row, const float* scale, const float* xe, const float* xo, const float* levels,
                        int64_t K, int64_t bs) {
    const __m512 lv = _mm512_loadu_ps(levels);
    const __m512i mask = _mm512_set1_epi32(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / bs; ++b) {
        __m512 table = dq_round_bf16_512(_mm512_mul_ps(lv, _mm512_set1_ps(scale[b])));  // the block's 16 weights
        for (int64_t i = b * bs / 2; i < (b + 1) * bs / 2; i += 16) {  // 16 bytes: 32 weights
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
            __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);  // weight 2j
            __m512 low = _mm512_permutexvar_ps(_mm512_and_si512(codes, mask), table);  // weight 2j + 1
            acc0 = _mm512_fmadd_ps(high, _mm512_loadu_ps(xe + i), acc0);
            acc1 = _mm512_fmadd_ps(low, _mm512_loadu_ps(xo + i), acc1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// The same with AVX2: the 16 weights in two registers, a code's bit 3 picks between them.
__attribute__((target("avx2,fma")))
static float dq_nf4_row_avx2(const uint8_t* row, const float* scale, const float* xe, const float* xo,
                             const float* levels, int64_t K, int64_t bs) {
    const __m256 lv0 = _mm256_loadu_ps(levels), lv1 = _mm256_loadu_ps(levels + 8);
    const __m256i mask = _mm256_set1_epi32(15);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / bs; ++b) {
        const __m256 s = _mm256_set1_ps(scale[b]);
        const __m256 t0 = dq_round_bf16_256(_mm256_mul_ps(lv0, s)), t1 = dq_round_bf16_256(_mm256_mul_ps(lv1, s));
        for (int64_t i = b * bs / 2; i < (b + 1) * bs / 2; i += 8) {  // 8 bytes: 16 weights
            __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
            __m256i hi = _mm256_srli_epi32(codes, 4), lo = _mm256_and_si256(codes, mask);
            __m256 high = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
            __m256 low = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
            acc0 = _mm256_fmadd_ps(high, _mm256_loadu_ps(xe + i), acc0);
            acc1 = _mm256_fmadd_ps(low, _mm256_loadu_ps(xo + i), acc1);
        }
    }
    return dq_sum_256(_mm256_add_ps(acc0, acc1));
}

// level 1: AVX2, 2: AVX-512.
static void dq_nf4(const uint8_t* codes, const float* scale, const float* levels, const uint16_t* x, uint16_t* out,
                   int64_t M, int64_t N, int64_t K, int64_t bs, int64_t level, int64_t threads) {
    float* xs = new float[K];  // x's even elements (the high nibbles'), then its odd ones
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t i = 0; i < K / 2; ++i) {
            xs[i] = dq_bf16_float(x[m * K + 2 * i]);
            xs[K / 2 + i] = dq_bf16_float(x[m * K + 2 * i + 1]);
        }
        #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* row = codes + n * (K / 2);
            const float* s = scale + n * (K / bs);
            float acc = level >= 2 ? dq_nf4_row(row, s, xs, xs + K / 2, levels, K, bs)
                                   : dq_nf4_row_avx2(row, s, xs, xs + K / 2, levels, K, bs);
            out[m * N + n] = dq_bf16_rne(acc);
        }
    }
    delete[] xs;
}

extern "C" void kernel(const uint8_t* codes, const float* scale, const float* levels, const uint16_t* x,
                       uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t bs, int64_t max_level,
                       int64_t threads, int64_t* level) {
    int64_t best = bs % 32 ? 0 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
    level[0] = best < max_level ? best : max_level;
    if (level[0] > 0 && M > 0) dq_nf4(codes, scale, levels, x, out, M, N, K, bs, level[0], threads);
}
