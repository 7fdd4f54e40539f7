// The multi-token matmul every weight-only format's kernel shares (dtensor_quant/core/native.py inlines it):
// out[M, N] = x[M, K] @ W[N, K]^T, the weight dequantized a tile at a time into a buffer that stays in cache.
//
// A tile is DQ_TR (32) rows of W by at most DQ_KC columns. The format writes each row of it, exactly as its
// dequantize computes the weights (the same products, rounded the same way), into a row-major buffer. For more
// than DQ_FEW tokens the tile is transposed so that each step of the micro-kernel reads the 32 rows' weights at one
// column (AVX-512 BF16: at one pair of columns) from one or two vector registers, multiplies them by one broadcast
// activation each and adds the products in fp32: an outer product, no horizontal sums. For up to DQ_FEW tokens
// (AVX-512 BF16) 4 rows at a time are dequantized whole and multiplied as they are, 32 columns a step, each sum's 16
// lanes added at the end of a block of DQ_KC columns: building the transposed tile would cost more than those
// tokens' products. Either way every
// weight is dequantized once per call (per DQ_MB tokens), read from memory once, and never written to memory as a
// dense weight; and a token's result does not depend on the tokens beside it (for a given way).
//
// Four paths (the kernel's level): 4, AMX (bf16 activations): the format's rows as they are, 32 columns by 16
// tokens per TDPBF16PS, no transpose (dq_tile_amx); 3, AVX-512 BF16: bf16 activations times the bf16 weights in
// pairs (vdpbf16ps: exact products, fp32 sums); 2, AVX-512: fp32 weights and activations, FMA; 1, AVX2 with FMA,
// the same on 8 lanes. vdpbf16ps and TDPBF16PS read subnormal inputs as zero and flush subnormal results, as
// oneDNN's bf16 GEMM does on such a CPU: a tile holding a weight that is subnormal, infinite or NaN in bf16 takes
// level 2 instead, so every weight is still the format's; a subnormal activation (below 1.2e-38) is read as zero
// there.
//
// A format may store a 32-column chunk of a row in any order of its columns (NF4: the high nibbles, then the low
// ones): its perm(p) says which column position p holds, and the activations are permuted the same way. Only the
// order of the fp32 sum differs from dequantize + mm.
//
// A format's rows (a struct F) provides:
//   static int64_t perm(int64_t p);                                  column of position p in a chunk of 32
//   bool bf16(int64_t n, int64_t k0, int64_t kc, uint16_t* dst) const;          avx512f,avx512bw; false: a weight
//                                                                                 vdpbf16ps would not read exactly
//   void f32_512(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const;   avx512f,avx512bw
//   void f32_256(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const;   avx2,fma
// each writing row n's columns [k0, k0 + kc) (multiples of 32), as bf16 bits or as fp32 (rounded to bf16 first
// when round is set: bf16 activations, or a format whose dequantize rounds to the weight's bf16 dtype).
#pragma once
#include "native_prelude.h"

#include <cstdlib>
#include <memory>

constexpr int64_t DQ_TR = 32;           // weight rows per tile
constexpr int64_t DQ_KC = 2048;         // columns per block of K (a multiple of 32): the tile buffers stay in L2
constexpr int64_t DQ_LDPAD = 32;        // row stride padding of the row-major buffer: no 4 KiB aliasing of its rows
constexpr int64_t DQ_PREFETCH = 4096;   // bytes ahead of a row's stored weights that a format's loop prefetches
// A kernel loop's software prefetch of the stored weights DQ_PREFETCH bytes ahead of p (rows lie end to end).
#define DQ_PREFETCH_AHEAD(p) _mm_prefetch(reinterpret_cast<const char*>(p) + DQ_PREFETCH, _MM_HINT_T0)
constexpr int64_t DQ_MB = 128;          // tokens per pass over the weight: their activations stay in L2
constexpr int64_t DQ_FEW = 32;          // up to this many tokens, level 3 multiplies rows as they are (no transpose)

// The groups of columns [k0, k0 + kc) that share a scale (group size g, a multiple of 32): group b holds [k, end).
// One division per row, not per group.
struct DqGroups {
    int64_t b, k, end, stop, g;
    DqGroups(int64_t k0, int64_t kc, int64_t g_) : b(k0 / g_), k(k0), end((k0 / g_ + 1) * g_), stop(k0 + kc), g(g_) {
        if (end > stop) end = stop;
    }
    bool more() const { return k < stop; }
    void next() { ++b, k = end, end = end + g < stop ? end + g : stop; }
};

