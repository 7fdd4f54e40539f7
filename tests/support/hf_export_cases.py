"""Small transformers models for the dq.hf.save tests: every kind of weight, written and loaded back."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import FORMATS, mesh
from tests.support import hf_cases as hc

# Tiny, but with every kind of weight: column- and row-parallel Linears, embeddings, norms, an lm_head.
SMALL = dict(hc.CONFIG, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, vocab_size=128)  # fmt: skip


SMALL_MOE = dict(SMALL, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)


def config_of(kind: str) -> dict:
    return SMALL_MOE if kind == "qwen3moe" else SMALL


def write_checkpoint(kind: str, path, seed: int = 0) -> str:
    config_cls, model_cls = hc.model_class(kind)
    torch.manual_seed(seed)
    model_cls(config_cls(**config_of(kind))).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def build(kind: str, layout: str, fmt_name: str | None):
    """The model on meta, quantized, placed by ``layout``, materialized (this rank's shards only)."""
    config_cls, model_cls = hc.model_class(kind)
    with dq.hf.init_empty():
        model = model_cls(config_cls(**config_of(kind)))
    model.to(torch.bfloat16)
    if fmt_name is not None:
        dq.quantize_(model, FORMATS[fmt_name])
    if layout == "tp2":
        parallelize_module(model, mesh(2), dq.hf.tp_plan(model))
    elif layout == "ep2":  # each rank holds half of every fused expert stack: Shard(0)
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.ndim == 3:
                    dt = distribute_tensor(p.detach(), mesh(2), [Shard(0)], src_data_rank=None)
                    setattr(module, name, torch.nn.Parameter(dt, requires_grad=False))
    elif layout in ("fsdp2", "2d", "hsdp"):
        m = mesh(2) if layout == "fsdp2" else mesh(2, 2)
        if layout == "2d":  # TP inside, FSDP2 over it: column-parallel weights become _StridedShard(0), Shard(0)
            parallelize_module(model, m["tp"], dq.hf.tp_plan(model))
        dp = m["dp"] if layout == "2d" else m  # hsdp: the whole 2x2 mesh, (Replicate, Shard(0))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return dq.hf.materialize(model, "cpu")


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {kind: write_checkpoint(kind, root / kind) for kind in ("llama", "qwen3moe")}


def peft_model(src, fmt_name, **lora):
    """A Llama loaded from ``src`` (quantized if ``fmt_name``), wrapped by peft's LoRA on two kinds of Linear."""
    import peft

    model = build("llama", "single", fmt_name)
    dq.hf.load(model, src)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], **lora)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # lora_B starts at zero: give every adapter values so that merging changes something
        for i, (name, p) in enumerate(wrapped.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    return wrapped
