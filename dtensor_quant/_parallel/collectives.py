"""The collectives DTensor issues on a QuantizedTensor, run on its stored bytes.

torch has no per-local-type redistribute hook: DTensor calls the same c10d
ops on a quantized local tensor as on a dense one, and they arrive here.
Each one runs the same collective on the inner tensors' bytes and joins the
result with the layout's concatenation rule. A gather along any dim
(:func:`gather`; dim 0 for the all-gather op, any dim through
:mod:`dtensor_quant._parallel.gather_dim`) sends each inner tensor that must
travel as a ``uint8`` view of itself, all in one coalesced all-gather, and
for dim 0 the received tensors are the joined inner tensors themselves. It
leaves out an inner tensor that is constant along the joined dims (a
per-tensor scale: :func:`~dtensor_quant._parallel.codec.varies`) -- every piece
takes the receiver's copy -- and carries only its bytes, as a check: if the
ranks' copies differ (shards quantized one by one, then
``DTensor.from_local``), every rank raises (:func:`agree.constants_differ`).
``scatter_``, ``broadcast_`` and the all-to-all pack every inner tensor into
one ``uint8`` buffer (:mod:`dtensor_quant._parallel.codec`).
"""

from __future__ import annotations

import torch

from .._core.bits import is_tracing, same_bits
from .._core.dispatch import implements
from .._core.layout import Constant, Stacked, partial_refused
from .._core.memo import layout_key, lookup, remember
from .._core.notes import Notes, new_bytes
from .._core.tensor import QuantizedTensor
from .._ops import writes
from .._ops.layout_ops import alias, cat_dim, describe, rebuild, slice_dim
from . import agree, wire
from .codec import pack, packed_size, unpack, varies

functional = torch.ops._c10d_functional


def _refuse_partial(func, q, *args, **kwargs):
    raise partial_refused(f"a {describe(q)}", "Partial", f" ({func} would sum it)")


implements(
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_reduce_",
    "_c10d_functional::reduce_scatter_tensor",
    "c10d::allreduce_",
    "c10d::_reduce_scatter_base_",
    "c10d::reduce_scatter_",
)(_refuse_partial)


@implements("_c10d_functional::wait_tensor")
def _wait(func, q):
    """Our collectives complete before they return: nothing to wait for, and ``q`` itself back, as
    torch's ``wait_tensor`` returns its input (an alias only where one changes the notes)."""
    return q if q.notes.pending is None and not q.notes.from_factory else alias(q)


@implements("_c10d_functional::_wrap_tensor_autograd")
def _wrap(func, q):
    # A custom op, whose output may not be its input: an alias.
    return alias(q)


@implements("_c10d_functional::all_gather_into_tensor")
def all_gather_into_tensor(func, q, group_size, group_name):
    """Stack the ranks' pieces along dim 0, sending only inner tensors that can differ (:func:`gather`)."""
    return gather(func, q, group_size, group_name, 0)


def all_gather_along(q: QuantizedTensor, dim: int, group_size: int, group_name) -> QuantizedTensor:
    """The ranks' ``q`` concatenated along ``dim``: what ``all_gather_single(q, dim)`` computes, with one
    collective and one copy (no stacked intermediate to split and concatenate again)."""
    return gather(functional.all_gather_into_tensor.default, q, group_size, group_name, dim)


