"""_training/trainable on one process: stochastic rounding, in-place updates, optimizers.

The distributed side (FSDP2, TP, 2-D, DCP) is tests/distributed/model/test_trainable.py;
it compares against exactly these single-process runs.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtensor_quant as dq
from dtensor_quant._core.format import Reducer
from dtensor_quant._core.stochastic import Noise
from dtensor_quant._training import trainable

SR_FORMATS = {"int8": dq.Int8Rowwise(), "float8": dq.Float8Rowwise(), "float8t": dq.Float8Tensorwise()}


# -- stochastic rounding in the formats ---------------------------------------------------


def rounded(fmt, w: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``w`` stochastically rounded into ``fmt`` with ``noise``, as float32 values."""
    return fmt.dequantize(fmt.quantize_stochastic(w, Reducer(w.shape), Noise.of(noise), torch.float32), torch.float32)


@pytest.mark.parametrize("name", SR_FORMATS)
def test_stochastic_rounding_is_unbiased_and_keeps_values_on_codes(name):
    fmt = SR_FORMATS[name]
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    nearest = fmt.quantize(w, Reducer(w.shape))
    codes = fmt.dequantize(nearest, torch.float32)
    # a value on a code stays there whatever the noise: requantizing dequantized bytes is exact
    again = fmt.quantize_stochastic(codes, Reducer(w.shape), Noise.of(torch.rand(w.shape)), torch.float32)
    for n in fmt.inner_names:
        assert torch.equal(again[n].view(torch.uint8), nearest[n].view(torch.uint8))
    # the average over many noises converges on the value (nearest rounding does not)
    g = torch.Generator().manual_seed(1)
    mean = sum(rounded(fmt, w, torch.rand(w.shape, generator=g)) for _ in range(256)) / 256
    assert (mean - w).abs().mean() < 0.15 * (codes - w).abs().mean()
    # the extreme noises pick the two neighbouring codes, which bracket the value
    a, b = (rounded(fmt, w, torch.full(w.shape, u)) for u in (0.0, 1 - 2**-24))
    slack = 1e-6 * w.abs()  # a row's maximum sits within an ulp of its top code (the scale rounds up)
    assert (torch.minimum(a, b) <= w + slack).all() and (w - slack <= torch.maximum(a, b)).all()


def test_scales_keep_the_logical_dtype():
    w = torch.randn(8, 64)
    inner = dq.Int8Rowwise().quantize_stochastic(w, Reducer(w.shape), Noise.of(torch.rand(w.shape)), torch.bfloat16)
    assert inner["scale"].dtype == torch.bfloat16 and inner["qdata"].dtype == torch.int8


# -- trainable weights --------------------------------------------------------------------


def mlp(dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=True), nn.ReLU(), nn.Linear(96, 16, bias=False)).to(dtype)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g).bfloat16(), torch.randn(32, 16, generator=g)


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=True),
}


def train(model, make_opt, steps=25):
    x, y = data()
    opt = make_opt(list(model.parameters()))
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_any_torch_optimizer_trains_quantized_weights_like_dense_ones(opt_name):
    dense_losses, _ = train(mlp(), OPTIMIZERS[opt_name])
    model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=1)
    losses, opt = train(model, OPTIMIZERS[opt_name])
    w = model[0].weight
    assert isinstance(w, dq.QuantizedTensor) and w.requires_grad and w.qdata.dtype == torch.int8
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] == pytest.approx(dense_losses[-1], rel=0.05), (losses[-1], dense_losses[-1])
    for p in (model[0].weight, model[2].weight):  # dense states, in the logical dtype
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.ndim:
                assert type(value) is torch.Tensor and value.dtype == torch.bfloat16, key


def test_foreach_and_single_tensor_updates_give_the_same_bytes():
    a = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=1)
    b = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=1)
    train(a, OPTIMIZERS["adamw"], steps=5)
    train(b, OPTIMIZERS["adamw-foreach"], steps=5)
    for p, q in zip(a.parameters(), b.parameters()):
        if isinstance(p, dq.QuantizedTensor):
            assert torch.equal(p.qdata, q.qdata) and torch.equal(p.scale, q.scale)
        else:
            assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["float8", "float8t"])
def test_float8_weights_train(name):
    model = dq.quantize_(mlp(), SR_FORMATS[name], trainable=True, seed=1)
    losses, _ = train(model, OPTIMIZERS["adamw-foreach"])
    assert losses[-1] < 0.5 * losses[0]


