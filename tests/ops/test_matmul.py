"""ops/matmul on one process: torch's CPU kernels agree with dequantize + mm.

Every case compares against the exact product of the weight's dequantized
values (float64), within the bound of an fp32 sum in any order, rounded to
the output dtype (:func:`dtensor_quant.testing.linear_error_bound`): the
kernel's accumulation order is its own and changes with the CPU (torch's
int8/int4 kernels are vectorized per CPU capability). Where the library takes
the same dequantize + mm as the test, the results are compared bit for bit.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._core import native
from dtensor_quant._core.reductions import block_reduce, expand_blocks
from dtensor_quant._formats import float8, int4, int4_zero, int8, nf4
from dtensor_quant.testing import (
    FORMATS,
    assert_within,
    gamma,
    has_kernel,
    linear_error_bound,
    unit_roundoff,
    weight,
    where,
)
from tests.support.format_cases import int8_codes

KERNELS = list(where(has_kernel))  # the formats with a matmul kernel of their own
# dtensor_quant._core.native's kernels (tests/core/test_native.py, tests/core/test_native_tiles.py): bf16 and fp32
# activations, an x86 CPU, a C++ compiler; int8/int4 also have torch's kernels for 1 (int4: 1-2) bf16 tokens.
NATIVE = {dq.NF4: nf4, dq.BnbNF4: nf4, dq.NF4BlockScales: nf4, dq.MXFP4: nf4, dq.Int4GroupwiseIntZero: int4_zero,
          dq.Float8Rowwise: float8, dq.Float8Tensorwise: float8, dq.Float8Blockwise: float8, dq.Int4Groupwise: int4,
          dq.Int8Rowwise: int8}  # fmt: skip


def kernel_runs(fmt, dtype, batch):
    """Whether F.linear runs a kernel (rather than dequantize + mm) for this 64 x 256 weight."""
    if dtype == torch.float16:
        return False
    torchs = dtype == torch.bfloat16 and batch <= {dq.Int8Rowwise: 1, dq.Int4Groupwise: 2}.get(type(fmt), 0)
    return torchs or NATIVE[type(fmt)].kernel() is not None


class KernelSpy:
    """Counts calls in which the format's kernel (``fmt.linear``) ran instead of dequantize + mm."""

    def __init__(self, monkeypatch, fmt):
        self.ran, original = 0, type(fmt).linear

        def spy(f, x, prepared, bias):
            out = original(f, x, prepared, bias)
            self.ran += out is not None
            return out

        monkeypatch.setattr(type(fmt), "linear", spy)


def assert_kernel_close(out, x, q, bias=None, what=""):
    """``out`` is ``x @ W.T`` (then ``+ bias``) for ``q``'s weight, by a kernel or by dequantize + mm.

    Bound: an fp32 sum of the products in any order, rounded to ``out``'s dtype, then the bias added in
    that dtype. A kernel may use the weight's values before they are rounded to the weight's dtype
    (int4: ``(code - 8) * scale + zero`` in fp32, possibly regrouped): ``weight_error`` covers that
    (one rounding of the dequantized value, and a few fp32 roundings of terms within twice the row's
    largest value).
    """
    w32 = q.dequantize(torch.float32)
    w_err = unit_roundoff(q.dtype) * w32.abs() + gamma(4) * 2 * w32.abs().amax(dim=1, keepdim=True)
    exact = x.double() @ w32.double().t()
    bound = linear_error_bound(x, w32, out_dtype=out.dtype, weight_error=w_err)
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + unit_roundoff(out.dtype) * (exact.abs() + bound)
    assert_within(out, exact, bound, what or f"{q.fmt} in {out.dtype}")


