"""fsdp/gather_quantized on one process: the GatherQuantized wrapper's forward, gradient and refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtensor_quant as dq
from dtensor_quant._fsdp.gather_quantized import GatherQuantized, gather_quantized_
from dtensor_quant.testing import assert_same_bits, assert_within, linear_error_bound, weight


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 16))


@pytest.mark.parametrize("fmt", [dq.Int8Rowwise(), dq.Int4Groupwise(32)])
def test_wrapper_forward_is_quantized_and_gradient_straight_through(fmt):
    master = weight((16, 64), dtype=torch.float32)
    w = nn.Parameter(GatherQuantized(master.clone(), fmt))
    x = weight((3, 64), seed=1, dtype=torch.float32).requires_grad_()
    y = F.linear(x, w)
    q = dq.quantize(master, fmt)
    assert torch.equal(y, F.linear(x.detach(), q))
    y.sum().backward()
    # straight-through: d(sum(x W^T))/dW = ones^T x, dense, whatever the quantization (autograd's matmuls and
    # the test's, each within the bound of its sums: 3 terms for the weight's, 16 for the input's)
    ones, xd, wd = torch.ones(3, 16), x.detach(), q.dequantize()
    assert type(w.grad) is torch.Tensor
    assert_within(w.grad, ones.t() @ xd, 2 * linear_error_bound(ones.t(), xd.t()), "weight gradient")
    assert_within(x.grad, ones @ wd, 2 * linear_error_bound(ones, wd.t()), "input gradient")
    assert_same_bits(w.detach().quantized(), q)


def test_wrapper_optimizer_updates_the_master():
    model = gather_quantized_(small_model(), dq.Int8Rowwise())
    assert isinstance(model[0].weight, GatherQuantized) and isinstance(model[2].weight, GatherQuantized)
    before = model[0].weight._data.clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(weight((4, 64), dtype=torch.float32)).sum().backward()
    opt.step()
    assert isinstance(model[0].weight, GatherQuantized)
    assert not torch.equal(model[0].weight._data, before)
    clone = copy.deepcopy(model)
    assert isinstance(clone[0].weight, GatherQuantized) and torch.equal(clone[0].weight._data, model[0].weight._data)


def test_gather_quantized_refuses_what_the_format_cannot_hold():
    model = nn.Sequential(nn.Linear(63, 8))
    with pytest.raises(ValueError, match=r"0.weight: .*even"):
        gather_quantized_(model, dq.Int4Groupwise(32))
