"""_training/fused on live ranks: a fused AdamW step (fused=True) on trainable quantized weights under FSDP2 and
tensor parallelism gives the bytes of one process (gradients injected, as in test_trainable)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh


def _model(rows, tp=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, rows, bias=False), nn.Linear(rows, 16, bias=True)).to(torch.bfloat16)
    if tp is not None:
        parallelize_module(m, tp, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    return dq.quantize_(m, dq.Int8Rowwise(), trainable=True, seed=3)


def trained(how, rows, steps=3):
    """The model after ``steps`` injected fused AdamW steps: one process (how=None), FSDP2 or TP."""
    if how == "fsdp":
        m = _model(rows)
        for layer in m:
            fully_shard(layer, mesh=mesh(dist.get_world_size()))
        fully_shard(m, mesh=mesh(dist.get_world_size()))
    else:
        m = _model(rows, tp=mesh(dist.get_world_size()) if how == "tp" else None)
    opt = torch.optim.AdamW(list(m.parameters()), lr=1e-2, fused=True)
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        for p in m.parameters():
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad
        opt.step()
        opt.zero_grad()
    out = []
    for p in m.parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        out.append({n: t.clone() for n, t in full.inner.items()} if isinstance(full, dq.QuantizedTensor) else full)
    return out


def _same(a, b):
    return all(
        all(torch.equal(x[n], y[n]) for n in x) if isinstance(x, dict) else torch.equal(x, y) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_fused_adamw_on_two_ranks_gives_the_bytes_of_one_process(ranks, how):
    rows = 10 if how == "fsdp" else 32  # FSDP2: 10 rows, 5 per rank; TP: row and column shards of 32
    expected = trained(None, rows)
    for got in ranks(2).run(trained, how, rows):
        assert _same(got, expected)
