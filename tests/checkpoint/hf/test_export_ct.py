"""checkpoint/hf/export_ct: the exporter writes what a format declares, and refuses a format that declares none."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import dtensor_quant as dq
from tests.support import producers as pr

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_a_format_compressed_tensors_cannot_express_is_refused(tmp_path):
    model = pr.tiny_llama()
    dq.quantize_(model, dq.NF4(), filter_fn=lambda m, fqn: fqn.endswith("q_proj"))
    with pytest.raises(ValueError, match="no scheme for NF4"):
        dq.hf.save(model, tmp_path / "x", quantization="compressed-tensors")


@dataclass(frozen=True)
class _Undeclared(dq.Int8Rowwise):
    """Int8Rowwise's math, but no compressed-tensors declaration: the exporter asks the format, not its class."""

    def producer_layout(self, producer, dtype):
        return None


@dataclass(frozen=True)
class _Renamed(dq.Int8Rowwise):
    """Int8Rowwise stored by compressed-tensors under another scale key: the exporter writes what is declared."""

    def producer_layout(self, producer, dtype):
        args = dict(dq.hf.CT_BASE_ARGS, num_bits=8, type="int", strategy="channel")
        inner = (
            ("qdata", dq.hf.StoredAs("same", "{key}", torch.int8)),
            ("scale", dq.hf.StoredAs("same", "{key}_renamed_scale", dtype)),
        )
        return dq.hf.ProducerLayout(producer, "int-quantized", args, inner)


def test_the_exporter_writes_what_the_format_declares(tmp_path):
    from safetensors import safe_open

    model = pr.tiny_llama()
    only_q = lambda m, fqn: fqn.endswith("q_proj")  # noqa: E731
    dq.quantize_(model, _Undeclared(), filter_fn=only_q)
    with pytest.raises(ValueError, match="no scheme for"):
        dq.hf.save(model, tmp_path / "refused", quantization="compressed-tensors")

    model = pr.tiny_llama()
    dq.quantize_(model, _Renamed(), filter_fn=only_q)
    dq.hf.save(model, tmp_path / "x", quantization="compressed-tensors")
    key = next(n for n, _ in model.named_parameters() if n.endswith("q_proj.weight"))
    inner = dict(model.get_parameter(key).inner)
    with safe_open(str(next((tmp_path / "x").glob("*.safetensors"))), "pt") as f:
        assert torch.equal(f.get_tensor(key), inner["qdata"])
        assert torch.equal(f.get_tensor(key + "_renamed_scale"), inner["scale"])
        assert key + "_scale" not in f.keys()
