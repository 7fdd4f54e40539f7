// What every kernel source of dtensor_quant includes (dtensor_quant/_core/native.py inlines it when it builds one):
// bf16 helpers that round as c10::BFloat16 does, and run-time checks of the CPU's vector ISA.
#pragma once
#include <immintrin.h>
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>

// c10::BFloat16(float): round to nearest even, any NaN to the canonical quiet NaN.
static inline uint16_t dq_bf16_rne(float f) {
    if (std::isnan(f)) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float dq_bf16_float(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Flush-to-zero or denormals-are-zero (torch.set_flush_denormal(True)) would change tiny weights: no kernel then.
static inline bool dq_exact_fp() { return (_mm_getcsr() & 0x8040) == 0; }
static inline bool dq_avx2() {
    return dq_exact_fp() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
static inline bool dq_avx512() {
    return dq_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
static inline bool dq_avx512_bf16() {
    return dq_avx512() && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
}

// dq_bf16_rne on 8 lanes for values that cannot be NaN, the result widened back to fp32 (exact for
// denormals; Inf stays Inf; overflow rounds to it as in RNE).
__attribute__((target("avx2,fma")))
static inline __m256 dq_round_bf16_256_finite(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The same for any value: NaN lanes become the canonical quiet NaN, as dq_bf16_rne makes them.
__attribute__((target("avx2,fma")))
static inline __m256 dq_round_bf16_256(__m256 v) {
    return _mm256_blendv_ps(dq_round_bf16_256_finite(v), _mm256_set1_ps(NAN), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

__attribute__((target("avx2,fma")))
static inline float dq_sum_256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The two on 16 lanes.
__attribute__((target("avx512f,avx512bw")))
static inline __m512 dq_round_bf16_512_finite(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

__attribute__((target("avx512f,avx512bw")))
static inline __m512 dq_round_bf16_512(__m512 v) {
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, dq_round_bf16_512_finite(v), _mm512_set1_ps(NAN));
}

// Lanes of 16 fp32 weights whose bf16 rounding vdpbf16ps would not read exactly: subnormal (it reads subnormals as
// zero, and vcvtneps2bf16 flushes one that would round up to bf16's smallest normal), infinite or NaN. Every other
// value vcvtneps2bf16 rounds to nearest even, exactly as dq_bf16_rne.
__attribute__((target("avx512f,avx512dq")))
static inline __mmask16 dq_bf16_unsafe_512(__m512 v) {
    return _mm512_fpclass_ps_mask(v, 0x01 | 0x08 | 0x10 | 0x20 | 0x80);  // QNaN, +Inf, -Inf, subnormal, SNaN
}

// t0 (entries 0-7) and t1 (8-15) looked up at 8 indices below 16: bit 3 picks the register.
__attribute__((target("avx2,fma")))
static inline __m256 dq_lookup16_256(__m256 t0, __m256 t1, __m256i idx) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// The largest |x| of x[0 .. n) (-inf if n == 0), 8 lanes at a time, with each |x| = inf counted as inf_as and,
// with keep_nan, NaN if any NaN (else NaN is skipped): the bits of reductions.block_stat_abs + block_reduce "max"
// (a row of Int8Rowwise's training path: inf_as 0, keep_nan; a block of BlockFloat8: inf_as 2^-149, NaN skipped).
__attribute__((target("avx2")))
static inline float dq_absmax_avx2(const float* x, int64_t n, float inf_as, bool keep_nan) {
    __m256 acc = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 inf = _mm256_set1_ps(INFINITY), inf_v = _mm256_set1_ps(inf_as);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + j), mask);
        v = _mm256_blendv_ps(v, inf_v, _mm256_cmp_ps(v, inf, _CMP_EQ_OQ));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        acc = _mm256_max_ps(v, acc);  // acc where v is NaN (the second operand)
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float m = -INFINITY;
    for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; j < n; ++j) {
        float t = std::fabs(x[j]);
        t = t == INFINITY ? inf_as : t;
        if (t != t) any_nan = true;
        else if (t > m) m = t;
    }
    return (any_nan && keep_nan) ? NAN : (j > 0 ? m : -INFINITY);
}
