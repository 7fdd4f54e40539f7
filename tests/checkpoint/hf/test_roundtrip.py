"""Every export dq.hf.save writes, dq.hf reads back: per format x exporter x scale dtype.

The exporters: the default (a format with a Hugging Face layout, FP8 blocks,
as stored; every other weight dense) and ``quantization="compressed-tensors"``
(the formats it expresses as stored, the others refused up front, naming what
would work). Read back through ``quantize_like_checkpoint`` + ``load``, as a
user would: a weight written as stored comes back in the same format with
every inner tensor's bytes equal; one written dense comes back as the
original's dequantization, bit for bit; nothing else changes. Before, an
``Float8Blockwise(scale_dtype=torch.bfloat16)`` export (``quant_method: fp8``
with bf16 ``weight_scale_inv``) was refused by the library's own loader.
"""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support import producers as pr

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

FORMATS = {
    "Int8Rowwise": lambda sd: dq.Int8Rowwise(scale_dtype=sd),
    "Float8Rowwise": lambda sd: dq.Float8Rowwise(scale_dtype=sd),
    "Float8Tensorwise": lambda sd: dq.Float8Tensorwise(scale_dtype=sd),
    "Float8Blockwise": lambda sd: dq.Float8Blockwise(128, scale_dtype=sd),
    "Int4Groupwise": lambda sd: dq.Int4Groupwise(128, scale_dtype=sd),
    "Int4GroupwiseIntZero": lambda sd: dq.Int4GroupwiseIntZero(128, scale_dtype=sd),
    "NF4": lambda sd: dq.NF4(),
    "NF4BlockScales": lambda sd: dq.NF4BlockScales(),
    "BnbNF4": lambda sd: dq.BnbNF4(),
    "MXFP4": lambda sd: dq.MXFP4(),
}
SCALES = {"default": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NO_SCALE_DTYPE = ("NF4", "NF4BlockScales", "BnbNF4", "MXFP4")


def quantized(fmt, seed: int = 0) -> torch.nn.Module:
    model = pr.tiny_llama(seed=seed)
    dq.quantize_(model, fmt, filter_fn=lambda m, fqn: fqn != "lm_head")
    return model


def like_checkpoint(path) -> tuple[torch.nn.Module, dict]:
    """A model built as a user reading someone's export would: quantized as the checkpoint says."""
    with dq.hf.init_empty():
        model = pr.tiny_llama().to("meta")
    chosen = dq.hf.quantize_like_checkpoint(model, path)
    return dq.hf.materialize(model), chosen


def assert_read_back(model, back, chosen_keys, dense_keys) -> None:
    """Weights written as stored come back with equal bytes; those written dense as the dequantization."""
    for key, p in model.named_parameters():
        got = back.get_parameter(key)
        if key in chosen_keys:
            assert isinstance(got, dq.QuantizedTensor), key
            for n in p.fmt.inner_names:
                a, b = getattr(p, n), getattr(got, n)
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (key, n)
        elif key in dense_keys:  # written dense: the dequantization, in the model's dtype
            assert not isinstance(got, dq.QuantizedTensor), key
            assert torch.equal(got.detach().view(torch.uint8), p.dequantize(torch.bfloat16).view(torch.uint8)), key
        else:
            assert torch.equal(got.detach(), p.detach()), key


QUICK = ("Float8Blockwise", "Int8Rowwise")  # the rest: -m slow (3-4 s a case on two cores)


@pytest.mark.parametrize("exporter", ["default", "compressed-tensors"])
@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in FORMATS])
def test_every_export_reads_back(tmp_path, name, scale, exporter):
    if name in NO_SCALE_DTYPE and scale != "default":
        pytest.skip(f"{name} has no scale_dtype")
    try:
        fmt = FORMATS[name](SCALES[scale])
    except ValueError as e:
        pytest.skip(f"{name} refuses scale_dtype={scale}: {e}")
    model, out = quantized(fmt), tmp_path / "export"
    if exporter == "compressed-tensors":
        try:
            dq.hf.save(model, out, quantization="compressed-tensors")
        except ValueError as e:  # refused up front: nothing written, the message says what would work
            assert "compressed-tensors" in str(e), e
            assert any(w in str(e) for w in ("quantization=None", "build the model in", "Int4GroupwiseIntZero")), e
            assert not list(out.glob("*.safetensors")) if out.exists() else True
            return
    else:
        dq.hf.save(model, out)
    back, chosen = like_checkpoint(out)
    dq.hf.load(back, out)
    quantized_keys = {k for k, p in model.named_parameters() if isinstance(p, dq.QuantizedTensor)}
    as_stored = exporter == "compressed-tensors" or name == "Float8Blockwise"
    assert set(chosen) == (quantized_keys if as_stored else set()), sorted(chosen)
    assert_read_back(model, back, set(chosen), quantized_keys - set(chosen))
    if as_stored:  # the model the export came from (another seed's weights) reads it back as stored too
        again = quantized(fmt, seed=1)
        dq.hf.load(again, out)
        assert_read_back(model, again, quantized_keys, set())
