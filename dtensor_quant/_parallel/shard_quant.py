"""Quantize one (local) shard: the format's math, checked and wrapped, statistics reduced over the mesh.

:func:`quantize_local` runs ``fmt.quantize`` on a dense shard and wraps the
result with the layout of the whole weight; :class:`MeshReducer` is the
``Reducer`` that all-reduces a statistic over exactly the mesh dims whose
shards share its blocks. Used by :func:`dtensor_quant.quantize`, the
``dtensor_quant::quantize`` custom op, :class:`~dtensor_quant.GatherQuantized`
and the Hugging Face loader.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from .._core.format import QuantFormat, Reducer, check_weight, weight_layout
from .._core.layout import Constant, LayoutError
from .._core.reductions import canonical_nans, reduce_nan_aware
from .._core.tensor import QuantizedTensor
from .._ops.layout_ops import canonical_dims
from . import agree, wire
from .placements import shard_like


def quantize_local(fmt: QuantFormat, weight: torch.Tensor, reduce: Reducer, full_shape) -> QuantizedTensor:
    """``fmt.quantize`` of a dense (local) weight, checked and wrapped.

    ``reduce`` combines the statistics that shards share (the identity on one
    process); ``full_shape`` is the whole weight's, which a layout may depend on.
    """
    check_weight(fmt, full_shape, weight.dtype)
    with torch.no_grad():
        if weight.ndim == 2:
            inner = fmt.quantize(weight.detach(), reduce)
        else:
            inner = _quantize_matrices(fmt, weight.detach(), reduce)
        if not weight.is_meta:
            inner = {name: canonical_nans(t) for name, t in inner.items()}
    return wrap_quantized(fmt, inner, weight.shape, weight.dtype, full_shape)


class _PerMatrix(Reducer):
    """What ``fmt.quantize`` sees for one ``[out, in]`` matrix of an N-D weight.

    ``full_shape`` is one matrix's (a layout that depends on the width reads
    it); statistics go to the N-D weight's reducer, whose layout has the
    leading dims one-to-one, so only the shards of the matrix's own dims
    (tensor parallelism inside an expert) are reduced over.
    """

    def __init__(self, parent: Reducer):
        super().__init__(parent.full_shape[-2:])
        self.parent = parent

    def __call__(self, stat, op, like):
        return self.parent(stat, op, like)


def _quantize_matrices(fmt: QuantFormat, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
    """The format's 2-D math on every matrix of ``[..., out, in]``, stacked.

    Bit-identical to quantizing each expert on its own by construction. An
    empty leading dim (a rank holding no experts of an uneven split) still
    needs the inner dtypes and trailing shapes: it quantizes one zero matrix
    without any reduction and keeps none of its values.
    """
    lead, mats = weight.shape[:-2], weight.reshape(-1, *weight.shape[-2:])
    if mats.shape[0] == 0:
        template = fmt.quantize(mats.new_zeros(mats.shape[1:]), Reducer(reduce.full_shape[-2:]))
        return {n: t.new_empty((*lead, *t.shape)) for n, t in template.items()}
    per = _PerMatrix(reduce)
    parts = [fmt.quantize(m, per) for m in mats]
    return {n: torch.stack([p[n] for p in parts]).reshape(*lead, *parts[0][n].shape) for n in parts[0]}


def wrap_quantized(fmt: QuantFormat, inner: dict, shape, dtype, full_shape) -> QuantizedTensor:
    """Wrap a (local) shard of logical ``shape`` of a weight of ``full_shape``, checking the layout."""
    layout = weight_layout(fmt, full_shape)
    if tuple(inner) != tuple(layout):
        raise LayoutError(f"{fmt}.quantize returned inner tensors {tuple(inner)}, its layout declares {tuple(layout)}")
    for (name, t), rel_row in zip(inner.items(), layout.values()):
        expected = tuple(r.inner_len(n) for r, n in zip(rel_row, shape))
        if tuple(t.shape) != expected:
            raise LayoutError(
                f"{fmt}.quantize returned inner '{name}' of shape {tuple(t.shape)} for a {tuple(shape)} "
                f"weight, but its layout says {expected}"
            )
    return QuantizedTensor(inner, fmt, tuple(layout.values()), canonical_dims(len(shape)), tuple(shape), dtype)


class MeshReducer(Reducer):
    """All-reduces a statistic over the mesh dims whose shards share its blocks.

    ``axes`` holds one ``(logical dim, process group name)`` pair per sharded
    mesh dim; a statistic laid out like inner ``like`` is all-reduced over the
    groups of the dims along which ``like`` is ``Constant``.
    """

    def __init__(self, fmt: QuantFormat, full_shape, axes: list[tuple[int, str]]):
        super().__init__(full_shape)
        self.layout = weight_layout(fmt, full_shape)
        self.axes = list(axes)

    @classmethod
    def for_mesh(cls, fmt: QuantFormat, full_shape, mesh, placements) -> MeshReducer:
        ndim = len(full_shape)
        axes = [(p.dim % ndim, mesh.get_group(m).group_name) for m, p in enumerate(placements) if shard_like(p)]
        return cls(fmt, full_shape, axes)

    def __call__(self, stat: torch.Tensor, op: str, like: str) -> torch.Tensor:
        rels = self.layout[like]
        for dim, group in self.axes:
            if isinstance(rels[dim], Constant):
                stat = reduce_nan_aware(stat, op, lambda t, o, g=group: _all_reduce(t, o, g))
        return stat


def _all_reduce(t: torch.Tensor, op: str, group: str) -> torch.Tensor:
    out = funcol.all_reduce(t.contiguous(), op, group)
    wire.note_hidden("_c10d_functional::all_reduce", out, group=group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def agree_before_reducing(fmt, weight, shard_dims, groups, full_shape) -> None:
    """Every rank of every sharded mesh dim must quantize with the same format (else the reductions mix).

    Called before the first reduction, on every sharded group whatever the
    format reduces, so every rank makes the same collectives (dtensor_quant._parallel.agree).
    """
    key = ("quantize", fmt, tuple(full_shape), weight.dtype, tuple(shard_dims))
    for d, g in zip(shard_dims, groups):
        if d >= 0:
            agree.check_same(g, key, weight, f"quantize into {fmt}", _describe_quantize)


def _describe_quantize(key) -> str:
    _, fmt, shape, dtype, dims = key
    return f"quantize a {str(dtype).removeprefix('torch.')} {shape} weight sharded on dims {list(dims)} into {fmt!r}"
