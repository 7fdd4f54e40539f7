"""Matmul on quantized weights (one process): torch's CPU kernels agree with dequantize + mm.

Every case compares against ``x @ W.dequantize().T`` computed in float32 from
the same quantized weight, so the only difference allowed is the kernel's
accumulation order (and the rounding of the output dtype).
"""

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant.formats import float8, int4_zero, nf4
from dtensor_quant.testing import FORMATS, has_kernel, weight, where

KERNELS = list(where(has_kernel))  # the formats with a matmul kernel of their own
# dtensor_quant.native's one-token kernels (tests/test_fused_kernels.py): 1-4 bf16 tokens, AVX-512, a C++ compiler.
FUSED = (
    dq.NF4,
    dq.BnbNF4,
    dq.MXFP4,
    dq.Int4GroupwiseIntZero,
    dq.Float8Rowwise,
    dq.Float8Tensorwise,
    dq.Float8Blockwise,
)


def fused_kernels_here():
    return all(k.kernel() is not None for k in (nf4, float8, int4_zero))


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class KernelSpy:
    """Counts calls in which the format's kernel (``fmt.linear``) ran instead of dequantize + mm."""

    def __init__(self, monkeypatch, fmt):
        self.ran, original = 0, type(fmt).linear

        def spy(f, x, prepared, bias):
            out = original(f, x, prepared, bias)
            self.ran += out is not None
            return out

        monkeypatch.setattr(type(fmt), "linear", spy)


def reference(x, q, bias=None):
    out = x.float() @ q.dequantize(torch.float32).t()
    return out + bias.float() if bias is not None else out


def assert_close(actual, expected, dtype):
    scale = expected.abs().max().clamp(min=1)
    err = (actual.float() - expected).abs().max() / scale
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e} in {dtype}"


