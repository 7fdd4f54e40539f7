"""Writes into quantized tensors: exact, or refused before anything changes.

A write (``copy_``, and through it ``load_state_dict``, DCP and FSDP2's
sharding) copies inner tensors. That gives the source's values only when both
sides map their inner tensors onto logical elements the same way, and when
the destination's inner tensors hold nothing but the destination's elements.
Two things break that, and both are checked here before any byte moves:

* **grids that differ.** A source concatenated from independently quantized
  pieces (``Stacked``), a transposed source, or any other relation whose
  inner index per logical element differs from the destination's. Same shapes
  are not enough: two 100-column Int4 pieces with group 128 have two scales
  per row, like one 200-column weight, but not the same columns per scale.
* **views whose scales reach outside.** ``w[:, :64]`` of an Int8Rowwise
  weight holds the row scales of all columns; writing a new scale there
  would change columns 64 and up. A view remembers (``SHARED``) which inner
  tensors cover elements outside it; a write is allowed only where those are
  bit-identical in the source (then only the other inner tensors are copied,
  which is exact) or the view is empty (then nothing is written).

The rows past a leading narrow of a buffer made by a factory (``new_zeros``,
``empty_like``) count as padding, not as elements: that is how FSDP2 pads an
uneven shard, and a partial last block may reach into them.
"""

from __future__ import annotations

import torch

from ..core.bits import same_bits
from ..core.layout import Blocked, Constant, FlatBlocked, InFlat, LayoutError, OneToOne, Packed, Stacked

# Counts the writes into quantized tensors' bytes (copy_, the in-place collectives). The inner views
# a view op makes inside __torch_dispatch__ are not autograd views and keep version counters of their
# own, so a write through ``w[:n]`` leaves ``w``'s inner versions as they were (and a write into ``w``,
# a kept view's): what is cached from the bytes (matmul's prepared kernel weights) checks this too.
GENERATION = [0]


def note_write() -> None:
    """Call after writing into a quantized tensor's inner tensors: caches derived from bytes go stale."""
    GENERATION[0] += 1


def write_inner(pairs, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)`` inner tensor pair, from inside ``__torch_dispatch__``.

    In-place ops there skip the version bump (the ADInplaceOrView key is already past); bump it, and
    note the write, so caches keyed on versions (matmul's prepared kernel weights) see it.
    """
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)
        torch.autograd.graph.increment_version(dst)
    note_write()


SHARED = "_dq_shared_outside"  # on a view: {inner index: (relation, dim, start, stop) of the cut}
FACTORY = "_dq_factory"  # on a factory's output: rows past a leading narrow of it are padding


def _index(rel, x):
    """The inner index of logical index ``x`` (an int, or a tensor of them) along a dim laid out by ``rel``."""
    if isinstance(rel, OneToOne):
        return x
    if isinstance(rel, (Packed, Blocked)):
        return x // rel.factor
    if isinstance(rel, Constant):
        return x * 0
    if isinstance(rel, Stacked):
        return (x // rel.n) * rel.rel.inner_len(rel.n) + _index(rel.rel, x % rel.n)
    raise LayoutError(f"{rel}: this view cannot be written into (it has no per-element grid)")


def same_grid(a, b, length: int) -> bool:
    """Whether relations ``a`` and ``b`` put every logical index of a dim of ``length`` at the same inner index."""
    if a == b:
        return True
    x = torch.arange(length)
    try:
        return torch.equal(_index(a, x), _index(b, x))
    except LayoutError:
        return False


def note_slice(q, out, dim: int, start: int, stop: int) -> None:
    """Record on view ``out = q[start:stop]`` (along ``dim``) the inner tensors it shares with elements outside."""
    d = q.__dict__
    shared = d.get(SHARED)
    length = q.shape[dim]
    end = stop if (dim == 0 and start == 0 and FACTORY in d) else length
    if start > 0 or stop < end:
        for i, rels in enumerate(q.rels):
            rel = rels[dim]
            if isinstance(rel, Constant):
                hit = end > 0
            elif start == stop or isinstance(rel, (OneToOne, Packed)):  # slices cut whole packs only
                hit = False
            elif isinstance(rel, FlatBlocked):  # a block of the flat index straddles a cut row boundary
                hit = (start > 0 and start * rel.row % rel.b != 0) or (stop < end and stop * rel.row % rel.b != 0)
            elif isinstance(rel, InFlat):  # blocks run across the whole dim: any cut shares them
                hit = True
            elif isinstance(rel, Stacked) and isinstance(rel.rel, FlatBlocked):  # each run has its own flat grid
                f = rel.rel

                def inside(p, n=rel.n, f=f):
                    return p % n != 0 and (p % n) * f.row % f.b != 0

                hit = (start > 0 and inside(start)) or (stop < end and inside(stop))
            elif isinstance(rel, Blocked):  # the start is on a block boundary (slice_dim checked it)
                hit = stop < end and stop % rel.b != 0
            else:  # the element just outside on either side maps into the view's inner range
                hit = (start > 0 and _index(rel, start - 1) >= _index(rel, start)) or (
                    stop < end and _index(rel, stop) <= _index(rel, stop - 1)
                )
            if hit:
                shared = dict(shared or ())
                shared[i] = (rel, dim, start, stop)  # described only if a write is refused
    if shared:
        out.__dict__[SHARED] = shared


def keep_shared(src, out) -> None:
    """An alias of a view is the same view."""
    if SHARED in src.__dict__:
        out.__dict__[SHARED] = src.__dict__[SHARED]


def check_copy(dst, src, describe) -> set[str]:
    """Raise ``LayoutError`` unless ``dst.copy_(src)`` is exact; returns the inner tensors to leave as they are."""
    if dst.dims != src.dims:
        raise LayoutError(
            f"cannot copy a {describe(src)} with orientation {src.dims} into one with orientation {dst.dims}: "
            "their scales run along different dims. Copy the untransposed weights."
        )
    for name, d_rels, s_rels in zip(dst.fmt.inner_names, dst.rels, src.rels):
        for dim, (rd, rs) in enumerate(zip(d_rels, s_rels)):
            if not same_grid(rd, rs, dst.shape[dim]):
                raise LayoutError(
                    f"cannot copy into a {describe(dst)}: along dim {dim} the source's '{name}' is {rs} and the "
                    f"destination's is {rd}, so its values would land on other elements (a concatenation of "
                    "independently quantized pieces, say). Quantize the dense source with the destination's "
                    "layout instead: dtensor_quant.quantize(src.dequantize(), fmt) (not bit-exact: requantized)."
                )
    keep = set()
    for i, (rel, dim, start, stop) in dst.__dict__.get(SHARED, {}).items():
        name = dst.fmt.inner_names[i]
        if dst.numel() == 0 or same_bits(getattr(dst, name), getattr(src, name)):
            keep.add(name)
            continue
        why = f"'{name}' ({rel} along dim {dim}) also covers elements outside [{start}:{stop}]"
        raise LayoutError(
            f"cannot write into this view of a {describe(dst)}: {why}, and the source's differ, so the write "
            "would change elements outside the view. Write the whole weight (or slices on the layout's block "
            "boundaries), or dequantize, edit and requantize it."
        )
    return keep
