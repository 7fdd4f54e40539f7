"""checkpoint/dcp on one process: the checkpoint is readable without the library; damaged, partial and
mismatched checkpoints are refused with the documented error types.
"""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

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


def test_plain_dcp_load_of_another_format_says_the_bytes_were_written(tmp_path):
    """Int8Rowwise and Float8Rowwise entries have the same names and shapes: DCP's planning lets them through and
    copies int8 codes into the float8 qdata (DCP converts dtypes). dq.checkpoint.load refuses before reading;
    plain dcp.load cannot be stopped before it writes (DCP has no hook between reading its metadata and writing
    the tensors), so load_state_dict's refusal says that the parameter already holds the checkpoint's bytes."""
    path = str(tmp_path / "ckpt")
    ckpt.save(cc.reference(SEED, "int8"), path)
    net = cc.reference(OTHER, "f8row")
    before = {k: v.clone() for k, v in net.a.weight.inner.items()}
    with pytest.raises(ckpt.CheckpointFormatError, match=r"Int8Rowwise.*Float8Rowwise"):
        ckpt.load(net, path)
    assert all(torch.equal(net.a.weight.inner[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items())
    sd = net.state_dict()
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    with pytest.raises(ckpt.CheckpointFormatError, match=r"already written the checkpoint's bytes"):
        net.load_state_dict(sd)


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
