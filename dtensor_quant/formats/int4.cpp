// Int4Groupwise's multi-token kernel (dtensor_quant/formats/int4.py loads it through dtensor_quant/core/native.py;
// one token takes torch's own int4 kernel). Every weight is Int4Groupwise.dequantize's: (code - 8) * scale, then
// + zero, each rounded in fp32 (a multiply, then an add: never fused), rounded to bf16 for bf16 activations; only
// the order of the fp32 sum differs from dequantize + mm. The tiled matmul is native_tiles.h's; a group's 16
// possible weights are computed once and each code picks its own (vpermw: 32 bf16 weights at once; vpermps).
#include "native_prelude.h"
#include "native_tiles.h"

// Row n of the weight for native_tiles.h: in each chunk of 32 columns, the 16 low nibbles' weights (the even
// columns), then the 16 high nibbles' (the odd ones).
struct Int4Rows {
    const uint8_t* codes;  // [N, K / 2], column 2j in byte j's low nibble
    const float* scale;    // [N, K / g]
    const float* zero;     // [N, K / g]
    int64_t K, g;

    static int64_t perm(int64_t p) { return p < 16 ? 2 * p : 2 * (p - 16) + 1; }

    // The group's 16 weights (code - 8) * s + z; the empty asm keeps the product its own rounding (no FMA).
    __attribute__((target("avx512f,avx512bw")))
    static __m512 table(float s, float z) {
        const __m512 c = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
        __m512 p = _mm512_mul_ps(c, _mm512_set1_ps(s));
        __asm__("" : "+v"(p));
        return _mm512_add_ps(p, _mm512_set1_ps(z));
    }

    __attribute__((target("avx2,fma")))
    static void table(float s, float z, __m256& t0, __m256& t1) {
        __m256 p0 = _mm256_mul_ps(_mm256_set_ps(-1, -2, -3, -4, -5, -6, -7, -8), _mm256_set1_ps(s));
        __m256 p1 = _mm256_mul_ps(_mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_ps(s));
        __asm__("" : "+x"(p0), "+x"(p1));
        t0 = _mm256_add_ps(p0, _mm256_set1_ps(z));
        t1 = _mm256_add_ps(p1, _mm256_set1_ps(z));
    }

    __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
    bool bf16(int64_t n, int64_t k0, int64_t kc, uint16_t* dst) const {
        const uint8_t* row = codes + n * (K / 2);
        const float *s = scale + n * (K / g), *z = zero + n * (K / g);
        const __m256i mask = _mm256_set1_epi16(15);
        __mmask16 bad = 0;
        dst -= k0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            const __m512 t = table(s[gr.b], z[gr.b]);
            bad |= dq_bf16_unsafe_512(t);
            const __m512i words = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
            for (int64_t k = gr.k; k < gr.end; k += 32) {
                _mm_prefetch(reinterpret_cast<const char*>(row + k / 2) + DQ_PREFETCH, _MM_HINT_T0);
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
        const uint8_t* row = codes + n * (K / 2);
        const float *s = scale + n * (K / g), *z = zero + n * (K / g);
        const __m512i mask = _mm512_set1_epi32(15);
        dst -= k0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            __m512 t = table(s[gr.b], z[gr.b]);
            if (round) t = dq_round_bf16_512(t);
            for (int64_t k = gr.k; k < gr.end; k += 32) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
                _mm512_storeu_ps(dst + k, _mm512_permutexvar_ps(_mm512_and_si512(c, mask), t));
                _mm512_storeu_ps(dst + k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t));
            }
        }
    }

    __attribute__((target("avx2,fma")))
    void f32_256(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const uint8_t* row = codes + n * (K / 2);
        const float *s = scale + n * (K / g), *z = zero + n * (K / g);
        const __m256i mask = _mm256_set1_epi32(15);
        dst -= k0;
        for (DqGroups gr(k0, kc, g); gr.more(); gr.next()) {
            __m256 t0, t1;
            table(s[gr.b], z[gr.b], t0, t1);
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

// flags: 1: x and out are fp32 (else bf16); 2: the tiles (the only path here); 4: round every weight to bf16.
// Level 1: AVX2, 2: AVX-512, 3: AVX-512 BF16. Called with M = 0 it only reports the best level here.
extern "C" void kernel(const uint8_t* codes, const float* scale, const float* zero, const void* x, void* out,
                       int64_t M, int64_t N, int64_t K, int64_t g, int64_t flags, int64_t max_level, int64_t threads,
                       int64_t* level) {
    int64_t best = K % 32 || g % 32 || K % g ? 0 : dq_avx512_bf16() ? 3 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
    level[0] = !(flags & 2) ? 0 : best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    dq_tiles(Int4Rows{codes, scale, zero, K, g}, x, out, M, N, K, flags & 1, flags & 4, level[0], threads);
}
