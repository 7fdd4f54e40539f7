"""Quantize under TP=2, save, load under FSDP=3 and in one process: the same bytes everywhere.

    python examples/checkpoint_reshard.py [--format int4|int8] [--dir DIR]

1. TP=2 (2 ranks): the LLaMA-style model of ``dtensor_quant/testing/tiny_llama.py``, each Linear
   weight sharded as tensor parallelism shards it (``wq wk wv w1 w3 output``
   column-wise, ``Shard(0)``; ``wo w2`` row-wise, ``Shard(1)``), then quantized
   in place: each rank quantizes its own shard, with the scale reductions the
   layout needs. Saved with ``dtensor_quant.checkpoint.save``.
2. FSDP=3 (3 ranks, uneven shards): a model with other random weights, every
   Linear weight ``Shard(0)`` over 3 ranks, quantized, then
   ``checkpoint.load``. Every weight is compared, inner tensor by inner tensor,
   with the model quantized once in a single process.
3. One process, no process group: the same checkpoint loads into a plain
   quantized model, which generates exactly the reference model's tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant import parse_format, weight_bytes
from dtensor_quant.testing import same_bits, tiny_llama
from dtensor_quant.testing.rank_pool import run

FORMATS = ("int4", "int8")  # --format choices, read by parse_format: int4 is Int4Groupwise(128)
ROW_WISE = ("wo", "w2")  # tensor parallelism splits their inputs


def sharded(seed: int, fmt, plan: str) -> nn.Module:
    """The model from ``seed`` with its Linear weights sharded by ``plan`` ("tp" or "fsdp"), then quantized."""
    model = tiny_llama.build(seed=seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            dim = 1 if plan == "tp" and name.rsplit(".", 1)[-1] in ROW_WISE else 0
            weight = distribute_tensor(module.weight.detach(), mesh, [Shard(dim)], src_data_rank=None)
            module.weight = nn.Parameter(weight, requires_grad=False)
    return dq.quantize_(model, fmt)


def reference(fmt) -> nn.Module:
    return dq.quantize_(tiny_llama.build(seed=0), fmt)


def same_weight(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every stored byte equal: each inner tensor of a quantized weight, or the dense tensor itself."""
    if not isinstance(b, dq.QuantizedTensor):
        return same_bits(a, b)
    return (
        isinstance(a, dq.QuantizedTensor)
        and a.fmt == b.fmt
        and all(same_bits(a.inner[n], t) for n, t in b.inner.items())
    )


def save_tp(fmt_name: str, path: str) -> None:
    ckpt.save(sharded(seed=0, fmt=parse_format(fmt_name), plan="tp"), path)


def load_fsdp(fmt_name: str, path: str) -> list[str]:
    """Load into FSDP-style shards; return the names of weights that differ from the reference."""
    fmt = parse_format(fmt_name)
    model = sharded(seed=1, fmt=fmt, plan="fsdp")
    ckpt.load(model, path)
    expected = dict(reference(fmt).named_parameters())
    wrong = []
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        want = expected[name]
        if not same_weight(full, want):
            wrong.append(name)
    return wrong


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=FORMATS, default="int4")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args()
    fmt = parse_format(args.format)
    path = str(Path(args.dir or tempfile.mkdtemp(prefix="reshard_")) / "ckpt")

    print(f"1. TP=2: quantize with {fmt} shard by shard and save to {path} ...", flush=True)
    run(save_tp, 2, args.format, path)
    on_disk = sum(f.stat().st_size for f in Path(path).iterdir())
    stored, dense = weight_bytes(reference(fmt)), weight_bytes(tiny_llama.build(seed=0))
    print(
        f"   {on_disk / 2**20:.2f} MiB on disk: {on_disk / stored:.3f}x the quantized model's bytes, "
        f"{on_disk / dense:.3f}x the bf16 model's"
    )

    print("2. FSDP=3: load into a model with other weights, sharded Shard(0) over 3 ranks ...", flush=True)
    wrong = run(load_fsdp, 3, args.format, path)[0]
    print(f"   every weight bit-identical to the single-process quantization: {not wrong} {wrong or ''}")

    print("3. One process: load and generate ...", flush=True)
    model = dq.quantize_(tiny_llama.build(seed=2), fmt)
    ckpt.load(model, path)
    prompt = torch.arange(8)[None]
    tokens, expected = tiny_llama.generate(model, prompt, 8), tiny_llama.generate(reference(fmt), prompt, 8)
    same_tokens = torch.equal(tokens, expected)
    print(f"   tokens {tokens[0, 8:].tolist()}, reference {expected[0, 8:].tolist()}: equal {same_tokens}")
    if wrong or not same_tokens:
        raise SystemExit("checkpoint reshard FAILED")


if __name__ == "__main__":
    main()
