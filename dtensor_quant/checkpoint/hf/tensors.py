"""The model side of a checkpoint: the key of each of a model's tensors, and this rank's slice of it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ...core.layout import partial_refused
from ..state_dict import is_quantized


def model_tensors(model: nn.Module):
    """``(checkpoint key, lora, tensor)`` for every parameter and persistent buffer, shared ones once.

    Inside a :class:`~dtensor_quant.lora.LoRALinear` the frozen ``base`` linear
    answers to the wrapper's own name (``q_proj.base.weight`` is the
    checkpoint's ``q_proj.weight``) and ``lora`` is the wrapper; its adapters
    come with key None (no Hugging Face checkpoint holds them).
    """
    seen, modules = set(), dict(model.named_modules())
    for prefix, module in modules.items():
        parent, _, child = prefix.rpartition(".")
        lora = modules.get(parent) if child in ("base", "lora_a", "lora_b") else None
        lora = lora if is_lora_wrapper(lora) else None
        persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for name, t in [*module._parameters.items(), *((n, module._buffers[n]) for n in persistent)]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if lora is None:
                yield (f"{prefix}.{name}" if prefix else name), None, t
            elif child == "base":
                yield (f"{parent}.{name}" if parent else name), lora, t
            else:
                yield None, lora, t


def is_lora_wrapper(module) -> bool:
    """Whether ``module`` wraps a frozen ``base`` linear with ``lora_a``/``lora_b`` adapters scaled by ``scaling``.

    :class:`dtensor_quant.lora.LoRALinear` is one; recognised by what it holds
    rather than by class, so that the checkpoint layer needs nothing from the
    model layer above it.
    """
    return all(hasattr(module, n) for n in ("base", "lora_a", "lora_b", "scaling"))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``t`` (``t`` itself when it is not a DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_slice(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's ``(shape, offset)`` in ``t``'s global tensor (the same arithmetic DCP uses)."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.ndim
    if any(isinstance(p, Partial) for p in t.placements):
        if is_quantized(t):
            raise partial_refused("a quantized weight", "Partial", f" ({t.placements} has no slice to read or write)")
        raise ValueError(f"a Partial tensor ({t.placements}) has no slice to read or write; redistribute it first")
    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)


def stored_suffixes(t: torch.Tensor) -> dict[str, str] | None:
    """The checkpoint key suffix of each inner tensor, for a format that has a Hugging Face layout."""
    if not is_quantized(t):
        return None
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.fmt.checkpoint_suffixes


def describe(t: torch.Tensor) -> str:
    """``t``'s format, or ``dense <dtype>``, for error messages."""
    if not is_quantized(t):
        return f"dense {t.dtype}"
    return str((t._local_tensor if isinstance(t, DTensor) else t).fmt)
