"""model/padding at TP 2 and 4 on live ranks: the padded row-parallel MLP computes the unpadded one-process
MLP's function, within the bound of its summation (the model and the bound: tests/model/test_padding.py)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant._model.padding import pad_for_tp
from dtensor_quant.testing import assert_same_bits, mesh
from tests.model.test_padding import INT4, assert_same_function, inputs, mlp


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
    assert_same_function(single, reference, x)
    # the all-reduce sums the ranks' partial products in another order
    assert_same_function(tp, reference, x, tp_mesh=m)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pad_when", ["before", "after"])
def test_row_parallel_at_tp_2_and_4(ranks, world, pad_when):
    ranks(world).run(tp_forward, pad_when, "float32")


def test_row_parallel_bf16(ranks):
    ranks(2).run(tp_forward, "after", "bfloat16")
