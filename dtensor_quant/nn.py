"""Module-level helpers: quantize the Linear weights of a model in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .format import QuantFormat
from .quantize import quantize
from .state_dict import is_quantized, register


def quantize_(
    model: nn.Module,
    fmt: QuantFormat,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` weight with a frozen quantized parameter, in place.

    Works before or after ``parallelize_module``: a DTensor weight is quantized
    shard by shard with the scale reductions its layout needs (bit-identical
    to quantizing the full weight), and a placement the layout cannot hold
    raises :class:`~dtensor_quant.LayoutError` naming the module. ``filter_fn(module,
    fqn)`` picks which Linears to quantize (default: all). The model's state
    dict then holds each quantized weight as its inner tensors
    (:mod:`dtensor_quant.state_dict`), ready for ``torch.distributed.checkpoint``.
    """
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or (filter_fn is not None and not filter_fn(module, fqn)):
            continue
        try:
            weight = quantize(module.weight.detach(), fmt)
        except ValueError as e:
            raise type(e)(f"{fqn}.weight: {e}") from None
        module.weight = nn.Parameter(weight, requires_grad=False)
        if not getattr(module, "_dtensor_quant_frozen_check", False):
            module.register_forward_pre_hook(_refuse_trainable(fqn))
            module._dtensor_quant_frozen_check = True
    return register(model)


def _refuse_trainable(fqn: str):
    """A forward pre-hook: a quantized weight with ``requires_grad=True`` is refused before any gradient.

    Its gradient would be dense (under FSDP2 also reduced), and the update
    could not be applied to quantized bytes: without this the first error
    comes from ``optimizer.step()``, after a wasted backward, naming no parameter.
    """

    def hook(module, args):
        if not torch.is_grad_enabled():
            return
        for name, p in module._parameters.items():
            if p is not None and p.requires_grad and is_quantized(p):
                raise ValueError(
                    f"{fqn + '.' if fqn else ''}{name} is quantized and has requires_grad=True: its gradient would be "
                    "dense and no optimizer can update quantized bytes. Freeze it (requires_grad_(False)) and train "
                    "adapters (dtensor_quant.lora), or make it trainable with dtensor_quant.gather_quantized_."
                )

    return hook


def quantized_fqns(model: nn.Module) -> list[str]:
    """Names of the parameters of ``model`` that hold quantized weights."""
    from torch.distributed.tensor import DTensor

    from .tensor import QuantizedTensor

    out = []
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, QuantizedTensor):
            out.append(name)
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes this process stores for ``model``'s parameters (quantized ones at their stored size)."""
    from torch.distributed.tensor import DTensor

    from .tensor import QuantizedTensor

    total = 0
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += local.nbytes_stored if isinstance(local, QuantizedTensor) else local.numel() * local.element_size()
    return total
