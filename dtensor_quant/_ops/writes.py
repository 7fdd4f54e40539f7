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
  would change columns 64 and up. A view's notes say which inner tensors
  cover elements outside it (``Notes.shared_outside``, recorded by
  :func:`dtensor_quant._core.notes.sliced`); a write is allowed only where
  those are bit-identical in the source (then only the other inner tensors
  are copied, which is exact) or the view is empty (then nothing is written).

Every write then goes through :func:`write_inner`, which tells the bytes'
record (:func:`dtensor_quant._core.notes.wrote`): what kernels prepared from
those bytes is stale, through whichever view they were read.
"""

from __future__ import annotations

import torch

from .._core.bits import same_bits
from .._core.layout import LayoutError, same_grid
from .._core.notes import wrote


def write_inner(q, pairs, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)`` inner tensor pair of ``q``, from inside ``__torch_dispatch__``.

    In-place ops there skip the version bump (the ADInplaceOrView key is already past): bump it, and
    tell ``q``'s bytes record, so caches keyed on either (matmul's prepared kernel weights) see it.
    """
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)
        torch.autograd.graph.increment_version(dst)
    wrote(q.notes)


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
    for i, (rel, dim, start, stop) in dst.notes.shared_outside:
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