// c[j] = element j of every r[i]: a 16 x 16 transpose of 32-bit elements.
__attribute__((target("avx512f,avx512bw")))
static inline void dq_transpose16(const __m512i* r, __m512i* c) {
    __m512i t[16], u[16], v[4];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // u[4g + c]: columns c, c + 4, c + 8, c + 12 of rows 4g..4g+3, one per 128-bit lane
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        v[0] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);       // columns j, j + 8 of rows 0-7
        v[1] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);       // j + 4, j + 12 of rows 0-7
        v[2] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);  // the same of rows 8-15
        v[3] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        c[j] = _mm512_shuffle_i32x4(v[0], v[2], 0x88);
        c[j + 8] = _mm512_shuffle_i32x4(v[0], v[2], 0xDD);
        c[j + 4] = _mm512_shuffle_i32x4(v[1], v[3], 0x88);
        c[j + 12] = _mm512_shuffle_i32x4(v[1], v[3], 0xDD);
    }
}

// The same for 8 x 8 floats.
__attribute__((target("avx2,fma")))
static inline void dq_transpose8(const __m256* r, __m256* c) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; ++g) {  // u[4g + c]: columns c, c + 4 of rows 4g..4g+3
        u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
        c[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        c[j + 4] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

// rows: 32 rows of kc bf16 weights (stride ld) -> dst[kc / 2][32]: each row's pair of columns as one 32-bit lane.
__attribute__((target("avx512f,avx512bw")))
static void dq_pack_bf16(const uint16_t* rows, int64_t ld, int64_t kc, uint32_t* dst) {
    __m512i r[16], c[16];
    for (int64_t k = 0; k < kc; k += 32)
        for (int h = 0; h < 2; ++h) {
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + (16 * h + i) * ld + k);
            dq_transpose16(r, c);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (k / 2 + j) * DQ_TR + 16 * h, c[j]);
        }
}

// rows: 32 rows of kc fp32 weights (stride ld) -> dst[kc][32].
__attribute__((target("avx512f,avx512bw")))
static void dq_pack_f32_512(const float* rows, int64_t ld, int64_t kc, float* dst) {
    __m512i r[16], c[16];
    for (int64_t k = 0; k < kc; k += 16)
        for (int h = 0; h < 2; ++h) {
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + (16 * h + i) * ld + k);
            dq_transpose16(r, c);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (k + j) * DQ_TR + 16 * h, c[j]);
        }
}

__attribute__((target("avx2,fma")))
static void dq_pack_f32_256(const float* rows, int64_t ld, int64_t kc, float* dst) {
    __m256 r[8], c[8];
    for (int64_t k = 0; k < kc; k += 8)
        for (int g = 0; g < 4; ++g) {
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + (8 * g + i) * ld + k);
            dq_transpose8(r, c);
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * DQ_TR + 8 * g, c[j]);
        }
}

// C[MR][32] (+)= x[MR][kc] w[kc][32]: x bf16 (row stride ldx), w packed by dq_pack_bf16; C starts at 0 if first.
// Each token's sums run over the columns in the same order whatever MR (and so whatever the number of tokens).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void dq_micro_bf16(const uint16_t* x, int64_t ldx, const uint32_t* w, int64_t kc, float* C, bool first) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2; ++v) acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + m * DQ_TR + 16 * v);
    for (int64_t p = 0; p < kc / 2; ++p) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * DQ_TR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * DQ_TR + 16);
        for (int m = 0; m < MR; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * ldx + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2; ++v) _mm512_storeu_ps(C + m * DQ_TR + 16 * v, acc[m][v]);
}

// The same in fp32 with FMA: x fp32, w packed by dq_pack_f32_512.
template <int MR>
__attribute__((target("avx512f,avx512bw")))
static void dq_micro_f32_512(const float* x, int64_t ldx, const float* w, int64_t kc, float* C, bool first) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2; ++v) acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + m * DQ_TR + 16 * v);
    for (int64_t k = 0; k < kc; ++k) {
        const __m512 w0 = _mm512_loadu_ps(w + k * DQ_TR), w1 = _mm512_loadu_ps(w + k * DQ_TR + 16);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
            acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2; ++v) _mm512_storeu_ps(C + m * DQ_TR + 16 * v, acc[m][v]);
}

