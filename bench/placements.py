"""Bytes on the wire and time for full_tensor / redistribute: quantized vs bf16, one run.

    python bench/placements.py [--world 2] [--shape 4096 4096] [--repeat 5]

For each transition it runs the same DTensor in bf16, Int8Rowwise and
Int4Groupwise(128) on local gloo ranks, records every collective with
dtensor_quant.wire, and prints bytes sent per rank and median time, each
also as a ratio to bf16 measured in this same run. Targets (issue 2):
Int8Rowwise <= 0.51x and Int4Groupwise(128) <= 0.27x of bf16's bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.testing.rank_pool import run

# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(128)")}}
TRANSITIONS = [
    ("full_tensor from Shard(0)", [Shard(0)], None),
    ("full_tensor from Shard(1)", [Shard(1)], None),
    ("Shard(0) -> Shard(1)", [Shard(0)], [Shard(1)]),
    ("Replicate -> Shard(1)", [Replicate()], [Shard(1)]),
]
TARGETS = {"Int8Rowwise": 0.51, "Int4Groupwise(128)": 0.27}


def measure(shape, repeat):
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = []
    for label, src, dst in TRANSITIONS:
        for name, fmt in FORMATS.items():
            tensor = weight if fmt is None else dq.quantize(weight, fmt)
            dt = distribute_tensor(tensor, mesh, src)
            step = (
                (lambda dt=dt: dt.full_tensor())
                if dst is None
                else (lambda dt=dt, dst=dst: dt.redistribute(mesh, dst).to_local())
            )
            with wire.record() as log:
                step()
            times = []
            for _ in range(repeat):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            rows.append((label, name, log.nbytes, sorted(log.dtypes(), key=str), statistics.median(times)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 4096])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = run(measure, args.world, tuple(args.shape), args.repeat)[0]  # rank 0's view
    print(f"world={args.world} weight={tuple(args.shape)} bf16, gloo on CPU, median of {args.repeat}")
    print(f"{'transition':<27}{'format':<20}{'bytes/rank':>12}{'x bf16':>8}{'ms':>9}{'x bf16':>8}  wire dtypes")
    failed = []
    for label, _, _ in TRANSITIONS:
        base = next(r for r in rows if r[0] == label and r[1] == "bf16")
        for _, name, nbytes, dtypes, seconds in (r for r in rows if r[0] == label):
            ratio = f"{nbytes / base[2]:.3f}" if base[2] else "-"  # no bytes move (a local split)
            print(
                f"{label:<27}{name:<20}{nbytes:>12,}{ratio:>8}{seconds * 1e3:>9.2f}"
                f"{seconds / base[4]:>8.2f}  {', '.join(str(d).replace('torch.', '') for d in dtypes)}"
            )
            if name in TARGETS and base[2] and nbytes / base[2] > TARGETS[name]:
                failed.append(f"{label} {name}: {nbytes / base[2]:.3f} > {TARGETS[name]}")
    print(
        "byte targets (Int8Rowwise <= 0.51, Int4Groupwise(128) <= 0.27):",
        "MISSED " + "; ".join(failed) if failed else "met",
    )


if __name__ == "__main__":
    main()