@pytest.mark.parametrize("fmt_name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_kernel_matches_dequantize(monkeypatch, fmt_name, dtype, batch):
    """bf16: torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu (and NF4/float8's fused kernels, 1-4
    tokens), equal to dequantize + mm up to rounding.

    fp32/fp16 dequantize (torch's CPU kernels are slow outside bf16): the same math, exactly.
    """
    q = dq.quantize(weight((64, 256), seed=1, dtype=dtype), FORMATS[fmt_name])
    x = weight((batch, 256), seed=2, dtype=dtype)
    bias = weight((64,), seed=3, dtype=dtype)
    kernel = KernelSpy(monkeypatch, q.fmt)
    out = F.linear(x, q, bias)
    runs = dtype == torch.bfloat16 and (not isinstance(q.fmt, FUSED) or (batch <= 4 and fused_kernels_here()))
    assert kernel.ran == runs, f"{fmt_name} in {dtype}: kernel ran {kernel.ran} times"
    if dtype != torch.bfloat16:
        assert torch.equal(out, x @ q.dequantize().t() + bias)
    assert out.dtype == dtype and out.shape == (batch, 64)
    assert_close(out, reference(x, q, bias), dtype)


@pytest.mark.parametrize(
    "fmt_name,shape",
    [("int8", (64, 36)), ("int4g32", (24, 64)), ("int4g32", (32, 48)), ("int4g32", (32, 80))],
)
def test_fallback_where_the_kernel_cannot_run(monkeypatch, fmt_name, shape):
    """in % 8 (int8: the kernel would read past rows), out % 16 or a partial group (int4): dequantize + mm."""
    q = dq.quantize(weight(shape, seed=1), FORMATS[fmt_name])
    x = weight((3, shape[1]), seed=2)
    kernel = KernelSpy(monkeypatch, q.fmt)
    out = F.linear(x, q)
    assert kernel.ran == 0
    assert torch.equal(out, x @ q.dequantize().t())


class CountPrepare:
    """Counts ``fmt.prepare`` calls (the weight repacking the cache exists to avoid)."""

    def __init__(self, monkeypatch, cls):
        self.calls, original = 0, cls.prepare

        def counting(fmt, inner):
            self.calls += 1
            return original(fmt, inner)

        monkeypatch.setattr(cls, "prepare", counting)


def test_prepared_weight_is_cached_and_rebuilt_after_in_place_updates(monkeypatch):
    fmt = dq.Int4Groupwise(32)
    count = CountPrepare(monkeypatch, dq.Int4Groupwise)
    q = dq.quantize(weight((32, 128), seed=1), fmt)
    x = weight((2, 128), seed=2)
    y = F.linear(x, q)
    F.linear(x[:1], q)
    assert count.calls == 1
    other = dq.quantize(weight((32, 128), seed=7), fmt)
    q.copy_(other)  # e.g. a checkpoint load: same storage, new bytes
    z = F.linear(x, q)
    assert count.calls == 2
    assert torch.equal(z, F.linear(x, other)) and not torch.equal(y, z)


@pytest.mark.parametrize("fmt_name", ["int8", "int4g32"])
def test_batched_activations(monkeypatch, fmt_name):
    """3-D/4-D inputs: folded to mm when contiguous, expand + bmm when not; same numbers either way."""
    q = dq.quantize(weight((64, 128), seed=1), FORMATS[fmt_name])
    kernel = KernelSpy(monkeypatch, q.fmt)
    x = weight((3, 2, 5, 128), seed=2)
    expected = reference(x, q)
    cases = {
        "3-D": (x[0], expected[0]),
        "4-D": (x, expected),
        "3-D transposed": (x[0].transpose(0, 1), expected[0].transpose(0, 1)),
        "4-D transposed": (x.transpose(1, 2), expected.transpose(1, 2)),
    }
    for name, (inp, exp) in cases.items():
        ran = kernel.ran
        out = F.linear(inp, q)
        assert kernel.ran == ran + 1, f"{name}: no kernel"
        assert_close(out, exp, torch.bfloat16)
        assert_close(torch.matmul(inp, q.t()), exp, torch.bfloat16)
    xt = x[0].transpose(0, 1)
    assert_close(torch.bmm(xt.contiguous(), q.t().expand(2, 128, 64)), expected[0].transpose(0, 1), torch.bfloat16)
    bias = weight((1, 1, 64), seed=3)
    out = torch.baddbmm(bias, xt.contiguous(), q.t().expand(2, 128, 64))
    assert_close(out, expected[0].transpose(0, 1) + bias.float(), torch.bfloat16)


def test_batched_refusals():
    q = dq.quantize(weight((64, 128)), dq.Int8Rowwise())
    with pytest.raises(NotImplementedError, match="broadcast"):
        q.expand(2, 128, 64)  # a different matrix shape: not a broadcast of q
    with pytest.raises(NotImplementedError, match="broadcast"):
        torch.bmm(q.t().expand(2, 128, 64), q.t().expand(2, 128, 64).transpose(1, 2))


def test_weight_grad_input_path_dequantizes():
    """The input gradient (``grad @ W``) of a frozen quantized weight."""
    q = dq.quantize(weight((64, 128), seed=1), dq.Int4Groupwise(32))
    x = weight((4, 128), seed=2).float().requires_grad_()
    qf = dq.quantize(weight((64, 128), seed=1).float(), dq.Int4Groupwise(32))
    F.linear(x, qf).sum().backward()
    assert torch.allclose(x.grad, qf.dequantize().sum(0).expand(4, -1))
    assert q.dtype == torch.bfloat16
    xb = x.detach().bfloat16().requires_grad_()  # the bf16 path: the kernel forward, grad @ W backward
    F.linear(xb, q).sum().backward()
    assert_close(xb.grad, q.dequantize().float().sum(0).expand(4, -1), torch.bfloat16)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fmt_name", ["int8", "int4g32"])
def test_compiled_linear_reuses_the_prepared_weight(monkeypatch, backend, fmt_name):
    """Compiled, the kernel is one opaque op: same numbers, and the weight is not repacked per call."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    fmt = FORMATS[fmt_name]
    count = CountPrepare(monkeypatch, type(fmt))
    q = torch.nn.Parameter(dq.quantize(weight((64, 128), seed=1), fmt), requires_grad=False)
    x = weight((4, 128), seed=2)
    eager = F.linear(x, q)
    recorder = AotEagerAndRecordGraphs() if backend == "aot_eager" else backend
    compiled = torch.compile(lambda x: F.linear(x, q), backend=recorder)
    for _ in range(3):
        assert torch.equal(compiled(x), eager)
    assert count.calls == 1, f"prepared {count.calls} times"
    if backend == "aot_eager":
        targets = [str(n.target) for g in recorder.fw_graphs for n in g.graph.nodes]
        assert "dtensor_quant.kernel_linear.default" in targets, targets
