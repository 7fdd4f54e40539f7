"""C++ kernels built once per machine, for formats whose matmul torch ships no CPU kernel for.

torch 2.13 has weight-only CPU kernels for int8 and int4 only. A format with
another layout (NF4's 16-level table, float8's bits) that wants a one-token
``x @ W.T`` at memory speed keeps the C++ source of its kernel in a ``.cpp``
file beside its module (``_formats/nf4.cpp``), which includes the shared
helpers of ``native_prelude.h`` beside this one, and declares it once
(:func:`declare`: a name, the file, what its probe passes). The source's
``void kernel(...)`` is the kernel's signature; :mod:`.native_build` compiles
it with a Python binding generated from that signature into a cache keyed by
the source, the flags and the CPU level it was built for (the cache, and why
it is safe to share between machines: that module's docstring), so a machine
compiles each source once (a few seconds) and every later process loads it
in milliseconds; a call costs about a microsecond.

Vector code sits in functions with ``target`` attributes and is chosen at
run time (``__builtin_cpu_supports``); the rest of a build uses only the
instructions of its level. A kernel's entry point ``kernel(..., max_level,
threads, level)`` writes the vector level it ran (0: none here) into
``level``; called with no rows it only reports it. :func:`load` returns None
when anything is missing -- no C++ compiler, a CPU without the vector ISA --
and warns once (:class:`KernelUnavailableWarning`); the format's ``linear``
then returns None: the library dequantizes and multiplies, the plain path.
``DTENSOR_QUANT_NATIVE=0`` turns these kernels off (without a warning).

The kernels read the format's stored bytes and compute each weight exactly
as the format's ``dequantize`` does (the same products, rounded the same way
to the activation's dtype); only the order of the fp32 sum differs from
dequantize + mm, as in torch's int4/int8 kernels.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import config, native_build


def enabled() -> bool:
    return config.get("native")


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


@dataclass(frozen=True)
class Kernel:
    """A C++ kernel: its name, its source file, and what its probe passes.

    The source defines ``void kernel(...)``; that signature is the only
    declaration of its parameters (pointers take tensors, ``int64_t`` ints,
    the last ``int64_t* level`` the vector level it ran), and the Python
    binding is generated from it (:mod:`dtensor_quant._core.native_build`).
    :func:`load` probes a build by calling it on no rows: an empty tensor for
    each pointer, ``probe[name]`` (else 0) for each integer -- the values that
    make it report its best level (a block size its checks accept, the flags).
    A kernel with ``vector_only`` (all but the noise, which has a plain loop)
    reporting level 0 does not run here.
    """

    name: str
    source: Path
    probe: Mapping[str, int] = field(default_factory=dict)
    vector_only: bool = True


#: Every kernel the package declares (:func:`declare`), by name: what ``python -m dtensor_quant kernels --build``
#: builds.
DECLARED: dict[str, Kernel] = {}


def declare(name: str, source: Path, probe: Mapping[str, int] | None = None, vector_only: bool = True) -> Kernel:
    """A format's kernel (see :class:`Kernel`), listed in :data:`DECLARED`."""
    kernel = Kernel(name, source, dict(probe or {}), vector_only)
    DECLARED[name] = kernel
    return kernel


def load(kernel: Kernel, say: Callable[[str], None] | None = None) -> tuple[Callable, int] | None:
    """``(entry point, level)`` of ``kernel``, built once per machine and CPU level; None where it cannot run.

    Level 0 of a ``vector_only`` kernel (no vector path on this CPU) counts
    as unavailable. Where the kernel cannot run, a warning says so once per
    process and source, naming the slower path every matmul then takes.
    ``say`` hears of a build (``kernels --build``).
    """
    if not enabled():
        return None
    level = native_build.cpu_level()
    key = (kernel.name, str(kernel.source), level)
    if key not in _KERNELS:
        _KERNELS[key] = None
        try:
            run, _ = native_build.load(kernel.name, source(kernel.source), level, say)
            best = _probe(run, kernel)
            if best > 0 or not kernel.vector_only:
                _KERNELS[key] = (run, best)
            else:
                _say_unavailable(key, "this CPU has neither AVX2 with FMA nor AVX-512, or flushes denormals to zero")
        except Exception as e:  # no compiler, a bad signature: the plain path
            text = str(e)  # a compile error: the compiler's output says why, the command line before it does not
            text = text[text.find("Output:") :] if "Output:" in text else text
            _say_unavailable(key, f"it did not build: {type(e).__name__}: {text[:800]}")
    return _KERNELS[key]


def _probe(run: Callable, kernel: Kernel) -> int:
    params = native_build.parameters(source(kernel.source))
    empty, level = torch.empty(0), level_out()
    run(*[kernel.probe.get(n, 0) if t == "int64_t" else empty for t, n in params[:-1]], level)
    return int(level)


def why_unavailable(kernel: Kernel) -> str | None:
    """Why ``kernel`` cannot run in this process (its build error, or the CPU), once :func:`load` has tried it;
    None if it runs, was not tried, or the kernels are off (``DTENSOR_QUANT_NATIVE=0``)."""
    return next((why for key, why in _WHY_NOT.items() if key[:2] == (kernel.name, str(kernel.source))), None)


def cache_folder() -> Path:
    """Where the kernels built for this CPU, torch and Python live (see :mod:`dtensor_quant._core.native_build`)."""
    return native_build.folder(native_build.cpu_level())


