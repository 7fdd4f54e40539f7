"""model/quantize_like: a model quantized on meta the way a pre-quantized checkpoint stores it, layer by layer."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support import producers as pr

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_quantize_like_checkpoint_chooses_per_layer(producer_checkpoints):
    import transformers

    path = producer_checkpoints["ct_int4"]
    with dq.hf.init_empty():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**pr.hc.CONFIG))
    model.to(torch.bfloat16)
    chosen = dq.hf.quantize_like_checkpoint(model, path)
    assert len(chosen) == 14 and "lm_head.weight" not in chosen  # 7 Linears x 2 layers; lm_head as the producer left it
    assert {v.fmt for v in chosen.values()} == {dq.Int4Groupwise(128, scale_dtype=torch.bfloat16)}
    assert not isinstance(model.lm_head.weight, dq.QuantizedTensor)
