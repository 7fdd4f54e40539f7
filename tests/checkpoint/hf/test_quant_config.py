"""dq.hf.QuantConfig on one process: transformers' from_pretrained / save_pretrained through its quantizer registry.

Every quantized byte is compared with a route the library already has
(from_pretrained dense then dq.quantize_, meta model + dq.hf.load), and
generate's tokens with that reference's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import FORMATS
from tests.support import hf_quant_cases as qc
from tests.support.hf_cases import CONFIG, read_all

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("spec", ["nf4", "int4:128", "int8"])
def test_from_pretrained_quantizes_as_quantize_does(checkpoints, spec):
    path = checkpoints["llama", False]
    model = qc.from_pretrained(path, quantization_config=dq.hf.QuantConfig(spec))
    ref = qc.from_pretrained(path)
    dq.quantize_(ref, dq.parse_format(spec))
    linears = sum(isinstance(m, torch.nn.Linear) for m in ref.modules())
    assert qc.assert_same_model(model, ref) == linears  # every Linear, lm_head included, as quantize_ does
    assert qc.tokens(model) == qc.tokens(ref)
    assert model.is_quantized and model.hf_quantizer.quantization_config.format == dq.parse_format(spec)


@pytest.mark.parametrize("fmt_name", ["nf4", "int4g128"])
def test_save_pretrained_round_trip(checkpoints, tmp_path, fmt_name):
    """save_pretrained writes the stored bytes and the format; from_pretrained and dq.hf.load read them back."""
    fmt = FORMATS[fmt_name]
    model = qc.from_pretrained(checkpoints["llama", False], quantization_config=dq.hf.QuantConfig(fmt))
    model.save_pretrained(tmp_path)
    config = qc.quantization_config(tmp_path)
    assert config["quant_method"] == "dtensor_quant" and dq.hf.QuantConfig(**config).format == fmt
    files = read_all(tmp_path)  # with the safetensors package: each weight as its inner tensors
    q = model.model.layers[0].mlp.down_proj.weight
    for name in fmt.inner_names:
        stored = files[f"model.layers.0.mlp.down_proj.weight.{name}"]
        assert torch.equal(stored.view(torch.uint8), getattr(q, name).view(torch.uint8)), name
    assert "model.layers.0.mlp.down_proj.weight" not in files

    again, info = qc.from_pretrained(tmp_path, output_loading_info=True)  # no quantization_config: the file's
    assert not any(info.values()), info
    qc.assert_same_model(again, model)
    assert qc.tokens(again) == qc.tokens(model)

    with dq.hf.init_empty():
        meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
    dq.hf.quantize_like_checkpoint(meta, tmp_path)
    result = dq.hf.load(dq.hf.materialize(meta), tmp_path)
    assert len(result.prequantized) == sum(isinstance(m, torch.nn.Linear) for m in meta.modules())
    qc.assert_same_model(meta, model)


def test_dq_hf_save_writes_what_from_pretrained_reads(checkpoints, tmp_path):
    """dq.hf.save(quantization="dtensor_quant"), several formats in one model, read by from_pretrained as stored."""
    model = qc.from_pretrained(checkpoints["llama", False])
    dq.quantize_(model, FORMATS["int8"], filter_fn=lambda m, fqn: "mlp" in fqn)
    dq.quantize_(model, FORMATS["nf4"], filter_fn=lambda m, fqn: "self_attn" in fqn)
    dq.hf.save(model, tmp_path, quantization="dtensor_quant")
    groups = qc.quantization_config(tmp_path)["config_groups"]
    assert sorted(g["format"]["format"] for g in groups.values()) == ["Int8Rowwise", "NF4"]
    again = qc.from_pretrained(tmp_path)
    qc.assert_same_model(again, model)
    assert qc.tokens(again) == qc.tokens(model)


def _one_step(model, fused: bool = True):
    """One AdamW step on a fixed batch (the same gradients for the same bytes)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=fused)
    ids = torch.tensor(qc.PROMPT * 2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def test_trainable_loads_as_quantize_does(checkpoints):
    """QuantConfig(trainable=True, seed) gives quantize_(trainable=True, seed)'s weights: the same bytes, and the
    same bytes again after a fused AdamW step (the same stochastic-rounding seed per weight)."""
    path = checkpoints["llama", False]
    config = dq.hf.QuantConfig("int8", trainable=True, seed=3)
    model = qc.from_pretrained(path, torch.float32, quantization_config=config)
    ref = qc.from_pretrained(path, torch.float32)
    dq.quantize_(ref, dq.Int8Rowwise(), trainable=True, seed=3)
    linears = sum(isinstance(m, torch.nn.Linear) for m in ref.modules())
    assert qc.assert_same_model(model, ref) == linears  # requires_grad compared too: every weight trainable
    assert model.hf_quantizer.is_qat_trainable  # transformers.Trainer fine-tunes it without adapters
    before = model.model.layers[0].mlp.down_proj.weight.qdata.clone()
    _one_step(model), _one_step(ref)
    assert not torch.equal(before, model.model.layers[0].mlp.down_proj.weight.qdata)
    qc.assert_same_model(model, ref)


def test_trainable_save_pretrained_round_trip_and_given_state_dict(checkpoints, tmp_path):
    """save_pretrained records trainable and seed (reloaded trainable, the same bytes), and writes the state_dict it
    is given (what Trainer passes under FSDP), not the model's own."""
    path = checkpoints["llama", False]
    config = dq.hf.QuantConfig("int8", trainable=True, seed=5)
    model = qc.from_pretrained(path, torch.float32, quantization_config=config)
    stepped = qc.from_pretrained(path, torch.float32, quantization_config=config)
    _one_step(stepped)
    model.save_pretrained(tmp_path, state_dict=stepped.state_dict())
    stored = qc.quantization_config(tmp_path)
    assert stored["trainable"] is True and stored["seed"] == 5, stored
    again = qc.from_pretrained(tmp_path, torch.float32)
    qc.assert_same_model(again, stepped)  # the given state dict's bytes, trainable
    passed = qc.from_pretrained(tmp_path, torch.float32, quantization_config=dq.hf.QuantConfig("int8", trainable=True))
    qc.assert_same_model(passed, stepped)  # a config passed too: the checkpoint's is used, as stored
    with dq.hf.init_empty():
        meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.float32)
    dq.hf.quantize_like_checkpoint(meta, tmp_path)
    dq.hf.load(dq.hf.materialize(meta), tmp_path)
    for name, p in stepped.named_parameters():
        if isinstance(p, dq.QuantizedTensor):
            dq.testing.assert_same_bits(meta.get_parameter(name), p, name)