// The same with AVX2, 16 rows at a time (16 vector registers: 2 x MR accumulators, 2 weights, 1 activation).
template <int MR>
__attribute__((target("avx2,fma")))
static void dq_micro_f32_256(const float* x, int64_t ldx, const float* w, int64_t kc, float* C, bool first) {
    for (int h = 0; h < 2; ++h) {
        __m256 acc[MR][2];
        for (int m = 0; m < MR; ++m)
            for (int v = 0; v < 2; ++v)
                acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + m * DQ_TR + 16 * h + 8 * v);
        for (int64_t k = 0; k < kc; ++k) {
            const __m256 w0 = _mm256_loadu_ps(w + k * DQ_TR + 16 * h), w1 = _mm256_loadu_ps(w + k * DQ_TR + 16 * h + 8);
            for (int m = 0; m < MR; ++m) {
                const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
                acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
            }
        }
        for (int m = 0; m < MR; ++m)
            for (int v = 0; v < 2; ++v) _mm256_storeu_ps(C + m * DQ_TR + 16 * h + 8 * v, acc[m][v]);
    }
}

// lane i of the result: the sum of a[i]'s 16 lanes.
__attribute__((target("avx512f,avx512bw")))
static inline __m512 dq_sum16(const __m512* a) {
    __m512 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; ++i)
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
        s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

// A few tokens: C[m][r0 + r] (+)= x[m] . w[r] over kc for MR tokens and 4 row-major bf16 rows (stride ldw) -- inner
// products of 16 lanes, summed at the end of the block: no transposed tile to build.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void dq_dot_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t kc, float* C,
                        int64_t r0, bool first) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k += 32) {
        __m512bh wv[4];
        for (int r = 0; r < 4; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
        for (int m = 0; m < MR; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
            for (int r = 0; r < 4; ++r) acc[4 * m + r] = _mm512_dpbf16_ps(acc[4 * m + r], xv, wv[r]);
        }
    }
    alignas(64) float sums[16];  // token m, row r at 4m + r
    _mm512_store_ps(sums, dq_sum16(acc));
    for (int m = 0; m < MR; ++m) {
        float* c = C + m * DQ_TR + r0;
        const __m128 v = _mm_load_ps(sums + 4 * m);
        _mm_storeu_ps(c, first ? v : _mm_add_ps(_mm_loadu_ps(c), v));
    }
}

// One tile for at most DQ_FEW tokens on level 3: 4 rows at a time dequantized whole, in the order their codes are
// stored (a stream the CPU prefetches; a block of columns of every row at a time jumps between rows, and the whole
// call took 3-35% longer on 5632 and 14336 columns), into rb (4 rows of K + DQ_LDPAD), then multiplied a block of
// DQ_KC columns at a time: the block's 4 rows stay in L1 for every group of 4 tokens. False (nothing usable
// written) if a weight is one vdpbf16ps cannot read.
template <class F>
static bool dq_tile_few(const F& f, int64_t n0, int64_t rows, int64_t K, int64_t M, const uint16_t* xb,
                        uint16_t* rb, float* C) {
    const int64_t ld = K + DQ_LDPAD;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        for (int64_t r = r0; r < r0 + 4 && r < rows; ++r)  // rows past the weight's last keep older values
            if (!f.bf16(n0 + r, 0, K, rb + (r - r0) * ld)) return false;
        for (int64_t k0 = 0; k0 < K; k0 += DQ_KC) {
            const int64_t kc = K - k0 < DQ_KC ? K - k0 : DQ_KC;
            for (int64_t m = 0; m < M; m += 4) {
                const uint16_t* xm = xb + m * K + k0;
                float* Cm = C + m * DQ_TR;
                switch (M - m < 4 ? M - m : 4) {
                    case 4: dq_dot_bf16<4>(xm, K, rb + k0, ld, kc, Cm, r0, k0 == 0); break;
                    case 3: dq_dot_bf16<3>(xm, K, rb + k0, ld, kc, Cm, r0, k0 == 0); break;
                    case 2: dq_dot_bf16<2>(xm, K, rb + k0, ld, kc, Cm, r0, k0 == 0); break;
                    default: dq_dot_bf16<1>(xm, K, rb + k0, ld, kc, Cm, r0, k0 == 0); break;
                }
            }
        }
    }
    return true;
}

