"""checkpoint/dcp on one process: the checkpoint is readable without the library; damaged, partial and
mismatched checkpoints are refused with the documented error types.
"""

import dataclasses
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadItemType

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from tests.support import ckpt_cases as cc
from tests.support.ckpt_cases import OTHER, SEED, load_damaged, save_model, save_placed

# Plain dcp calls in this process (no process group) say they assume a single process: that is the intent.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# Runs in a fresh interpreter where importing dtensor_quant fails.
READER = """
import json, sys
sys.modules["dtensor_quant"] = None
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

path, out = sys.argv[1], sys.argv[2]
dcp_to_torch_save(path, out + ".tmp")
sd = torch.load(out + ".tmp", weights_only=True)
w = sd["a.weight"]  # nested as saved: {"qdata": ..., "scale": ..., "__quant__": ...}
spec = json.loads(w["__quant__"])
# Int8Rowwise as docs/checkpoint.md describes it: w = qdata * scale
dense = (w["qdata"].float() * w["scale"].float()).to(getattr(torch, spec["dtype"]))
torch.save((spec, dense), out)
"""


@pytest.mark.slow
def test_readable_without_the_library(tmp_path):
    """The entries and the format record suffice to rebuild a weight; nothing needs an unsafe unpickle."""
    import subprocess
    import sys

    path = tmp_path / "ckpt"
    save_model("int8", "single", str(path))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-c", READER, str(path), str(tmp_path / "out.pt")]
    subprocess.run(cmd, check=True, env=env, timeout=300)
    spec, dense = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = cc.reference(SEED, "int8").a.weight
    assert spec["format"] == "Int8Rowwise" and spec["shape"] == list(ref.shape)
    assert spec["inner"]["scale"]["layout"] == ["one-to-one", "constant"]
    assert torch.equal(dense, ref.dequantize())


def test_missing_checkpoint_names_the_partial_save(tmp_path):
    path = tmp_path / "ckpt"
    ckpt.staging_path(path).mkdir()
    (ckpt.staging_path(path) / "__0_0.distcp").write_bytes(b"half")
    with pytest.raises(FileNotFoundError, match=r"ckpt.partial holds the files of a save that did not complete"):
        ckpt.load(cc.reference(SEED, "int8"), str(path))


def model_bytes(net) -> dict[str, torch.Tensor]:
    """Every stored byte of a model: each quantized weight's inner tensors, each dense tensor."""
    out = {}
    for name, p in net.named_parameters():
        tensors = p.inner if isinstance(p, dq.QuantizedTensor) else {"": p.detach()}
        out.update({f"{name}.{k}": t.contiguous().view(torch.uint8).clone() for k, t in tensors.items()})
    return out


class TensorsFirst(dcp.FileSystemReader):
    """Reads every tensor chunk before any bytes entry: what DCP does when a weight's chunk lies in a file it
    reads before the file holding the weight's format record (several ranks' files)."""

    def prepare_local_plan(self, plan):
        plan = super().prepare_local_plan(plan)
        return dataclasses.replace(plan, items=sorted(plan.items, key=lambda i: i.type == LoadItemType.BYTE_IO))


@pytest.mark.parametrize("order", ["as planned", "tensors first"])
def test_plain_dcp_load_of_another_format_leaves_the_model_untouched(tmp_path, order):
    """Int8Rowwise and Float8Rowwise entries have the same names and shapes: DCP's planning lets them through and
    would copy int8 codes into the float8 qdata (DCP converts dtypes). The state dict's entries check the record
    DCP reads before the weight's bytes reach the parameter (a chunk read before its record waits in a scratch
    copy): the load raises and no quantized weight changed. Before, the bytes were written and only
    load_state_dict refused."""
    path = str(tmp_path / "ckpt")
    ckpt.save(cc.reference(SEED, "int8"), path)
    net = cc.reference(OTHER, "f8row")
    before = model_bytes(net)
    with pytest.raises(ckpt.CheckpointFormatError, match=r"Int8Rowwise.*Float8Rowwise"):
        ckpt.load(net, path)
    reader = TensorsFirst(path) if order == "tensors first" else dcp.FileSystemReader(path)
    with pytest.raises(CheckpointException, match=r"(?s)Int8Rowwise.*Float8Rowwise.*Nothing was written"):
        dcp.load(ckpt.entries_from_state(net.state_dict()), storage_reader=reader, no_dist=True)
    after = model_bytes(net)
    changed = [k for k, v in before.items() if not torch.equal(after[k], v)]
    if order == "as planned":  # the first entry DCP reads is a.weight's record: nothing at all is written
        assert not changed, changed
    else:  # no quantized weight is written; a dense tensor read before the refused record is loaded, as plain
        assert changed == ["b.bias."], changed  # DCP loads what it meets (dq.checkpoint.load checks all first)


@pytest.mark.parametrize("order", ["as planned", "tensors first"])
def test_plain_dcp_load_of_the_same_format_is_bit_exact(tmp_path, order):
    """The check costs nothing when the record is read first; chunks read before it are committed after it."""
    path = str(tmp_path / "ckpt")
    ckpt.save(cc.reference(SEED, "int8"), path)
    net = cc.reference(OTHER, "int8")
    sd = ckpt.entries_from_state(net.state_dict())  # plain DCP's default planner: the entry form, explicitly
    reader = TensorsFirst(path) if order == "tensors first" else dcp.FileSystemReader(path)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    expected = model_bytes(cc.reference(SEED, "int8"))
    got = model_bytes(net)
    assert all(torch.equal(got[k], v) for k, v in expected.items())  # in place, before load_state_dict
    net.load_state_dict(sd)
    assert all(torch.equal(model_bytes(net)[k], v) for k, v in expected.items())


@pytest.mark.parametrize("form", ["tensors", "entries"])
def test_state_dicts_pickle_under_weights_only(tmp_path, form):
    """torch.save of model.state_dict() loads with weights_only=True: tensors (the library's safe globals) or
    entries (an OrderedDict there)."""
    net = cc.reference(SEED, "int8")
    sd = net.state_dict() if form == "tensors" else ckpt.entries_from_state(net.state_dict())
    torch.save(sd, tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt", weights_only=True)
    fresh = cc.reference(OTHER, "int8")
    fresh.load_state_dict(back)
    expected = model_bytes(net)
    assert all(torch.equal(model_bytes(fresh)[k], v) for k, v in expected.items())


def test_damaged_checkpoint_single_process(tmp_path):
    path = tmp_path / "ckpt"
    save_placed(str(path), "single")
    victim = next(path.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x10
    victim.write_bytes(bytes(data))
    kind, msg, same = load_damaged(str(path), "single")
    assert kind == "CheckpointCorruptError" and victim.name in msg and same, (kind, msg)


def test_save_errors_have_the_documented_type(tmp_path):
    from dtensor_quant import checkpoint as ckpt

    net = dq.quantize_(torch.nn.Linear(64, 16), dq.Int8Rowwise())
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ckpt.CheckpointSaveError):
        ckpt.save(net, str(blocker / "ckpt"))
    future = ckpt.async_save(net, str(blocker / "ckpt"))
    with pytest.raises(ckpt.CheckpointSaveError):
        future.result(timeout=60)  # completes: DCP's CheckpointException is a BaseException


def test_damaged_metadata_is_a_corrupt_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    save_placed(str(path), "single")
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    kind, msg, same = load_damaged(str(path), "single")
    assert kind == "CheckpointCorruptError" and ".metadata" in msg and same, (kind, msg)
