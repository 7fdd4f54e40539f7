"""Matmuls with a quantized weight: the format's kernel when it has one, else dequantize + mm.

``F.linear(x, w)`` and ``x @ w.t()`` reach a QuantizedTensor as ``t`` then
``mm``/``addmm`` (on one process and under DTensor, which decomposes linear
above the local tensor; ``linear`` and ``matmul`` themselves are composite
ops that never reach a subclass). A 3-D activation that cannot be folded
into a matrix without a copy (a transposed one, say) arrives instead as
``expand`` of the weight to a batch of identical matrices, then ``bmm``: the
expand is a broadcast view (``Constant`` along the batch dims) and ``bmm``
runs the same kernel on the folded activation.

``mm(x, w.t())`` is ``x @ W.T`` on the canonical weight: the format's
``linear`` kernel. Any other orientation (the input gradient's ``grad @ W``)
dequantizes -- a matmul, not a silent format change: the result is dense by
definition. A format that quantizes its activations (``fmt.activation_scheme``)
is the exception in the forward: dequantizing it there would run weight-only
arithmetic in place of the declared one, so every forward path that would
(``W @ x``, a weight stored ``[in, out]`` used as ``x @ W``, a shard or view the
kernel cannot read) raises :class:`UnsupportedOpError` instead
(:func:`refuse_weight_only`); inside the backward (``grad @ W``) it
dequantizes as for any weight: the gradient is dense by design.

Kernels often want the weight in a layout of their own (torch's CPU int4 mm
repacks it, which costs more than the matmul). ``QuantFormat.prepare`` builds that once per
weight; the result is cached in the record of the bytes the weight and all
its views share (:class:`dtensor_quant._core.notes.Bytes`; one entry per
view, so every expert of a stack keeps its own), keyed by every inner
tensor's address, shape and strides, and stamped with the record's write
count and the inner tensors' versions: a write through any view of the
weight (``copy_``, a collective into it) or into its inner tensors from
outside (a checkpoint load) rebuilds it. Inference tensors (made under
``torch.inference_mode``) have no version counter: their weights are
prepared on every call.
Under ``torch.compile`` the kernel call is one opaque custom op,
``dtensor_quant::kernel_linear``, whose inputs are the weight's inner tensors
(and, for a per-token activation scheme whose statistic a row-parallel matmul
reduces, the reduced token maxima: computed and all-reduced in the traced
graph, since the op's body runs later, outside the DTensor handler that asks
for the reduction; :mod:`dtensor_quant._parallel.activation_stats`):
at run time it finds the same record through them
(:func:`dtensor_quant._core.notes.bytes_of`) instead of repacking the weight
on every call, and inductor never lowers the kernel itself.

:func:`linear` is the one entry point: the ``mm``/``addmm``/``bmm``/
``_grouped_mm`` handlers and the ``dtensor_quant::linear`` custom op all
end there. What it decides from the weight's layout (which inner tensors the
kernel reads, its block sizes) is memoised per layout
(:mod:`dtensor_quant._core.memo`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging

import torch

from .._core import activations
from .._core.bits import is_tracing
from .._core.dispatch import UnsupportedOpError, implements
from .._core.format import QuantFormat
from .._core.format_ids import format_from_id, format_id
from .._core.memo import lookup, remember
from .._core.notes import Bytes, bytes_of
from .._core.tensor import QuantizedTensor
from . import unpack
from .dequant import dequantize
from .layout_ops import (
    alias,
    block_sizes,
    broadcast_batch,
    broadcastable,
    canonical_dims,
    canonical_inner,
    describe,
    is_broadcast_batch,
    is_transposed,
    matrix_dims,
    select_dim,
    unbroadcast,
)

log = logging.getLogger(__name__)


def invalidate(q: QuantizedTensor) -> None:
    """Forget what kernels prepared from ``q``'s bytes (writes do this themselves; see the module docstring)."""
    if q.notes.bytes is not None:
        q.notes.bytes.prepared.clear()


