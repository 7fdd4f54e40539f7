"""Damaged JSON in a checkpoint directory: every field read is checked where it is read.

config.json (cut short, not an object), producers' quantization_config
(compressed-tensors, GPTQ, AWQ, bitsandbytes, FP8 blocks) and bitsandbytes'
quant_state JSON (a list, a null, a missing or mistyped field) each give a
CheckpointFormatError naming the file, the tensor and the field -- before,
AttributeError, KeyError, TypeError or a bare JSONDecodeError naming no file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import dtensor_quant as dq
from tests.support import producers as pr

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

Error = dq.checkpoint.CheckpointFormatError
BNB_KEY = "model.layers.0.self_attn.q_proj.weight"
STATE = BNB_KEY + ".quant_state.bitsandbytes__nf4"


def meta_model():
    with dq.hf.init_empty():
        return pr.tiny_llama().to("meta")


def copy_of(src, tmp_path, name="damaged"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def with_quant_state(src, tmp_path, change) -> str:
    """A copy of a bitsandbytes checkpoint whose q_proj quant_state JSON is ``change(state)`` (bytes or an object)."""
    from safetensors.torch import load_file, save_file

    dst = copy_of(src, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    state = json.loads(bytes(tensors[STATE].tolist()))
    new = change(state)
    data = new if isinstance(new, bytes) else json.dumps(new).encode()
    tensors[STATE] = torch.tensor(list(data), dtype=torch.uint8)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def without(field):
    return lambda s: {k: v for k, v in s.items() if k != field}


QUANT_STATES = {
    "a list": (lambda s: [s], "field 'the document' is list"),
    "a null": (lambda s: None, "field 'the document' is NoneType null"),
    "no blocksize": (without("blocksize"), "field 'blocksize' is missing, expected a positive integer"),
    "no nested_offset": (without("nested_offset"), "field 'nested_offset' is missing, expected a finite number"),
    "a null nested_offset": (lambda s: dict(s, nested_offset=None), "field 'nested_offset' is null"),
    "a string blocksize": (lambda s: dict(s, blocksize="64"), "field 'blocksize' is str \"64\""),
    "a float nested_blocksize": (lambda s: dict(s, nested_blocksize=2.5), "field 'nested_blocksize' is float 2.5"),
    "cut short": (lambda s: json.dumps(s).encode()[:20], "is not valid JSON"),
}


@pytest.mark.parametrize("case", list(QUANT_STATES))
def test_damaged_bitsandbytes_quant_state(producer_checkpoints, tmp_path, case):
    change, message = QUANT_STATES[case]
    path = with_quant_state(producer_checkpoints["bnb"], tmp_path, change)
    with pytest.raises(Error) as info:
        dq.hf.quantize_like_checkpoint(meta_model(), path)
    text = str(info.value)
    assert "damaged/model.safetensors" in text and STATE in text and message in text, text


def test_damaged_quant_state_is_refused_by_load_too(producer_checkpoints, tmp_path):
    """A model built from the intact checkpoint, loading a copy whose quant_state lost its nested_offset."""
    model = pr.build("single", producer_checkpoints["bnb"])[0]
    path = with_quant_state(producer_checkpoints["bnb"], tmp_path, without("nested_offset"))
    with pytest.raises(Error, match=r"model\.safetensors \(read for tensor .*nested_offset' is missing"):
        dq.hf.load(model, path)


def with_config(src, tmp_path, change) -> str:
    dst = copy_of(src, tmp_path)
    config = dst / "config.json"
    new = change(json.loads(config.read_text()))
    config.write_bytes(new if isinstance(new, bytes) else json.dumps(new).encode())
    return str(dst)


def test_truncated_config_json_names_the_file(producer_checkpoints, tmp_path):
    path = with_config(producer_checkpoints["dense"], tmp_path, lambda c: json.dumps(c).encode()[:50])
    with pytest.raises(Error, match=r"damaged/config\.json is not valid JSON"):
        dq.hf.load(pr.tiny_llama(), path)
    with pytest.raises(Error, match=r"damaged/config\.json is not valid JSON"):
        dq.hf.quantize_like_checkpoint(meta_model(), path)


def test_config_json_that_is_not_an_object(producer_checkpoints, tmp_path):
    path = with_config(producer_checkpoints["dense"], tmp_path, lambda c: [c])
    with pytest.raises(Error, match=r"config\.json: field 'the document' is list"):
        dq.hf.load(pr.tiny_llama(), path)
    path = with_config(producer_checkpoints["dense"], tmp_path / "2", lambda c: dict(c, quantization_config=[1]))
    with pytest.raises(Error, match=r"config\.json: field 'quantization_config' is list \[1\], expected a JSON obj"):
        dq.hf.load(pr.tiny_llama(), path)


def qc_change(**fields):
    def change(config):
        qc = dict(config["quantization_config"])
        for k, v in fields.items():
            if v is ...:
                qc.pop(k, None)
            else:
                qc[k] = v
        return dict(config, quantization_config=qc)

    return change


def ct_weights(**fields):
    def change(config):
        qc = json.loads(json.dumps(config["quantization_config"]))
        group = next(iter(qc["config_groups"].values()))
        group["weights"].update(fields)
        return dict(config, quantization_config=qc)

    return change


PRODUCER_CONFIGS = {
    "gptq bits": ("gptq", qc_change(bits="4"), "'quantization_config.bits' is str \"4\", expected an integer"),
    "gptq group_size": ("gptq", qc_change(group_size=0), "'quantization_config.group_size' is int 0"),
    "gptq desc_act": ("gptq", qc_change(desc_act="no"), "'quantization_config.desc_act' is str"),
    "gptq quant_method": ("gptq", qc_change(quant_method=["gptq"]), "'quantization_config.quant_method' is list"),
    "awq version": ("awq", qc_change(version=2), "'quantization_config.version' is int 2, expected a string"),
    "awq zero_point": ("awq", qc_change(zero_point="yes"), "'quantization_config.zero_point' is str"),
    "ct config_groups": ("ct_int8", qc_change(config_groups=[]), "'quantization_config.config_groups' is list"),
    "ct group": ("ct_int8", qc_change(config_groups={"group_0": 3}), "'quantization_config.config_groups.group_0'"),
    "ct num_bits": (
        "ct_int8",
        ct_weights(num_bits="8"),
        "'quantization_config.config_groups.group_0.weights.num_bits'",
    ),
    "ct symmetric": ("ct_int8", ct_weights(symmetric=1), "weights.symmetric' is int 1, expected true or false"),
    "ct strategy": ("ct_int8", ct_weights(strategy=5), "weights.strategy' is int 5, expected a string"),
}


@pytest.mark.parametrize("case", list(PRODUCER_CONFIGS))
def test_damaged_producer_quantization_config(producer_checkpoints, tmp_path, case):
    kind, change, message = PRODUCER_CONFIGS[case]
    path = with_config(producer_checkpoints[kind], tmp_path, change)
    with pytest.raises(Error) as info:
        dq.hf.quantize_like_checkpoint(meta_model(), path)
    text = str(info.value)
    assert "damaged/config.json" in text and message in text, text
    if "quant_method" not in case:  # the method is the checkpoint's; every other field is read for a weight
        assert "(read for tensor model.layers.0." in text, text


def test_damaged_fp8_block_size(tmp_path):
    """dq.hf.save's own FP8-block export, with a weight_block_size that is not two positive integers."""
    model = pr.tiny_llama()
    dq.quantize_(model, dq.Float8Blockwise(128), filter_fn=lambda m, fqn: fqn != "lm_head")
    dq.hf.save(model, tmp_path / "export")
    for bad, shown in (("128", 'str "128"'), ([128], "list [128]"), ([0, 0], "list [0, 0]")):
        path = with_config(
            tmp_path / "export", tmp_path / str(shown).replace(" ", "_"), qc_change(weight_block_size=bad)
        )
        with pytest.raises(Error) as info:
            dq.hf.quantize_like_checkpoint(meta_model(), path)
        assert f"'quantization_config.weight_block_size' is {shown}, expected a list of 2" in str(info.value)
