"""formats/block_states: BlockFloat8 and BlockLog4, the optimizer-state formats (AdamW's moments)."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core.format import Reducer
from dtensor_quant._core.stochastic import Noise
from tests.support.format_cases import both_paths


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


def _sweep(top: float) -> torch.Tensor:
    """Float32 values densely across [0, top] (every exponent, many fractions), both signs, rows of 255."""
    bits = torch.arange(0, 0x7F800000, 1021, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = bits[bits <= top]
    x = torch.cat([x, -x])[: x.numel() * 2 // 255 * 255].reshape(-1, 255)
    return torch.cat([torch.full((x.shape[0], 1), top), x], 1)  # each block's maximum is top: the factor is 1


def _with_extremes(x: torch.Tensor) -> torch.Tensor:
    """``x`` with an Inf, a -Inf and a NaN in some vector-width groups and in some scalar tails."""
    x = x.clone()
    x[0, 3], x[1, 260], x[2, 511], x[3, 8:16] = float("inf"), -float("inf"), float("nan"), float("inf")
    return x


@pytest.mark.parametrize("fmt", [dq.BlockFloat8(256), dq.BlockFloat8(256, nonnegative=True)], ids=str)
def test_block_float8_kernels_give_the_torch_bits(monkeypatch, fmt):
    top = 57344.0 if fmt.nonnegative else 448.0
    cases = [
        _sweep(top),  # every rounding case of the code, ties included
        torch.randn(37, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-12, 3, 300),
        torch.tensor([[0.0, -0.0, 1e-30, float("nan"), 3.0], [0.0] * 5, [float("inf"), 1.0, 2.0, 3.0, 4.0]]),
        # subnormal block maxima (rescaled by 2**64), an Inf among zeros, Inf beside NaN and subnormals
        torch.tensor(
            [
                [1e-41, -3e-42, 0.0, 1.4e-45, 5e-40],
                [float("inf"), 0, 0, 0, 0],
                [-float("inf"), 1e-41, float("nan"), 0, 2e-39],
            ]
        ),
        torch.randn(9, 300, generator=torch.Generator().manual_seed(2)) * torch.logspace(-45, -20, 300),
        _with_extremes(torch.randn(6, 512, generator=torch.Generator().manual_seed(6)) * 1e-40),
    ]
    for x in cases:
        x = x.abs() if fmt.nonnegative else x
        noise = Noise(3, 7, tuple(x.shape), (5, 2), (x.shape[0] + 9, x.shape[1] + 4))
        for quantize in (
            lambda x=x: fmt.quantize(x, Reducer(x.shape)),
            lambda x=x, noise=noise: fmt.quantize_stochastic(x, Reducer(x.shape), noise, torch.float32),
        ):
            fast, slow = both_paths(monkeypatch, quantize)
            assert torch.equal(fast["codes"], slow["codes"])
            assert torch.equal(fast["absmax"].view(torch.int32), slow["absmax"].view(torch.int32))
        q = dq.quantize(x, fmt)
        values = both_paths(monkeypatch, lambda q=q: q.dequantize(torch.float32))
        assert torch.equal(values[0].view(torch.int32), values[1].view(torch.int32))


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
