"""optim/adamw on one process: quantized AdamW moments, against torch.optim.AdamW and by hand.

The distributed side (states as DTensors, every placement, DCP resharding) is
tests/distributed/optim/test_adamw.py.
"""

import copy
import json
import math

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


# -- gradients at float32's extremes: the quantized moments stay finite where torch's dense ones do ----------------

_LOW_BIT = [(dq.optim.AdamW8bit, 256), (dq.optim.AdamW4bit, 128)]  # the class and its default block size


def _run(cls, grads, **kw) -> torch.Tensor:
    """The weight after one step per gradient, from the same start, with ``cls`` (an optimizer class)."""
    p = nn.Parameter(torch.randn(16, 512, generator=torch.Generator().manual_seed(0)))
    opt = cls([p], lr=1e-3, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _grads(scale: float, steps: int = 4) -> list[torch.Tensor]:
    """Gradients of magnitude 0.5 to 1.5 times ``scale``, random signs (none so small that its square underflows
    where its scale's does not)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(16, 512, generator=g) + 0.5) * torch.randn(16, 512, generator=g).sign() * scale
            for _ in range(steps)]  # fmt: skip


@pytest.mark.parametrize("cls,block", _LOW_BIT, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_gradient_whose_square_overflows_leaves_every_other_block_as_it_was(cls, block):
    """Before: one gradient of 1e30 (its square overflows float32) turned its whole block of weights NaN with
    AdamW8bit (the block maximum Inf, then Inf / Inf). Now the blocks are independent of it, bit for bit, and its
    own block stays finite, as torch.optim.AdamW's weights do."""
    grads = _grads(1e-3)
    hostile = [g.clone() for g in grads]
    hostile[1][3, 70] = 1e30
    ours, clean, dense = _run(cls, hostile), _run(cls, grads), _run(torch.optim.AdamW, hostile)
    assert dense.isfinite().all() and ours.isfinite().all()
    outside = torch.ones_like(ours, dtype=torch.bool)
    outside[3, 70 // block * block : (70 // block + 1) * block] = False
    assert torch.equal(ours[outside], clean[outside])
    if cls is dq.optim.AdamW8bit:  # e5m2 keeps the second moment's Inf: the element takes no step, as torch's
        torch.testing.assert_close(ours[3, 70], dense[3, 70])


@pytest.mark.parametrize("cls,block", _LOW_BIT, ids=lambda v: getattr(v, "__name__", str(v)))
def test_gradients_of_1e_19_train_like_gradients_of_1(cls, block):
    """Before: gradients of ~1e-19 (second moments ~1e-41, subnormal) turned most AdamW8bit weights NaN (448 /
    absmax overflowed). Adam (eps=0) and the block formats are scale-invariant, so a run on gradients times 2**-64
    must be as close to torch.optim.AdamW's as the same run on the gradients themselves (the subnormal second
    moments lose a few bits in float32 itself, torch's too, so not bit-exact: 10% allowed for that)."""
    grads = _grads(1.0)
    tiny = [g * 2.0**-64 for g in grads]  # ~5e-20: the squares are ~3e-39, the second moments ~3e-42
    assert all((1 - 0.999) * (g * g).amin() > 0 for g in tiny)  # subnormal, never zero
    assert all((1 - 0.999) * (g * g).amax() < torch.finfo(torch.float32).tiny for g in tiny)
    err = {}
    for name, gs in (("tiny", tiny), ("unit", grads)):
        ours, dense = _run(cls, gs, eps=0.0), _run(torch.optim.AdamW, gs, eps=0.0)
        assert ours.isfinite().all() and dense.isfinite().all()
        err[name] = (ours - dense).abs().amax().item()
    assert err["tiny"] <= 1.1 * err["unit"], err  # up to the rounding of subnormal second moments


# -- state dicts across state formats and thresholds ---------------------------------------------

STATE_CONFIGS = {
    "dense": dict(state_formats=(None, None)),
    "8bit": dict(state_formats=(dq.BlockFloat8(256), dq.BlockFloat8(256, nonnegative=True))),
    "4bit": dict(state_formats=(dq.BlockLog4(128), dq.BlockLog4(128, nonnegative=True))),
    "8bit-kept-dense": dict(  # the threshold keeps every moment dense
        state_formats=(dq.BlockFloat8(256), dq.BlockFloat8(256, nonnegative=True)), min_quantized_numel=10**6
    ),
    "8bit-64": dict(state_formats=(dq.BlockFloat8(64), dq.BlockLog4(64, nonnegative=True)), min_quantized_numel=1),
}


def _values(state: torch.Tensor) -> torch.Tensor:
    return state.dequantize(torch.float32) if isinstance(state, dq.QuantizedTensor) else state.float()


@pytest.mark.parametrize("dst", list(STATE_CONFIGS))
@pytest.mark.parametrize("src", list(STATE_CONFIGS))
def test_state_dicts_load_across_state_formats_and_thresholds(src, dst):
    """Saved in one optimizer's state formats, loaded into another's: the same format gives the stored bytes;
    another gives the saved values stored in the loading optimizer's format (what its step does to a moment:
    read as float32, write back in its format); then training goes on."""
    m = model()
    saver = dq.optim.AdamW(m.parameters(), lr=2e-3, **STATE_CONFIGS[src])
    train(m, saver, 2)
    saved = copy.deepcopy(saver.state_dict())
    loader = dq.optim.AdamW(m.parameters(), lr=2e-3, **STATE_CONFIGS[dst])
    loader.load_state_dict(saved)
    for p in m.parameters():
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), loader.state_formats):
            was, got = saver.state[p][key], loader.state[p][key]
            if not loader.quantizes(p, fmt):
                assert type(got) is torch.Tensor and got.dtype == p.dtype
                assert torch.equal(got, _values(was).to(p.dtype)), (key, p.shape)
            elif isinstance(was, dq.QuantizedTensor) and was.fmt == fmt:
                assert all(torch.equal(getattr(got, n), getattr(was, n)) for n in fmt.inner_names)
            else:
                expected = dq.quantize(_values(was).to(p.dtype), fmt)
                assert got.fmt == fmt and all(
                    torch.equal(getattr(got, n), getattr(expected, n)) for n in fmt.inner_names
                )
    losses = train(m, loader, 2, first=2)
    assert all(math.isfinite(x) for x in losses)


