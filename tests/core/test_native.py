"""core/native: the one-token kernels of NF4 and float8: exact weights, dense results.

tests/core/test_native_tiles.py checks the multi-token (tiled) kernels the same way.

A one-hot activation row ``e_k`` makes the kernel return column ``k`` of the
weight it used, rounded once to bf16 -- which the weight already is -- so
comparing those columns with ``dequantize`` checks the kernel's weights bit
for bit. Random activations then check the sum against the exact product of
the dequantized weights, within the bound of an fp32 sum in any order rounded
to bf16 (:func:`dtensor_quant.testing.linear_error_bound`): the kernel's order
is its own, and differs between its AVX2 and AVX-512 paths. Widths are
TinyLlama's (2048 and 5632 columns, where NF4's scale factors run across
rows), with few rows.
"""

import dataclasses
import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._core import activations, native
from dtensor_quant._formats import float8, int4_zero, nf4
from dtensor_quant.testing import assert_within, linear_error_bound, unit_roundoff, weight

pytestmark = pytest.mark.skipif(
    nf4.kernel() is None or float8.kernel() is None,
    reason="no fused kernels here (no C++ compiler, or no AVX2)",
)


def one_hot_columns(q, cols):
    """Rows ``e_k`` for each ``k`` in ``cols`` (bf16), as the kernel sees activations."""
    x = torch.zeros(len(cols), q.shape[1], dtype=torch.bfloat16)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    return x


def columns(k, block):
    """Every block's first and last column, and a spread between."""
    picked = {0, k - 1, *range(block - 1, k, block * 7), *range(block, k, block * 5), *range(3, k, 97)}
    return sorted(picked)


def assert_close(out, x, dense, bias=None):
    """``out`` is ``x @ dense.T`` summed in fp32 in some order and rounded to bf16 (then ``+ bias``, rounded
    again): within that bound of the exact value."""
    exact = x.double() @ dense.double().t()
    bound = linear_error_bound(x, dense, out_dtype=torch.bfloat16)
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + unit_roundoff(torch.bfloat16) * (exact.abs() + bound)
    assert_within(out, exact, bound, "kernel vs exact")


