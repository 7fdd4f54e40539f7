"""checkpoint/dcp on live ranks, for quantized expert stacks:
EP -> FSDP2 -> one process (and EP x TP -> one), bit-exact.

The checkpoint holds each inner tensor of an ``[E, out, in]`` stack as its
own entry with the expert dim one-to-one, so DCP reshards it at expert (and
block) granularity between any of these layouts.
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh

EXPERTS, HIDDEN, INTER = 3, 512, 64  # 3 experts: uneven over 2 ranks, one rank empty over 4


class Experts(nn.Module):
    """The shape of a transformers 5 experts module: fused 3-D stacks."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g).to(torch.bfloat16))
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER * 2, generator=g).to(torch.bfloat16))


def quantized(seed, fmt_name):
    return dq.quantize_(Experts(seed), FORMATS[fmt_name])


def expert_parallel(seed, fmt_name, mesh_shape):
    """Experts over mesh dim 0; on a 2-D mesh each expert also over dim 1 (gate_up rows, down columns)."""
    net, m = quantized(seed, fmt_name), mesh(*mesh_shape)
    inside = {"gate_up_proj": [Shard(1)], "down_proj": [Shard(2)]} if len(mesh_shape) == 2 else {}
    for name, p in list(net.named_parameters()):
        dt = distribute_tensor(p.detach(), m, [Shard(0), *inside.get(name, [])])
        setattr(net, name, nn.Parameter(dt, requires_grad=False))
    return net


def check(net, fmt_name) -> None:
    """Every parameter of ``net`` has the bytes of the single-process reference (seed 1)."""
    ref = dict(quantized(1, fmt_name).named_parameters())
    for name, p in net.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert_same_bits(full, ref[name].detach(), name)


def save_ep(fmt_name, mesh_shape, path):
    ckpt.save(expert_parallel(1, fmt_name, mesh_shape), path)


def load_fsdp_then_save(fmt_name, src, dst):
    net = quantized(2, fmt_name)  # other values: the load must overwrite every byte
    fully_shard(net, mesh=mesh(torch.distributed.get_world_size()))
    ckpt.load(net, src)
    check(net, fmt_name)
    ckpt.save(net, dst)


def load_single(fmt_name, path):
    net = quantized(2, fmt_name)
    ckpt.load(net, path)
    check(net, fmt_name)


@pytest.mark.parametrize("fmt_name", ["int8", "int4g64", "nf4b64s8"])
def test_ep_to_fsdp_to_one_process(ranks, tmp_path, fmt_name):
    ep, fsdp = str(tmp_path / "ep"), str(tmp_path / "fsdp")
    ranks(4).run(save_ep, fmt_name, (4,), ep)  # one rank holds no expert
    ranks(2).run(load_fsdp_then_save, fmt_name, ep, fsdp)  # FSDP2: 2 + 1 experts
    load_single(fmt_name, fsdp)


@pytest.mark.parametrize("fmt_name", ["int8", pytest.param("int4g64", marks=pytest.mark.slow)])
def test_ep_tp_to_one_process(ranks, tmp_path, fmt_name):
    path = str(tmp_path / "ep_tp")
    ranks(4).run(save_ep, fmt_name, (2, 2), path)
    load_single(fmt_name, path)
