"""ops/unpack: the fast whole-weight dense values equal dequantize's, bit for bit, on any input."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import assert_within, linear_error_bound


@pytest.mark.parametrize(
    "fmt",
    [
        dq.NF4(),
        dq.NF4(64, 4),
        dq.BnbNF4(),
        dq.MXFP4(),
        dq.Int4GroupwiseIntZero(32, scale_dtype=torch.float16),
        dq.Int4Groupwise(32),
        dq.Int8Rowwise(),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(32),
    ],
    ids=str,
)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 512), (46, 1024), (32, 96)], ids=str)  # (32, 96): NF4 blocks across rows
def test_unpack_gives_dequantize_bits_in_every_dtype_and_chunking(fmt, wdtype, shape, monkeypatch):
    """The fast whole-weight path (table lookup, block-grid scales, row chunks) is bit-exact."""
    from dtensor_quant._ops import unpack
    from dtensor_quant.testing import reference_dequantize, same_bits

    q = dq.quantize(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(wdtype) * 0.05, fmt)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        expected = reference_dequantize(q, dtype)
        for chunk in (1 << 20, 1024):  # one piece; row chunks cut on the layout's row blocks
            monkeypatch.setattr(unpack, "CHUNK_ELEMENTS", chunk)
            got = unpack.dense(q, dtype)
            assert got is not None and same_bits(got, expected), (dtype, chunk)
        assert same_bits(q.t().dequantize(dtype), expected.t())


def test_unpack_refuses_a_slice_whose_blocks_are_not_a_fresh_weights():
    """A column slice of NF4 keeps a factor per row cut short: the flat fast path must not read it in flat order."""
    from dtensor_quant._ops import unpack
    from dtensor_quant.testing import reference_dequantize, same_bits

    q = dq.quantize(torch.randn(64, 2048, generator=torch.Generator().manual_seed(0)), dq.NF4())
    for piece in (q[:, :1024], q[:, 1024:], q[:32]):
        expected = reference_dequantize(piece, torch.float32)
        assert same_bits(piece.dequantize(), expected)
        x = torch.randn(3, piece.shape[1], generator=torch.Generator().manual_seed(1))
        # q[:32] is laid out as a fresh weight: NF4's kernel runs and sums in its own order
        assert_within(torch.nn.functional.linear(x, piece), x @ expected.t(), 2 * linear_error_bound(x, expected))
    assert unpack.dense(q[:, :1024], torch.float32) is None  # per-row factors cut short: not a fresh layout
    assert unpack.dense(q[:32], torch.float32) is not None  # whole row blocks: the fast path


def _hostile_weights():
    g = torch.Generator().manual_seed(0)
    near_max = (torch.randn(64, 4096, generator=g) * 20000).clamp(-65504, 65504).to(torch.float16)
    near_max[3, :64] = 65504
    mixed = torch.randn(8, 14336, generator=g).to(torch.bfloat16)
    mixed[1, 7], mixed[2, 9], mixed[3] = float("-inf"), float("nan"), 0
    small = (torch.randn(8, 14336, generator=g) * 1e-3).to(torch.float16)
    return {"fp16 near max": near_max, "nan, inf and a zero row": mixed, "fp16 small": small}


@pytest.mark.parametrize("name", list(_hostile_weights()))
@pytest.mark.parametrize(
    "fmt",
    [
        dq.NF4(),
        dq.BnbNF4(),
        dq.MXFP4(),
        dq.Int4Groupwise(128),
        dq.Int4Groupwise(128, scale_dtype=torch.float16),
        dq.Int4GroupwiseIntZero(128),
        dq.Int4GroupwiseIntZero(128, scale_dtype=torch.float16),
        dq.Int8Rowwise(),
        dq.Int8Rowwise(scale_dtype=torch.bfloat16),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(32),
        dq.Float8Blockwise(32, scale_dtype=torch.bfloat16),
    ],
    ids=str,
)
def test_unpack_matches_dequantize_on_hostile_input(fmt, name):
    """FSDP2's fast path (unpack) and dequantize agree bit for bit where values are extreme or non-finite.

    Every value that is not NaN bit for bit, and the NaNs in the same places; not a NaN's payload, which
    depends on which of torch's conversion kernels the CPU runs (float8 NaN to fp32 keeps its mantissa
    bits in ATen's scalar kernel, ATEN_CPU_CAPABILITY=default, and not in its vectorized ones).
    """
    from dtensor_quant._ops import unpack
    from dtensor_quant.testing import reference_dequantize, same_bits

    def same_values(a, b):
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and same_bits(a.masked_fill(nan, 0), b.masked_fill(nan, 0))

    w = _hostile_weights()[name]
    q = dq.quantize(w, fmt)
    for dtype in (torch.bfloat16, torch.float32, w.dtype):
        got = unpack.dense(q, dtype)
        assert got is not None and same_values(got, reference_dequantize(q, dtype)), dtype
