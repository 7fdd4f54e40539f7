"""Per-token activation statistics under TP 4, SequenceParallel and a 2-D (dp x tp) mesh: one process's model.

A gated MLP (``w1``/``w3`` column-parallel, ``w2`` row-parallel) with every
weight ``Int8Rowwise(activations="int8-token")``. Column-parallel layers hold
every token's features, so their outputs (``w2``'s input) equal one process bit
for bit; the row-parallel ``w2`` quantizes each token with the all-reduced
one-process scale, so its integer partial sums are exact and the output differs
from one process only by the float sum of the ranks' partial outputs
(:func:`partial_sum_bound`). The wire record shows exactly one extra
``all_reduce`` of ``tokens x 4`` bytes per forward (``w2``: the only layer
whose reduction dim is cut), and on a 2-D mesh one per mesh dim that cuts it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._core import activations
from dtensor_quant.testing import assert_within, mesh, weight
from dtensor_quant.testing.bounds import unit_roundoff
from tests.model.test_tp_plan import MLP, Block

FMT = dq.Int8Rowwise(activations="int8-token")
DIM, HIDDEN = 64, 256


def quantized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in fp32 with every linear weight ``FMT`` (fp32 activations: the bound is tight)."""
    model = model.float()
    for i, lin in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        w = weight(tuple(lin.weight.shape), seed=i).float()
        lin.weight = torch.nn.Parameter(dq.quantize(w, FMT), requires_grad=False)
    return model


def partial_sum_bound(h: torch.Tensor, q, world: int, dtype: torch.dtype) -> torch.Tensor:
    """How far ``world`` ranks' sum of exact integer partial outputs (each scaled in fp32 and rounded to
    ``dtype``: up to 2 roundings, then summed in ``dtype``: ``world - 1``) can be from one process's scaling of
    the whole sum (2 roundings): ``sum |partial|`` is at most the one-process ``|codes| @ |W codes|.T`` scaled,
    each of the ``3 world + 1`` roundings at most ``u`` of it (fp32 activations: a tight bound, which the
    per-rank statistic (vLLM's) exceeds)."""
    codes, x_scale = activations.quantize_activation(h, q.fmt.activation_scheme, q.fmt.input_scale)
    terms = (codes.double().abs() @ q.qdata.double().abs().t()) * x_scale.double() * q.scale.double().reshape(1, -1)
    return terms * (3 * world + 1) * unit_roundoff(dtype)


def _per_token_reduces(log, tokens: int) -> int:
    return len([t for t in log.transfers if "all_reduce" in t.op and t.nbytes == tokens * 4])


def _w2_input(model_w2, store: list):
    """Keep what ``w2`` multiplies (a DTensor under TP: its full value)."""

    def hook(module, args):
        h = args[0]
        store.append(h.full_tensor() if isinstance(h, DTensor) else h)

    return model_w2.register_forward_pre_hook(hook)


