"""Zero-padding a SwiGLU MLP for a tensor-parallel degree its group size forbids (Qwen2-72B's 29568).

int4 g128 holds 29568 = 231 groups: the down-projection's columns cannot be
split at TP 2, 4 or 8. Padded to 29696 (232 groups) they can, and the padded
MLP's output is the unpadded one's: bit-identical in fp32 on one process, and
within the all-reduce's reordering on TP ranks.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.model.padding import mlp_padding, pad_for_tp
from dtensor_quant.testing import assert_same_bits, mesh

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


def test_padding_for_qwen2_72b_int4_g128():
    assert mlp_padding(INTER, HIDDEN, INT4, 1) == INTER
    for tp in (2, 4, 8):
        assert mlp_padding(INTER, HIDDEN, INT4, tp) == 29696  # 232 groups: equal, whole-group shards
    with pytest.raises(dq.LayoutError):
        dq.check_placements((HIDDEN, INTER), INT4, (2,), [Shard(1)])
    dq.check_placements((HIDDEN, 29696), INT4, (8,), [Shard(1)])


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("bias", [False, True])
def test_padded_output_bit_identical_fp32(when, bias):
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
    x = inputs()
    assert torch.equal(padded(x), ref(x))


def test_padded_output_bf16_within_one_rounding():
    """bf16: the CPU bf16 matmul blocks a longer K differently, so the sum may round once differently."""
    model = mlp(torch.bfloat16)
    ref = dq.quantize_(copy.deepcopy(model), INT4)
    padded = copy.deepcopy(ref)
    pad_for_tp(padded, 2, INT4)
    x = inputs(torch.bfloat16)
    y, y0 = padded(x).float(), ref(x).float()
    assert (y - y0).abs().max() <= 2**-7 * y0.abs().max(), (y - y0).abs().max()


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


# -- on TP ranks ---------------------------------------------------------------------


def tp_forward(pad_when, dtype_name):
    world, dtype = dist.get_world_size(), getattr(torch, dtype_name)
    model = mlp(dtype)
    reference = dq.quantize_(copy.deepcopy(model), INT4)  # unpadded, one process
    m = mesh(world)
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    try:
        parallelize_module(copy.deepcopy(reference), m, plan)
        raise AssertionError(f"the unpadded MLP was accepted at TP {world}")
    except dq.LayoutError:
        pass
    tp = copy.deepcopy(model) if pad_when == "before" else copy.deepcopy(reference)
    pad_for_tp(tp, world, INT4)
    if pad_when == "before":
        dq.quantize_(tp, INT4)
    single = copy.deepcopy(tp)  # the padded model on one process
    parallelize_module(tp, m, plan)
    for name, p in tp.named_parameters():
        assert isinstance(p, DTensor)
        assert_same_bits(p.to_local(), distribute_tensor(single.get_parameter(name), m, p.placements).to_local(), name)
    x = inputs(dtype)
    with torch.no_grad():
        y, y_single, y_ref = tp(x), single(x), reference(x)
    assert torch.equal(y_single, y_ref) or dtype != torch.float32
    return ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pad_when", ["before", "after"])
def test_row_parallel_at_tp_2_and_4(ranks, world, pad_when):
    for err in ranks(world).run(tp_forward, pad_when, "float32"):
        assert err < 1e-6, err  # the all-reduce sums the ranks' partial products in another order


def test_row_parallel_bf16(ranks):
    for err in ranks(2).run(tp_forward, "after", "bfloat16"):
        assert err < 2**-6, err