def prepared(fmt: QuantFormat, inner: dict[str, torch.Tensor], record: Bytes | None):
    """``fmt.prepare(inner)``, cached in the bytes' ``record`` while neither it nor an inner version changes.

    Traced inner tensors, inference tensors (no version counter: a write could not be seen) and bytes
    their owner refills (``cache_kernels`` False) are prepared on every call.
    """
    if record is None or not record.cache_kernels:
        return fmt.prepare(inner)
    tensors = tuple(inner.values())
    # Every F.linear of a weight passes the same format and inner tensor objects (the weight's own attributes):
    # the last call's objects are kept in one slot and matched by identity, then checked by what a write
    # changes -- no hashing or comparing of the format, shapes and strides on every call. One slot per bytes
    # record, so views made anew per call (experts of a stack) only replace it and use the keyed entries.
    last = record.prepared.get(_LAST)
    if (
        last is not None
        and last[0] is fmt
        and _same_objects(last[1], tensors)
        and last[2] == [(t._version, t.data_ptr()) for t in tensors]
        and last[3] == record.stamp()
    ):
        return last[4]
    where, versions = [fmt], []
    for t in tensors:
        if type(t) is not torch.Tensor or t.is_meta or t.is_inference():
            return fmt.prepare(inner)
        where.append((t.data_ptr(), t.shape, t.stride()))
        versions.append(t._version)
    versions.append(record.stamp())
    where, versions = tuple(where), tuple(versions)
    hit = record.prepared.get(where)
    if hit is not None and hit[0] == versions:
        result = hit[1]
    else:
        result = fmt.prepare(inner)
        record.prepared[where] = (versions, result)
    record.prepared[_LAST] = (fmt, tensors, [(t._version, t.data_ptr()) for t in tensors], record.stamp(), result)
    return result


_LAST = "last objects"  # prepared()'s slot in a record (its other keys are tuples)


def _same_objects(held: tuple, tensors: tuple) -> bool:
    if len(held) != len(tensors):
        return False
    for a, b in zip(held, tensors):
        if a is not b:
            return False
    return True


def kernel_linear_impl(
    x: torch.Tensor, fmt: QuantFormat, inner: dict[str, torch.Tensor], out_features: int, bias, blocks, record=None
):
    """``x @ W.T + bias`` for a 2-D ``x`` and canonical inner tensors: kernel, else dequantize + mm.

    ``blocks`` is :func:`~dtensor_quant._ops.layout_ops.block_sizes` of the weight's relations, ``record``
    the :class:`~dtensor_quant._core.notes.Bytes` of the weight (found from the inner tensors if None).
    """
    shape = (out_features, x.shape[-1])
    whole = not fmt.kernel_needs_whole_blocks or unpack.fresh_inner(
        fmt, tuple(blocks), shape, tuple(tuple(t.shape) for t in inner.values())
    )
    if not whole:
        _say_no_kernel(fmt, shape)
    if whole and record is None:
        record = bytes_of(next(iter(inner.values())))
    out = fmt.linear(x, prepared(fmt, inner, record), bias) if whole else None
    if _RECORDING:
        _record(fmt, "kernel" if out is not None else "dequantize")
    if out is not None:
        return out
    refuse_weight_only(fmt, "this weight's kernel cannot run on it (a view or shard it cannot read)")
    w = None if is_tracing(x) else unpack.dense_inner(fmt, inner, blocks, shape, x.dtype)
    out = x @ (w if w is not None else fmt.dequantize(broadcastable(inner, blocks, shape), x.dtype)).t()
    return out + bias if bias is not None else out


_RECORDING: list[collections.Counter] = []  # the counters of the record_paths() blocks now open


@contextlib.contextmanager
def record_paths():
    """Counts the matmuls with a quantized weight run inside the block, by ``(format, path)``.

    ``path`` is ``"kernel"`` (the format's own: torch's int kernels, the C++
    kernels of dtensor_quant._core.native) or ``"dequantize"`` (dequantize +
    mm: no kernel for this format, dtype, orientation or layout). Says which
    path a slow model takes; counts every thread's calls.
    """
    counts: collections.Counter = collections.Counter()
    _RECORDING.append(counts)
    try:
        yield counts
    finally:
        _RECORDING.remove(counts)


def _record(fmt: QuantFormat, path: str) -> None:
    for counts in _RECORDING:
        counts[(str(fmt), path)] += 1


def refuse_weight_only(fmt: QuantFormat, path: str) -> None:
    """Raise if ``fmt`` quantizes its activations and this is a forward: dequantize + mm would be weight-only.

    The backward's ``grad @ W`` (run inside an autograd node) dequantizes as for any weight: the input
    gradient is computed densely by design, whatever the format's forward arithmetic.
    """
    scheme = fmt.activation_scheme
    if scheme is None or torch._C._current_autograd_node() is not None:
        return
    raise UnsupportedOpError(
        f"dtensor_quant: {path}: a {fmt} weight would be dequantized and multiplied with the activation "
        f"unquantized (weight-only arithmetic), not with its declared activation scheme {scheme.spelling!r}. "
        "The scheme runs in F.linear(x, W) / nn.Linear (also x @ W.t(), torch.matmul(x, W.t())) with the weight "
        "quantized as [out_features, in_features]; quantize a weight stored [in, out] as its transpose, or call "
        "W.dequantize() to multiply densely on purpose"
    )


