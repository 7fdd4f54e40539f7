"""formats: what every built-in format does on hostile values (dtype extremes, NaN and Inf, fp16, empty
weights) and with a scale dtype of its own. See docs/hostile_input.md.
"""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import FORMATS
from tests.support.format_cases import assert_dequantizes_like


@pytest.mark.parametrize(
    "fmt",
    [
        dq.Int4Groupwise(128, scale_dtype=torch.float16),
        dq.Int4GroupwiseIntZero(64, scale_dtype=torch.bfloat16),
        dq.Int4GroupwiseIntZero(128),
        dq.Int8Rowwise(scale_dtype=torch.bfloat16),
        dq.Float8Rowwise(scale_dtype=torch.bfloat16),
        dq.Float8Tensorwise(scale_dtype=torch.float32),
        dq.Float8Blockwise(128, scale_dtype=torch.bfloat16),
    ],
    ids=str,
)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_scale_dtype_stores_that_dtype_and_quantizes_well(fmt, wdtype):
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)).to(wdtype)
    q = dq.quantize(w, fmt)
    scale = q.scale_inv if isinstance(fmt, dq.Float8Blockwise) else q.scale
    assert scale.dtype == (fmt.scale_dtype or wdtype)
    err = ((q.dequantize().float() - w.float()).norm() / w.float().norm()).item()
    assert err < (0.12 if "Int4" in type(fmt).__name__ else 0.04), err
    assert_dequantizes_like(q, lambda dtype: q.dequantize(dtype))  # the fast path, every output dtype


def test_scale_dtype_is_part_of_the_identity_and_parses():
    from dtensor_quant._model.format_spec import parse_format

    assert repr(dq.Int4Groupwise(128)) == "Int4Groupwise(group_size=128)"  # unchanged: ids and checkpoints
    assert dq.Int4Groupwise(128, "float16") == dq.Int4Groupwise(128, torch.float16) != dq.Int4Groupwise(128)
    assert len({dq.Int8Rowwise(), dq.Int8Rowwise(torch.bfloat16), dq.Int8Rowwise(torch.float16)}) == 3
    assert dq.Float8Blockwise(128, torch.float32) == dq.Float8Blockwise(128)  # float32 is its default
    assert parse_format("int4:64,float16") == dq.Int4Groupwise(64, torch.float16)
    assert parse_format("int4") == dq.Int4Groupwise()  # not ambiguous with Int4GroupwiseIntZero
    assert parse_format("int4groupwiseintzero:128,bfloat16") == dq.Int4GroupwiseIntZero(128, torch.bfloat16)
    with pytest.raises(ValueError, match="scale_dtype must be None or one of"):
        dq.Int8Rowwise(torch.int8)
    inner_dtypes = {"qdata": torch.uint8, "scale": torch.bfloat16, "zero": torch.bfloat16}
    record = dq.checkpoint.quant_record(dq.Int4Groupwise(128), (8, 256), torch.bfloat16, inner_dtypes)
    assert record["params"] == {"group_size": 128}  # as before the option existed


EXTREME_FORMATS = ["int8", "int4g32", "f8row", "f8tensor"]  # NF4's extremes belong to its rewrite (issue 12)


