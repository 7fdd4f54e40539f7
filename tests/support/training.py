"""Small training runs for the FSDP2 tests: one model recipe, synthetic data and one loop.

The same loop trains the single-process reference (in the pytest process) and
the sharded model (on the ranks), so the only difference between the two is
the parallelism. Losses are global-batch means in float32.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.func import functional_call

import dtensor_quant as dq
from dtensor_quant.lora import add_lora_
from dtensor_quant.testing import tiny_llama
from tests.support.extra_formats import FORMATS  # the built-in formats and the test-only ones

CFG = tiny_llama.Config(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, max_seq_len=32)
# w1/w3 have 250 rows: uneven (and on 4 ranks a 61-row shard) under FSDP2 over 3 or 4 ranks.
UNEVEN = replace(CFG, hidden_dim=250)
CONFIGS = {"even": CFG, "uneven": UNEVEN}
BATCH, SEQ = 12, 16  # 12 splits over 1, 2, 3 and 4 data-parallel ranks


def in_layers(module, fqn: str) -> bool:
    return fqn.startswith("layers.")


def qlora_model(fmt_name: str, cfg_name: str = "even", dtype=torch.float32):
    """The tiny LLaMA with every Linear in its blocks quantized and LoRA-adapted (rank 8)."""
    model = tiny_llama.build(CONFIGS[cfg_name], seed=0, dtype=dtype)
    dq.quantize_(model, FORMATS[fmt_name], filter_fn=in_layers)
    return add_lora_(model, rank=8, alpha=16, filter_fn=in_layers, seed=1)


def batches(steps: int, cfg_name: str = "even", seed: int = 0) -> list[torch.Tensor]:
    """Token sequences from a fixed random successor table (learnable, so the loss falls)."""
    return list(tiny_llama.synthetic_batches(steps, BATCH, SEQ, CONFIGS[cfg_name].vocab_size, noise=0.2, seed=seed))


def train(model, data, *, lr=1e-2, mp_dtype=None, dp_group=None) -> list[float]:
    """AdamW on the trainable parameters; returns the global-batch loss of every step.

    With ``dp_group`` each rank takes its slice of every batch (FSDP2 averages
    the gradients). ``mp_dtype`` on one process emulates FSDP2's mixed
    precision: every parameter is cast for the forward, gradients flow back
    to the float32 masters.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    losses = []
    for tokens in data:
        tokens = tokens.chunk(dp_size)[dp_rank]
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        logits = _forward(model, inp, mp_dtype)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / dp_size)
    return losses


def _forward(model, inp, mp_dtype):
    if mp_dtype is None:
        return model(inp)
    cast = {n: t.to(mp_dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return functional_call(model, cast, (inp,))


@functools.cache
def reference_losses(fmt_name: str, cfg_name: str, steps: int, mp: str | None = None) -> tuple[float, ...]:
    """Single-process QLoRA training of the same model on the same data (cached per session)."""
    model = qlora_model(fmt_name, cfg_name)
    mp_dtype = getattr(torch, mp) if mp else None
    return tuple(train(model, batches(steps, cfg_name), mp_dtype=mp_dtype))


def gather_quantized_model(fmt_name: str | None, cfg_name: str = "even", quant_dtype=None):
    """The tiny LLaMA, fully trainable; its blocks' Linears all-gathered quantized (None: dense)."""
    from dtensor_quant._fsdp.gather_quantized import gather_quantized_

    model = tiny_llama.build(CONFIGS[cfg_name], seed=0, dtype=torch.float32)
    if fmt_name is not None:
        gather_quantized_(model, FORMATS[fmt_name], quant_dtype=quant_dtype, filter_fn=in_layers)
    return model


@functools.cache
def gather_quantized_reference(fmt_name, cfg_name, steps, mp=None, lr=3e-3) -> tuple[float, ...]:
    """Single-process training of the wrapped model: its matmuls quantize the whole master."""
    mp_dtype = getattr(torch, mp) if mp else None
    model = gather_quantized_model(fmt_name, cfg_name, quant_dtype=mp_dtype)
    return tuple(train(model, batches(steps, cfg_name), lr=lr, mp_dtype=mp_dtype))


def floor_bytes(unit: torch.nn.Module, shard: int, param_dtype=None) -> int:
    """Bytes one rank sends to all-gather ``unit`` over ``shard`` ranks: the physical floor.

    Quantized weights (frozen, or trainable ones gathered quantized) send the
    stored bytes of their padded shard, except inner tensors constant along
    every dim; dense parameters their padded shard in ``param_dtype``.
    Parameters may already be tensor-parallel DTensors (their local shard counts).
    """
    from dtensor_quant._core.layout import Constant
    from dtensor_quant._fsdp.gather_quantized import GatherQuantized

    total = 0
    for p in unit.parameters():
        p = p.to_local() if isinstance(p, DTensor) else p
        rows = -(-p.shape[0] // shard)
        q = p.quantized() if isinstance(p, GatherQuantized) else p
        if isinstance(q, dq.QuantizedTensor):
            for name, rels in zip(q.fmt.inner_names, q.rels):
                if not all(isinstance(r, Constant) for r in rels):
                    inner = getattr(q, name)
                    total += rels[0].inner_len(rows) * inner[0].numel() * inner.element_size()
        else:
            total += rows * p[0].numel() * (param_dtype or p.dtype).itemsize
    return total
