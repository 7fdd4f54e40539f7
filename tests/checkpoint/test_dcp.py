"""checkpoint/dcp on one process: the checkpoint is readable without the library; damaged, partial and
mismatched checkpoints are refused with the documented error types.
"""

import dataclasses
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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


def mixed(seed: int, formats: dict[str, str | None]):
    """``cc.dense_net(seed)`` with each of its Linears ``a``, ``b``, ``c`` quantized in its own format (None: dense)."""
    net = cc.dense_net(seed)
    for name, fmt_name in formats.items():
        if fmt_name:
            dq.quantize_(getattr(net, name), dq.testing.FORMATS[fmt_name])
    return net


# (saved, loaded into): one weight of another format; a dense weight ahead of the refused one, which DCP reads
# first in its plan's order; a weight that fits ahead of one that does not.
REFUSALS = {
    "another format": ({"a": "int8", "b": "int8", "c": "int8"}, {"a": "f8row", "b": "f8row", "c": "f8row"}),
    "dense first": ({"a": None, "b": "int8", "c": "int8"}, {"a": None, "b": "f8row", "c": "int8"}),
    "a fitting weight first": ({"a": "int8", "b": "int8", "c": "f8row"}, {"a": "int8", "b": "int8", "c": "int8"}),
}


@pytest.mark.parametrize("planner", ["entry form", "tensors-only + LoadPlanner"])
@pytest.mark.parametrize("case", list(REFUSALS))
@pytest.mark.parametrize("order", ["as planned", "tensors first"])
def test_plain_dcp_load_of_another_format_leaves_the_model_untouched(tmp_path, order, case, planner):
    """Int8Rowwise and Float8Rowwise entries have the same names and shapes: DCP's planning lets them through and
    would copy int8 codes into the float8 qdata (DCP converts dtypes). The state dict's entries hold back every
    chunk DCP reads (dense tensors and other weights too) until every record the load reads is checked: the load
    raises and not one byte of the model changed, whichever order DCP reads in. Before, the quantized bytes were
    written and only load_state_dict refused; then a dense tensor or another weight read before the refused record
    was still written. The same for a tensors-only state dict through dq.checkpoint.LoadPlanner."""
    saved, loaded = REFUSALS[case]
    path = str(tmp_path / "ckpt")
    ckpt.save(mixed(SEED, saved), path)
    net = mixed(OTHER, loaded)
    before = model_bytes(net)
    with pytest.raises(ckpt.CheckpointFormatError, match=r"Int8Rowwise.*Float8Rowwise|Float8Rowwise.*Int8Rowwise"):
        ckpt.load(net, path)
    reader = TensorsFirst(path) if order == "tensors first" else dcp.FileSystemReader(path)
    kwargs = {}
    if planner == "entry form":
        sd = ckpt.entries_from_state(net.state_dict())
    else:
        sd = net.state_dict()
        kwargs["planner"] = dq.checkpoint.LoadPlanner()
    with pytest.raises(CheckpointException, match=r"(?s)Rowwise.*Rowwise.*Nothing was written"):
        dcp.load(sd, storage_reader=reader, no_dist=True, **kwargs)
    after = model_bytes(net)
    assert not [k for k, v in before.items() if not torch.equal(after[k], v)]
    # the refused load left nothing armed: a load of a checkpoint that fits, into the same state dict, is exact
    ckpt.save(mixed(SEED, loaded), path + "2")
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path + "2"), no_dist=True, **kwargs)
    net.load_state_dict(sd)
    expected = model_bytes(mixed(SEED, loaded))
    assert all(torch.equal(model_bytes(net)[k], v) for k, v in expected.items())


@pytest.mark.parametrize("saved", [{"a": None, "b": "int8", "c": None}, {"a": None, "b": None, "c": None}])
def test_partial_plain_dcp_load_writes_what_it_reads(tmp_path, saved):
    """allow_partial_load: a quantized weight the checkpoint lacks (held dense there) is skipped, and its record
    is not waited for: every tensor the load reads is written, with or without a record in the load."""
    path = str(tmp_path / "ckpt")
    ckpt.save(mixed(SEED, saved), path)
    net = mixed(OTHER, {"a": None, "b": "int8", "c": "int8"})
    before, want = model_bytes(net), model_bytes(mixed(SEED, saved))
    sd = ckpt.entries_from_state(net.state_dict())  # plain DCP's default planner: the entry form
    dcp.load(sd, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    after = model_bytes(net)
    for key, value in after.items():
        read = key in want and (key.startswith(("a.", "b.bias", "c.bias")) or (saved["b"] and key.startswith("b.")))
        assert torch.equal(value, want[key] if read else before[key]), key


def test_plain_dcp_load_of_entries_without_a_record_writes_nothing(tmp_path):
    """A checkpoint holding a weight's entries but no format record (allow_partial_load lets it through): what
    the load read waits for a record that never comes; load_state_dict then refuses, the model untouched."""
    path = str(tmp_path / "ckpt")
    source = mixed(SEED, {"a": None, "b": "int8", "c": None})
    sd = ckpt.entries_from_state(source.state_dict())
    del sd["b.weight"]["__quant__"]
    dcp.save(dict(sd), checkpoint_id=path, no_dist=True)
    net = mixed(OTHER, {"a": None, "b": "int8", "c": None})
    before, sd = model_bytes(net), ckpt.entries_from_state(net.state_dict())
    dcp.load(sd, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    with pytest.raises(ckpt.CheckpointFormatError, match=r"without their __quant__ format record.*nothing the load"):
        net.load_state_dict(sd)
    assert all(torch.equal(model_bytes(net)[k], v) for k, v in before.items())


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


def test_save_takes_a_model_or_a_state_dict(tmp_path):
    """Before: AttributeError ('NoneType' object has no attribute 'items')."""
    for state in (None, [1, 2]):
        with pytest.raises(TypeError, match="takes a model"):
            ckpt.save(state, str(tmp_path / "ckpt"))


def test_a_partial_load_into_a_model_with_more_weights(tmp_path):
    """strict=False: the model's extra quantized weight (not in the checkpoint) keeps its bytes, the others load.
    A load guard armed by that weight's record must not wait for the records dq.checkpoint.load checked first."""
    path = str(tmp_path / "ckpt")
    saved = mixed(SEED, {"a": "int8", "b": "int8", "c": "int8"})
    ckpt.save({k: v for k, v in saved.state_dict().items() if not k.startswith("c.")}, path)  # no c at all
    net = mixed(OTHER, {"a": "int8", "b": "int8", "c": "int8"})
    before, want = model_bytes(net), model_bytes(saved)
    ckpt.load(net, path, strict=False)
    for key, value in model_bytes(net).items():
        assert torch.equal(value, before[key] if key.startswith("c.") else want[key]), key
