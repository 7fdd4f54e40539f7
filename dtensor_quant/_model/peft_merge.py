"""``dq.lora.merge_and_unload``: merge PEFT LoRA adapters into quantized base weights, then drop the adapters.

PEFT's own ``merge_and_unload()`` adds the adapters' product into the base
weight in place (``weight.data += delta``). A quantized weight has no dense
values to add to, and adding would have to requantize behind PEFT's back,
so the library refuses that op (``UnsupportedOpError``). This function does
the merge explicitly, with PEFT's own arithmetic: for each LoRA layer whose
base weight is quantized, the dense values ``dequantize(W)`` plus PEFT's
``get_delta_weight`` (rounded as PEFT's in-place add rounds: once, to the
weight's dtype) are quantized again in the weight's own format. So the result
is bit for bit what PEFT's merge on the dequantized model followed by
quantizing each merged weight gives. LoRA layers on dense weights are merged
by PEFT itself. Then PEFT's ``unload()`` removes the adapters.

Merging into a quantized weight rounds the merged values to the format: the
adapters' effect survives only up to the format's precision (the same loss as
quantizing a merged dense model). ``keep_dense=True`` keeps the merged
weights dense instead.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._checkpoint.state_dict import is_quantized
from .._parallel.custom_ops import dequantize
from .._parallel.quantize import quantize


def _fmt(weight: torch.Tensor):
    return (weight._local_tensor if isinstance(weight, DTensor) else weight).fmt


def merge_and_unload(peft_model: nn.Module, *, keep_dense: bool = False) -> nn.Module:
    """PEFT's ``merge_and_unload()`` for a model whose LoRA layers wrap quantized Linears; returns the base model.

    Every active LoRA adapter of a layer is merged (``W + scaling * B @ A``,
    PEFT's ``get_delta_weight``), then the weight is quantized again in its
    format (or left dense with ``keep_dense``). A sharded (DTensor) weight
    stays sharded: the dense sum is formed per shard and quantized like
    ``dq.quantize`` of a DTensor (statistics across shards reduced). Raises
    ``ValueError`` for adapters it cannot merge exactly as PEFT defines them
    (DoRA, LoRA on anything but a Linear), before changing anything.
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError as e:  # pragma: no cover - only reached by PEFT users
        raise ImportError("dq.lora.merge_and_unload merges PEFT adapters: pip install peft") from e
    layers = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    todo, errors = [], []
    for name, layer in layers:
        base = layer.get_base_layer()
        if not is_quantized(base.weight):
            continue  # PEFT's own merge
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        if not isinstance(base, nn.Linear):
            errors.append(f"{name}: LoRA on {type(base).__name__}; only Linear layers are merged here")
        elif any(layer.use_dora.get(a, False) for a in adapters):
            errors.append(f"{name}: DoRA adapters rescale the merged weight by its norm; not merged here")
        else:
            todo.append((layer, base, adapters))
    if errors:
        raise ValueError("dq.lora.merge_and_unload:\n  " + "\n  ".join(errors))
    with torch.no_grad():
        for layer, base, adapters in todo:
            weight = base.weight
            dense = dequantize(weight, weight.dtype)
            for adapter in adapters:
                delta = layer.get_delta_weight(adapter)
                if isinstance(dense, DTensor) and not isinstance(delta, DTensor):
                    delta = distribute_tensor(delta, dense.device_mesh, dense.placements, src_data_rank=None)
                dense = (dense + delta).to(weight.dtype)  # PEFT: weight.data += delta: one rounding, to its dtype
            merged = dense if keep_dense else quantize(dense, _fmt(weight))
            base.weight = nn.Parameter(merged, requires_grad=False)
            layer.merged_adapters.extend(a for a in adapters if a not in layer.merged_adapters)
    # the quantized layers hold their merged weights (marked merged); PEFT merges the dense ones and unwraps all
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*already merged")  # ours: PEFT notes it and skips them
        return peft_model.merge_and_unload()
