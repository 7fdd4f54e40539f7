"""Noise for stochastic rounding that depends only on (seed, step, global element index).

Stochastic rounding rounds ``x`` between two neighbouring codes ``lo <= x <
hi`` up with probability ``(x - lo) / (hi - lo)``, so small updates survive
in expectation instead of being rounded away. The random number each element
uses must not depend on how the weight is sharded: a 2-rank run, a 3-rank run
and one interrupted and resumed must round every element the same way. So
the numbers come from a counter-based hash, not from a generator's stream:
element ``i`` (its row-major index in the *whole* logical weight) at
requantization ``step`` of a weight whose seed is ``seed`` gets

    u = (fmix(fmix(i_lo ^ key) ^ i_hi) >> 8) / 2**24,  key = fmix(seed_lo ^ fmix(seed_hi ^ fmix(step)))

(the ``i_hi`` round only where the whole weight has ``2**32`` elements or more, a
fact of its global shape that every rank agrees on), a float32 in ``[0, 1)``
with 24 random bits. ``fmix`` is a 32-bit xorshift-multiply finalizer whose
multipliers are below ``2**31``, so the torch reference below computes it in
int64 without overflow and a C++ kernel in uint32 gets the same bits.

The torch reference costs about a dozen int64 passes over the shard; the C++
kernel (built once per machine through :mod:`dtensor_quant._core.native`) one pass.
Both give identical bits (a test compares them); ``DTENSOR_QUANT_NATIVE=0``
uses the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x45D9F3B, 0x2C1B3C6D  # odd, below 2**31: products of a 32-bit value fit in int64


def _fmix_int(h: int) -> int:
    h &= _M32
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 15
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """``_fmix_int`` on an int64 tensor of values in ``[0, 2**32)``."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 15)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def key(seed: int, step: int) -> int:
    """The 32-bit key of requantization ``step`` of the weight seeded with ``seed`` (any 64-bit ints)."""
    return _fmix_int((seed & _M32) ^ _fmix_int(((seed >> 32) & _M32) ^ _fmix_int(step & _M32)))


def _wide(global_shape: Sequence[int]) -> bool:
    n = 1
    for s in global_shape:
        n *= int(s)
    return n > _M32


def _global_index(shape, offsets, global_shape, device) -> torch.Tensor:
    """Row-major index in ``global_shape`` of every element of the block ``shape`` at ``offsets`` (int64)."""
    index = torch.zeros((1,) * len(shape), dtype=torch.int64, device=device)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        view = [1] * len(shape)
        view[d] = shape[d]
        index = index + ((torch.arange(shape[d], dtype=torch.int64, device=device) + offsets[d]) * stride).view(view)
        stride *= int(global_shape[d])
    return index.expand(tuple(shape))


def uniform_reference(
    seed: int, step: int, shape: Sequence[int], offsets: Sequence[int], global_shape: Sequence[int], device=None
) -> torch.Tensor:
    """The noise of the block ``shape`` at ``offsets`` of a weight of ``global_shape``, in torch ops."""
    index = _global_index(tuple(shape), tuple(offsets), tuple(global_shape), device)
    h = _fmix((index & _M32) ^ key(seed, step))
    if _wide(global_shape):
        h = _fmix(h ^ (index >> 32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class Noise:
    """The stochastic-rounding noise of one local block: what a format's ``quantize_stochastic`` receives.

    ``uniform()`` is the float32 tensor; a format with a kernel of its own may
    draw the same numbers itself from ``key``, ``offsets``, ``global_shape``
    and ``wide`` (``_core/native_noise.h``). ``values``, when given, replaces the
    hash (tests, or a caller with noise of its own): kernels then step aside.
    """

    seed: int
    step: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    device: torch.device | str = "cpu"
    values: torch.Tensor | None = None

    @classmethod
    def of(cls, values: torch.Tensor) -> Noise:
        """Given noise (uniform in ``[0, 1)``, float32, one value per element of the block)."""
        shape = tuple(values.shape)
        return cls(0, 0, shape, (0,) * len(shape), shape, values.device, values.float())

    @property
    def key(self) -> int:
        return key(self.seed, self.step)

    @property
    def wide(self) -> bool:
        return _wide(self.global_shape)

    def uniform(self) -> torch.Tensor:
        if self.values is not None:
            return self.values
        return uniform(self.seed, self.step, self.shape, self.offsets, self.global_shape, self.device)


def uniform(
    seed: int, step: int, shape: Sequence[int], offsets: Sequence[int], global_shape: Sequence[int], device=None
) -> torch.Tensor:
    """Float32 noise in ``[0, 1)`` for the local block ``shape`` at ``offsets`` of a weight of ``global_shape``.

    A 2-D block on the CPU goes through the C++ kernel when it is available;
    anything else (and ``DTENSOR_QUANT_NATIVE=0``) through
    :func:`uniform_reference`. Both give the same bits.
    """
    shape, offsets, global_shape = tuple(shape), tuple(offsets), tuple(global_shape)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if len(shape) == 2 and device.type == "cpu" and 0 not in shape:
        kernel = _kernel()
        if kernel is not None:
            out = torch.empty(shape, dtype=torch.float32)
            fn, _ = kernel
            fn(out, key(seed, step), offsets[0], offsets[1], int(global_shape[1]), int(_wide(global_shape)))
            return out
    return uniform_reference(seed, step, shape, offsets, global_shape, device)


# Any x86 CPU runs it (a plain loop where AVX2 is missing): the same bits either way.
KERNEL = native.declare("stochastic_noise", Path(__file__).with_name("stochastic.cpp"), {"gcols": 1}, vector_only=False)


_CALLS: dict = {}


def _kernel():
    loaded = native.load(KERNEL)
    if loaded is None:
        return None
    call = _CALLS.get(id(loaded))
    if call is None:
        fn, level = loaded
        ran = native.level_out()

        def run(out, k, row0, col0, gcols, wide):
            fn(out, k, row0, col0, gcols, wide, out.shape[0], out.shape[1], ran)

        call = _CALLS[id(loaded)] = (run, level)
    return call
