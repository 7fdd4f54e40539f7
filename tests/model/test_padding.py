"""model/padding: zero-padding a SwiGLU MLP for a tensor-parallel degree its group size forbids (Qwen2-72B's 29568).

int4 g128 holds 29568 = 231 groups: the down-projection's columns cannot be
split at TP 2, 4 or 8. Padded to 29696 (232 groups) they can, and the padded
MLP computes the unpadded one's function: its original bytes are untouched,
its padded hidden units are exact zeros on any machine, and its output sums
the same nonzero products as the unpadded one's. Which order the CPU's GEMM
sums them in depends on the reduction length and the CPU (MKL blocks fp32
differently under AVX-512 and AVX2: 29696 vs 29568 columns, or a
row-parallel all-reduce, regroups the terms), so outputs are compared within
the bound of that summation (:mod:`dtensor_quant.testing.bounds`), computed
from the actual operands, not bit for bit.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import dtensor_quant as dq
from dtensor_quant._model.padding import mlp_padding, pad_for_tp
from dtensor_quant.testing import assert_same_bits, assert_within, linear_error_bound, unit_roundoff

INTER, HIDDEN = 29568, 64


INT4 = dq.Int4Groupwise(128)


class MLP(nn.Module):
    def __init__(self, hidden=HIDDEN, inter=INTER, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp(dtype=torch.float32, bias=False) -> MLP:
    torch.manual_seed(0)
    return MLP(bias=bias).to(dtype)


def inputs(dtype=torch.float32):
    return torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)


def values(t):
    """The dense values a matmul with ``t`` multiplies (a quantized weight's, a DTensor's whole)."""
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.dequantize() if isinstance(t, dq.QuantizedTensor) else t


def projections(model, x, tp_mesh=None):
    """``(gate(x), up(x), silu(gate(x)) * up(x))``, whole (gathered from the column-parallel ranks' shards)."""
    g, u = model.gate_proj(x), model.up_proj(x)
    out = (g, u, F.silu(g) * u)
    if tp_mesh is None:
        return out
    return tuple(DTensor.from_local(t, tp_mesh, [Shard(t.ndim - 1)]).full_tensor() for t in out)


def down_bound(model, h, dtype, ranks=1):
    """Bound on ``|down(h) computed - exact|``: fp32 sums in any order; bf16 rounds each rank's partial
    sum and each step of the all-reduce too (``ranks`` of them)."""
    w, b = values(model.down_proj.weight), model.down_proj.bias
    b = values(b) if b is not None else None
    bound = linear_error_bound(h, w, b, out_dtype=dtype)
    if ranks > 1 and dtype != torch.float32:
        terms = h.double().abs() @ w.double().abs().t() + (b.double().abs() if b is not None else 0)
        bound = bound + ranks * unit_roundoff(dtype) * terms * 2
    return bound


def assert_same_function(padded, ref, x, tp_mesh=None):
    """The padded MLP (``ranks``-way TP or one process) computes the unpadded one-process MLP's function.

    Exact on any machine: the padded hidden units are zeros (zero weight rows and bias: silu(0) * 0).
    Within the summation's bound: gate and up (64 products each, blocked by another output width) and
    the output: ``|y - y_ref| <= bound(y) + bound(y_ref) + |W_down| @ |h - h_ref|``, the last term
    carrying the hidden units' own measured difference through the down projection.
    """
    dtype, ranks = x.dtype, tp_mesh.size() if tp_mesh is not None else 1
    with torch.no_grad():
        g, u, h = projections(padded, x, tp_mesh)
        g0, u0, h0 = projections(ref, x)
        y, y0 = padded(x), ref(x)
    assert h[:, INTER:].count_nonzero() == 0, "a padded hidden unit is not an exact zero"
    for name, a, b in (("gate_proj", g, g0), ("up_proj", u, u0)):
        lin = ref.get_submodule(name)
        bias = lin.bias.detach() if lin.bias is not None else None
        assert_within(a[:, :INTER], b, 2 * linear_error_bound(x, values(lin.weight), bias), name)
    w0 = values(ref.down_proj.weight).double().abs()
    carried = (h[:, :INTER].double() - h0.double()).abs() @ w0.t()
    bound = down_bound(padded, h, dtype, ranks) + down_bound(ref, h0, dtype) + carried
    assert_within(y, y0, bound, f"output at TP {ranks}" if ranks > 1 else "output")


def test_padding_for_qwen2_72b_int4_g128():
    assert mlp_padding(INTER, HIDDEN, INT4, 1) == INTER
    for tp in (2, 4, 8):
        assert mlp_padding(INTER, HIDDEN, INT4, tp) == 29696  # 232 groups: equal, whole-group shards
    with pytest.raises(dq.LayoutError):
        dq.check_placements((HIDDEN, INTER), INT4, (2,), [Shard(1)])
    dq.check_placements((HIDDEN, 29696), INT4, (8,), [Shard(1)])


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("bias", [False, True])
def test_padded_output_is_the_unpadded_function_fp32(when, bias):
    model = mlp(bias=bias)
    ref = dq.quantize_(copy.deepcopy(model), INT4)
    padded = copy.deepcopy(model) if when == "before" else copy.deepcopy(ref)
    assert pad_for_tp(padded, 4, INT4) == {"": (INTER, 29696)}
    if when == "before":
        dq.quantize_(padded, INT4)
    assert padded.gate_proj.weight.shape == (29696, HIDDEN) and padded.down_proj.weight.shape == (HIDDEN, 29696)
    assert padded.tp_padding.tolist() == [INTER, 29696]
    # the original rows and columns keep their quantized bytes; the padding dequantizes to zeros
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        w, w0 = padded.get_submodule(name).weight, ref.get_submodule(name).weight
        assert_same_bits(w.narrow(dim, 0, INTER), w0, name)
        assert w.narrow(dim, INTER, 29696 - INTER).dequantize().count_nonzero() == 0
    assert_same_function(padded, ref, inputs())


def test_padded_output_is_the_unpadded_function_bf16():
    """bf16: the CPU bf16 matmul blocks a longer K differently, and each result rounds to bf16."""
    model = mlp(torch.bfloat16)
    ref = dq.quantize_(copy.deepcopy(model), INT4)
    padded = copy.deepcopy(ref)
    pad_for_tp(padded, 2, INT4)
    assert_same_function(padded, ref, inputs(torch.bfloat16))


def test_pad_refused_where_inexact():
    """NF4's mean is over the whole weight and its zero blocks are not exact zeros: refused, with why."""
    # 960 = 15 blocks of 64 cannot be halved; 1024 can, but NF4's quantized weights cannot be padded to it
    model = dq.quantize_(MLP(hidden=64, inter=960).to(torch.bfloat16), dq.NF4())
    assert mlp_padding(960, 64, dq.NF4(), 2) == 1024
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"exact zeros|statistics|Pad the dense model"):
        pad_for_tp(model, 2, dq.NF4())
    assert all(p is before[n] for n, p in model.named_parameters())
    assert model.down_proj.in_features == 960 and not list(model.buffers())  # no padding recorded
    # NF4 at TP 3 would need an intermediate size far out of reach: said, and nothing changed
    model = dq.quantize_(MLP(hidden=8, inter=1024).to(torch.bfloat16), dq.NF4())
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no intermediate size up to"):
        pad_for_tp(model, 3, dq.NF4())
    assert all(p is before[n] for n, p in model.named_parameters())


