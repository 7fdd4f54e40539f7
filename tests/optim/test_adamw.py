"""optim/adamw on one process: quantized AdamW moments, against torch.optim.AdamW and by hand.

The distributed side (states as DTensors, every placement, DCP resharding) is
tests/distributed/optim/test_adamw.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtensor_quant as dq
from dtensor_quant._core.format import Reducer
from dtensor_quant._core.stochastic import Noise


def model(dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64)).to(dtype)


def batch(i: int):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(64, 128, generator=g)
    teacher = torch.randn(128, 64, generator=torch.Generator().manual_seed(99)) / 128**0.5
    return x.bfloat16(), torch.tanh(x @ teacher)


def train(m, opt, steps: int, first: int = 0) -> list[float]:
    losses = []
    for i in range(first, first + steps):
        x, y = batch(i % 16)
        loss = F.mse_loss(m(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def tail(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


def test_adamw8bit_trains_like_torch_adamw():
    reference = train(m := model(), torch.optim.AdamW(m.parameters(), lr=2e-3), 60)
    got = train(m := model(), dq.optim.AdamW8bit(m.parameters(), lr=2e-3), 60)
    assert tail(got) == pytest.approx(tail(reference), rel=0.02), (tail(got), tail(reference))
    four = train(m := model(), dq.optim.AdamW4bit(m.parameters(), lr=2e-3), 60)
    assert tail(four) < 0.5 * four[0]  # 4-bit moments learn too (their accuracy is the bench's business)


def test_which_states_are_quantized_follows_the_global_shape():
    m = model()
    opt = dq.optim.AdamW8bit(m.parameters(), lr=1e-3)
    train(m, opt, 1)
    big, bias = opt.state[m[0].weight], opt.state[m[0].bias]
    assert isinstance(big["exp_avg"], dq.QuantizedTensor) and big["exp_avg"].fmt == dq.BlockFloat8(256)
    assert big["exp_avg_sq"].fmt == dq.BlockFloat8(256, nonnegative=True) and big["exp_avg"].dtype == torch.bfloat16
    assert type(bias["exp_avg"]) is torch.Tensor and bias["exp_avg"].dtype == torch.bfloat16  # 1-D: dense
    small = dq.optim.AdamW8bit(m.parameters(), lr=1e-3, min_quantized_numel=10**6)
    train(m, small, 1)
    assert type(small.state[m[0].weight]["exp_avg"]) is torch.Tensor


def test_one_step_by_hand():
    """After one step the moments are the format's quantization of AdamW's; the update uses their exact values."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 512))
    w.grad = torch.randn(16, 512)
    start = w.detach().clone()
    fm, fv = dq.BlockFloat8(128), dq.BlockFloat8(128, nonnegative=True)
    opt = dq.optim.AdamW([w], lr=0.1, weight_decay=0.5, state_formats=(fm, fv), min_quantized_numel=1)
    opt.step()
    g = w.grad
    # each moment is the format's stochastic rounding with its own seed, at step 1, keyed by the global index
    for (key, fmt, exact), seed in zip(
        [("exp_avg", fm, 0.1 * g), ("exp_avg_sq", fv, 0.001 * g * g)], opt.moment_seeds(0)
    ):
        expected = fmt.quantize_stochastic(
            exact, Reducer(exact.shape), Noise(seed, 1, (16, 512), (0, 0), (16, 512)), w.dtype
        )
        state = opt.state[w][key]
        assert torch.equal(state.codes, expected["codes"]) and torch.equal(state.absmax, expected["absmax"])
    # AdamW's step from this step's moments (before they are stored in 8 bits), as torch.optim.AdamW computes it
    m, v = 0.1 * g, 0.001 * g * g
    expected = start * (1 - 0.1 * 0.5) - (0.1 / 0.1) * m / (v.sqrt() / 0.001**0.5 + 1e-8)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-6)


