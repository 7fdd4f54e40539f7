"""ops/layout_ops: slicing, splitting, concatenation, padding, selection and flattening of quantized tensors,
derived from the layout.

The reference is the dense weight: a slice, a split piece or a selected expert must dequantize to the same slice
of the dequantized weight, bit for bit, and what joins pieces back must hold the weight's bytes.
"""

from dataclasses import dataclass

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core.layout import Blocked, Stacked
from dtensor_quant._ops.layout_ops import pad_end
from dtensor_quant._parallel.placements import dim_alignment
from dtensor_quant.testing import FORMATS, assert_same_bits, pick, weight
from tests.support.extra_formats import EXTRA_FORMATS
from tests.support.format_cases import int8_codes

# every relation at (3, 64, 512): the built-ins at blocks that fit, and the test-only user formats
EXPERT_FORMATS = [*pick("int8", "f8row", "f8tensor", "f8block32", "int4g64", "nf4").values(), *EXTRA_FORMATS.values()]


@dataclass(frozen=True)
class _ColumnInt8(dq.QuantFormat):
    """One int8 scale per input column: a flat view of it does not follow the flat index."""

    layout = {"qdata": (dq.OneToOne(), dq.OneToOne()), "scale": (dq.Constant(), dq.OneToOne())}

    def quantize(self, weight, reduce):
        scale = (reduce(weight.abs().amax(dim=0, keepdim=True), "max", "scale") / 127).clamp(min=1e-12)
        return {"qdata": int8_codes(weight, scale), "scale": scale.to(weight.dtype)}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


def test_slicing_a_flattened_view_that_does_not_follow_the_flat_index_is_a_layout_error():
    flat = dq.quantize(torch.randn(8, 16), _ColumnInt8()).view(-1)  # a per-column scale cannot flatten
    with pytest.raises(dq.LayoutError, match=r"cannot take \[0:16\] of dim 0.*not sliceable after view\(-1\)"):
        flat[0:16]
    with pytest.raises(dq.LayoutError, match=r"cannot split dim 0 into pieces of \[64, 64\]"):
        torch.split(flat, 64)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS, ids=str)
