"""transformers.Trainer + FSDP2 (accelerate) fine-tunes trainable int8 weights on 2 gloo ranks.

The model comes from ``from_pretrained(..., quantization_config=dq.hf.QuantConfig("int8", trainable=True))``;
Trainer runs its defaults (fused AdamW, ``adamw_torch_fused``) under accelerate's FSDP2 (on CPU through the
state shim of tests/support/hf_trainer_cases.py). Checked: the weights stay int8 and trainable and change;
``save_model`` writes the gathered bytes, which ``from_pretrained`` and ``dq.hf.load`` read back as they are;
a run resumed from Trainer's checkpoint ends with the continuous run's bytes on every rank.
"""

from __future__ import annotations

import pytest

from tests.support import hf_trainer_cases as tc
from tests.support.hf_cases import CONFIG

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

LINEARS = 7 * CONFIG["num_hidden_layers"] + 1  # q, k, v, o, gate, up, down a layer; lm_head


@pytest.mark.slow
def test_trainer_fsdp2_fused_adamw_save_model_reload(ranks, checkpoints, tmp_path):
    results = ranks(2).run(tc.train_save_reload, checkpoints["llama", False], str(tmp_path))
    for r in results:
        assert r["optimizer"] == ("AdamW", True), r["optimizer"]  # Trainer's default, fused
        assert r["quantized"] == LINEARS and r["trainable"], r
        assert len(r["changed"]) > LINEARS, r["changed"]  # every quantized weight (and dense ones) moved
        assert r["sr_steps"] and min(r["sr_steps"]) > 0, r["sr_steps"]
        assert r["reloaded_differs"] == [] and r["dq_load_differs"] == [], r
        assert r["reloaded_trainable"] == [True] and r["config"] == {"trainable": True, "seed": 0}, r
        assert r["losses"] == results[0]["losses"]
    losses = results[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_trainer_resume_is_byte_identical(ranks, checkpoints, tmp_path):
    results = ranks(2).run(tc.resume, checkpoints["llama", False], str(tmp_path))
    for r in results:
        assert r["differ"] == [], r["differ"]
        assert len(r["changed"]) > LINEARS, r["changed"]  # the resumed run did train from the checkpoint's bytes
        continuous, resumed = r["losses"]
        assert resumed[-2:] == continuous[-2:], r["losses"]
    assert "optimizer.bin" in results[0]["checkpoint"], results[0]["checkpoint"]


@pytest.mark.slow
def test_accelerate_parameter_mapping_is_refused_not_trained(ranks, checkpoints, tmp_path):
    """accelerate's data_ptr-keyed FSDP2 remap points every quantized weight's optimizer slot at one weight."""
    for message in ranks(2).run(tc.unfixed_refused, checkpoints["llama", False], str(tmp_path)):
        assert "data_ptr()" in message and "docs/frameworks.md" in message, message
