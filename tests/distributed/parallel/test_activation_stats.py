"""_parallel/activation_stats on 2 gloo ranks: row-parallel W8A8 equals one process.

The reference is one process: the whole weight quantized once and
``F.linear`` of the whole activation (the format's reference arithmetic). Under
``RowwiseParallel`` with the reduced scheme every rank quantizes each element
with the one-process token scale, so each rank's partial output is bit for bit
the reference arithmetic of its slices with the global scale (int8: an exact
integer sum), and the sum over ranks differs from one process only by the float
sum of the partial outputs: a bound. The per-rank scheme (vLLM's) is checked to
take each rank's own statistic instead.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._core import activations
from dtensor_quant._parallel import custom_ops
from dtensor_quant.testing import assert_within, mesh, weight

FORMATS = {
    "int8-token": dq.Int8Rowwise(activations="int8-token"),
    "int8-token-per-rank": dq.Int8Rowwise(activations="int8-token-per-rank"),
    "fp8-token": dq.Float8Rowwise(activations="fp8-token"),
    "fp8-token-per-rank": dq.Float8Rowwise(activations="fp8-token-per-rank"),
    "fp8-tensorwise": dq.Float8Tensorwise(activations="fp8-token"),
    "int8-bf16-scale": dq.Int8Rowwise(torch.bfloat16, activations="int8-token"),
}


def _partial_bound(partials: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """How far two float sums of the same partial outputs can be apart, after rounding to ``dtype``: the
    ranks' sum (in ``dtype``, any order) against the one-process epilogue's single rounding."""
    total = sum(p.double().abs() for p in partials)
    u = torch.finfo(dtype).eps / 2
    return total * (len(partials) + 2) * u * 2


def row_parallel_case(name: str, dtype_name: str, tokens: int):
    dtype = getattr(torch, dtype_name)
    fmt, m, world, rank = FORMATS[name], mesh(2), dist.get_world_size(), dist.get_rank()
    w = weight((48, 256), seed=1).to(dtype)
    x = weight((tokens, 256), seed=2).to(dtype)
    x[0, 200:] *= 40  # the largest value of token 0 lies in rank 1's slice: local scales would differ
    q = dq.quantize(w, fmt)
    reference = F.linear(x, q)
    module = parallelize_module(torch.nn.Linear(256, 48, bias=False, dtype=dtype), m, RowwiseParallel())
    module.weight = torch.nn.Parameter(distribute_tensor(q, m, [Shard(1)]), requires_grad=False)
    x_local = x.chunk(world, -1)[rank]
    with wire.record() as log:
        out = module(DTensor.from_local(x_local, m, [Shard(-1)]))
    out = out.full_tensor() if isinstance(out, DTensor) else out
    scheme = fmt.activation_scheme
    w_local = q.qdata.chunk(world, -1)[rank]
    global_amax = x.float().abs().amax(-1, keepdim=True)
    with activations.token_stat_reduction(lambda amax: global_amax if not scheme.per_rank else amax):
        mine = activations.reference_linear(x_local, w_local, q.scale, scheme)
    partials = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(partials, mine)
    reduces = [t for t in log.transfers if "all_reduce" in t.op and t.nbytes == tokens * 4]
    if scheme.per_rank:
        assert not reduces, log.transfers
        diff = (out.float() - reference.float()).abs().max().item()
        return diff
    assert reduces, f"no per-token all-reduce on the wire: {log.transfers}"
    assert_within(out, sum(p.float() for p in partials).to(dtype), _partial_bound(partials, dtype), "sum of partials")
    assert_within(out, reference, _partial_bound(partials, dtype), f"{name} TP 2 vs one process")
    return 0.0


@pytest.mark.parametrize("name", ["int8-token", "fp8-token", "fp8-tensorwise", "int8-bf16-scale"])
@pytest.mark.parametrize("dtype_name,tokens", [("bfloat16", 5), ("float32", 3)])
def test_row_parallel_equals_one_process(ranks, name, dtype_name, tokens):
    ranks(2).run(row_parallel_case, name, dtype_name, tokens)


@pytest.mark.parametrize("name", ["int8-token-per-rank", "fp8-token-per-rank"])
def test_per_rank_scales_differ_from_one_process(ranks, name):
    diffs = ranks(2).run(row_parallel_case, name, "float32", 3)
    assert all(d > 0 for d in diffs), diffs


def local_partial_is_reference_case():
    """Each rank's partial output is bit for bit the integer reference on its slices with the global scale."""
    fmt, m, world, rank = FORMATS["int8-token"], mesh(2), dist.get_world_size(), dist.get_rank()
    w, x = weight((16, 128), seed=5), weight((4, 128), seed=6)
    q = dq.quantize(w, fmt)
    wt = distribute_tensor(q, m, [Shard(1)]).t()
    xd = DTensor.from_local(x.chunk(world, -1)[rank], m, [Shard(1)])
    out = torch.mm(xd, wt)
    assert out.placements[0].is_partial(), out.placements
    global_amax = x.float().abs().amax(-1, keepdim=True)
    with activations.token_stat_reduction(lambda amax: global_amax):
        expected = activations.reference_linear(
            x.chunk(world, -1)[rank], q.qdata.chunk(world, -1)[rank], q.scale, fmt.activation_scheme
        )
    assert torch.equal(out.to_local(), expected), "a rank's partial output is not the integer reference's"


