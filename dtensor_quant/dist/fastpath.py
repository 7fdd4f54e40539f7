"""The hot ops' decisions, made once per (op, layout) and replayed on every later call.

Every handler in :mod:`dtensor_quant.aten` re-derives its result's relations,
orientation, shape and strides from the input's layout on each call, and
builds the result through the validating constructor. That is most of the
time of a small op: a dense ``.t()`` costs about 1 us, the derived one 15 us.
Decode and small layers issue the same few ops on the same few layouts over
and over (``t``/``mm`` for every linear; all-gather, alias and ``split`` for
every gather), so this module keeps, per (op, layout, static arguments), what
the handler decided, and on a hit only runs the inner tensors' own ops and
builds the wrapper directly. Covered: ``t``/``transpose``, the aliases
(``detach``, ``alias``, ``lift_fresh``, ``wait_tensor``,
``_wrap_tensor_autograd``, ``view`` to the same shape), ``view(-1)``,
``split``/``split_with_sizes``, the functional all-gather, and ``mm``/``addmm``
of an activation and ``w.t()``. Only decisions are kept, never results or
bytes: every call reads the inner tensors as they are.

One result is lazier than the handler's: ``t()`` leaves its inner transposes
to the first read of an inner tensor (:data:`~dtensor_quant.tensor.PENDING`),
because the ``mm`` that follows it in every ``F.linear`` runs the kernel on
the weight's own inner tensors. They are views, so reading them later gives
what reading them at once would have; formats with an inner name that is
also a Tensor attribute (NF4's ``mean``) get them at once.

A layout here is what the decision depends on: the format, relation rows and
orientation (by object identity: a plan pins the objects it was made for, so
an identity cannot be reused while the plan lives, and an equal layout in a
different object only costs one more plan), plus logical dtype, shape and
strides, and for a collective the inner dtypes and shapes and the group. The
first call of each key runs the ordinary handler and the plan is read off its
result, so a plan is the handler's own decision, not a second derivation.

Never cached, always the ordinary handler:

* inputs that carry annotations which change a result (``writes.SHARED``,
  ``writes.FACTORY``, ``PADDED_ROWS``) for ``split``;
* traced, fake or meta inner tensors (``torch.compile``, ``to_empty``);
* decisions that read data: an all-gather of an inner tensor that is constant
  along the gathered dim but sent (whether the pieces agree is looked at);
* anything a handler refuses: the error comes from the handler every time.

Checks that must run every call still do: the cross-rank layout agreement
(:mod:`dtensor_quant.agree`, ``DTENSOR_QUANT_AGREE_EVERY_CALL`` included) and
the wire log. ``DTENSOR_QUANT_FASTPATH=0`` or ``with fastpath.disabled():``
turns the fast path off (the tests compare both paths bit for bit).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.utils import _python_dispatch

from . import agree, codec, collectives, wire
from ..core import dispatch
from ..ops import matmul
from ..core.padded_rows import PADDED_ROWS
from ..core.layout import Constant, Opaque, Stacked, inner_slice
from ..ops.layout_ops import canonical_dims, view_of
from ..core.tensor import PENDING, QuantizedTensor
from ..ops.writes import FACTORY, SHARED

ENABLED = os.environ.get("DTENSOR_QUANT_FASTPATH", "1") not in ("", "0")
_MAX_PLANS = 4096  # a long run that keeps making new layouts starts over instead of growing
_PLANS: dict = {}
_SLOW = object()  # a plan that says: this key always takes the ordinary handler
_FAST: dict = {}  # schema name -> fast handler
_BY_OP: dict = {}  # OpOverload -> fast handler or None, filled on first use


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block on the ordinary handlers only (the reference the fast path is tested against)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def plans() -> dict[tuple, bool]:
    """The plans kept now, by key: True where the key takes the fast path, False where it always
    takes the ordinary handler. Tests read it to see that plans are made once, then replayed."""
    return {key: plan is not _SLOW for key, (plan, _) in _PLANS.items()}


def clear() -> None:
    """Forget every plan (never needed for correctness: plans are keyed on everything they depend on)."""
    _PLANS.clear()


def run(func, args, kwargs):
    """The fast result of ``func``, or ``NotImplemented`` when the ordinary handler must run."""
    if not ENABLED:
        return NotImplemented
    fast = _BY_OP.get(func, _SLOW)
    if fast is _SLOW:
        fast = _BY_OP[func] = _FAST.get(func._schema.name)
    if fast is None:
        return NotImplemented
    return fast(func, args, kwargs)


dispatch.FAST_PATH = run


def _fast(*names: str):
    def register(fn):
        for name in names:
            _FAST[name] = fn
        _BY_OP.clear()
        return fn

    return register


def _plain(q) -> bool:
    """An eager QuantizedTensor whose inner tensors hold data (not traced, fake or meta)."""
    if type(q) is not QuantizedTensor:
        return False
    t = getattr(q, q.fmt.inner_names[0])
    return type(t) is torch.Tensor and not t.is_meta


def _key(q) -> tuple:
    return (id(q.rels), id(q.dims), id(q.fmt), q.dtype, q.shape, q.stride())


def _remember(key, plan, *tensors):
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = (plan, [(q.rels, q.dims, q.fmt) for q in tensors])  # pins the objects whose ids are in the key
    return plan


def _meta(out: QuantizedTensor) -> tuple:
    return (out.rels, out.dims, tuple(out.shape), tuple(out.stride()), out.dtype)


def _make(q: QuantizedTensor, inner, meta) -> QuantizedTensor:
    """``QuantizedTensor(inner, q.fmt, *meta)`` without re-validating what the plan's first call did."""
    rels, dims, shape, stride, dtype = meta
    out = torch.Tensor._make_wrapper_subclass(QuantizedTensor, shape, strides=stride, dtype=dtype, device=q.device)
    out.fmt, out.rels, out.dims = q.fmt, rels, dims
    for name, t in zip(q.fmt.inner_names, inner):
        setattr(out, name, t)
    return out


