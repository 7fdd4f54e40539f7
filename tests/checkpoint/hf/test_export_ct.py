"""checkpoint/hf/export_ct: a format compressed-tensors has no scheme for is refused on export."""

from __future__ import annotations

import pytest

import dtensor_quant as dq
from tests.support import producers as pr

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_a_format_compressed_tensors_cannot_express_is_refused(tmp_path):
    model = pr.tiny_llama()
    dq.quantize_(model, dq.NF4(), filter_fn=lambda m, fqn: fqn.endswith("q_proj"))
    with pytest.raises(ValueError, match="no scheme for NF4"):
        dq.hf.save(model, tmp_path / "x", quantization="compressed-tensors")
