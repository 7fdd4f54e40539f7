"""Checkpoint save and load: time and bytes of each quantized format against bf16, one run.

    python bench/dcp.py [--world 2] [--layers 8] [--dim 4096] [--repeat 3] [--dir DIR]

A stack of ``layers`` bf16 ``Linear(dim, dim)`` weights is sharded Shard(0)
over ``world`` local gloo ranks, as bf16, Int8Rowwise and
Int4Groupwise(128). For each, every rank runs, ``repeat`` times:

* ``save``: ``dtensor_quant.checkpoint.save`` (DCP, atomic commit, fsync);
* ``async``: how long ``checkpoint.async_save`` blocks the caller (staging);
* ``load``: ``checkpoint.load`` into the same model sharded Shard(1) instead
  (a reshard: every rank reads pieces of every other rank's files).

It prints the bytes on disk, the median times, each as a ratio to bf16
measured in the same run, the bytes against the model's stored (quantized)
payload, and whether the loaded weights are bit-identical to the saved ones.
bf16 goes through the same code path (a dense model's state dict is plain DCP).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant._model import weight_bytes
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.testing.rank_pool import run

# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(128)")}}


def model(layers: int, dim: int, fmt, placement, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(layers))).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net:
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [placement], src_data_rank=None))
    return dq.quantize_(net, fmt) if fmt is not None else net


def timed(fn, repeat: int, then=None) -> float:
    """Median seconds of ``fn()`` across ranks; ``then(result)`` runs untimed after each call."""
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if then is not None:
            then(result)
    return statistics.median(times)


def same(a: nn.Module, b: nn.Module) -> bool:
    """Bit-identical parameters (every inner tensor of a quantized one)."""
    for p, q in zip(a.parameters(), b.parameters()):
        x, y = p.full_tensor(), q.full_tensor()
        quantized = isinstance(x, dq.QuantizedTensor)
        pairs = [(getattr(x, n), getattr(y, n)) for n in x.fmt.inner_names] if quantized else [(x, y)]
        if not all(torch.equal(s.view(torch.uint8), t.view(torch.uint8)) for s, t in pairs):
            return False
    return True


def measure(layers: int, dim: int, repeat: int, root: str):
    rows = []
    for name, fmt in FORMATS.items():
        path = str(Path(root) / name)
        saved = model(layers, dim, fmt, Shard(0), seed=0)
        target = model(layers, dim, fmt, Shard(1), seed=1)
        save_s = timed(lambda saved=saved, path=path: ckpt.save(saved, path), repeat)
        nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
        async_s = timed(
            lambda saved=saved, path=path: ckpt.async_save(saved, path + ".async"), repeat, then=lambda f: f.result()
        )
        load_s = timed(lambda target=target, path=path: ckpt.load(target, path), repeat)
        payload = weight_bytes(saved) * dist.get_world_size()
        rows.append((name, nbytes, payload, save_s, async_s, load_s, same(saved, target)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="dcp_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(measure, args.world, args.layers, args.dim, args.repeat, str(root))[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    base = rows[0]
    print(
        f"world={args.world}, {args.layers} x Linear({args.dim}, {args.dim}) bf16, gloo on CPU, files in {root}, "
        f"median of {args.repeat}"
    )
    print(
        f"{'format':<20}{'MiB on disk':>12}{'x bf16':>8}{'x payload':>10}{'save s':>9}{'x bf16':>8}"
        f"{'async s':>9}{'x bf16':>8}{'load s':>9}{'x bf16':>8}  bit-exact (S0 -> S1)"
    )
    for name, nbytes, payload, save_s, async_s, load_s, exact in rows:
        print(
            f"{name:<20}{nbytes / 2**20:>12.2f}{nbytes / base[1]:>8.3f}{nbytes / payload:>10.3f}"
            f"{save_s:>9.3f}{save_s / base[3]:>8.2f}{async_s:>9.3f}{async_s / base[4]:>8.2f}"
            f"{load_s:>9.3f}{load_s / base[5]:>8.2f}  {exact}"
        )
    print("x payload: bytes on disk / bytes the model stores (its quantized inner tensors): no dense copy is written")


if __name__ == "__main__":
    main()