def test_a_moment_that_does_not_fit_is_refused_naming_the_parameter():
    m = model()
    opt = dq.optim.AdamW8bit(m.parameters(), lr=2e-3)
    train(m, opt, 1)
    other = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64)).bfloat16()
    saved = copy.deepcopy(opt.state_dict())
    for config in ("8bit", "dense", "8bit-kept-dense"):
        with pytest.raises(
            dq.checkpoint.CheckpointFormatError, match=r"'exp_avg' of parameter 0 \(shape \(128, 128\)\)"
        ):
            dq.optim.AdamW(other.parameters(), **STATE_CONFIGS[config]).load_state_dict(copy.deepcopy(saved))
    unknown = copy.deepcopy(saved)
    record = json.loads(unknown["state"][0]["exp_avg"]["__quant__"])
    unknown["state"][0]["exp_avg"]["__quant__"] = json.dumps(dict(record, format="NotAFormat"))
    with pytest.raises(dq.checkpoint.CheckpointFormatError, match=r"'exp_avg' of parameter 0 .*NotAFormat"):
        dq.optim.AdamW4bit(m.parameters()).load_state_dict(unknown)


# -- per-group options ----------------------------------------------------------------------


def test_a_param_groups_block_size_gives_the_moments_of_that_block_size():
    torch.manual_seed(1)
    w, g = torch.randn(64, 256), torch.randn(64, 256)
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    grouped = dq.optim.AdamW8bit([{"params": [a], "block_size": 64}], min_quantized_numel=1024)
    plain = dq.optim.AdamW8bit([b], block_size=64, min_quantized_numel=1024)
    for p, opt in ((a, grouped), (b, plain)):
        p.grad = g.clone()
        opt.step()
    assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq"):
        x, y = grouped.state[a][key], plain.state[b][key]
        assert all(torch.equal(getattr(x, n), getattr(y, n)) for n in x.fmt.inner_names)


@pytest.mark.parametrize(
    "group, match",
    [
        ({"amsgrad": True}, "amsgrad=True is not supported"),
        ({"momentum": 0.9}, r"\['momentum'\] are not options"),
        ({"state_formats": (None, None)}, r"\['state_formats'\] are not options"),  # AdamW8bit: block_size
    ],
)
def test_param_group_options_that_would_be_ignored_are_refused(group, match):
    with pytest.raises(ValueError, match=match):
        dq.optim.AdamW8bit([{"params": [nn.Parameter(torch.randn(8, 8))], **group}])