def test_pad_for_tp_on_meta():
    """A model built on meta (to load a checkpoint into) pads like a real one; before: Tensor.item() on meta."""
    with torch.device("meta"):
        meta = MLP()
        meta_nf4 = MLP(hidden=64, inter=960).to(torch.bfloat16)
    real = dq.quantize_(mlp(), INT4)
    dq.quantize_(meta, INT4)
    assert pad_for_tp(meta, 2, INT4) == pad_for_tp(real, 2, INT4) == {"": (INTER, 29696)}
    for name, p in real.named_parameters():
        m = meta.get_parameter(name)
        assert m.is_meta and m.shape == p.shape and m.dtype == p.dtype and m.rels == p.rels, name
    assert not meta.tp_padding.is_meta and meta.tp_padding.tolist() == [INTER, 29696]
    assert pad_for_tp(meta, 4, INT4) == {}  # 29696 is legal at TP 4 too
    dense = MLP().to("meta")
    assert pad_for_tp(dense, 8, INT4) == {"": (INTER, 29696)} and dense.down_proj.weight.shape == (HIDDEN, 29696)
    dq.quantize_(meta_nf4, dq.NF4())
    with pytest.raises(ValueError, match=r"Pad the dense model"):  # refused as on the CPU
        pad_for_tp(meta_nf4, 2, dq.NF4())


def test_checkpoint_records_padding(tmp_path):
    padded = dq.quantize_(mlp(), INT4)
    pad_for_tp(padded, 2, INT4)
    dq.checkpoint.save(padded, str(tmp_path / "ckpt"))
    fresh = MLP().float()
    torch.manual_seed(5)
    fresh = dq.quantize_(fresh, INT4)
    with pytest.raises(Exception, match=r"29696|29568|size|shape"):
        dq.checkpoint.load(fresh, str(tmp_path / "ckpt"))  # an unpadded model cannot load it
    pad_for_tp(fresh, 2, INT4)
    dq.checkpoint.load(fresh, str(tmp_path / "ckpt"))
    assert fresh.tp_padding.tolist() == [INTER, 29696]
    for name, p in padded.named_parameters():
        assert_same_bits(fresh.get_parameter(name), p, name)
