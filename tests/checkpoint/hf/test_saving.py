"""checkpoint/hf/saving on one process: an export replaces the previous one."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support.hf_cases import build

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_save_replaces_a_previous_export(checkpoints, tmp_path):
    """A single-file export over a sharded one leaves no stale index or shard behind."""
    model = build("llama", "single", "int8")
    dq.hf.load(model, checkpoints["llama", False])
    dq.hf.save(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    dq.hf.save(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]


def test_save_arguments_are_checked(tmp_path):
    """Before: dtype='bfloat16' raised AttributeError inside the layout, dtype=torch.int8 wrote truncated weights
    (then failed inside dequantize), float8 wrote scale-less weights the loader took for stored FP8,
    max_shard_bytes <= 0 put every tensor in a file of its own, a state dict raised AttributeError."""
    model = build("llama", "single", "int8")
    for dtype in ("bfloat16", torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="the dtype dense tensors are written in"):
            dq.hf.save(model, tmp_path / "a", dtype=dtype)
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_shard_bytes"):
            dq.hf.save(model, tmp_path / "b", max_shard_bytes=size)
    with pytest.raises(TypeError, match="takes a model"):
        dq.hf.save(model.state_dict(), tmp_path / "c")
    assert not any(tmp_path.iterdir())  # nothing written
