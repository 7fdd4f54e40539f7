"""Tiny Hugging Face checkpoints and checks for the dq.hf tests (importable by the ranks of a pool).

Checkpoints are written with transformers' ``save_pretrained`` (one file, or
an index with ``max_shard_size``) and by :func:`write_fp8`, a block-scale FP8
writer of our own that quantizes with plain torch (not the library), in the
layout DeepSeek-V3 and Qwen3-FP8 publish. References are read with the
``safetensors`` package, never with the reader under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh

# Real width where it matters (768 = an intermediate size of real models); few rows.
CONFIG = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": False}  # fmt: skip


def model_class(kind: str):
    import transformers

    return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[kind]  # fmt: skip


# Four experts, fused in the model ([E, 2I, H] and [E, H, I]), one key per expert and projection in the file.
MOE = dict(CONFIG, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)


def config_of(kind: str) -> dict:
    return MOE if kind == "qwen3moe" else CONFIG


def write_dense(kind: str, path, sharded: bool, seed: int = 0) -> str:
    config_cls, model_cls = model_class(kind)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config_of(kind))).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="300KB" if sharded else "1GB")
    return str(path)


def fp8_quantize(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's weight quantization, written out block by block (independent of the library)."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // b), -(-cols // b), dtype=torch.float32)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * b : (i + 1) * b, j * b : (j + 1) * b].float()
            s = (block.abs().max() / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
            scale[i, j] = s
            q[i * b : (i + 1) * b, j * b : (j + 1) * b] = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8(tensors: dict[str, torch.Tensor], path, quantize: set[str], sharded: bool, config: dict | None = None):
    """An FP8 block-scale checkpoint: ``quantize``'s weights as e4m3fn + ``weight_scale_inv``, the rest as given."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, v in tensors.items():
        if k in quantize:
            out[k], out[k + "_scale_inv"] = fp8_quantize(v)
        else:
            out[k] = v.contiguous()
    keys = list(out)
    parts = [keys[::2], keys[1::2]] if sharded else [keys]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors" if sharded else "model.safetensors"
        save_file({k: out[k] for k in part}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    if sharded:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        config = dict(config, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def read_all(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, with the safetensors package."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_loaded(model, path, fmt, result) -> dict:
    """Every tensor of ``model`` equals the checkpoint's, quantized whole and then sharded; bytes read are counted.

    Returns this rank's bytes read and the bytes its slices hold (counted here from the local shapes).
    """
    full = read_all(path)
    expected_bytes = 0
    for name, p in model.named_parameters():
        src = full[name] if name in full else fused(full, name)
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, dq.QuantizedTensor):
            stored = name + "_scale_inv" in full
            # pre-quantized: the file's bytes, sharded; dense: quantized whole, then sharded
            want = _stored(full, name, local.fmt, p.dtype) if stored else dq.quantize(src.to(p.dtype), fmt)
            if isinstance(p, DTensor):
                want = distribute_tensor(want, p.device_mesh, p.placements, src_data_rank=None)._local_tensor
            assert_same_bits(local, want, name)
            if stored:
                expected_bytes += sum(t.numel() * t.element_size() for t in local.inner.values())
            else:
                expected_bytes += local.numel() * src.element_size()
        else:
            want = src.to(p.dtype)
            if isinstance(p, DTensor):
                want = distribute_tensor(want, p.device_mesh, p.placements, src_data_rank=None)._local_tensor
            assert torch.equal(local.detach().view(torch.uint8), want.view(torch.uint8)), name
            expected_bytes += local.numel() * src.element_size()
    return {"read": result.bytes_read, "expected": expected_bytes, "file": result.file_bytes}


def _stored(full, name, fmt, dtype):
    """The checkpoint's stored FP8 weight as a QuantizedTensor (built from the file's bytes, not quantized)."""
    from dtensor_quant._ops.layout_ops import canonical_dims

    q, s = full[name], full[name + "_scale_inv"]
    rels = tuple(fmt.layout.values())
    return dq.QuantizedTensor({"qdata": q, "scale_inv": s}, fmt, rels, canonical_dims(2), tuple(q.shape), dtype)


def fused(full: dict, name: str) -> torch.Tensor:
    """A fused expert stack assembled from the per-expert tensors, the way transformers documents it."""
    prefix, _, proj = name.rpartition(".")
    count = sum(1 for k in full if k.startswith(prefix + ".") and k.endswith(".down_proj.weight"))
    if proj == "gate_up_proj":
        return torch.stack([torch.cat([full[f"{prefix}.{e}.gate_proj.weight"], full[f"{prefix}.{e}.up_proj.weight"]])
                            for e in range(count)])  # fmt: skip
    return torch.stack([full[f"{prefix}.{e}.{proj}.weight"] for e in range(count)])


WORLD = {"single": 1, "tp2": 2, "fsdp2": 2, "2d": 4, "ep2": 2}


def build(kind: str, layout: str, fmt_name: str):
    """The transformers model on meta, quantized, placed by ``layout``, then materialized (this rank's shards)."""
    config_cls, model_cls = model_class(kind)
    with dq.hf.init_empty():
        model = model_cls(config_cls(**config_of(kind)))
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


def on(ranks, layout, fn, *args):
    n = WORLD[layout]
    return [fn(*args)] if n == 1 else ranks(n).run(fn, *args)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "qwen2", "qwen3moe"):
        for sharded in (False, True):
            out[kind, sharded] = write_dense(kind, root / f"{kind}-{sharded}", sharded)
    return out


@pytest.fixture(scope="session")
def fp8_checkpoints(tmp_path_factory, checkpoints):
    """The Llama checkpoint with every decoder Linear in FP8 block-scale form (lm_head and embeddings dense)."""
    import json
    from pathlib import Path

    dense = read_all(checkpoints["llama", False])
    linears = {k for k, v in dense.items() if ".layers." in k and k.endswith("proj.weight")}
    config = json.loads((Path(checkpoints["llama", False]) / "config.json").read_text())
    root = tmp_path_factory.mktemp("fp8")
    return {s: write_fp8(dense, root / f"fp8-{s}", linears, s, config) for s in (False, True)}