def test_a_state_format_of_the_users_choice():
    """Any QuantFormat holds a moment: here Int8Rowwise (a scale per row) for the first one."""
    m = model()
    opt = dq.optim.AdamW(m.parameters(), lr=2e-3, state_formats=(dq.Int8Rowwise(), dq.BlockLog4(64, nonnegative=True)))
    losses = train(m, opt, 60)
    assert isinstance(opt.state[m[0].weight]["exp_avg"], dq.QuantizedTensor)
    assert opt.state[m[0].weight]["exp_avg"].fmt == dq.Int8Rowwise()
    assert tail(losses) < 0.7 * losses[0]


def test_trainable_int8_weights_with_8bit_states():
    m = dq.quantize_(model(), dq.Int8Rowwise(), trainable=True, seed=1)
    opt = dq.optim.AdamW8bit(m.parameters(), lr=2e-3)
    losses = train(m, opt, 60)
    assert isinstance(m[0].weight, dq.QuantizedTensor) and tail(losses) < 0.7 * losses[0]
    assert dq.training.resolve(m[0].weight).state.step == 60  # one stochastic requantization per step


def test_state_dict_round_trip_continues_bit_exactly():
    def run(first_half_only=False):
        m = dq.quantize_(model(), dq.Int8Rowwise(), trainable=True, seed=1)
        opt = dq.optim.AdamW8bit(m.parameters(), lr=2e-3)
        train(m, opt, 5)
        return m, opt

    straight, opt = run()
    train(straight, opt, 5, first=5)

    half, opt_half = run()
    model_sd, optim_sd = copy.deepcopy(half.state_dict()), copy.deepcopy(opt_half.state_dict())
    entry = optim_sd["state"][0]["exp_avg"]  # a quantized moment in its checkpoint form
    assert set(entry) == {"codes", "absmax", "__quant__"} and entry["codes"].dtype == torch.uint8
    assert optim_sd["state"][0]["sr_step"] == 5

    resumed = dq.quantize_(model(), dq.Int8Rowwise(), trainable=True, seed=1)
    resumed.load_state_dict(model_sd)
    opt2 = dq.optim.AdamW8bit(resumed.parameters(), lr=2e-3)
    opt2.load_state_dict(optim_sd)
    assert isinstance(opt2.state[resumed[0].weight]["exp_avg"], dq.QuantizedTensor)
    train(resumed, opt2, 5, first=5)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        if isinstance(p, dq.QuantizedTensor):
            assert torch.equal(p.qdata, q.qdata) and torch.equal(p.scale, q.scale)
        else:
            assert torch.equal(p, q)


def test_frozen_quantized_parameters_are_refused():
    m = dq.quantize_(model(), dq.Int8Rowwise())
    m[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen quantized parameter"):
        dq.optim.AdamW8bit(m.parameters())


# -- the state formats ----------------------------------------------------------------------


def test_moments_are_unbiased_over_many_steps():
    """A moving average whose steps are smaller than a code's gap keeps moving (stochastic rounding), unbiased."""
    torch.manual_seed(0)
    scale = torch.logspace(-2, 0, 256)
    p = nn.Parameter(torch.zeros(32, 256))
    opt = dq.optim.AdamW8bit([p], lr=0.0, min_quantized_numel=1)
    v_exact = torch.zeros(32, 256)
    for _ in range(300):
        p.grad = torch.randn(32, 256) * scale
        opt.step()
        v_exact = 0.999 * v_exact + 0.001 * p.grad * p.grad
    ratio = opt.state[p]["exp_avg_sq"].dequantize(torch.float32) / v_exact
    assert abs(ratio.mean().item() - 1) < 0.01


def test_dense_moments_and_one_requantization_per_step():
    """``state_formats=(None, None)``: dense moments in the parameter's dtype; int8 weights requantized once a step."""
    m = dq.quantize_(model(), dq.Int8Rowwise(), trainable=True, seed=1)
    opt = dq.optim.AdamW(m.parameters(), lr=2e-3, state_formats=(None, None))
    losses = train(m, opt, 30)
    state = opt.state[m[0].weight]
    assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].dtype == torch.bfloat16
    assert dq.training.resolve(m[0].weight).state.step == 30 and tail(losses) < 0.8 * losses[0]
