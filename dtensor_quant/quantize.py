"""quantize(): dense tensor or sharded DTensor in, QuantizedTensor (or DTensor of them) out.

For a sharded DTensor each rank quantizes its own shard. A statistic whose
block spans shards (a per-row maximum under column sharding, a per-tensor
maximum under any sharding) is all-reduced over exactly the mesh dims whose
shards share it, so the result is bit-identical to quantizing the full
tensor and then distributing it. A statistic whose blocks all fall inside
one shard needs no collective at all.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from .format import QuantFormat, Reducer
from .layout import Constant
from .ops import canonical_dims
from .placements import _shard_like, check_placements
from .tensor import QuantizedTensor


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Quantize a dense 2-D weight (or a DTensor of one) into ``fmt``.

    Returns a :class:`QuantizedTensor` with the same logical shape and dtype,
    or, for a DTensor, a DTensor with the same mesh and placements whose local
    tensors are quantized. Raises :class:`~dtensor_quant.LayoutError` on every
    rank, before any collective, when a placement cuts a pack or a group.
    """
    if isinstance(weight, QuantizedTensor) or (
        isinstance(weight, DTensor) and isinstance(weight._local_tensor, QuantizedTensor)
    ):
        raise ValueError(f"the tensor is already quantized; dequantize() it before quantizing into {fmt}")
    if isinstance(weight, DTensor):
        return _quantize_dtensor(weight, fmt)
    fmt.check_weight(weight.shape, weight.dtype)
    with torch.no_grad():
        inner = fmt.quantize(weight.detach(), Reducer(weight.shape))
    return _wrap(fmt, inner, weight.shape, weight.dtype, weight.shape)


def _wrap(fmt: QuantFormat, inner: dict, shape, dtype, full_shape) -> QuantizedTensor:
    """Wrap a (local) shard of logical ``shape`` of a weight of ``full_shape``, checking the layout."""
    rels = tuple(fmt.layout_for(full_shape).values())
    for (name, t), rel_row in zip(inner.items(), rels):
        expected = tuple(r.inner_len(n) for r, n in zip(rel_row, shape))
        assert tuple(t.shape) == expected, f"{fmt}.quantize made '{name}' {tuple(t.shape)}, layout says {expected}"
    return QuantizedTensor(inner, fmt, rels, canonical_dims(len(shape)), tuple(shape), dtype)


def _quantize_dtensor(weight: DTensor, fmt: QuantFormat) -> DTensor:
    mesh, placements = weight.device_mesh, weight.placements
    check_placements(weight.shape, fmt, mesh.shape, placements)
    local = weight.to_local().detach()
    with torch.no_grad():
        inner = fmt.quantize(local, MeshReducer(fmt, weight.shape, mesh, placements))
    q = _wrap(fmt, inner, local.shape, weight.dtype, weight.shape)
    return DTensor.from_local(q, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride())


class MeshReducer(Reducer):
    """All-reduces a statistic over the mesh dims whose shards share its blocks."""

    def __init__(self, fmt: QuantFormat, full_shape, mesh, placements):
        super().__init__(full_shape)
        self.layout = fmt.layout_for(full_shape)
        self.mesh, self.placements = mesh, placements

    def __call__(self, stat: torch.Tensor, op: str, like: str) -> torch.Tensor:
        rels = self.layout[like]
        for mesh_dim, p in enumerate(self.placements):
            if _shard_like(p) and isinstance(rels[p.dim % len(rels)], Constant):
                stat = funcol.all_reduce(stat.contiguous(), op, (self.mesh, mesh_dim))
                stat = funcol.wait_tensor(stat) if isinstance(stat, funcol.AsyncCollectiveTensor) else stat
        return stat
