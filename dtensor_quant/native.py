"""C++ kernels built once per machine, for formats whose matmul torch ships no CPU kernel for.

torch 2.13 has weight-only CPU kernels for int8 and int4 only. A format with
another layout (NF4's 16-level table, float8's bits) that wants a one-token
``x @ W.T`` at memory speed keeps the C++ source of its kernel in a ``.cpp``
file beside its module (``formats/nf4.cpp``), which includes the shared
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


def enabled() -> bool:
    return os.environ.get("DTENSOR_QUANT_NATIVE", "1") != "0"


def source(path: Path) -> str:
    """The text of the kernel source ``path``, each ``#include "x.h"`` of a header beside this module inlined.

    The inlined text is what the disk cache keys on, so an edit to a header
    rebuilds every kernel that includes it. Other includes (``<immintrin.h>``)
    are left to the compiler.
    """

    def inline(match: re.Match) -> str:
        header = _HERE / match.group(1)
        return source(header) if header.is_file() else match.group(0)

    return _INCLUDE.sub(inline, path.read_text())


_HERE = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)


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
                _say_unavailable(name, "this CPU has neither AVX2 with FMA nor AVX-512, or flushes denormals to zero")
        except Exception as e:  # no compiler, no inductor, a changed loader: the plain path
            _say_unavailable(name, f"it did not build: {type(e).__name__}: {str(e)[:500]}")
    return _KERNELS[key]


def _say_unavailable(name: str, why: str) -> None:
    warnings.warn(
        f"dtensor_quant: the {name} C++ kernel cannot run here ({why}); matmuls with {name} weights dequantize "
        "the weight and multiply densely instead (dequantize + mm: several times slower for few tokens). "
        "DTENSOR_QUANT_NATIVE=0 turns the kernels off without this warning.",
        KernelUnavailableWarning,
        stacklevel=3,
    )


class KernelUnavailableWarning(RuntimeWarning):
    """A format's C++ kernel could not be built or cannot run on this CPU: its matmuls take dequantize + mm."""


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
