// NF4's kernels (dtensor_quant/formats/nf4.py loads them through dtensor_quant/core/native.py). Every weight is
// NF4.dequantize's: w[n, k] = level[code] * scale[n, k / bs] in fp32, rounded to bf16 where dequantize rounds
// (a bf16 weight, or bf16 activations); only the order of the fp32 sum differs from dequantize + mm.
//
// One token (decode): each block's 16 weights are one AVX-512 register (two with AVX2), each code picks its
// weight with vpermps, an FMA adds weight * x in fp32. The codes are read once per token, at memory speed; no
// dense weight is ever written.
//
// Several tokens (prefill, batches, experts): native_tiles.h's tiled matmul, each row of a tile written from a
// block's 16 weights the same way (with AVX-512 BF16, vpermw picks 32 bf16 weights at once).
#include "native_prelude.h"
#include "native_tiles.h"

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
            DQ_PREFETCH_AHEAD(row + i);
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
            DQ_PREFETCH_AHEAD(row + i);
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

// Row n of the weight for native_tiles.h: in each chunk of 32 columns, the 16 high nibbles' weights (the even
// columns), then the 16 low nibbles' (the odd ones).
struct Nf4Rows {
    const uint8_t* codes;  // [N, K / 2]
    const float* scale;    // [N, K / bs]: each block's scale
    const float* levels;   // the 16 levels
    int64_t K, bs;

    static int64_t perm(int64_t p) { return p < 16 ? 2 * p : 2 * (p - 16) + 1; }

    __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
    bool bf16(int64_t n, int64_t k0, int64_t kc, uint16_t* dst) const {
        const uint8_t* row = codes + n * (K / 2);
        const float* s = scale + n * (K / bs);
        const __m512 lv = _mm512_loadu_ps(levels);
        const __m256i mask = _mm256_set1_epi16(15);
        dst -= k0;
        __mmask16 bad = 0;
        for (DqGroups bl(k0, kc, bs); bl.more(); bl.next()) {
            const __m512 t = _mm512_mul_ps(lv, _mm512_set1_ps(s[bl.b]));  // the block's 16 weights
            bad |= dq_bf16_unsafe_512(t);
            const __m512i words = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
            for (int64_t k = bl.k; k < bl.end; k += 32) {  // 16 bytes: the 16 high nibbles, then the low ones
                DQ_PREFETCH_AHEAD(row + k / 2);
                const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
                const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(c, 4)),
                                                       _mm256_and_si256(c, mask), 1);
                _mm512_storeu_si512(dst + k, _mm512_permutexvar_epi16(idx, words));
            }
        }
        return bad == 0;
    }

    __attribute__((target("avx512f,avx512bw")))
    void f32_512(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const uint8_t* row = codes + n * (K / 2);
        const float* s = scale + n * (K / bs);
        const __m512 lv = _mm512_loadu_ps(levels);
        const __m512i mask = _mm512_set1_epi32(15);
        dst -= k0;
        for (DqGroups bl(k0, kc, bs); bl.more(); bl.next()) {
            __m512 t = _mm512_mul_ps(lv, _mm512_set1_ps(s[bl.b]));
            if (round) t = dq_round_bf16_512(t);
            for (int64_t k = bl.k; k < bl.end; k += 32) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
                _mm512_storeu_ps(dst + k, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t));
                _mm512_storeu_ps(dst + k + 16, _mm512_permutexvar_ps(_mm512_and_si512(c, mask), t));
            }
        }
    }

    __attribute__((target("avx2,fma")))
    void f32_256(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const uint8_t* row = codes + n * (K / 2);
        const float* s = scale + n * (K / bs);
        const __m256i mask = _mm256_set1_epi32(15);
        dst -= k0;
        for (DqGroups bl(k0, kc, bs); bl.more(); bl.next()) {
            const __m256 v = _mm256_set1_ps(s[bl.b]);
            __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(levels), v), t1 = _mm256_mul_ps(_mm256_loadu_ps(levels + 8), v);
            if (round) t0 = dq_round_bf16_256(t0), t1 = dq_round_bf16_256(t1);
            for (int64_t k = bl.k; k < bl.end; k += 32)
                for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: the chunk's columns 16h..16h+15
                    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2 + 8 * h)));
                    _mm256_storeu_ps(dst + k + 8 * h, dq_lookup16_256(t0, t1, _mm256_srli_epi32(c, 4)));
                    _mm256_storeu_ps(dst + k + 16 + 8 * h, dq_lookup16_256(t0, t1, _mm256_and_si256(c, mask)));
                }
        }
    }
};

// flags: 1: x and out are fp32 (else bf16); 2: several tokens, through the tiles (else the one-token kernel, bf16
// only); 4: round every weight to bf16 (the tiles; the one-token kernel always does). Level 1: AVX2, 2: AVX-512, 3:
// AVX-512 BF16, 4: AMX (the tiles only). Called with M = 0 it only reports the best level here.
extern "C" void kernel(const uint8_t* codes, const float* scale, const float* levels, const void* x, void* out,
                       int64_t M, int64_t N, int64_t K, int64_t bs, int64_t flags, int64_t max_level, int64_t threads,
                       int64_t* level) {
    const bool tiles = flags & 2;
    int64_t best = bs % 32 ? 0 : dq_tiles_best();
    if (!tiles && best > 2) best = 2;
    level[0] = best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    if (tiles) {
        dq_tiles(Nf4Rows{codes, scale, levels, K, bs}, x, out, M, N, K, flags & 1, flags & 4, level[0], threads);
    } else if (!(flags & 1)) {
        dq_nf4(codes, scale, levels, static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), M, N, K, bs,
               level[0], threads);
    } else {
        level[0] = 0;
    }
}
