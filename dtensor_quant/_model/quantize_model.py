"""Model-level helpers: quantize the matmul weights of a model (Linears and fused experts) in place.

``dq.quantize_`` is its public name (re-exported by :mod:`dtensor_quant._model` and the package root).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.conv import _ConvNd

from .._checkpoint.state_dict import is_quantized, register
from .._core.format import QuantFormat, check_format
from .._core.tensor import QuantizedTensor
from .._fsdp.all_gather import dequantized_from
from .._parallel.quantize import quantize
from .._training import trainable as _trainable_weights
from . import placed


def is_matmul_weight(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """Whether ``quantize_`` quantizes ``module.<name>``: an ``nn.Linear`` weight or a fused expert stack.

    A fused expert stack is a floating parameter of 3 or more dims ``[...,
    out, in]`` on any module but a convolution (transformers 5 MoE experts:
    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).
    """
    if isinstance(module, nn.Linear):
        return name == "weight"
    return param.ndim >= 3 and param.dtype.is_floating_point and not isinstance(module, _ConvNd)


def quantize_(
    model: nn.Module,
    fmt: QuantFormat,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    left_dense: list[tuple[str, str]] | None = None,
    transposed: Callable[[str], bool] | None = None,
    trainable: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Quantize every matmul weight of ``model`` into frozen quantized parameters, in place.

    The weights are those :func:`is_matmul_weight` names: every ``nn.Linear``
    weight and every fused expert stack ``[experts, out, in]`` (each expert
    quantized on its own). ``filter_fn(module, fqn)`` picks among them by
    module (default: all). Nothing it picks is skipped: a weight the format
    cannot hold raises, naming the parameter, and a model with no weight to
    quantize raises. Pass a list as ``left_dense`` to get ``(name, why)`` for
    every parameter that stays dense (excluded by the filter, or not a
    matmul weight: embeddings, norms, biases, routers kept as plain
    parameters).

    Works before or after ``parallelize_module`` / expert sharding: a DTensor
    weight is quantized shard by shard with the scale reductions its layout
    needs (bit-identical to quantizing the full weight), and a placement the
    layout cannot hold raises :class:`~dtensor_quant.LayoutError`. The model's
    state dict then holds each quantized weight as its inner tensors
    (:mod:`dtensor_quant.checkpoint`), ready for ``torch.distributed.checkpoint``.

    ``trainable=True`` makes them trainable instead (``nn.Linear`` weights,
    formats with stochastic rounding: Int8Rowwise, Float8Rowwise,
    Float8Tensorwise): parameters with ``requires_grad=True`` that stay
    quantized, get dense gradients, and that any ``torch.optim`` optimizer
    updates in place, requantizing with stochastic rounding keyed by
    ``seed``, each weight's name and its update count
    (:mod:`dtensor_quant._training.trainable`; docs/training.md).

    ``transposed(name)``: True for a parameter the model holds as ``[..., in,
    out]`` and multiplies as ``x @ W`` (gpt-oss's fused experts in
    transformers): it is quantized as ``[..., out, in]`` (blocks along its
    inputs) and the parameter is the transposed view.
    """
    check_format(fmt)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ takes a model (an nn.Module), got {type(model).__name__}; for a tensor: quantize")
    if trainable and not _trainable_weights.supports_training(fmt):
        raise ValueError(
            f"quantize_(..., trainable=True): {fmt} has no stochastic rounding (QuantFormat.quantize_stochastic), "
            "so optimizer updates could not be requantized without losing them. Use Int8Rowwise(), "
            "Float8Rowwise() or Float8Tensorwise(), or train adapters on frozen weights (dtensor_quant.lora)."
        )
    done = 0
    for fqn, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{fqn}.{name}" if fqn else name
            if not is_matmul_weight(module, name, param):
                _note(left_dense, full, f"not a matmul weight ({type(module).__name__}, {param.ndim}-D)")
                continue
            if filter_fn is not None and not filter_fn(module, fqn):
                _note(left_dense, full, "excluded by filter_fn")
                continue
            if trainable and param.ndim != 2:
                raise ValueError(f"{full}: trainable quantized weights are 2-D [out, in]; this one is {param.ndim}-D")
            try:
                if transposed is not None and transposed(full):
                    weight = quantize(param.detach().transpose(-2, -1), fmt).transpose(-2, -1)
                else:
                    weight = quantize(param.detach(), fmt)
            except ValueError as e:
                raise type(e)(f"{full}: {e}") from None
            setattr(module, name, nn.Parameter(weight, requires_grad=trainable))
            placed.own(module)  # in-place initialisation finds the weight's placement here
            done += 1
            if trainable:
                _trainable_weights.make_trainable(module, name, _trainable_weights.weight_seed(seed, full))
            elif not getattr(module, "_dtensor_quant_frozen_check", False):
                module.register_forward_pre_hook(_refuse_trainable(fqn))
                module._dtensor_quant_frozen_check = True
    if done == 0 and filter_fn is None:
        raise ValueError(
            f"quantize_: {type(model).__name__} has no nn.Linear weight and no fused expert parameter "
            f"[experts, out, in] to quantize into {fmt}"
        )
    return register(model)


def adopt_quantized(model: nn.Module) -> nn.Module:
    """What :func:`quantize_` adds around the frozen weights it makes, for weights a loader built itself.

    transformers' ``from_pretrained`` with :class:`dtensor_quant.hf.QuantConfig`
    quantizes each weight as it is read; this then gives every module holding
    one the same frozen-weight check, and the model the same state-dict hooks,
    so the model is the one ``quantize_`` would have made.
    """
    for fqn, module in model.named_modules():
        mine = any(p is not None and is_quantized(p) and not p.requires_grad for p in module._parameters.values())
        if mine and not getattr(module, "_dtensor_quant_frozen_check", False):
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
        mine = _trainable_weights.trainable_names(module)
        for name, p in module._parameters.items():
            if name in mine:
                continue
            if p is not None and p.requires_grad and (is_quantized(p) or dequantized_from(p) is not None):
                raise ValueError(
                    f"{fqn + '.' if fqn else ''}{name} is quantized and has requires_grad=True: its gradient would be "
                    "dense and no optimizer can update quantized bytes. Freeze it (requires_grad_(False)) and train "
                    "adapters (dtensor_quant.lora), or make it trainable with dtensor_quant.gather_quantized_."
                )

    return hook


def _note(out: list | None, name: str, why: str) -> None:
    if out is not None:
        out.append((name, why))


def quantized_fqns(model: nn.Module) -> list[str]:
    """Names of the parameters of ``model`` that hold quantized weights."""
    out = []
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, QuantizedTensor):
            out.append(name)
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes this process stores for ``model``'s parameters (quantized ones at their stored size)."""
    total = 0
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += local.nbytes_stored if isinstance(local, QuantizedTensor) else local.numel() * local.element_size()
    return total
