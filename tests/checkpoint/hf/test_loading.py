"""checkpoint/hf/loading on one process: stored FP8 blocks read as torch's reader reads them, and views
made before a load see the loaded bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import dtensor_quant as dq
from tests.support import hf_cases as hc
from tests.support.hf_cases import build

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def dequantized_full(kind, layout, fmt_name, path):
    model = build(kind, layout, fmt_name)
    dq.hf.load(model, path)
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.dequantize() if isinstance(t, dq.QuantizedTensor) else t.detach().clone()
    return out


def test_fp8_dequantization_equals_torch_reader(fp8_checkpoints):
    """Our dequantization of the stored bytes equals torch's QuantizedHuggingFaceStorageReader's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    path = fp8_checkpoints[True]  # torch's reader needs the index
    ours = dequantized_full("llama", "single", "f8block128", path)
    state = {k: torch.empty_like(v) for k, v in ours.items()}
    with pytest.warns(UserWarning, match="disabled"):
        dcp.load(
            state, storage_reader=QuantizedHuggingFaceStorageReader(path, target_dtype=torch.bfloat16), no_dist=True
        )
    quantized = [k for k in ours if k + "_scale_inv" in hc.read_all(path)]
    assert len(quantized) == 14
    for k in ours:
        assert torch.equal(ours[k].view(torch.uint8), state[k].view(torch.uint8)), k


def test_a_view_made_before_a_load_sees_the_loaded_bytes(tmp_path):
    """The loader writes row runs into the inner tensors; kernel inputs cached from a kept view must not survive."""
    path = hc.write_dense("llama", tmp_path / "other", False, seed=1)
    model = build("llama", "single", "int4g128")
    w = model.model.layers[0].mlp.down_proj.weight
    view = w[:64]
    x = torch.randn(1, w.shape[1], dtype=torch.bfloat16)
    before = torch.nn.functional.linear(x, view)  # caches the int4 kernel's repacked rows of the view
    dq.hf.load(model, path)
    after = torch.nn.functional.linear(x, view)
    assert not torch.equal(after, before)
    assert torch.equal(after, torch.nn.functional.linear(x, w[:64]))