@pytest.mark.parametrize(
    "fmt", [dq.NF4(), dq.BnbNF4(), dq.NF4BlockScales(), dq.NF4BlockScales(levels="torchao"), dq.MXFP4()], ids=str
)  # the same kernel, their tables
@pytest.mark.parametrize("shape", [(48, 2048), (40, 5632)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_kernel_weights_are_dequantize_bits(shape, dtype, fmt):
    """bf16 and fp32 weights, bf16 activations, every vector path here: each weight is dequantize's, bit for bit."""
    q = dq.quantize(weight(shape, seed=1, dtype=dtype) * 0.02, fmt)
    dense = q.dequantize(torch.bfloat16)
    prepared = q.fmt.prepare(q.inner).get()
    assert prepared is not None
    cols = columns(shape[1], q.fmt.block_size)
    x = weight((1, shape[1]), seed=2)
    for level in range(1, nf4.kernel()[1] + 1):  # AVX2, AVX-512
        out = nf4.fused_linear(one_hot_columns(q, cols), prepared, q.fmt.block_size, max_level=level)
        assert torch.equal(out.t(), dense[:, cols]), f"level {level}"
        assert_close(nf4.fused_linear(x, prepared, q.fmt.block_size, max_level=level), x, dense)


@pytest.mark.parametrize("fmt", [dq.Float8Rowwise(), dq.Float8Tensorwise(), dq.Float8Blockwise(128)], ids=str)
@pytest.mark.parametrize("shape", [(300, 2048), (40, 5632)])
def test_float8_kernel_weights_are_dequantize_bits(fmt, shape):
    """Every vector path this CPU has (AVX2, AVX-512, AVX-512 BF16) gives dequantize's bits."""
    q = dq.quantize(weight(shape, seed=1) * 0.02, fmt)
    dense = q.dequantize(torch.bfloat16)
    prepared = q.fmt.prepare(q.inner).get()
    cols = columns(shape[1], 32)
    x = weight((1, shape[1]), seed=2)
    for level in range(1, float8.kernel()[1] + 1):
        out = float8.fused_linear(one_hot_columns(q, cols), prepared, max_level=level)
        assert torch.equal(out.t(), dense[:, cols]), f"level {level}"
        assert_close(float8.fused_linear(x, prepared, max_level=level), x, dense)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [128, 32])
def test_int_zero_kernel_weights_are_dequantize_bits(scale_dtype, group):
    """Every code and zero point 0-16 (GPTQ v1), scales over the dtype's range: each weight is dequantize's bf16,
    fp16 products rounded to fp16 first, at every vector level here."""
    if int4_zero.kernel() is None:
        pytest.skip("no Int4GroupwiseIntZero kernel here")
    fmt, shape = dq.Int4GroupwiseIntZero(group, scale_dtype=scale_dtype), (40, 2048)
    q = dq.quantize(weight(shape, seed=1), fmt)
    g = torch.Generator().manual_seed(3)
    q.qdata.copy_(torch.randint(0, 256, q.qdata.shape, generator=g, dtype=torch.int32).to(torch.uint8))
    q.zero.copy_(torch.randint(0, 17, q.zero.shape, generator=g, dtype=torch.int32).to(torch.uint8))
    info = torch.finfo(scale_dtype)
    exps = torch.randint(-14 if scale_dtype == torch.float16 else -100, 12, q.scale.shape, generator=g)
    q.scale.copy_((torch.rand(q.scale.shape, generator=g) + 1) * torch.exp2(exps.float()))
    q.scale[0, 0], q.scale[1, 0] = info.smallest_normal * info.eps, info.smallest_normal  # subnormal products
    dense = q.dequantize(torch.bfloat16)
    prepared = q.fmt.prepare(q.inner).get()
    assert prepared is not None
    cols = columns(shape[1], group)
    x = weight((1, shape[1]), seed=2)
    for level in range(1, int4_zero.kernel()[1] + 1):  # AVX2, AVX-512
        out = int4_zero.fused_linear(one_hot_columns(q, cols), prepared, group, max_level=level)
        assert torch.equal(out.t(), dense[:, cols]), f"level {level}"
        assert_close(int4_zero.fused_linear(x, prepared, group, max_level=level), x, dense)


def test_float8_kernel_extreme_scales_and_every_code():
    """Every non-NaN code, subnormals included, under scales from tiny (products below bf16's normal range,
    where the BF16 path must not be used) to huge (products that overflow to Inf), and an Inf scale; 127.5 and
    2^7 on either side of the BF16 path's upper bound.

    A row holding an Inf weight turns its one-hot outputs into NaN (0 * Inf), exactly as the fp32 product
    with the dequantized weight does: that product is the reference.
    """
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)])  # 256 a row
    codes = torch.stack([codes.roll(i * 37) for i in range(10)])
    scale = torch.tensor([1.0, 2.0**-130, 2.0**-117, 2.0**-118, 3.1e-3, 127.5, 2.0**7, 2.0**120, 3.0e38, float("inf")])
    inner = {"qdata": codes.view(torch.float8_e4m3fn), "scale": scale.to(torch.bfloat16).reshape(-1, 1)}
    dense = dq.Float8Rowwise().dequantize(inner, torch.bfloat16)
    x = torch.eye(codes.shape[1], dtype=torch.bfloat16)
    expected = (x.float() @ dense.float().t()).to(torch.bfloat16)
    finite = dense.isfinite().all(1)
    assert torch.equal(expected.t()[finite], dense[finite]) and finite.sum() == 7  # 2^120 * 448 overflows too
    prepared = float8.kernel_prepare(inner["qdata"], inner["scale"], codes.shape[1])
    for level in range(1, float8.kernel()[1] + 1):
        out = float8.fused_linear(x, prepared, max_level=level)
        assert torch.equal(out.isnan(), expected.isnan()), f"level {level}"
        assert torch.equal(out.nan_to_num(), expected.nan_to_num()), f"level {level}"


def test_float8_nan_codes_take_the_plain_path():
    q = dq.quantize(weight((32, 2048), seed=1), dq.Float8Rowwise())
    q.inner["qdata"].view(torch.uint8)[3, 100] = 0x7F
    assert q.fmt.prepare(q.inner).get() is None
    x = weight((1, 2048), seed=2)
    out = F.linear(x, q)
    torch.testing.assert_close(out, x @ q.dequantize().t(), rtol=0, atol=0, equal_nan=True)
    assert out[0, 3].isnan() and not out[0, :3].isnan().any()


