"""C++ kernels built once per machine, for formats whose matmul torch ships no CPU kernel for.

torch 2.13 has weight-only CPU kernels for int8 and int4 only. A format with
another layout (NF4's 16-level table, float8's bits) that wants a one-token
``x @ W.T`` at memory speed keeps the C++ source of its kernel in a ``.cpp``
file beside its module (``_formats/nf4.cpp``), which includes the shared
helpers of ``native_prelude.h`` beside this one, and loads it here. The
source is compiled with the compiler and the
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
and warns once (:class:`KernelUnavailableWarning`); the format's ``linear``
then returns None: the library dequantizes and multiplies, the plain path.
``DTENSOR_QUANT_NATIVE=0`` turns these kernels off (without a warning).

The kernels read the format's stored bytes and compute each weight exactly
as the format's ``dequantize`` does (the same products, rounded the same way
to the activation's dtype); only the order of the fp32 sum differs from
dequantize + mm, as in torch's int4/int8 kernels.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_KERNELS: dict[tuple[str, str], tuple[Callable, int] | None] = {}  # by name and source file
_WHY_NOT: dict[tuple[str, str], str] = {}  # as _KERNELS: why it cannot run here (what its warning said)


def enabled() -> bool:
    return os.environ.get("DTENSOR_QUANT_NATIVE", "1") != "0"


def source(path: Path, _seen: set[Path] | None = None) -> str:
    """The text of the kernel source ``path``, each ``#include "x.h"`` inlined once.

    A header is looked up beside the including file first (a format's own
    ``_formats/block_float8.h``), then beside this module (``native_prelude.h``).

    The inlined text is what the disk cache keys on, so an edit to a header
    rebuilds every kernel that includes it. Other includes (``<immintrin.h>``)
    are left to the compiler; a header's ``#pragma once`` becomes this
    once-only inlining.
    """
    seen = set() if _seen is None else _seen

    def inline(match: re.Match) -> str:
        header = path.parent / match.group(1)  # a header beside the source, else one beside this module
        if not header.is_file():
            header = _HERE / match.group(1)
        if not header.is_file():
            return match.group(0)
        if header in seen:
            return ""
        seen.add(header)
        return _PRAGMA_ONCE.sub("", source(header, seen))

    return _INCLUDE.sub(inline, path.read_text())


_HERE = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^#pragma once$", re.MULTILINE)


def load(name: str, path: Path, argtypes: list[str], probe: Callable[[Callable], int]) -> tuple[Callable, int] | None:
    """``(kernel, level)`` for the C++ source file ``path``, built once per machine; None where it cannot run.

    ``probe(kernel)`` calls the kernel on no rows and returns the vector
    level it reports; level 0 (no vector path on this CPU) counts as
    unavailable. Where the kernel cannot run, a warning says so once per
    process and source, naming the slower path every matmul then takes.
    """
    if not enabled():
        return None
    key = (name, str(path))
    if key not in _KERNELS:
        _KERNELS[key] = None
        try:
            from torch._inductor.codecache import CppPythonBindingsCodeCache

            kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, source(path), needs_vec_isa=False)
            level = probe(kernel)
            if level > 0:
                _KERNELS[key] = (kernel, level)
            else:
                _say_unavailable(key, "this CPU has neither AVX2 with FMA nor AVX-512, or flushes denormals to zero")
        except Exception as e:  # no compiler, no inductor, a changed loader: the plain path
            text = str(e)  # a compile error: the compiler's output says why, the command line before it does not
            text = text[text.find("Output:") :] if "Output:" in text else text
            _say_unavailable(key, f"it did not build: {type(e).__name__}: {text[:800]}")
    return _KERNELS[key]


def why_unavailable(name: str, path: Path) -> str | None:
    """Why the kernel ``name`` built from ``path`` cannot run in this process (its build error, or the CPU), once
    :func:`load` has tried it; None if it runs, was not tried, or the kernels are off (``DTENSOR_QUANT_NATIVE=0``)."""
    return _WHY_NOT.get((name, str(path)))


def _say_unavailable(key: tuple[str, str], why: str) -> None:
    name = key[0]
    _WHY_NOT[key] = why
    warnings.warn(
        f"dtensor_quant: the {name} C++ kernel cannot run here ({why}); matmuls with {name} weights dequantize "
        "the weight and multiply densely instead (dequantize + mm: several times slower for few tokens). "
        "DTENSOR_QUANT_NATIVE=0 turns the kernels off without this warning.",
        KernelUnavailableWarning,
        stacklevel=3,
    )


class KernelUnavailableWarning(RuntimeWarning):
    """A format's C++ kernel could not be built or cannot run on this CPU: its matmuls take dequantize + mm."""


