"""ops/layout_ops: slicing, splitting, concatenation, padding, selection and flattening of quantized tensors,
derived from the layout.
"""

from dataclasses import dataclass

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import pick, weight
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