def _inner(q: QuantizedTensor) -> list[torch.Tensor]:
    return [getattr(q, name) for name in q.fmt.inner_names]


# -- aliases and views --------------------------------------------------------

_KEEP_ON_ALIAS = (
    SHARED,
    PADDED_ROWS,
)  # what layout_ops.alias keeps (writes.keep_shared, fsdp_padding.keep_padded_rows)


def _alias(q: QuantizedTensor) -> QuantizedTensor:
    """``layout_ops.alias``: the same layout, inner tensors detached; an alias of a view is the same view."""
    out = _make(q, [t.detach() for t in _inner(q)], (q.rels, q.dims, q.shape, q.stride(), q.dtype))
    d, od = q.__dict__, out.__dict__
    for k in _KEEP_ON_ALIAS:
        if k in d:
            od[k] = d[k]
    return out


@_fast(
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "_c10d_functional::wait_tensor",
    "_c10d_functional::_wrap_tensor_autograd",
)
def _alias_op(func, args, kwargs):
    q = args[0]
    if not _plain(q):
        return NotImplemented
    return _alias(q)


@_fast("aten::t", "aten::transpose")
def _transpose(func, args, kwargs):
    q = args[0]
    if kwargs or not _plain(q):
        return NotImplemented
    nd = q.ndim
    if len(args) == 1:
        if nd != 2:
            return _alias(q)
        d0, d1 = 0, 1
    else:
        d0, d1 = args[1] % nd, args[2] % nd
        if d0 == d1:
            return _alias(q)
    key = ("transpose", _key(q), d0, d1)
    hit = _PLANS.get(key)
    if hit is None:
        out = dispatch.HANDLERS["aten::transpose"](func, q, d0, d1)
        # Deferred only where an unset inner name reaches QuantizedTensor.__getattr__: NF4's "mean"
        # would otherwise read as torch.Tensor.mean.
        _remember(key, (_meta(out), not any(hasattr(QuantizedTensor, n) for n in q.fmt.inner_names)), q)
        return out
    meta, deferred = hit[0]
    if deferred:
        # The inner transposes are made when first read (tensor.PENDING): F.linear's t() is followed
        # by an mm that reads the weight's own inner tensors (_mm below), so they are mostly never made.
        out = _make(q, (), meta)
        out.__dict__[PENDING] = (_transpose_inner, q, d0, d1)
    else:
        out = _make(q, [view_of(t.transpose(d0, d1), t) for t in _inner(q)], meta)
    d, od = q.__dict__, out.__dict__
    if SHARED in d:
        od[SHARED] = d[SHARED]
    od["_transposed_from"] = d.get("_transposed_from", q)
    return out


def _transpose_inner(out: QuantizedTensor, q: QuantizedTensor, d0: int, d1: int) -> None:
    """Set ``out``'s inner tensors to ``q``'s transposed, as the handler makes them.

    Each records the tensor it views (``layout_ops.view_of``: kernels cache on that one). Made
    below autograd's view tracking and any dispatch mode, as inside ``__torch_dispatch__``,
    wherever the first read happens.
    """
    with torch._C._AutoDispatchBelowADInplaceOrView(), _python_dispatch._disable_current_modes():
        for name in q.fmt.inner_names:
            t = getattr(q, name)
            setattr(out, name, view_of(t.transpose(d0, d1), t))


