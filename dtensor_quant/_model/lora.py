"""LoRA adapters on frozen (quantized) Linears: the trainable half of QLoRA.

``LoRALinear`` keeps the original ``nn.Linear`` as ``base`` (frozen, usually
with a quantized weight) and adds ``lora_b(lora_a(x)) * alpha / rank`` in the
adapters' own dtype (fp32 masters; FSDP2's ``param_dtype`` casts them for
compute). ``lora_b`` starts at zero, so the model starts as the base model.

The adapters are plain ``nn.Linear`` submodules, so FSDP2 shards them like
any parameter and torch's tensor-parallel styles apply to them by name:
:func:`lora_tp_plan` turns a plan for the plain model into one for the LoRA
model (column-parallel ``base`` + ``lora_b``, row-parallel ``base`` + ``lora_a``).

PEFT users merge with :func:`merge_and_unload` (``dq.lora.merge_and_unload(peft_model)``):
PEFT's own merge adds into the weight in place, which a quantized weight refuses,
unless the LoRA config went through :func:`peft_config` before ``get_peft_model``
(PEFT then builds LoRA layers whose merge requantizes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .peft_merge import merge_and_unload  # noqa: F401  (dq.lora.merge_and_unload: PEFT adapters on quantized Linears)


def peft_config(config):
    """Make PEFT's own ``merge_and_unload()`` work on quantized Linears of models built from ``config``.

    Registers, through PEFT's custom-layer API (``LoraConfig._register_custom_module``),
    a LoRA layer for every ``nn.Linear`` whose weight is quantized: its
    ``merge`` dequantizes, adds PEFT's delta and quantizes again (bit-equal to
    :func:`merge_and_unload`, with PEFT's rounding warning); its ``unmerge``
    puts back the weight from before the merge. Call it on the
    ``peft.LoraConfig`` before ``peft.get_peft_model(model, config)`` (or pass
    the config to ``PeftModel.from_pretrained(..., config=...)``); returns ``config``.
    See :mod:`dtensor_quant._model.peft_layer`.
    """
    from .peft_layer import peft_config as register

    return register(config)


class LoRALinear(nn.Module):
    """``base(x) + lora_b(lora_a(dropout(x))) * alpha / rank`` with ``base`` frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, dtype=torch.float32):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.base.requires_grad_(False)
        device = base.weight.device
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / rank
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        h = self.lora_b(self.lora_a(self.dropout(x.to(self.lora_a.weight.dtype))))
        return out + (h * self.scaling).to(out.dtype)


def add_lora_(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """Freeze ``model`` and wrap its ``nn.Linear`` modules (``filter_fn(module, fqn)`` picks) in LoRALinear.

    The adapters are drawn from ``seed`` so every rank builds the same model.
    Returns ``model``; only the adapters require grad afterwards.
    """
    model.requires_grad_(False)
    targets = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and fqn and (filter_fn is None or filter_fn(m, fqn))
    ]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for fqn, linear in targets:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(linear, rank, alpha, dropout, dtype))
    return model


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable (adapter) parameters of ``model`` by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def lora_tp_plan(plan: dict[str, object]) -> dict[str, object]:
    """A tensor-parallel plan for plain Linears, rewritten for the LoRALinears that replaced them.

    ``ColwiseParallel`` on ``wq`` becomes the same style on ``wq.base`` and
    ``wq.lora_b`` (``lora_a`` stays replicated: its gradient is complete on
    every rank because ColwiseParallel all-reduces the input gradient);
    ``RowwiseParallel`` on ``wo`` goes to ``wo.base`` and ``wo.lora_a``
    (``lora_b`` sees the all-reduced output, replicated). Other entries are
    kept as they are.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for fqn, style in plan.items():
        if isinstance(style, ColwiseParallel):
            out[f"{fqn}.base"] = style
            out[f"{fqn}.lora_b"] = style
        elif isinstance(style, RowwiseParallel):
            out[f"{fqn}.base"] = style
            out[f"{fqn}.lora_a"] = style
        else:
            out[fqn] = style
    return out