def test_local_partial_is_reference(ranks):
    ranks(2).run(local_partial_is_reference_case)


def column_parallel_case():
    """Column-parallel: every token's features are local, nothing extra travels, the result is one process's."""
    fmt, m = FORMATS["int8-token"], mesh(2)
    w, x = weight((32, 128), seed=7), weight((4, 128), seed=8)
    q = dq.quantize(w, fmt)
    module = parallelize_module(torch.nn.Linear(128, 32, bias=False), m, ColwiseParallel())
    module.weight = torch.nn.Parameter(distribute_tensor(q, m, [Shard(0)]), requires_grad=False)
    with wire.record() as log:
        out = module(x)
    assert not [t for t in log.transfers if "all_reduce" in t.op], log.transfers
    expected = F.linear(x, q).chunk(dist.get_world_size(), -1)[dist.get_rank()]
    assert torch.equal(out, expected), "column-parallel output differs from one process"


def test_column_parallel_is_one_process(ranks):
    ranks(2).run(column_parallel_case)


def custom_op_row_parallel_case():
    """``dtensor_quant::linear``'s own row-parallel strategy (weight ``Shard(1)``) reduces the statistic too."""
    fmt, m, world, rank = FORMATS["int8-token"], mesh(2), dist.get_world_size(), dist.get_rank()
    w, x = weight((16, 128), seed=5).float(), weight((4, 128), seed=6).float()
    x[0, 100:] *= 40
    q = dq.quantize(w, fmt)
    xd = DTensor.from_local(x.chunk(world, -1)[rank], m, [Shard(1)])
    with wire.record() as log:
        out = custom_ops.linear(xd, distribute_tensor(q, m, [Shard(1)]))
    assert out.placements[0].is_partial(), out.placements
    assert [t for t in log.transfers if "all_reduce" in t.op and t.nbytes == 4 * 4], log.transfers
    global_amax = x.float().abs().amax(-1, keepdim=True)
    with activations.token_stat_reduction(lambda amax: global_amax):
        expected = activations.reference_linear(
            x.chunk(world, -1)[rank], q.qdata.chunk(world, -1)[rank], q.scale, fmt.activation_scheme
        )
    assert torch.equal(out.to_local(), expected), "the custom op's partial output is not the reduced reference"


def test_custom_op_row_parallel_reduces(ranks):
    ranks(2).run(custom_op_row_parallel_case)


def replicated_weight_case():
    """A replicated weight times a feature-sharded activation: DTensor computes it row-parallel (slicing the
    weight locally), so the statistic is reduced there too; each partial is the reduced integer reference."""
    fmt, m, world, rank = FORMATS["int8-token"], mesh(2), dist.get_world_size(), dist.get_rank()
    w, x = weight((16, 128), seed=5).float(), weight((4, 128), seed=6).float()
    x[0, 100:] *= 40
    q = dq.quantize(w, fmt)
    xd = DTensor.from_local(x.chunk(world, -1)[rank], m, [Shard(1)])
    wd = distribute_tensor(q, m, [Replicate()])
    with wire.record() as log:
        out = F.linear(xd, wd)
    assert [t for t in log.transfers if "all_reduce" in t.op and t.nbytes == 4 * 4], log.transfers
    if not out.placements[0].is_partial():  # DTensor gathered the activation instead: one process's product
        return torch.equal(out.full_tensor(), F.linear(x, q))
    global_amax = x.float().abs().amax(-1, keepdim=True)
    with activations.token_stat_reduction(lambda amax: global_amax):
        expected = activations.reference_linear(
            x.chunk(world, -1)[rank], q.qdata.chunk(world, -1)[rank], q.scale, fmt.activation_scheme
        )
    return torch.equal(out.to_local(), expected)


