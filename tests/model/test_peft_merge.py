"""model/peft_merge: PEFT LoRA on a quantized transformers model:
dq.lora.merge_and_unload merges as PEFT does, then requantizes."""

from __future__ import annotations

import copy

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import assert_same_bits

peft = pytest.importorskip("peft", reason="peft (a test extra) is what this merges")
transformers = pytest.importorskip("transformers")

CONFIG = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": False}  # fmt: skip
TARGETS = (".q_proj.weight", ".v_proj.weight", ".down_proj.weight")
SLOW = pytest.mark.slow
FORMATS = [dq.Int8Rowwise(), dq.Int4GroupwiseIntZero(128), pytest.param(dq.NF4(), marks=SLOW),
           pytest.param(dq.Float8Blockwise(128), marks=SLOW)]  # fmt: skip


def _model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)


def _lora(model):
    torch.manual_seed(1)  # init_lora_weights=False: nonzero B, so the merge changes every targeted weight
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=[t.split(".")[1] for t in TARGETS] + ["lm_head"],
                             init_lora_weights=False)  # fmt: skip
    return peft.get_peft_model(model, config)


def _adapters(peft_model) -> dict:
    return {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_merge_and_unload_equals_peft_merge_of_the_dequantized_model_requantized(fmt):
    model = _model()
    dq.quantize_(model, fmt, filter_fn=lambda m, fqn: fqn != "lm_head")
    before = {n: p for n, p in model.named_parameters() if isinstance(p, dq.QuantizedTensor)}
    dense = copy.deepcopy(model)  # the same values, dense: what PEFT's own merge can add into
    for name, p in list(dense.named_parameters()):
        if isinstance(p, dq.QuantizedTensor):
            dense.get_submodule(name.rpartition(".")[0]).weight = torch.nn.Parameter(p.dequantize())
    quantized, reference = _lora(model), _lora(dense)
    reference.load_state_dict(_adapters(quantized), strict=False)  # the same adapters

    # PEFT's in-place add into a quantized weight is refused, loudly, naming the merges that work
    with pytest.raises(dq.UnsupportedOpError, match=r"dq\.lora\.merge_and_unload\(peft_model\).*dq\.lora\.peft_config"):
        copy.deepcopy(quantized).merge_and_unload()
    merged, want = dq.lora.merge_and_unload(quantized), reference.merge_and_unload()

    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    for name, p in merged.named_parameters():
        w = want.get_parameter(name)
        if isinstance(p, dq.QuantizedTensor) and name.endswith(TARGETS):  # merged, then quantized again
            assert_same_bits(p, dq.quantize(w.detach(), fmt), name)
        elif isinstance(p, dq.QuantizedTensor):  # no adapter: the weight as it was
            assert p is before[name], name
        else:
            assert torch.equal(p, w), name  # lm_head and the rest: PEFT's own merge
    assert isinstance(merged.model.layers[0].self_attn.q_proj.weight, dq.QuantizedTensor)


def test_keep_dense_keeps_peft_values():
    model = _model()
    dq.quantize_(model, dq.Int8Rowwise(), filter_fn=lambda m, fqn: fqn != "lm_head")
    dense = copy.deepcopy(model)
    for name, p in list(dense.named_parameters()):
        if isinstance(p, dq.QuantizedTensor):
            dense.get_submodule(name.rpartition(".")[0]).weight = torch.nn.Parameter(p.dequantize())
    quantized, reference = _lora(model), _lora(dense)
    reference.load_state_dict(_adapters(quantized), strict=False)
    merged, want = dq.lora.merge_and_unload(quantized, keep_dense=True), reference.merge_and_unload()
    for name, p in merged.named_parameters():
        if name.endswith(TARGETS) or not isinstance(p, dq.QuantizedTensor):  # merged: PEFT's dense values
            assert torch.equal(p, want.get_parameter(name)), name


# -- every adapter feature merges exactly or is refused by name ----------------------------------------------


def _pair(config_kwargs, fmt=None, model_kwargs=None, register=False):
    """A quantized model and its dequantized copy, each with the same PEFT adapters (quantized: maybe registered)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, **(model_kwargs or {}))).bfloat16()
    dq.quantize_(model, fmt or dq.Int8Rowwise(), filter_fn=lambda m, fqn: fqn != "lm_head")
    dense = copy.deepcopy(model)
    for name, p in list(dense.named_parameters()):
        if isinstance(p, dq.QuantizedTensor):
            dense.get_submodule(name.rpartition(".")[0]).weight = torch.nn.Parameter(p.dequantize())

    def config():
        c = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                            init_lora_weights=False, **config_kwargs)  # fmt: skip
        return dq.lora.peft_config(c) if register else c

    torch.manual_seed(1)
    quantized, reference = peft.get_peft_model(model, config()), peft.get_peft_model(dense, config())
    reference.load_state_dict(_adapters(quantized), strict=False)
    return quantized, reference


def _assert_merged_like(merged, want, fmt, targets=TARGETS):
    """Merged quantized weights: PEFT's dense merge quantized again; dense ones (biases included) bit for bit."""
    for name, p in merged.named_parameters():
        w = want.get_parameter(name)
        if isinstance(p, dq.QuantizedTensor) and not name.endswith(targets):
            continue  # no adapter: the weight as it was (the first test checks it is the same object)
        if isinstance(p, dq.QuantizedTensor):
            assert_same_bits(p, dq.quantize(w.detach(), fmt), name)
        else:
            assert torch.equal(p, w), name


BIAS = {"attention_bias": True, "mlp_bias": True}


@pytest.mark.parametrize("config", [{"lora_bias": True}, {"use_rslora": True}, {"rank_pattern": {"v_proj": 4},
                                    "alpha_pattern": {"down_proj": 3}, "lora_dropout": 0.1}], ids=str)  # fmt: skip
def test_features_merge_as_peft_merges_the_dequantized_model(config):
    quantized, reference = _pair(config, model_kwargs=BIAS)
    _assert_merged_like(dq.lora.merge_and_unload(quantized), reference.merge_and_unload(), dq.Int8Rowwise())


def test_a_lora_bias_on_a_layer_without_bias_gives_it_one_and_the_output_stays():
    quantized, _ = _pair({"lora_bias": True})
    x = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    layer = quantized.base_model.model.model.layers[0].self_attn.q_proj
    extra = layer.lora_B["default"].bias * layer.scaling["default"]
    with torch.no_grad():
        before = quantized(x).logits
        merged = dq.lora.merge_and_unload(quantized)
        after = merged(x).logits
    bias = merged.model.layers[0].self_attn.q_proj.bias
    assert bias is not None and bias.dtype == torch.bfloat16
    assert torch.equal(bias, torch.zeros_like(bias).add_(extra))  # PEFT's bias += lora_B.bias * scaling, from 0
    # what moves is only the weights' rounding to int8, not the bias (dropping it moved the logits by ~its size)
    dropped = merged.model.layers[0].self_attn.q_proj
    moved = (after - before).abs().max()
    assert moved < 0.1 * before.abs().max(), (moved, before.abs().max())
    with torch.no_grad():
        dropped.bias = None
        without = merged(x).logits
    assert (without - before).abs().max() > 2 * moved  # the bias matters more than the rounding here


def test_several_active_adapters_merge_in_order():
    quantized, reference = _pair({"lora_bias": True}, model_kwargs=BIAS)
    for m in (quantized, reference):
        torch.manual_seed(2)
        m.add_adapter("other", peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                                              init_lora_weights=False, lora_bias=True))  # fmt: skip
    reference.load_state_dict(_adapters(quantized), strict=False)
    for m in (quantized, reference):
        m.base_model.set_adapter(["default", "other"])
    merged = dq.lora.merge_and_unload(quantized)
    _assert_merged_like(merged, reference.merge_and_unload(), dq.Int8Rowwise(), (*TARGETS, ".o_proj.weight"))


