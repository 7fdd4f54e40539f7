"""formats/int4_zero: Int4GroupwiseIntZero holds compressed-tensors' asymmetric int4, AutoAWQ and GPTQ checkpoints.

Each test of a format that pre-quantized checkpoints need (here and in the other tests/formats/ files)
writes stored bytes the way the producer lays them out (random codes, scales that span the dtype's range,
extremes), puts them into the format's inner tensors as a loader would (no requantization), and compares
``dequantize`` and the fast ``unpack`` with what the producer library
computes from the same bytes. A producer package that is missing skips its
tests with the reason; CI installs them (pyproject's ``test`` extra, ``.ci/run``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import dtensor_quant as dq
from tests.support.format_cases import (
    assert_dequantizes_like,
    ct_scheme,
    needs_compressed_tensors,
    pack_nibbles,
    random_scales,
    stored,
)

# -- compressed-tensors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("group", [128, 32])
def test_compressed_tensors_int4_pack_quantized(symmetric, group):
    """``pack-quantized`` int4: ``weight_packed``'s bytes are qdata as stored; scales bf16; zero points unpacked."""
    needs_compressed_tensors()
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, n_in = 48, 4 * group
    g = torch.Generator().manual_seed(group + symmetric)
    codes = torch.randint(-8, 8, (out, n_in), generator=g, dtype=torch.int8)
    scale = random_scales((out, n_in // group), torch.bfloat16, seed=1)
    scheme = ct_scheme(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    state = {"weight_packed": pack_to_int32(codes, 4), "weight_scale": scale, "weight_shape": torch.tensor([out, n_in])}
    if symmetric:
        fmt = dq.Int4Groupwise(group, scale_dtype=torch.bfloat16)
        zero = torch.zeros_like(scale)
    else:
        zero_ct = torch.randint(-8, 8, (out, n_in // group), generator=g, dtype=torch.int8)
        zero_ct[0, :2] = torch.tensor([-8, 7])
        state["weight_zero_point"] = pack_to_int32(zero_ct, 4, packed_dim=0)
        fmt = dq.Int4GroupwiseIntZero(group, scale_dtype=torch.bfloat16)
        zero = (zero_ct + 8).to(torch.uint8)
    qdata = state["weight_packed"].contiguous().view(torch.uint8)  # little-endian int32 words: element i at bits 4i
    assert torch.equal(qdata, pack_nibbles((codes + 8).to(torch.uint8))), "the bytes are not qdata as stored"
    q = stored(fmt, (out, n_in), qdata=qdata, scale=scale, zero=zero)
    reference = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert reference.dtype == torch.bfloat16
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


# -- AutoAWQ and GPTQ (fp16 scales, integer zero points) ---------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble k of a word holds column 8j + AWQ_ORDER[k]


def _awq_packing():
    """AutoAWQ's packing_utils (torch only), loaded from the installed package without its heavy __init__."""
    # tests/support/producers.py may already have put a bare namespace for "awq" in sys.modules
    # (its __spec__ is None, which find_spec refuses): its __path__ names the same folder.
    top = sys.modules.get("awq")
    if top is not None and getattr(top, "__path__", None):
        folder = Path(next(iter(top.__path__)))
    else:
        spec = importlib.util.find_spec("awq")
        folder = Path(spec.origin).parent if spec and spec.origin else None
    path = folder / "utils" / "packing_utils.py" if folder is not None else None
    if path is None or not path.exists():
        pytest.skip("autoawq is not installed (pip install --no-deps autoawq==0.2.9; only packing_utils is used)")
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values -> AWQ GEMM int32 [rows, cols/8], nibble k of word j = column 8j + AWQ_ORDER[k]."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    words = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("group", [128, 64])
def test_awq_gemm(group):
    """AWQ GEMM (qweight int32 [in, out/8], qzeros [in/g, out/8], fp16 scales [in/g, out]) vs dequantize_gemm."""
    packing = _awq_packing()
    out, n_in = 64, 4 * group
    g = torch.Generator().manual_seed(group)
    codes = torch.randint(0, 16, (out, n_in), generator=g)
    zero = torch.randint(0, 16, (out, n_in // group), generator=g)
    zero[0, :2] = torch.tensor([0, 15])
    scale = random_scales((out, n_in // group), torch.float16, seed=7)
    reference = packing.dequantize_gemm(awq_pack(codes.t()), awq_pack(zero.t()), scale.t().contiguous(), 4, group)
    assert reference.dtype == torch.float16 and reference.shape == (n_in, out)
    fmt = dq.Int4GroupwiseIntZero(group, scale_dtype=torch.float16)
    q = stored(fmt, (out, n_in), qdata=pack_nibbles(codes), scale=scale, zero=zero.to(torch.uint8))
    assert_dequantizes_like(q, lambda dtype: reference.t().to(dtype))


def test_gptq_v1_zero_point_sixteen():
    """GPTQ v1 stores z - 1 in four bits: a zero point of 0 reads back as 16, and dequantizes as GPTQ does.

    GPTQ's reference dequantization (auto-gptq's and gptqmodel's torch path): ``scales * (weight - zeros)``
    with int8 codes, ``zeros = stored + 1``, fp16 scales.
    """
    g = torch.Generator().manual_seed(8)
    out, n_in, group = 32, 256, 128
    codes = torch.randint(0, 16, (out, n_in), generator=g, dtype=torch.int8)
    stored_zero = torch.randint(0, 16, (out, n_in // group), generator=g, dtype=torch.int8)
    stored_zero[0] = 15  # (0 - 1) & 15
    zeros = stored_zero + 1
    scale = random_scales((out, n_in // group), torch.float16, seed=9)
    reference = scale.repeat_interleave(group, 1) * (codes - zeros.repeat_interleave(group, 1))
    fmt = dq.Int4GroupwiseIntZero(group, scale_dtype=torch.float16)
    q = stored(fmt, (out, n_in), qdata=pack_nibbles(codes), scale=scale, zero=zeros.to(torch.uint8))
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


# -- extremes and non-finite input -----------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [None, torch.float16], ids=["weight dtype", "fp16 scales"])
def test_int_zero_extreme_and_non_finite_input(scale_dtype):
    """Finite groups stay finite (fp16 near its max); a NaN poisons only its own group; an Inf saturates to the
    end code of its group, whose other values keep their codes; zeros stay zeros."""
    fmt = dq.Int4GroupwiseIntZero(128, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(16, 512, generator=g) * 20000).clamp(-65504, 65504).to(torch.float16)
    w[3, :128] = 65504
    w[4, :128] = -65504
    d = dq.quantize(w, fmt).dequantize()
    assert d.isfinite().all() and ((d.float() - w.float()).norm() / w.float().norm()) < 0.12

    w = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    w[1, 7], w[2, 300], w[3] = float("-inf"), float("nan"), 0
    d = dq.quantize(w, fmt).dequantize()
    bad = ~d.isfinite()
    assert bad[2, 256:384].all() and int(bad.sum()) == 128
    without = dq.quantize(torch.where(w.isinf(), 0, w), fmt).dequantize()  # the lower end is <= 0 either way
    assert torch.equal(d[1, 8:128], without[1, 8:128]) and d[1, 7] == d[1, :128].min() < 0
    assert (d[3] == 0).all()
