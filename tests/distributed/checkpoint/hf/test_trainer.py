"""transformers.Trainer + FSDP2 (accelerate) fine-tunes trainable int8 weights on 2 gloo ranks.

The model comes from ``from_pretrained(..., quantization_config=dq.hf.QuantConfig("int8", trainable=True))``;
Trainer runs its defaults (fused AdamW, ``adamw_torch_fused``) under accelerate's FSDP2 (on CPU through the
state shim of tests/support/hf_trainer_cases.py). Checked: the weights stay int8 and trainable and change;
``save_model`` writes the gathered bytes, which ``from_pretrained`` and ``dq.hf.load`` read back as they are;
a run resumed from Trainer's checkpoint ends with the continuous run's bytes on every rank.
"""

from __future__ import annotations

import pytest

import dtensor_quant as dq
from tests.support import hf_trainer_cases as tc
from tests.support.hf_cases import CONFIG

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

LINEARS = 7 * CONFIG["num_hidden_layers"] + 1  # q, k, v, o, gate, up, down a layer; lm_head


# tensors: the model's state dicts hold tensors (dq.checkpoint.tensor_state_dicts), else entries
@pytest.mark.slow
@pytest.mark.parametrize("tensors", [False, True], ids=["entries", "tensors"])
def test_trainer_fsdp2_fused_adamw_save_model_reload(ranks, checkpoints, tmp_path, tensors):
    results = ranks(2).run(tc.train_save_reload, checkpoints["llama", False], str(tmp_path), tensors)
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


# Trainer's checkpoints as accelerate writes them: one file from rank 0, or DCP, with the entry form that a model
# loaded with QuantConfig(trainable=True) keeps. Not with tensor state dicts: there
# set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) (accelerate's FULL_STATE_DICT load) makes
# dense empties on ranks > 0 for rank 0's quantized tensors and the broadcast never matches (a hang).
@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_trainer_resume_is_byte_identical(ranks, checkpoints, tmp_path, state_dict_type):
    results = ranks(2).run(tc.resume, checkpoints["llama", False], str(tmp_path), False, state_dict_type)
    for r in results:
        assert r["differ"] == [], r["differ"]
        assert len(r["changed"]) > LINEARS, r["changed"]  # the resumed run did train from the checkpoint's bytes
        continuous, resumed = r["losses"]
        assert resumed[-2:] == continuous[-2:], r["losses"]
    assert any(name.startswith("pytorch_model_fsdp") for name in results[0]["checkpoint"]), results[0]["checkpoint"]


@pytest.mark.slow
def test_accelerate_parameter_mapping_is_refused_not_trained(ranks, checkpoints, tmp_path):
    """accelerate's data_ptr-keyed FSDP2 remap points every quantized weight's optimizer slot at one weight."""
    for message in ranks(2).run(tc.unfixed_refused, checkpoints["llama", False], str(tmp_path)):
        assert "data_ptr()" in message and "docs/frameworks.md" in message, message


