"""checkpoint/dcp on live ranks: loads that must quantize, refuse or survive.

Dense checkpoints, wrong formats, damaged files, async and killed saves: a clear error on every rank, before
any rank waits in a collective, and nothing of the model changed.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant.testing import placements, rank
from dtensor_quant.testing.rank_pool import RankError, RankPool
from tests.support import ckpt_cases as cc
from tests.support.ckpt_cases import OTHER, SEED, load_damaged, on, save_model, save_placed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- a dense checkpoint quantizes on load, with the full tensor's scales ------------------


def load_dense(fmt_name, layout, path):
    net = cc.placed(OTHER, fmt_name, layout)
    ckpt.load(net, path)
    cc.check_against(net, SEED, fmt_name, layout)


DENSE_LOADS = [
    ("s0_2", "int8", "s1_3"),  # per-row scales under column shards: the row maxima are all-reduced
    ("single", "int4g32", "fsdp4"),
    ("tp2", "int8", "2x2"),
    ("2x2", "int4g32", "single"),
]


@pytest.mark.parametrize("src,fmt_name,dst", DENSE_LOADS)
def test_dense_checkpoint_quantizes_on_load(ranks, tmp_path, src, fmt_name, dst):
    """A plain model's DCP save loads into a quantized sharded model exactly as quantize(full) would."""
    path = str(tmp_path / "dense")
    on(ranks, src, save_model, None, src, path, "dcp")
    on(ranks, dst, load_dense, fmt_name, dst, path)


def per_chunk_scales_differ():
    """Guard for the test above: quantizing each column shard alone gives other bytes."""
    full = cc.dense_net(SEED).a.weight.detach()
    m = cc.mesh(2)
    local = distribute_tensor(full, m, placements("S1"), src_data_rank=None).to_local()
    wrong = dq.quantize(local, dq.Int8Rowwise())
    right = distribute_tensor(dq.quantize(full, dq.Int8Rowwise()), m, placements("S1"), src_data_rank=None).to_local()
    return not torch.equal(wrong.scale, right.scale)


def test_per_chunk_scales_would_be_caught(ranks):
    assert ranks(2).run(per_chunk_scales_differ) == [True, True], "column shards quantized alone kept the full scales"


def load_dense_state_dict(fmt_name, layout, source):
    """``load_state_dict`` of dense weights: full plain tensors, or DTensors in another layout."""
    net = cc.placed(OTHER, fmt_name, layout)
    dense = cc.placed(SEED, None, "s0_2" if source == "dtensor" else "single").state_dict()
    net.load_state_dict({k: v for k, v in dense.items() if k.endswith("weight")}, strict=False)
    net.b.bias = cc.placed(SEED, fmt_name, layout).b.bias  # dense, not what this test is about
    cc.check_against(net, SEED, fmt_name, layout)


@pytest.mark.parametrize("fmt_name,layout,source", [("int8", "s1_2", "plain"), ("int4g32", "tp2", "dtensor")])
def test_dense_state_dict_quantizes_on_load(ranks, fmt_name, layout, source):
    ranks(2).run(load_dense_state_dict, fmt_name, layout, source)


# -- a different format is refused, naming both, on every rank, before any collective ---------


def load_expecting_error(fmt_name, layout, path):
    net = cc.placed(OTHER, fmt_name, layout)
    before = [p.to_local().qdata.clone() if isinstance(p, DTensor) else None for p in net.parameters() if p.ndim == 2]
    try:
        ckpt.load(net, path)
    except ValueError as e:
        after = [p.to_local().qdata for p in net.parameters() if p.ndim == 2]
        untouched = all(torch.equal(a, b) for a, b in zip(after, before))
        return type(e).__name__, str(e), untouched
    return "no error", "", True


