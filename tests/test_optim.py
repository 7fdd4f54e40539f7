"""dq.optim on one process: quantized AdamW moments, against torch.optim.AdamW and by hand.

The distributed side (states as DTensors, every placement, DCP resharding) is
tests/distributed/test_optim_states.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtensor_quant as dq
from dtensor_quant.core.format import Reducer


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
    assert big["exp_avg_sq"].fmt == dq.BlockFloat8(256, sqrt=True) and big["exp_avg"].dtype == torch.bfloat16
    assert type(bias["exp_avg"]) is torch.Tensor and bias["exp_avg"].dtype == torch.bfloat16  # 1-D: dense
    small = dq.optim.AdamW8bit(m.parameters(), lr=1e-3, min_quantized_numel=10**6)
    train(m, small, 1)
    assert type(small.state[m[0].weight]["exp_avg"]) is torch.Tensor


def test_one_step_by_hand():
    """After one step the moments are exactly the format's quantization of AdamW's, and the update uses them."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 512))
    w.grad = torch.randn(16, 512)
    start = w.detach().clone()
    fm, fv = dq.BlockFloat8(128), dq.BlockFloat8(128, sqrt=True)
    opt = dq.optim.AdamW([w], lr=0.1, weight_decay=0.5, state_formats=(fm, fv), min_quantized_numel=1)
    opt.step()
    g = w.grad
    m_q, v_q = dq.quantize(0.1 * g, fm), dq.quantize(0.001 * g * g, fv)
    state = opt.state[w]
    assert torch.equal(state["exp_avg"].codes, m_q.codes) and torch.equal(state["exp_avg"].absmax, m_q.absmax)
    assert torch.equal(state["exp_avg_sq"].codes, v_q.codes)
    m, v = m_q.dequantize(), v_q.dequantize()  # the step reads the moments through their float32 values
    expected = start * (1 - 0.1 * 0.5) - 0.1 / 0.1 * (0.1 * g) / ((0.001 * g * g).sqrt() / 0.001**0.5 + 1e-8)
    with_quantized = start * (1 - 0.05) - (0.1 / 0.1) * m / (v.sqrt() / 0.001**0.5 + 1e-8)
    torch.testing.assert_close(w.detach(), with_quantized, rtol=1e-6, atol=1e-6)
    assert (w.detach() - expected).abs().max() < 0.1  # the quantized moments are close to the exact ones


def test_a_state_format_of_the_users_choice():
    """Any QuantFormat holds a moment: here Int8Rowwise (a scale per row) for the first one."""
    m = model()
    opt = dq.optim.AdamW(m.parameters(), lr=2e-3, state_formats=(dq.Int8Rowwise(), dq.BlockLog4(64, sqrt=True)))
    losses = train(m, opt, 60)
    assert isinstance(opt.state[m[0].weight]["exp_avg"], dq.QuantizedTensor)
    assert opt.state[m[0].weight]["exp_avg"].fmt == dq.Int8Rowwise()
    assert tail(losses) < 0.7 * losses[0]


def test_trainable_int8_weights_with_8bit_states():
    m = dq.quantize_(model(), dq.Int8Rowwise(), trainable=True, seed=1)
    opt = dq.optim.AdamW8bit(m.parameters(), lr=2e-3)
    losses = train(m, opt, 60)
    assert isinstance(m[0].weight, dq.QuantizedTensor) and tail(losses) < 0.7 * losses[0]
    assert dq.trainable.resolve(m[0].weight).state.step == 60  # one stochastic requantization per step


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


@pytest.mark.parametrize(
    "fmt", [dq.BlockFloat8(), dq.BlockFloat8(64, sqrt=True), dq.BlockLog4(), dq.BlockLog4(32, sqrt=True)], ids=str
)
@pytest.mark.parametrize("width", [1024, 1000])  # whole blocks (the fast unpack) and a partial last block
def test_state_formats(fmt, width):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, width, generator=g) * torch.logspace(-3, 0, width)  # magnitudes over 3 decades
    if fmt.sqrt:
        x = x * x
    q = dq.quantize(x, fmt)
    d = q.dequantize(torch.float32)
    general = fmt.dequantize({"codes": q.codes, "absmax": q.absmax.repeat_interleave(fmt.block_size, 1)[:, :width]},
                             torch.float32)  # fmt: skip
    assert torch.equal(d, general)  # unpack (or its absence) gives dequantize's bits
    rel = ((d - x).abs() / x.abs()).median()
    assert rel < (0.05 if isinstance(fmt, dq.BlockFloat8) else 0.25), rel
    if fmt.sqrt:
        assert (d > 0).all()  # a second moment is never coded as zero
    assert q.absmax.dtype == torch.float32 and q.absmax.shape == (8, -(-width // fmt.block_size))
    zeros = dq.quantize(torch.zeros(4, width), fmt)
    assert torch.equal(zeros.dequantize(torch.float32), torch.zeros(4, width))


def test_block_log4_needs_an_even_width():
    with pytest.raises(ValueError, match="width 33"):
        dq.quantize(torch.randn(4, 33), dq.BlockLog4(32))


def test_block_float8_codes_are_nearest():
    """BlockFloat8 rounds each value to the nearest e4m3 code of its block's scale."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    inner = dq.BlockFloat8().quantize(x, Reducer(x.shape))
    scale = inner["absmax"] / 448
    expected = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(inner["codes"], expected)