def gather(func, q, group_size, group_name, dim: int):
    """The ranks' pieces joined along ``dim``, from one all-gather of their bytes.

    Where every sent inner tensor simply joins along ``dim`` (its relation
    there continues the grid) or is constant along it (every rank's copy must
    agree), the layout is decided once per layout (:func:`_gather_plan`, read
    off the first call's result) and the inner tensors travel as ``uint8``
    views of themselves in one coalesced all-gather, which stacks each one's
    pieces along dim 0: for ``dim`` 0 that is the joined inner tensor itself,
    with no copy and no packing on either side (a gather's fixed cost is
    these few tensor calls; docs/performance.md measures them). Otherwise, and
    whenever sent constants turn out to differ, the same collective runs
    (:func:`_all_gather_bytes`: every path sends alike) and each rank's piece
    is joined with :func:`~dtensor_quant._ops.layout_ops.cat_dim`.
    """
    if group_size == 1:
        return alias(q)
    # Plain loops, not comprehensions: each comprehension is a call of its own, and this runs on every gather.
    inner, metas = [], []
    for name in q.fmt.inner_names:
        t = getattr(q, name)
        inner.append(t)
        metas.append((t.dtype, t.shape))
    key = ("all_gather", dim, *layout_key(q), tuple(metas), group_size, group_name)
    plain = type(inner[0]) is torch.Tensor and not inner[0].is_meta  # not traced, fake or meta
    plan = lookup(key) if plain else None
    if plan is None:
        out = _gather_pieces(func, q, group_size, group_name, dim)
        if plain:
            remember(key, _gather_plan(q, inner, out, group_size, group_name, dim), q.rels, q.dims, q.fmt)
        return out
    if plan is _PIECES:
        return _gather_pieces(func, q, group_size, group_name, dim)
    (rels, dims, shape, stride), sent, agreed, checks, known = plan
    if agree.EVERY_CALL or known[0] is not agree.world():
        if not agree.agreed(*agreed):
            agree_layout(q, group_name, "all-gather")
        # In one world agree.AGREED only grows: once it holds the key, this plan skips hashing it (the
        # format's and relations' dataclass hashes, five Python calls a gather) until the world changes
        known[0] = agree.world() if agreed in agree.AGREED else None
    kept, sending = [], []
    for t, s in zip(inner, sent):
        (kept if s is None else sending).append(t)
    got = _all_gather_bytes(func, sending, kept, group_size, group_name)
    if checks and not all(_all_equal(got[i].view(group_size, -1)) for i, _ in checks):
        copies = [[_rank_copy(got[i], t, group_size, r) for (i, _), t in zip(checks, kept)] for r in range(group_size)]
        check_kept(q, [n for _, n in checks], copies, group_name, "all-gather")  # raises, on every rank
    joined = []
    for t, s in zip(inner, sent):
        if s is None:
            joined.append(t.clone())  # sent by no rank: the same on all of them (cat_dim clones it)
            continue
        i, whole = s
        stacked = got[i].view(t.dtype)  # [ranks * n, ...]: the pieces stacked along dim 0
        if whole is None:  # constant along dim: one copy if every rank's agrees, else a Stacked join
            if not _all_equal(got[i].view(group_size, -1)):
                return _join(q, got, group_size, group_name, dim)
            joined.append(stacked[: t.shape[0]].clone())
        elif dim == 0:  # every rank's piece stacked along its dim 0 = torch.cat of the pieces
            joined.append(stacked)
        else:  # the ranks' pieces side by side along dim = torch.cat of the pieces
            joined.append(stacked.view(group_size, *t.shape).movedim(0, dim).reshape(whole))
    _, _, dtype, device = q.props
    return QuantizedTensor.make(joined, q.fmt, rels, dims, shape, stride, dtype, new_bytes(joined), device)


def _all_gather_bytes(func, sent: list[torch.Tensor], kept: list[torch.Tensor], group_size: int, group_name):
    """Every rank's bytes of ``sent`` (each as a ``uint8`` view of its shape) and of ``kept`` (flattened: only
    compared), from one coalesced all-gather: per tensor, ``[ranks * rows, ...]``, the ranks' pieces stacked.

    The one wire format of every quantized gather, planned or not: ranks whose layouts agree may still take
    different paths here (a padded last shard is a layout of its own), and they must issue the same collective.
    """
    # Each tensor's bytes as a ``uint8`` tensor of its shape (the last dim times its element size), no copy
    # where it is contiguous: one dtype for every inner tensor, so they share one collective (gloo has no
    # float8), and bits a float dtype could canonicalise travel as bytes. A 0-d tensor travels as 1-d.
    # Inline loops: a helper call per tensor costs more than the view, on every gather.
    send = []
    for t in sent:
        send.append((t if t.ndim else t.reshape(1)).contiguous().view(torch.uint8))
    for t in kept:
        send.append(t.reshape(-1).contiguous().view(torch.uint8))
    wire.note(func._schema.name, send, group=group_name)
    got = functional.all_gather_into_tensor_coalesced(send, group_size, group_name)
    wait, out = functional.wait_tensor, []
    for g in got:
        out.append(wait(g))
    return out


