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

    with pytest.raises(dq.UnsupportedOpError):  # PEFT's in-place add into a quantized weight is refused, loudly
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