@pytest.mark.parametrize(
    ("config", "named"),
    [({"use_dora": True}, "DoRA"), ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication")],
    ids=["dora", "layer_replication"],
)
def test_features_that_do_not_merge_exactly_are_refused_by_name_before_anything_changes(config, named):
    if "use_dora" in config:  # DoRA's init reads the base weight's norm: made dense, then quantized
        with pytest.raises(dq.UnsupportedOpError, match="DoRA's weight norm"):
            _pair(config)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).bfloat16()
        quantized = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj"], **config))
        for m in quantized.modules():
            if isinstance(m, peft.tuners.lora.LoraLayer) and m.get_base_layer() is not m:
                w = m.get_base_layer().weight
                m.get_base_layer().weight = torch.nn.Parameter(dq.quantize(w.detach(), dq.Int8Rowwise()), False)
    else:
        quantized, _ = _pair(config)
    before = {n: p for n, p in quantized.named_parameters()}
    with pytest.raises(ValueError, match=named):
        dq.lora.merge_and_unload(quantized)
    assert {n: p for n, p in quantized.named_parameters()} == before
    assert not any(getattr(m, "merged", False) for m in quantized.modules())


# -- PEFT's own merge_and_unload, through the LoRA layer dq.lora.peft_config registers ----------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_peft_merge_and_unload_on_a_registered_config_equals_dq_merge(fmt):
    quantized, _ = _pair({"lora_bias": True}, fmt=fmt, model_kwargs=BIAS, register=True)
    layer = quantized.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "QuantizedLoraLinear"
    assert type(quantized.base_model.model.lm_head).__name__ != "QuantizedLoraLinear"  # dense: PEFT's own layer
    ours = dq.lora.merge_and_unload(copy.deepcopy(quantized))
    with pytest.warns(UserWarning, match="rounding errors"):  # PEFT's convention for quantized bases
        merged = quantized.merge_and_unload()
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    for name, p in merged.named_parameters():
        q = ours.get_parameter(name)
        if isinstance(p, dq.QuantizedTensor):
            assert_same_bits(p, q, name)
        else:
            assert torch.equal(p, q), name