@pytest.mark.parametrize(
    "fmt",
    [
        dq.NF4(),
        dq.BnbNF4(),
        dq.MXFP4(),
        dq.Int4GroupwiseIntZero(128, scale_dtype=torch.float16),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(),
    ],
    ids=str,
)
def test_linear_picks_the_kernel_by_token_count(monkeypatch, fmt):
    """F.linear: 1 bf16 token runs the one-token kernel, more (and fp32 activations) the tiled kernel, each with
    its bias; past native.TILES_MAX_TOKENS (made 8 here), and for fp16 activations, dequantize + mm."""
    module = int4_zero if isinstance(fmt, dq.Int4GroupwiseIntZero) else float8
    module = nf4 if isinstance(fmt, (dq.NF4, dq.BnbNF4, dq.NF4BlockScales, dq.MXFP4)) else module
    q = dq.quantize(weight((64, 2048), seed=1), fmt)
    bias = weight((64,), seed=3)
    ran = []
    for name in ("fused_linear", "tiled_linear"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: ran.append(_n) or _f(*a, **k))
    monkeypatch.setattr(native, "TILES_MAX_TOKENS", 8)
    dense = q.dequantize(torch.bfloat16)
    for tokens, path in ((1, "fused_linear"), (2, "tiled_linear"), (3, "tiled_linear"), (8, "tiled_linear")):
        x = weight((tokens, 2048), seed=2)
        out = F.linear(x, q, bias)
        assert ran == [path], (tokens, ran)
        ran.clear()
        assert_close(out, x, dense, bias)
    x = weight((9, 2048), seed=2)
    assert torch.equal(F.linear(x, q, bias), x @ dense.t() + bias) and not ran
    x = weight((1, 2048), seed=2, dtype=torch.float32)
    out = F.linear(x, q)
    assert ran == ["tiled_linear"] and out.dtype == torch.float32
    ran.clear()
    x = weight((1, 2048), seed=2, dtype=torch.float16)
    assert torch.equal(F.linear(x, q), x @ q.dequantize(torch.float16).t()) and not ran


def test_nf4_slice_whose_blocks_differ_from_a_fresh_weight_dequantizes(monkeypatch):
    """A column slice keeps the full weight's 8-row scale factors; a fresh [64, 1024] weight has 16-row ones:
    the flat-order kernel must not read it (``kernel_needs_whole_blocks``)."""
    q = dq.quantize(weight((64, 2048), seed=1), dq.NF4())
    piece = q[:, :1024]
    prepare_calls = []
    monkeypatch.setattr(dq.NF4, "prepare", lambda f, inner: prepare_calls.append(1))
    x = weight((1, 1024), seed=2)
    assert torch.equal(F.linear(x, piece), x @ piece.dequantize().t())
    assert not prepare_calls