def _say_unavailable(key: tuple, why: str) -> None:
    name = key[0]
    _WHY_NOT[key] = why
    warnings.warn(
        f"dtensor_quant: the {name} C++ kernel cannot run here ({why}); matmuls with {name} weights dequantize "
        "the weight and multiply densely instead (dequantize + mm: several times slower for few tokens). "
        "DTENSOR_QUANT_NATIVE=0 turns the kernels off without this warning.",
        KernelUnavailableWarning,
        stacklevel=3,
    )


_KERNELS: dict[tuple, tuple[Callable, int] | None] = {}  # by name, source file and build level
_WHY_NOT: dict[tuple, str] = {}  # as _KERNELS: why it cannot run here (what its warning said)


class KernelUnavailableWarning(RuntimeWarning):
    """A format's C++ kernel could not be built or cannot run on this CPU: its matmuls take dequantize + mm."""


# The flags every kernel's entry point takes: x and out are fp32 (else bf16); several tokens through the tiled
# matmul of native_tiles.h (else the one-token kernel); every weight rounded to bf16 (the tiles).
F32, TILES, ROUND = 1, 2, 4
# The vector levels a kernel reports (native_tiles.h; level 4, AMX, the tiles only), and the highest.
LEVEL_NAMES = {1: "AVX2", 2: "AVX-512", 3: "AVX-512 BF16", 4: "AMX"}
BEST_LEVEL = max(LEVEL_NAMES)
#: What the matmul kernels' probe passes besides their own integers (:class:`Kernel`): the tiles, any level, one
#: thread.
MATMUL_PROBE = {"flags": TILES, "max_level": BEST_LEVEL, "threads": 1}


def max_level_from_env() -> int:
    """``DTENSOR_QUANT_MAX_LEVEL`` as a level (unset or empty: the best), or a ConfigError (a ValueError) naming
    the levels."""
    level = config.get("max_level")
    return BEST_LEVEL if level is None else level


def _max_level_on_import() -> int | None:
    try:
        return max_level_from_env()
    except config.ConfigError:
        return None  # raised where a kernel first asks for it (cap()), not by ``import dtensor_quant``


#: The highest vector level any kernel takes: ``DTENSOR_QUANT_MAX_LEVEL`` (read on import), else every level
#: this CPU has. Every level multiplies the same weights (each level sums in its own order); a cap reproduces
#: a CPU without AMX (3) or without AVX-512 (1) for a benchmark (``ONEDNN_MAX_CPU_ISA`` caps torch's GEMM alike).
#: None while the variable holds a value it does not take: :func:`cap` raises the error then.
MAX_LEVEL = _max_level_on_import()


def cap() -> int:
    """:data:`MAX_LEVEL`, or the ConfigError of a ``DTENSOR_QUANT_MAX_LEVEL`` it could not read."""
    return MAX_LEVEL if MAX_LEVEL is not None else max_level_from_env()


# The activation dtypes the tiled kernels take (fp16 dequantizes: its products would round to fp16 first).
TILE_DTYPES = (torch.bfloat16, torch.float32)
# Past this many tokens dequantize + mm (one dequantization, then torch's GEMM) is as fast as the tiles, which
# dequantize the weight once per 128 tokens.
TILES_MAX_TOKENS = 1024
# Up to this many tokens (AVX-512 BF16) the tiles multiply a few rows as they are, inner products summed at the
# end; more, through transposed tiles (outer products): ``DQ_FEW`` of native_tiles.h. The crossover was measured
# on an AVX-512 BF16 CPU (docs/performance.md).
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
    level = min(best, cap() if max_level is None else max_level)
    ran = level_out()
    run(*inputs, x, out, x.shape[0], out_features, x.shape[1], *params, flags, level, torch.get_num_threads(), ran)
    return out if int(ran) else None


def level_out() -> torch.Tensor:
    """The one-element buffer a kernel reports its vector level in."""
    return torch.zeros(1, dtype=torch.int64)


def inputs_for(x: torch.Tensor, prepared: Lazy):
    """The kernel inputs ``prepared`` holds (built now if not yet) when the kernels take activations ``x`` -- bf16
    or fp32 (:data:`TILE_DTYPES`), at most :data:`TILES_MAX_TOKENS` rows --, else None: dequantize + mm, and the
    inputs never built for it. None too where the weight has none (``prepared`` built None)."""
    if x.dtype not in TILE_DTYPES or x.shape[0] > TILES_MAX_TOKENS:
        return None
    return prepared.get()


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


# -- per-thread scratch buffers ---------------------------------------------------------------------------------

_SCRATCH = threading.local()
_SCRATCH_KEEP = 16  # shapes kept per thread (a model's token counts): past this the cache starts over


def scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU buffer of ``shape`` and ``dtype`` kept for this thread: a kernel's small side outputs (the level it
    ran, per-token scales) that its caller reads before returning and never hands out.

    Each activation-quantizing linear would otherwise allocate them on every call, a few microseconds each: a
    measurable share of a decode step. Per thread, so concurrent calls never share one; the next call of the same
    thread with the same shape overwrites it, so nothing read from it may outlive the call (copy it if it must).
    """
    try:
        cache = _SCRATCH.buffers
    except AttributeError:
        cache = _SCRATCH.buffers = {}
    key = (shape, dtype)
    buf = cache.get(key)
    if buf is None:
        if len(cache) >= _SCRATCH_KEEP:
            cache.clear()
        buf = cache[key] = torch.empty(shape, dtype=dtype)
    return buf
