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

Every adapter feature either merges exactly or is refused by name, before
anything changes (:func:`unmergeable`):

* a LoRA bias (``lora_bias=True``) is added into the base bias as PEFT adds
  it (``bias += lora_B.bias * scaling``); a base layer without a bias gets
  one (PEFT's dense merge raises there; leaving it out would move every
  output by the adapter's bias);
* ``use_rslora``, ``rank_pattern``, ``alpha_pattern`` only change the
  scaling that ``get_delta_weight`` applies; ``lora_dropout`` is not part of
  a merged weight; several active adapters are merged one after the other;
* DoRA and every other LoRA variant (aLoRA, Arrow, VeLoRA, MonteCLoRA, ...),
  LoRA on a layer that is not a Linear or on a parameter
  (``target_parameters``), ``fan_in_fan_out`` on a Linear, replicated layers
  (``layer_replication``: copies share one base weight) and a quantized bias
  are refused.

The same merge (:func:`merge_layer_`) backs the LoRA layer that PEFT's own
``merge_and_unload()`` uses on quantized bases (:mod:`dtensor_quant._model.peft_layer`),
so the two give the same bytes.

Merging into a quantized weight rounds the merged values to the format: the
adapters' effect survives only up to the format's precision (the same loss as
quantizing a merged dense model). ``keep_dense=True`` keeps the merged
weights dense instead.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._checkpoint.state_dict import is_quantized
from .._core.dispatch import context_hint
from .._parallel.custom_ops import dequantize
from .._parallel.quantize import quantize

#: The warning PEFT gives when it merges into a quantized base (bitsandbytes' words), with the format named.
ROUNDING_WARNING = (
    "Merge lora module to {fmt} quantized Linear may get different generations due to rounding errors: "
    "the merged weight is quantized again in its format"
)


@context_hint(
    " PEFT merges (or unmerges) a LoRA adapter by adding into the base weight in place, which would requantize "
    "it behind PEFT's back. On a quantized base: dq.lora.merge_and_unload(peft_model) returns the merged model; "
    "or build the PEFT model from dq.lora.peft_config(lora_config), whose layers' merge and unmerge requantize."
)
def from_peft_merge(func) -> bool:
    """Whether the op being refused comes from a merge or unmerge of PEFT's (a frame of a ``peft`` module in one)."""
    return any("merge" in frame.f_code.co_name for frame in _peft_frames())


@context_hint(
    " PEFT computed on the quantized base weight itself (DoRA's weight norm; PiSSA, OLoRA, CorDA, LoftQ "
    "initialisation): those PEFT features need a dense base weight. On a quantized base use plain LoRA "
    "(lora_bias, use_rslora, rank and alpha patterns work), or quantize after merging."
)
def from_peft_base_weight(func) -> bool:
    """Whether the op comes from PEFT code that reads the base weight: DoRA or a weight-changing initialisation."""
    for frame in _peft_frames():
        name = frame.f_globals.get("__name__", "")
        return name.endswith((".dora", ".variants")) or "init" in frame.f_code.co_name
    return False


def _peft_frames():
    """The frames of ``peft`` modules on the stack, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("peft."):
            yield frame
        frame = frame.f_back


def weight_format(weight: torch.Tensor):
    """The format of a quantized weight or of a DTensor of one."""
    return (weight._local_tensor if isinstance(weight, DTensor) else weight).fmt


def quantized_names(module: nn.Module) -> list[str]:
    """The parameters of ``module`` itself (not its children) that are quantized."""
    return [n for n, p in module.named_parameters(recurse=False) if is_quantized(p)]


def _peft():
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import check_adapters_to_merge
    except ImportError as e:  # pragma: no cover - only reached by PEFT users
        raise ImportError("dq.lora.merge_and_unload merges PEFT adapters: pip install peft") from e
    return LoraLayer, check_adapters_to_merge


def unmergeable(layer: nn.Module, adapters: list[str]) -> str | None:
    """Why ``adapters`` of PEFT LoRA ``layer`` (on a quantized base) cannot be merged exactly, or None."""
    base = layer.get_base_layer()
    if hasattr(layer, "parameter_name"):  # PEFT's ParamWrapper (target_parameters)
        return (
            f"LoRA on the parameter '{layer.parameter_name}' of a {type(base).__name__} (target_parameters); "
            "only LoRA on a Linear's weight is merged into a quantized weight"
        )
    if not isinstance(base, nn.Linear):
        return f"LoRA on {type(base).__name__}; only Linear layers are merged into a quantized weight"
    if is_quantized(base.bias):
        return "the base layer's bias is quantized; only a dense bias takes a LoRA bias"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True on a Linear (its weight is [out, in]): the delta would be transposed"
    for a in adapters:
        a_shape, b_shape = tuple(layer.lora_A[a].weight.shape), tuple(layer.lora_B[a].weight.shape)
        if b_shape[0] != base.weight.shape[0] or a_shape[1] != base.weight.shape[1]:
            return (
                f"adapter '{a}' is B {b_shape} @ A {a_shape} for a weight of shape {tuple(base.weight.shape)} "
                "(adapters made for a weight's local shard: build the PEFT model before sharding the base)"
            )
        variant = getattr(layer, "lora_variant", {}).get(a)
        if getattr(layer, "use_dora", {}).get(a) or type(variant).__name__.startswith("Dora"):
            return f"adapter '{a}' uses DoRA: its magnitude vector rescales the merged weight by its norm"
        if variant is not None:
            return f"adapter '{a}' is a LoRA variant ({type(variant).__name__}), more than scaling * B @ A"
        if getattr(layer, "lora_bias", {}).get(a) and base.bias is None and isinstance(base.weight, DTensor):
            return (
                f"adapter '{a}' has a LoRA bias (lora_bias=True) and the sharded base Linear has none to "
                "add it to; give the layer a bias (sharded like its output) before merging"
            )
    return None


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` placed like ``ref`` when ``ref`` is a DTensor and ``t`` a whole tensor (every rank holds it)."""
    if isinstance(ref, DTensor) and not isinstance(t, DTensor):
        return distribute_tensor(t, ref.device_mesh, ref.placements, src_data_rank=None)
    return t


def merged_tensors(layer: nn.Module, adapters: list[str], keep_dense: bool = False):
    """The base layer's weight and bias with ``adapters`` merged, by PEFT's arithmetic: ``(weight, bias)``.

    The weight: ``dequantize(W)`` plus each adapter's ``get_delta_weight``,
    rounded to the weight's dtype after each (PEFT's ``weight.data +=
    delta``), then quantized in the weight's format (unless ``keep_dense``).
    The bias: PEFT's ``bias += lora_B.bias * scaling`` for each adapter with
    a LoRA bias, on a zero bias in the weight's dtype if the layer has none;
    the layer's own bias object when no adapter has one.
    """
    base = layer.get_base_layer()
    weight, bias = base.weight, base.bias
    dense = dequantize(weight, weight.dtype)
    new_bias = None
    for adapter in adapters:
        delta = layer.get_delta_weight(adapter)
        if delta.shape != dense.shape:
            raise ValueError(f"adapter '{adapter}': delta of shape {tuple(delta.shape)} for a weight of "
                             f"shape {tuple(dense.shape)}")  # fmt: skip
        dense = (dense + _like(delta, dense)).to(weight.dtype)  # PEFT: weight.data += delta: one rounding
        if getattr(layer, "lora_bias", {}).get(adapter):
            if new_bias is None:
                assert bias is not None or not isinstance(weight, DTensor)  # refused by unmergeable
                zeros = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
                new_bias = bias.detach().clone() if bias is not None else zeros
            extra = layer.lora_B[adapter].bias * layer.scaling[adapter]
            new_bias += _like(extra.detach(), new_bias)  # PEFT: bias.data += lora_B.bias * scaling
    merged = dense if keep_dense else quantize(dense, weight_format(weight))
    return merged, (bias if new_bias is None else new_bias)


def merge_layer_(layer: nn.Module, adapters: list[str], keep_dense: bool = False) -> None:
    """Merge ``adapters`` into ``layer``'s quantized base (new weight and bias parameters) and mark them merged."""
    base = layer.get_base_layer()
    with torch.no_grad():
        weight, bias = merged_tensors(layer, adapters, keep_dense)
    base.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not base.bias:
        grad = base.bias.requires_grad if base.bias is not None else False
        base.bias = nn.Parameter(bias, requires_grad=grad)
    layer.merged_adapters.extend(a for a in adapters if a not in layer.merged_adapters)


def _replicated(peft_model: nn.Module, layers) -> str | None:
    configs = getattr(peft_model, "peft_config", {})
    if any(getattr(c, "layer_replication", None) for c in configs.values()):
        return "layer_replication: replicated layers share one base weight, which each copy's adapters would change"
    seen: dict[int, str] = {}
    for name, layer in layers:
        w = getattr(layer.get_base_layer(), "weight", None)
        if w is not None and is_quantized(w):
            if id(w) in seen:
                return f"{name} and {seen[id(w)]} share one base weight (layer_replication?): each has its adapters"
            seen[id(w)] = name
    return None


def merge_and_unload(
    peft_model: nn.Module, *, keep_dense: bool = False, adapter_names: list[str] | None = None
) -> nn.Module:
    """PEFT's ``merge_and_unload()`` for a model whose LoRA layers wrap quantized Linears; returns the base model.

    Every active LoRA adapter of a layer (or ``adapter_names``, as PEFT takes
    them) that is not merged yet is merged (``W + scaling * B @ A``, PEFT's
    ``get_delta_weight``, and a LoRA bias into the layer's bias), then the
    weight is quantized again in its format (or left dense with
    ``keep_dense``). A sharded (DTensor) weight stays sharded: the dense sum
    is formed per shard and quantized like ``dq.quantize`` of a DTensor
    (statistics across shards reduced). Raises ``ValueError`` for adapters it
    cannot merge exactly as PEFT defines them (DoRA and the other variants,
    LoRA on anything but a Linear, replicated layers; :func:`unmergeable`),
    before changing anything.
    """
    if not isinstance(peft_model, nn.Module) or not callable(getattr(peft_model, "merge_and_unload", None)):
        raise TypeError(
            f"dq.lora.merge_and_unload takes a PEFT model (peft.get_peft_model, PeftModel.from_pretrained), got "
            f"{type(peft_model).__name__}, which has no merge_and_unload; dtensor_quant.lora's own adapters "
            "(add_lora_) are merged by dtensor_quant.hf.save (merge_lora=True)"
        )
    lora_layer, check_adapters_to_merge = _peft()
    layers = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, lora_layer)]
    todo, dense_biases, errors = [], [], []
    replicated = _replicated(peft_model, layers)
    if replicated:
        errors.append(replicated)
    for name, layer in layers:
        base = layer.get_base_layer()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's "already merged" note: it repeats it when it merges
            adapters = [a for a in check_adapters_to_merge(layer, adapter_names) if a in layer.lora_A]
        if not quantized_names(base):
            if any(layer.lora_bias.get(a) for a in adapters) and getattr(base, "bias", 1) is None:
                dense_biases.append(base)  # PEFT's merge raises without a bias to add into: give it one
            continue  # PEFT's own merge
        why = unmergeable(layer, adapters)
        if why:
            errors.append(f"{name}: {why}")
        else:
            todo.append((layer, adapters))
    if errors:
        raise ValueError("dq.lora.merge_and_unload: cannot merge exactly:\n  " + "\n  ".join(errors))
    for base in dense_biases:
        base.bias = nn.Parameter(base.weight.new_zeros(base.weight.shape[0]), requires_grad=False)
    for layer, adapters in todo:
        if adapters:
            merge_layer_(layer, adapters, keep_dense)
    # the quantized layers hold their merged weights (marked merged); PEFT merges the dense ones and unwraps all
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*already merged")  # ours: PEFT notes it and skips them
        return peft_model.merge_and_unload(adapter_names=adapter_names)