// name##_n<R>: name<rows> for any rows from 1 to R (the last, shorter group of tokens).
#define DQ_MICRO_TABLE(name, T, W)                                                                                 \
    template <int R>                                                                                               \
    static void name##_n(const T* x, int64_t ldx, const W* w, int64_t kc, float* C, bool first, int64_t rows) {     \
        if constexpr (R > 1) {                                                                                     \
            if (rows < R) return name##_n<R - 1>(x, ldx, w, kc, C, first, rows);                                   \
        }                                                                                                          \
        name<R>(x, ldx, w, kc, C, first);                                                                          \
    }

DQ_MICRO_TABLE(dq_micro_bf16, uint16_t, uint32_t)
DQ_MICRO_TABLE(dq_micro_f32_512, float, float)
DQ_MICRO_TABLE(dq_micro_f32_256, float, float)

// x[m, perm(k)] for the chunk order of the format: as bf16 (xb) and as fp32 (xf), either may be null.
template <class F>
static void dq_prepare_x_scalar(const void* x, bool x_f32, int64_t M, int64_t K, uint16_t* xb, float* xf) {
    int64_t perm[32];
    for (int p = 0; p < 32; ++p) perm[p] = F::perm(p);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 32)
            for (int p = 0; p < 32; ++p) {
                const int64_t src = m * K + k + perm[p];
                if (x_f32) {
                    xf[m * K + k + p] = static_cast<const float*>(x)[src];
                } else {
                    const uint16_t h = static_cast<const uint16_t*>(x)[src];
                    if (xb) xb[m * K + k + p] = h;
                    if (xf) xf[m * K + k + p] = dq_bf16_float(h);
                }
            }
}

// The same 32 values a step with AVX-512 (vpermw / vpermt2ps).
template <class F>
__attribute__((target("avx512f,avx512bw")))
static void dq_prepare_x_512(const void* x, bool x_f32, int64_t M, int64_t K, uint16_t* xb, float* xf) {
    alignas(64) uint16_t pw[32];
    alignas(64) int32_t pd[16], pd2[16];
    for (int p = 0; p < 32; ++p) pw[p] = static_cast<uint16_t>(F::perm(p));
    for (int p = 0; p < 16; ++p) pd[p] = static_cast<int32_t>(F::perm(p)), pd2[p] = static_cast<int32_t>(F::perm(16 + p));
    const __m512i iw = _mm512_load_si512(pw), id = _mm512_load_si512(pd), id2 = _mm512_load_si512(pd2);
    for (int64_t i = 0; i < M * K; i += 32) {
        if (x_f32) {
            const float* src = static_cast<const float*>(x) + i;
            const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
            _mm512_storeu_ps(xf + i, _mm512_permutex2var_ps(a, id, b));
            _mm512_storeu_ps(xf + i + 16, _mm512_permutex2var_ps(a, id2, b));
        } else {
            const __m512i h = _mm512_permutexvar_epi16(iw, _mm512_loadu_si512(static_cast<const uint16_t*>(x) + i));
            if (xb) _mm512_storeu_si512(xb + i, h);
            if (xf) {
                _mm512_storeu_ps(xf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
                _mm512_storeu_ps(xf + i + 16, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
            }
        }
    }
}

// Rows [n0, n0 + rows) of the output for M tokens: C[m][r] rounded to bf16 (as dq_bf16_rne) or kept as fp32.
static void dq_store_scalar(const float* C, int64_t M, int64_t rows, bool out_f32, void* out, int64_t N, int64_t n0) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) {
            const float v = C[m * DQ_TR + r];
            if (out_f32)
                static_cast<float*>(out)[m * N + n0 + r] = v;
            else
                static_cast<uint16_t*>(out)[m * N + n0 + r] = dq_bf16_rne(v);
        }
}

// dst[i] = bf16(v[i]) (as dq_bf16_rne) for the lanes of mask k.
__attribute__((target("avx512f,avx512bw,avx512vl")))  // the 256-bit masked store is AVX-512 VL
static inline void dq_store_bf16_512(uint16_t* dst, __mmask16 k, __m512 v) {
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(dq_round_bf16_512(v)), 16);
    _mm256_mask_storeu_epi16(dst, k, _mm512_cvtepi32_epi16(bits));
}

// The same 16 values a step with AVX-512 (masked stores for a tile's last rows).
__attribute__((target("avx512f,avx512bw")))
static void dq_store_512(const float* C, int64_t M, int64_t rows, bool out_f32, void* out, int64_t N, int64_t n0) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; r += 16) {
            const __mmask16 k = rows - r >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (rows - r)) - 1);
            const __m512 v = _mm512_loadu_ps(C + m * DQ_TR + r);
            if (out_f32) {
                _mm512_mask_storeu_ps(static_cast<float*>(out) + m * N + n0 + r, k, v);
            } else {
                dq_store_bf16_512(static_cast<uint16_t*>(out) + m * N + n0 + r, k, v);
            }
        }
}