def mlp_case(shape: tuple[int, ...], sequence_parallel: bool):
    """TP ``shape[-1]`` (the ``tp`` dim of a ``dp x tp`` mesh when 2-D, each dp rank its own batch rows)."""
    m = mesh(*shape)
    tp_mesh = m["tp"] if len(shape) == 2 else m
    tp, dp = shape[-1], (shape[0] if len(shape) == 2 else 1)
    dp_rank = m.get_coordinate()[0] if len(shape) == 2 else 0
    make = Block if sequence_parallel else MLP
    model, reference = (quantized(make(DIM, HIDDEN)) for _ in range(2))
    if sequence_parallel:
        reference.norm.load_state_dict(model.norm.state_dict())
        plan = {
            "norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    parallelize_module(model, tp_mesh, plan)
    w2 = model.mlp.w2 if sequence_parallel else model.w2
    ref_w2 = reference.mlp.w2 if sequence_parallel else reference.w2
    batch, seq = 2 * dp, 3 * tp
    x = weight((batch, seq, DIM), seed=11).float()
    x[0, 0, : DIM // 2] *= 30  # token 0's largest input to w2 lies in some ranks' slices only
    x_mine = x.chunk(dp, 0)[dp_rank]
    seen, expected_h = [], []
    hooks = [_w2_input(w2, seen), _w2_input(ref_w2, expected_h)]
    tokens = x_mine.shape[0] * x_mine.shape[1]
    with torch.no_grad():
        inp = x_mine.chunk(tp, 1)[tp_mesh.get_local_rank()] if sequence_parallel else x_mine
        with wire.record() as log:
            out = model(inp)
        expected = reference(x_mine)
    for h in hooks:
        h.remove()
    if sequence_parallel:
        expected = expected.chunk(tp, 1)[tp_mesh.get_local_rank()]
    (h_tp,), (h_one,) = seen, expected_h
    assert torch.equal(h_tp, h_one), "column-parallel w1/w3 did not give w2 one process's input"
    bound = partial_sum_bound(h_one.reshape(-1, HIDDEN), ref_w2.weight, tp, out.dtype)
    bound = bound.reshape(*h_one.shape[:-1], DIM)
    if sequence_parallel:
        bound = bound.chunk(tp, 1)[tp_mesh.get_local_rank()]
    assert_within(out, expected, bound, f"TP {shape} (sequence parallel: {sequence_parallel}) vs one process")
    reduces = _per_token_reduces(log, tokens)
    assert reduces == 1, f"expected one per-token all-reduce ({tokens} x 4 bytes), got {reduces}: {log.transfers}"
    return (out.double() - expected.double()).abs().max().item()


@pytest.mark.slow
def test_tp4_mlp_equals_one_process(ranks):
    ranks(4).run(mlp_case, (4,), False)


def test_sequence_parallel_equals_one_process(ranks):
    ranks(2).run(mlp_case, (2,), True)


@pytest.mark.slow
def test_sequence_parallel_tp4_equals_one_process(ranks):
    ranks(4).run(mlp_case, (4,), True)


@pytest.mark.slow
def test_dp_tp_mesh_equals_one_process(ranks):
    ranks(4).run(mlp_case, (2, 2), False)


def two_d_cut_case(weight_specs: str):
    """``x @ W.T`` on a 2x2 mesh with ``W`` placed ``weight_specs``: one per-token all-reduce per mesh dim cutting
    ``in`` (on that dim's group only), none over a dim that replicates it or cuts the tokens."""
    m = mesh(2, 2)
    w = weight((32, 128), seed=3).float()
    x = weight((8, 128), seed=4).float()
    x[1, 100:] *= 50
    q = dq.quantize(w, FMT)
    w_place = {"R,S1": [Replicate(), Shard(1)], "S1,S1": [Shard(1), Shard(1)]}[weight_specs]
    x_place = {"R,S1": [Shard(0), Shard(1)], "S1,S1": [Shard(1), Shard(1)]}[weight_specs]
    wd = distribute_tensor(q, m, w_place)
    xd = distribute_tensor(x, m, x_place)
    with torch.no_grad(), wire.record() as log:
        out = torch.mm(xd, wd.t()).full_tensor()
    reference = F.linear(x, q)
    cuts = sum(1 for p in w_place if p == Shard(1))
    tokens = xd.to_local().shape[0]
    bound = partial_sum_bound(x, q, 2**cuts, x.dtype)
    assert_within(out, reference, bound, f"2x2 mesh, weight {weight_specs}")
    reduces = _per_token_reduces(log, tokens)
    assert reduces == cuts, f"{cuts} per-token all-reduces expected ({tokens} x 4 bytes), got {reduces}"
    return reduces


@pytest.mark.slow
@pytest.mark.parametrize("weight_specs", ["R,S1", "S1,S1"])
def test_two_d_mesh_reduces_over_the_cutting_dims(ranks, weight_specs):
    ranks(4).run(two_d_cut_case, weight_specs)
