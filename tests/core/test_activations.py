"""_core/activations and the formats' quantized-activation matmuls on one process.

References: :func:`reference_linear` spelled out in plain torch (int8: an exact
integer sum, so the kernel equals it bit for bit; fp8: the exact products'
sum, so the kernel is within the fp32 summation bound of the exact value), and
the declared arithmetic written out again here for the statistics.
"""

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._core import activations
from dtensor_quant._core.reductions import reduce_magnitude_max
from dtensor_quant._formats.int8 import int_matmul
from dtensor_quant.testing import assert_within, linear_error_bound, unit_roundoff, weight

INT8 = [
    dq.Int8Rowwise(activations="int8-token"),
    dq.Int8Rowwise(activations="int8-token-per-rank"),
    dq.Int8Rowwise(torch.bfloat16, activations="int8-token"),
    dq.Int8Rowwise(activations="int8-tensor", input_scale=0.03),
]
FP8 = [
    dq.Float8Rowwise(activations="fp8-token"),
    dq.Float8Rowwise(torch.bfloat16, activations="fp8-token"),
    dq.Float8Tensorwise(activations="fp8-token"),
    dq.Float8Tensorwise(activations="fp8-tensor", input_scale=0.01),
]
SHAPES = [(1, 64, 96), (7, 40, 64), (33, 24, 256), (130, 16, 128)]  # tokens, out, in (in % 32 != 0 too)


def _operands(tokens, out, inp, dtype, seed=0):
    return weight((tokens, inp), seed=seed).to(dtype), weight((out, inp), seed=seed + 1).to(dtype)


@pytest.mark.parametrize("fmt", INT8, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_int8_linear_is_the_integer_reference(fmt, shape, dtype):
    x, w = _operands(*shape, dtype)
    q = dq.quantize(w, fmt)
    bias = weight((shape[1],), seed=9).to(dtype)
    got = F.linear(x, q, bias)
    expected = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme, fmt.input_scale, bias)
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("fmt", FP8, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_linear_within_the_summation_bound(fmt, shape, dtype):
    x, w = _operands(*shape, dtype, seed=3)
    q = dq.quantize(w, fmt)
    got = F.linear(x, q)
    codes, x_scale = activations.quantize_activation(x, fmt.activation_scheme, fmt.input_scale)
    xv = codes.double() * x_scale.double()
    wv = q.qdata.double() * q.scale.double()
    exact = xv @ wv.t()
    bound = linear_error_bound(xv, wv, out_dtype=dtype)
    reference_bound = bound
    if dtype == torch.bfloat16:  # the tiles' bf16 output rounds the sum once more, before the scales
        bound = bound + unit_roundoff(dtype) * (exact.abs() + bound)
    assert_within(got, exact, bound, f"{fmt} {shape} {dtype}")
    reference = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme, fmt.input_scale)
    assert_within(reference, exact, reference_bound, "the reference itself")


def test_token_statistics_as_declared():
    x = weight((5, 48), seed=4, dtype=torch.float32)
    x[2] = 0  # a zero token: scale 1, codes 0
    scheme = activations.SCHEMES["int8-token"]
    codes, scale = activations.quantize_activation(x, scheme, None)
    amax = x.abs().amax(-1, keepdim=True)
    expected_scale = torch.where(amax == 0, 1.0, amax / 127)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(codes, (x / expected_scale).round().clamp(-128, 127).to(torch.int8))
    assert codes.abs().amax(-1).tolist() == [127, 127, 0, 127, 127]
    fp8 = activations.SCHEMES["fp8-token"]
    codes8, scale8 = activations.quantize_activation(x, fp8, None)
    assert torch.equal(scale8, torch.where(amax == 0, 1.0, amax / 448))
    expected8 = (x / scale8).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes8.view(torch.uint8), expected8.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_token_absmax_is_the_magnitude_maximum_with_clear_sign_bits(dtype):
    """The maximum of |x| per token, exactly (a value of x's dtype), NaN kept, every sign bit clear (so the bits
    reduce as ints under TP); compared against abs().amax() in float64."""
    x = weight((6, 40), seed=9).to(dtype)
    x[0, 7], x[1, 3], x[2], x[3] = float("nan"), float("-inf"), -0.0, -x[3].abs()  # NaN, -inf, all -0, negative
    x[4, 11] = -float("nan")  # a NaN whose sign bit is set
    amax = activations.token_absmax(x, activations.SCHEMES["int8-token"])
    assert amax.dtype == torch.float32 and amax.shape == (6, 1)
    expected = x.double().abs().amax(-1, keepdim=True).float()
    assert torch.equal(amax.isnan(), expected.isnan()) and amax[0].isnan() and amax[4].isnan()
    finite = ~expected.isnan()
    assert torch.equal(amax[finite], expected[finite]), (amax, expected)
    assert not (amax.view(torch.int32) < 0).any(), "a sign bit is set"
    empty = activations.token_absmax(x[:, :0], activations.SCHEMES["int8-token"])
    assert torch.equal(empty.view(torch.int32), torch.zeros(6, 1, dtype=torch.int32))