def test_replicated_weight_with_sharded_features_reduces(ranks):
    assert all(ranks(2).run(replicated_weight_case))


def nan_in_one_slice_case(name: str):
    """A NaN or Inf in one rank's slice of a token makes that token's row NaN on every rank, as on one process,
    through the eager path (c10d's all-reduce of the maxima) and the recorded one (the functional collective,
    seen by ``wire.record``), which give the same bits on the other tokens."""
    fmt, m, world, rank = FORMATS[name], mesh(2), dist.get_world_size(), dist.get_rank()
    w, x = weight((16, 128), seed=5).float(), weight((5, 128), seed=6).float()
    x[0, 100], x[1, 3], x[2, 120] = float("nan"), float("nan"), float("inf")  # rank 1's, rank 0's, rank 1's slice
    x[3, 70:] *= 40
    q = dq.quantize(w, fmt)
    reference = F.linear(x, q)
    assert reference[:3].isnan().all() and reference[3:].isfinite().all()
    module = parallelize_module(torch.nn.Linear(128, 16, bias=False), m, RowwiseParallel())
    module.weight = torch.nn.Parameter(distribute_tensor(q, m, [Shard(1)]), requires_grad=False)
    xd = DTensor.from_local(x.chunk(world, -1)[rank], m, [Shard(-1)])
    with torch.no_grad():
        eager = module(xd)
        with wire.record() as log:
            recorded = module(xd)
    assert [t for t in log.transfers if "all_reduce" in t.op and t.nbytes == 5 * 4], log.transfers
    for out in (eager, recorded):
        out = out.full_tensor() if isinstance(out, DTensor) else out
        assert out[:3].isnan().all(), f"a NaN or Inf token is not NaN on rank {rank}: {out[:3]}"
        assert out[3:].isfinite().all()
    assert torch.equal(eager[3:], recorded[3:]), "the eager reduction differs from the recorded one"


@pytest.mark.parametrize("name", ["int8-token", "fp8-token"])
def test_nan_in_one_rank_slice_is_nan_everywhere(ranks, name):
    ranks(2).run(nan_in_one_slice_case, name)


def dense_fall_through_case():
    """With the handler installed (this module declares reduced schemes), a dense DTensor matmul runs torch's own
    dispatch: the same bits as with the handler out of DTensor's table, column- and row-parallel, 3-D, with a
    bias (``addmm``); the handler is back in the table after each call, and after one that raises."""
    from torch.distributed.tensor import Partial

    from dtensor_quant._parallel import activation_stats

    assert activation_stats.installed()
    m, world, rank = mesh(2), dist.get_world_size(), dist.get_rank()
    w, x, bias = weight((48, 256), seed=1), weight((2, 5, 256), seed=2), weight((48,), seed=3)
    cases = {
        "column-parallel": lambda: F.linear(
            DTensor.from_local(x, m, [Replicate()]), distribute_tensor(w, m, [Shard(0)])
        ),
        "row-parallel": lambda: F.linear(
            DTensor.from_local(x.chunk(world, -1)[rank], m, [Shard(-1)]), distribute_tensor(w, m, [Shard(1)])
        ),
        "column-parallel with bias": lambda: F.linear(
            DTensor.from_local(x[0], m, [Replicate()]),
            distribute_tensor(w, m, [Shard(0)]),
            distribute_tensor(bias, m, [Shard(0)]),
        ),
    }
    table = DTensor._op_dispatcher._custom_op_handlers
    mine = {op: table[op] for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)}
    for name, run in cases.items():
        with torch.no_grad():
            got = run()
            assert activation_stats.installed(), f"{name}: the handler left DTensor's table"
            for op in mine:
                del table[op]
            try:
                expected = run()
            finally:
                table.update(mine)
        assert got.placements == expected.placements, name
        assert torch.equal(got.to_local(), expected.to_local()), f"{name}: not torch's own result"
        if name == "row-parallel":
            assert isinstance(got.placements[0], Partial)
    with pytest.raises(RuntimeError):  # shapes that do not multiply: torch's error, the handler still installed
        torch.mm(DTensor.from_local(x[0], m, [Replicate()]), distribute_tensor(w, m, [Shard(0)]))
    assert activation_stats.installed()


def test_dense_matmul_falls_through_to_torch(ranks):
    ranks(2).run(dense_fall_through_case)