@pytest.mark.parametrize(
    "saved,loaded,names",
    [
        ("int4g32", "int4g64", ["Int4Groupwise(group_size=32)", "Int4Groupwise(group_size=64)"]),
        ("int8", "int4g32", ["Int8Rowwise()", "Int4Groupwise(group_size=32)"]),
    ],
)
def test_format_mismatch_names_both(ranks, tmp_path, saved, loaded, names):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_model, saved, "s0_2", path)
    start = time.monotonic()
    results = ranks(2).run(load_expecting_error, loaded, "s0_2", path, timeout=60)
    assert time.monotonic() - start < 30  # no rank waited in a collective for the other
    for kind, msg, untouched in results:
        assert kind == "CheckpointFormatError", (kind, msg)
        assert all(n in msg for n in names) and "a.weight" in msg, msg
        assert untouched


def load_into_dense(path):
    net = cc.placed(OTHER, None, "s0_2")
    try:
        ckpt.load(net, path)
    except ValueError as e:
        return str(e)
    return "no error"


def test_quantized_checkpoint_into_dense_model_is_refused(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_model, "int8", "s0_2", path)
    for msg in ranks(2).run(load_into_dense, path, timeout=60):
        assert "quantized" in msg and "dense" in msg and "a.weight" in msg, msg


# -- async_save ----------------------------------------------------------------------------


def async_save_then_overwrite(fmt_name, layout, path, api):
    net = cc.placed(SEED, fmt_name, layout)
    if api == "dq":
        future = ckpt.async_save(net, path)
    elif api == "dcp":  # plain DCP's default planner: the entry form, explicitly
        future = dcp.async_save(ckpt.entries_from_state(net.state_dict()), checkpoint_id=path)
    else:  # the state dict's tensors, through the library's planner
        future = dcp.async_save(net.state_dict(), checkpoint_id=path, planner=ckpt.SavePlanner())
    if api == "dq":
        # Training goes on: collectives on the default group while the save runs in the background.
        for _ in range(5):
            net.a.weight.full_tensor()
            dist.barrier()
    # The state was staged before async_save returned: changing the weights now must not reach the file.
    for p in net.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        for t in local.inner.values() if isinstance(local, dq.QuantizedTensor) else [local]:
            t.detach().zero_()
    future.result()


@pytest.mark.parametrize("api", ["dq", "dcp", "tensors"])
def test_async_save_is_bit_exact(ranks, tmp_path, api):
    from tests.support.ckpt_cases import load_model

    path = str(tmp_path / "ckpt")
    ranks(2).run(async_save_then_overwrite, "int4g32", "tp2", path, api)
    ranks(4).run(load_model, "int4g32", "fsdp4", path)


# -- a rank killed mid-save ------------------------------------------------------------------


def save_and_die(fmt_name, layout, path, dying_rank):
    """Save other weights; ``dying_rank`` is killed right after writing its own files."""
    writer = ckpt.AtomicFileSystemWriter
    write_data = writer.write_data

    def write_then_die(self, plan, planner):
        result = write_data(self, plan, planner)
        result.wait()
        os._exit(17)

    if rank() == dying_rank:
        writer.write_data = write_then_die
    ckpt.save(cc.placed(OTHER, fmt_name, layout), path)
    return "completed"


@pytest.mark.slow  # kills a rank: its pool restarts (6 s)
@pytest.mark.parametrize("dying_rank", [0, 1])  # 0: the coordinator
def test_killed_rank_leaves_previous_checkpoint(ranks, tmp_path, dying_rank):
    """The survivor reports the failure; the previous checkpoint still loads bit-exactly."""
    from tests.support.ckpt_cases import load_model

    path = str(tmp_path / "ckpt")
    ranks(2).run(save_model, "int8", "s0_2", path)  # the previous checkpoint (SEED)
    pool = RankPool(2, timeout=120, device="cpu", pg_timeout=30)
    try:
        with pytest.raises(RankError) as info:
            pool.run(save_and_die, "int8", "s0_2", path, dying_rank)
    finally:
        pool.close(force=True)
    survivor = 1 - dying_rank
    error, trace = info.value.errors[survivor]
    assert isinstance(error, ckpt.CheckpointSaveError), trace
    assert "holds the previous checkpoint" in str(error), error
    assert error.lost_ranks == [dying_rank] and f"rank {dying_rank} stopped answering" in str(error), error
    assert "died" in str(info.value.errors[dying_rank][0]) or "exited" in info.value.errors[dying_rank][1]
    ranks(3).run(load_model, "int8", "s0_3", path)  # SEED's weights, not OTHER's
    # the next save cleans the partial files up and commits
    ranks(2).run(save_model, "int8", "s1_2", path, "dq", OTHER)
    assert not ckpt.staging_path(path).exists()
    ranks(2).run(load_model, "int8", "s0_2", path, "dq", OTHER)


