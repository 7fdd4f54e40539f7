"""checkpoint/hf/adapters on one process: peft adapters that cannot be merged on export are refused by name."""

from __future__ import annotations

import pytest

import dtensor_quant as dq
from tests.support.hf_export_cases import build, peft_model

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "lora,words",
    [({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "LoRA bias")],
    ids=["dora", "lora_bias"],
)
def test_unmergeable_peft_adapters_are_refused_by_name(sources, tmp_path, lora, words):
    pytest.importorskip("peft")
    wrapped = peft_model(sources["llama"], None, **lora)
    with pytest.raises(ValueError, match=words) as e:
        dq.hf.save(wrapped, tmp_path / "out")
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in str(e.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "config,key",
    [
        ({"target_modules": ["embed_tokens"]}, "model.embed_tokens.lora_embedding_A.default"),  # LoRA on an Embedding
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "lm_head.modules_to_save.default.weight"),
    ],
    ids=["embedding", "modules_to_save"],
)
def test_peft_layers_that_are_not_lora_on_a_linear_are_refused(sources, tmp_path, config, key):
    """Before: written under peft's names (from_pretrained drew the embedding / lm_head at random)."""
    peft = pytest.importorskip("peft")
    model = build("llama", "single", None)
    dq.hf.load(model, sources["llama"])
    with pytest.raises(ValueError, match="cannot export adapter layers") as e:
        dq.hf.save(peft.get_peft_model(model, peft.LoraConfig(r=4, **config)), tmp_path / "out")
    assert key in str(e.value)


def test_other_peft_tuners_and_unmerged_peft_are_refused(sources, tmp_path):
    peft = pytest.importorskip("peft")
    model = build("llama", "single", None)
    dq.hf.load(model, sources["llama"])
    ia3 = peft.get_peft_model(model, peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=[]))
    with pytest.raises(ValueError, match=r"not a LoRA layer.*q_proj.ia3_l.default"):
        dq.hf.save(ia3, tmp_path / "out")
    with pytest.raises(ValueError, match=r"merge_lora=False.*lora_A.default.weight"):
        dq.hf.save(peft_model(sources["llama"], None), tmp_path / "out", merge_lora=False)
