"""``Shard(i) -> Shard(j)`` of a quantized local on a CPU mesh: one gather, then this rank's piece.

gloo has no all-to-all, so torch 2.13's ``shard_dim_alltoall``
(``torch/distributed/tensor/_collective_utils.py``, called by
``Shard._to_new_shard_dim``) gathers the whole tensor along ``i`` on a CPU
mesh, chunks it along ``j`` into every rank's piece and keeps one:
``Shard._custom_chunk(gathered, n, j)[rank].contiguous()``. For a quantized
local the chunk is a trip through ``__torch_dispatch__`` and a wrapper built
for every rank's piece (docs/performance.md measures the cost). The patch gathers in one step
(:func:`dtensor_quant._parallel.collectives.all_gather_along`, as
:mod:`dtensor_quant._parallel.gather_dim` does) and keeps this rank's piece
(:func:`dtensor_quant._ops.slicing.chunk_view`: every rank's cuts checked,
one slice), then ``contiguous()`` as torch does. It leaves every other case
-- a dense local, a CUDA mesh (NCCL's all-to-all), a tensor that requires
grad, a traced one, an active dispatch mode, torch.compile, a rank past the
last piece -- to torch's code. The same bytes on the wire, the same result
(tests/distributed/parallel/test_shard_to_shard.py compares it with torch's
path). Installed by :func:`dtensor_quant.enable_fast_redistribute` (opt-in: a speed
shortcut, not needed for correctness).
"""

from __future__ import annotations

import torch.distributed.tensor.placement_types as placement_types
from torch.distributed import _functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d

from .._core.torch_patches import replace
from .._ops.slicing import chunk_sizes, chunk_view
from .collectives import all_gather_along
from .gather_dim import in_one_step

#: torch 2.13.0's ``shard_dim_alltoall`` (core.torch_patches.fingerprint of its source).
TORCH_2_13 = "0c06bbdd1a372d9a"


def _in_one_step(q, shard_dim: int, mesh, mesh_dim: int) -> int | None:
    """This rank's piece when the shortcut takes ``q``, else None (torch's code)."""
    # Ranks may decide differently (one past the last piece): torch's path gathers a quantized local with the
    # same collective (gather_dim, else the all-gather handler: collectives._all_gather_bytes), so they still meet.
    if not (in_one_step(q) and mesh.device_type == "cpu"):
        return None
    rank = mesh.get_local_rank(mesh_dim)  # once: it costs a dozen calls
    return rank if rank < len(chunk_sizes(q.props[0][shard_dim], mesh.size(mesh_dim))) else None


def _gathered_then_cut(torch_shard_dim_alltoall):
    def shard_dim_alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
        rank = _in_one_step(input, shard_dim, mesh, mesh_dim)
        if rank is None:
            return torch_shard_dim_alltoall(input, gather_dim, shard_dim, mesh, mesh_dim)
        group = funcol._resolve_group((mesh, mesh_dim))
        n = c10d._get_group_size_by_name(group)
        gathered = all_gather_along(input, gather_dim, n, funcol._group_or_group_name(group))
        return chunk_view(gathered, shard_dim, n, rank).contiguous()

    shard_dim_alltoall.__doc__ = torch_shard_dim_alltoall.__doc__
    return shard_dim_alltoall


def install():
    """Install the patch (once); returns it (None only on a torch without the member, with a warning)."""
    return replace(
        "shard_to_shard",
        "Shard(i) -> Shard(j) of a quantized local on a CPU mesh gathers in one step and keeps one piece",
        {(placement_types, "shard_dim_alltoall"): (TORCH_2_13, _gathered_then_cut)},
        strict=False,
    )
