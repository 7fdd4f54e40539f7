"""PEFT's own ``merge_and_unload()`` on quantized bases: a LoRA layer PEFT builds for quantized Linears.

PEFT merges a LoRA layer by adding into the base weight in place, which a
quantized weight refuses. For its own quantized backends (bitsandbytes,
torchao, hqq) PEFT builds a LoRA layer class of the backend whose ``merge``
dequantizes, adds the delta and quantizes again, with a warning that rounding
changes the outputs. Its dispatchers for those backends are a fixed list;
the one place a library can add its own is ``LoraConfig._register_custom_module``
(PEFT's experimental custom-layer API: a map from base-layer type to LoRA
layer class, asked before PEFT's own dispatchers). So it is opt-in:
``dq.lora.peft_config(config)`` registers :class:`QuantizedLoraLinear` for
:class:`QuantizedLinear` (every ``nn.Linear`` whose weight is quantized) on
that config, and ``get_peft_model(model, config)`` then builds these layers.

:meth:`QuantizedLoraLinear.merge` is :func:`dtensor_quant._model.peft_merge.merge_layer_`,
the merge ``dq.lora.merge_and_unload`` uses, so both give the same bytes,
with PEFT's warning. :meth:`QuantizedLoraLinear.unmerge` puts back the exact
weight and bias the layer had before its first merge (kept while merged: the
merged weight costs as much memory again); it refuses if the base weight was
replaced since the merge. Forward and training are PEFT's ``lora.Linear``.

This module imports peft at import time; ``dq.lora.peft_config`` imports it
when called, so the package needs no peft.
"""

from __future__ import annotations

import warnings

import torch
from peft.tuners.lora.layer import Linear
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from .._checkpoint.state_dict import is_quantized
from .._parallel.custom_ops import dequantize
from .peft_merge import ROUNDING_WARNING, merged_tensors, quantized_names, unmergeable, weight_format


class _QuantizedLinearType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, nn.Linear) and is_quantized(getattr(obj, "weight", None))


class QuantizedLinear(metaclass=_QuantizedLinearType):
    """Not a module: ``isinstance(m, QuantizedLinear)`` is true for every ``nn.Linear`` whose weight is quantized.

    The key of PEFT's custom-module map (PEFT asks ``isinstance(base, key)``),
    so that only quantized Linears get :class:`QuantizedLoraLinear`.
    """


class QuantizedLoraLinear(Linear):
    """PEFT's ``lora.Linear`` on a quantized base, whose ``merge``/``unmerge`` requantize (see the module doc)."""

    def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
        if config.fan_in_fan_out:  # what PEFT's own dispatch does for an nn.Linear
            warnings.warn("fan_in_fan_out is set to True but the target module is `torch.nn.Linear`. "
                          "Setting fan_in_fan_out to False.", stacklevel=2)  # fmt: skip
            config.fan_in_fan_out = False
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.unmerged_tensors: tuple | None = None  # (weight, bias) before the first merge
        self.merged_tensors: tuple | None = None  # (weight, bias) the last merge set

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge the active adapters (or ``adapter_names``): dequantize, add PEFT's delta (and bias), requantize."""
        base = self.get_base_layer()
        if not quantized_names(base):  # the weight was made dense since: PEFT's own merge
            return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        adapters = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapters:
            return None
        why = unmergeable(self, adapters)
        if why:
            raise ValueError(
                f"{type(self).__name__}.merge: {why}. Keep the adapters unmerged, or merge into a dense copy "
                "(dq.lora.merge_and_unload(peft_model, keep_dense=True) refuses the same features)"
            )
        warnings.warn(ROUNDING_WARNING.format(fmt=weight_format(base.weight)), UserWarning, stacklevel=2)
        with torch.no_grad():
            weight, bias = merged_tensors(self, adapters)
        checked = (dequantize(weight, weight.dtype), bias) if safe_merge else ()
        if not all(torch.isfinite(t).all() for t in checked if t is not None):
            raise ValueError(f"NaNs detected in the merged weights. The adapter {adapters} seems to be broken")
        if self.unmerged_tensors is None:
            self.unmerged_tensors = (base.weight, base.bias)
        base.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not base.bias:
            base.bias = nn.Parameter(bias, requires_grad=base.bias.requires_grad if base.bias is not None else False)
        self.merged_tensors = (base.weight, base.bias)
        self.merged_adapters.extend(adapters)
        return None

    def unmerge(self) -> None:
        """Put back the weight and bias the layer had before it was merged, bit for bit."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        if self.unmerged_tensors is None:  # merged by PEFT's own merge (a dense base)
            super().unmerge()
            return
        base = self.get_base_layer()
        if base.weight is not self.merged_tensors[0] or base.bias is not self.merged_tensors[1]:
            raise ValueError(
                f"{type(self).__name__}.unmerge: the base layer's weight or bias was replaced after the merge, "
                "so the weight from before the merge would drop that change; merge again instead of unmerging"
            )
        weight, bias = self.unmerged_tensors
        base.weight, base.bias = weight, bias
        self.unmerged_tensors = self.merged_tensors = None
        self.merged_adapters.clear()

    def __repr__(self) -> str:
        return super().__repr__().replace("lora.Linear", f"lora.{type(self).__name__}")


def peft_config(config):
    """Register :class:`QuantizedLoraLinear` for quantized Linears on PEFT ``config``; returns ``config``."""
    register = getattr(config, "_register_custom_module", None)
    if register is None:
        raise TypeError(f"dq.lora.peft_config takes a peft.LoraConfig, got {type(config).__name__}")
    register({QuantizedLinear: QuantizedLoraLinear})
    return config