// This thread's buffer `which` of at least n floats, kept for its next calls (a fresh one would cost page faults
// on every call), 64-byte aligned (a tile row or vector that straddles two cache lines loads both). Zeroed when
// made: rows of a tile past the weight's last row read it, their sums unused.
struct DqFree {
    void operator()(float* p) const { std::free(p); }
};
static float* dq_buffer(int which, int64_t n) {
    static thread_local std::unique_ptr<float[], DqFree> buffers[3];
    static thread_local int64_t sizes[3] = {0, 0, 0};
    if (sizes[which] < n) {
        const int64_t bytes = (n * 4 + 63) / 64 * 64;
        buffers[which].reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
        std::memset(buffers[which].get(), 0, bytes);
        sizes[which] = n;
    }
    return buffers[which].get();
}

// Level 4, AMX (Intel's tile registers, Sapphire Rapids on): TDPBF16PS multiplies a tile of 16 weight rows by 32
// columns -- the format's bf16 rows exactly as it writes them, no transpose -- by 16 tokens' activations in pairs of
// columns (the VNNI layout dq_prepare_x_amx builds once per call), adding the exact products to 16 x 16 fp32 sums.
// Its numerics are vdpbf16ps's (subnormal inputs read as zero, fp32 sums), so the same tiles fall back to level 2.
// Linux hands a process the tile registers only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, once).
constexpr int64_t DQ_AMX_KB = 512;  // columns per block: the tile's 32 decoded rows of a block (34 KB) fit in L1

// AMX needs a compiler with its intrinsics (GCC 11, Clang 12 on): with an older one the kernels build without
// level 4 rather than not at all.
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define DQ_AMX 1
#else
#define DQ_AMX 0
#endif

static inline bool dq_amx() {
#if DQ_AMX
    static const bool usable = [] {
        unsigned a, b, c, d;
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }();
    return usable && dq_avx512_bf16();
#else
    return false;
#endif
}

// The best level of the tiled matmul here (the one-token kernels stop lower).
static inline int64_t dq_tiles_best() {
    return dq_amx() ? 4 : dq_avx512_bf16() ? 3 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
}

#if DQ_AMX
// This thread's tile configuration while in scope: tmm0-3 the sums (16 rows x 16 tokens), tmm4-5 two blocks of 16
// weight rows x 32 columns, tmm6-7 two groups of 16 tokens x 32 columns. The configuration found (oneDNN's, in the
// same thread) is put back on leaving. ldtilecfg/sttilecfg as inline assembly with memory operands: GCC 12's
// builtins do not tell the compiler that they read or write the 64 bytes, and it dropped the stores that fill them.
struct DqAmxScope {
    struct alignas(64) Config {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
        uint8_t reserved2[16];
    };
    Config saved;

    DqAmxScope() {
        asm volatile("sttilecfg %0" : "=m"(saved));
        Config cfg;
        std::memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
        asm volatile("ldtilecfg %0" : : "m"(cfg));
    }
    ~DqAmxScope() {
        if (saved.palette)
            asm volatile("ldtilecfg %0" : : "m"(saved));
        else
            asm volatile("tilerelease" ::: "memory");
    }
};

// xb [M, K] (permuted bf16 activations) -> xv [G][K / 2][16] 32-bit pairs, G = ceil(M / 16) groups of 16 tokens,
// the tokens past M zero: each group's rows of pairs are a TDPBF16PS operand.
__attribute__((target("avx512f,avx512bw")))
static void dq_prepare_x_amx(const uint16_t* xb, int64_t M, int64_t K, uint32_t* xv) {
    __m512i r[16], c[16];
    for (int64_t g = 0; g < (M + 15) / 16; ++g)
        for (int64_t k = 0; k < K; k += 32) {
            for (int i = 0; i < 16; ++i)
                r[i] = 16 * g + i < M ? _mm512_loadu_si512(xb + (16 * g + i) * K + k) : _mm512_setzero_si512();
            dq_transpose16(r, c);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(xv + (g * (K / 2) + k / 2 + j) * 16, c[j]);
        }
}

