"""ops/init on 2 live ranks: nn.init on a sharded quantized weight gives the bytes of the same dense init, quantized.

The reference is the same model kept dense, parallelized the same way and
initialised with generators in the same state (DTensor runs a random op on
each rank's local shard), then ``dq.quantize``'d as a DTensor -- which
reduces the statistics that shards share (a row scale under a column shard)
over the mesh. torchtitan's order: meta model -> quantize -> parallelize ->
``to_empty`` -> init.
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh

FORMATS = {"int8": dq.Int8Rowwise(), "nf4": dq.NF4(64), "f8t": dq.Float8Tensorwise()}


def build(parallel: str, fmt=None, device="meta"):
    with torch.device(device):
        m = nn.Sequential(nn.Linear(256, 128, bias=False), nn.Linear(128, 64, bias=False))
    if fmt is not None:
        dq.quantize_(m, fmt)
    if parallel == "tp":
        parallelize_module(m, mesh(2), {"0": ColwiseParallel(), "1": RowwiseParallel()})  # row, column shards
    else:
        for layer in m:
            fully_shard(layer, mesh=mesh(2))
        fully_shard(m, mesh=mesh(2))
    m.to_empty(device="cpu")
    return m


def init(m, how: str):
    # On a CPU mesh DTensor has no RNG tracker and drops a ``generator`` argument: the default one draws.
    torch.manual_seed(13)
    g = None
    for layer in m:
        if how == "trunc_normal":
            nn.init.trunc_normal_(layer.weight, std=0.02, generator=g)
        elif how == "kaiming":
            nn.init.kaiming_uniform_(layer.weight, a=5**0.5, generator=g)
        elif how == "copy":
            with torch.no_grad():
                dense = torch.randn(layer.weight.shape) * 0.02
                w = layer.weight
                w.copy_(distribute_tensor(dense, w.device_mesh, w.placements, src_data_rank=None))


def compare(parallel, fmt_name, how):
    fmt = FORMATS[fmt_name]
    m = build(parallel, fmt)
    init(m, how)
    ref = build(parallel)
    init(ref, how)
    out = []
    for layer, dense in zip(m, ref):
        got, want = layer.weight._local_tensor, dq.quantize(dense.weight.detach(), fmt)._local_tensor
        assert isinstance(layer.weight, DTensor)
        out.append(
            all(
                torch.equal(getattr(got, n).view(torch.uint8), getattr(want, n).view(torch.uint8))
                for n in fmt.inner_names
            )
        )
    return out


@pytest.mark.parametrize("how", ["trunc_normal", "kaiming", "copy"])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_tensor_parallel_init_equals_the_dense_init_quantized(ranks, fmt_name, how):
    for result in ranks(2).run(compare, "tp", fmt_name, how):
        assert result == [True, True]


@pytest.mark.parametrize("fmt_name", ["int8", "f8t"])  # f8t: one scale, reduced over the FSDP2 mesh
def test_fsdp2_init_equals_the_dense_init_quantized(ranks, fmt_name):
    for result in ranks(2).run(compare, "fsdp", fmt_name, "trunc_normal"):
        assert result == [True, True]
