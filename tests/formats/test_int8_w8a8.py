"""_formats/int8_w8a8.cpp: the W8A8 kernel equals the integer reference bit for bit, at every vector level here.

The reference is :func:`dtensor_quant._core.activations.reference_linear`: int8 codes of each token, their
products summed exactly, then ``float(acc) * x_scale * w_scale`` rounded once. The kernel quantizes in one
pass (multiplying by the reciprocal of the scale where that gives the same codes, dividing where a quotient lies
near a half-integer), sums on AMX-INT8 (level 4, ``in % 64 == 0``) or through ``torch._int_mm`` between its
quantize and epilogue passes (levels 1 AVX2, 2 AVX-512), so every level must give the reference's bits; NaN
outputs compare as NaN (their payload is the conversion's).
"""

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._core import activations, native, native_build
from dtensor_quant._formats import int8
from dtensor_quant.testing import weight

pytestmark = pytest.mark.skipif(int8.w8a8_kernel() is None, reason="no W8A8 kernel here (no C++ compiler or AVX2)")

LEVELS = [lvl for lvl in (1, 2, 4) if lvl <= int8.w8a8_kernel()[1]] if int8.w8a8_kernel() else []
SCHEMES = [("int8-token", None), ("int8-token-per-rank", None), ("int8-tensor", 0.03)]
# tokens, out, in: AMX's 16-token groups and 32-row tiles cut short, in % 64 != 0 (no AMX), a long row
# 300 x 2048: the AMX kernel's tokens in two chunks (512 KiB of codes each); 140 x 4160: in two chunks of at
# least 128 tokens (past 512 KiB)
SHAPES = [(1, 64, 128), (7, 40, 64), (33, 24, 256), (130, 70, 192), (17, 33, 96), (5, 48, 2112), (300, 40, 2048)]
SHAPES += [(140, 40, 4160)]
# a real model's width (Llama-3-8B's SwiGLU, 14336): one 128-token chunk of codes is 1.8 MiB, past the 512 KiB aim
SHAPES += [(130, 33, 14336)]


def same(got, expected):
    """Equal bits where finite, NaN where the reference is NaN (Inf equal as values)."""
    return (
        got.dtype == expected.dtype
        and torch.equal(got.isnan(), expected.isnan())
        and torch.equal(got.nan_to_num(0.0, 1.0, -1.0), expected.nan_to_num(0.0, 1.0, -1.0))
        and torch.equal(got.isinf(), expected.isinf())
    )


def hostile(x: torch.Tensor) -> torch.Tensor:
    """x with a NaN row, an Inf row, a zero row, a row of ties (x / s exactly k + 1/2), a subnormal row."""
    x = x.clone()
    rows = x.shape[0]
    if rows > 5:
        x[0, 3] = float("nan")
        x[1, 1] = float("-inf")
        x[2] = 0
        ties = torch.arange(x.shape[1], dtype=torch.float32) % 255 - 127  # amax 127: scale 1
        ties[1:-1] += 0.5 * torch.sign(ties[1:-1])
        x[3] = ties.clamp(-127, 127).to(x.dtype)
        x[4] = x[4] * 1e-39 if x.dtype == torch.float32 else x[4]
    return x


def run(fmt, x, q, level):
    w_scale = q.scale.float().reshape(-1).contiguous()
    return int8.w8a8_native(x, q.qdata, w_scale, fmt.activation_scheme, fmt.input_scale, max_level=level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("scheme,input_scale", SCHEMES, ids=[s for s, _ in SCHEMES])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_is_the_integer_reference(level, scheme, input_scale, shape, dtype):
    tokens, out, inp = shape
    fmt = dq.Int8Rowwise(activations=scheme, input_scale=input_scale)
    x = hostile(weight((tokens, inp), seed=tokens + inp, dtype=torch.float32) * 4).to(dtype)
    q = dq.quantize(weight((out, inp), seed=out).to(dtype), fmt)
    got = run(fmt, x, q, level)
    expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme, fmt.input_scale)
    assert got is not None and same(got, expected), f"level {level}"


