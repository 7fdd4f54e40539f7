"""Copies and memory: ``clone``, device moves, ``copy_`` (DCP's load), pinning, streams."""

from __future__ import annotations

import torch

from .._core import notes as rules
from .._core.dispatch import KEEPS_INITIAL, implements
from .._core.layout import LayoutError
from .._core.tensor import QuantizedTensor, contiguous_strides
from . import init, writes
from .layout_ops import describe, map_inner, rebuild


@implements("aten::clone")
def _clone(func, q, memory_format=None):
    """New bytes, the same layout (``Replicate -> Shard`` clones its chunk on every call: no checks again)."""
    contiguous = memory_format == torch.contiguous_format or q.is_contiguous()
    inner = [getattr(q, n).clone(memory_format=torch.contiguous_format) for n in q.fmt.inner_names]
    stride = contiguous_strides(q.shape) if contiguous else q.stride()
    return QuantizedTensor.make(
        inner, q.fmt, q.rels, q.dims, q.shape, stride, q.dtype, rules.new_bytes(inner), q.device
    )


@implements("aten::_to_copy")
def _to_copy(func, q, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """Device moves copy the stored bytes; a dtype only changes the logical (dequantized) dtype."""
    if dtype is not None and not dtype.is_floating_point:
        raise LayoutError(f"{describe(q)}: cannot convert to {dtype}; dequantize() first")

    def move(t):
        out = t.to(device=device, non_blocking=non_blocking, copy=True)
        return out.pin_memory() if pin_memory else out

    inner = map_inner(q, move)
    notes = rules.moved(q.notes, list(inner.values()))
    return rebuild(q, inner, q.shape, dtype=dtype, stride=q.stride(), notes=notes)


@implements("aten::copy_")
def _copy_(func, dst, src, non_blocking=False):
    """Quantized into quantized: the stored bytes (checked first). Dense into quantized: an initialisation
    (the dense values quantized as the weight's own, :mod:`.init`). Quantized into dense: only the values
    of an initialisation still going on; anything else would silently dequantize."""
    if not isinstance(src, QuantizedTensor):
        return init.write_dense(dst, init.fresh_dense(dst).copy_(src))
    if not isinstance(dst, QuantizedTensor):
        opened = init.initial_values(src)
        if opened is None:
            raise LayoutError(
                f"cannot copy a {describe(src)} into a dense {tuple(dst.shape)} tensor: that would silently "
                "dequantize. Use .dequantize()."
            )
        return dst.copy_(opened)
    if dst.fmt != src.fmt or dst.shape != src.shape:
        raise LayoutError(f"cannot copy a {describe(src)} into a {describe(dst)}")
    for name in dst.fmt.inner_names:
        d, s = getattr(dst, name), getattr(src, name)
        if d.shape != s.shape or d.dtype != s.dtype:
            raise LayoutError(
                f"cannot copy into {describe(dst)}: inner '{name}' is {tuple(s.shape)}:{s.dtype} in the "
                f"source and {tuple(d.shape)}:{d.dtype} in the destination"
            )
    keep = writes.check_copy(dst, src, describe)  # every check before the first byte moves
    pairs = [(getattr(dst, n), getattr(src, n)) for n in dst.fmt.inner_names if n not in keep]
    writes.write_inner(dst, pairs, non_blocking=non_blocking)
    opened = init.initial_values(src)
    if opened is not None and dst.shape == src.shape:
        init.keep_open(dst, opened.clone())
    return dst


KEEPS_INITIAL.add(_copy_)


@implements("aten::is_pinned")
def _is_pinned(func, q, device=None):
    return all(t.is_pinned() for t in q.inner.values())


@implements("aten::_pin_memory")
def _pin_memory(func, q, device=None):
    inner = map_inner(q, lambda t: t.pin_memory())
    return rebuild(q, inner, q.shape, stride=q.stride(), notes=rules.moved(q.notes, list(inner.values())))


@implements("aten::record_stream")
def _record_stream(func, q, stream):
    for t in q.inner.values():
        t.record_stream(stream)
