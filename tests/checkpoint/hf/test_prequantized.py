"""checkpoint/hf/prequantized on one process: producers' checkpoints read as stored, or refused naming why."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support import producers as pr
from tests.support.producers import build

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_a_dense_model_is_refused_naming_quantize_like_checkpoint(producer_checkpoints):
    path = producer_checkpoints["ct_int8"]
    with dq.hf.init_empty():
        model = pr.tiny_llama().to("meta")
    dq.hf.materialize(model)
    with pytest.raises(ValueError, match="quantize_like_checkpoint"):
        dq.hf.load(model, path)


def test_a_float32_model_reads_bf16_scales_as_stored(producer_checkpoints):
    """The formats keep the checkpoint's scale dtype: the values are the producer's bf16 ones, in float32."""
    path = producer_checkpoints["ct_int8"]
    with dq.hf.init_empty():
        model = pr.tiny_llama(torch.float32).to("meta")
    chosen = dq.hf.quantize_like_checkpoint(model, path)
    dq.hf.materialize(model)
    dq.hf.load(model, path)
    ref = pr.reference(path)
    for key in chosen:
        w = model.get_parameter(key)
        assert torch.equal(w.dequantize(torch.float32), ref[key].float()), key


def test_gptq_act_order_is_refused_naming_desc_act(producer_checkpoints):
    path = producer_checkpoints["gptq_actorder"]
    model = build("single", path)[0]
    with pytest.raises(ValueError, match="desc_act=True"):
        dq.hf.load(model, path)
