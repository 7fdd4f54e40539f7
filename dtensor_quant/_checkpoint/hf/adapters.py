"""LoRA wrappers around a model's Linears: which weight each wraps, and the adapters to merge into it on export.

Two kinds are recognized. The library's own :class:`~dtensor_quant.lora.LoRALinear`
keeps the wrapped Linear as ``base`` and adapters ``lora_a``/``lora_b``.
peft's tuner layers keep it as ``base_layer``; its LoRA layer on a Linear adds
``lora_A[name]``/``lora_B[name]`` per adapter, with ``scaling[name]``. In both,
the wrapped weight is the checkpoint's ``<layer>.weight`` (``q_proj.base.weight``
and ``q_proj.base_layer.weight`` are ``q_proj.weight``), and the model computes
``W x + scaling * B A x`` for each active adapter, so an export merges
``W + scaling * B @ A``.

What cannot be merged that way (DoRA, LoRA variants and biases, LoRA on
embeddings or convolutions, other peft tuners such as IA3 or LoHa, peft's
``modules_to_save`` copies) is recognized as peft's and refused by name on
export rather than written under keys no Hugging Face model has: transformers'
``from_pretrained`` would then leave the real weights randomly initialized.

peft is not imported: its modules are told by their class's module
(``peft.*``) and their attributes, so this works with any peft version that
keeps these names, and without peft installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class Delta:
    """One adapter's contribution ``scaling * B @ A`` to a ``[out, in]`` weight (``transposed``: to ``[in, out]``)."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scaling: float
    transposed: bool = False  # peft's fan_in_fan_out: the base weight is stored [in, out] (GPT-2's Conv1D)


@dataclass
class Wrapper:
    """A module that wraps a Linear in adapters; ``base`` is the wrapped module's attribute name."""

    module: nn.Module
    base: str
    deltas: list[Delta] = field(default_factory=list)  # the active adapters' contributions, to merge
    refused: str | None = None  # why its adapters cannot be merged into the weight (None: they can)
    kind: str = "dq.lora"  # "dq.lora" or "peft": how unmerged adapters could be written


def is_peft(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def unwrap(model: nn.Module) -> nn.Module:
    """The model a peft ``PeftModel`` wraps (whose names are the checkpoint's), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    if is_peft(model) and callable(get_base):
        return get_base()
    return model


def is_lora_wrapper(module) -> bool:
    """Whether ``module`` wraps a frozen ``base`` linear with ``lora_a``/``lora_b`` adapters scaled by ``scaling``.

    :class:`dtensor_quant.lora.LoRALinear` is one; recognised by what it holds
    rather than by class, so that the checkpoint layer needs nothing from the
    model layer above it.
    """
    return all(hasattr(module, n) for n in ("base", "lora_a", "lora_b", "scaling"))


def wrapper_of(module: nn.Module) -> Wrapper | None:
    """The :class:`Wrapper` that ``module`` is, or None for an ordinary module."""
    if is_lora_wrapper(module):
        a, b = module.lora_a.weight, module.lora_b.weight
        return Wrapper(module, "base", [Delta(a, b, float(module.scaling))])
    if not is_peft(module):
        return None
    base = getattr(module, "base_layer", None)
    if not isinstance(base, nn.Module):
        if any(True for _ in module.parameters(recurse=False)) or _holds_model_weights(module):
            return Wrapper(module, "", refused=f"peft's {type(module).__name__} is not a LoRA layer", kind="peft")
        return None  # a container (LoraModel, ModuleDicts of adapters): its children speak for themselves
    return _peft_lora(module, base)


def _holds_model_weights(module: nn.Module) -> bool:
    """peft's ``ModulesToSaveWrapper`` and the like: copies of a model module, under names no checkpoint has."""
    return hasattr(module, "original_module") or hasattr(module, "modules_to_save")


def _peft_lora(module: nn.Module, base: nn.Module) -> Wrapper:
    out = Wrapper(module, "base_layer", kind="peft")
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        out.refused = f"peft's {type(module).__name__} is not a LoRA layer (only LoRA's B @ A is merged here)"
        return out
    weight = getattr(base, "weight", None)
    if not isinstance(base, nn.Linear) and not (isinstance(weight, torch.Tensor) and weight.ndim == 2):
        out.refused = f"LoRA on a {type(base).__name__} (only LoRA on a Linear is merged here)"
        return out
    for name in getattr(module, "active_adapters", []):
        why = _unmergeable(module, name)
        if why:
            out.refused = f"adapter '{name}' {why}"
            return out
    known = {id(p) for holder in (lora_a, lora_b) for p in holder.parameters()}
    known |= {id(p) for p in base.parameters()}
    others = [n for n, p in module.named_parameters() if id(p) not in known]
    if others:  # LoRA on an embedding (lora_embedding_A), DoRA's magnitudes, ...: more than B @ A on a Linear
        out.refused = f"peft's {type(module).__name__} holds adapter tensors besides LoRA's A and B ({others[:3]})"
        return out
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return out  # merged: the weight already holds B @ A; disabled: the model computes without them
    for name in getattr(module, "active_adapters", []):
        if name not in lora_a:
            continue
        a, b = lora_a[name], lora_b[name]
        if not isinstance(a, nn.Linear) or not isinstance(b, nn.Linear):
            out.refused = f"adapter '{name}' is a {type(a).__name__}, not a Linear pair"
            return out
        scaling = module.scaling[name]
        out.deltas.append(Delta(a.weight, b.weight, float(scaling), bool(getattr(module, "fan_in_fan_out", False))))
    return out


def _unmergeable(module: nn.Module, name: str) -> str | None:
    """Why peft's adapter ``name`` is more than ``scaling * B @ A`` added to the weight, or None."""
    if getattr(module, "use_dora", {}).get(name):
        return "uses DoRA (a magnitude vector rescales the merged weight's columns)"
    if getattr(module, "lora_bias", {}).get(name):
        return "has a LoRA bias (lora_bias=True), which changes the layer's bias"
    variant = getattr(module, "lora_variant", {}).get(name)
    if variant is not None:
        return f"is a LoRA variant ({type(variant).__name__})"
    for extra in ("lora_embedding_A", "lora_magnitude_vector"):
        holder = getattr(module, extra, None)
        if holder is not None and name in holder:
            return f"has {extra} tensors"
    return None
