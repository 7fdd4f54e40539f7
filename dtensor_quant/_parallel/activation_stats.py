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

Cost, per row-parallel matmul: the maxima are taken on the bits (one integer
pass over the activation) and travel as their own bits (an int32 MAX of
sign-cleared floats is their float MAX, NaN kept: no key transform), through
c10d's all-reduce in eager mode and the functional collective where a graph
is traced or the wire recorded; the mesh dims to reduce over are worked out
once per layout. What is left is gloo's round trip: on 2 ranks sharing 2
loaded cores, mostly the wake-ups of its worker threads (docs/performance.md).
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from .._core import activations
from .._core.reductions import reduce_magnitude_max
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


def cut_groups(w_t, in_dim: int = 0, x=None) -> tuple[Cut, ...]:
    """The mesh dims whose shards of ``w_t`` (a transposed weight ``[in, out]``; or ``[out, in]`` with
    ``in_dim`` 1) or of the activation ``x`` cut ``in``, when the weight's local tensor is quantized with a
    dynamic, reduced activation scheme; else none.

    The activation counts too: a replicated weight times an activation sharded on its features is computed
    row-parallel (DTensor slices the weight locally, at no cost) -- or by gathering the activation, where
    the reduction of identical maxima is only an extra collective. Which one DTensor picks is decided after
    this handler, so it reduces in both. Worked out once per (mesh, placements) and remembered: this runs
    for every matmul of a quantized DTensor weight."""
    if not isinstance(w_t, DTensor) or not isinstance(w_t._local_tensor, QuantizedTensor):
        return ()
    scheme = w_t._local_tensor.fmt.activation_scheme
    if scheme is None or not scheme.dynamic or scheme.per_rank or w_t.ndim != 2:
        return ()
    mesh, x_mesh = w_t.device_mesh, x.device_mesh if isinstance(x, DTensor) else None
    # Meshes by identity (equal meshes may hold other groups), held by the entry so their ids stay theirs.
    key = (id(mesh), w_t.placements, in_dim, id(x_mesh), x.placements if x_mesh else None, getattr(x, "ndim", 0))
    hit = _CUTS.get(key)
    if hit is None:
        if len(_CUTS) >= _CUTS_KEPT:
            _CUTS.clear()
        hit = _CUTS[key] = (_cuts(mesh, w_t.placements, in_dim, x_mesh, x), mesh, x_mesh)
    return hit[0]


class Cut(NamedTuple):
    """One mesh dim the per-token maxima are reduced over: its process group (resolved once), the group's
    name (what the traced collective takes) and the mesh dim's name (for the wire record)."""

    group: dist.ProcessGroup
    group_name: str
    mesh_dim: str | None


_CUTS: dict = {}  # (ids of the meshes, placements, ...) -> (cuts, the meshes)
_CUTS_KEPT = 64  # layouts remembered at once (a model has a handful); past it, the cache starts again


def _cuts(mesh, placements, in_dim: int, x_mesh, x) -> tuple[Cut, ...]:
    x_cut = [False] * mesh.ndim
    if x_mesh is not None and x_mesh == mesh:
        x_cut = [shard_like(p) and p.dim % x.ndim == x.ndim - 1 for p in x.placements]
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    groups = [
        (mesh.get_group(m), names[m])
        for m, p in enumerate(placements)
        if (shard_like(p) and p.dim % 2 == in_dim) or x_cut[m]
    ]
    return tuple(Cut(g, g.group_name, name) for g, name in groups)


def _reduce_max(cuts: tuple[Cut, ...], amax: torch.Tensor) -> torch.Tensor:
    """The per-token maxima ``amax`` (``|x|``'s, fp32) all-reduced (MAX, NaN kept) over each cut mesh dim."""
    for cut in cuts:
        amax = reduce_magnitude_max(amax, functools.partial(_all_reduce, cut=cut))
    return amax


def _all_reduce(key: torch.Tensor, op: str, cut: Cut) -> torch.Tensor:
    """``op``-all-reduce of ``key`` (int32, made by the caller) over ``cut``'s group.

    In eager mode, with nothing recording the wire, the process group's own all-reduce, in place: the
    functional collective's Python wrapper, its async tensor and its wait cost several times gloo's own
    CPU time for these few bytes, once per row-parallel layer. Traced (fake or functional tensors, or any dispatch
    mode active: compile, export, ``wire.record``), the functional collective, which a graph can hold; the
    same bytes go over the same group either way, so the record shows what the fast path sends.
    """
    if type(key) is torch.Tensor and not _dispatch_modes() and not wire.recording():
        cut.group.allreduce([key], _C10D_OPTIONS[op]).wait()  # dist.all_reduce's own checks cost as much again
        return key
    with wire.on_mesh_dim(cut.mesh_dim):  # the record names the dim whichever path records it
        out = funcol.all_reduce(key.contiguous(), op, cut.group_name)
    wire.note_hidden("_c10d_functional::all_reduce", out, group=cut.group_name, mesh_dim=cut.mesh_dim)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _options(op: dist.ReduceOp) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return options


_C10D_OPTIONS = {"max": _options(dist.ReduceOp.MAX)}
_dispatch_modes = torch._C._len_torch_dispatch_stack  # fake, proxy and functional modes included


def _handle(op, args, kwargs):
    """DTensor's handler for ``op``: torch's own dispatch of it, inside a token-statistics reduction where the
    weight asks for one. The handler leaves DTensor's table while torch's dispatch runs (so calling the op runs
    torch's dispatch, not this again) and goes back after. torch 2.13 dispatches DTensor ops in C++ (no Python
    ``dispatch`` to call instead), so a dense weight -- every bf16 DTensor ``mm`` of the process once a reduced
    scheme was declared -- pays the call into this handler, a type test and a second entry into torch's
    dispatch: kept to that (no context manager, no closure), some microseconds over torch's own DTensor ``mm``
    (8-9 us against its ~40 us on a small matrix, 2 loaded ranks; docs/performance.md)."""
    where, in_dim, x_at = _WEIGHT[op]
    w_t = args[where]
    cuts = cut_groups(w_t, in_dim, args[x_at])  # () at once for a dense local
    handlers = DTensor._op_dispatcher._custom_op_handlers
    with _LOCK:
        mine = handlers.pop(op, None)
        try:
            if not cuts:
                return op(*args, **kwargs)
            with activations.token_stat_reduction(functools.partial(_reduce_max, cuts)):
                return op(*args, **kwargs)
        finally:
            if mine is not None:
                handlers[op] = mine


activations.on_reduced_scheme(install)