@_fast("aten::view", "aten::_unsafe_view")
def _view(func, args, kwargs):
    q, size = args[0], args[1]
    if kwargs or not _plain(q):
        return NotImplemented
    size = tuple(size)
    if size == tuple(q.shape):
        return _alias(q)
    if len(size) != 1 or q.ndim < 2 or size[0] not in (-1, q.numel()):
        return NotImplemented
    key = ("flatten", _key(q))
    hit = _PLANS.get(key)
    if hit is None:
        flat = q.dims == canonical_dims(q.ndim)  # else the handler refuses or takes another branch
        out = dispatch.HANDLERS["aten::view"](func, q, size)
        _remember(key, _meta(out) if flat else _SLOW, q)
        return out
    if hit[0] is _SLOW:
        return NotImplemented
    meta = hit[0]
    rels = meta[0]
    if any(isinstance(row[0], Opaque) for row in rels):
        # A flatten that does not follow the flat index is an Opaque, which equals only itself:
        # a fresh one per result, as the handler makes, so two results never look like one grid.
        rels = tuple((type(row[0])(),) if isinstance(row[0], Opaque) else row for row in rels)
        meta = (rels, *meta[1:])
    return _make(q, [t.reshape(-1) for t in _inner(q)], meta)


# -- split ---------------------------------------------------------------------

_CHANGES_SLICES = (SHARED, FACTORY, PADDED_ROWS)  # what slice_dim and writes.note_slice read


@_fast("aten::split", "aten::split_with_sizes")
def _split(func, args, kwargs):
    q = args[0]
    if kwargs or len(args) > 3 or not _plain(q) or any(k in q.__dict__ for k in _CHANGES_SLICES):
        return NotImplemented
    sizes = args[1] if isinstance(args[1], int) else tuple(args[1])
    dim = (args[2] if len(args) > 2 else 0) % q.ndim
    key = ("split", func._schema.name, _key(q), sizes, dim)
    hit = _PLANS.get(key)
    if hit is None:
        outs = dispatch.HANDLERS[func._schema.name](func, *args)
        _remember(key, _split_plan(q, outs, dim), q)
        return outs
    if hit[0] is _SLOW:
        return NotImplemented
    pieces, cuts = hit[0]
    columns = [_cut(t, dim, c) for t, c in zip(_inner(q), cuts)]  # per inner, its piece of every output
    result = []
    for i, (meta, notes) in enumerate(pieces):
        out = _make(q, [col[i] for col in columns], meta)
        for k, v in notes:
            out.__dict__[k] = dict(v) if isinstance(v, dict) else v
        result.append(out)
    return result


def _cut(t: torch.Tensor, dim: int, cuts) -> list[torch.Tensor]:
    """``[t.narrow(dim, i0, n) for i0, n in cuts]``: one ``split_with_sizes`` when the cuts tile ``t``."""
    tiling, pieces = cuts
    if tiling is not None and t.shape[dim] == tiling[1]:
        return t.split_with_sizes(tiling[0], dim)
    return [t.narrow(dim, i0, n) for i0, n in pieces]


def _split_plan(q, outs, dim):
    """``(per piece (layout, annotations slice_dim left), per inner (tiling or None, its narrows))``.

    A tiling is ``(sizes, total)`` when an inner tensor's pieces follow one another from 0 to
    ``total`` (what ``split_with_sizes`` makes in one op); a constant inner is not cut, so every
    piece narrows the whole of it.
    """
    if not outs:
        return _SLOW
    pieces, narrows, start = [], [[] for _ in q.rels], 0
    for out in outs:
        stop = start + out.shape[dim]
        for cuts, rel_row in zip(narrows, q.rels):
            i0, i1, _ = inner_slice(rel_row[dim], start, stop, q.shape[dim])
            cuts.append((i0, i1 - i0))
        notes = tuple((k, out.__dict__[k]) for k in _CHANGES_SLICES if k in out.__dict__)
        pieces.append((_meta(out), notes))
        start = stop
    per_inner = []
    for cuts in narrows:
        ends = [i0 + n for i0, n in cuts]
        tiles = all(i0 == end for (i0, _), end in zip(cuts[1:], ends)) and cuts[0][0] == 0
        per_inner.append(((tuple(n for _, n in cuts), ends[-1]) if tiles else None, tuple(cuts)))
    return tuple(pieces), tuple(per_inner)


# -- all-gather ------------------------------------------------------------------


