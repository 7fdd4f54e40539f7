"""formats/nf4_block_scales: NF4 without double quantization (bitsandbytes'), and the exact expansion of NF4/BnbNF4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._formats.nf4 import kernel as nf4_kernel
from dtensor_quant._ops.matmul import record_paths
from dtensor_quant.testing import same_bits
from tests.support.format_cases import OUT_DTYPES

EXPANDABLE = [dq.NF4(), dq.BnbNF4()]
# (896, 896): Qwen2.5-0.5B's q/o (a 16384-value factor spans 18.3 rows); (40, 14336): a factor inside a row;
# (6, 96): 64-value blocks across rows; (3, 128, 256): an expert stack.
SHAPES = [(896, 896), (40, 14336), (6, 96), (3, 128, 256)]


def _bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is missing: pip install '.[test]'")


def _weight(shape, dtype, seed=0):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    w.view(-1)[:64] = 0  # an all-zero block
    w.view(-1)[64:128] *= 50  # a block far above the others
    return w.to(dtype)


@pytest.mark.parametrize("shape", [(64, 1024), (40, 14336), (3, 640), (896, 896)], ids=str)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_quantize_is_bitsandbytes_without_double_quantization(shape, dtype):
    """quantize_4bit(nf4, compress_statistics=False): the same codes and float32 absmax; dequantize_4bit's bits.

    (Rows whose width is no multiple of 64, e.g. 6 x 96, are left out: there bitsandbytes 0.50's CPU
    dequantize_4bit disagrees with its own quantize -- 2.5x our error from the same codes and absmax.)
    """
    functional = _bnb()
    w = _weight(shape, dtype)
    packed, state = functional.quantize_4bit(w, quant_type="nf4", compress_statistics=False)
    q = dq.quantize(w, dq.NF4BlockScales())
    assert torch.equal(q.qdata.reshape(-1), packed.reshape(-1))
    assert torch.equal(q.scale.reshape(-1), state.absmax)
    assert same_bits(q.dequantize(), functional.dequantize_4bit(packed, state))


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_torchao_levels_pick_nf4s_codes(dtype):
    """levels="torchao": NF4's codes (the nearest of its levels to w / absmax), its scale the block's absmax."""
    w = _weight((64, 1024), dtype)
    q, nf4 = dq.quantize(w, dq.NF4BlockScales(levels="torchao")), dq.quantize(w, dq.NF4())
    assert torch.equal(q.qdata, nf4.qdata)
    assert q.scale.dtype == dtype
    assert torch.equal(q.scale, w.abs().reshape(64, 16, 64).amax(-1))
    err = ((q.dequantize().float() - w.float()).norm() / w.float().norm()).item()
    assert err < 0.1, err


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", EXPANDABLE, ids=str)
def test_expand_scales_keeps_every_value(fmt, dtype, shape):
    """Every element dequantizes to the same bits in every output dtype; the codes are the same bytes."""
    w = _weight(shape, dtype)
    w.view(-1)[-3] = float("nan")  # a non-finite weight poisons its own factor's values: still the same bits
    q = dq.quantize(w, fmt)
    e = dq.expand_scales(q)
    assert e.fmt == fmt.expanded_format() and e.shape == q.shape and e.dtype == q.dtype
    assert e.qdata.data_ptr() == q.qdata.data_ptr()  # the codes are shared, not copied (an expert stack's too)
    for out in OUT_DTYPES:
        assert same_bits(e.dequantize(out), q.dequantize(out)), out


@pytest.mark.parametrize("fmt", EXPANDABLE, ids=str)
def test_expanded_weight_cuts_where_the_double_quantized_one_cannot(fmt):
    """Qwen2.5-0.5B's q_proj [896, 896] at TP 2: neither half of the rows nor of the columns is a whole number of
    16384-value factors; the expanded weight cuts both, each half the same bits as the whole's."""
    q = dq.quantize(_weight((896, 896), torch.bfloat16), fmt)
    for dim in (0, 1):
        with pytest.raises(dq.LayoutError):
            torch.chunk(q, 2, dim=dim)[0].dequantize()
    e = dq.expand_scales(q)
    whole = q.dequantize()
    for dim in (0, 1):
        for piece, want in zip(torch.chunk(e, 2, dim=dim), torch.chunk(whole, 2, dim=dim)):
            assert same_bits(piece.dequantize(), want)


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("fmt", EXPANDABLE, ids=str)
def test_expanded_weight_runs_the_same_kernel_to_the_same_bits(fmt, tokens):
    """F.linear: the same NF4 kernel with the same levels and block scales gives the same output bits."""
    q = dq.quantize(_weight((96, 2048), torch.bfloat16), fmt)
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    e = dq.expand_scales(q)
    with record_paths() as paths:
        assert same_bits(F.linear(x, e), F.linear(x, q))
    if nf4_kernel() is not None:  # both through the kernel, not one of them dequantized
        assert paths == {(str(e.fmt), "kernel"): 1, (str(fmt), "kernel"): 1}, paths


def test_expand_scales_refuses_what_it_cannot_expand():
    q = dq.quantize(_weight((64, 256), torch.bfloat16), dq.NF4())
    with pytest.raises(ValueError, match="not a view or slice"):
        dq.expand_scales(q.t())
    assert same_bits(dq.expand_scales(q[:32]).dequantize(), q.dequantize()[:32])  # a legal slice is a weight
    with pytest.raises(ValueError, match="one level of scales"):
        dq.expand_scales(dq.quantize(_weight((64, 256), torch.bfloat16), dq.Int8Rowwise()))
    with pytest.raises(ValueError, match="dense"):
        dq.expand_scales(torch.zeros(64, 256))


def test_format_checks():
    with pytest.raises(ValueError, match="levels must be one of"):
        dq.NF4BlockScales(64, levels="paper")
    with pytest.raises(ValueError, match="even block_size"):
        dq.NF4BlockScales(63)
    with pytest.raises(ValueError, match="multiple of block_size"):
        dq.quantize(torch.randn(3, 20), dq.NF4BlockScales())
    assert dq.NF4BlockScales().layout_for((6, 96))["scale"] == (dq.FlatBlocked(64, 96), dq.InFlat(96))
    assert dq.NF4BlockScales().layout_for((896, 896))["scale"] == (dq.OneToOne(), dq.Blocked(64))