@pytest.mark.parametrize("fmt_name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_kernel_matches_dequantize(monkeypatch, fmt_name, dtype, batch):
    """bf16: torch's _weight_int8pack_mm (1 token) / _weight_int4pack_mm_for_cpu (1-2 tokens), else this library's
    tiled kernels; NF4/float8's one-token kernels for 1 token; fp32: the tiled kernels. All equal to dequantize + mm up
    to rounding. fp16 dequantizes: the same math, exactly.
    """
    q = dq.quantize(weight((64, 256), seed=1, dtype=dtype), FORMATS[fmt_name])
    x = weight((batch, 256), seed=2, dtype=dtype)
    bias = weight((64,), seed=3, dtype=dtype)
    kernel = KernelSpy(monkeypatch, q.fmt)
    out = F.linear(x, q, bias)
    runs = kernel_runs(q.fmt, dtype, batch)
    assert kernel.ran == runs, f"{fmt_name} in {dtype}: kernel ran {kernel.ran} times"
    if dtype == torch.float16:
        assert torch.equal(out, x @ q.dequantize().t() + bias)
    assert out.dtype == dtype and out.shape == (batch, 64)
    assert_kernel_close(out, x, q, bias)


@pytest.mark.parametrize(
    "fmt_name,shape",
    [("int8", (64, 36)), ("int8", (64, 40)), ("int4g32", (32, 48)), ("int4g32", (32, 80))],
)
def test_fallback_where_the_kernel_cannot_run(monkeypatch, fmt_name, shape):
    """Three tokens: in % 32 (the tiled kernels; int8's torch kernel would also read past rows unless in % 8) or a
    partial group (int4): dequantize + mm."""
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
    cases = {"3-D": x[0], "4-D": x, "3-D transposed": x[0].transpose(0, 1), "4-D transposed": x.transpose(1, 2)}
    for name, inp in cases.items():
        ran = kernel.ran
        out = F.linear(inp, q)
        if native.enabled():  # bf16 at 5-10 tokens: the library's tiles (DTENSOR_QUANT_NATIVE=0: dequantize + mm)
            assert kernel.ran == ran + 1, f"{name}: no kernel"
        assert_kernel_close(out, inp, q, what=name)
        assert_kernel_close(torch.matmul(inp, q.t()), inp, q, what=f"{name} matmul")
    xt = x[0].transpose(0, 1).contiguous()
    assert_kernel_close(torch.bmm(xt, q.t().expand(2, 128, 64)), xt, q, what="bmm")
    bias = weight((1, 1, 64), seed=3)
    out = torch.baddbmm(bias, xt, q.t().expand(2, 128, 64))
    assert_kernel_close(out, xt, q, bias, what="baddbmm")


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
    ones = torch.ones(4, 64)
    # grad @ W: each entry a 64-term fp32 sum of a column, as is the test's sum(0), each in its own order
    assert_within(x.grad, qf.dequantize().sum(0).expand(4, -1), 2 * linear_error_bound(ones, qf.dequantize().t()))
    assert q.dtype == torch.bfloat16
    xb = x.detach().bfloat16().requires_grad_()  # the bf16 path: the kernel forward, grad @ W backward
    F.linear(xb, q).sum().backward()
    w = q.dequantize()
    exact = ones.double() @ w.double()
    assert_within(xb.grad, exact, linear_error_bound(ones.bfloat16(), w.t(), out_dtype=torch.bfloat16), "bf16")


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


def test_record_paths_counts_each_matmuls_path():
    """record_paths says which path each matmul with a quantized weight took: the format's kernel or dequantize."""
    from dtensor_quant._ops.matmul import record_paths

    q = dq.quantize(weight((64, 256), seed=1), dq.Int8Rowwise())
    with record_paths() as paths:
        F.linear(weight((1, 256), seed=2), q)  # torch's int8 kernel
        F.linear(weight((1, 256), seed=2, dtype=torch.float16), q)  # no fp16 kernel: dequantize + mm
        weight((1, 64), seed=3) @ q  # grad @ W's orientation: dequantize + mm
    F.linear(weight((1, 256), seed=2), q)  # outside the block: not counted
    assert dict(paths) == {("Int8Rowwise()", "kernel"): 1, ("Int8Rowwise()", "dequantize"): 2}


@pytest.mark.parametrize(
    "fmt",
    [
        dq.Int8Rowwise(),
        dq.Int4Groupwise(32),
        dq.NF4(32, 4),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(16),
    ],
    ids=str,
)
def test_quantized_linear_matches_dequantized(fmt):
    """F.linear on a quantized weight (kernel or fallback) agrees with the dequantized weight."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = torch.randn(4, 7, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).requires_grad_()
    q = dq.quantize(w, fmt)
    out = torch.nn.functional.linear(x, q)
    # bf16 kernels sum (and may scale) in orders of their own: within the summation's bound, elementwise
    assert_kernel_close(out, x, q)
    out.float().sum().backward()
    ones, dense = torch.ones(4, 7, 32, dtype=torch.bfloat16), q.dequantize()
    exact = ones.double() @ dense.double()  # grad @ W: 32-term sums, rounded to bf16
    assert_within(x.grad, exact, linear_error_bound(ones, dense.t(), out_dtype=torch.bfloat16), "input gradient")


@dataclass(frozen=True)
class _ScaleFirstRowBlockInt8(dq.QuantFormat):
    """One int8 scale per 4 rows, listed first: the first inner tensor has 1/4 of the weight's rows."""

    layout = {"scale": (dq.Blocked(4), dq.Constant()), "qdata": (dq.OneToOne(), dq.OneToOne())}

    def quantize(self, weight, reduce):
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, 4, "max")
        scale = (reduce(amax, "max", "scale") / 127).clamp(min=1e-12).to(weight.dtype)
        return {"scale": scale, "qdata": int8_codes(weight, expand_blocks(scale, 0, 4, weight.shape[0]))}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


