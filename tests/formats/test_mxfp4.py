"""formats/mxfp4: MXFP4 against compressed-tensors, transformers' gpt-oss experts and the reference quantizer."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import same_bits
from tests.support.format_cases import OUT_DTYPES, assert_dequantizes_like, ct_scheme, needs_compressed_tensors, stored


def _mx_bytes(shape, seed):
    """Random e2m1 code bytes and e8m0 exponents for a weight ``[..., out, in]``: every code, exponents 0-254."""
    g = torch.Generator().manual_seed(seed)
    *lead, out, n_in = shape
    qdata = torch.randint(0, 256, (*lead, out, n_in // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(100, 150, (*lead, out, n_in // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    flat = scale.view(-1)
    flat[:4] = torch.tensor([0, 1, 254, 127], dtype=torch.uint8)  # 2**-127 (subnormal), 2**127: the extremes
    return qdata, scale


def test_mxfp4_compressed_tensors():
    """``mxfp4-pack-quantized``: ``weight_packed`` and ``weight_scale`` are qdata and scale as stored."""
    needs_compressed_tensors()
    from compressed_tensors.compressors import MXFP4PackedCompressor

    qdata, scale = _mx_bytes((48, 512), seed=12)
    scheme = ct_scheme(
        num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8
    )
    reference = MXFP4PackedCompressor.decompress({"weight_packed": qdata, "weight_scale": scale}, scheme)["weight"]
    q = stored(dq.MXFP4(), (48, 512), qdata=qdata, scale=scale)
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype), dtypes=(torch.bfloat16,))
    assert_dequantizes_like(q, lambda dtype: q.dequantize(torch.float32).to(dtype))  # exact in fp32: one rounding


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_mxfp4_gpt_oss_expert_stacks_like_transformers(dtype):
    """gpt-oss's ``*_blocks`` [E, out, in/32, 16] and ``*_scales`` [E, out, in/32] into a 3-D stack [E, out, in].

    transformers' ``convert_moe_packed_tensors`` dequantizes them (``ldexp`` in the model's dtype) and
    transposes to its [E, in, out] parameter layout.
    """
    pytest.importorskip("transformers", reason="transformers is missing: pip install '.[test]'")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    qdata, scale = _mx_bytes((3, 40, 256), seed=13)
    blocks = qdata.view(3, 40, 256 // 32, 16)
    reference = convert_moe_packed_tensors(blocks, scale, dtype=dtype)
    assert reference.shape == (3, 256, 40)
    q = stored(dq.MXFP4(), (3, 40, 256), qdata=qdata, scale=scale)
    assert same_bits(q.dequantize(dtype), reference.transpose(1, 2))
    assert same_bits(q[1].dequantize(dtype), reference[1].t())  # one expert, as the eager forward selects it


def test_mxfp4_quantize_matches_the_reference_quantizer():
    """Scales as compressed-tensors' generate_mx_scales (vLLM's reference), values rounded to nearest even e2m1."""
    needs_compressed_tensors()
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    g = torch.Generator().manual_seed(14)
    magnitudes = torch.exp2(torch.randint(-20, 20, (32, 1), generator=g).float())
    w = (torch.randn(32, 512, generator=g) * magnitudes).to(torch.bfloat16)
    w[0, :32] = torch.linspace(-7, 7, 32)  # ties and the saturation edge at 6
    w[1, :32] = 1.75 * 2.0**3  # a block maximum that rounds up to the next power of two
    q = dq.quantize(w, dq.MXFP4())
    amax = w.view(32, -1, 32).abs().amax(-1)
    assert torch.equal(q.scale, generate_mx_scales(amax).to(torch.uint8))
    args = ct_scheme(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32).weights
    scale_float = torch.exp2(q.scale.double() - 127).to(torch.bfloat16)
    reference = fake_quantize(w, scale_float, None, args)
    assert same_bits(q.dequantize(torch.bfloat16), reference.to(torch.bfloat16))


def test_mxfp4_shapes_and_extremes():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        dq.quantize(torch.randn(8, 48), dq.MXFP4())
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[1, 3], w[2, 40], w[3, :32] = float("nan"), float("inf"), 0
    q = dq.quantize(w, dq.MXFP4())
    d = q.dequantize()
    assert (~d[1, :32].isfinite()).all() and (d[3, :32] == 0).all()  # a NaN: its block's scale is e8m0's NaN
    assert d[0].isfinite().all() and d[1, 32:].isfinite().all() and d[2].isfinite().all()
    # an Inf saturates at 6 times its block's scale, which its finite values set
    assert d[2, 40] == 6 * 2.0 ** (q.scale[2, 1].item() - 127)
    without = dq.quantize(torch.where(w.isinf(), 0, w), dq.MXFP4()).dequantize()
    assert torch.equal(d[2, 32:40], without[2, 32:40]) and torch.equal(d[2, 41:], without[2, 41:])
    big = torch.full((2, 32), torch.finfo(torch.float32).max)
    assert dq.quantize(big, dq.MXFP4()).dequantize().isfinite().all()  # one exponent smaller: values saturate
    near = torch.full((2, 32), 60000.0, dtype=torch.float16)  # the reference rounds it to 4 * 2**14 = 65536: Inf
    assert dq.quantize(near, dq.MXFP4()).dequantize().isfinite().all()
