"""Hugging Face checkpoints into quantized sharded transformers models and back (dq.hf), on gloo ranks.

Each model is built the way a user would for a model that no rank can hold:
parameters on the meta device, quantized, sharded (torch's TP styles from
transformers' own plan, FSDP2, or both), materialized, then loaded. Every
quantized byte is compared with quantizing the full tensor (read with the
safetensors package) and then sharding it; every rank's bytes read are
counted and compared with the bytes of its own slices.
"""

from __future__ import annotations

import hf_cases as hc
import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import FORMATS, assert_within, gamma, mesh, unit_roundoff

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

WORLD = {"single": 1, "tp2": 2, "fsdp2": 2, "2d": 4, "ep2": 2}


def build(kind: str, layout: str, fmt_name: str):
    """The transformers model on meta, quantized, placed by ``layout``, then materialized (this rank's shards)."""
    config_cls, model_cls = hc.model_class(kind)
    with dq.hf.init_empty():
        model = model_cls(config_cls(**hc.config_of(kind)))
    model.to(torch.bfloat16)
    dq.quantize_(model, FORMATS[fmt_name], filter_fn=lambda m, fqn: fqn != "lm_head" or fmt_name != "f8block128")
    if layout == "tp2":
        parallelize_module(model, mesh(2), dq.hf.tp_plan(model))
    elif layout == "ep2":  # expert parallelism: each rank holds half of every fused expert stack
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.ndim == 3:
                    dt = distribute_tensor(p.detach(), mesh(2), [Shard(0)], src_data_rank=None)
                    setattr(module, name, torch.nn.Parameter(dt, requires_grad=False))
    elif layout in ("fsdp2", "2d"):
        m = mesh(2) if layout == "fsdp2" else mesh(2, 2)
        if layout == "2d":
            parallelize_module(model, m["tp"], dq.hf.tp_plan(model))
        dp = m if layout == "fsdp2" else m["dp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return dq.hf.materialize(model, "cpu")


def load_and_check(kind, layout, fmt_name, path):
    model = build(kind, layout, fmt_name)
    assert all(not p.is_meta for p in model.parameters())
    # Sharded models read and quantize in runs of a few rows (many runs per weight); one process, whole slices.
    result = dq.hf.load(model, path, chunk_bytes=16 << 10 if layout != "single" else 16 << 20)
    return hc.check_loaded(model, path, FORMATS[fmt_name], result)


def on(ranks, layout, fn, *args):
    n = WORLD[layout]
    return [fn(*args)] if n == 1 else ranks(n).run(fn, *args)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "qwen2", "qwen3moe"):
        for sharded in (False, True):
            out[kind, sharded] = hc.write_dense(kind, root / f"{kind}-{sharded}", sharded)
    return out


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


@pytest.mark.parametrize("kind,sharded,layout,fmt_name", CASES)
def test_load_dense_checkpoint(ranks, checkpoints, kind, sharded, layout, fmt_name):
    results = on(ranks, layout, load_and_check, kind, layout, fmt_name, checkpoints[kind, sharded])
    for r in results:
        assert r["read"] == r["expected"], r  # each rank read exactly its slices, once
    if layout == "tp2":  # embeddings, lm_head and every linear are split: about half the file each
        assert all(r["read"] < 0.55 * r["file"] for r in results), results


def _tensors_of(path):
    return hc.read_all(path)


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory, checkpoints):
    """The Llama checkpoint with every decoder Linear in FP8 block-scale form (lm_head and embeddings dense)."""
    import json
    from pathlib import Path

    dense = hc.read_all(checkpoints["llama", False])
    linears = {k for k, v in dense.items() if ".layers." in k and k.endswith("proj.weight")}
    config = json.loads((Path(checkpoints["llama", False]) / "config.json").read_text())
    root = tmp_path_factory.mktemp("fp8")
    return {s: hc.write_fp8(dense, root / f"fp8-{s}", linears, s, config) for s in (False, True)}


@pytest.mark.parametrize("sharded,layout", [(True, "tp2"), (False, "fsdp2"), (True, "single")])
def test_load_fp8_block_checkpoint_as_stored(ranks, fp8_checkpoints, sharded, layout):
    for r in on(ranks, layout, load_and_check, "llama", layout, "f8block128", fp8_checkpoints[sharded]):
        assert r["read"] == r["expected"], r


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


