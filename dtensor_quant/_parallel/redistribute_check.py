"""Every redistribute of a quantized DTensor checks its target placements before its first collective.

torch 2.13 has no hook where a local tensor type sees a redistribute's target:
``DTensor.redistribute``, ``full_tensor`` and the redistributes of op dispatch
all call ``redistribute_local_tensor(local, current_spec, target_spec)``
(``torch/distributed/tensor/_redistribute.py``), which runs the steps one by
one, and a step only sees its own piece of the move. So a ``Shard(0) ->
Shard(1)`` whose new cut splits a block gathered first -- two all-gathers --
and raised only when cutting the gathered tensor, naming the padded
intermediate DTensor makes, not the user's weight. This patch calls
:func:`dtensor_quant._parallel.placements.check_redistribute` first, for a
quantized local only: shapes alone, so every rank raises the same
``LayoutError`` (naming the legal mesh sizes) and nothing is sent. It is a
check, not a shortcut: installed when the process makes its first quantized
tensor (:func:`dtensor_quant._core.tensor.on_first_quantized_tensor`), never by
``import dtensor_quant`` alone; torch's code then runs unchanged, and for
every dense local exactly as before.

One move the target's rule allows cannot be done in torch's single step: a
``Shard(i) -> Shard(j)`` where dim ``j`` has one element under a layout
blocked along it (torch pads dim ``j`` and cuts the padding inside the
block). That move runs as ``Shard(i) -> Replicate`` then ``Replicate ->
Shard(j)``: the same result, one gather.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard, _dispatch, _redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .._core.tensor import QuantizedTensor, on_first_quantized_tensor
from .._core.torch_patches import replace
from .placements import SHARDS, check_redistribute

#: torch 2.13.0's ``redistribute_local_tensor`` (core.torch_patches.fingerprint of its source).
TORCH_2_13 = "34b9a1fd5c931804"


def _checked_first(torch_redistribute_local_tensor):
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
        if not isinstance(local_tensor, QuantizedTensor) or current_spec.tensor_meta is None:  # no shape: torch's
            return torch_redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs)
        src, dst = current_spec.placements, target_spec.placements
        for p in dst:
            if type(p) in SHARDS:
                break
        else:  # a gather (full_tensor, -> Replicate): any pieces join, nothing to check (check_redistribute's
            # own first test, here before the mesh's shape, which costs several calls, is read for it)
            return torch_redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs)
        if not check_redistribute(local_tensor, current_spec.shape, current_spec.mesh.shape, src, dst):  # may raise
            return torch_redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs)
        # Through Replicate on each mesh dim whose Shard(i) -> Shard(j) would cut DTensor's padding in a block.
        mid = tuple(Replicate() if a != b and type(a) is type(b) is Shard else b for a, b in zip(src, dst))
        mid_spec = DTensorSpec(current_spec.mesh, mid, tensor_meta=current_spec.tensor_meta)
        local_tensor = torch_redistribute_local_tensor(local_tensor, current_spec, mid_spec, *args, **kwargs)
        return torch_redistribute_local_tensor(local_tensor, mid_spec, target_spec, *args, **kwargs)

    redistribute_local_tensor.__doc__ = torch_redistribute_local_tensor.__doc__
    return redistribute_local_tensor


def install():
    """Install the check (once); returns the patch (None only on a torch without the function, with a warning)."""
    return replace(
        "redistribute_check",
        "a redistribute of a quantized local checks its target placements before any collective",
        {
            (_redistribute, "redistribute_local_tensor"): (TORCH_2_13, _checked_first),
            (_dispatch, "redistribute_local_tensor"): (TORCH_2_13, _checked_first),
        },
        strict=False,
    )


on_first_quantized_tensor(install)
