"""formats/bnb_nf4: bitsandbytes' NF4 with double quantization, stored bytes and quantization alike."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import same_bits
from tests.support.format_cases import OUT_DTYPES, assert_dequantizes_like, random_scales


def _bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is missing: pip install '.[test]'")


def _bnb_state(shape, dtype, absmax, nested, offset):
    """A bitsandbytes QuantState for stored NF4 bytes (double quantization), as a checkpoint's quant_state reads."""
    functional = _bnb()
    nested_state = functional.QuantState(
        absmax=nested, code=functional.create_dynamic_map(), blocksize=256, dtype=torch.float32
    )
    return functional.QuantState(
        absmax=absmax,
        shape=torch.Size(shape),
        dtype=dtype,
        blocksize=64,
        code=functional.get_4bit_type("nf4", device="cpu"),
        quant_type="nf4",
        offset=torch.tensor(offset, dtype=torch.float32),
        state2=nested_state,
    )


def _into_bnb_nf4(shape, dtype, packed, absmax, nested, offset):
    """The stored bnb tensors (flat) in BnbNF4's inner tensors: the same bytes, reshaped to the layout."""
    q = dq.quantize(torch.zeros(shape, dtype=dtype), dq.BnbNF4())
    q.qdata.copy_(packed.reshape(q.qdata.shape))
    q.absmax.copy_(absmax.reshape(q.absmax.shape))
    q.nested_absmax.copy_(nested.reshape(q.nested_absmax.shape))
    q.offset.fill_(offset)
    return q


@pytest.mark.parametrize("shape", [(64, 1024), (40, 14336), (33, 64), (6, 96)], ids=str)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_bnb_nf4_dequantizes_stored_bytes_like_bitsandbytes(shape, dtype):
    """Random stored bytes (every code, absmax code and sign; nested scales over a wide range) vs dequantize_4bit.

    (40, 14336): a nested block of 16384 values runs across rows; (6, 96): so does every 64-value block.
    """
    functional = _bnb()
    numel, g = shape[0] * shape[1], torch.Generator().manual_seed(sum(shape))
    packed = torch.randint(0, 256, (numel // 2, 1), generator=g, dtype=torch.int32).to(torch.uint8)
    absmax = torch.randint(0, 256, (numel // 64,), generator=g, dtype=torch.int32).to(torch.uint8)
    nested = random_scales((-(-numel // 64 // 256),), torch.float32, seed=15, extremes=False) * 1e-30
    offset = 0.0517
    reference = functional.dequantize_4bit(packed, _bnb_state(shape, dtype, absmax, nested, offset))
    q = _into_bnb_nf4(shape, dtype, packed, absmax, nested, offset)
    assert same_bits(q.dequantize(), reference)
    for other in OUT_DTYPES:  # bnb's output dtype is the state's: the same bytes in every dtype
        expected = functional.dequantize_4bit(packed, _bnb_state(shape, other, absmax, nested, offset))
        assert_dequantizes_like(q, lambda d, expected=expected: expected, dtypes=(other,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bnb_nf4_quantize_like_bitsandbytes(dtype):
    """quantize_4bit(nf4, compress_statistics=True): the 4-bit codes always equal bitsandbytes', the rest measured."""
    functional = _bnb()
    agree = total = 0
    for seed, shape in enumerate([(64, 1024), (256, 2048), (40, 14336), (3, 12288)]):
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)
        w[0, :64] = 0  # an all-zero block
        w[1, :64] *= 50  # a block far above the others: its absmax normalizes to +1
        packed, state = functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        q = dq.quantize(w, dq.BnbNF4())
        assert torch.equal(q.qdata.reshape(-1), packed.reshape(-1)), "4-bit codes"
        if q.offset.item() == state.offset.item():  # torch's float32 mean rounded as our float64 sum did
            assert torch.equal(q.nested_absmax.reshape(-1), state.state2.absmax)
        agree += int((q.absmax.reshape(-1) == state.absmax).sum())
        total += state.absmax.numel()
        stored = _into_bnb_nf4(shape, dtype, packed, state.absmax, state.state2.absmax, state.offset.item())
        assert same_bits(stored.dequantize(), functional.dequantize_4bit(packed, state))
        err = ((q.dequantize().float() - w.float()).norm() / w.float().norm()).item()
        assert err < 0.12, err
    # bitsandbytes' CPU search picks the second-nearest of two nearly equidistant map entries now and then
    assert agree / total > 0.99, f"{agree}/{total} absmax codes equal bitsandbytes'"


def test_bnb_nf4_maps_and_layout():
    functional = _bnb()
    from dtensor_quant._formats.bnb_nf4 import NF4_LEVELS_F32, dynamic_map

    assert torch.equal(dynamic_map(), functional.create_dynamic_map())
    assert torch.equal(torch.tensor(NF4_LEVELS_F32), functional.get_4bit_type("nf4", device="cpu"))
    layout = dq.BnbNF4().layout_for((16, 14336))
    assert layout["nested_absmax"] == (dq.FlatBlocked(16384, 14336), dq.InFlat(14336))
    assert layout["absmax"] == (dq.OneToOne(), dq.Blocked(64))
    with pytest.raises(ValueError, match="multiple of block_size"):
        dq.quantize(torch.randn(3, 20), dq.BnbNF4())


def test_bnb_nf4_non_finite_input_poisons_only_its_nested_block():
    w = torch.randn(32, 14336, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[9, 5000] = float("nan")  # flat index 134024: nested block 8 covers [131072, 147456)
    w[20, :64] = 0
    d = dq.quantize(w, dq.BnbNF4()).dequantize().flatten()
    bad = (~d.isfinite()).nonzero().flatten()
    assert bad.numel() == 16384 and bad.min() == 8 * 16384 and bad.max() == 9 * 16384 - 1
    assert (d[20 * 14336 : 20 * 14336 + 64] == 0).all()
