"""Gathers of a quantized local along any dim, in one step.

torch 2.13's ``all_gather_single`` (``torch/distributed/_functional_collectives.py``),
which DTensor calls for every gather of a ``Shard(d)`` tensor, all-gathers
along dim 0 and then, for ``d != 0``, runs
``torch.cat(torch.chunk(result, n), dim=d)``: for a quantized local that is
the all-gather, ``_wrap_tensor_autograd``, an ``AsyncCollectiveTensor`` and
its wait, a ``split`` and a ``cat`` -- five trips through Python dispatch
around one collective, and the received bytes copied twice (into the
stacked result, then by the ``cat``). Along dim 0 (``full_tensor`` and
every ``Shard(0)`` gather) it is the all-gather, ``_wrap_tensor_autograd``
and the wait: three trips (docs/performance.md measures the cost). The patch gathers a quantized local outside autograd
and dispatch modes with one call
(:func:`dtensor_quant._parallel.collectives.all_gather_along`: the same checks
and collective as the all-gather handler, then each inner tensor put in its
place along ``d``, at most one copy) and leaves everything else (dense
locals, tensors that require grad, traced ones, an active dispatch mode such
as ``CommDebugMode``, torch.compile) to torch's code. The same bytes on the wire, the same result
(tests/distributed/parallel/test_gather_dim.py compares it with torch's path).
Installed by :func:`dtensor_quant.enable_fast_redistribute` (opt-in: a speed
shortcut, not needed for correctness).

``DTensor.full_tensor`` is that gather plus one more trip through Python
dispatch: it hands the gathered local through ``_ToTorchTensor``, an autograd
function whose forward returns ``local.view_as(local)``, a fresh tensor object
for autograd to record into. For a dense local that view is one C++ call; for
a quantized one it is a ``__torch_dispatch__`` call building a wrapper (the
floor of any Python subclass view, bench/op_overhead.py's ``bare``), and it
runs right after the collective, while gloo's threads still share the rank's
core: on 2 pinned gloo ranks it took 76-80 us against a dense local's 39 us
(256x256 weight, one ``full_tensor`` 650-900 us), which is all of what
``full_tensor`` cost more than the same gather as ``redistribute(Replicate)``
(docs/performance.md). Where autograd records nothing (grad mode off, or a
DTensor that does not require grad) and the gather made a new local, that
local is already a fresh object nobody else holds, so the patched
``full_tensor`` returns it as it is; everything else is torch's code.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor import DTensor, Replicate

from .._core.bits import is_tracing
from .._core.tensor import QuantizedTensor
from .._core.torch_patches import replace
from .collectives import all_gather_along

#: torch 2.13.0's ``all_gather_single`` (core.torch_patches.fingerprint of its source).
TORCH_2_13 = "7822d9d52b2791f3"
#: torch 2.13.0's ``DTensor.full_tensor``.
FULL_TENSOR_2_13 = "7ecf3506c5555556"


def in_one_step(q) -> bool:
    """Whether a collective on ``q`` may skip torch's functional-collective code and run as plain calls: an
    eager quantized local outside autograd and any dispatch mode (which must see the collective)."""
    return (
        not torch.compiler.is_compiling()  # a compiled graph traces torch's ops, not this shortcut
        and type(q) is QuantizedTensor
        and not q.requires_grad
        and torch._C._len_torch_dispatch_stack() == 0
        and not is_tracing(getattr(q, q.fmt.inner_names[0]))
    )


def _gathered_along_dim(torch_all_gather_single):
    def all_gather_single(self, gather_dim, group, tag=""):
        if not in_one_step(self):
            return torch_all_gather_single(self, gather_dim, group, tag)
        group = funcol._resolve_group(group, tag)
        group_size = c10d._get_group_size_by_name(group)
        return all_gather_along(self, gather_dim, group_size, funcol._group_or_group_name(group))

    all_gather_single.__doc__ = torch_all_gather_single.__doc__
    return all_gather_single


def _full_tensor_as_gathered(torch_full_tensor):
    def full_tensor(self, *, grad_placements=None):
        local = self._local_tensor
        if (
            type(local) is not QuantizedTensor
            or (self.requires_grad and torch.is_grad_enabled())
            or not in_one_step(local)
        ):
            return torch_full_tensor(self, grad_placements=grad_placements)
        out = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim, async_op=False)._local_tensor
        if out is local or type(out) is not QuantizedTensor:  # nothing gathered (already whole): torch's fresh view
            return out.view_as(out)
        return out  # the gather's own result: a fresh tensor no other object holds

    full_tensor.__doc__ = torch_full_tensor.__doc__
    return full_tensor


def install():
    """Install the patch (once); returns it (None only on a torch without the members, with a warning)."""
    return replace(
        "gather_dim",
        "a gather of a quantized local along dim d != 0 runs its split and concatenation as plain calls, and "
        "full_tensor of a quantized local returns the gathered local without one more view through dispatch",
        {
            (funcol, "all_gather_single"): (TORCH_2_13, _gathered_along_dim),
            (DTensor, "full_tensor"): (FULL_TENSOR_2_13, _full_tensor_as_gathered),
        },
        strict=False,
    )
