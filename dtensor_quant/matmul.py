"""Matmuls with a quantized weight: the format's kernel when it has one, else dequantize + mm.

``F.linear(x, w)`` reaches a QuantizedTensor as ``t`` then ``mm``/``addmm``
(both on one process and under DTensor, which decomposes linear above the
local tensor). ``mm(x, w.t())`` is ``x @ W.T`` on the canonical weight: the
format's ``linear`` kernel. Any other orientation (the input gradient's
``grad @ W``) dequantizes -- a matmul, not a silent format change: the result
is dense by definition.

Kernels often want the weight in a layout of their own (torch's CPU int4 mm
repacks it, 86 ms for 4096x4096). ``QuantFormat.prepare`` builds that once per
weight; the result is cached on the persistent weight tensor (a module's
parameter, a DTensor's local) and dropped when its bytes change.
"""

from __future__ import annotations

import torch

from .ops import _describe, canonical_inner, dequantize, implements, is_transposed
from .tensor import QuantizedTensor

_CACHE_ATTR = "_prepared_kernel_weight"


def invalidate(q: QuantizedTensor) -> None:
    """Forget the prepared kernel weight of ``q`` (its bytes were rewritten in place)."""
    q.__dict__.pop(_CACHE_ATTR, None)


def _prepared(w: QuantizedTensor, inner: dict[str, torch.Tensor]):
    """``w.fmt.prepare(inner)``, cached on the tensor ``w`` was transposed from."""
    owner = w.__dict__.get("_transposed_from", w)
    if any(_is_traced(t) for t in inner.values()) or "fsdp_gathered" in w.__dict__:
        # An FSDP2-gathered weight lives in a buffer FSDP2 frees after use: a cached
        # prepared copy would outlive it (one extra weight per layer) and go stale.
        return w.fmt.prepare(inner)
    key = (tuple((t.data_ptr(), t._version, tuple(t.shape), t.stride()) for t in inner.values()))
    cached = owner.__dict__.get(_CACHE_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    prepared = w.fmt.prepare(inner)
    owner.__dict__[_CACHE_ATTR] = (key, prepared)
    return prepared


def _is_traced(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"


def linear(x: torch.Tensor, w_t: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w_t (+ bias)`` for a logical ``[in, out]`` quantized ``w_t`` (a transposed weight)."""
    inner = canonical_inner(w_t) if is_transposed(w_t) else None
    if inner is not None:
        out = w_t.fmt.linear(x, _prepared(w_t, inner), bias)
        if out is not None:
            return out
    out = x @ dequantize(w_t, x.dtype)
    return out + bias if bias is not None else out


@implements("aten::mm")
def _mm(func, a, b):
    if isinstance(b, QuantizedTensor) and not isinstance(a, QuantizedTensor):
        return linear(a, b)
    if isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor):
        return dequantize(a, b.dtype) @ b
    raise NotImplementedError(f"mm of two quantized tensors ({_describe(a)}, {_describe(b)})")


@implements("aten::addmm")
def _addmm(func, bias, a, b, beta=1, alpha=1):
    if isinstance(bias, QuantizedTensor):
        raise NotImplementedError(f"addmm with a quantized bias ({_describe(bias)})")
    out = _mm(func, a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else beta * bias)


@implements("aten::bmm", "aten::baddbmm")
def _bmm(func, *args, **kwargs):
    q = next(a for a in args if isinstance(a, QuantizedTensor))
    raise NotImplementedError(f"{func} with a {_describe(q)}: quantized weights are 2-D; use F.linear or mm")
