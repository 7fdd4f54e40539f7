"""C++ kernels built once per machine, for formats whose matmul torch ships no CPU kernel for.

torch 2.13 has weight-only CPU kernels for int8 and int4 only. A format with
another layout (NF4's 16-level table, float8's bits) that wants a one-token
``x @ W.T`` at memory speed keeps the C++ source of its kernel in its own
file and loads it here. The source is compiled with the compiler and the
loader inductor uses for its own CPU kernels
(``torch._inductor.codecache.CppPythonBindingsCodeCache``): a disk cache
keyed by the source and flags, so a machine compiles each source once (a
few seconds) and every later process loads it in milliseconds, and a Python
binding that takes tensors directly (about a microsecond a call).

Vector code sits in functions with ``target`` attributes and is chosen at
run time (``__builtin_cpu_supports``), so one build runs on any x86 CPU. A
kernel's entry point ``kernel(..., max_level, threads, level)`` writes the
vector level it ran (0: none here) into ``level``; called with no rows it
only reports it. :func:`load` returns None when anything is missing -- no
C++ compiler, a torch whose loader moved, a CPU without the vector ISA --
and the format's ``linear`` then returns None: the library dequantizes and
multiplies, the plain path. ``DTENSOR_QUANT_NATIVE=0`` turns these kernels
off.

The kernels read the format's stored bytes and compute each weight exactly
as the format's ``dequantize`` does (the same products, rounded the same way
to the activation's dtype); only the order of the fp32 sum differs from
dequantize + mm, as in torch's int4/int8 kernels.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# What every kernel source starts with: bf16 helpers that round as c10::BFloat16 does.
PRELUDE = r"""
#include <immintrin.h>
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
    return dq_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
static inline bool dq_avx512_bf16() { return dq_avx512() && __builtin_cpu_supports("avx512bf16"); }

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
"""

_KERNELS: dict[str, tuple[Callable, int] | None] = {}


def enabled() -> bool:
    return os.environ.get("DTENSOR_QUANT_NATIVE", "1") != "0"


def load(name: str, source: str, argtypes: list[str], probe: Callable[[Callable], int]) -> tuple[Callable, int] | None:
    """``(kernel, level)`` for ``PRELUDE + source``, built once per machine; None where it cannot run.

    ``probe(kernel)`` calls the kernel on no rows and returns the vector
    level it reports; level 0 (no vector path on this CPU) counts as
    unavailable. Failures are logged once per kernel, at INFO.
    """
    if not enabled():
        return None
    if name not in _KERNELS:
        _KERNELS[name] = None
        try:
            from torch._inductor.codecache import CppPythonBindingsCodeCache

            kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, PRELUDE + source, needs_vec_isa=False)
            level = probe(kernel)
            if level > 0:
                _KERNELS[name] = (kernel, level)
            else:
                log.info("dtensor_quant: %s kernel: no vector path on this CPU; dequantizing instead", name)
        except Exception as e:  # no compiler, no inductor, a changed loader: the plain path
            log.info("dtensor_quant: %s kernel unavailable (%s: %s); dequantizing instead", name, type(e).__name__, e)
    return _KERNELS[name]


def level_out() -> torch.Tensor:
    """The one-element buffer a kernel reports its vector level in."""
    return torch.zeros(1, dtype=torch.int64)


class Lazy:
    """A format's ``prepare`` result for a kernel that only some calls run: built by the first call that runs it.

    The library prepares a weight before every matmul it takes part in
    (cached per weight, or per call for FSDP2's gathered weights); a
    one-token kernel's inputs (NF4's block scales, a scan for float8 NaN
    codes) would then cost every prefill and training step without ever
    being used. ``get()`` builds them once, on the first decode call.
    """

    __slots__ = ("_build", "_built", "_value")

    def __init__(self, build: Callable[[], object]):
        self._build, self._value, self._built = build, None, False

    def get(self):
        if not self._built:
            self._value, self._built = self._build(), True
        return self._value