def save_and_report(kind, layout, fmt_name, src, out):
    model = build(kind, layout, fmt_name)
    dq.hf.load(model, src)
    dq.hf.save(model, out, max_shard_bytes=400_000 if layout == "tp2" else 5 << 30)  # TP-2: an index of files
    full = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        full[name] = t.dequantize() if isinstance(t, dq.QuantizedTensor) else t.detach().clone()
    return full


@pytest.mark.parametrize("kind,layout", [("qwen2", "tp2"), ("qwen2", "fsdp2"), ("qwen3moe", "ep2")])
def test_save_dense_export_reads_with_from_pretrained(ranks, checkpoints, tmp_path, kind, layout):
    _, model_cls = hc.model_class(kind)
    out = str(tmp_path / "export")
    fmt_name = "int8" if kind == "qwen3moe" else "int4g128"
    expected = on(ranks, layout, save_and_report, kind, layout, fmt_name, checkpoints[kind, True], out)[0]
    from pathlib import Path

    assert (Path(out) / "model.safetensors.index.json").exists() == (layout == "tp2")
    back = model_cls.from_pretrained(out, dtype=torch.bfloat16)
    got = dict(back.named_parameters())
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k].detach(), v.to(torch.bfloat16)), k
    tokens = torch.randint(0, hc.CONFIG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(back(tokens).logits).all()


def test_save_fp8_block_writes_the_stored_bytes(ranks, fp8_checkpoints, tmp_path):
    out = str(tmp_path / "export")
    ranks(2).run(save_and_report, "llama", "tp2", "f8block128", fp8_checkpoints[True], out)
    src, back = hc.read_all(fp8_checkpoints[True]), hc.read_all(out)
    assert set(src) == set(back)
    for k, v in src.items():
        assert v.dtype == back[k].dtype and torch.equal(v.view(torch.uint8), back[k].view(torch.uint8)), k
    import json
    from pathlib import Path

    assert json.loads((Path(out) / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


# -- refusals: one process is enough (every check runs before anything is read) -----------


def test_quantized_checkpoint_into_another_format_is_refused(fp8_checkpoints):
    with pytest.raises(ValueError, match=r"stored quantized.*Float8Blockwise"):
        dq.hf.load(build("llama", "single", "int8"), fp8_checkpoints[False])


def test_missing_and_unexpected_tensors_are_refused(tmp_path, checkpoints):
    from safetensors.torch import save_file

    full = hc.read_all(checkpoints["llama", False])
    del full["model.norm.weight"]
    full["extra.weight"] = torch.zeros(2)
    save_file(full, str(tmp_path / "model.safetensors"))
    model = build("llama", "single", "int8")
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model.norm.weight'\]") as e:
        dq.hf.load(model, tmp_path)
    assert "extra.weight" in str(e.value)
    result = dq.hf.load(model, tmp_path, strict=False)
    assert sorted(result.quantized) == sorted(dq.model.quantized_fqns(model))
    assert (result.missing, result.unexpected) == (["model.norm.weight"], ["extra.weight"])


def test_reads_only_the_slice(tmp_path):
    """A column slice reads one run per row; a row slice one run; counted bytes are the slice's."""
    from safetensors.torch import save_file

    t = torch.arange(6 * 10 * 4, dtype=torch.float32).reshape(6, 10, 4)
    save_file({"t": t}, str(tmp_path / "model.safetensors"))
    with dq.hf.Checkpoint(tmp_path) as ck:
        assert torch.equal(ck.read("t", (1, 3, 0), (2, 5, 4)), t[1:3, 3:8])
        assert ck.bytes_read == 2 * 5 * 4 * 4
        assert torch.equal(ck.read("t", (2, 0, 1), (3, 10, 2)), t[2:5, :, 1:3])
        assert torch.equal(ck.read("t"), t)


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


def test_save_replaces_a_previous_export(checkpoints, tmp_path):
    """A single-file export over a sharded one leaves no stale index or shard behind."""
    model = build("llama", "single", "int8")
    dq.hf.load(model, checkpoints["llama", False])
    dq.hf.save(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    dq.hf.save(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]


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