@pytest.mark.parametrize("fmt_name", [*EXTREME_FORMATS, "nf4", "nf4b32s4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_values_at_the_dtype_max_stay_finite(fmt_name, dtype):
    """NF4 before: 2 * spread overflowed, its factor became 0 and every weight it covers NaN (16,384 of them)."""
    m = torch.finfo(dtype).max
    w = torch.randn(8, 64).to(dtype)
    w[0, 0], w[1, 3], w[2] = m, -m, m
    w[3, ::2], w[3, 1::2] = -m, m  # max - min overflows float32 for bf16/fp32
    w[4, :32] = (torch.linspace(-1, 1, 32, dtype=torch.float64) * m).to(dtype)
    assert w.isfinite().all()
    d = dq.quantize(w, FORMATS[fmt_name]).dequantize()
    assert d.isfinite().all(), (~d.isfinite()).nonzero().tolist()
    if fmt_name.startswith("nf4"):
        # NF4's scales share a mean and per-factor int8 steps, so no row is independent of the extremes;
        # every error is within NF4's own bound: half the widest gap between levels (1.0 - 0.7230) of the
        # block's scale, plus the scale's int8 step (spread / 256 <= max / 256).
        err = (d.double() - w.double()).abs().max() / m
        assert err <= (1.0 - 0.7230) / 2 + 2**-8, err
        return
    # the rows that are not extreme are untouched by the others
    ref = dq.quantize(w[5:], FORMATS[fmt_name]).dequantize()
    if fmt_name != "f8tensor":  # one scale for the whole tensor: its extremes set everyone's precision
        assert torch.equal(d[5:], ref)


@pytest.mark.parametrize("fmt_name", EXTREME_FORMATS)
def test_one_poisoned_value_poisons_at_most_its_block(fmt_name):
    """An Inf never costs its block its precision: the scale is its finite values', the Inf saturates to the
    largest code. A NaN poisons its block where the code has no NaN (int8, int4: the block says NaN rather than
    hold a finite wrong value); float8's e4m3fn codes keep it in its own element. See docs/hostile_input.md."""
    fmt = FORMATS[fmt_name]
    w = torch.randn(8, 128, dtype=torch.bfloat16)
    clean = dq.quantize(w, fmt).dequantize()
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = w.clone()
        bad[3, 70] = value
        d = dq.quantize(bad, fmt).dequantize()
        block = torch.zeros_like(d, dtype=torch.bool)
        if fmt_name == "int4g32":
            block[3, 64:96] = True
        elif fmt_name == "f8tensor":  # one scale: the whole tensor is the block
            block[:] = True
        else:
            block[3] = True
        element = torch.zeros_like(block)
        element[3, 70] = True
        assert torch.equal(d[~block], clean[~block]), "a value outside the poisoned block changed"
        if value != value and fmt_name in ("int8", "int4g32"):
            assert d[block].isnan().all(), "the poisoned block must say so (NaN), not hold finite wrong values"
            continue
        rest = block & ~element
        ref = dq.quantize(torch.where(element, 0, bad), fmt).dequantize()  # the block without the value
        if fmt_name != "int4g32":  # int4's range includes 0 either way; float8 and int8 scale by the max
            assert torch.equal(d[rest], ref[rest]), "the rest of the block lost precision to the non-finite value"
        assert d[rest].isfinite().all()
        if value != value:
            assert d[element].isnan().all()
        else:  # saturates: the largest code of its sign, times the block's scale
            assert d[element].isfinite().all() and (d[element] * value > 0).all()
            assert (d[element] >= d[rest].max()) if value > 0 else (d[element] <= d[rest].min())


@pytest.mark.parametrize("fmt_name", EXTREME_FORMATS)
def test_fp16_error_is_within_the_stated_bound_of_fp32(fmt_name):
    """docs/hostile_input.md: fp16's max error <= 1.25 x fp32's + 8 ulps of the largest scale
    + 1 ulp of the largest value.

    (8: Int4's largest code offset multiplies the scale's rounding; 1.25: float8's code rounding moves
    with the scale's; fp16 scales may be subnormal, whose ulp is 2**-24, so tiny weights keep fp32's
    precision instead of hitting a floor at 6.1e-5.)
    """
    fmt = FORMATS[fmt_name]
    for magnitude in (1e-6, 1e-4, 1e-2, 1.0, 1e3):
        w16 = (torch.randn(16, 256, generator=torch.Generator().manual_seed(5)) * magnitude).half()
        q16 = dq.quantize(w16, fmt)
        e16 = (q16.dequantize().float() - w16.float()).abs().amax().item()
        e32 = (dq.quantize(w16.float(), fmt).dequantize() - w16.float()).abs().amax().item()

        def ulp(x):
            return max(2**-24, torch.finfo(torch.float16).eps * x)

        bound = 1.25 * e32 + 8 * ulp(q16.scale.float().abs().max().item()) + ulp(w16.float().abs().max().item())
        assert e16 <= bound, (magnitude, e16, e32, bound)
        assert e16 <= 4 * e32 + 2**-20, (magnitude, e16, e32)  # and never the old 17x at 1e-4


def test_empty_weights():
    for fmt in FORMATS.values():
        q = dq.quantize(torch.zeros(0, 64), fmt)
        assert q.dequantize().shape == (0, 64)
    for fmt in FORMATS.values():  # no in_features: works, or a ValueError (never ZeroDivisionError)
        try:
            q = dq.quantize(torch.zeros(64, 0), fmt)
        except ValueError:
            continue
        assert q.dequantize().shape == (64, 0)


@pytest.mark.parametrize(
    "fmt", [dq.Int8Rowwise(scale_dtype=torch.bfloat16), dq.Float8Rowwise(scale_dtype=torch.bfloat16)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bf16_scales_of_weights_at_the_dtype_max_stay_finite(fmt, dtype):
    """Before: bf16 scales turned fp16 weights of 65504 (65504 rounds to bf16 65536) and fp32 weights of 3.4e38
    (the cap used bf16's range only) into Inf. Now they saturate at the largest bf16 value finite in the weight's
    dtype, within the code's rounding of it, and the other rows are as quantized on their own."""
    from dtensor_quant._core.reductions import largest_finite

    m = torch.finfo(dtype).max
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    w[0, 0], w[1], w[2, ::2] = m, -m, m
    d = dq.quantize(w, fmt).dequantize()
    assert d.dtype == dtype and d.isfinite().all()
    limit = largest_finite(torch.bfloat16, dtype)
    qmax = 127 if isinstance(fmt, dq.Int8Rowwise) else 448
    step = limit / qmax if qmax == 127 else limit / 16  # int8: one code; e4m3: 3 fraction bits
    assert ((d[:3].double() - w[:3].double().clamp(-limit, limit)).abs() <= step).all()
    assert torch.equal(d[3:], dq.quantize(w[3:], fmt).dequantize())
