"""ops/matmul under tensor parallelism: what reaches the local quantized weight (3-D inputs, contiguous or not)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.testing import FORMATS, assert_within, linear_error_bound, mesh, weight


def tp_linear_inputs(fmt_name):
    """3-D inputs, contiguous or not, through column- and row-parallel quantized layers."""
    m = mesh(2)
    fmt = FORMATS[fmt_name]
    w1, w2 = weight((256, 256), seed=1, dtype=torch.float32), weight((256, 256), seed=2, dtype=torch.float32)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w1)
        model[1].weight.copy_(w2)
    dq.quantize_(model, fmt)
    w1, w2 = model[0].weight.dequantize(), model[1].weight.dequantize()  # the one-process values
    parallelize_module(model, m, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = weight((5, 3, 256), seed=3, dtype=torch.float32)
    for inp in (x, x.transpose(0, 1)):  # the transposed one reaches the weight as expand + bmm
        h_ref = F.linear(inp, w1)
        expected = F.linear(h_ref, w2)
        with wire.record() as log, torch.no_grad():
            out = model(inp)
        # Only activations travel: nothing quantized, and one all-reduce of the output.
        assert not any(t.quantized for t in log.transfers)
        assert log.nbytes == out.numel() * out.element_size()
        # Column-parallel: each rank's 128 outputs, 256-term sums blocked for another width; row-parallel:
        # the all-reduce regroups the sums. Each within its summation's bound, the first layer's measured
        # difference carried through the second.
        with torch.no_grad():
            h = DTensor.from_local(model[0](inp), m, [Shard(inp.ndim - 1)]).full_tensor()
        assert_within(h, h_ref, 2 * linear_error_bound(inp, w1), "column-parallel")
        carried = (h - h_ref).double().abs() @ w2.double().abs().t()
        bound = linear_error_bound(h, w2) + linear_error_bound(h_ref, w2) + carried
        assert_within(out, expected, bound, "row-parallel")


@pytest.mark.parametrize("fmt_name", ["int8", "int4g128"])
def test_tp_layers_with_3d_inputs(ranks, fmt_name):
    ranks(2).run(tp_linear_inputs, fmt_name)
