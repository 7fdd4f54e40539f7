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


def test_bitsandbytes_with_half_of_its_double_quantization_is_refused(producer_checkpoints, tmp_path):
    """A file whose quant_state names nested blocks but holds no .nested_absmax is neither format: refused, not
    read as the plain layout (its uint8 absmax codes as float32 scales)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = producer_checkpoints["bnb"]
    dst = tmp_path / "bnb_half"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(".nested_absmax")}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    with dq.hf.init_empty():
        model = pr.tiny_llama().to("meta")
    with pytest.raises(ValueError, match=r"no \.nested_absmax tensor but a nested_blocksize"):
        dq.hf.quantize_like_checkpoint(model, str(dst))
