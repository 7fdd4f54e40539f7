"""Per-token activation statistics reduced over the mesh dims that cut a row-parallel matmul's reduction dim.

A format that quantizes its activation per token (``Int8Rowwise(activations="int8-token")``)
takes each token's ``max |x|`` over the features. Under ``RowwiseParallel`` the
input is ``Shard(-1)``: each rank holds a slice of every token's features, and a
scale taken from the slice differs from the one-process scale, so the ranks
would compute another model (vLLM's behaviour, available explicitly as the
``"...-token-per-rank"`` schemes). Here the maximum, one float per token, is
all-reduced (MAX, NaN kept) over the mesh dims along which the weight cuts its
input dim before any rank quantizes, so every element gets the code it gets on
one process: the integer partial sums add up to the one-process sum exactly,
and the only difference left is the float sum of the ranks' partial outputs.

How: DTensor issues ``aten.mm``/``aten.addmm`` for ``F.linear`` (and the
library's ``dtensor_quant::linear`` custom op has a row-parallel strategy of
its own: the same handler covers it, its weight ``[out, in]``); the handler
installed here in DTensor's table of op handlers
(``DTensor._op_dispatcher._custom_op_handlers``, which torch's own loss
parallelism uses too) sees the weight's placements, and when it is a quantized
weight with a dynamic, reduced scheme cut on its input dim, it runs torch's own
dispatch of the op inside :func:`~dtensor_quant._core.activations.token_stat_reduction`,
which the format's ``linear`` asks for its maxima. Every other ``mm`` goes to
torch's dispatch unchanged. The handler is installed when the process first
declares such a scheme (importing the library changes nothing in torch). While
it runs torch's dispatch, the handler is out of the table: another thread's
DTensor ``mm`` at that instant would take torch's path (DTensor ops from
several threads of one process are not supported here).

The all-reduce is recorded by :func:`dtensor_quant.wire.record` as a dense
``all_reduce`` of ``tokens x 4`` bytes per rank, naming the mesh dim and the
ranks it went over (``Transfer.mesh_dim``, ``Transfer.ranks``).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from .._core import activations
from .._core.reductions import reduce_nan_aware
from .._core.tensor import QuantizedTensor
from . import custom_ops, wire
from .placements import shard_like

#: op -> (the argument holding the weight, the weight's input dim, the argument holding the activation):
#: ``mm``/``addmm`` take the activation then the transposed weight ``[in, out]`` last, ``dtensor_quant::linear``
#: the activation first and the weight ``[out, in]`` second.
_WEIGHT = {
    torch.ops.aten.mm.default: (-1, 0, -2),
    torch.ops.aten.addmm.default: (-1, 0, -2),
    custom_ops.linear_op(): (1, 1, 0),
}
_OPS = tuple(_WEIGHT)
_LOCK = threading.RLock()


def install() -> None:
    """Put the handler into DTensor's op-handler table for ``mm`` and ``addmm`` (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _OPS:
        if handlers.get(op) is None:
            handlers[op] = _handle


def installed() -> bool:
    """Whether the handler is in DTensor's table."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return all(handlers.get(op) is _handle for op in _OPS)


def cut_groups(w_t, in_dim: int = 0, x=None) -> list[tuple[str, str | None]]:
    """(group name, mesh dim name or None) of the mesh dims whose shards of ``w_t`` (a transposed weight
    ``[in, out]``; or ``[out, in]`` with ``in_dim`` 1) or of the activation ``x`` cut ``in``, when the weight's
    local tensor is quantized with a dynamic, reduced activation scheme; else none.

    The activation counts too: a replicated weight times an activation sharded on its features is computed
    row-parallel (DTensor slices the weight locally, at no cost) -- or by gathering the activation, where
    the reduction of identical maxima is only an extra collective. Which one DTensor picks is decided after
    this handler, so it reduces in both."""
    if not isinstance(w_t, DTensor) or not isinstance(w_t._local_tensor, QuantizedTensor):
        return []
    scheme = w_t._local_tensor.fmt.activation_scheme
    if scheme is None or not scheme.dynamic or scheme.per_rank or w_t.ndim != 2:
        return []
    mesh = w_t.device_mesh
    x_cut = [False] * mesh.ndim
    if isinstance(x, DTensor) and x.device_mesh == mesh:
        x_cut = [shard_like(p) and p.dim % x.ndim == x.ndim - 1 for p in x.placements]
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    return [
        (mesh.get_group(m).group_name, names[m])
        for m, p in enumerate(w_t.placements)
        if (shard_like(p) and p.dim % 2 == in_dim) or x_cut[m]
    ]


def _reduce_max(groups: list[tuple[str, str | None]], amax: torch.Tensor) -> torch.Tensor:
    for group, dim in groups:
        amax = reduce_nan_aware(amax, "max", functools.partial(_all_reduce, group=group, mesh_dim=dim))
    return amax


def _all_reduce(t: torch.Tensor, op: str, group: str, mesh_dim: str | None = None) -> torch.Tensor:
    with wire.on_mesh_dim(mesh_dim):  # the record names the dim whichever path records it
        out = funcol.all_reduce(t.contiguous(), op, group)
    wire.note_hidden("_c10d_functional::all_reduce", out, group=group, mesh_dim=mesh_dim)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


@contextlib.contextmanager
def _torch_dispatch(op):
    """The op's handler out of DTensor's table for the block, so that calling it runs torch's dispatch."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    with _LOCK:
        mine = handlers.pop(op, None)
        try:
            yield
        finally:
            if mine is not None:
                handlers[op] = mine


def _handle(op, args, kwargs):
    where, in_dim, x_at = _WEIGHT[op]
    groups = cut_groups(args[where], in_dim, args[x_at])
    with _torch_dispatch(op):
        if not groups:
            return op(*args, **kwargs)
        with activations.token_stat_reduction(functools.partial(_reduce_max, groups)):
            return op(*args, **kwargs)


activations.on_reduced_scheme(install)
