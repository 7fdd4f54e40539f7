"""Fault injection: one rank SIGKILLed in the middle of a save, an async save, a Hugging Face export and a
training step, and a disk that fills up during a save.

Each test starts ranks of its own (``tests/support/faults.py``: a killed rank would break the shared pool) and
chooses the kill point in the rank's own code, by wrapping a function the save calls. What every test checks:

* the previous checkpoint at the path still loads, bit-exactly (or, where the kill came after the move into
  place, the new one does: complete either way), in a later run of fresh processes;
* nothing partial is taken for a checkpoint: the path holds a complete checkpoint, and a partial directory
  gives a clear error;
* every survivor raises within :data:`BOUND` seconds of the death (the process group's timeout is 300 s),
  with an error naming the dead rank;
* the next save succeeds and removes the partial files.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant._checkpoint.hf.io import commit as hf_commit
from dtensor_quant._checkpoint.hf.io.safetensors_io import INDEX
from tests.support import ckpt_cases as cc
from tests.support.faults import die, die_at, run_ranks, survivors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Seconds a survivor may take to raise after the death: the roll call waits 3 s for the dead rank; the rest is
# slack for a loaded machine. Far below the process group's 300 s, so a survivor that only times out fails.
BOUND = 30.0
FMT, LAYOUT = "int8", "s0_2"


def check_survivors(outcomes, dead: int, error_type: str = "CheckpointSaveError") -> list:
    """Every other rank raised ``error_type`` naming ``dead``, within BOUND seconds of its death."""
    alive = survivors(outcomes, dead)
    for o in alive:
        assert o.kind == "raised" and o.error_type == error_type, str(o)
        assert f"rank {dead} stopped answering" in o.error, str(o)
        if error_type == "CheckpointSaveError":
            assert o.value == [dead], str(o)  # lost_ranks
        took = o.at - outcomes[dead].at
        assert took < BOUND, f"rank {o.rank} took {took:.1f} s to notice that rank {dead} died"
    return alive


# -- dq.checkpoint.save and async_save ---------------------------------------------------------


def _arm_dcp(point: str) -> None:
    """Make this process die at ``point`` of the next save."""
    import torch.distributed.checkpoint.filesystem as fs

    if point == "mid_write":  # after the first stored item: a data file half written
        calls = []
        die_at(fs, "_write_item", when=lambda *a, **k: calls.append(1) or len(calls) > 1)
    elif point == "before_metadata":  # the coordinator, every rank's data written, no .metadata yet
        die_at(ckpt.AtomicFileSystemWriter, "finish")
    elif point == "before_move":  # the coordinator, .metadata written into <path>.partial, not moved yet
        die_at(torch_dcp.FileSystemWriter, "finish", after=True)
    elif point == "after_move":  # the coordinator, the new checkpoint moved into place, no rank told yet
        die_at(ckpt.AtomicFileSystemWriter, "finish", after=True)
    else:
        raise AssertionError(point)


def save_twice_dying(path: str, dying: int, point: str, api: str) -> str:
    """Save SEED's weights (the previous checkpoint), then OTHER's, during which rank ``dying`` dies."""
    import torch.distributed as dist

    ckpt.save(cc.placed(cc.SEED, FMT, LAYOUT), path)
    if dist.get_rank() == dying:
        _arm_dcp(point)
    net = cc.placed(cc.OTHER, FMT, LAYOUT)
    if api == "save":
        ckpt.save(net, path)
    else:
        ckpt.async_save(net, path).result()
    return "saved"


def check_path_then_save_again(path: str, seed: int) -> None:
    """One process, a fresh model: ``path`` loads ``seed``'s weights bit-exactly; the next save commits."""
    cc.load_model(FMT, "single", path, "dq", seed)
    partial = ckpt.staging_path(path)
    if partial.exists() and not (partial / ".metadata").exists():
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            cc.load_model(FMT, "single", str(partial))
    cc.save_model(FMT, "single", path, "dq", 99)
    assert not partial.exists()
    cc.load_model(FMT, "single", path, "dq", 99)