def test_gradient_is_dense_and_the_forward_uses_the_quantized_weight():
    model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True)
    x, _ = data()
    w = model[0].weight
    out = model[0](x)
    torch.testing.assert_close(out, F.linear(x, w.dequantize(), model[0].bias), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert type(w.grad) is torch.Tensor and w.grad.shape == w.shape and w.grad.dtype == w.dtype
    torch.testing.assert_close(w.grad.float(), torch.ones(32, 96).t() @ x.float(), rtol=2e-2, atol=2e-2)


def test_updates_are_stochastically_rounded_and_counted():
    model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=4)
    w = model[0].weight
    link = trainable.resolve(w)
    before, delta = w.dequantize(torch.float32), torch.full(w.shape, 1e-4)
    with torch.no_grad():
        w.add_(delta)  # far below a code's step: nearest rounding would lose it
    assert link.state.step == 1
    moved = w.dequantize(torch.float32) - before
    assert moved.abs().max() > 0 and moved.mean().item() == pytest.approx(1e-4, rel=0.3)
    with torch.no_grad():  # an update that changes nothing leaves the bytes and the count
        q0 = w.qdata.clone()
        w.mul_(1.0)
        w.add_(delta, alpha=0.0)
        torch._foreach_mul_([w], 1.0)
    assert link.state.step == 1 and torch.equal(w.qdata, q0)


def test_an_alias_of_a_trainable_weight_updates_it():
    model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True)
    w = model[0].weight
    before = w.qdata.clone()
    with torch.no_grad():
        w.data.add_(torch.full(w.shape, 0.05))  # old-style code writes through .data
    assert not torch.equal(w.qdata, before) and trainable.resolve(w).state.step == 1


def test_optimizer_states_are_dense_and_factories_for_bytes_stay_quantized():
    model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True)
    w = model[0].weight
    assert type(torch.zeros_like(w)) is torch.Tensor and torch.zeros_like(w).dtype == torch.bfloat16
    assert type(torch.full_like(w, 0.5)) is torch.Tensor
    assert isinstance(torch.empty_like(w), dq.QuantizedTensor)  # distribute_tensor, Module.to_empty
    assert isinstance(w.new_zeros((4, 64)), dq.QuantizedTensor)  # FSDP2's padded shards
    frozen = dq.quantize(torch.randn(8, 64), dq.Int8Rowwise())
    assert isinstance(torch.zeros_like(frozen), dq.QuantizedTensor)


def test_frozen_weights_still_refuse_arithmetic():
    model = dq.quantize_(mlp(), dq.Int8Rowwise())
    w = model[0].weight
    with pytest.raises(dq.UnsupportedOpError, match=r"aten\.mul_.*Int8Rowwise.*trainable=True"):
        w.mul_(0.5)
    with pytest.raises(dq.UnsupportedOpError, match="trainable=True"):
        torch._foreach_add_([w], [torch.ones(w.shape)])
    with pytest.raises(dq.UnsupportedOpError):
        torch.full_like(w, 1.0)


def test_trainable_needs_stochastic_rounding_and_2d_weights():
    with pytest.raises(ValueError, match="no stochastic rounding"):
        dq.quantize_(mlp(torch.float32), dq.NF4(64), trainable=True)

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 8, 64))

    with pytest.raises(ValueError, match="3-D"):
        dq.quantize_(Experts(), dq.Int8Rowwise(), trainable=True)


def test_each_weight_has_its_own_seed():
    model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=7)
    seeds = {trainable.resolve(p).state.seed for p in (model[0].weight, model[2].weight)}
    assert len(seeds) == 2
    again = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=7)
    assert trainable.resolve(again[0].weight).state.seed == trainable.resolve(model[0].weight).state.seed


def test_resuming_from_a_state_dict_rounds_as_the_uninterrupted_run():
    make = OPTIMIZERS["adamw-foreach"]
    straight = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=2)
    train(straight, make, steps=6)

    first = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=2)
    _, opt = train(first, make, steps=3)
    model_sd, opt_sd = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    assert all(s["sr_step"] == 6 for s in (opt_sd["state"][0], opt_sd["state"][2]))  # mul_ and addcdiv_, 3 steps

    resumed = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=2)
    resumed.load_state_dict(model_sd)
    x, y = data()
    opt2 = make(list(resumed.parameters()))
    opt2.load_state_dict(opt_sd)
    for _ in range(3):
        F.mse_loss(resumed(x).float(), y).backward()
        opt2.step()
        opt2.zero_grad()
    for p, q in zip(straight.parameters(), resumed.parameters()):
        if isinstance(p, dq.QuantizedTensor):
            assert torch.equal(p.qdata, q.qdata) and torch.equal(p.scale, q.scale)
        else:
            assert torch.equal(p, q)


def _continue(model, opt, steps):
    x, y = data()
    for _ in range(steps):
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _same_weights(a, b) -> bool:
    return all(
        all(torch.equal(getattr(p, n), getattr(q, n)) for n in p.fmt.inner_names)
        if isinstance(p, dq.QuantizedTensor)
        else torch.equal(p, q)
        for p, q in zip(a.parameters(), b.parameters())
    )