def _rank_copy(got: torch.Tensor, t: torch.Tensor, group_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``t`` (dtype and shape) out of :func:`_all_gather_bytes`'s result ``got`` for it.

    A narrow by byte count, not ``got.view(group_size, -1)[rank]``: for an empty ``t`` (a zero-size shard) that
    row's storage offset is ``rank`` bytes, which no wider dtype can view."""
    n = got.numel() // group_size
    return got.view(-1).narrow(0, rank * n, n).view(t.dtype).view(t.shape)


def _all_equal(rank_bytes: torch.Tensor) -> bool:
    """Whether every rank's row of ``rank_bytes`` (``[ranks, bytes]``, uint8) holds the same bytes."""
    return torch.equal(rank_bytes, rank_bytes[:1].expand_as(rank_bytes))


def _gather_pieces(func, q, group_size, group_name, dim: int = 0):
    """The all-gather as pieces: each rank's inner tensors (views of the received bytes), joined along
    ``dim`` by the layout's rule (:func:`~dtensor_quant._ops.layout_ops.cat_dim`: one copy)."""
    agree_layout(q, group_name, "all-gather")
    sent, kept = _sent(q)
    got = _all_gather_bytes(func, [getattr(q, n) for n in sent], [getattr(q, n) for n in kept], group_size, group_name)
    return _join(q, got, group_size, group_name, dim)


def _sent(q) -> tuple[list[str], list[str]]:
    """The inner tensors a gather sends (those that can differ between ranks), and those it only compares."""
    names = [n for n in q.fmt.inner_names if varies(q, n)]
    return names, [n for n in q.fmt.inner_names if n not in names]


def _join(q, got: list[torch.Tensor], group_size: int, group_name, dim: int) -> QuantizedTensor:
    """:func:`_all_gather_bytes`'s result ``got`` (of :func:`_sent`'s tensors) as each rank's piece, the kept
    tensors compared, the pieces joined along ``dim`` by :func:`~dtensor_quant._ops.layout_ops.cat_dim`."""
    names, kept = _sent(q)
    like = [getattr(q, n) for n in names + kept]
    rank_copies = [[_rank_copy(g, t, group_size, r) for g, t in zip(got, like)] for r in range(group_size)]
    check_kept(q, kept, [c[len(names) :] for c in rank_copies], group_name, "all-gather")
    pieces, stride = [], q.stride()
    for copies in rank_copies:
        copies = dict(zip(names, copies))
        inner = [copies.get(n, getattr(q, n)) for n in q.fmt.inner_names]
        # Only joined below (its notes are never read): q's layout, over this rank's bytes.
        pieces.append(
            QuantizedTensor.make(inner, q.fmt, q.rels, q.dims, q.shape, stride, q.dtype, Notes(None), q.device)
        )
    return cat_dim(pieces, dim)


def check_kept(q: QuantizedTensor, kept, copies: list[list[torch.Tensor]], group, what: str) -> None:
    """Raise on every rank if the ranks' ``copies`` (one list per rank) of ``q``'s unsent inner tensors differ.

    Every rank received the same copies, so every rank decides the same.
    """
    if not kept or is_tracing(copies[0][0]):  # compiled graphs read no data in dispatch
        return
    if all(same_bits(c, r) for row in copies[1:] for c, r in zip(row, copies[0])):
        return
    group = _group(group)
    ranks = [torch.distributed.get_global_rank(group, i) for i in range(len(copies))]
    raise agree.constants_differ(f"{what} of a {describe(q)}", kept, copies, ranks)


_PIECES = "pieces"  # the plan of a gather whose result reads the data (sent constants): always the pieces


def _gather_plan(q, inner, out, group_size, group_name, dim):
    """``(result layout, per inner (its place in the coalesced gather, joined shape, or None where it is
    constant along dim) or None if not sent, the key agree.AGREED holds once the ranks agreed, (place, name)
    of each kept tensor's bytes, a cell: [the world's token] once agree.AGREED is seen to hold that key in that
    world (agree.world))``, or ``_PIECES``.

    The gather sends the sent tensors, then the kept ones (not sent: each rank keeps its own; their bytes
    travel only to be compared), flattened. The layout is
    ``out``'s, the first call's result: only where that call's sent constants agreed (a ``Constant``
    relation along ``dim`` in ``out``), so that it is the layout of every call whose constants agree.
    """
    sent, kept = [], []
    for i, (name, t, row) in enumerate(zip(q.fmt.inner_names, inner, q.rels)):
        if not varies(q, name):
            sent.append(None)
            kept.append(name)
            continue
        if isinstance(row[dim], Stacked) or t.ndim == 0 or 0 in t.shape:
            return _PIECES  # runs of several grids, or nothing to cut
        if isinstance(row[dim], Constant):
            if not isinstance(out.rels[i][dim], Constant):
                return _PIECES  # the ranks' copies differed: a Stacked result, read from the data each call
            whole = None
        else:
            whole = (*t.shape[:dim], group_size * t.shape[dim], *t.shape[dim + 1 :])
        sent.append((len(sent) - len(kept), whole))
    n_sent = len(sent) - len(kept)
    if not n_sent:
        return _PIECES
    checks = tuple((n_sent + j, name) for j, name in enumerate(kept))
    layout = (out.rels, out.dims, out.shape, out.stride())
    return layout, tuple(sent), (agree.group_name_of(group_name), agree.layout_key(q)), checks, [None]


@implements("c10d::scatter_")
def scatter_(func, outputs, inputs, process_group, root_rank, async_op=True, timeout=-1):
    """distribute_tensor's Shard path: the source sends each rank its piece's bytes."""
    (out,) = outputs
    agree_layout(out, process_group, "distribute_tensor (scatter)")
    names = out.fmt.inner_names
    like = [getattr(out, n) for n in names]
    out_buf = torch.empty(packed_size(like), dtype=torch.uint8, device=out.device)
    in_bufs = [[pack([getattr(p, n) for n in names]) for p in row] for row in inputs]
    wire.note(func._schema.name, out_buf, group=process_group)
    _, work = func([out_buf], in_bufs, process_group, root_rank, async_op, timeout)
    work.wait()
    writes.write_inner(out, zip(like, unpack(out_buf, like)))
    return [out], work


@implements("c10d::broadcast_")
def broadcast_(func, tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    """distribute_tensor's Replicate path: every inner tensor from the source, in place."""
    (q,) = tensors
    agree_layout(q, process_group, "distribute_tensor (broadcast)")
    like = list(q.inner.values())
    buf = pack(like)
    wire.note(func._schema.name, buf, group=process_group)
    _, work = func([buf], process_group, root_rank, root_tensor, async_op, timeout)
    work.wait()
    writes.write_inner(q, zip(like, unpack(buf, like)))
    return [q], work


@implements("_c10d_functional::broadcast")
def broadcast(func, q, src, group_name):
    agree_layout(q, group_name, "broadcast")
    like = list(q.inner.values())
    buf = pack(like)
    wire.note(func._schema.name, buf, group=group_name)
    out = functional.wait_tensor(func(buf, src, group_name))
    inner = dict(zip(q.fmt.inner_names, (t.clone() for t in unpack(out, like))))
    return rebuild(q, inner, q.shape)


@implements("_dtensor::shard_dim_alltoall")
def shard_dim_alltoall(func, q, gather_dim, shard_dim, group_name):
    """Shard(i) -> Shard(j) on NCCL: every rank sends piece k of its shard to rank k."""
    group = _group(group_name)
    n, me = group.size(), torch.distributed.get_rank(group)
    # Split first: a misaligned target placement raises on every rank before any collective (the layout
    # agreement's included; redistribute_check has refused a target the layout cannot hold before this).
    pieces = torch.split(q, -(-q.shape[shard_dim] // n), shard_dim) if q.shape[shard_dim] else [q] * n
    pieces = list(pieces) + [slice_dim(q, shard_dim, q.shape[shard_dim], q.shape[shard_dim])] * (n - len(pieces))
    agree_layout(q, group_name, "all-to-all", shape=False)  # the pieces' shapes may differ between ranks
    names = [name for name in q.fmt.inner_names if varies(q, name, (gather_dim,))]
    kept = [name for name in q.fmt.inner_names if name not in names]
    checked = [getattr(q, name) for name in kept]  # after each piece: every rank gets every rank's copy
    send = [[getattr(p, name) for name in names] + checked for p in pieces]
    sizes = {packed_size(s) for s in send}
    if len(sizes) != 1:
        raise ValueError(f"{describe(q)}: all-to-all needs equal pieces along dim {shard_dim}")
    buf = pack([t for s in send for t in s])  # each tensor is padded on its own: rank k's bytes are piece k's
    wire.note(func._schema.name, buf, group=group_name)
    split = [sizes.pop()] * n
    out = functional.wait_tensor(functional.all_to_all_single(buf, split, split, group_name))
    mine = pieces[me]
    size = out.numel() // n  # narrowed, not out.view(n, -1)[r]: an empty row there sits at an odd offset
    rank_bufs = [unpack(out.narrow(0, r * size, size), send[me]) for r in range(n)]
    check_kept(q, kept, [b[len(names) :] for b in rank_bufs], group_name, "all-to-all")
    received = []
    for got in rank_bufs:
        got = dict(zip(names, got))
        received.append(rebuild(mine, {k: got.get(k, t) for k, t in mine.inner.items()}, mine.shape))
    return cat_dim(received, gather_dim).contiguous()


def check_consistent(dt) -> None:
    """Raise ``LayoutError`` on every rank unless the ranks' local quantized tensors make one DTensor ``dt``.

    For ``DTensor.from_local`` of quantized pieces, whose ``run_check`` compares only dtypes and shapes
    (and broadcasts rank 0's tensor along Replicate dims): along every mesh dim the ranks must hold the
    same layout, and along a sharded dim the same bytes in each inner tensor that is constant along it
    (a per-tensor scale, NF4's mean, the per-row scales of a column shard), since every rank keeps its
    own copy of those for the whole tensor; along a replicated dim, the same bytes in every inner
    tensor. Shards quantized one by one fail this: their statistics are their own. Gathers
    (``full_tensor``, ``redistribute``) check the kept tensors themselves, after their collective; this
    checks before any, at one 8-byte all-gather per mesh dim and inner tensor compared. A dense ``dt``
    passes.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor) or not isinstance(dt.to_local(), QuantizedTensor):
        return
    local = dt.to_local()
    for i, placement in enumerate(dt.placements):
        if placement.is_partial():
            raise partial_refused(f"a {describe(local)}", "Partial", "")
        group = dt.device_mesh.get_group(i).group_name
        what = f"check_consistent (mesh dim {i}, {placement}) of a {describe(local)}"
        agree_layout(local, group, what, shape=False)  # the pieces' shapes may differ (uneven shards)
        dim = getattr(placement, "dim", None)
        names = [n for n in local.fmt.inner_names if dim is None or not varies(local, n, (dim,))]
        agree.check_digests(group, {n: getattr(local, n) for n in names}, what)


def agree_layout(q: QuantizedTensor, group, what: str, shape: bool = True) -> None:
    """Every rank of ``group`` must hold ``q`` in the same layout (a clear error on all of them if not)."""
    key = agree.layout_key(q)
    if not shape:
        key = key[:4] + (None, tuple(d for d, _ in key[5]))
    group = agree.group_name_of(group)
    if agree.agreed(group, key):  # agreed before: not even the message to build
        return
    agree.check_same(group, key, next(iter(q.inner.values())), f"{what} of a {describe(q)}", _describe_key)


def _describe_key(key) -> str:
    if key[4] is None:
        relations = [[str(r) for r in row] for row in key[1]]
        return f"{key[0]!r}, {key[3]}, inner dtypes {[str(d) for d in key[5]]}, relations {relations}"
    return agree.describe_key(key)


def _group(group_name):
    if isinstance(group_name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group_name)
    return group_name