# bf16=True: accelerate's mixed precision (autocast, and FSDP2's MixedPrecisionPolicy in bfloat16)
@pytest.mark.slow
def test_trainer_fsdp2_bf16_trains_int8_weights_and_save_model_reloads(ranks, checkpoints, tmp_path):
    results = ranks(2).run(tc.train_bf16, checkpoints["llama", False], str(tmp_path))
    for r in results:
        assert r["mixed_precision"] == "bf16" and r["fsdp_param_dtypes"] == ["torch.bfloat16"], r
        assert r["quantized"] == LINEARS and r["trainable"] and r["formats"] == ["Int8Rowwise()"], r
        assert r["dtypes"] == ["torch.float32"], r  # the weights keep their logical dtype; bf16 is the compute's
        assert len(r["changed"]) > LINEARS, r["changed"]
        assert r["sr_steps"] and min(r["sr_steps"]) > 0, r["sr_steps"]
        assert r["reloaded_differs"] == [], r
        assert r["losses"] == results[0]["losses"]
    losses = results[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


# fp16=True on CPU: accelerate 1.16 makes no float16 autocast and no GradScaler on CPU; FSDP2's MixedPrecisionPolicy
# in float16 (set as accelerate sets it on GPUs) casts the gathered weights and each layer's inputs
@pytest.mark.slow
def test_trainer_fsdp2_fp16_trains_int8_weights_and_save_model_reloads(ranks, checkpoints, tmp_path):
    results = ranks(2).run(tc.train_bf16, checkpoints["llama", False], str(tmp_path), "fp16")
    for r in results:
        assert r["mixed_precision"] == "fp16" and r["fsdp_param_dtypes"] == ["torch.float16"], r
        assert r["scaler"] == "NoneType", r  # no loss scaling on CPU (docs/frameworks.md)
        assert r["quantized"] == LINEARS and r["trainable"] and r["formats"] == ["Int8Rowwise()"], r
        assert r["dtypes"] == ["torch.float32"], r
        assert len(r["changed"]) > LINEARS, r["changed"]
        assert r["sr_steps"] == [len(r["losses"])], r["sr_steps"]  # every step updated every weight
        assert r["reloaded_differs"] == [], r
        assert r["losses"] == results[0]["losses"]
    losses = results[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


# QLoRA: PEFT LoRA adapters on a frozen NF4 base, Trainer's defaults, FSDP2 (the base sharded as NF4 DTensors,
# all-gathered as their stored bytes)
@pytest.mark.slow
def test_trainer_fsdp2_qlora_on_an_nf4_base(ranks, checkpoints, tmp_path):
    pytest.importorskip("peft")
    results = ranks(2).run(tc.qlora, checkpoints["llama", False], str(tmp_path))
    layers = CONFIG["num_hidden_layers"]
    for r in results:
        assert r["optimizer"] == ("AdamW", True), r["optimizer"]
        assert r["base_formats"] == [str(dq.parse_format("nf4"))] and r["base_frozen"] and r["base_changed"] == [], r
        assert r["adapters"] == 2 * 2 * layers and r["adapters_changed"], r  # A and B of q_proj, v_proj a layer
        assert "adapter_model.safetensors" in r["saved"], r["saved"]
        assert r["reloaded_differs"] == [], r
        assert r["losses"] == results[0]["losses"]
    losses = results[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_trainer_qlora_resume_is_byte_identical(ranks, checkpoints, tmp_path, state_dict_type):
    pytest.importorskip("peft")
    results = ranks(2).run(tc.qlora_resume, checkpoints["llama", False], str(tmp_path), state_dict_type, timeout=300)
    for r in results:
        assert r["differ"] == [], r["differ"]
        assert sorted(r["changed"]) == r["adapters"], r["changed"]  # the adapters moved, the NF4 base did not
        continuous, resumed = r["losses"]
        assert resumed[-2:] == continuous[-2:], r["losses"]


# FSDP2 x TP 2 on 4 ranks: transformers loads the model on a 2-D mesh (DistributedConfig(tp_size=2, fsdp_size=2)),
# Trainer trains it as loaded (accelerate prepares only the optimizer); on CPU accelerate's ParallelismConfig check
# needs parallelism_on_cpu (docs/frameworks.md)
@pytest.mark.slow  # 4 ranks on 2 cores
def test_trainer_fsdp2_x_tp2_trains_int8_weights(ranks, checkpoints, tmp_path):
    results = ranks(4).run(tc.train_fsdp_tp, checkpoints["llama", False], str(tmp_path), timeout=900)
    for r in results:
        assert r["parallelism"] == (2, 2) and r["fsdp_modules"] > 0, r
        assert r["optim"] == "adamw_torch_fused", r  # Trainer's default
        assert r["quantized"] == LINEARS and r["formats"] == ["Int8Rowwise()"], r
        assert len(r["mesh_dims"]) == 1 and "tp" in r["mesh_dims"][0], r["mesh_dims"]  # 2-D: a dp dim and tp
        assert len(r["changed"]) == LINEARS, r["changed"]
        assert r["sr_steps"] == [len(r["losses"])], r["sr_steps"]
        assert r["losses"] == results[0]["losses"]
    losses = results[0]["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