// The sums of a block of 32 weight rows by one or two (TWO) groups of 16 tokens, in tiles 0 and 2 (rows 0-15 and
// 16-31; 1 and 3 the second group's): zeroed (first) or loaded from c0 / c1 (the second group's at +16; row
// stride cs bytes), and stored back there. Shared by the bf16 tile loops (dq_amx_block, float8_unit.h).
template <bool TWO>
__attribute__((target("amx-tile"), always_inline))
static inline void dq_amx_sums_begin(float* c0, float* c1, int64_t cs, bool first) {
    if (first) {
        _tile_zero(0);
        _tile_zero(2);
        if (TWO) {
            _tile_zero(1);
            _tile_zero(3);
        }
    } else {
        _tile_loadd(0, c0, cs);
        _tile_loadd(2, c1, cs);
        if (TWO) {
            _tile_loadd(1, c0 + 16, cs);
            _tile_loadd(3, c1 + 16, cs);
        }
    }
}

template <bool TWO>
__attribute__((target("amx-tile"), always_inline))
static inline void dq_amx_sums_end(float* c0, float* c1, int64_t cs) {
    _tile_stored(0, c0, cs);
    _tile_stored(2, c1, cs);
    if (TWO) {
        _tile_stored(1, c0 + 16, cs);
        _tile_stored(3, c1 + 16, cs);
    }
}

// Ct[32][Mp] (+)= rows[32][kc] . x over columns [k0, k0 + kc) (rows: the tile's decoded bf16 rows, stride ld), for
// token groups [g0, g0 + 1 or 2); first: the sums start at zero. Each sum runs over the columns in order, whatever
// the other tokens.
template <bool TWO, class W>
__attribute__((target("amx-tile,amx-bf16")))
static void dq_amx_block(const uint16_t* rows, int64_t ld, const uint32_t* xv, int64_t K, int64_t k0, int64_t kc,
                         int64_t g0, float* Ct, int64_t Mp, bool first, W&& work) {
    float* c0 = Ct + 16 * g0;
    float* c1 = Ct + 16 * Mp + 16 * g0;
    const int64_t cs = Mp * 4;
    dq_amx_sums_begin<TWO>(c0, c1, cs, first);
    const uint32_t* x0 = xv + (g0 * (K / 2) + k0 / 2) * 16;
    const uint32_t* x1 = x0 + (K / 2) * 16;
    for (int64_t k = 0; k < kc; k += 32) {
        _tile_loadd(4, rows + k, ld * 2);
        _tile_loadd(5, rows + 16 * ld + k, ld * 2);
        _tile_loadd(6, x0 + k * 8, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (TWO) {
            _tile_loadd(7, x1 + k * 8, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        work(k / 32);
    }
    dq_amx_sums_end<TWO>(c0, c1, cs);
}

// One tile on level 4: rows [n0, n0 + rows) for M tokens into Ct[32][Mp] (Mp: M rounded up to 16), DQ_AMX_KB
// columns at a time. The 32 rows of a block of columns are decoded while the tile unit multiplies the block before
// (two rows after each step of its first group of tokens: the vector units and the tile unit run at once), into
// the other of two buffers rb[2][32][DQ_AMX_KB + DQ_LDPAD]. False (nothing usable written) if a weight
// is one TDPBF16PS cannot read.
template <class F>
static bool dq_tile_amx(const F& f, int64_t n0, int64_t rows, int64_t K, int64_t M, const uint32_t* xv,
                        uint16_t* rb, float* Ct) {
    const int64_t ld = DQ_AMX_KB + DQ_LDPAD, G = (M + 15) / 16, Mp = 16 * G, size = DQ_TR * ld;
    bool ok = true;
    auto decode = [&](int64_t k0, uint16_t* dst, int64_t r0, int64_t r1) {
        const int64_t kb = K - k0 < DQ_AMX_KB ? K - k0 : DQ_AMX_KB;
        for (int64_t r = r0; r < r1 && r < rows; ++r) ok &= f.bf16(n0 + r, k0, kb, dst + r * ld);
    };
    decode(0, rb, 0, DQ_TR);  // rows past the weight's last keep older values: their sums are unused
    for (int64_t k0 = 0, b = 0; k0 < K && ok; k0 += DQ_AMX_KB, ++b) {
        const int64_t kb = K - k0 < DQ_AMX_KB ? K - k0 : DQ_AMX_KB, steps = kb / 32;
        const uint16_t* cur = rb + (b & 1) * size;
        uint16_t* next = rb + ((b + 1) & 1) * size;
        const bool more = k0 + DQ_AMX_KB < K;
        // the next block's rows, two after each step of this block's first group of tokens
        for (int64_t g = 0; g < G; g += 2) {
            auto ahead = [&](int64_t step) {
                if (more && g == 0) decode(k0 + DQ_AMX_KB, next, step * DQ_TR / steps, (step + 1) * DQ_TR / steps);
            };
            if (g + 1 < G)
                dq_amx_block<true>(cur, ld, xv, K, k0, kb, g, Ct, Mp, k0 == 0, ahead);
            else
                dq_amx_block<false>(cur, ld, xv, K, k0, kb, g, Ct, Mp, k0 == 0, ahead);
        }
    }
    return ok;
}
#else
struct DqAmxScope {};
static void dq_prepare_x_amx(const uint16_t*, int64_t, int64_t, uint32_t*) {}
template <class F>
static bool dq_tile_amx(const F&, int64_t, int64_t, int64_t, int64_t, const uint32_t*, uint16_t*, float*) {
    return false;
}
#endif  // DQ_AMX

// out[m, n0 + r] = bf16(Ct[r][m]) for the tile's rows and the M tokens: 16 x 16 blocks transposed.
__attribute__((target("avx512f,avx512bw")))
static void dq_store_amx(const float* Ct, int64_t M, int64_t rows, uint16_t* out, int64_t N, int64_t n0) {
    const int64_t Mp = (M + 15) / 16 * 16;
    __m512i r[16], c[16];
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const __mmask16 k = rows - r0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (rows - r0)) - 1);
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(Ct + (r0 + i) * Mp + m0);
            dq_transpose16(r, c);
            for (int j = 0; j < 16 && m0 + j < M; ++j)
                dq_store_bf16_512(out + (m0 + j) * N + n0 + r0, k, _mm512_castsi512_ps(c[j]));
        }
    }
}