DCP_KILLS = [
    pytest.param(1, "mid_write", "save", id="save-rank1-mid-write"),
    pytest.param(0, "mid_write", "save", id="save-coordinator-mid-write", marks=pytest.mark.slow),
    pytest.param(0, "before_metadata", "save", id="save-coordinator-before-metadata", marks=pytest.mark.slow),
    pytest.param(0, "before_move", "save", id="save-coordinator-before-move"),
    pytest.param(0, "after_move", "save", id="save-coordinator-after-move", marks=pytest.mark.slow),
    pytest.param(1, "mid_write", "async", id="async-rank1-mid-write"),
    pytest.param(0, "before_move", "async", id="async-coordinator-before-move", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dying,point,api", DCP_KILLS)
def test_rank_killed_during_dcp_save(tmp_path, dying, point, api):
    path = str(tmp_path / "ckpt")
    outcomes = run_ranks(2, save_twice_dying, path, dying, point, api)
    (survivor,) = check_survivors(outcomes, dying)
    committed = point == "after_move"
    if dying == 0:  # the survivor cannot know whether the coordinator moved the new checkpoint in
        assert "or this save's" in survivor.error, survivor.error
    else:
        assert "still holds the previous checkpoint" in survivor.error, survivor.error
    check_path_then_save_again(path, cc.OTHER if committed else cc.SEED)


def save_dying_after_write(path: str, seconds: float) -> str:
    """Rank 1 dies after writing its files, ``seconds`` late: the other ranks are waiting in DCP's exchange of
    the write results by then."""
    import time

    import torch.distributed as dist

    ckpt.save(cc.placed(cc.SEED, FMT, "s0_3"), path)
    if dist.get_rank() == 1:
        write = ckpt.AtomicFileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            time.sleep(seconds)
            die()

        ckpt.AtomicFileSystemWriter.write_data = write_then_die
    ckpt.save(cc.placed(cc.OTHER, FMT, "s0_3"), path)
    return "saved"


@pytest.mark.slow  # three ranks on two cores
def test_every_survivor_fails_fast_on_three_ranks(tmp_path):
    """Both survivors raise within the bound, each naming rank 1 and only rank 1 (they answer each other's roll
    call): gloo fails DCP's exchange on both at once."""
    path = str(tmp_path / "ckpt")
    check_survivors(run_ranks(3, save_dying_after_write, path, 2.0), 1)
    cc.load_model(FMT, "single", path, "dq", cc.SEED)


def resume_on_ranks(path: str) -> str:
    cc.load_model(FMT, LAYOUT, path, "dq", cc.SEED)
    cc.save_model(FMT, LAYOUT, path, "dq", cc.OTHER)
    cc.load_model(FMT, LAYOUT, path, "dq", cc.OTHER)
    return "resumed"


@pytest.mark.slow  # three starts of two ranks
def test_fresh_ranks_resume_after_a_killed_save(tmp_path):
    """The next run on the same mesh: loads the previous checkpoint, saves and loads the next one."""
    path = str(tmp_path / "ckpt")
    check_survivors(run_ranks(2, save_twice_dying, path, 1, "mid_write", "save"), 1)
    assert [o.kind for o in run_ranks(2, resume_on_ranks, path)] == ["returned"] * 2
    assert not ckpt.staging_path(path).exists()


# -- dq.hf.save ---------------------------------------------------------------------------------

SHARD_BYTES = 6000  # four tensors in three files and an index: a commit is several moves


def _arm_hf(point: str) -> None:
    if point == "mid_write":  # after this rank's first slice: a file of the staging directory half written
        die_at(os, "pwrite", after=True)
    elif point == "before_commit":  # every rank's bytes and the index staged; the journal not yet in place
        die_at(os, "replace", when=lambda src, dst, **k: Path(dst).name == hf_commit.JOURNAL)
    elif point == "mid_commit":  # the journal in place, the first new file moved in, the others not yet
        die_at(os, "replace", after=True, when=lambda src, dst, **k: Path(src).parent.name == hf_commit.STAGING)
    else:
        raise AssertionError(point)


def hf_save_twice_dying(path: str, dying: int, point: str) -> str:
    import torch.distributed as dist

    dq.hf.save(cc.placed(cc.SEED, FMT, LAYOUT), path, max_shard_bytes=SHARD_BYTES)
    if dist.get_rank() == dying:
        _arm_hf(point)
    dq.hf.save(cc.placed(cc.OTHER, FMT, LAYOUT), path, max_shard_bytes=SHARD_BYTES)
    return "saved"


def check_hf_export(path: str, seed: int) -> None:
    """``path`` loads into a dense model as ``seed``'s quantized weights dequantized, bit for bit."""
    net = cc.dense_net(5)
    dq.hf.load(net, path)
    ref = dict(cc.reference(seed, FMT).named_parameters())
    for name, got in net.named_parameters():
        want = ref[name].detach()
        want = want.dequantize(torch.bfloat16) if isinstance(want, dq.QuantizedTensor) else want
        assert torch.equal(got.detach().view(torch.uint8), want.view(torch.uint8)), name


HF_KILLS = [
    pytest.param(1, "mid_write", id="rank1-mid-write"),
    pytest.param(0, "mid_write", id="leader-mid-write", marks=pytest.mark.slow),
    pytest.param(0, "before_commit", id="leader-before-commit", marks=pytest.mark.slow),
    pytest.param(0, "mid_commit", id="leader-mid-commit"),
]


@pytest.mark.parametrize("dying,point", HF_KILLS)
def test_rank_killed_during_hf_save(tmp_path, dying, point):
    path = str(tmp_path / "export")
    outcomes = run_ranks(2, hf_save_twice_dying, path, dying, point)
    (survivor,) = check_survivors(outcomes, dying)
    if dying == 0:
        assert "or this one if rank 0 died after committing it" in survivor.error, survivor.error
    else:
        assert "holds the previous export as it was" in survivor.error, survivor.error
    committed = point == "mid_commit"
    assert (Path(path) / hf_commit.JOURNAL).exists() == committed
    check_hf_export(path, cc.OTHER if committed else cc.SEED)  # the reader finishes an interrupted commit
    assert not (Path(path) / hf_commit.JOURNAL).exists()
    dq.hf.save(cc.reference(99, FMT), path, max_shard_bytes=SHARD_BYTES)  # the next save, in one process
    named = set(json.loads((Path(path) / INDEX).read_text())["weight_map"].values())
    assert len(named) > 1 and {p.name for p in Path(path).iterdir()} == {INDEX, *named}  # nothing stale or staged
    check_hf_export(path, 99)


# -- a training step under FSDP2 and under tensor parallelism -----------------------------------------


def tiny_trainable(how: str):
    """Two Linears with trainable Int8Rowwise weights, sharded by FSDP2 or tensor parallel, and SGD."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dtensor_quant.fsdp import fully_shard
    from dtensor_quant.testing import mesh

    m = mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 16)).to(torch.bfloat16)
    if how == "tp":
        parallelize_module(model, m, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    dq.quantize_(model, dq.Int8Rowwise(), trainable=True, seed=3)
    if how == "fsdp":
        for layer in model:
            fully_shard(layer, mesh=m)
        fully_shard(model, mesh=m)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), m


def train_step(model, opt, how: str, step: int) -> None:
    import torch.distributed as dist

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    if how == "fsdp":  # data parallel: each rank its rows of the batch
        x = x.chunk(dist.get_world_size())[dist.get_rank()]
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def snapshot(model) -> list:
    """Every parameter's full stored bytes (inner tensors of quantized ones)."""
    from torch.distributed.tensor import DTensor

    out = []
    for p in model.parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        inner = full.inner if isinstance(full, dq.QuantizedTensor) else {"": full}
        out.append({n: t.clone().view(torch.uint8) if t.element_size() == 1 else t.clone() for n, t in inner.items()})
    return out


def same(a: list, b: list) -> bool:
    same_keys = len(a) == len(b)
    return same_keys and all(x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x) for x, y in zip(a, b))


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def train_save_then_die(path: str, how: str, dying: int) -> dict:
    """Step 0, save, step 1 (recorded), then rank ``dying`` dies in step 2's forward; survivors name it."""
    import torch.distributed as dist

    model, opt, m = tiny_trainable(how)
    train_step(model, opt, how, 0)
    saved = snapshot(model)
    ckpt.save(_state(model, opt), path)
    train_step(model, opt, how, 1)
    after_one = snapshot(model)
    if dist.get_rank() == dying:
        model[1].register_forward_pre_hook(lambda *_: die())
    try:
        train_step(model, opt, how, 2)
    except RuntimeError as e:  # gloo's 'Connection closed by peer [address]': which rank is that?
        return {"lost": dq.lost_ranks(m.get_group()), "error": str(e), "saved": saved, "after_one": after_one}
    return {"lost": None}


def resume(path: str, how: str) -> tuple[list, list]:
    """Fresh ranks: load the checkpoint, then take step 1 again."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, _ = tiny_trainable(how)
    state = _state(model, opt)
    ckpt.load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = snapshot(model)
    train_step(model, opt, how, 1)
    return loaded, snapshot(model)


@pytest.mark.slow  # two starts of two ranks, a training step each: 13-60 s on a loaded machine
@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_rank_killed_during_a_training_step(tmp_path, how):
    """The survivor's step fails at once; ``dq.lost_ranks`` names the dead rank; fresh ranks resume exactly."""
    path = str(tmp_path / "ckpt")
    outcomes = run_ranks(2, train_save_then_die, path, how, 1)
    (survivor,) = survivors(outcomes, 1)
    assert survivor.kind == "returned" and survivor.value["lost"] == [1], str(survivor)
    assert survivor.at - outcomes[1].at < BOUND
    for o in run_ranks(2, resume, path, how):
        assert o.kind == "returned", str(o)
        loaded, stepped = o.value
        assert same(loaded, survivor.value["saved"])
        assert same(stepped, survivor.value["after_one"])  # the uninterrupted run's step 1, bit for bit


# -- a disk that fills up during a save -----------------------------------------------------------------

DISK_BYTES = 8 << 20  # the tmpfs: ample for the previous checkpoint, then filled up to LEFT_FREE


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own under ``tmp_path`` (root only); skipped where mounting is not permitted."""
    import subprocess

    where = tmp_path / "disk"
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(where)]
    done = subprocess.run(mount, capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode}); the "
                    "file-size-limit case covers a failing disk")  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_disk(where: str) -> None:
    """Fill the file system of ``where`` but for one page: too little for any save of the model."""
    left = os.sysconf("SC_PAGE_SIZE")
    with open(os.path.join(where, "filler"), "wb") as f:
        f.truncate(0)
        f.write(bytes(max(0, shutil.disk_usage(where).free - left)))
    assert shutil.disk_usage(where).free <= left


def limit_file_size() -> None:
    """Writes past 1 KiB fail with EFBIG in this process (SIGXFSZ ignored: without that the process would die)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def save_onto_full_disk(path: str, how: str, api: str) -> str:
    """Save SEED (the previous checkpoint); then the disk fills up (tmpfs), or rank 1's file-size limit drops,
    and OTHER is saved: every rank must raise."""
    import torch.distributed as dist

    def save(seed):
        if api == "dcp":
            ckpt.save(cc.placed(seed, FMT, LAYOUT), path)
        else:
            dq.hf.save(cc.placed(seed, FMT, LAYOUT), path, max_shard_bytes=SHARD_BYTES)

    save(cc.SEED)
    dist.barrier()
    if how == "tmpfs" and dist.get_rank() == 0:
        fill_disk(os.path.dirname(path))
    if how == "fsize" and dist.get_rank() == 1:
        limit_file_size()
    dist.barrier()
    save(cc.OTHER)
    return "saved"


@pytest.mark.parametrize(
    "how,api",
    [
        pytest.param("tmpfs", "dcp", id="tmpfs-dcp"),
        pytest.param("fsize", "dcp", id="fsize-dcp", marks=pytest.mark.slow),
        pytest.param("tmpfs", "hf", id="tmpfs-hf", marks=pytest.mark.slow),
        pytest.param("fsize", "hf", id="fsize-hf"),
    ],
)
def test_disk_full_during_save(request, tmp_path, how, api):
    """Every rank raises, saying why; the previous checkpoint at the path stays intact and loads."""
    where = request.getfixturevalue("small_disk") if how == "tmpfs" else tmp_path
    path = str(where / "ckpt")
    outcomes = run_ranks(2, save_onto_full_disk, path, how, api)
    why = "No space left on device" if how == "tmpfs" else "File too large"
    for o in outcomes:
        assert o.kind == "raised" and why in o.error, str(o)
        assert o.error_type == ("CheckpointSaveError" if api == "dcp" else "OSError"), str(o)
    if how == "tmpfs":
        os.remove(where / "filler")
    if api == "dcp":
        check_path_then_save_again(path, cc.SEED)
    else:
        check_hf_export(path, cc.SEED)
        assert not (Path(path) / hf_commit.STAGING).exists()
