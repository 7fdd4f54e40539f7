"""_training/fused: torch.optim's fused steps (``fused=True``: transformers' and torchtitan's default) on
trainable quantized weights follow the one rule of in-place updates; frozen weights are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtensor_quant as dq
from dtensor_quant._training.trainable import resolve
from dtensor_quant.testing import assert_same_bits


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 16, bias=False)).bfloat16()


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g).bfloat16(), torch.randn(32, 16, generator=g)


def quantized():
    return dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=1)


def train(model, opt, steps):
    x, y = data()
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


FUSED = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize("name", FUSED)
def test_fused_optimizers_train_quantized_weights_like_dense_ones(name):
    model = mlp()
    dense_losses = train(model, FUSED[name](list(model.parameters())), 25)
    model = quantized()
    opt = FUSED[name](list(model.parameters()))
    losses = train(model, opt, 25)
    assert isinstance(model[0].weight, dq.QuantizedTensor) and model[0].weight.qdata.dtype == torch.int8
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] == pytest.approx(dense_losses[-1], rel=0.1), (losses[-1], dense_losses[-1])
    for p in (model[0].weight, model[2].weight):  # dense states, in the logical dtype
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.ndim:
                assert type(value) is torch.Tensor and value.dtype == torch.bfloat16, key


OTHER_FUSED = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, fused=True),
}


@pytest.mark.parametrize("name", OTHER_FUSED)
def test_other_fused_optimizers_train_quantized_weights(name):
    model = quantized()
    losses = train(model, OTHER_FUSED[name](list(model.parameters())), 25)
    assert losses[-1] < 0.5 * losses[0]


def test_a_fused_step_is_the_kernel_on_float32_values_then_the_stochastic_requantization():
    lr, betas, wd, eps = 1e-2, (0.9, 0.999), 0.01, 1e-8
    a, b = quantized(), quantized()
    x, y = data()
    for m in (a, b):
        F.mse_loss(m(x).float(), y).backward()
    opt = torch.optim.AdamW(list(a.parameters()), lr=lr, betas=betas, weight_decay=wd, eps=eps, fused=True)
    opt.step()
    for i in (0, 2):
        p = b[i].weight
        link = resolve(p)
        dense = link.dense(p)
        m, v = torch.zeros_like(dense), torch.zeros_like(dense)
        torch._fused_adamw_([dense], [p.grad.float()], [m], [v], [], [torch.tensor(1.0)], lr=lr, beta1=betas[0],
                            beta2=betas[1], weight_decay=wd, eps=eps, amsgrad=False, maximize=False)  # fmt: skip
        link.requantize_(p, dense)
        assert_same_bits(a[i].weight.detach(), p.detach(), f"{i}.weight")
        state = opt.state[a[i].weight]
        assert torch.equal(state["exp_avg"], m.bfloat16()) and torch.equal(state["exp_avg_sq"], v.bfloat16())


def test_a_zero_learning_rate_leaves_the_bytes():
    model = quantized()
    before = model[0].weight.qdata.clone(), model[0].weight.scale.clone()
    train(model, torch.optim.AdamW(list(model.parameters()), lr=0.0, fused=True), 2)
    assert torch.equal(model[0].weight.qdata, before[0]) and torch.equal(model[0].weight.scale, before[1])


def test_a_frozen_quantized_weight_in_a_fused_step_is_refused_naming_the_fix():
    model = dq.quantize_(mlp(), dq.Int8Rowwise())
    w = model[0].weight
    w.grad = torch.zeros(w.shape, dtype=w.dtype)  # forced: a frozen weight gets no gradient of its own
    with pytest.raises(dq.UnsupportedOpError, match=r"_fused_adamw_.*trainable=True"):
        torch.optim.AdamW([w], lr=1e-2, fused=True).step()
