"""checkpoint/hf/loading on live ranks: Hugging Face checkpoints into quantized sharded transformers models (dq.hf).

Each model is built the way a user would for a model that no rank can hold:
parameters on the meta device, quantized, sharded (torch's TP styles from
transformers' own plan, FSDP2, or both), materialized, then loaded. Every
quantized byte is compared with quantizing the full tensor (read with the
safetensors package) and then sharding it; every rank's bytes read are
counted and compared with the bytes of its own slices.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import FORMATS, assert_within, gamma, mesh, unit_roundoff
from tests.support import hf_cases as hc
from tests.support.hf_cases import build, on

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def load_and_check(kind, layout, fmt_name, path):
    model = build(kind, layout, fmt_name)
    assert all(not p.is_meta for p in model.parameters())
    # Sharded models read and quantize in runs of a few rows (many runs per weight); one process, whole slices.
    result = dq.hf.load(model, path, chunk_bytes=16 << 10 if layout != "single" else 16 << 20)
    return hc.check_loaded(model, path, FORMATS[fmt_name], result)


CASES = [
    ("llama", False, "tp2", "int8"),  # per-row scales of row-parallel shards: all-reduced
    ("qwen2", True, "tp2", "int4g128"),
    ("llama", True, "fsdp2", "f8tensor"),  # one scale for the whole tensor from FSDP's row shards
    ("qwen2", False, "single", "int4g128"),
    ("llama", False, "single", "nf4"),  # statistics span rows: quantized whole
    pytest.param("llama", True, "2d", "int8", marks=pytest.mark.slow),
    # MoE: fused [E, out, in] experts read from the file's per-expert tensors; FSDP2 shards the experts
    ("qwen3moe", True, "ep2", "int8"),
    pytest.param("qwen3moe", False, "single", "int4g128", marks=pytest.mark.slow),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,sharded,layout,fmt_name", CASES)
def test_load_dense_checkpoint(ranks, checkpoints, kind, sharded, layout, fmt_name):
    results = on(ranks, layout, load_and_check, kind, layout, fmt_name, checkpoints[kind, sharded])
    for r in results:
        assert r["read"] == r["expected"], r  # each rank read exactly its slices, once
    if layout == "tp2":  # embeddings, lm_head and every linear are split: about half the file each
        assert all(r["read"] < 0.55 * r["file"] for r in results), results


def _tensors_of(path):
    return hc.read_all(path)


@pytest.mark.parametrize("sharded,layout", [(True, "tp2"), (False, "fsdp2"), (True, "single")])
def test_load_fp8_block_checkpoint_as_stored(ranks, fp8_checkpoints, sharded, layout):
    for r in on(ranks, layout, load_and_check, "llama", layout, "f8block128", fp8_checkpoints[sharded]):
        assert r["read"] == r["expected"], r


# -- QLoRA adapters on a loaded model, and quantize_ of meta DTensors ------------------------------


def qlora_roundtrip(path, out, layout):
    """QLoRA on a HF checkpoint: load, wrap in adapters, shard with FSDP2, load again (by HF names), save merged."""
    model = build("qwen2", "single", "int4g128")
    dq.hf.load(model, path)
    dq.lora.add_lora_(model, rank=4, filter_fn=lambda m, fqn: fqn.endswith(("q_proj", "down_proj")))
    with torch.no_grad():
        for i, p in enumerate(dq.lora.lora_parameters(model).values()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    expected, bounds = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, dq.lora.LoRALinear):
            b, a = m.lora_b.weight.detach().float(), m.lora_a.weight.detach().float()
            merged = m.base.weight.dequantize(torch.float32) + b @ a * m.scaling
            expected[name + ".weight"] = merged.to(torch.bfloat16)
            # Sharded adapters (FSDP2) multiply through DTensor's mm, in another order: the 4-term sums within
            # their bound, the scaling and the fp32 sum rounding once each, then each result rounds to bf16.
            terms = (b.double().abs() @ a.double().abs()) * m.scaling
            fp32 = 2 * gamma(a.shape[0] + 2) * (terms + merged.double().abs())
            bounds[name + ".weight"] = fp32 + unit_roundoff(torch.bfloat16) * 2 * (merged.double().abs() + fp32)
    if layout == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh(2))
        fully_shard(model, mesh=mesh(2))
    result = dq.hf.load(model, path)  # the base weights by the checkpoint's names; adapters untouched
    assert not result.missing and len(result.quantized) == 15, result
    dq.hf.save(model, out)
    return {k: v.detach() for k, v in expected.items()}, bounds


@pytest.mark.parametrize("layout", ["single", "fsdp2"])
def test_qlora_model_loads_by_hf_names_and_saves_merged(ranks, checkpoints, tmp_path, layout):
    _, model_cls = hc.model_class("qwen2")
    out = str(tmp_path / "merged")
    expected, bounds = on(ranks, layout, qlora_roundtrip, checkpoints["qwen2", False], out, layout)[0]
    back = dict(model_cls.from_pretrained(out, dtype=torch.bfloat16).named_parameters())
    assert len(expected) == 4
    for k, v in expected.items():
        if layout == "single":  # the same computation as the test's: bit for bit
            assert torch.equal(back[k].detach(), v), k
        else:
            assert_within(back[k].detach(), v, bounds[k], k)


def quantize_meta_dtensors():
    """quantize_ after parallelize_module on the meta device: quantized meta shards, no collective, no data."""
    config_cls, model_cls = hc.model_class("llama")
    with dq.hf.init_empty():
        model = model_cls(config_cls(**hc.CONFIG))
    parallelize_module(model, mesh(2), dq.hf.tp_plan(model))
    dq.quantize_(model, dq.Int8Rowwise())
    w = model.model.layers[0].mlp.down_proj.weight
    assert isinstance(w.to_local(), dq.QuantizedTensor) and w.to_local().is_meta, w
    assert w.to_local().qdata.shape == (256, 384)
    with dq.hf.init_empty():
        other = model_cls(config_cls(**hc.CONFIG))
    parallelize_module(other, mesh(2), dq.hf.tp_plan(other))
    with pytest.raises(dq.LayoutError, match=r"o_proj.*not a multiple of 256"):  # 128 columns per rank
        dq.quantize_(other, dq.Int4Groupwise(256))


def test_quantize_after_parallelize_on_meta(ranks):
    ranks(2).run(quantize_meta_dtensors)
