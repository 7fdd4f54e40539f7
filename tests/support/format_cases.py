"""What the format tests share: reference roundings, stored bytes put into a format as a loader writes
them, and both paths of a kernel (C++ and torch).
"""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import same_bits


def round_up(x: torch.Tensor, dtype) -> torch.Tensor:
    """The smallest ``dtype`` value >= ``x``: scales round up so that no code is clipped."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def int8_codes(weight, scale):
    return (weight.float() / scale.float()).round().clamp(-127, 127).to(torch.int8)


OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def stored(fmt, shape, dtype=torch.bfloat16, **inner):
    """A quantized weight of ``fmt`` whose inner tensors are the given stored bytes (as a loader writes them)."""
    q = dq.quantize(torch.zeros(shape, dtype=dtype), fmt)
    for name, value in inner.items():
        target = getattr(q, name)
        assert target.dtype == value.dtype and target.shape == value.shape, (name, target.shape, value.shape)
        target.copy_(value)
    return q


def random_scales(shape, dtype, seed, extremes=True):
    """Positive scales over the dtype's whole range (log-uniform), with its smallest subnormal and largest value."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = torch.tensor(info.smallest_normal * info.eps).log2().item(), torch.tensor(info.max).log2().item() - 4
    s = torch.exp2(torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if extremes:
        flat = s.view(-1)
        flat[0], flat[1], flat[2] = info.smallest_normal * info.eps, info.max / 16, info.smallest_normal
    return s


def assert_dequantizes_like(q, reference, dtypes=OUT_DTYPES):
    """``q.dequantize(dtype)`` and the fast path equal ``reference(dtype)`` bit for bit in each dtype."""
    from dtensor_quant._ops import unpack

    for dtype in dtypes:
        expected = reference(dtype)
        assert same_bits(q.dequantize(dtype), expected), dtype
        fast = unpack.dense(q, dtype)
        assert fast is None or same_bits(fast, expected), f"unpack differs from the producer in {dtype}"


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two unsigned 4-bit codes per byte along the last dim, the even one in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., ::2] | (codes[..., 1::2] << 4)


def needs_compressed_tensors():
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is missing: pip install '.[test]'")


def ct_scheme(**weights):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


def both_paths(monkeypatch, fn):
    """``fn()`` with the C++ kernels, then with the torch expressions (DTENSOR_QUANT_NATIVE=0)."""
    fast = fn()
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "0")
    slow = fn()
    monkeypatch.delenv("DTENSOR_QUANT_NATIVE")
    return fast, slow