def test_linear_fallback_takes_its_width_from_the_weight_not_the_first_inner_tensor():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(6))
    q = dq.quantize(w, _ScaleFirstRowBlockInt8())
    # the fallback's matmul against the test's: within the fp32 summation bound (another order may apply)
    assert_within(torch.nn.functional.linear(x, q), x @ q.dequantize().t(), 2 * linear_error_bound(x, q.dequantize()))


def test_matmul_refusals_are_unsupported_op_errors():
    """The matmul handlers raise the library's op error, like every other op a layout cannot express."""
    q = dq.quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).bfloat16(), dq.Int8Rowwise())
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    cases = {
        "mm of two quantized tensors": lambda: torch.mm(q, q.t()),
        "addmm with a quantized bias": lambda: torch.addmm(q, x, q.t()),
        "would repeat quantized elements": lambda: q.expand(2, 16, 64),
    }
    for match, fn in cases.items():
        with pytest.raises(dq.UnsupportedOpError, match=match) as info:
            fn()
        assert str(info.value).startswith("dtensor_quant: ")


@pytest.mark.parametrize("group_size", [2, 16, 512])
def test_int4_matmul_falls_back_where_the_kernel_refuses_the_group_size(group_size):
    w = torch.randn(32, 1024).bfloat16()
    q = dq.quantize(w, dq.Int4Groupwise(group_size))
    x = torch.randn(3, 1024).bfloat16()
    assert torch.equal(torch.nn.functional.linear(x, q), torch.nn.functional.linear(x, q.dequantize()))


@pytest.mark.parametrize("fmt", [dq.Int8Rowwise(), dq.Int4Groupwise(64), dq.NF4(64, 256), dq.Float8Rowwise()], ids=str)
def test_selected_expert_takes_the_linear_kernels(fmt):
    w = weight((3, 64, 512), seed=2)
    q = dq.quantize(w, fmt)
    x = weight((5, 512), seed=3)
    for e in range(3):
        expected = F.linear(x, dq.quantize(w[e], fmt))
        assert torch.equal(F.linear(x, q[e]), expected)  # same kernel, same bits
        assert torch.equal(F.linear(x, q.transpose(1, 2)[e].t()), expected)


@pytest.mark.parametrize("fmt", [dq.Int8Rowwise(), dq.NF4(64, 256)], ids=str)
def test_grouped_mm_matches_a_loop_over_experts(fmt):
    w = weight((4, 64, 512), seed=4)
    q = dq.quantize(w, fmt)
    x = weight((10, 512), seed=5)
    offs = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # expert 1 gets no rows; row 9 is past the end
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    starts = [0, 3, 3, 7]
    for g in range(4):
        s, e = starts[g], int(offs[g])
        assert torch.equal(out[s:e], F.linear(x[s:e], q[g]))
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))
    x3 = weight((4, 2, 512), seed=6)
    out3 = torch._grouped_mm(x3, q.transpose(-2, -1))
    assert all(torch.equal(out3[g], F.linear(x3[g], q[g])) for g in range(4))