RESUME_OPTIMIZERS = {
    "adamw-foreach": OPTIMIZERS["adamw-foreach"],
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),  # stateless: the count is its only state
    "adamw8bit": lambda ps: dq.optim.AdamW8bit(ps, lr=1e-2, block_size=32, min_quantized_numel=1024),
}


@pytest.mark.parametrize("opt_name", RESUME_OPTIMIZERS)
def test_resuming_through_get_and_set_optimizer_state_dict_and_dcp(tmp_path, opt_name):
    """The count lives in the optimizer's live state: DCP's state-dict API carries it like any other state (the
    model's state dict holds tensors, so DCP takes the library's planners)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    make = RESUME_OPTIMIZERS[opt_name]
    straight = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=2)
    _continue(straight, make(list(straight.parameters())), 6)

    first = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=2)
    opt = make(list(first.parameters()))
    _continue(first, opt, 3)
    assert all("sr_step" in opt.state[p] for p in (first[0].weight, first[2].weight))  # live, not only saved
    state = {"model": get_model_state_dict(first), "optim": get_optimizer_state_dict(first, opt)}
    dcp.save(state, checkpoint_id=str(tmp_path), planner=dq.checkpoint.SavePlanner(), no_dist=True)

    resumed = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=2)
    opt2 = make(list(resumed.parameters()))
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opt2)}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=dq.checkpoint.LoadPlanner(), no_dist=True)
    set_model_state_dict(resumed, state["model"])
    # strict=False: plain SGD keeps no state for its dense parameters, which torch's strict check wants
    set_optimizer_state_dict(resumed, opt2, state["optim"], options=StateDictOptions(strict=False))
    _continue(resumed, opt2, 3)
    assert _same_weights(straight, resumed)


def test_resuming_from_a_copy_of_the_live_state():
    """A framework that rebuilds the optimizer's state from its live keys (not state_dict()) resumes exactly."""
    make = OPTIMIZERS["adamw-foreach"]
    straight = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=4)
    _continue(straight, make(list(straight.parameters())), 5)

    first = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=4)
    opt = make(list(first.parameters()))
    _continue(first, opt, 2)
    live = [{k: copy.deepcopy(v) for k, v in opt.state[p].items()} for p in first.parameters()]
    resumed = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=4)
    with torch.no_grad():
        for p, q in zip(first.parameters(), resumed.parameters()):
            q.copy_(p)
    opt2 = make(list(resumed.parameters()))
    for p, saved in zip(resumed.parameters(), live):
        opt2.state[p] = saved
    _continue(resumed, opt2, 3)
    assert _same_weights(straight, resumed)


@pytest.mark.slow
def test_compiled_forward_and_backward_train_like_eager():
    """torch.compile of a model with trainable weights: the forward and backward trace through the quantized weight
    (its kernel or dequantize), the optimizer's in-place updates stay eager. The compiled graph may fuse and reorder
    the float math, so the losses and gradients are compared within a bound, not bit for bit."""

    def run(compiled: bool):
        model = dq.quantize_(mlp(), dq.Int8Rowwise(), trainable=True, seed=1)
        forward = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = data()
        seen = []
        for _ in range(5):
            loss = F.mse_loss(forward(x).float(), y)
            loss.backward()
            seen.append((loss.item(), model[0].weight.grad.float().clone()))
            opt.step()
            opt.zero_grad()
        return seen, model

    eager, _ = run(False)
    compiled, model = run(True)
    assert isinstance(model[0].weight, dq.QuantizedTensor) and model[0].weight.qdata.dtype == torch.int8
    for (loss_e, grad_e), (loss_c, grad_c) in zip(eager, compiled):
        assert loss_c == pytest.approx(loss_e, rel=1e-3)
        torch.testing.assert_close(grad_c, grad_e, rtol=2e-2, atol=1e-3)
    assert compiled[-1][0] < 0.5 * compiled[0][0]


def test_an_optimizer_listing_a_trainable_weight_twice_is_refused_before_any_update():
    """What accelerate's data_ptr-keyed FSDP2 remap leaves (every quantized weight mapped to one): refused."""
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
    dq.quantize_(model, dq.Int8Rowwise(), trainable=True)
    a, b = model[0].weight, model[1].weight
    before = a.qdata.clone()
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], fused=True)
    opt.param_groups[1]["params"] = [a]  # as accelerate's remap assigns them, past torch's own duplicate check
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(ValueError, match=r"2 times .*data_ptr\(\)"):
        opt.step()
    assert torch.equal(a.qdata, before)
