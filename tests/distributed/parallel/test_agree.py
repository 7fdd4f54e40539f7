"""_parallel/agree on live ranks: ranks that hold a weight in different layouts get a clear error on every rank.

Different formats (different byte counts, or the same ones that would mix
silently), different group sizes, and per-tensor constants that each rank
quantized on its own: never a gloo abort, a hang or mixed bytes. See
docs/hostile_input.md.
"""

import contextlib

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant import LayoutError
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh, rank, weight

MIXED = {
    "sizes": (dq.Int8Rowwise(), dq.Int4Groupwise(32)),  # different byte counts: gloo would abort a rank
    "same_bytes": (dq.Int8Rowwise(), dq.Float8Rowwise()),  # same byte counts: bytes would mix silently
    "group_size": (dq.Int4Groupwise(32), dq.Int4Groupwise(64)),
}


def disagreeing(kind, op):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    # A shape no other test uses on this pool: a layout both ranks already agreed on for this group
    # is not checked again (docs/hostile_input.md: the one case the cached check cannot see).
    fmt = MIXED[kind][rank()]
    w, m = weight((24, 256), seed=11), mesh(2)
    if op == "gather":
        local = dq.quantize(w, fmt)[rank() * 12 : (rank() + 1) * 12].clone()
        DTensor.from_local(local, m, [Shard(0)], run_check=False).full_tensor()
    elif op == "distribute":
        distribute_tensor(dq.quantize(w, fmt), m, [Shard(0)])
    elif op == "redistribute":
        local = dq.quantize(w, fmt)[:, rank() * 128 : (rank() + 1) * 128].clone()
        DTensor.from_local(local, m, [Shard(1)], run_check=False).redistribute(m, [Shard(0)])
    elif op == "quantize":
        dq.quantize(distribute_tensor(w, m, [Shard(1)]), fmt)
    elif op == "gather_quantized":  # trainable masters quantized before FSDP2's all-gather
        net = torch.nn.Sequential(torch.nn.Linear(256, 24, bias=False))
        dq.gather_quantized_(net, fmt)
        dq.fsdp.fully_shard(net, mesh=m)
        net(torch.randn(2, 256))
    elif op == "fsdp":
        net = torch.nn.Sequential(torch.nn.Linear(256, 24, bias=False))
        dq.quantize_(net, fmt)
        dq.fsdp.fully_shard(net, mesh=m)
        net(torch.randn(2, 256))


@pytest.mark.parametrize("op", ["gather", "distribute", "redistribute", "quantize", "fsdp", "gather_quantized"])
@pytest.mark.parametrize("kind", list(MIXED))
def test_ranks_that_disagree_all_raise(ranks, kind, op):
    """A clear error on every rank -- never a gloo abort, a hang (the 60 s timeout) or mixed bytes."""
    from dtensor_quant.testing.rank_pool import RankError

    pool = ranks(2)
    with pytest.raises(RankError) as info:
        pool.run(disagreeing, kind, op, timeout=60)
    assert sorted(info.value.errors) == [0, 1]
    for r, (err, tb) in info.value.errors.items():
        assert isinstance(err, LayoutError) and "different layouts" in str(err), (r, tb)
        assert str(MIXED[kind][0]) in str(err) and str(MIXED[kind][1]) in str(err), str(err)
    assert pool.run(agreeing_after) == [0, 0]  # the pool is still usable: nothing hangs


def agreeing_after():
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_quant import wire

    w = dq.quantize(weight((16, 96), seed=7), dq.Int8Rowwise())
    dt = distribute_tensor(w, mesh(2), [Shard(1)])
    dt.full_tensor()
    with wire.record() as log:  # the same layout again: no agreement exchange on the hot path
        assert torch.equal(dt.full_tensor().dequantize(), w.dequantize())
    return sum(t.op == "dtensor_quant::agree" for t in log.transfers)


