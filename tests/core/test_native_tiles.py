"""core/native_tiles.h: the multi-token kernels, with each format's rows: exact weights, sums within their bound.

A one-hot activation row ``e_k`` makes a kernel return column ``k`` of the
weight it used: the fp32 sum of one product by 1 and zeros, rounded to the
activation's dtype, which the weight already is. Comparing those columns with
``dequantize`` checks every weight the kernel made bit for bit, at real widths
(TinyLlama's 2048 and 5632, Llama-3-8B's 14336) with few rows, on every vector
path of this CPU (1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX -- forced lower
with ``max_level``), for bf16 and fp32 weights and activations. Random activations
are then compared with dequantize + mm within the bound of an fp32 sum in
another order (never bit for bit: the order differs).
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._core import native
from dtensor_quant._formats import float8, int4, int4_zero, int8, mxfp4, nf4
from dtensor_quant.testing import weight

FORMATS = [
    dq.NF4(),
    dq.BnbNF4(),
    dq.NF4BlockScales(),
    dq.NF4BlockScales(levels="torchao"),
    dq.MXFP4(),
    dq.Float8Rowwise(),
    dq.Float8Rowwise(scale_dtype=torch.bfloat16),
    dq.Float8Tensorwise(),
    dq.Float8Blockwise(128),
    dq.Int4Groupwise(128),
    dq.Int4Groupwise(32, scale_dtype=torch.bfloat16),
    dq.Int4GroupwiseIntZero(128),
    dq.Int4GroupwiseIntZero(128, scale_dtype=torch.float16),
    dq.Int8Rowwise(),
    dq.Int8Rowwise(scale_dtype=torch.bfloat16),
]
# Rows not a multiple of the 32-row tile; K past one 2048-column block (14336: slow, more than 128 one-hot tokens);
# 2176 = 4 * 512 + 128: AMX's last block of columns a short one.
SHAPES = [(40, 2048), (33, 5632), (17, 2176), pytest.param((24, 14336), marks=pytest.mark.slow, id="(24, 14336)")]


def module_of(fmt):
    if isinstance(fmt, (dq.NF4, dq.BnbNF4, dq.NF4BlockScales, dq.MXFP4)):
        return nf4  # BnbNF4 and MXFP4 run NF4's kernels
    if isinstance(fmt, dq.Int4GroupwiseIntZero):
        return int4_zero
    if isinstance(fmt, dq.Int4Groupwise):
        return int4
    if isinstance(fmt, dq.Int8Rowwise):
        return int8
    return float8


def available(fmt) -> bool:
    return module_of(fmt).kernel() is not None


pytestmark = pytest.mark.skipif(
    not all(available(f) for f in FORMATS), reason="no tiled kernels here (no C++ compiler for inductor, or no AVX2)"
)


def tile_inputs(q):
    """The tiled kernel's inputs from the format's ``prepare`` (the same the library's linear uses)."""
    prepared = q.fmt.prepare(q.inner)
    if isinstance(q.fmt, dq.Int4Groupwise):
        return prepared[1].get()
    if isinstance(q.fmt, dq.Int8Rowwise):
        return prepared[2].get()
    return prepared.get()


def tiled(q, inputs, x, level):
    """The format's tiled kernel, called as its ``linear`` calls it (a bf16 ``scale_dtype`` rounds every weight)."""
    fmt, module = q.fmt, module_of(q.fmt)
    if isinstance(fmt, dq.MXFP4):
        return module.tiled_linear(x, inputs, mxfp4.BLOCK, max_level=level)
    if isinstance(fmt, (dq.NF4, dq.BnbNF4, dq.NF4BlockScales)):
        return module.tiled_linear(x, inputs, fmt.block_size, max_level=level)
    if isinstance(fmt, dq.Int4GroupwiseIntZero):
        return module.tiled_linear(x, inputs, fmt.group_size, max_level=level)
    rounds = fmt.scale_dtype == torch.bfloat16
    if isinstance(fmt, dq.Int4Groupwise):
        return module.tiled_linear(x, inputs, fmt.group_size, max_level=level, rounds=rounds)
    return module.tiled_linear(x, inputs, max_level=level, rounds=rounds)


def levels(fmt, x_dtype):
    """Every vector path here; levels 3 and 4 (vdpbf16ps, AMX) multiply bf16 activations only (fp32 ones run
    level 2)."""
    best = module_of(fmt).kernel()[1]
    return range(1, (best if x_dtype == torch.bfloat16 else min(best, 2)) + 1)


def columns(k, block):
    """Every block's first and last column, and a spread between: more than 128 for K = 14336 (two token passes)."""
    return sorted({0, k - 1, *range(block - 1, k, block * 7), *range(block, k, block * 5), *range(3, k, 97)})


def one_hot(cols, k, dtype):
    x = torch.zeros(len(cols), k, dtype=dtype)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    return x


def assert_within_sum_bound(out, x, dense):
    """|out - x @ dense.T| within an fp32 sum's reordering bound, K * 2^-24 * (|x| @ |dense|.T), plus the output's
    own rounding (half an ulp of bf16 or fp32) -- elementwise, against a float64 reference."""
    ref = x.double() @ dense.double().t()
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ dense.double().abs().t())
    bound += ref.abs() * (2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-24)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3e}"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_tiled_kernel_weights_are_dequantize_bits(fmt, shape, w_dtype, x_dtype):
    q = dq.quantize(weight(shape, seed=1, dtype=w_dtype) * 0.02, fmt)
    dense = q.dequantize(x_dtype)
    inputs = tile_inputs(q)
    assert inputs is not None
    cols = columns(shape[1], 32)
    x = one_hot(cols, shape[1], x_dtype)
    for level in levels(fmt, x_dtype):
        out = tiled(q, inputs, x, level)
        assert out.dtype == x_dtype
        assert torch.equal(out.t(), dense[:, cols]), f"level {level}"
        for start in range(0, len(cols), 37):  # a few tokens at a time: the inner-product way on level 3
            few = tiled(q, inputs, x[start : start + 1 + start % 5], level)
            assert torch.equal(few.t(), dense[:, cols[start : start + 1 + start % 5]]), f"level {level}, few"
        most = native.TILES_FEW_TOKENS  # the most tokens the inner-product way takes
        assert torch.equal(tiled(q, inputs, x[:most], level).t(), dense[:, cols[:most]]), f"level {level}, {most}"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_tiled_kernel_sums_within_their_bound(fmt, x_dtype):
    """Random activations, 2 to 130 tokens (both ways of the tiles, a partial group of 8, a second pass of 128),
    every path."""
    q = dq.quantize(weight((72, 5632), seed=3) * 0.02, fmt)
    dense, inputs = q.dequantize(x_dtype), tile_inputs(q)
    for tokens in (2, 7, 16, 33, 130):
        x = weight((tokens, 5632), seed=tokens, dtype=x_dtype)
        for level in levels(fmt, x_dtype):
            assert_within_sum_bound(tiled(q, inputs, x, level), x, dense)