def test_reduced_magnitude_maximum_keeps_nan():
    """reduce_magnitude_max over two simulated ranks (an int32 MAX of their keys, as gloo does): the float
    maximum where both are numbers, NaN where either rank has a NaN."""
    scheme = activations.SCHEMES["int8-token"]
    a, b = weight((7, 16), seed=10), weight((7, 16), seed=11) * 3
    a[1, 2], b[2, 5], a[3], b[3] = float("nan"), float("nan"), 0.0, -0.0
    a[4, 0], b[5, 1] = float("inf"), -float("nan")
    stats = [activations.token_absmax(t, scheme) for t in (a, b)]

    def two_ranks(key, op):
        assert op == "max" and key.dtype == torch.int32
        return torch.maximum(key, stats[1].view(torch.int32))

    got = reduce_magnitude_max(stats[0].clone(), two_ranks)
    both = torch.cat([a, b], -1).double()
    expected = torch.where(both.isnan().any(-1, keepdim=True), float("nan"), both.abs().amax(-1, keepdim=True))
    assert got.isnan().tolist() == [[False], [True], [True], [False], [False], [True], [False]]
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite].float())
    assert got[4].item() == float("inf") and got[3].view(torch.int32).item() == 0


@pytest.mark.parametrize("spelling", ["int8-token", "int8-token-per-rank", "fp8-token", "int8-tensor"])
def test_kernel_statistic_says_where_the_scale_comes_from(spelling):
    """One helper for both activation kernels: the static scale, the reduced maxima inside a reduction block
    (reduced schemes only), or nothing (the kernel takes its own maxima)."""
    scheme = activations.SCHEMES[spelling]
    x = weight((3, 32), seed=12)
    seen = []
    stat, flags = activations.kernel_statistic(x, scheme, 0.5 if not scheme.dynamic else None)
    with activations.token_stat_reduction(lambda amax: seen.append(amax) or amax * 2):
        reduced, reduced_flags = activations.kernel_statistic(x, scheme, 0.5 if not scheme.dynamic else None)
    if not scheme.dynamic:
        assert flags == reduced_flags == activations.STATIC_SCALE and stat.tolist() == reduced.tolist() == [0.5]
        return
    assert flags == 0 and stat.numel() == 0
    if scheme.per_rank:
        assert reduced_flags == 0 and reduced.numel() == 0 and not seen
    else:
        assert reduced_flags == activations.GIVEN_MAXIMA and len(seen) == 1
        assert torch.equal(reduced, (x.abs().amax(-1) * 2).float())


def test_static_scale_saturates():
    scheme = activations.SCHEMES["int8-tensor"]
    x = torch.tensor([[1.0, -1.0, 0.004, 10.0]])
    codes, scale = activations.quantize_activation(x, scheme, 0.01)
    assert scale.shape == (1, 1) and codes.tolist() == [[100, -100, 0, 127]]


