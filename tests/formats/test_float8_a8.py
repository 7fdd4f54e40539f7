"""_formats/float8_a8.cpp: the passes around the product of fp8 activations give the torch path's bits, at every
level here.

The torch path (what runs without the kernel) is ``quantize_activation`` (e4m3 codes per token), the codes' values
through the float8 tiles with unit scales (:func:`float8.fp8_matmul`), then ``scale_output``. The kernel makes the
same codes in one pass (its own e4m3 rounding) and scales the same sums in one pass, so its output must equal that
path bit for bit (NaN as NaN); that path itself is checked against the exact sum within the summation bound in
tests/core/test_activations.py. Levels: 1 plain C++, 2 AVX-512 (the tiles between them run at their own best
level, ``DTENSOR_QUANT_MAX_LEVEL`` capping both), 4 AMX: bf16 activations through stage 3, the whole linear in one
call (fp32 ones through stages 1 and 2 as on level 2).
"""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core import activations, native
from dtensor_quant._formats import float8
from dtensor_quant.testing import weight

pytestmark = pytest.mark.skipif(float8.a8_kernel() is None, reason="no fp8-activation kernel here (no C++ compiler)")

LEVELS = [lvl for lvl in (1, 2, 4) if float8.a8_kernel() and lvl <= float8.a8_kernel()[1]]
FORMATS = [
    dq.Float8Rowwise(activations="fp8-token"),
    dq.Float8Rowwise(torch.bfloat16, activations="fp8-token-per-rank"),
    dq.Float8Tensorwise(activations="fp8-tensor", input_scale=0.01),
]
SHAPES = [(1, 64, 96), (7, 40, 64), (33, 24, 256), (130, 48, 128), (5, 20, 2048), (130, 40, 2048), (20, 36, 2144)]
SHAPES += [(130, 33, 14336)]  # a real model's width (Llama-3-8B's SwiGLU): several column blocks per tile
# tokens, out, in; the last two: AMX (level 4) in two chunks of tokens, in two blocks of columns


def same(got, expected):
    return (
        got.dtype == expected.dtype
        and torch.equal(got.isnan(), expected.isnan())
        and torch.equal(got.nan_to_num(0.0, 1.0, -1.0), expected.nan_to_num(0.0, 1.0, -1.0))
    )


def hostile(x):
    """A NaN row, an Inf row, a zero row and a row of tiny values (e4m3's subnormal codes, fp32 underflow)."""
    x = x.clone()
    if x.shape[0] > 4:
        x[0, 3], x[1, 1], x[2] = float("nan"), float("inf"), 0.0
        x[3] = x[3] * (1e-30 if x.dtype == torch.float32 else 1e-3)
    return x


def torch_path(fmt, x, q, prepared):
    codes, x_scale = activations.quantize_activation(x, fmt.activation_scheme, fmt.input_scale)
    return activations.scale_output(float8.fp8_matmul(codes, prepared[1], x.dtype), x_scale, q.scale, x.dtype)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_is_the_torch_path(level, fmt, shape, dtype):
    tokens, out, inp = shape
    x = hostile((weight((tokens, inp), seed=tokens, dtype=torch.float32) * 3).to(dtype))
    q = dq.quantize(weight((out, inp), seed=out).to(dtype), fmt)
    prepared = fmt.prepare(q.inner)
    # the product's tiles are the float8 kernel's, at DTENSOR_QUANT_MAX_LEVEL on the torch path: the same cap here,
    # so both sum in the same order (AMX and AVX2 tiles differ in the last bit at long rows, in = 14336)
    level = min(level, native.cap())
    got = float8.fp8_native(x, prepared[1], prepared[2][0], fmt.activation_scheme, fmt.input_scale, max_level=level)
    assert got is not None and same(got, torch_path(fmt, x, q, prepared))


