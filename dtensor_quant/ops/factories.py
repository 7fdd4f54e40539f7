"""Factories: ``empty_like``, ``zeros_like``, ``new_zeros``, ``new_empty`` (FSDP2 and DTensor's empty shards)."""

from __future__ import annotations

import torch

from ..core.dispatch import implements
from .layout_ops import factory


@implements("aten::empty_like")
def _empty_like(func, q, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return factory(q, q.shape, torch.empty, dtype, device)


@implements("aten::zeros_like")
def _zeros_like(func, q, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return factory(q, q.shape, torch.zeros, dtype, device)


@implements("aten::new_zeros")
def _new_zeros(func, q, size, dtype=None, layout=None, device=None, pin_memory=None):
    return factory(q, size, torch.zeros, dtype, device)


@implements("aten::new_empty")
def _new_empty(func, q, size, dtype=None, layout=None, device=None, pin_memory=None):
    return factory(q, size, torch.empty, dtype, device)