@_fast("_c10d_functional::all_gather_into_tensor")
def _all_gather(func, args, kwargs):
    q, group_size, group_name = args
    if kwargs or group_size == 1 or not _plain(q):
        return NotImplemented
    inner = _inner(q)
    key = ("all_gather", _key(q), tuple((t.dtype, t.shape) for t in inner), group_size, group_name)
    hit = _PLANS.get(key)
    if hit is None:
        out = collectives.all_gather_into_tensor(func, q, group_size, group_name)
        _remember(key, _gather_plan(q, out, group_size, group_name), q)
        return out
    plan = hit[0]
    if plan is _SLOW:
        return NotImplemented
    meta, sent, widths, agreed = plan
    if agree.EVERY_CALL or agreed not in agree.AGREED:  # collectives.agree_layout's own first test, key kept
        collectives.agree_layout(q, group_name, "all-gather")
    buf = codec.pack([t for t, s in zip(inner, sent) if s is not None])
    wire.note(func._schema.name, buf)
    c10d = torch.ops._c10d_functional
    rows = c10d.wait_tensor(c10d.all_gather_into_tensor(buf, group_size, group_name)).view(group_size, -1)
    columns = rows.split_with_sizes(widths, 1)  # [ranks, bytes] per sent tensor (and per padding)
    joined = []
    for t, s in zip(inner, sent):
        if s is None:
            joined.append(t.clone())  # a tensor no rank sent: the same on all of them (cat_dim clones it)
        else:
            column, shape = s  # every rank's piece, stacked along its dim 0 = torch.cat of the pieces
            joined.append(columns[column].view(t.dtype).reshape(shape))
    return _make(q, joined, meta)


def _gather_plan(q, out, group_size, group_name):
    """``(result layout, per inner (its column of the buffer, gathered shape) or None if not sent,
    the columns' widths in bytes, the key agree.AGREED holds once the ranks agreed)``, or _SLOW.

    A rank's buffer is :func:`codec.pack` of the sent tensors: each one's bytes, then padding.
    """
    sent, widths = [], []
    for name, t, row in zip(q.fmt.inner_names, _inner(q), q.rels):
        if not codec.varies(q, name):
            sent.append(None)
            continue
        if isinstance(row[0], (Constant, Stacked)) or t.ndim == 0 or 0 in t.shape:
            return _SLOW  # whether the gathered pieces agree may be read from the data; or nothing to view
        nbytes = t.numel() * t.element_size()
        sent.append((len(widths), (group_size * t.shape[0], *t.shape[1:])))
        widths += [nbytes, -nbytes % codec.ALIGN] if nbytes % codec.ALIGN else [nbytes]
    if not widths:
        return _SLOW
    return _meta(out), tuple(sent), widths, (agree.group_name_of(group_name), agree.layout_key(q))


# -- the linear: mm of an activation and a transposed weight -----------------------


@_fast("aten::mm")
def _mm(func, args, kwargs):
    """``matmul.linear`` for a 2-D activation and ``w.t()``: its kernel call on the weight's own inner tensors.

    What ``matmul._plan`` decides (which inner tensors, the block sizes) is kept per layout; the
    call itself is ``matmul.kernel_linear_impl``, so the kernel choice and its fallback stay matmul's.
    """
    x, w_t = args
    if kwargs or type(x) is not torch.Tensor or type(w_t) is not QuantizedTensor or x.ndim != 2 or x.is_meta:
        return NotImplemented
    owner = w_t.__dict__.get("_transposed_from")
    if type(owner) is not QuantizedTensor:
        return NotImplemented
    key = ("mm", _key(w_t), id(owner.rels), id(owner.dims), id(owner.fmt), owner.shape)
    hit = _PLANS.get(key)
    if hit is None:
        inner, blocks = matmul.plan_linear(w_t)
        own = inner is not None and all(a is b for a, b in zip(inner.values(), _inner(owner)))
        _remember(key, blocks if own else _SLOW, w_t, owner)
        return NotImplemented  # this call: the handler
    if hit[0] is _SLOW:
        return NotImplemented
    inner = owner.inner
    first = next(iter(inner.values()))
    if type(first) is not torch.Tensor or first.is_meta:
        return NotImplemented
    return matmul.kernel_linear_impl(x, w_t.fmt, inner, w_t.shape[1], None, hit[0])


@_fast("aten::addmm")
def _addmm(func, args, kwargs):
    """``F.linear`` with a bias: the fast mm plus the bias, as ``matmul._addmm`` adds it (``beta = alpha = 1``)."""
    if kwargs or len(args) != 3 or type(args[0]) is not torch.Tensor:
        return NotImplemented
    out = _mm(func, args[1:], kwargs)
    return out if out is NotImplemented else out + args[0]
