// The row writers native_tiles.h asks of the two int4 formats (int4.cpp: Int4Groupwise, int4_zero.cpp:
// Int4GroupwiseIntZero): the same codes (two per byte, column 2j in byte j's low nibble), one scale and one zero
// point per group of g columns; they differ only in the 16 weights a group's codes stand for, which the format
// computes (its dequantize's arithmetic) and these writers look up: vpermw for 32 bf16 weights at once, vpermps
// for fp32. In each chunk of 32 columns a row holds the 16 low nibbles' weights (the even columns), then the 16
// high nibbles' (the odd ones).
//
// D derives from Int4RowWriters<D> and provides the members below plus
//   __m512 table(float s, float z) const;                        avx512f,avx512bw: the group's 16 weights, code order
//   void table(float s, float z, __m256& t0, __m256& t1) const;  avx2,fma,f16c: the same, codes 0-7 and 8-15
#pragma once
#include "native_prelude.h"
#include "native_tiles.h"

template <class D>
struct Int4RowWriters {
    const uint8_t* codes;  // [N, K / 2]
    const float* scale;    // [N, K / g]
    const float* zero;     // [N, K / g]
    int64_t K, g;

    static int64_t perm(int64_t p) { return p < 16 ? 2 * p : 2 * (p - 16) + 1; }

    __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
    bool bf16(int64_t n, int64_t k0, int64_t kc, uint16_t* dst) const {
        const D& d = static_cast<const D&>(*this);
        const uint8_t* row = codes + n * (K / 2);
        const float *s = scale + n * (K / g), *z = zero + n * (K / g);
        const __m256i mask = _mm256_set1_epi16(15);
        __mmask16 bad = 0;
        dst -= k0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            const __m512 t = d.table(s[gr.b], z[gr.b]);
            bad |= dq_bf16_unsafe_512(t);
            const __m512i words = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
            for (int64_t k = gr.k; k < gr.end; k += 32) {
                DQ_PREFETCH_AHEAD(row + k / 2);
                const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
                const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, mask)),
                                                       _mm256_srli_epi16(c, 4), 1);
                _mm512_storeu_si512(dst + k, _mm512_permutexvar_epi16(idx, words));
            }
        }
        return bad == 0;
    }

    __attribute__((target("avx512f,avx512bw")))
    void f32_512(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const D& d = static_cast<const D&>(*this);
        const uint8_t* row = codes + n * (K / 2);
        const float *s = scale + n * (K / g), *z = zero + n * (K / g);
        const __m512i mask = _mm512_set1_epi32(15);
        dst -= k0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            __m512 t = d.table(s[gr.b], z[gr.b]);
            if (round) t = dq_round_bf16_512(t);
            for (int64_t k = gr.k; k < gr.end; k += 32) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
                _mm512_storeu_ps(dst + k, _mm512_permutexvar_ps(_mm512_and_si512(c, mask), t));
                _mm512_storeu_ps(dst + k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t));
            }
        }
    }

    __attribute__((target("avx2,fma,f16c")))
    void f32_256(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const D& d = static_cast<const D&>(*this);
        const uint8_t* row = codes + n * (K / 2);
        const float *s = scale + n * (K / g), *z = zero + n * (K / g);
        const __m256i mask = _mm256_set1_epi32(15);
        dst -= k0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            __m256 t0, t1;
            d.table(s[gr.b], z[gr.b], t0, t1);
            if (round) t0 = dq_round_bf16_256(t0), t1 = dq_round_bf16_256(t1);
            for (int64_t k = gr.k; k < gr.end; k += 32)
                for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: the chunk's columns 16h..16h+15
                    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2 + 8 * h)));
                    _mm256_storeu_ps(dst + k + 8 * h, dq_lookup16_256(t0, t1, _mm256_and_si256(c, mask)));
                    _mm256_storeu_ps(dst + k + 16 + 8 * h, dq_lookup16_256(t0, t1, _mm256_srli_epi32(c, 4)));
                }
        }
    }
};