def tiny_weight(fmt):
    """A [40, 2048] weight whose first tile (32 rows) dequantizes to some bf16 subnormals and whose last 8 rows
    do not (NF4's double-quantized scales cannot hold both: all of it is tiny there). Int4Groupwise's quantize
    keeps its scales above 1e-6 / 15, so its scales and zeros are written directly."""
    if isinstance(fmt, dq.Int4Groupwise):
        q = dq.quantize(weight((40, 2048), seed=5), fmt)
        q.inner["scale"][:32] = 3e-39
        q.inner["zero"].zero_()
        return q
    w = weight((40, 2048), seed=5, dtype=torch.float32) * (1e-38 if isinstance(fmt, dq.NF4) else 1e-37)
    if not isinstance(fmt, dq.NF4):
        w[32:] *= 1e30
    return dq.quantize(w, fmt)


@pytest.mark.parametrize("fmt", [dq.NF4(), dq.Int4Groupwise(32), dq.Int8Rowwise(), dq.Float8Rowwise()], ids=str)
def test_subnormal_weights_leave_the_bf16_path(fmt):
    """Weights below bf16's normal range: vdpbf16ps would read them as zero, so their tiles take the fp32 path
    on level 3 (the other tile stays on it); every weight is still dequantize's, on every level."""
    q = tiny_weight(fmt)
    dense = q.dequantize(torch.bfloat16)
    tiny = (dense != 0) & (dense.abs() < torch.finfo(torch.bfloat16).tiny)
    assert bool(tiny[:32].any()) and bool(tiny[32:].any()) == isinstance(fmt, dq.NF4)
    cols = columns(2048, 32)
    x = one_hot(cols, 2048, torch.bfloat16)
    for level in levels(fmt, torch.bfloat16):
        assert torch.equal(tiled(q, tile_inputs(q), x, level).t(), dense[:, cols]), f"level {level}"


