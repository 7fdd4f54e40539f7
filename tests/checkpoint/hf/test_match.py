"""checkpoint/hf/match: a checkpoint that does not match the model is refused before anything is read."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support import hf_cases as hc
from tests.support.hf_cases import build

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_quantized_checkpoint_into_another_format_is_refused(fp8_checkpoints):
    with pytest.raises(ValueError, match=r"stored quantized.*Float8Blockwise"):
        dq.hf.load(build("llama", "single", "int8"), fp8_checkpoints[False])


def test_missing_and_unexpected_tensors_are_refused(tmp_path, checkpoints):
    from safetensors.torch import save_file

    full = hc.read_all(checkpoints["llama", False])
    del full["model.norm.weight"]
    full["extra.weight"] = torch.zeros(2)
    save_file(full, str(tmp_path / "model.safetensors"))
    model = build("llama", "single", "int8")
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model.norm.weight'\]") as e:
        dq.hf.load(model, tmp_path)
    assert "extra.weight" in str(e.value)
    result = dq.hf.load(model, tmp_path, strict=False)
    assert sorted(result.quantized) == sorted(dq.quantized_fqns(model))
    assert (result.missing, result.unexpected) == (["model.norm.weight"], ["extra.weight"])
