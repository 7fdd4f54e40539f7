// Int8Rowwise's multi-token kernel (dtensor_quant/formats/int8.py loads it through dtensor_quant/core/native.py; one
// token takes torch's own int8 kernel). Every weight is Int8Rowwise.dequantize's: float(code) * scale in fp32,
// rounded to bf16 for bf16 activations; only the order of the fp32 sum differs from dequantize + mm. The tiled
// matmul is native_tiles.h's.
#include "native_prelude.h"
#include "native_tiles.h"

// Row n of the weight for native_tiles.h, in its own column order.
struct Int8Rows {
    const int8_t* codes;  // [N, K]
    const float* scale;   // [N]
    int64_t K;

    static int64_t perm(int64_t p) { return p; }

    __attribute__((target("avx512f,avx512bw")))
    __m512 weights(const int8_t* p, __m512 s) const {  // 16 codes times the row's scale
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), s);
    }

    __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
    bool bf16(int64_t n, int64_t k0, int64_t kc, uint16_t* dst) const {
        const int8_t* row = codes + n * K;
        const __m512 s = _mm512_set1_ps(scale[n]);
        __mmask16 bad = 0;
        for (int64_t k = k0; k < k0 + kc; k += 32) {
            DQ_PREFETCH_AHEAD(row + k);
            const __m512 a = weights(row + k, s), b = weights(row + k + 16, s);
            bad |= dq_bf16_unsafe_512(a) | dq_bf16_unsafe_512(b);
            _mm512_storeu_si512(dst + (k - k0), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        return bad == 0;
    }

    __attribute__((target("avx512f,avx512bw")))
    void f32_512(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const int8_t* row = codes + n * K;
        const __m512 s = _mm512_set1_ps(scale[n]);
        for (int64_t k = k0; k < k0 + kc; k += 16) {
            const __m512 w = weights(row + k, s);
            _mm512_storeu_ps(dst + (k - k0), round ? dq_round_bf16_512(w) : w);
        }
    }

    __attribute__((target("avx2,fma")))
    void f32_256(int64_t n, int64_t k0, int64_t kc, bool round, float* dst) const {
        const int8_t* row = codes + n * K;
        const __m256 s = _mm256_set1_ps(scale[n]);
        for (int64_t k = k0; k < k0 + kc; k += 8) {
            const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
            const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(c), s);
            _mm256_storeu_ps(dst + (k - k0), round ? dq_round_bf16_256(w) : w);
        }
    }
};

// flags: 1: x and out are fp32 (else bf16); 2: the tiles (the only path here); 4: round every weight to bf16.
// Level 1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX. Called with M = 0 it only reports the best level here.
extern "C" void kernel(const int8_t* codes, const float* scale, const void* x, void* out, int64_t M, int64_t N,
                       int64_t K, int64_t flags, int64_t max_level, int64_t threads, int64_t* level) {
    int64_t best = K % 32 ? 0 : dq_tiles_best();
    level[0] = !(flags & 2) ? 0 : best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    dq_tiles(Int8Rows{codes, scale, K}, x, out, M, N, K, flags & 1, flags & 4, level[0], threads);
}