@pytest.mark.parametrize("level", LEVELS)
def test_given_token_maxima_are_used(level):
    """Under tensor parallelism the per-token maxima arrive reduced (token_stat_reduction): the kernel quantizes
    with them, exactly as the reference does under the same reduction."""
    fmt = dq.Int8Rowwise(activations="int8-token")
    x = weight((19, 128), seed=3).to(torch.bfloat16)
    q = dq.quantize(weight((40, 128), seed=4).to(torch.bfloat16), fmt)
    wider = x.float().abs().amax(-1, keepdim=True) * 3  # as if other ranks held larger values
    with activations.token_stat_reduction(lambda local: torch.maximum(local, wider)):
        got = run(fmt, x, q, level)
        expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme)
    assert same(got, expected)
    assert not same(got, activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme))


def test_large_batches_and_threads():
    """More tokens than one chunk of the AMX kernel holds (at most 1024), and several threads over the weight's
    tiles."""
    fmt = dq.Int8Rowwise(activations="int8-token")
    x = weight((1100, 64), seed=5).to(torch.bfloat16)
    q = dq.quantize(weight((96, 64), seed=6).to(torch.bfloat16), fmt)
    expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert same(run(fmt, x, q, None), expected)
    finally:
        torch.set_num_threads(threads)


def test_linear_takes_the_kernel_and_falls_back():
    """F.linear runs the kernel (same bits as the reference, with a bias); fp16 activations, which it does not
    take, run the reference in torch."""
    fmt = dq.Int8Rowwise(activations="int8-token")
    q = dq.quantize(weight((40, 128), seed=7).to(torch.bfloat16), fmt)
    bias = weight((40,), seed=8).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        x = weight((9, 128), seed=9).to(dtype)
        expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme, None, bias.to(dtype))
        assert same(F.linear(x, q, bias.to(dtype)), expected)
    half = weight((2, 128), seed=1).half()
    assert int8.w8a8_native(half, q.qdata, q.scale.float(), fmt.activation_scheme, None) is None


def test_levels_reported():
    """The probe reports AMX (4) exactly where the CPU has AMX-INT8 tiles (and the builds take AMX), else the
    best of AVX-512 (2) and AVX2 (1): the quantize and epilogue passes have no level 3."""
    _, best = int8.w8a8_kernel()
    features = native_build.cpu_features()
    if "amx_int8" in features and native_build.cpu_level() == native.BEST_LEVEL:
        assert best == 4
    else:
        assert best == (2 if {"avx512f", "avx512bw", "avx512vl"} <= features else 1)


def near_half_integers(rows: int, width: int, seed: int) -> torch.Tensor:
    """fp32 rows whose quotients x / s lie within 3 ulps of a half-integer: where x * (1 / s) and x / s often round
    to different integers. Element 0 of each row sets its absmax (and so s = absmax / 127)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(rows, generator=g) * 10 + 0.1
    s = amax / 127
    c = torch.randint(-127, 127, (rows, width), generator=g).float() + 0.5
    x = c * s[:, None]
    for _ in range(int(torch.randint(0, 4, ()))):  # a few ulps up or down
        x = torch.nextafter(x, torch.where(torch.rand(x.shape, generator=g) < 0.5, -torch.inf, torch.inf))
    x[:, 0] = amax
    return x


@pytest.mark.parametrize("level", LEVELS)
def test_quotients_near_half_integers(level):
    """An identity weight makes each output its token's code times the scales: every code must be the
    reference's, where multiplying by the reciprocal would have rounded the other way."""
    fmt = dq.Int8Rowwise(activations="int8-token")
    x = near_half_integers(40, 128, seed=level)
    s = x[:, :1] / 127
    assert ((x / s).round() != (x * (1 / s)).round()).any()  # the case this test is about occurs
    q = dq.quantize(torch.eye(128), fmt)
    expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme)
    assert same(run(fmt, x, q, level), expected)


