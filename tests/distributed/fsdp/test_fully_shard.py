"""fsdp/fully_shard on live ranks: a trainable quantized parameter is refused by name, on every rank."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import mesh


def trainable_quantized(how):
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    dq.quantize_(net, dq.Int8Rowwise())
    net[1].weight.requires_grad_(True)
    try:
        if how == "fully_shard":
            dq.fsdp.fully_shard(net, mesh=mesh(2))
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(net, mesh=mesh(2))
            net(torch.randn(2, 64)).sum().backward()
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("how", ["fully_shard", "plain_fully_shard"])
def test_trainable_quantized_parameter_is_refused_by_name(ranks, how):
    for msg in ranks(2).run(trainable_quantized, how, timeout=60):
        assert "1.weight" in msg and "requires_grad=True" in msg, msg
