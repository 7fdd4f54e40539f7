"""``Replicate -> Shard`` of a quantized local tensor: one narrow and one clone of this rank's piece.

torch 2.13's ``Shard._replicate_to_shard``
(``torch/distributed/tensor/placement_types.py``) runs
``torch.chunk(local, n, dim)[rank].clone()``: two ops, each a trip through
``__torch_dispatch__``, and a wrapper built for every rank's piece. For a
dense local that is two C++ calls; for a quantized one, two trips through
Python dispatch and n wrappers (docs/performance.md measures the cost). The patch runs
the same computation for a quantized local -- the split's checks on every
rank, then this rank's piece cloned (:func:`dtensor_quant._ops.slicing.chunk_copy`)
-- and leaves every other local tensor, placement (``_StridedShard`` has
its own method), traced (symbolic) index and compiled graph to torch's
code. Results are the same bytes, layout and notes
(tests/parallel/test_replicate_to_shard.py compares them with torch's own
path). Installed by :func:`dtensor_quant.enable_fast_redistribute` (opt-in: a speed
shortcut, not needed for correctness).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from .._core.tensor import QuantizedTensor
from .._core.torch_patches import replace
from .._ops.slicing import chunk_copy

#: torch 2.13.0's ``Shard._replicate_to_shard`` (core.torch_patches.fingerprint of its source).
TORCH_2_13 = "d2f988cd5c48015b"


def _one_piece_for_quantized(torch_replicate_to_shard):
    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        if (
            type(self) is Shard
            and type(local_tensor) is QuantizedTensor
            and type(shard_index) is int
            and not torch.compiler.is_compiling()  # a compiled graph traces torch's ops, not this shortcut
        ):
            piece = chunk_copy(local_tensor, self.dim, mesh.size(mesh_dim=mesh_dim), shard_index)
            if piece is not None:
                return piece
        return torch_replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index)

    _replicate_to_shard.__doc__ = torch_replicate_to_shard.__doc__
    return _replicate_to_shard


def install():
    """Install the patch (once); returns it (None only on a torch without the member, with a warning)."""
    return replace(
        "replicate_to_shard",
        "Replicate -> Shard of a quantized local tensor clones only this rank's piece",
        {(Shard, "_replicate_to_shard"): (TORCH_2_13, _one_piece_for_quantized)},
        strict=False,
    )
