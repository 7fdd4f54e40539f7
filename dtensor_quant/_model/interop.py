"""Bring torchao's quantized weights into the protocol without copying their bytes.

``from_torchao(t)`` turns a torchao ``NF4Tensor`` or per-row ``Int8Tensor`` into
a :class:`QuantizedTensor` whose inner tensors are *views* of torchao's, so
torchao users get DTensor, FSDP2 and DCP support for the weights they already
have. ``from_torchao_(model)`` swaps every such parameter of a model in place.

NF4's bytes are the same here and in torchao (high nibble first, int8 block
scales, per-256 factors, one mean, all over the flattened weight); only the
shapes are regrouped as the layout's relations say (views of the same memory).
torchao is optional: nothing here imports it.
"""

from __future__ import annotations

import torch
from torch import nn

from .._core.tensor import QuantizedTensor
from .._formats import NF4, Int8Rowwise
from .._ops.layout_ops import canonical_dims


def from_torchao(t: torch.Tensor) -> QuantizedTensor:
    """A zero-copy QuantizedTensor for a torchao NF4Tensor or per-row symmetric Int8Tensor."""
    kind = type(t).__name__
    if kind == "NF4Tensor":
        return _from_nf4(t)
    if kind == "Int8Tensor":
        return _from_int8(t)
    raise ValueError(f"from_torchao converts torchao NF4Tensor and per-row Int8Tensor, not {kind}")


def _from_nf4(t) -> QuantizedTensor:
    if t.dim() != 2:
        raise ValueError(f"from_torchao: NF4 weights must be 2-D, got {tuple(t.shape)}")
    fmt = NF4(t.block_size, t.scaler_block_size)
    layout = fmt.layout_for(t.shape)  # torchao's inner tensors are the flat, row-major ones
    torchao_names = {
        "qdata": "quantized_data",
        "scaler": "quantized_scalers",
        "factor": "quantization_factor",
        "mean": "scaler_mean",
    }
    inner = {}
    for name, rels in layout.items():
        shape = tuple(r.inner_len(n) for r, n in zip(rels, t.shape))
        inner[name] = getattr(t, torchao_names[name]).reshape(shape)
    return QuantizedTensor(inner, fmt, tuple(layout.values()), canonical_dims(2), tuple(t.shape), t.dtype)


def _from_int8(t) -> QuantizedTensor:
    qdata, scale = t.qdata, t.scale
    zero = getattr(t, "zero_point", None)
    if qdata.dim() != 2 or scale.shape != (qdata.shape[0], 1):
        raise ValueError(
            f"from_torchao: only per-row Int8Tensor maps to Int8Rowwise; got scale {tuple(scale.shape)} "
            f"for qdata {tuple(qdata.shape)}"
        )
    if zero is not None and bool(zero.ne(0).any()):
        raise ValueError("from_torchao: an asymmetric Int8Tensor (nonzero zero_point) has no Int8Rowwise equivalent")
    fmt = Int8Rowwise()
    return QuantizedTensor(
        {"qdata": qdata, "scale": scale},
        fmt,
        tuple(fmt.layout_for(t.shape).values()),
        canonical_dims(2),
        tuple(t.shape),
        t.dtype,
    )


def from_torchao_(model: nn.Module) -> nn.Module:
    """Replace every torchao NF4Tensor / Int8Tensor parameter of ``model`` in place (zero-copy)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if type(p).__name__ in ("NF4Tensor", "Int8Tensor") or type(p.data).__name__ in ("NF4Tensor", "Int8Tensor"):
                setattr(module, name, nn.Parameter(from_torchao(p.data if isinstance(p, nn.Parameter) else p), False))
    return model