def test_a_failed_build_warns_once_and_dequantizes(monkeypatch, tmp_path):
    """NF4's kernel source replaced by one that does not compile (as with no C++ compiler): the first linear warns,
    once, naming the dequantize + mm path it takes instead; every later one is silent and gives that path's result."""
    broken = tmp_path / "nf4.cpp"
    broken.write_text('#include "native_prelude.h"\nthis is not C++\n')
    monkeypatch.setattr(nf4, "KERNEL", dataclasses.replace(nf4.KERNEL, source=broken))
    q = dq.quantize(weight((16, 2048), seed=1), dq.NF4())
    x = weight((1, 2048), seed=2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            assert torch.equal(F.linear(x, q), x @ q.dequantize().t())
    said = [w for w in said if issubclass(w.category, native.KernelUnavailableWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert "nf4 C++ kernel" in str(said[0].message) and "dequantize + mm" in str(said[0].message)


def test_native_off_falls_back_silently(monkeypatch):
    """DTENSOR_QUANT_NATIVE=0: no kernel, no warning, the dequantize + mm result."""
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nf4.kernel() is None
        q = dq.quantize(weight((16, 2048), seed=1), dq.NF4())
        assert q.fmt.prepare(q.inner).get() is None
        x = weight((1, 2048), seed=2)
        assert torch.equal(F.linear(x, q), x @ q.dequantize().t())


def test_kernel_sources_ship_with_the_package():
    """Every format's kernel is a .cpp file beside its module (package data), with the shared header it includes."""
    for module in (nf4, float8):
        assert module.KERNEL.source.is_file() and module.KERNEL.source.suffix == ".cpp"
        text = native.source(module.KERNEL.source)
        assert "dq_bf16_rne" in text and '#include "native_prelude.h"' not in text


def test_every_kernel_source_resolves_and_the_training_kernels_build(monkeypatch):
    """Every .cpp in the package inlines all its headers (beside it, then beside core/native.py), and the training
    paths' kernels build and run here: a build failure there only warns and takes the torch expressions (the same
    bits), so nothing else would notice that the kernels stopped running."""
    from dtensor_quant._core.stochastic import Noise, uniform

    package = Path(dq.__file__).parent
    sources = sorted(package.rglob("*.cpp"))
    assert len(sources) >= 10, sources
    for path in sources:
        text = native.source(path)
        assert '#include "' not in text, f"{path.name}: a header was not found"
        assert "void kernel(" in text, f"{path.name}: no entry point"
    if not native.enabled():
        pytest.skip("DTENSOR_QUANT_NATIVE=0")
    asked, load = [], native.load
    monkeypatch.setattr(native, "load", lambda kernel, *a: asked.append(kernel.name) or load(kernel, *a))
    w = weight((8, 512), seed=3, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", native.KernelUnavailableWarning)
        uniform(0, 0, (8, 512), (0, 0), (8, 512))
        noise = Noise(0, 0, (8, 512), (0, 0), (8, 512))
        dq.Int8Rowwise().quantize_stochastic(w, lambda t, *_: t, noise, torch.float32)
        dq.quantize(w, dq.Int8Rowwise()).dequantize(torch.float32)
        dq.quantize(w, dq.BlockFloat8(256)).dequantize(torch.float32)
    expected = {"stochastic_noise", "int8_stochastic", "int8_row_absmax", "int8_values"}
    expected |= {"block_float8_quantize", "block_float8_unpack"}
    assert expected <= set(asked), sorted(set(asked))


def test_kernel_inputs_are_built_by_the_first_call_that_runs_a_kernel(monkeypatch):
    """Calls that dequantize (fp16 activations, more than native.TILES_MAX_TOKENS tokens) never build NF4's block
    scales; the first call that runs a kernel does, once per weight."""
    built, original = [], dq.NF4.kernel_inputs
    monkeypatch.setattr(dq.NF4, "kernel_inputs", lambda f, inner: built.append(1) or original(f, inner))
    monkeypatch.setattr(native, "TILES_MAX_TOKENS", 8)
    q = dq.quantize(weight((64, 2048), seed=1), dq.NF4())
    F.linear(weight((16, 2048), seed=2), q)
    F.linear(weight((1, 2048), seed=2, dtype=torch.float16), q)
    assert not built
    F.linear(weight((1, 2048), seed=2), q)
    F.linear(weight((5, 2048), seed=3), q)
    F.linear(weight((2, 2048), seed=3, dtype=torch.float32), q)
    assert len(built) == 1


@pytest.mark.parametrize("fmt", [dq.NF4(), dq.Float8Rowwise(), dq.Int8Rowwise()], ids=str)
def test_weight_made_in_inference_mode(fmt):
    """A weight quantized under ``torch.inference_mode`` (no version counter) decodes, and an in-place load into it
    there is seen: its kernel inputs are not cached against versions it does not have."""
    x = weight((1, 2048), seed=2)
    with torch.inference_mode():
        q = dq.quantize(weight((64, 2048), seed=1), fmt)
        other = dq.quantize(weight((64, 2048), seed=7) * 3, fmt)
        assert_close(F.linear(x, q), x, q.dequantize(torch.bfloat16))
        q.copy_(other)
        assert_close(F.linear(x, q), x, other.dequantize(torch.bfloat16))


@pytest.mark.parametrize("fmt", [dq.NF4(), dq.Float8Rowwise(), dq.Int4Groupwise(128)], ids=str)
def test_writes_through_one_view_reach_kernels_of_another(fmt):
    """Inner views made inside dispatch keep version counters of their own: a write into a weight after a linear
    of a kept row view, and a write into that view after a linear of the weight, are both seen by the next linear
    (compared with a clone, whose kernel inputs are new)."""
    x = weight((1, 2048), seed=2)
    q, other, third = (dq.quantize(weight((256, 2048), seed=s) * (s + 1), fmt) for s in (1, 5, 9))
    view = q[:128]
    F.linear(x, q), F.linear(x, view)
    q.copy_(other)
    assert torch.equal(F.linear(x, view), F.linear(x, other[:128].clone()))
    if not isinstance(fmt, dq.NF4):  # NF4's shared mean refuses a write into rows from another weight
        view.copy_(third[:128])
        assert torch.equal(F.linear(x, q), F.linear(x, q.clone()))
        assert not torch.equal(F.linear(x, q), F.linear(x, other))


def test_a_weight_the_kernel_cannot_read_is_said_once(caplog):
    """NF4's wo column shard at TP 2 (TinyLlama's [2048, 2048], few rows kept: a factor spans 8 whole rows): the
    kernel cannot run on it, so every matmul dequantizes it; that is said once per format and shape, with the
    way out."""
    q = dq.quantize(weight((40, 2048), seed=3), dq.NF4())
    piece = q[:, :1024]
    x = weight((1, 1024), seed=4)
    with caplog.at_level(logging.WARNING, logger="dtensor_quant._ops.matmul"):
        for _ in range(3):
            assert torch.equal(F.linear(x, piece), x @ piece.dequantize().t())
    said = [r.getMessage() for r in caplog.records if "every matmul dequantizes" in r.getMessage()]
    assert len(said) == 1 and "[40, 1024]" in said[0] and "adapt_tp_plan" in said[0], said


@pytest.mark.parametrize("cap", [1, 3])
def test_max_level_caps_every_kernel_and_keeps_the_bits(monkeypatch, cap):
    """``DTENSOR_QUANT_MAX_LEVEL`` (``native.MAX_LEVEL``): the tiles run at most at the cap, the same weights
    summed in that level's order (each within the bound of the exact product)."""
    q = dq.quantize(weight((256, 2048), 11), dq.NF4())
    x = weight((8, 2048), 12)
    dense = q.dequantize(torch.float64)
    exact = x.double() @ dense.t()
    bound = linear_error_bound(x, dense, out_dtype=torch.bfloat16)
    levels = []
    level_out = native.level_out
    monkeypatch.setattr(native, "level_out", lambda: levels.append(level_out()) or levels[-1])
    monkeypatch.setattr(native, "MAX_LEVEL", cap)
    capped = F.linear(x, q)
    assert levels and all(0 < int(ran) <= cap for ran in levels), [int(r) for r in levels]
    assert_within(capped, exact, bound, f"capped at level {cap}")


@pytest.mark.parametrize("value", ["0", "5", "amx"])
def test_a_max_level_that_names_no_level_is_refused(monkeypatch, value):
    monkeypatch.setenv("DTENSOR_QUANT_MAX_LEVEL", value)
    with pytest.raises(ValueError, match=rf"DTENSOR_QUANT_MAX_LEVEL={value!r} is not a value it takes.*1 AVX2.*4 AMX"):
        native.max_level_from_env()
    monkeypatch.setenv("DTENSOR_QUANT_MAX_LEVEL", "2")
    assert native.max_level_from_env() == 2


def test_scratch_is_per_thread_and_per_shape():
    """``native.scratch`` hands a thread back its own buffer for a shape (no allocation per call), never another
    thread's, and a new one for another shape or dtype."""
    import threading

    a = native.scratch((3, 1), torch.float32)
    assert native.scratch((3, 1), torch.float32) is a
    assert a.shape == (3, 1) and a.dtype == torch.float32
    assert native.scratch((4, 1), torch.float32) is not a
    assert native.scratch((3, 1), torch.int64).dtype == torch.int64
    other = []
    t = threading.Thread(target=lambda: other.append(native.scratch((3, 1), torch.float32)))
    t.start()
    t.join()
    assert other[0] is not a and other[0].data_ptr() != a.data_ptr()


@pytest.mark.parametrize("spelling", ["int8-token", "fp8-token"])
def test_activation_linear_after_other_token_counts(spelling):
    """The activation kernels' per-token scales live in per-thread scratch: calls with other token counts in
    between leave each result equal to the same call made first (nothing stale read back)."""
    torch.manual_seed(0)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    kind = dq.Int8Rowwise if spelling.startswith("int8") else dq.Float8Rowwise
    fmt = kind(activations=spelling)
    q = dq.quantize(w, fmt)
    xs = [torch.randn(t, 128, dtype=torch.bfloat16) * (i + 1) for i, t in enumerate((1, 5, 32, 5, 1))]
    forward = [F.linear(x, q) for x in xs]
    backward = [F.linear(x, q) for x in reversed(xs)][::-1]
    for x, a, b in zip(xs, forward, backward):
        assert torch.equal(a, b)
        if spelling.startswith("int8"):  # the integer reference: bit for bit
            ref = activations.reference_linear(x, q.qdata, q.scale, fmt.activation_scheme)
            assert torch.equal(a, ref)