// One tile (rows [n0, n0 + rows)) for M tokens, all of K, on one vector level. xb/xf: the permuted activations of
// these tokens (stride K). Returns false (having written nothing) if level 3 met a weight vdpbf16ps cannot read.
template <class F>
static bool dq_tile(const F& f, int64_t level, bool round, int64_t n0, int64_t rows, int64_t K, int64_t M,
                    const uint16_t* xb, const float* xf, void* rowbuf, void* packed, float* C) {
    const int64_t ld = DQ_KC + DQ_LDPAD;
    for (int64_t k0 = 0; k0 < K; k0 += DQ_KC) {
        const int64_t kc = K - k0 < DQ_KC ? K - k0 : DQ_KC;
        const bool first = k0 == 0;
        if (level >= 3) {
            uint16_t* rb = static_cast<uint16_t*>(rowbuf);
            for (int64_t r = 0; r < rows; ++r)
                if (!f.bf16(n0 + r, k0, kc, rb + r * ld)) return false;
            dq_pack_bf16(rb, ld, kc, static_cast<uint32_t*>(packed));
            for (int64_t m = 0; m < M; m += 8)
                dq_micro_bf16_n<8>(xb + m * K + k0, K, static_cast<uint32_t*>(packed), kc, C + m * DQ_TR, first,
                                   M - m);
        } else if (level == 2) {
            float* rb = static_cast<float*>(rowbuf);
            for (int64_t r = 0; r < rows; ++r) f.f32_512(n0 + r, k0, kc, round, rb + r * ld);
            dq_pack_f32_512(rb, ld, kc, static_cast<float*>(packed));
            for (int64_t m = 0; m < M; m += 8)
                dq_micro_f32_512_n<8>(xf + m * K + k0, K, static_cast<float*>(packed), kc, C + m * DQ_TR, first,
                                      M - m);
        } else {
            float* rb = static_cast<float*>(rowbuf);
            for (int64_t r = 0; r < rows; ++r) f.f32_256(n0 + r, k0, kc, round, rb + r * ld);
            dq_pack_f32_256(rb, ld, kc, static_cast<float*>(packed));
            for (int64_t m = 0; m < M; m += 6)
                dq_micro_f32_256_n<6>(xf + m * K + k0, K, static_cast<float*>(packed), kc, C + m * DQ_TR, first,
                                      M - m);
        }
    }
    return true;
}

// out = x @ W^T for the format's rows f: x [M, K] bf16 (out bf16) or fp32 (x_f32; out fp32), on vector level
// `level` (3: AVX-512 BF16, with bf16 activations only; 2: AVX-512; 1: AVX2), `threads` OpenMP threads over tiles.
// K must be a multiple of 32. round: every weight rounded to bf16 (as dequantize does for these activations).
// dq_tile_amx's two blocks of rows fit in the row buffer dq_tiles gives each thread.
static_assert(2 * DQ_TR * (DQ_AMX_KB + DQ_LDPAD) * 2 <= DQ_TR * (DQ_KC + DQ_LDPAD) * 4, "AMX row buffers");