def test_unmerge_restores_the_weight_and_bias_from_before_the_merge():
    quantized, _ = _pair({"lora_bias": True}, register=True)
    x = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    layer = quantized.base_model.model.model.layers[0].self_attn.q_proj
    weight, bias = layer.base_layer.weight, layer.base_layer.bias
    with torch.no_grad():
        before = quantized(x).logits
        with pytest.warns(UserWarning, match="rounding errors"):
            quantized.merge_adapter()
        assert layer.merged and layer.base_layer.weight is not weight and layer.base_layer.bias is not None
        merged = quantized(x).logits
        quantized.unmerge_adapter()
        assert layer.base_layer.weight is weight and layer.base_layer.bias is bias and not layer.merged
        assert torch.equal(quantized(x).logits, before)
    assert not torch.equal(merged, before)  # the merged forward is the requantized one

    quantized.merge_adapter()
    layer.base_layer.weight = torch.nn.Parameter(dq.quantize(torch.zeros_like(weight.dequantize()), dq.Int8Rowwise()))
    with pytest.raises(ValueError, match="replaced after the merge"):
        layer.unmerge()


def test_registered_layers_refuse_what_does_not_merge_exactly():
    quantized, _ = _pair({}, register=True)
    layer = quantized.base_model.model.model.layers[0].self_attn.q_proj
    layer.fan_in_fan_out = True  # what PEFT's dispatch never sets on a Linear: the delta would be transposed
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        quantized.merge_and_unload()


@pytest.mark.parametrize("model", [torch.nn.Sequential(torch.nn.Linear(4, 4)), None, torch.ones(2)])
def test_merge_and_unload_takes_a_peft_model(model):
    """Before: AttributeError ('Sequential' object has no attribute 'merge_and_unload', or 'named_modules')."""
    with pytest.raises(TypeError, match="takes a PEFT model"):
        dq.lora.merge_and_unload(model)
