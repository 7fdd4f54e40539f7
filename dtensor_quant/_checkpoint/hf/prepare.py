"""Building a transformers model to load sharded: its TP plan as torch styles, parameters on meta, then memory."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def tp_plan(model: nn.Module) -> dict:
    """torch ParallelStyles for a transformers model's own TP plan (``model._tp_plan``: colwise, rowwise, ...).

    Only the styles that are plain column/row sharding are mapped; any other
    style raises ``ValueError`` naming it (use your own plan then).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan (_tp_plan); write one")
    unknown = {s for s in plan.values() if s not in styles}
    if unknown:
        raise ValueError(f"{type(model).__name__}'s TP plan uses styles {sorted(unknown)}; known: {sorted(styles)}")
    return {k: styles[s]() for k, s in plan.items()}


@contextlib.contextmanager
def init_empty():
    """Create modules' parameters on the meta device, keeping buffers (e.g. RoPE tables) real.

    Under ``torch.device("meta")`` a transformers model's non-persistent
    buffers (``inv_freq``) would be meta too, and no checkpoint holds them.
    """
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device="cpu") -> nn.Module:
    """``model.to_empty(device)`` for the tensors still on the meta device only; real buffers keep their values."""
    return model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
