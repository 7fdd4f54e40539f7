"""model/tp_plan on one process: which row-parallel layers adapt_tp_plan switches, and what the planner says."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
)

import dtensor_quant as dq
from dtensor_quant._model.tp_plan import adapt_tp_plan
from dtensor_quant.testing import weight


def test_legal_row_cut_is_kept():
    """No rank needed: a format that can cut the columns keeps torchtitan's style, and dense weights are left alone."""
    model = quantized(MLP(256, 5632), 256, dq.Int8Rowwise())
    plan, switched = adapt_tp_plan(model, PLAN, 4)
    assert switched == {} and plan == PLAN
    plan, switched = adapt_tp_plan(MLP(256, 5632), PLAN, 4)
    assert switched == {}
    plan, switched = adapt_tp_plan(MLP(256, 5632), PLAN, 4, fmt=dq.NF4())  # to be quantized after parallelizing
    assert list(switched) == ["w2"]


def test_planner_suggests_the_switch():
    """The planner's refusal of TinyLlama's NF4 down-projection names the way to keep the degree."""
    from dtensor_quant._model.planner.plan import plan

    ((_, cells),) = plan([("w2", (2048, 5632), "rowwise")], dq.NF4(), tp=[2, 4]).rows
    for cell in cells:
        assert not cell.legal and "column-parallel on a gathered input (dtensor_quant.adapt_tp_plan)" in (
            cell.alternatives
        ), cell.alternatives
    ((_, cells),) = plan([("w2", (64, 5632), "rowwise")], dq.NF4(), tp=[4]).rows  # 16 rows: no whole factor
    assert "column-parallel on a gathered input" not in cells[0].alternatives, cells[0].alternatives
    # but the 64-weight blocks alone allow the column cut: the expanded scales, with their cost
    assert cells[0].alternatives.endswith(
        "or store its scales expanded, NF4BlockScales(block_size=64, levels='torchao'): the same values, 5.5 KiB "
        "more for the whole weight (dtensor_quant.expand_scales; adapt_tp_plan does it)"
    ), cells[0].alternatives


def test_wildcard_keys_expand_only_where_a_match_is_switched():
    """transformers' plans name layers by pattern ("layers.*.w2"), as parallelize_module matches them."""
    model = nn.Module()
    model.layers = nn.ModuleList(quantized(MLP(256, 5632), 256, dq.NF4()) for _ in range(2))
    plan = {"layers.*.w1": ColwiseParallel(), "layers.*.w3": ColwiseParallel(), "layers.*.w2": RowwiseParallel()}
    new, switched = adapt_tp_plan(model, plan, 2)
    assert list(new) == ["layers.*.w1", "layers.*.w3", "layers.0.w2", "layers.1.w2"]
    assert sorted(switched) == ["layers.0.w2", "layers.1.w2"]
    assert all(type(new[k]) is ColwiseParallel and new[k].input_layouts == (Shard(-1),) for k in switched)
    dense = nn.Module()
    dense.layers = nn.ModuleList(quantized(MLP(256, 5632), 256, dq.Int8Rowwise()) for _ in range(2))
    assert adapt_tp_plan(dense, plan, 2) == (plan, {})


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=torch.bfloat16)
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=torch.bfloat16)
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A norm on sequence shards before the MLP (sequence parallelism's pattern)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.RMSNorm(dim, dtype=torch.bfloat16)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        return self.mlp(self.norm(x))


def quantized(model, dim, fmt):
    for i, lin in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
        lin.weight = nn.Parameter(dq.quantize(weight(tuple(lin.weight.shape), seed=i), fmt), requires_grad=False)
    return model


PLAN = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


def test_expanded_scales_keep_ties_and_wait_for_every_verdict():
    """adapt_tp_plan expands a weight no cut can hold (NF4 [896, 896] at TP 2) only once every layer is legal, and
    replaces it wherever the model holds it."""
    model = nn.Module()
    model.q = nn.Linear(896, 896, bias=False, dtype=torch.bfloat16)
    model.o = nn.Linear(896, 896, bias=False, dtype=torch.bfloat16)
    model.q.weight = nn.Parameter(dq.quantize(weight((896, 896), seed=1), dq.NF4()), requires_grad=False)
    model.tied = nn.Linear(896, 896, bias=False, dtype=torch.bfloat16)
    model.tied.weight = model.q.weight  # the same parameter in two modules
    model.o.weight = nn.Parameter(dq.quantize(weight((896, 896), seed=2), dq.Int4Groupwise(128)), requires_grad=False)
    before = model.q.weight
    plan = {"q": ColwiseParallel(), "o": RowwiseParallel()}
    # at TP 2: q's 448-row halves are no whole 16384-weight factors (expanded); o in int4 g128 cannot cut its 896
    # columns (448 is no multiple of 128) but can cut its rows (switched to column-parallel)
    _, changed = adapt_tp_plan(model, plan, 2)
    assert sorted(changed) == ["o", "q"] and changed["q"].startswith("scales stored expanded as NF4BlockScales")
    assert model.q.weight is model.tied.weight and model.q.weight is not before
    assert torch.equal(model.q.weight.dequantize(), before.dequantize())
    # both holders of the tied weight in the plan: expanded once, still tied
    model.q.weight = model.tied.weight = before
    _, changed = adapt_tp_plan(model, {**plan, "tied": ColwiseParallel()}, 2)
    assert sorted(changed) == ["o", "q", "tied"] and model.q.weight is model.tied.weight
    assert type(model.q.weight.fmt) is dq.NF4BlockScales
    # a layer no cut can hold and no expansion helps (Float8Blockwise(128): 448 rows, 448 columns): nothing changes
    model.q.weight = model.tied.weight = before
    model.o.weight = nn.Parameter(dq.quantize(weight((896, 896), seed=2), dq.Float8Blockwise(128)), requires_grad=False)
    with pytest.raises(dq.LayoutError, match=r"legal at TP 2 for o \[896, 896\] in Float8Blockwise"):
        adapt_tp_plan(model, plan, 2)
    assert model.q.weight is before and model.tied.weight is before
