"""checkpoint/hf/saving on one process: an export replaces the previous one."""

from __future__ import annotations

import pytest

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