# -- the coordinator's clean-up of a leftover staging directory races the other ranks ------------


def _wait_for(cond, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def save_while_racing_the_cleanup(path, marks):
    """``ckpt.save`` with the interleaving a loaded machine produces now and then, made certain.

    Rank 1 (DCP's ``prepare_local_plan``: ``Path.mkdir(parents=True,
    exist_ok=True)``) finds the staging directory already there (``os.mkdir``
    raises EEXIST) and is preempted before ``Path.mkdir`` checks that it is a
    directory; meanwhile the coordinator, cleaning up the leftovers, gets as far
    as it can. A coordinator that removes the directory and re-creates it lets
    rank 1's check land in between: FileExistsError, and the save fails.
    """
    staging = os.fspath(ckpt.staging_path(path))
    eexist, set_up = os.path.join(marks, "rank1_found_it"), os.path.join(marks, "coordinator_set_up")
    writer = ckpt.AtomicFileSystemWriter
    real_mkdir, real_rmdir, real_set_up = os.mkdir, os.rmdir, writer.set_up_storage_writer

    def mkdir(p, *args, **kwargs):
        try:
            return real_mkdir(p, *args, **kwargs)
        except FileExistsError:
            if os.fspath(p) == staging:
                open(eexist, "w").close()
                _wait_for(lambda: not os.path.isdir(staging) or os.path.exists(set_up))
            raise

    def rmdir(p, *args, **kwargs):
        if os.fspath(p) != staging:
            return real_rmdir(p, *args, **kwargs)
        _wait_for(lambda: os.path.exists(eexist))
        real_rmdir(p, *args, **kwargs)
        time.sleep(1.0)  # preempted before re-creating it

    def set_up_storage_writer(self, *args, **kwargs):
        real_set_up(self, *args, **kwargs)
        open(set_up, "w").close()

    if rank() == 1:
        os.mkdir = mkdir
    else:
        os.rmdir, writer.set_up_storage_writer = rmdir, set_up_storage_writer
    try:
        ckpt.save(cc.placed(SEED, "int8", "s0_2"), path)
    finally:
        os.mkdir, os.rmdir, writer.set_up_storage_writer = real_mkdir, real_rmdir, real_set_up


def test_save_survives_the_staging_cleanup_race(ranks, tmp_path):
    """A leftover ``.partial`` is cleaned up without failing a rank that is creating it at that moment."""
    from tests.support.ckpt_cases import load_model

    path = tmp_path / "ckpt"
    ckpt.staging_path(path).mkdir()  # an interrupted save's files
    (ckpt.staging_path(path) / "__7_0.distcp").write_bytes(b"half")
    ranks(2).run(save_while_racing_the_cleanup, str(path), str(tmp_path))
    assert (tmp_path / "rank1_found_it").exists(), "the race was not forced: rank 1 created the directory itself"
    assert not ckpt.staging_path(path).exists() and not (path / "__7_0.distcp").exists()
    ranks(2).run(load_model, "int8", "s1_2", str(path))


def save_with_partial_on_rank1(path):
    """Rank 1 alone holds a weight with no checkpoint form (Partial): rank 0 must not wait in DCP's collectives."""
    from torch.distributed.tensor import Partial

    net = cc.placed(SEED, "int8", "s0_2")
    if rank() == 1:
        w = net.a.weight
        partial = DTensor.from_local(w.to_local(), w.device_mesh, [Partial()], run_check=False)
        net.a.weight = torch.nn.Parameter(partial, requires_grad=False)
    start = time.monotonic()
    try:
        ckpt.save(net, path)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "saved", "", time.monotonic() - start


def test_a_save_refused_on_one_rank_raises_on_every_rank(ranks, tmp_path):
    results = ranks(2).run(save_with_partial_on_rank1, str(tmp_path / "ckpt"), timeout=60)
    for kind, msg, seconds in results:
        assert kind == results[1][0] != "saved" and "Partial" in msg and seconds < 30, (kind, msg, seconds)
    assert "rank 1 failed" in results[0][1]


def load_other_format_on_rank1(path):
    return load_damaged(path, "s0_2", "int8" if rank() == 0 else "int4g32")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_checkpoint_is_refused_on_every_rank_and_changes_nothing(ranks, tmp_path, damage):
    path = tmp_path / "ckpt"
    ranks(2).run(save_placed, str(path), "s0_2")
    victim = path / "__1_0.distcp"  # only rank 1's file: rank 0 must still refuse
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2 : len(data) // 2 + 4] = bytes(255 - b for b in data[len(data) // 2 : len(data) // 2 + 4])
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    for kind, msg, same in ranks(2).run(load_damaged, str(path), "s0_2", timeout=60):
        assert kind == "CheckpointCorruptError", (kind, msg)
        assert "__1_0.distcp" in msg and (".weight" in msg or ".bias" in msg), msg
        assert same, "a failed load changed the model"


def test_format_mismatch_on_one_rank_is_raised_on_every_rank(ranks, tmp_path):
    """Only rank 1's model differs from the checkpoint: rank 0 must not wait in DCP's collective."""
    path = tmp_path / "ckpt"
    ranks(2).run(save_placed, str(path), "s0_2")
    results = ranks(2).run(load_other_format_on_rank1, str(path), timeout=60)
    for kind, msg, same in results:
        assert kind == "CheckpointFormatError" and "Int4Groupwise" in msg, (kind, msg)
        assert same


# -- plain dcp.load of another format: every rank raises, nothing of the model written ------------------------


def local_bytes(net) -> dict[str, torch.Tensor]:
    """This rank's stored bytes of every parameter: a quantized weight's inner tensors, a dense tensor itself."""
    out = {}
    for n, p in net.named_parameters():
        local = p.to_local()
        inner = local.inner if isinstance(local, dq.QuantizedTensor) else {"": local}
        out.update({f"{n}.{k}": t.contiguous().view(torch.uint8).clone() for k, t in inner.items()})
    return out


def plain_dcp_load_of(fmt_name, layout, path):
    net = cc.placed(OTHER, fmt_name, layout)
    before = local_bytes(net)
    try:
        dcp.load(ckpt.entries_from_state(net.state_dict()), checkpoint_id=path)  # plain DCP: entries
        outcome = "loaded"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        outcome = f"{type(e).__name__}: {e}"
    after = local_bytes(net)
    return outcome, all(torch.equal(after[k], t) for k, t in before.items())


def test_plain_dcp_load_of_another_format_writes_nothing(ranks, tmp_path):
    """Saved on 2 ranks (each rank's chunks and some of the records in its own file), read with plain dcp.load
    into another format: before, DCP wrote the int8 codes into the float8 weights and only load_state_dict
    refused. Now nothing DCP reads (the dense bias included) reaches the model before every record of the load is
    checked, on every rank (the orders that used to write a dense tensor or another weight first:
    tests/checkpoint/test_dcp.py)."""
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_model, "int8", "s0_2", path)
    for outcome, untouched in ranks(2).run(plain_dcp_load_of, "f8row", "s0_2", path, timeout=120):
        assert "Int8Rowwise" in outcome and "Float8Rowwise" in outcome and "Nothing was written" in outcome, outcome
        assert untouched
    same = ranks(2).run(plain_dcp_load_of, "int8", "s0_2", path, timeout=120)
    assert [outcome for outcome, _ in same] == ["loaded"] * 2
