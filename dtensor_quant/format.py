"""The base class a quantized format derives from: layout, math and kernel only.

A format is a frozen dataclass (its parameters are part of its identity and
of every checkpoint) that says three things about a 2-D weight ``[out, in]``:

* ``layout``: for each inner tensor, one :mod:`~dtensor_quant.layout`
  relation per logical dim. The library derives every DTensor, FSDP2 and DCP
  op from it. A format whose blocks depend on the weight's shape (NF4's
  blocks of block-scales) overrides ``layout_for(shape)`` instead.
* ``quantize``/``dequantize``: the math, on a (possibly sharded) local
  weight. Statistics that a scale needs from the whole weight go through
  ``reduce``, which is the identity on one process and an all-reduce over the
  mesh dims whose shards share a block when the weight is a sharded DTensor.
* ``unpack`` (optional): ``dequantize`` at memory speed for whole weights,
  which FSDP2's gathers and the backward's input gradient use.
* N-D weights ``[..., out, in]`` (fused mixture-of-experts parameters
  ``[experts, out, in]``) need nothing from the format: :func:`weight_layout`
  prepends a one-to-one relation per leading dim to every inner tensor, and
  the library quantizes and dequantizes each ``[out, in]`` matrix with the
  2-D math, so an expert's bytes are those of quantizing it on its own.
* ``prepare``/``linear`` (optional): a fast ``x @ W.T``. ``prepare`` turns the
  canonical inner tensors into whatever the kernel wants (the library caches
  it per weight); ``linear`` returning ``None`` falls back to dequantize +
  matmul.
"""

from __future__ import annotations

import functools

import torch

from .layout import OneToOne, Relation


class Reducer:
    """Combines a statistic over the shards that share its blocks; here, one unsharded weight.

    ``full_shape`` is the logical shape of the whole weight (a format whose
    layout depends on it needs it while quantizing a shard).
    """

    def __init__(self, full_shape):
        self.full_shape = tuple(full_shape)

    def __call__(self, stat: torch.Tensor, op: str, like: str) -> torch.Tensor:
        """Combine ``stat`` (laid out like inner ``like``) with the other shards' (``op``: max, min or sum)."""
        return stat


class QuantFormat:
    """Subclass as a ``@dataclass(frozen=True)``; see the module docstring."""

    @property
    def layout(self) -> dict[str, tuple[Relation, ...]]:
        raise NotImplementedError

    def layout_for(self, shape) -> dict[str, tuple[Relation, ...]]:
        """The relations for a weight of logical ``shape`` (default: ``layout``, shape-independent)."""
        return self.layout

    def check_weight(self, shape: torch.Size, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` for a weight this format cannot hold."""
        if len(shape) != 2:
            raise ValueError(f"{self} quantizes 2-D weights [out, in]; got shape {tuple(shape)}")
        if not dtype.is_floating_point:
            raise ValueError(f"{self} quantizes floating-point weights; got {dtype}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Dense values from the inner tensors of a canonical ``[out, in]`` weight or shard.

        The library hands them over broadcastable to the logical shape: a
        blocked inner tensor repeated once per element (partial last block
        cut), a constant one of size 1; packed ones arrive as stored. So the
        math is elementwise and never needs the full weight's shape.
        """
        raise NotImplementedError

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """Optional fast dequantize: write the values into ``out`` and return True, or return False.

        ``inner`` are the *stored* tensors (not broadcast) of a canonical
        ``[out, in]`` weight whose packs and column blocks are whole (a chunk
        of rows of one, cut on its row blocks; the last row block may be
        partial); ``out`` is a preallocated tensor
        of that shape whose dtype is the result's. The bits must equal
        ``dequantize``'s (a table lookup per byte, one broadcast multiply per
        block). :mod:`dtensor_quant.unpack` calls it.
        """
        return False

    def prepare(self, inner: dict[str, torch.Tensor]):
        """The kernel's view of a canonical weight (cached by the library); default: ``inner``."""
        return inner

    def linear(self, x: torch.Tensor, prepared, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x @ W.T + bias`` from ``prepare``'s result, or None to dequantize instead."""
        return None

    @functools.cached_property
    def inner_names(self) -> tuple[str, ...]:
        """The inner tensors, in the order of every layout (override with ``layout_for``).

        Cached on the (frozen) format: every QuantizedTensor construction checks it.
        """
        return tuple(self.layout)


def weight_layout(fmt: QuantFormat, shape) -> dict[str, tuple[Relation, ...]]:
    """``fmt``'s relations for a weight of logical ``shape`` ``[..., out, in]``.

    A leading (expert) dim is one-to-one for every inner tensor: each matrix
    keeps its own codes and scales, so slicing, sharding and gathering along
    it never cuts a block. Library code asks this, never ``fmt.layout_for``
    directly, so a format only ever sees 2-D shapes.
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{fmt} quantizes weights [..., out, in] of at least 2 dims; got shape {shape}")
    lead = (OneToOne(),) * (len(shape) - 2)
    return {name: lead + tuple(rels) for name, rels in fmt.layout_for(shape[-2:]).items()}


def check_weight(fmt: QuantFormat, shape, dtype: torch.dtype) -> None:
    """``fmt.check_weight`` for a weight ``[..., out, in]``: the format checks one ``[out, in]`` matrix."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{fmt} quantizes weights [..., out, in] of at least 2 dims; got shape {shape}")
    try:
        fmt.check_weight(torch.Size(shape[-2:]), dtype)
    except ValueError as e:
        if len(shape) == 2:
            raise
        raise type(e)(f"each [out, in] matrix {shape[-2:]} of the {shape} weight: {e}") from None