# The flags every kernel's entry point takes: x and out are fp32 (else bf16); several tokens through the tiled
# matmul of native_tiles.h (else the one-token kernel); every weight rounded to bf16 (the tiles).
F32, TILES, ROUND = 1, 2, 4
# The vector levels a kernel reports (native_tiles.h; level 4, AMX, the tiles only), and the highest.
LEVEL_NAMES = {1: "AVX2", 2: "AVX-512", 3: "AVX-512 BF16", 4: "AMX"}
BEST_LEVEL = max(LEVEL_NAMES)


def max_level_from_env() -> int:
    """``DTENSOR_QUANT_MAX_LEVEL`` as a level (unset or empty: the best), or a ValueError naming the levels."""
    value = os.environ.get("DTENSOR_QUANT_MAX_LEVEL", "").strip()
    if not value:
        return BEST_LEVEL
    if value not in {str(k) for k in LEVEL_NAMES}:
        names = ", ".join(f"{k} ({n})" for k, n in LEVEL_NAMES.items())
        raise ValueError(f"DTENSOR_QUANT_MAX_LEVEL={value!r}: it caps the kernels' vector path at one of {names}")
    return int(value)


#: The highest vector level any kernel takes: ``DTENSOR_QUANT_MAX_LEVEL`` (read on import), else every level
#: this CPU has. Every level multiplies the same weights (each level sums in its own order); a cap reproduces
#: a CPU without AMX (3) or without AVX-512 (1) for a benchmark (``ONEDNN_MAX_CPU_ISA`` caps torch's GEMM alike).
MAX_LEVEL = max_level_from_env()
# The activation dtypes the tiled kernels take (fp16 dequantizes: its products would round to fp16 first).
TILE_DTYPES = (torch.bfloat16, torch.float32)
# Past this many tokens dequantize + mm (one dequantization, then torch's GEMM) is as fast as the tiles, which
# dequantize the weight once per 128 tokens.
TILES_MAX_TOKENS = 1024
# Up to this many tokens (AVX-512 BF16) the tiles multiply a few rows as they are, inner products summed at the
# end; more, through transposed tiles (outer products): ``DQ_FEW`` of native_tiles.h. Measured crossover on an
# AVX-512 BF16 CPU (1 thread, 2048x5632 and 5632x2048 NF4/int4 weights, interleaved A/B): the inner products are
# 7-20% faster at 17-24 tokens, even at 32, slower from 48.
TILES_FEW_TOKENS = 32


def matmul(
    kernel: tuple[Callable, int] | None,
    inputs: tuple,
    x: torch.Tensor,
    out_features: int,
    params: tuple,
    *,
    tiles: bool,
    round_weights: bool = False,
    max_level: int | None = None,
) -> torch.Tensor | None:
    """``x @ W.T`` (``[tokens, out_features]``, ``x``'s dtype) through a loaded kernel; None if it refused.

    Every kernel's entry point is ``kernel(*inputs, x, out, M, N, K, *params,
    flags, max_level, threads, level)``: the weight's prepared tensors, then
    the format's own integers (a block size). ``max_level`` caps the vector
    path (default: :data:`MAX_LEVEL`, the best here unless capped). A kernel refuses (reports level 0) where
    flush-to-zero was turned on since its probe, or for a path it lacks; no
    kernel (``DTENSOR_QUANT_NATIVE=0`` since the inputs were made) is None too.
    """
    if kernel is None:  # DTENSOR_QUANT_NATIVE=0 set after the weight's kernel inputs were made
        return None
    run, best = kernel
    x = x.contiguous()
    out = x.new_empty((x.shape[0], out_features))
    flags = (F32 if x.dtype == torch.float32 else 0) | (TILES if tiles else 0) | (ROUND if round_weights else 0)
    level = min(best, MAX_LEVEL if max_level is None else max_level)
    ran = level_out()
    run(*inputs, x, out, x.shape[0], out_features, x.shape[1], *params, flags, level, torch.get_num_threads(), ran)
    return out if int(ran) else None


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
