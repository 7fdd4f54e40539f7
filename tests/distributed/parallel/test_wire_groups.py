"""``dq.wire.record()`` names the group each collective went over: mesh dim, ranks, process-group name.

The ways a collective reaches the record, each checked on a mesh whose
groups are known: a quantized scatter and gather (reported by the library's
collectives with the group they were given, boxed or by name), a dense
DTensor redistribute and a ``torch.distributed`` call (seen by the recording
mode, the group read from the op's arguments) and the weight
statistic's all-reduce of ``dq.quantize`` on a DTensor (reported from inside
the custom op). On a 2x2 mesh the dims' groups are described ``mesh_dp`` /
``mesh_tp`` by DeviceMesh; a 1-D mesh over the whole world reuses the default
group, which names no dim: there the ranks say where it went.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.testing import mesh, weight


def _ranks(m, dim: str) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(m.get_group(dim)))


def two_d_case():
    m = mesh(2, 2)
    q = dq.quantize(weight((16, 64), seed=1), dq.Int8Rowwise())
    # distribute_tensor's scatter of the quantized bytes (c10d's op, the group boxed) over dp only.
    with wire.record() as log:
        dt = distribute_tensor(q, m, [Shard(0), Replicate()])
    scatters = [t for t in log.transfers if "scatter" in t.op]
    assert scatters and {(t.mesh_dim, t.ranks) for t in scatters} == {("dp", _ranks(m, "dp"))}, log.transfers
    # A c10d collective of torch.distributed's own API on a dim's group (as FSDP2 issues them).
    with wire.record() as log:
        dist.all_reduce(torch.ones(3), group=m.get_group("dp"))
    assert log.groups() == {("dp", _ranks(m, "dp"))}, log.transfers
    # A quantized gather over dp only: the tensor is sharded on dp and replicated on tp.
    with wire.record() as log:
        dt.redistribute(m, [Replicate(), Replicate()])
    gathers = log.all_gathers().transfers
    assert gathers and all(t.quantized for t in gathers), log.transfers
    assert {(t.mesh_dim, t.ranks) for t in gathers} == {("dp", _ranks(m, "dp"))}, gathers
    assert all(t.group == m.get_group("dp").group_name for t in gathers), gathers
    # A dense all-reduce over tp only (Partial on tp), seen by the recording mode.
    x = torch.ones(4, 8)
    p = DTensor.from_local(x, m, [Replicate(), Partial()])
    with wire.record() as log:
        p.redistribute(m, [Replicate(), Replicate()])
    assert log.transfers and log.groups() == {("tp", _ranks(m, "tp"))}, log.transfers
    assert len(log.over("tp")) == len(log) and not log.over("dp"), log.transfers
    # The weight statistic's reduction of dq.quantize on a DTensor, reported from inside the custom op.
    w = distribute_tensor(weight((16, 64), seed=2), m, [Replicate(), Shard(0)])
    with wire.record() as log:
        dq.quantize(w, dq.Float8Tensorwise())
    reduces = [t for t in log.transfers if "all_reduce" in t.op]
    assert reduces and {(t.mesh_dim, t.ranks) for t in reduces} == {("tp", _ranks(m, "tp"))}, log.transfers


@pytest.mark.slow
def test_two_d_mesh_names_each_dim(ranks):
    ranks(4).run(two_d_case)


def one_d_case():
    m = mesh(2)
    q = dq.quantize(weight((16, 64), seed=1), dq.Int8Rowwise())
    dt = distribute_tensor(q, m, [Shard(0)])
    with wire.record() as log:
        dt.full_tensor()
    world = tuple(range(dist.get_world_size()))
    assert log.transfers and {t.ranks for t in log.transfers} == {world}, log.transfers
    assert len(log.over(ranks=world)) == len(log)
    with pytest.raises(ValueError, match="mesh_dim name, ranks"):
        log.over()


def test_one_d_mesh_names_the_ranks(ranks):
    ranks(2).run(one_d_case)
