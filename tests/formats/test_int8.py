"""formats/int8: Int8Rowwise against a reference, compressed-tensors' per-channel int8 bit for bit, and its
stochastic-rounding kernel against the torch expression.
"""

from __future__ import annotations

import torch

import dtensor_quant as dq
from dtensor_quant._core.format import Reducer
from dtensor_quant._core.stochastic import Noise
from tests.support.format_cases import (
    assert_dequantizes_like,
    both_paths,
    ct_scheme,
    needs_compressed_tensors,
    random_scales,
    round_up,
    stored,
)


def test_int8_matches_reference():
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q8 = dq.quantize(w, dq.Int8Rowwise())
    scale = round_up(w.float().abs().amax(1, keepdim=True) / 127, torch.bfloat16).float()
    assert torch.equal(q8.dequantize(), ((w.float() / scale).round().clamp(-127, 127) * scale).to(torch.bfloat16))


def test_compressed_tensors_int8_per_channel():
    needs_compressed_tensors()
    from compressed_tensors.compressors import IntQuantizationCompressor

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (40, 256), generator=g, dtype=torch.int8)
    scale = random_scales((40, 1), torch.bfloat16, seed=4)
    scheme = ct_scheme(num_bits=8, type="int", symmetric=True, strategy="channel")
    reference = IntQuantizationCompressor.decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"]
    q = stored(dq.Int8Rowwise(scale_dtype=torch.bfloat16), (40, 256), qdata=codes, scale=scale)
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


def test_int8_stochastic_kernel_gives_the_torch_bits(monkeypatch):
    w = torch.randn(300, 517, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 517)
    for offsets, whole in [((0, 0), (300, 517)), ((7, 11), (900, 600)), ((10**6, 3), (10**7, 600))]:
        noise = Noise(5, 9, tuple(w.shape), offsets, whole)
        fast, slow = both_paths(
            monkeypatch, lambda n=noise: dq.Int8Rowwise().quantize_stochastic(w, Reducer(w.shape), n, torch.bfloat16)
        )
        assert torch.equal(fast["qdata"], slow["qdata"]) and torch.equal(fast["scale"], slow["scale"])
    w[3, 5], w[4] = float("nan"), 0.0  # a NaN row and a zero row: the row maxima and dense values as torch's
    q = dq.quantize(w.bfloat16(), dq.Int8Rowwise())
    for fn in (lambda: q.dequantize(torch.float32), lambda: dq.quantize(w, dq.Int8Rowwise()).scale):
        fast, slow = both_paths(monkeypatch, fn)
        assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))
