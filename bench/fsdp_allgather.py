"""FSDP2 all-gather per training step: bytes and time, quantized vs bf16, 2 and 4 ranks, one run.

    python bench/fsdp_allgather.py [--worlds 2 4] [--layers 8] [--dim 1024] [--repeat 3]
        [--reshard-after-forward 2] [--plot docs/fsdp_allgather.png]

A stack of ``--layers`` frozen ``dim x dim`` bf16 Linears, each its own FSDP2
unit (the QLoRA situation: the base weights only move, never train), in bf16,
Int8Rowwise and Int4Groupwise(128). For each it records with
dtensor_quant.wire the all-gathers of one forward + backward (per rank), and
times (median of ``--repeat``) the all-gather of every layer (``unshard``:
copy-in, collective, post hook) and the whole step. Everything is printed as
a ratio to bf16 measured in the same run. Targets (issue 4): Int8Rowwise <=
0.51x and Int4Groupwise(128) <= 0.27x of bf16's bytes, uint8 on the wire.
With matplotlib installed (the ``bench`` extra), ``--plot`` draws the ratios.
``--reshard-after-forward k`` passes an integer to ``fully_shard``: the
backward then all-gathers ``world / k`` shards per rank over groups of k ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing.rank_pool import run

# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(128)")}}
TARGETS = {"Int8Rowwise": 0.51, "Int4Groupwise(128)": 0.27}


def measure(layers: int, dim: int, repeat: int, reshard_after_forward=None):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for name, fmt in FORMATS.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)]).to(torch.bfloat16)
        model.requires_grad_(False)
        if fmt is not None:
            dq.quantize_(model, fmt)
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        x = torch.randn(8, dim, dtype=torch.bfloat16, requires_grad=True)

        def step(model=model, x=x):
            model(x).float().sum().backward()

        step()  # lazy init, kernels
        with wire.record() as log:
            step()
        gathers = log.all_gathers()
        gather_times, step_times = [], []
        for _ in range(repeat):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for layer in model:
                layer.unshard()
            gather_times.append(time.perf_counter() - t0)
            for layer in model:
                layer.reshard()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step()
            step_times.append(time.perf_counter() - t0)
        per_layer = gathers.nbytes / max(len(gathers), 1)
        rows.append(
            dict(
                world=world,
                format=name,
                bytes=gathers.nbytes,
                gathers=len(gathers),
                dtypes=sorted(str(d).replace("torch.", "") for d in gathers.dtypes()),
                gather_s=statistics.median(gather_times) * len(gathers) / layers,
                step_s=statistics.median(step_times),
                per_layer=per_layer,
            )
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reshard-after-forward", type=int, default=None, help="an integer group size for fully_shard")
    ap.add_argument("--plot", default=None, help="write a PNG of the ratios here (needs matplotlib)")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        per_rank = run(measure, world, args.layers, args.dim, args.repeat, args.reshard_after_forward, timeout=1800)
        rows += per_rank[0]  # rank 0's view
    print(
        f"FSDP2, {args.layers} frozen {args.dim}x{args.dim} bf16 Linears, one forward + backward per step, "
        f"gloo on CPU, median of {args.repeat}"
        + (f", reshard_after_forward={args.reshard_after_forward}" if args.reshard_after_forward is not None else "")
    )
    print(
        f"{'ranks':>5}  {'format':<20}{'all-gathers':>12}{'bytes/rank':>14}{'x bf16':>8}"
        f"{'gather ms':>11}{'x bf16':>8}{'step ms':>10}{'x bf16':>8}  wire"
    )
    missed = []
    for row in rows:
        base = next(r for r in rows if r["world"] == row["world"] and r["format"] == "bf16")
        row["bytes_ratio"] = row["bytes"] / base["bytes"]
        row["gather_ratio"] = row["gather_s"] / base["gather_s"]
        row["step_ratio"] = row["step_s"] / base["step_s"]
        print(
            f"{row['world']:>5}  {row['format']:<20}{row['gathers']:>12}{row['bytes']:>14,}{row['bytes_ratio']:>8.3f}"
            f"{row['gather_s'] * 1e3:>11.1f}{row['gather_ratio']:>8.2f}{row['step_s'] * 1e3:>10.1f}"
            f"{row['step_ratio']:>8.2f}  {', '.join(row['dtypes'])}"
        )
        limit = TARGETS.get(row["format"])
        if limit is not None and (row["bytes_ratio"] > limit or row["dtypes"] != ["uint8"]):
            missed.append(f"{row['world']} ranks {row['format']}: {row['bytes_ratio']:.3f} {row['dtypes']}")
    print(
        "byte targets (Int8Rowwise <= 0.51, Int4Groupwise(128) <= 0.27, uint8 only):",
        "MISSED " + "; ".join(missed) if missed else "met",
    )
    if args.plot:
        plot(rows, args.plot, f"{args.layers} x {args.dim}x{args.dim} Linears, gloo/CPU")


def plot(rows, path, subtitle):
    plt = common.pyplot()
    if plt is None:
        return
    quantized = [r for r in rows if r["format"] != "bf16"]
    labels = [f"{r['format']}\n{r['world']} ranks" for r in quantized]
    xs = range(len(quantized))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([x - 0.2 for x in xs], [r["bytes_ratio"] for r in quantized], 0.4, label="all-gather bytes")
    ax.bar([x + 0.2 for x in xs], [r["gather_ratio"] for r in quantized], 0.4, label="all-gather time")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("ratio to bf16 (same run)")
    ax.set_title(f"FSDP2 all-gather per step, quantized vs bf16\n{subtitle}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