def test_nan_and_inf_rows_are_nan_zero_rows_zero():
    fmt = dq.Int8Rowwise(activations="int8-token")
    q = dq.quantize(weight((8, 64), seed=5), fmt)
    x = weight((4, 64), seed=6)
    x[0, 3], x[1, 5], x[2] = float("nan"), float("inf"), 0.0
    out = F.linear(x, q)
    assert out[0].isnan().all() and out[1].isnan().all()
    assert torch.equal(out[2], torch.zeros(8, dtype=out.dtype)) and out[3].isfinite().all()


@pytest.mark.parametrize("m,k,n", [(0, 8, 8), (1, 1, 1), (3, 7, 5), (17, 64, 24), (5, 0, 3)])
def test_int_matmul_is_exact(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    assert torch.equal(int_matmul(a, b).long(), a.long() @ b.long().t())


def test_default_is_weight_only_and_unchanged():
    for fmt in (dq.Int8Rowwise(), dq.Float8Rowwise(), dq.Float8Tensorwise()):
        assert fmt.activation_scheme is None and "activations" not in repr(fmt)
    assert repr(dq.Int8Rowwise()) == "Int8Rowwise()"
    x, w = _operands(3, 16, 64, torch.bfloat16)
    before = F.linear(x, dq.quantize(w, dq.Int8Rowwise()))
    assert not torch.equal(before, F.linear(x, dq.quantize(w, dq.Int8Rowwise(activations="int8-token"))))


@pytest.mark.parametrize(
    "cls,kwargs,says",
    [
        (dq.Int8Rowwise, {"activations": "int8"}, "'int8-tensor', 'int8-token', 'int8-token-per-rank'"),
        (dq.Int8Rowwise, {"activations": "fp8-token"}, "int8-token"),
        (dq.Float8Rowwise, {"activations": "int8-token"}, "'fp8-tensor', 'fp8-token', 'fp8-token-per-rank'"),
        (dq.Int8Rowwise, {"activations": "int8-tensor"}, "needs input_scale"),
        (dq.Float8Tensorwise, {"activations": "fp8-tensor", "input_scale": -1.0}, "finite and positive"),
        (dq.Int8Rowwise, {"input_scale": 0.5}, "needs a static activation scheme"),
        (dq.Int8Rowwise, {"activations": "int8-token", "input_scale": 0.5}, "per token"),
    ],
)
def test_bad_declarations_say_what_exists(cls, kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        cls(**kwargs)


@pytest.mark.parametrize("fmt", INT8 + FP8, ids=str)
def test_the_scheme_survives_save_and_load(fmt, tmp_path):
    q = dq.quantize(weight((8, 64), seed=7), fmt)
    torch.save(q, tmp_path / "q.pt")
    back = torch.load(tmp_path / "q.pt", weights_only=True)
    assert back.fmt == fmt and back.fmt.activation_scheme == fmt.activation_scheme
    x = weight((2, 64), seed=8)
    assert torch.equal(F.linear(x, back), F.linear(x, q))


@pytest.mark.parametrize("fmt", [INT8[0], INT8[2], FP8[0], FP8[3], dq.Int8Rowwise()], ids=str)
def test_the_kit_checks_the_scheme(fmt):
    from dtensor_quant.testing import CHECKS, check_format

    checks = [c for c in CHECKS if c.name == "quantized activations"]
    (outcome,) = check_format(fmt, checks=checks).outcomes
    assert outcome.ok, outcome.detail
    assert ("not applicable" in outcome.detail) == (fmt.activation_scheme is None)


@pytest.mark.parametrize("fmt", [INT8[3], FP8[3]], ids=str)
def test_static_nan_and_inf_rows_are_nan(fmt):
    q = dq.quantize(weight((8, 64), seed=5), fmt)
    x = weight((3, 64), seed=6)
    x[0, 3], x[1, 5] = float("nan"), float("-inf")
    out = F.linear(x, q)
    assert out[0].isnan().all() and out[1].isnan().all() and out[2].isfinite().all()