@pytest.mark.parametrize("level", LEVELS)
def test_bf16_outputs_subnormal_zero_and_nan(level):
    """bf16 outputs rounded from subnormal fp32 products (which the AMX epilogue's hardware conversion would read
    as zero), signed zeros and NaN rows / columns: the reference's bits wherever it is not NaN, NaN where it is."""
    fmt = dq.Int8Rowwise(activations="int8-token")
    g = torch.Generator().manual_seed(level)
    x = (torch.randn(70, 128, generator=g) * 4).to(torch.bfloat16)
    x[3, 5] = float("nan")
    q = dq.quantize(weight((64, 128), seed=level), fmt)
    seen = False
    for power in (-120, -130, -135):
        w_scale = (q.scale.float().reshape(-1) * 2.0**power).contiguous()
        w_scale[7], w_scale[9], w_scale[11] = float("nan"), 0.0, -0.0
        got = int8.w8a8_native(x, q.qdata, w_scale, fmt.activation_scheme, None, max_level=level)
        expected = activations.reference_linear(x, q.qdata, w_scale[:, None], fmt.activation_scheme)
        tiny = (expected.float().abs() < torch.finfo(torch.float32).tiny) & (expected != 0)
        seen |= bool(tiny.any())
        finite = ~expected.isnan()
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.view(torch.int16)[finite], expected.view(torch.int16)[finite]), f"2^{power}"
    assert seen  # the case this test is about occurs


@pytest.mark.parametrize("inp", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens,out", [(1, 5), (17, 33), (64, 1)])
def test_int_matmul_is_exact_at_narrow_inputs(tokens, out, inp):
    """int_matmul (levels 1-2 and the torch fallback) is the exact product for any ``in``: at ``in == 1`` its
    ``[m, 1]`` operands have strides (1, 1), which torch 2.13's CPU ``_int_mm`` misreads (uninitialised sums)."""
    g = torch.Generator().manual_seed(tokens * 100 + out * 10 + inp)
    codes = torch.randint(-128, 128, (tokens, inp), dtype=torch.int8, generator=g)
    w_codes = torch.randint(-128, 128, (out, inp), dtype=torch.int8, generator=g)
    got = int8.int_matmul(codes, w_codes)
    assert torch.equal(got.long(), codes.long() @ w_codes.long().t())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("shape", [(1, 1), (9, 31), (8, 64), (33, 2816), (6, 100)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_token_maxima_are_torchs(level, shape, dtype):
    """The kernel's own pass over each row's max |x| (what tensor parallelism all-reduces) is
    activations.token_absmax_local's: the same values, NaN where a row holds one, every sign bit clear
    (-0 and negative NaN included), at every level and at row lengths that leave a vector's tail."""
    x = weight(shape, seed=shape[1], dtype=torch.float32) * 3
    if shape[0] > 5:
        x[0, -1], x[1, 0], x[2], x[3, shape[1] // 2] = float("nan"), float("-inf"), -0.0, -float("nan")
        x[4] = x[4] * 1e-39 if dtype == torch.float32 else x[4]
    x = x.to(dtype)
    run_kernel, _ = int8.w8a8_kernel()
    got = int8.local_token_absmax(run_kernel, level, x)
    expected = activations.token_absmax_local(x)
    assert got.shape == expected.shape == (shape[0], 1) and same(got, expected), f"level {level}"
    assert not (got.view(torch.int32) < 0).any(), "a sign bit is set"


@pytest.mark.parametrize("level", LEVELS)
def test_reduced_linear_hands_the_kernels_maxima_to_the_reduction(level):
    """Inside a token_stat_reduction block (a row-parallel matmul) the reduction receives this rank's maxima
    from the kernel's pass, equal to torch's, and the result is the reference's under the same reduction."""
    fmt = dq.Int8Rowwise(activations="int8-token")
    x = hostile(weight((21, 192), seed=8, dtype=torch.float32) * 4).to(torch.bfloat16)
    q = dq.quantize(weight((40, 192), seed=9).to(torch.bfloat16), fmt)
    seen = []

    def reduce(local):
        seen.append(local.clone())
        return local * 2  # as if another rank held twice the values

    with activations.token_stat_reduction(reduce):
        got = run(fmt, x, q, level)
        expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme)
    assert same(seen[0], activations.token_absmax_local(x)), "the reduction got other maxima than torch's"
    assert same(got, expected)
