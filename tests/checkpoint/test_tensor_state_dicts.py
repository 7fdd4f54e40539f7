"""Tensors-only state dicts (``dq.checkpoint.tensor_state_dicts``): values are tensors; DCP through the planners.

On disk nothing changes: the planners write each quantized value as its
entries (one key per inner tensor plus the ``__quant__`` record), the files
``dq.checkpoint.save`` writes, readable without this library.
"""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import dtensor_quant as dq
from dtensor_quant.checkpoint import CheckpointFormatError

FMT = dq.Int4Groupwise(64)


def model(seed: int, fmt=FMT) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(128, 96, bias=True), nn.Linear(96, 64, bias=False))
    return dq.checkpoint.tensor_state_dicts(dq.quantize_(m, fmt))


def first_error(e: BaseException) -> BaseException:
    """The rank's own error inside DCP's CheckpointException (a BaseException)."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if failures else e


def same_params(a: nn.Module, b: nn.Module) -> bool:
    for p, q in zip(a.parameters(), b.parameters()):
        if isinstance(p, dq.QuantizedTensor):
            if not all(torch.equal(getattr(p, n), getattr(q, n)) for n in p.fmt.inner_names):
                return False
        elif not torch.equal(p, q):
            return False
    return True


def test_values_are_tensors_sharing_the_parameters_bytes():
    m = model(0)
    sd = m.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    w = sd["0.weight"]
    assert isinstance(w, dq.QuantizedTensor) and w.shape == (96, 128)
    assert w.qdata.data_ptr() == m[0].weight.qdata.data_ptr()
    assert get_model_state_dict(m)["1.weight"].shape == (64, 96)


def test_load_state_dict_copies_the_bytes():
    src, dst = model(0), model(1)
    assert not same_params(src, dst)
    dst.load_state_dict(src.state_dict())
    assert same_params(src, dst)


def test_load_state_dict_of_a_dense_parameter_of_another_dtype_quantizes_its_values():
    """A dense value that requires grad (another model's parameter, in bfloat16) is a value to load: quantized
    (after the cast to the model's dtype), never refused as a graph."""
    dst = model(1)
    source = nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
    dst.load_state_dict({"1.weight": source}, strict=False)
    dq.testing.assert_same_bits(dst[1].weight, dq.quantize(source.detach().float(), FMT), "loaded")


def test_load_state_dict_of_another_format_is_refused():
    dst = model(1)
    with pytest.raises(CheckpointFormatError, match="Int8Rowwise"):
        dst.load_state_dict(model(0, dq.Int8Rowwise()).state_dict())


def test_set_model_state_dict_copies_the_bytes():
    src, dst = model(0), model(2)
    set_model_state_dict(dst, get_model_state_dict(src))
    assert same_params(src, dst)


def test_plain_dcp_with_the_planners_writes_the_entries(tmp_path):
    src, dst = model(0), model(3)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path), planner=dq.checkpoint.SavePlanner(), no_dist=True)
    stored = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert {"0.weight.qdata", "0.weight.scale", "0.weight.zero", "0.weight.__quant__", "0.bias"} <= set(stored)
    assert "0.weight" not in stored
    sd = dst.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=dq.checkpoint.LoadPlanner(), no_dist=True)
    assert same_params(src, dst)  # read straight into the parameters' bytes
    dst.load_state_dict(sd)
    assert same_params(src, dst)


def test_the_files_read_without_the_library(tmp_path):
    """Plain DCP, a plain state dict of plain tensors: the inner tensors and the JSON record."""
    src = model(0)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path), planner=dq.checkpoint.SavePlanner(), no_dist=True)
    w = src[0].weight
    plain = {"0.weight.qdata": torch.empty_like(w.qdata), "0.weight.__quant__": ""}
    dcp.load(plain, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(plain["0.weight.qdata"], w.qdata)
    assert json.loads(plain["0.weight.__quant__"])["format"] == "Int4Groupwise"


def test_the_load_planner_checks_the_format_record(tmp_path):
    dcp.save(
        model(0, dq.Int8Rowwise()).state_dict(),
        checkpoint_id=str(tmp_path),
        planner=dq.checkpoint.SavePlanner(),
        no_dist=True,
    )
    dst = model(1, dq.Float8Rowwise())  # inner tensors of the same names and shapes
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException
        dcp.load(dst.state_dict(), checkpoint_id=str(tmp_path), planner=dq.checkpoint.LoadPlanner(), no_dist=True)
    error = first_error(info.value)
    assert isinstance(error, CheckpointFormatError) and "Int8Rowwise" in str(error) and "Float8Rowwise" in str(error)


def test_the_default_planner_is_refused_naming_the_planners(tmp_path):
    with pytest.raises(BaseException) as info:
        dcp.save(model(0).state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    error = first_error(info.value)
    assert isinstance(error, CheckpointFormatError) and "SavePlanner" in str(error)


def test_dq_checkpoint_save_and_load_take_either_form(tmp_path):
    src, dst = model(0), model(4)
    dq.checkpoint.save(src, tmp_path / "a")
    dq.checkpoint.load(dst, tmp_path / "a")
    assert same_params(src, dst)
    dense = nn.Sequential(nn.Linear(128, 96, bias=True), nn.Linear(96, 64, bias=False))
    dq.checkpoint.save(dense, tmp_path / "dense")
    dq.checkpoint.load(dst, tmp_path / "dense")  # quantized on load
    assert torch.equal(dst[0].weight.qdata, dq.quantize(dense[0].weight.detach(), FMT).qdata)


def test_a_fused_qkv_split_hook_sees_tensors():
    """torchtitan's hook shape: split a fused weight on save (.shape, torch.split), join it on load (torch.cat)."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wqkv = nn.Linear(128, 3 * 64, bias=False)
            self._register_state_dict_hook(self.split)
            self._register_load_state_dict_pre_hook(self.join)

        @staticmethod
        def split(module, state_dict, prefix, local_metadata):
            w = state_dict.pop(prefix + "wqkv.weight")
            rows = w.shape[0] // 3
            for name, part in zip("qkv", torch.split(w, rows, dim=0)):
                state_dict[prefix + f"w{name}.weight"] = part

        @staticmethod
        def join(state_dict, prefix, *args):
            parts = [state_dict.pop(prefix + f"w{name}.weight") for name in "qkv"]
            state_dict[prefix + "wqkv.weight"] = torch.cat(parts, dim=0)

    def attention(seed):
        torch.manual_seed(seed)
        return dq.checkpoint.tensor_state_dicts(dq.quantize_(Attention(), dq.Int8Rowwise()))

    src, dst = attention(0), attention(1)
    sd = src.state_dict()
    assert sorted(sd) == ["wk.weight", "wq.weight", "wv.weight"]
    assert all(isinstance(v, dq.QuantizedTensor) and v.shape == (64, 128) for v in sd.values())
    dst.load_state_dict(sd)
    assert same_params(src, dst)