def test_adamw_takes_state_formats_per_group():
    a, b = nn.Parameter(torch.randn(64, 256)), nn.Parameter(torch.randn(64, 256))
    opt = dq.optim.AdamW([{"params": [a], "state_formats": (None, None)}, {"params": [b]}], min_quantized_numel=1024)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    assert not isinstance(opt.state[a]["exp_avg"], dq.QuantizedTensor)
    assert isinstance(opt.state[b]["exp_avg"], dq.QuantizedTensor)


def test_dcp_checkpoint_of_dense_moments_loads_into_8bit_ones(tmp_path):
    """Through dq.checkpoint: dense moments (a threshold that kept them dense) into AdamW8bit load, stored in its
    format; 8-bit moments into an optimizer that keeps them dense are refused naming the state (a stored
    quantized moment is never silently dequantized by the checkpoint's own check)."""
    m = model()
    dense = dq.optim.AdamW(m.parameters(), lr=2e-3, **STATE_CONFIGS["8bit-kept-dense"])
    train(m, dense, 2)
    dq.checkpoint.save({"optim": dense.state_dict()}, str(tmp_path / "dense"))
    eight = dq.optim.AdamW8bit(m.parameters(), lr=2e-3)
    train(m, eight, 1)  # states exist: the state dict to load into
    sd = {"optim": eight.state_dict()}
    # strict=False: AdamW8bit's groups have a key AdamW's have not (block_size); the loader keeps its own
    dq.checkpoint.load(sd, str(tmp_path / "dense"), strict=False)
    eight.load_state_dict(sd["optim"])
    w = m[0].weight
    expected = dq.quantize(dense.state[w]["exp_avg"].float().to(w.dtype), eight.state_formats[0])
    assert torch.equal(eight.state[w]["exp_avg"].codes, expected.codes)
    dq.checkpoint.save({"optim": eight.state_dict()}, str(tmp_path / "eight"))
    with pytest.raises(dq.checkpoint.CheckpointFormatError, match=r"optim\.state\.0\.exp_avg"):
        dq.checkpoint.load({"optim": dense.state_dict()}, str(tmp_path / "eight"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(weight_decay=-1), "weight_decay=-1"),  # before: accepted (torch's AdamW refuses it)
        (dict(lr="1e-3"), "lr='1e-3'"),  # before: TypeError from a comparison
        (dict(betas=(0.9,)), r"betas=\(0.9,\)"),
        (dict(min_quantized_numel=-1), "min_quantized_numel"),  # before: accepted
        (dict(state_formats="int8"), "state_formats is a pair"),  # before: "one format per moment (2), got 4"
        (dict(state_formats=("int8", None)), "a format instance or None"),
    ],
)
def test_bad_hyperparameters_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dq.optim.AdamW([nn.Parameter(torch.randn(64, 64))], **kwargs)


def test_complex_parameters_are_refused_and_float64_ones_train():
    """Before: a complex parameter trained silently wrong (its gradient read as float32 dropped the imaginary part:
    3.2 off torch's AdamW after 3 steps). float64 parameters keep their quantized moments (computed in float32),
    within the moments' rounding of torch's AdamW."""
    with pytest.raises(ValueError, match="complex parameters"):
        dq.optim.AdamW8bit([nn.Parameter(torch.randn(64, 64, dtype=torch.complex64))])
    for cls in (dq.optim.AdamW8bit, dq.optim.AdamW4bit):
        ours = nn.Parameter(torch.randn(128, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
        ref = nn.Parameter(ours.detach().clone())
        opt, torch_opt = cls([ours], min_quantized_numel=0), torch.optim.AdamW([ref])
        ours.grad = ref.grad = torch.randn(128, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        opt.step()
        torch_opt.step()
        assert isinstance(opt.state[ours]["exp_avg"], dq.QuantizedTensor) and ours.dtype == torch.float64
        # one step: |update| <= lr for both; the moments' rounding moves ours by at most 2 lr
        assert float((ours - ref).abs().max()) <= 2 * 1e-3