@functools.cache
def _say_no_kernel(fmt: QuantFormat, shape: tuple[int, int]) -> None:
    """Once per format and shape: this weight's kernel cannot run on it, so every call dequantizes."""
    log.warning(
        "dtensor_quant: a %s weight of shape %s is not laid out as a fresh weight of its shape (a column slice or "
        "shard whose blocks differ), so %s's kernel cannot run on it and every matmul dequantizes it. In tensor "
        "parallelism, dtensor_quant.adapt_tp_plan(..., kernels=True) makes such a layer column-parallel instead.",
        fmt,
        list(shape),
        type(fmt).__name__,
    )


@torch.library.custom_op("dtensor_quant::kernel_linear", mutates_args=())
def kernel_linear(
    x: torch.Tensor,
    inner: list[torch.Tensor],
    fmt_id: int,
    out_features: int,
    bias: torch.Tensor | None,
    blocks: list[int],
    token_absmax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compiled graph's view of :func:`kernel_linear_impl` (inner tensors in the format's order).

    ``token_absmax``: the activation's per-token maxima already reduced over the mesh (see the module
    docstring), used in place of the local ones."""
    fmt = format_from_id(fmt_id)
    inner_d = dict(zip(fmt.inner_names, inner))
    if token_absmax is None:
        return kernel_linear_impl(x, fmt, inner_d, out_features, bias, blocks)
    with activations.token_stat_reduction(lambda _local: token_absmax):
        return kernel_linear_impl(x, fmt, inner_d, out_features, bias, blocks)


@kernel_linear.register_fake
def _kernel_linear_fake(x, inner, fmt_id, out_features, bias, blocks, token_absmax=None):
    return x.new_empty((*x.shape[:-1], out_features))


def _traced_token_absmax(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor | None:
    """Inside a trace: the reduced per-token maxima the kernel op must use, or None (no reduction asked)."""
    scheme = fmt.activation_scheme
    if scheme is None or not scheme.dynamic or scheme.per_rank or not activations.reducing():
        return None
    return activations.token_absmax(x, scheme)


def plan_linear(w_t: QuantizedTensor):
    """``(the weight whose inner tensors the kernel reads, or None; block sizes; whether that weight is canonical)``.

    ``w_t`` is a transposed weight ``[in, out]``. The kernel reads canonical
    inner tensors: those of the weight ``w_t`` was made from (``Notes.weight``,
    no inner transposes made), else ``w_t``'s own made canonical. Decided once
    per layout (both depend only on relations and orientation).
    """
    # The plan depends on the relations, orientation and format alone (not on shape, strides or dtype), so
    # the key is their identities: this runs for every F.linear (memo.memo inlined, no closure).
    owner = w_t.notes.weight
    if owner is not None:
        key = ("linear", id(owner.rels), id(owner.dims), id(owner.fmt))
        plan = lookup(key)
        if plan is None:
            plan = remember(key, _kernel_plan(owner), owner.rels, owner.dims, owner.fmt)
        if plan[1]:  # the owner is a canonical weight: its own inner tensors
            return (owner, *plan)
    key = ("linear", id(w_t.rels), id(w_t.dims), id(w_t.fmt))
    plan = lookup(key)
    if plan is None:
        plan = remember(key, _kernel_plan(w_t), w_t.rels, w_t.dims, w_t.fmt)
    return (w_t, *plan)


def _kernel_plan(q: QuantizedTensor):
    """``(block sizes of q's canonical relations or None, whether q is canonical)`` for a 2-D ``q``."""
    if q.ndim != 2 or canonical_inner(q) is None:
        return None, False
    if q.dims == canonical_dims(2):
        return block_sizes(q.rels), True
    if is_transposed(q):
        return block_sizes(row[::-1] for row in q.rels), False
    return None, False


def linear(x: torch.Tensor, w_t: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w_t (+ bias)`` for a logical ``[in, out]`` quantized ``w_t`` (a transposed weight)."""
    source, blocks, canonical = plan_linear(w_t)
    if blocks is None or not is_transposed(w_t):
        refuse_weight_only(
            w_t.fmt,
            f"x @ W with W {describe(w_t)} not the transpose of a quantized [out, in] weight (a weight stored "
            "[in, out], or a view the kernel cannot read)",
        )
        if _RECORDING:
            _record(w_t.fmt, "dequantize")
        out = x @ dequantize(w_t, x.dtype)
        return out + bias if bias is not None else out
    inner = {n: getattr(source, n) for n in source.fmt.inner_names} if canonical else canonical_inner(source)
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])  # (F.linear's mm is 2-D: no reshape to pay for)
    if is_tracing(x2) or _any_tracing(inner):
        amax = _traced_token_absmax(x2, w_t.fmt)
        out = kernel_linear(x2, list(inner.values()), format_id(w_t.fmt), w_t.shape[1], bias, blocks, amax)
    else:
        out = kernel_linear_impl(x2, w_t.fmt, inner, w_t.shape[1], bias, blocks, source.notes.bytes)
    return out if x2 is x else out.reshape(*x.shape[:-1], out.shape[-1])


def _any_tracing(inner: dict[str, torch.Tensor]) -> bool:
    """Whether an inner tensor is traced (a loop, not ``any`` of a generator: this runs for every F.linear)."""
    for t in inner.values():
        if is_tracing(t):
            return True
    return False


@implements("aten::mm")
def _mm(func, a, b):
    if isinstance(b, QuantizedTensor) and not isinstance(a, QuantizedTensor):
        return linear(a, b)
    if isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor):
        refuse_weight_only(a.fmt, f"W @ x with the quantized weight on the left ({describe(a)})")
        if _RECORDING:
            _record(a.fmt, "dequantize")
        return dequantize(a, b.dtype) @ b
    raise UnsupportedOpError(
        f"dtensor_quant: mm of two quantized tensors ({describe(a)}, {describe(b)}): a quantized weight multiplies "
        "dense activations; dequantize one of them first (t.dequantize())"
    )


_DENSE_BIAS = (
    ": biases stay dense (dtensor_quant.quantize_ quantizes only the weights); pass bias.dequantize(), "
    "or quantize_ with a filter_fn that leaves the bias's module alone"
)


@implements("aten::addmm")
def _addmm(func, bias, a, b, beta=1, alpha=1):
    if isinstance(bias, QuantizedTensor):
        raise UnsupportedOpError(f"dtensor_quant: addmm with a quantized bias ({describe(bias)}){_DENSE_BIAS}")
    return _plus_bias(_mm(func, a, b), bias, beta, alpha)


def _plus_bias(out, bias, beta, alpha):
    """``beta * bias + alpha * out``, skipping the multiplies addmm/baddbmm almost always have as 1."""
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else beta * bias)


# -- batched products: a 2-D weight broadcast over a batch ---------------------


@implements("aten::expand")
def _expand(func, q, size, implicit=False):
    """A 2-D weight viewed as a batch of identical matrices (``Constant`` along the new leading dims)."""
    size = tuple(size)
    extra = len(size) - q.ndim
    trailing = tuple(q.shape[i] if s == -1 else s for i, s in enumerate(size[extra:]))
    if extra < 0 or trailing != tuple(q.shape) or any(s < 0 for s in size[:extra]):
        raise UnsupportedOpError(
            f"dtensor_quant: {describe(q)}: expand to {size} would repeat quantized elements; only a broadcast "
            "over new leading (batch) dims is supported"
        )
    if extra == 0:
        return alias(q)
    return broadcast_batch(q, size[:extra])


def _batched(func, a, b):
    if not isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor) and is_broadcast_batch(b):
        return linear(a, unbroadcast(b))
    if isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor) and is_broadcast_batch(a):
        refuse_weight_only(a.fmt, f"{func} of a broadcast quantized weight on the left ({describe(a)}) and x")
        if _RECORDING:
            _record(a.fmt, "dequantize")
        return dequantize(unbroadcast(a), b.dtype) @ b
    if not isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor) and matrix_dims(b) == 1:
        # One matrix per batch entry (transformers' batched_mm experts: ``bmm(x, w[ids])``).
        return (
            torch.stack([linear(a[i], select_dim(b, 0, i)) for i in range(b.shape[0])])
            if b.shape[0]
            else a.new_empty((0, a.shape[1], b.shape[2]))
        )
    if isinstance(a, QuantizedTensor) and not isinstance(b, QuantizedTensor) and matrix_dims(a) == 1:
        # ``bmm(w[ids], x)``: ``W_i @ x_i = (x_i.T @ W_i.T).T``, the weight-only kernel on ``x_i.T``.
        if not a.shape[0]:
            return b.new_empty((0, a.shape[1], b.shape[2]))
        return torch.stack([linear(b[i].mT, select_dim(a, 0, i).mT).mT for i in range(a.shape[0])])
    q = a if isinstance(a, QuantizedTensor) else b
    raise UnsupportedOpError(
        f"dtensor_quant: {func} with a {describe(q)}: only a 2-D weight broadcast over the batch (torch.matmul of a "
        "batched activation and a weight) is supported; use F.linear"
    )


@implements("aten::bmm")
def _bmm(func, a, b):
    return _batched(func, a, b)


@implements("aten::baddbmm")
def _baddbmm(func, bias, a, b, beta=1, alpha=1):
    if isinstance(bias, QuantizedTensor):
        raise UnsupportedOpError(f"dtensor_quant: baddbmm with a quantized bias ({describe(bias)}){_DENSE_BIAS}")
    return _plus_bias(_batched(func, a, b), bias, beta, alpha)


# -- grouped products: one weight matrix per group of rows (mixture-of-experts) ----


def _check_ends(ends: list[int], rows: int) -> None:
    """Group ``g`` is rows ``[ends[g-1], ends[g])``: the ends must rise from 0 and stay within the input.

    Anything else would drop rows, run them twice or return the wrong number of rows.
    """
    bad = [g for g, (s, e) in enumerate(zip([0, *ends], ends)) if e < s]
    if bad:
        raise ValueError(
            f"_grouped_mm: offs must be non-negative and non-decreasing (group g is rows offs[g-1]:offs[g]); "
            f"offs = {ends} falls at position {bad[0]}"
        )
    if ends and ends[-1] > rows:
        raise ValueError(f"_grouped_mm: offs = {ends} ends at row {ends[-1]}, past the input's {rows} rows")


@implements("aten::_grouped_mm")
def _grouped_mm(func, a, b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm(x, W.transpose(-2, -1), offs)`` with a quantized stack of expert weights.

    Rows ``[offs[g-1], offs[g])`` of ``x`` go through expert ``g`` with the
    format's weight-only kernel (:func:`linear`, which dequantizes that one
    expert where the format has no kernel); a 3-D ``x`` pairs batch entry
    ``g`` with expert ``g``. Rows past ``offs[-1]`` come back as zeros (torch
    leaves them undefined). The per-group loop needs concrete offsets, so
    this is an eager-mode path.
    """
    if isinstance(a, QuantizedTensor) or not isinstance(b, QuantizedTensor) or matrix_dims(b) != 1:
        q = a if isinstance(a, QuantizedTensor) else b
        raise UnsupportedOpError(
            f"dtensor_quant: _grouped_mm with a {describe(q)}: only a dense input and a quantized [experts, in, out] "
            "stack (a transposed [experts, out, in] weight) are supported"
        )
    if isinstance(bias, QuantizedTensor):
        raise UnsupportedOpError(f"dtensor_quant: _grouped_mm with a quantized bias ({describe(bias)}){_DENSE_BIAS}")
    experts = b.shape[0]
    if a.ndim == 3:
        if offs is not None or a.shape[0] != experts:
            raise ValueError(f"_grouped_mm: a 3-D input needs one batch entry per expert ({experts}) and no offs")
        groups = [(g, a[g]) for g in range(experts)]
        rows = None
    else:
        if offs is None or offs.ndim != 1 or offs.shape[0] != experts:
            got = "none" if offs is None else f"shape {list(offs.shape)}"
            raise ValueError(f"_grouped_mm: a 2-D input needs offs with one end per expert ({experts}), got {got}")
        if offs.dtype.is_floating_point or offs.dtype.is_complex or offs.dtype == torch.bool:
            raise ValueError(f"_grouped_mm: offs must be an integer tensor (torch takes int32), got {offs.dtype}")
        if is_tracing(offs):
            raise UnsupportedOpError(
                f"dtensor_quant: _grouped_mm with a {describe(b)}: needs concrete offsets (eager mode)"
            )
        ends = offs.tolist()
        _check_ends(ends, a.shape[0])
        starts = [0] + ends[:-1]
        groups = [(g, a[s:e]) for g, (s, e) in enumerate(zip(starts, ends)) if e > s]
        rows = (a.shape[0], ends[-1] if ends else 0)
    dtype = out_dtype or a.dtype
    outs = []
    for g, x in groups:
        y = linear(x, select_dim(b, 0, g), None if bias is None else bias[g]).to(dtype)
        outs.append(y)
    if rows is None:
        return torch.stack(outs) if outs else a.new_empty((0, a.shape[1], b.shape[2]), dtype=dtype)
    total, used = rows
    outs.append(a.new_zeros((total - used, b.shape[2]), dtype=dtype))
    return torch.cat(outs)