@pytest.mark.parametrize("level", LEVELS)
def test_codes_are_e4m3_round_to_nearest_even(level):
    """An identity weight returns each code's value times the scales: every e4m3 value, the midpoints between
    neighbours (ties to even) and points just beside them, at scale 1 (static), in fp32."""
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = table[table.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    row = row[: row.numel() // 64 * 64].reshape(-1, 64)
    fmt = dq.Float8Tensorwise(activations="fp8-tensor", input_scale=1.0)
    q = dq.quantize(torch.eye(64), fmt)
    prepared = fmt.prepare(q.inner)
    got = float8.fp8_native(row, prepared[1], prepared[2][0], fmt.activation_scheme, 1.0, max_level=level)
    assert torch.equal(q.qdata.float(), torch.eye(64) * 448)  # each sum: one code times 448, exact in fp32
    expected = row.to(torch.float8_e4m3fn).float() * 448 * 1.0 * q.scale.float().reshape(1, -1)
    assert same(got, expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("tokens, inp", [(19, 128), (130, 2048)], ids=str)  # 130 x 2048: AMX takes two chunks
def test_given_token_maxima_are_used(level, tokens, inp):
    fmt = dq.Float8Rowwise(activations="fp8-token")
    x = weight((tokens, inp), seed=3).to(torch.bfloat16)
    q = dq.quantize(weight((40, inp), seed=4).to(torch.bfloat16), fmt)
    prepared = fmt.prepare(q.inner)
    wider = x.float().abs().amax(-1, keepdim=True) * 3
    with activations.token_stat_reduction(lambda local: torch.maximum(local, wider)):
        got = float8.fp8_native(x, prepared[1], prepared[2][0], fmt.activation_scheme, None, max_level=level)
        expected = torch_path(fmt, x, q, prepared)
    assert same(got, expected) and not same(got, torch_path(fmt, x, q, prepared))


TILE_LEVELS = [lvl for lvl in (2, 3, 4) if float8.kernel() and lvl <= float8.kernel()[1]]


@pytest.mark.parametrize("level", TILE_LEVELS)
@pytest.mark.parametrize("tokens", [5, 96], ids=str)  # up to DQ_FEW tokens level 3 multiplies rows as they are
@pytest.mark.parametrize("group", [32, 96, 192], ids=str)  # 32-code steps only; 64-code steps and a 32 tail; 64s
def test_unit_scale_tiles_read_every_code_exactly(level, tokens, group):
    """The float8 tiles decode a weight of unit scale (the products fp8 activations make) through their own
    table path: every finite e4m3 code, in every column position of the table path's 64-code steps and 32-code
    tails, in groups of columns whose scales mix 1 and others. One-hot activations make each output one weight,
    so the output is each weight's float(code) * scale rounded to bf16, exactly."""
    gen = torch.Generator().manual_seed(0)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    rows, cols = 40, 192
    codes = finite[torch.randint(0, finite.numel(), (rows, cols), generator=gen)]
    codes[0, : finite.numel() // 4], codes[1, :] = finite[: finite.numel() // 4], finite[-cols:]
    qdata = codes.view(torch.float8_e4m3fn)
    scale = torch.where(torch.rand((rows, cols // group), generator=gen) < 0.6, 1.0, 0.375)
    prepared = float8.kernel_prepare(qdata, scale, group)
    pick = torch.randperm(cols, generator=gen)[:tokens]
    x = torch.eye(cols, dtype=torch.bfloat16)[pick]
    got = float8.tiled_linear(x, prepared, max_level=level)
    expected = (qdata.float() * scale.repeat_interleave(group, dim=1)).to(torch.bfloat16)[:, pick].t()
    assert got is not None and torch.equal(got, expected)


@pytest.mark.skipif(4 not in TILE_LEVELS, reason="no AMX here")
@pytest.mark.parametrize("shape", [(7, 40, 96), (130, 70, 2048), (33, 36, 2144)], ids=str)
def test_unit_scale_amx_path_is_the_general_tiles(shape):
    """Unit scales on AMX take their own loop (_formats/float8_unit.h: other blocking, the next rows decoded under
    every group of tokens); each sum must be the general tiles' bit for bit. The same rows with one extra row of
    scale 2 go through the general tiles (not every scale is 1); each output depends only on its own row."""
    tokens, out, inp = shape
    gen = torch.Generator().manual_seed(tokens)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randint(0, finite.numel(), (out + 1, inp), generator=gen)].view(torch.float8_e4m3fn)
    x = (torch.randn((tokens, inp), generator=gen) * 40).to(torch.float8_e4m3fn).to(torch.bfloat16)
    unit = float8.kernel_prepare(codes[:out], torch.ones((out, 1)), inp)
    mixed = float8.kernel_prepare(codes, torch.cat([torch.ones((out, 1)), torch.full((1, 1), 2.0)]), inp)
    got = float8.tiled_linear(x, unit, max_level=4)
    expected = float8.tiled_linear(x, mixed, max_level=4)[:, :out]
    assert got is not None and torch.equal(got, expected)


@pytest.mark.parametrize("level", [lvl for lvl in LEVELS if lvl >= 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantize_pass_is_quantize_activation(level, dtype):
    """Stage 1 alone on many rows: each value it writes is quantize_activation's code, bit for bit -- rows over a
    wide range of scales, values across e4m3's normal and subnormal steps, and values put on the midpoints of the
    scaled grid (up to the rounding of the product), where a quotient rounded any other way (a reciprocal) would
    round to the other code."""
    gen = torch.Generator().manual_seed(1)
    tokens, k = 512, 256
    x = torch.randn((tokens, k), generator=gen) * torch.exp2(torch.randint(-12, 12, (tokens, 1), generator=gen))
    x = x * torch.exp2(torch.randint(-8, 1, (tokens, k), generator=gen).float())
    amax = x.abs().amax(-1, keepdim=True)
    grid = torch.tensor([c for c in range(127) if c & 0x7F != 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)
    mids = ((grid.float()[1:] + grid.float()[:-1]) / 2)[torch.randint(0, grid.numel() - 1, (tokens, 8), generator=gen)]
    x[:, :8] = mids * (amax / 448)  # midpoints once scaled back, up to the rounding of the product
    x = x.to(dtype)
    scheme = activations.SCHEMES["fp8-token"]
    codes, x_scale = activations.quantize_activation(x, scheme, None)
    run, _ = float8.a8_kernel()
    values, got_scale = torch.empty_like(x), torch.empty((tokens, 1))
    ran, e = torch.empty(1, dtype=torch.int64), torch.empty(0)
    flags = 1 if dtype == torch.float32 else 0
    run(x, e, torch.ones(1), values, got_scale, e, e, tokens, 1, k, 1, flags, level, 1, ran)
    assert ran.item() == min(level, 4) and torch.equal(got_scale, x_scale)
    assert torch.equal(values, codes.to(dtype))


@pytest.mark.parametrize("level", LEVELS)
def test_outputs_at_bf16s_edges(level):
    """Products that round to bf16's subnormals, overflow to Inf, or stay at its largest values: stage 3 rounds the
    products with vcvtne2ps2bf16 except where a lane is one it would not round as the torch path does."""
    fmt = dq.Float8Rowwise(activations="fp8-token")
    x = (weight((40, 64), seed=5) * 4).to(torch.bfloat16)
    x[0] *= 1e-39  # with rows 0-15: subnormal products
    x[1] *= 1e10  # with rows 16-19: beyond bf16's largest
    w = weight((48, 64), seed=6)
    w[:16] *= 1e-2
    w[16:20] *= 1e30
    w[20:24] *= 1e28  # near bf16's largest
    q = dq.quantize(w.to(torch.bfloat16), fmt)
    prepared = fmt.prepare(q.inner)
    got = float8.fp8_native(x, prepared[1], prepared[2][0], fmt.activation_scheme, None, max_level=level)
    expected = torch_path(fmt, x, q, prepared)
    tiny = torch.finfo(torch.bfloat16).tiny
    assert (expected[0, :16].abs() < tiny).all() and (expected[0, :16] != 0).any() and expected[1, 16:20].isinf().all()
    assert got is not None and same(got, expected)
