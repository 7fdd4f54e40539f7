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
from dtensor_quant.core.stochastic import Noise


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
    "fmt",
    [dq.BlockFloat8(), dq.BlockFloat8(64, nonnegative=True), dq.BlockLog4(), dq.BlockLog4(32, nonnegative=True)],
    ids=str,
)
@pytest.mark.parametrize("width", [1024, 1000])  # whole blocks (the fast unpack) and a partial last block
def test_state_formats(fmt, width):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, width, generator=g) * torch.logspace(-3, 0, width)  # magnitudes over 3 decades
    if fmt.nonnegative:
        x = x * x
    q = dq.quantize(x, fmt)
    d = q.dequantize(torch.float32)
    general = fmt.dequantize({"codes": q.codes, "absmax": q.absmax.repeat_interleave(fmt.block_size, 1)[:, :width]},
                             torch.float32)  # fmt: skip
    assert torch.equal(d, general)  # unpack (or its absence) gives dequantize's bits
    rel = ((d - x).abs() / x.abs()).median()
    assert rel < (0.1 if isinstance(fmt, dq.BlockFloat8) else 0.3), rel
    if fmt.nonnegative:
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
    scale = inner["absmax"].repeat_interleave(256, 1) / 448
    expected = (x / scale).to(torch.float8_e4m3fn).float() * scale
    actual = dq.BlockFloat8().dequantize({"codes": inner["codes"], "absmax": scale * 448}, torch.float32)
    torch.testing.assert_close(actual, expected, rtol=2**-23, atol=0)  # 448 / absmax is computed once per block


def _both_paths(monkeypatch, fn):
    """``fn()`` with the C++ kernels, then with the torch expressions (DTENSOR_QUANT_NATIVE=0)."""
    fast = fn()
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "0")
    slow = fn()
    monkeypatch.delenv("DTENSOR_QUANT_NATIVE")
    return fast, slow


def _sweep(top: float) -> torch.Tensor:
    """Float32 values densely across [0, top] (every exponent, many fractions), both signs, rows of 255."""
    bits = torch.arange(0, 0x7F800000, 1021, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = bits[bits <= top]
    x = torch.cat([x, -x])[: x.numel() * 2 // 255 * 255].reshape(-1, 255)
    return torch.cat([torch.full((x.shape[0], 1), top), x], 1)  # each block's maximum is top: the factor is 1


@pytest.mark.parametrize("fmt", [dq.BlockFloat8(256), dq.BlockFloat8(256, nonnegative=True)], ids=str)
def test_block_float8_kernels_give_the_torch_bits(monkeypatch, fmt):
    top = 57344.0 if fmt.nonnegative else 448.0
    cases = [
        _sweep(top),  # every rounding case of the code, ties included
        torch.randn(37, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-12, 3, 300),
        torch.tensor([[0.0, -0.0, 1e-30, float("nan"), 3.0], [0.0] * 5, [float("inf"), 1.0, 2.0, 3.0, 4.0]]),
    ]
    for x in cases:
        x = x.abs() if fmt.nonnegative else x
        noise = Noise(3, 7, tuple(x.shape), (5, 2), (x.shape[0] + 9, x.shape[1] + 4))
        for quantize in (
            lambda x=x: fmt.quantize(x, Reducer(x.shape)),
            lambda x=x, noise=noise: fmt.quantize_stochastic(x, Reducer(x.shape), noise, torch.float32),
        ):
            fast, slow = _both_paths(monkeypatch, quantize)
            assert torch.equal(fast["codes"], slow["codes"])
            assert torch.equal(fast["absmax"].view(torch.int32), slow["absmax"].view(torch.int32))
        q = dq.quantize(x, fmt)
        values = _both_paths(monkeypatch, lambda q=q: q.dequantize(torch.float32))
        assert torch.equal(values[0].view(torch.int32), values[1].view(torch.int32))


def test_int8_stochastic_kernel_gives_the_torch_bits(monkeypatch):
    w = torch.randn(300, 517, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 517)
    for offsets, whole in [((0, 0), (300, 517)), ((7, 11), (900, 600)), ((10**6, 3), (10**7, 600))]:
        noise = Noise(5, 9, tuple(w.shape), offsets, whole)
        fast, slow = _both_paths(
            monkeypatch, lambda n=noise: dq.Int8Rowwise().quantize_stochastic(w, Reducer(w.shape), n, torch.bfloat16)
        )
        assert torch.equal(fast["qdata"], slow["qdata"]) and torch.equal(fast["scale"], slow["scale"])
    w[3, 5], w[4] = float("nan"), 0.0  # a NaN row and a zero row: the row maxima and dense values as torch's
    q = dq.quantize(w.bfloat16(), dq.Int8Rowwise())
    for fn in (lambda: q.dequantize(torch.float32), lambda: dq.quantize(w, dq.Int8Rowwise()).scale):
        fast, slow = _both_paths(monkeypatch, fn)
        assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))


@pytest.mark.parametrize(
    "fmt", [dq.BlockFloat8(64), dq.BlockFloat8(64, nonnegative=True), dq.BlockLog4(64), dq.BlockLog4(64, True)], ids=str
)
def test_state_formats_round_stochastically_without_bias(fmt):
    g = torch.Generator().manual_seed(4)
    x = torch.rand(16, 256, generator=g) * torch.logspace(-3, 0, 256)
    x = x if fmt.nonnegative else x * torch.sign(torch.randn(16, 256, generator=g))
    mean = (
        sum(
            dq.quantize(x, fmt).fmt.dequantize(
                _as_broadcast(
                    fmt,
                    fmt.quantize_stochastic(
                        x, Reducer(x.shape), Noise.of(torch.rand(x.shape, generator=g)), torch.float32
                    ),
                ),
                torch.float32,
            )
            for _ in range(200)
        )
        / 200
    )
    nearest = dq.quantize(x, fmt).dequantize(torch.float32)
    inside = x.abs() >= x.abs().amax() * (2.0**-6 if isinstance(fmt, dq.BlockLog4) else 2.0**-8)  # above the floor
    assert ((mean - x)[inside].abs().mean()) < 0.25 * ((nearest - x)[inside].abs().mean())


def _as_broadcast(fmt, inner):
    """The inner tensors as a format's dequantize receives them: the block maxima repeated per element."""
    return {"codes": inner["codes"], "absmax": inner["absmax"].repeat_interleave(fmt.block_size, 1)}


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
    assert dq.trainable.resolve(m[0].weight).state.step == 30 and tail(losses) < 0.8 * losses[0]