template <class F>
static void dq_tiles(const F& f, const void* x, void* out, int64_t M, int64_t N, int64_t K, bool x_f32, bool round,
                     int64_t level, int64_t threads) {
    if (x_f32 && level >= 3) level = 2;
    const int64_t mb = M < DQ_MB ? M : DQ_MB;
    uint16_t* xb = level >= 3 ? new uint16_t[mb * K] : nullptr;
    // levels 3 and 4 multiply xb; the fp32 copy only a tile they refuse needs, made then (a pass over the tokens
    // and a buffer twice xb's size saved on every other call)
    float* xf = level >= 3 ? nullptr : new float[mb * K];
    // 64-byte aligned: a tile row that straddles two cache lines loads both
    uint32_t* xv = level >= 4 ? static_cast<uint32_t*>(std::aligned_alloc(64, (mb + 15) / 16 * 16 * K * 2)) : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += DQ_MB) {
        const int64_t ms = M - m0 < DQ_MB ? M - m0 : DQ_MB;
        const void* xm = x_f32 ? static_cast<const void*>(static_cast<const float*>(x) + m0 * K)
                               : static_cast<const void*>(static_cast<const uint16_t*>(x) + m0 * K);
        if (level >= 2)
            dq_prepare_x_512<F>(xm, x_f32, ms, K, xb, xf);
        else
            dq_prepare_x_scalar<F>(xm, x_f32, ms, K, xb, xf);
        if (level >= 4) dq_prepare_x_amx(xb, ms, K, xv);
        void* om = x_f32 ? static_cast<void*>(static_cast<float*>(out) + m0 * N)
                         : static_cast<void*>(static_cast<uint16_t*>(out) + m0 * N);
        #pragma omp parallel num_threads(threads) if(threads > 1)
        {
            float* rowbuf = dq_buffer(0, DQ_TR * (DQ_KC + DQ_LDPAD));  // fp32 or bf16 rows
            // the transposed tile, or dq_tile_few's 4 whole bf16 rows
            float* packed = dq_buffer(1, DQ_TR * DQ_KC > 2 * (K + DQ_LDPAD) ? DQ_TR * DQ_KC : 2 * (K + DQ_LDPAD));
            float* C = dq_buffer(2, (ms + 15) / 16 * 16 * DQ_TR);
            std::unique_ptr<DqAmxScope> amx(level >= 4 ? new DqAmxScope() : nullptr);
            std::unique_ptr<float[]> xf_own;  // xf for a refused tile where there is none (levels 3, 4)
            #pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += DQ_TR) {
                const int64_t rows = N - n0 < DQ_TR ? N - n0 : DQ_TR;
                if (amx && dq_tile_amx(f, n0, rows, K, ms, xv, reinterpret_cast<uint16_t*>(rowbuf), C)) {
                    dq_store_amx(C, ms, rows, static_cast<uint16_t*>(om), N, n0);
                    continue;
                }
                // level 4 refused this tile (a weight TDPBF16PS cannot read): straight to level 2 below, not a
                // second bf16 decode of the tile that would refuse it again
                uint16_t* few_rows = reinterpret_cast<uint16_t*>(packed);
                const bool done = !amx && (level == 3 && ms <= DQ_FEW
                                               ? dq_tile_few(f, n0, rows, K, ms, xb, few_rows, C)
                                               : dq_tile(f, level, round, n0, rows, K, ms, xb, xf, rowbuf, packed, C));
                if (!done) {
                    const float* xt = xf;
                    if (!xt) {
                        if (!xf_own) {
                            xf_own.reset(new float[ms * K]);
                            for (int64_t i = 0; i < ms * K; ++i) xf_own[i] = dq_bf16_float(xb[i]);
                        }
                        xt = xf_own.get();
                    }
                    dq_tile(f, 2, true, n0, rows, K, ms, xb, xt, rowbuf, packed, C);  // level 3 rounds (bf16 x)
                }
                if (level >= 2)
                    dq_store_512(C, ms, rows, x_f32, om, N, n0);
                else
                    dq_store_scalar(C, ms, rows, x_f32, om, N, n0);
            }
        }
    }
    delete[] xb;
    delete[] xf;
    std::free(xv);
}
