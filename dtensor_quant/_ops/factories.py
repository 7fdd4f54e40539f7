"""Factories: ``empty_like``, ``zeros_like``, ``new_zeros``, ``new_empty`` (FSDP2 and DTensor's empty shards).

``zeros_like``/``full_like`` of a trainable weight are dense: what optimizers
make of a parameter are its states (momentum, moments), numbers of its
logical shape and dtype, not quantized bytes. The factories that make room
for a weight's own bytes -- ``new_zeros``/``new_empty`` (FSDP2's padded
shards, DTensor's empty ones) and ``empty_like`` (``distribute_tensor``'s
scatter, ``Module.to_empty``) -- stay quantized for every weight.

Which weights are trainable is known above this layer: the slot
``"trainable"`` (:mod:`dtensor_quant._core.registry`), declared here and
provided by :mod:`dtensor_quant._training.trainable` on import, answers with
the weight's link or None; without a provider no weight is trainable.
"""

from __future__ import annotations

import torch

from .._core.dispatch import KEEPS_INITIAL, implements, refusal
from .._core.registry import declare
from .layout_ops import factory

_TRAINABLE = declare(
    "trainable",
    "(q) -> the link of the trainable weight whose local tensor is q (dense(q), requantize_(q, x)), or None",
    unprovided=lambda q: None,
)


@implements("aten::empty_like")
def _empty_like(func, q, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return factory(q, q.shape, torch.empty, dtype, device)


KEEPS_INITIAL.add(_empty_like)  # trunc_normal_'s scratch tensors: an initialisation goes on


@implements("aten::zeros_like")
def _zeros_like(func, q, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    if _TRAINABLE(q) is not None:
        return torch.zeros(q.shape, dtype=dtype or q.dtype, device=device or q.device)
    return factory(q, q.shape, torch.zeros, dtype, device)


@implements("aten::full_like")
def _full_like(func, q, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    if _TRAINABLE(q) is None:
        raise refusal(func, (q,), {}, " (full_like makes optimizer states only of trainable weights)")
    return torch.full(q.shape, fill_value, dtype=dtype or q.dtype, device=device or q.device)


@implements("aten::new_zeros")
def _new_zeros(func, q, size, dtype=None, layout=None, device=None, pin_memory=None):
    return factory(q, size, torch.zeros, dtype, device)


@implements("aten::new_empty")
def _new_empty(func, q, size, dtype=None, layout=None, device=None, pin_memory=None):
    return factory(q, size, torch.empty, dtype, device)