def test_float8_tiles_every_code_and_extreme_scales():
    """Every non-NaN code, subnormals included, under scales from 2^-130 to Inf (test_fused_kernels.py's case):
    the tiles give the fp32 product with the dequantized weight, NaN where 0 * Inf makes one."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)])  # 256 a row
    codes = torch.stack([codes.roll(i * 37) for i in range(10)])
    scale = torch.tensor([1.0, 2.0**-130, 2.0**-117, 2.0**-118, 3.1e-3, 127.5, 2.0**7, 2.0**120, 3.0e38, float("inf")])
    inner = {"qdata": codes.view(torch.float8_e4m3fn), "scale": scale.to(torch.bfloat16).reshape(-1, 1)}
    prepared = float8.kernel_prepare(inner["qdata"], inner["scale"], codes.shape[1])
    for x_dtype in (torch.bfloat16, torch.float32):
        dense = dq.Float8Rowwise().dequantize(inner, x_dtype)
        x = torch.eye(codes.shape[1], dtype=x_dtype)
        expected = (x.double() @ dense.double().t()).to(x_dtype)
        for level in levels(dq.Float8Rowwise(), x_dtype):
            out = float8.tiled_linear(x, prepared, max_level=level)
            assert torch.equal(out.isnan(), expected.isnan()), f"{x_dtype} level {level}"
            assert torch.equal(out.nan_to_num(), expected.nan_to_num()), f"{x_dtype} level {level}"


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_tokens_result_does_not_depend_on_the_tokens_beside_it(fmt):
    """Every token's sum runs in one order whatever the tokens beside it, within each of the two ways the tiles
    multiply: up to TILES_FEW_TOKENS tokens (rows as they are, inner products) and more (transposed tiles,
    outer products)."""
    few = native.TILES_FEW_TOKENS
    q = dq.quantize(weight((40, 2048), seed=1), fmt)
    inputs = tile_inputs(q)
    x = weight((few + 64, 2048), seed=2)
    ways = (
        (x[:few], ((0, 1), (0, 3), (5, 9), (9, few))),
        (x, ((0, few + 1), (5, few + 24), (30, few + 64))),
    )
    for batch, slices in ways:
        whole = tiled(q, inputs, batch, None)
        for start, stop in slices:
            assert torch.equal(tiled(q, inputs, batch[start:stop], None), whole[start:stop]), (start, stop)


@pytest.mark.parametrize("threads", [1, 2])
def test_torchs_bf16_matmul_is_unchanged_after_the_tiles(threads):
    """On AMX (level 4) the tiles load their own tile configuration into each thread that runs them and put back
    the one they found: oneDNN's bf16 GEMM, which keeps its own in the same threads, gives the same bits after."""
    q = dq.quantize(weight((96, 2048), seed=1), dq.NF4())
    a, b = weight((64, 2048), seed=2), weight((256, 2048), seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        first = F.linear(a, b)
        for tokens in (3, 40):
            tiled(q, tile_inputs(q), weight((tokens, 2048), seed=4), None)
            assert torch.equal(F.linear(a, b), first)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", [dq.Int4Groupwise(128), dq.Int8Rowwise()], ids=str)
def test_int_formats_take_torchs_kernel_for_a_token_or_two_and_the_tiles_after(monkeypatch, fmt):
    """bf16: one token (int4: two) through torch's int kernel (which scales after its sum, so it is compared
    loosely), more through the tiles (within their bound); fp32 activations: the tiles at any count."""
    module, ran = module_of(fmt), []
    original = module.tiled_linear
    monkeypatch.setattr(module, "tiled_linear", lambda *a, **k: ran.append(a[0].shape[0]) or original(*a, **k))
    q = dq.quantize(weight((64, 2048), seed=1) * 0.02, fmt)
    bias = weight((64,), seed=3)
    dense = q.dequantize(torch.bfloat16)
    torchs = 2 if isinstance(fmt, dq.Int4Groupwise) else 1
    for tokens in (1, 2, 3, 16):
        x = weight((tokens, 2048), seed=10 + tokens)
        out = F.linear(x, q, bias).float() - bias.float()
        ref = x.float() @ dense.float().t()
        assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()
        if tokens > torchs:
            assert_within_sum_bound(F.linear(x, q), x, dense)
    x = weight((2, 2048), seed=4, dtype=torch.float32)
    assert_within_sum_bound(F.linear(x, q), x, q.dequantize(torch.float32))
    tiled = [t for t in (1, 2, 3, 16) if t > torchs]
    assert ran == [t for t in tiled for _ in (0, 1)] + [2]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_native_off_dequantizes(monkeypatch, fmt):
    """DTENSOR_QUANT_NATIVE=0: no C++ kernel; bf16 (beyond torch's own int kernels) and fp32 activations take
    dequantize + mm, bit for bit."""
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "0")
    q = dq.quantize(weight((64, 2048), seed=1), fmt)
    for dtype in (torch.bfloat16, torch.float32):
        x = weight((8, 2048), seed=2, dtype=dtype)
        assert torch.equal(F.linear(x, q), x @ q.dequantize(dtype).t())


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_native_switched_off_after_a_weight_was_used(monkeypatch, fmt):
    """DTENSOR_QUANT_NATIVE=0 set after a weight's kernel inputs were prepared: later calls honour it (dequantize +
    mm, bit for bit) without tripping over the prepared inputs (once a TypeError on every forward), and turning it
    back on gives the kernel's result again."""
    if not native.enabled():
        pytest.skip("DTENSOR_QUANT_NATIVE=0 already")
    q = dq.quantize(weight((64, 2048), seed=1), fmt)
    x = weight((8, 2048), seed=2)
    before = F.linear(x, q)
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "0")
    assert torch.equal(F.linear(x, q), x @ q.dequantize().t())
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "1")
    assert torch.equal(F.linear(x, q), before)


def test_the_few_tokens_threshold_is_the_kernels():
    """native.TILES_FEW_TOKENS (what the tests and docs name) is the DQ_FEW the C++ tiles use."""
    header = (Path(native.__file__).parent / "native_tiles.h").read_text()
    assert f"constexpr int64_t DQ_FEW = {native.TILES_FEW_TOKENS};" in header
