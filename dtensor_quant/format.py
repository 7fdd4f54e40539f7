"""The base class a quantized format derives from: layout, math and kernel only.

A format is a frozen dataclass (its parameters are part of its identity and
of every checkpoint) that says three things about a 2-D weight ``[out, in]``:

* ``layout``: for each inner tensor, one :mod:`~dtensor_quant.layout`
  relation per logical dim. The library derives every DTensor, FSDP2 and DCP
  op from it.
* ``quantize``/``dequantize``: the math, on a (possibly sharded) local
  weight. Statistics that a scale needs from the whole weight go through
  ``reduce``, which is the identity on one process and an all-reduce over the
  mesh dims whose shards share a block when the weight is a sharded DTensor.
* ``prepare``/``linear`` (optional): a fast ``x @ W.T``. ``prepare`` turns the
  canonical inner tensors into whatever the kernel wants (the library caches
  it per weight); ``linear`` returning ``None`` falls back to dequantize +
  matmul.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .layout import Relation


class Reducer(Protocol):
    def __call__(self, stat: torch.Tensor, op: str, like: str) -> torch.Tensor:
        """Combine ``stat`` (shaped like inner ``like``) over the shards sharing its blocks.

        ``op`` is ``"max"``, ``"min"`` or ``"sum"``.
        """
        ...


def no_reduce(stat: torch.Tensor, op: str, like: str) -> torch.Tensor:
    """The reducer of an unsharded weight: every block is local."""
    return stat


class QuantFormat:
    """Subclass as a ``@dataclass(frozen=True)``; see the module docstring."""

    @property
    def layout(self) -> dict[str, tuple[Relation, ...]]:
        raise NotImplementedError

    def check_weight(self, shape: torch.Size, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` for a weight this format cannot hold."""
        if len(shape) != 2:
            raise ValueError(f"{self} quantizes 2-D weights [out, in]; got shape {tuple(shape)}")
        if not dtype.is_floating_point:
            raise ValueError(f"{self} quantizes floating-point weights; got {dtype}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, inner: dict[str, torch.Tensor]):
        """The kernel's view of a canonical weight (cached by the library); default: ``inner``."""
        return inner

    def linear(self, x: torch.Tensor, prepared, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x @ W.T + bias`` from ``prepare``'s result, or None to dequantize instead."""
        return None

    @property
    def inner_names(self) -> tuple[str, ...]:
        return tuple(self.layout)