def test_expert_ops_along_every_dim(fmt):
    w = weight((4, 64, 512), seed=1)
    q = dq.quantize(w, fmt)
    dense = q.dequantize()
    for dim, size in ((0, 1), (0, 3), (1, 32), (1, 64 // 2), (2, 256)):
        try:
            parts = torch.split(q, size, dim)
        except dq.LayoutError:
            assert dim > 0  # a block along a matrix dim may forbid the cut; experts never do
            continue
        assert [p.shape[dim] for p in parts] == [p.shape[dim] for p in torch.split(dense, size, dim)]
        for p, d in zip(parts, torch.split(dense, size, dim)):
            assert torch.equal(p.dequantize(), d)
        assert torch.equal(torch.cat(parts, dim).dequantize(), dense)
    # narrow of experts, transpose of the matrix dims, index with a tensor, unbind
    assert torch.equal(q[1:3].dequantize(), dense[1:3])
    assert torch.equal(q.transpose(-2, -1).dequantize(), dense.transpose(-2, -1))
    assert torch.equal(q.transpose(1, 2)[3].dequantize(), dense[3].t())
    assert torch.equal(q[torch.tensor([3, 0, 3])].dequantize(), dense[[3, 0, 3]])
    assert [torch.equal(a.dequantize(), b) for a, b in zip(q.unbind(0), dense.unbind(0))] == [True] * 4
    with pytest.raises(dq.UnsupportedOpError, match="leading"):
        q.select(1, 0)


# -- every built-in format: slices, splits, concatenation and padding against the dense values ----------------

SHAPE = (32, 512)  # every format of the registry holds it, with a legal cut along each dim it can be cut on


def storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_slices_on_the_layouts_boundaries_are_views_of_the_dense_slices(fmt_name, dim):
    """``q.narrow(dim, a, n)`` at multiples of the layout's alignment: the dense slice's values, bit for bit, with
    every inner tensor a view of ``q``'s; a start between two boundaries is refused naming the inner tensor."""
    fmt = FORMATS[fmt_name]
    q = dq.quantize(weight(SHAPE, seed=1), fmt)
    dense, length = q.dequantize(), SHAPE[dim]
    step = dim_alignment(fmt, SHAPE, dim)
    if step >= length:  # one block spans the dim (a 128-row block, NF4's flat blocks): it cannot start inside
        assert torch.equal(q.narrow(dim, 0, length).dequantize(), dense)
        with pytest.raises(dq.LayoutError, match=f"dim {dim}"):
            q.narrow(dim, 1, length // 2)
        return
    for start, n in [(0, step), (step, length - step), (length - step, step), (step, step)]:
        piece = q.narrow(dim, start, n)
        assert torch.equal(piece.dequantize(), dense.narrow(dim, start, n)), (start, n)
        for name in fmt.inner_names:
            assert storage(getattr(piece, name)) == storage(getattr(q, name)), name
    if step > 1:
        with pytest.raises(dq.LayoutError, match=rf"cannot take \[{step // 2}:"):
            q.narrow(dim, step // 2, step)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_split_then_cat_gives_back_the_weights_bytes(fmt_name, dim):
    fmt = FORMATS[fmt_name]
    q = dq.quantize(weight(SHAPE, seed=2), fmt)
    step = dim_alignment(fmt, SHAPE, dim)
    if step >= SHAPE[dim]:
        return  # not splittable along this dim (previous test)
    sizes = [step, SHAPE[dim] - 3 * step, 2 * step]
    pieces = torch.split(q, sizes, dim)
    for piece, d in zip(pieces, torch.split(q.dequantize(), sizes, dim)):
        assert torch.equal(piece.dequantize(), d)
    assert_same_bits(torch.cat(pieces, dim), q, f"{fmt_name} along {dim}")


def test_cat_of_independently_quantized_pieces_is_stacked_and_splits_back():
    """Two 100-column Int4 pieces (group 128) do not continue one grid: their scales stack in runs of 100."""
    fmt = dq.Int4Groupwise(128)
    w = weight((16, 200), seed=3)
    a, b = dq.quantize(w[:, :100], fmt), dq.quantize(w[:, 100:], fmt)
    joined = torch.cat([a, b], 1)
    assert joined.rel("scale")[1] == Stacked(100, Blocked(128)) and joined.rel("qdata")[1] == dq.Packed(2)
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()], 1))
    left, right = torch.split(joined, 100, 1)
    assert_same_bits(left, a, "left")
    assert_same_bits(right, b, "right")
    with pytest.raises(dq.LayoutError, match="inside a run"):
        joined[:, 50:150]


@pytest.mark.parametrize("fmt_name", ["int8", "int4g32", "f8row", "f8tensor", "f8block32", "int4z128"])
def test_pad_end_appends_zero_bytes_and_keeps_the_weights(fmt_name):
    """What FSDP2's uneven shards are padded with: the weight's own elements unchanged, zero bytes after them."""
    fmt = FORMATS[fmt_name]
    q = dq.quantize(weight((30, 256), seed=4), fmt)
    padded = pad_end(q, 0, 2)
    assert padded.shape == (32, 256)
    assert torch.equal(padded.dequantize()[:30], q.dequantize())
    for name, rels in zip(fmt.inner_names, q.rels):
        t, old = getattr(padded, name), getattr(q, name)
        n = old.shape[0]
        assert torch.equal(t[:n].view(torch.uint8), old.view(torch.uint8)), name
        assert t.shape[0] == rels[0].inner_len(32) or isinstance(rels[0], dq.Constant), name
        assert not t[n:].view(torch.uint8).any(), name
    with pytest.raises(dq.LayoutError, match="blocks that run across"):
        pad_end(dq.quantize(weight((8, 14336)), dq.NF4()), 1, 64)  # NF4's flat blocks span the columns