def test_trainable_needs_stochastic_rounding():
    with pytest.raises(ValueError, match="stochastic rounding"):
        dq.hf.QuantConfig("nf4", trainable=True)
    assert "trainable" not in dq.hf.QuantConfig("int8").to_dict()  # written only when asked for


def test_modules_to_not_convert(checkpoints):
    model = qc.from_pretrained(
        checkpoints["llama", False],
        quantization_config=dq.hf.QuantConfig("int8", modules_to_not_convert=["lm_head", "down_proj"]),
    )
    assert not isinstance(model.lm_head.weight, dq.QuantizedTensor)
    assert not isinstance(model.model.layers[1].mlp.down_proj.weight, dq.QuantizedTensor)  # a module name's suffix
    assert isinstance(model.model.layers[1].mlp.up_proj.weight, dq.QuantizedTensor)


def test_config_forms():
    """A format, a string and the record to_dict writes give the same config; bad input says what works."""
    a, b = dq.hf.QuantConfig(dq.Int4Groupwise(64)), dq.hf.QuantConfig("int4:64")
    assert a.format == b.format == dq.Int4Groupwise(64)
    back = dq.hf.QuantConfig.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back.format == a.format and back.to_dict() == a.to_dict()
    assert dq.hf.QuantConfig(dq.Float8Rowwise(scale_dtype=torch.bfloat16)).to_dict()["format"]["params"] == {
        "scale_dtype": "bfloat16"
    }
    with pytest.raises(ValueError, match="unknown format 'nf5'"):
        dq.hf.QuantConfig("nf5")
    with pytest.raises(ValueError, match="name the format"):
        dq.hf.QuantConfig()
    with pytest.raises(TypeError, match="unknown arguments"):
        dq.hf.QuantConfig("nf4", bits=4)


def test_device_map_over_several_devices_is_refused(checkpoints):
    with pytest.raises(ValueError, match="tp_plan='auto'"):
        qc.from_pretrained(
            checkpoints["llama", False],
            quantization_config=dq.hf.QuantConfig("int8"),
            device_map={"model": "cpu", "lm_head": "disk"},
        )


REGISTRY = """
import sys
import dtensor_quant as dq
assert not any(m.startswith("transformers") for m in sys.modules), "import dtensor_quant imported transformers"
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
assert AUTO_QUANTIZATION_CONFIG_MAPPING["dtensor_quant"] is dq.hf.QuantConfig
assert AUTO_QUANTIZER_MAPPING["dtensor_quant"].__name__ == "DtensorQuantHfQuantizer"
print("ok")
"""

MISSING = """
import sys
sys.modules["transformers"] = None  # as if not installed
import dtensor_quant as dq
try:
    dq.hf.QuantConfig("nf4")
except ImportError as e:
    print(e)
"""


def test_registered_when_transformers_loads_its_quantizers():
    out = subprocess.run([sys.executable, "-c", REGISTRY], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("ok"), out.stderr


def test_without_transformers_the_error_names_the_extra():
    out = subprocess.run([sys.executable, "-c", MISSING], capture_output=True, text=True, check=True)
    assert "pip install 'dtensor_quant[hf]'" in out.stdout, out.stdout + out.stderr