def test_grouped_mm_refuses_invalid_offs():
    """Before: decreasing offs dropped groups and ends past the input returned other row counts, silently."""
    q = dq.quantize(weight((3, 64, 512), seed=4), dq.Int8Rowwise())
    x = weight((10, 512), seed=5)
    cases = {
        "non-decreasing": torch.tensor([4, 2, 9], dtype=torch.int32),  # group 1 would be dropped: 8 rows of 10
        "non-negative": torch.tensor([-2, 3, 9], dtype=torch.int32),
        "past the input's 10 rows": torch.tensor([3, 7, 12], dtype=torch.int32),  # 12 rows out of 10 in
        "integer tensor": torch.tensor([3.0, 7.0, 9.0]),
        r"one end per expert \(3\)": torch.tensor([3, 9], dtype=torch.int32),
    }
    for words, offs in cases.items():
        with pytest.raises(ValueError, match=words):
            torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=torch.tensor([0, 10, 10]))  # int64 and empty groups: fine
    assert out.shape == (10, 64) and torch.equal(out, F.linear(x, q[1]))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("fmt", [dq.NF4(), dq.Float8Rowwise(), dq.Int4Groupwise(128), dq.Int8Rowwise()], ids=str)
def test_moe_layer_runs_each_experts_tokens_through_kernels_without_a_dense_expert(monkeypatch, fmt, impl):
    """A MixtralExperts layer at Qwen3-30B-A3B's widths (H 2048, I 768; 4 experts), 12 tokens top-2: both the
    eager per-expert loop and grouped_mm run every expert's rows through the format's kernels (one-token or
    tiled) and never dequantize an expert; the output is the dequantized layer's within the kernels' rounding."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from dtensor_quant._core import native
    from dtensor_quant._ops.matmul import record_paths

    if not native.enabled():
        pytest.skip("DTENSOR_QUANT_NATIVE=0: no kernels, so every expert dequantizes (tests/core/test_native_tiles.py)")
    cfg = MixtralConfig(hidden_size=2048, intermediate_size=768, num_local_experts=4)
    torch.manual_seed(0)
    layer = MixtralExperts(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(layer.gate_up_proj, std=0.02)
    torch.nn.init.normal_(layer.down_proj, std=0.02)
    reference = copy.deepcopy(layer)
    dq.quantize_(layer, fmt)
    for name in ("gate_up_proj", "down_proj"):
        getattr(reference, name).data = getattr(layer, name).dequantize()
    for m in (layer, reference):
        m.config._experts_implementation = impl
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 2048, generator=g).to(torch.bfloat16)
    weights, index = torch.randn(12, 4, generator=g).softmax(-1).topk(2, dim=-1)
    weights = weights.to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x, index, weights)

        def refuse(*args, **kwargs):
            raise AssertionError("a dense expert was made")

        monkeypatch.setattr(type(fmt), "dequantize", refuse)
        monkeypatch.setattr(type(fmt), "unpack", refuse)
        with record_paths() as paths:
            out = layer(x, index, weights)
    assert set(paths) == {(str(fmt), "kernel")} and paths[(str(fmt), "kernel")] == 2 * len(index.unique())
    ref = expected.float()
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_prepared_weight_fast_slot_sees_every_write(monkeypatch):
    """The cache's identity slot (the same format and inner tensor objects as the last call) is checked by what a
    write changes: an in-place write into an inner tensor (its version), new storage swapped in under the same
    tensor object (``.data =``: its address, the version kept) and a write through the library (the bytes'
    stamp) each rebuild the prepared weight; views alternating with the weight keep their own keyed entries."""
    fmt = dq.Int8Rowwise()
    count = CountPrepare(monkeypatch, dq.Int8Rowwise)
    q = dq.quantize(weight((32, 128), seed=1), fmt)
    x = weight((2, 128), seed=2)
    y = F.linear(x, q)
    for _ in range(3):
        assert torch.equal(F.linear(x, q), y)
    assert count.calls == 1
    q.qdata.neg_()  # in place: the version moves
    assert torch.equal(F.linear(x, q), x @ q.dequantize().t()) and count.calls == 2
    version = q.qdata._version
    q.qdata.data = q.qdata.data.neg()  # new storage, same object, same version
    assert q.qdata._version == version
    assert torch.equal(F.linear(x, q), y) and count.calls == 3
    other = dq.quantize(weight((32, 128), seed=7), fmt)
    expected = F.linear(x, other)
    q.copy_(other)  # through the library: the bytes' stamp moves
    calls = count.calls
    assert torch.equal(F.linear(x, q), expected) and count.calls == calls + 1
    top = q[:16]  # a view of the same bytes: its own entry, then both cached
    for _ in range(2):
        F.linear(x, top), F.linear(x, q)
    assert count.calls == calls + 2
