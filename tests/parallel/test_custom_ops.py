"""_parallel/custom_ops on one process: quantize, dequantize and linear as ops, and their gradients."""

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._parallel import custom_ops as ops
from dtensor_quant.testing import FORMATS, assert_same_bits, assert_within, gamma, linear_error_bound, weight


def test_single_process_ops():
    w = weight((64, 256), seed=1)
    x = weight((3, 5, 256), seed=2)
    for fmt in FORMATS.values():
        q = ops.quantize(w, fmt)
        assert_same_bits(q, dq.quantize(w, fmt), f"{fmt}")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            d = ops.dequantize(q, dtype)
            assert d.dtype == dtype and torch.equal(d, q.dequantize(dtype))
        assert torch.equal(ops.linear(x, q), F.linear(x, q))
    with pytest.raises(TypeError, match="quantized"):
        ops.linear(x, w)


def test_linear_op_backward_reaches_input_and_bias():
    q = dq.quantize(weight((64, 128), seed=1, dtype=torch.float32), dq.Int8Rowwise())
    x = weight((2, 3, 128), seed=2, dtype=torch.float32).requires_grad_()
    bias = torch.zeros(64, requires_grad=True)
    out = ops.linear(x, q, bias)
    out.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    bias_ref = torch.zeros(64, requires_grad=True)
    w = q.dequantize()
    out_ref = F.linear(x_ref, w, bias_ref)
    out_ref.square().sum().backward()
    # The op and the reference may sum in other orders: the forwards within the summation's bound, and the
    # gradients (2 * out @ W, and 2 * out summed over 6 rows) within theirs plus the forwards' measured
    # difference carried through them.
    assert_within(out, out_ref, 2 * linear_error_bound(x, w, bias), "forward")
    g, g_ref = 2 * out.detach(), 2 * out_ref.detach()
    carried = (g - g_ref).double().abs()
    bound = linear_error_bound(g, w.t()) + linear_error_bound(g_ref, w.t()) + carried @ w.double().abs()
    assert_within(x.grad, x_ref.grad, bound, "input gradient")
    rows, rows_ref = g.reshape(-1, 64).double().abs(), g_ref.reshape(-1, 64).double().abs()
    sums = gamma(rows.shape[0]) * (rows.sum(0) + rows_ref.sum(0)) + carried.reshape(-1, 64).sum(0)
    assert_within(bias.grad, bias_ref.grad, sums, "bias gradient")


def test_top_level_dequantize_is_the_inverse_of_quantize():
    """``dq.dequantize`` sits beside ``dq.quantize`` and refuses a dense tensor by type."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q = dq.quantize(w, dq.Int4Groupwise(128))
    assert torch.equal(dq.dequantize(q), q.dequantize())
    assert dq.dequantize(q, torch.float32).dtype == torch.float32
    with pytest.raises(TypeError, match="expects a quantized tensor"):
        dq.dequantize(w)
    assert "interop" in dq.__all__ and "dequantize" in dq.__all__