def independently_quantized(fmt_name, dim, op, fast):
    """Each rank quantizes its own shard (a per-tensor constant of its own), then ``from_local``.

    Before: ``full_tensor`` and ``redistribute`` gave every piece one rank's constant (NF4's mean,
    Float8Tensorwise's scale): 23-35 units off on weights of ~10, silently.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._collective_utils import shard_dim_alltoall  # noqa: F401 (registers the op)

    from dtensor_quant._core import memo

    fmt, m = FORMATS[fmt_name], mesh(2)
    w = weight((32, 16384), seed=31, dtype=torch.bfloat16) * 10
    with memo.disabled() if not fast else contextlib.nullcontext():
        # first the same layout with agreeing constants (quantized as a DTensor): gathered exactly, and
        # its agreement (and the gather's memoised plan) cached -- the disagreeing one must still be caught
        good = dq.quantize(distribute_tensor(w, m, [Shard(dim)]), fmt)
        dq.check_consistent(good)
        for _ in range(2):
            assert_same_bits(good.full_tensor(), dq.quantize(w, fmt), "quantized as a DTensor")
        local = dq.quantize(torch.chunk(w, 2, dim)[rank()], fmt)
        bad = DTensor.from_local(local, m, [Shard(dim)], run_check=True)
        run = {
            "full_tensor": bad.full_tensor,
            "redistribute": lambda: bad.redistribute(m, [Replicate()]),
            "check_consistent": lambda: dq.check_consistent(bad),
            # what NCCL runs for Shard(i) -> Shard(j) (gloo: all-gather + split)
            "alltoall": lambda: torch.ops._dtensor.shard_dim_alltoall(local, dim, 1 - dim, m.get_group(0).group_name),
        }[op]
        try:
            run()
        except LayoutError as e:
            return str(e)
        return "not refused"


INDEPENDENT = [("nf4", 0, "mean"), ("f8tensor", 0, "scale"), ("f8tensor", 1, "scale")]
GATHERS = ["full_tensor", "redistribute", "check_consistent"]


@pytest.mark.parametrize(
    "fmt_name,dim,name,op,fast",
    [(*case, op, fast) for case in INDEPENDENT for op in GATHERS for fast in (True, False)]
    # NF4's flat blocks refuse the column cut first; the all-to-all has no fast path
    + [("f8tensor", 0, "scale", "alltoall", True), ("f8tensor", 1, "scale", "alltoall", True)],
)
def test_independently_quantized_shards_refused_where_they_meet(ranks, fmt_name, dim, name, op, fast):
    errors = ranks(2).run(independently_quantized, fmt_name, dim, op, fast)
    assert len(set(errors)) == 1, errors  # the same error on every rank (each sees every rank's value)
    assert f"copies of {name} differ" in errors[0] and "rank 1: " in errors[0], errors[0]
    assert "dq.quantize(distribute_tensor" in errors[0]


# -- the cached check's one gap, closed by checking every call -------------------------------------


def disagree_after_agreeing(every_call):
    """Both ranks agreed on Int8 and Int4 layouts of this shape; then they disagree (the cached check's gap)."""
    from torch.distributed.tensor import DTensor, Shard

    from dtensor_quant._parallel import agree

    w, m = weight((20, 256), seed=12), mesh(2)
    for fmt in (dq.Int8Rowwise(), dq.Int4Groupwise(64)):  # both layouts agreed on this group
        DTensor.from_local(dq.quantize(w, fmt)[rank() * 10 : (rank() + 1) * 10].clone(), m, [Shard(0)]).full_tensor()
    fmt = (dq.Int8Rowwise(), dq.Int4Groupwise(64))[rank()]
    agree.EVERY_CALL = every_call
    try:
        DTensor.from_local(dq.quantize(w, fmt)[rank() * 10 : (rank() + 1) * 10].clone(), m, [Shard(0)]).full_tensor()
    finally:
        agree.EVERY_CALL = False


def test_checking_every_call_closes_the_cached_gap(ranks):
    from dtensor_quant.testing.rank_pool import RankError

    with pytest.raises(RankError) as info:
        ranks(2).run(disagree_after_agreeing, True, timeout=60)
    assert all("different layouts" in str(e) for e, _ in info.value.errors.values()) and len(info.value.errors) == 2


# -- a new world: torch names its groups as it named the old ones ------------------------------------


def disagree_in_a_new_world():
    """Agree on Int8 and FP8 layouts of a shape, start a new world, then disagree on that shape (equal byte
    counts: without the check the bytes would mix silently, and both ranks would return)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, w = dist.get_rank(), weight((20, 256), seed=12)

    def gather(fmt):
        m = init_device_mesh("cpu", (2,))
        local = dq.quantize(w, fmt)[rank * 10 : (rank + 1) * 10].clone()
        return m.get_group().group_name, DTensor.from_local(local, m, [Shard(0)]).full_tensor()

    names = [gather(fmt)[0] for fmt in MIXED["same_bytes"]]  # both layouts agreed
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank, world_size=2)
    name, _ = gather(MIXED["same_bytes"][rank])
    return names, name


@pytest.mark.slow
def test_a_new_world_checks_again():
    """``destroy_process_group`` + ``init_process_group`` reuse the group names; what was agreed in the old
    world must not let the new one skip its check."""
    from tests.support.faults import run_ranks

    outcomes = run_ranks(2, disagree_in_a_new_world, timeout=120)
    for o in outcomes:
        assert o.kind == "raised" and o.error_type == "LayoutError", str(o)
        assert "different layouts" in o.error
