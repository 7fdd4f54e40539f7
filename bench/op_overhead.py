"""Per-op overhead of a quantized DTensor against the same op on a dense bf16 DTensor, one interleaved run.

    python bench/op_overhead.py [--world 2] [--size 256] [--repeat 200]

A ``size x size`` weight (small, so the time is dispatch, not arithmetic) on
``--world`` gloo ranks with one thread each, as a dense bf16 DTensor and
quantized (Int8Rowwise, Int4Groupwise(128)). Ops, each what decode and small
layers issue: a 1-token column-parallel ``F.linear``, ``full_tensor()``,
``redistribute`` Shard(0) -> Shard(1), the view ``.t()`` of the DTensor, and
the views ``.t()`` and ``view(-1)`` of the local tensor (a C++ view of a dense
tensor costs about 1 us; any Python tensor subclass costs about 10 us more, so
those two ratios measure the subclass floor rather than this library). Every op is timed as the median of
``--repeat`` calls, the variants interleaved call by call; printed as ratios
to dense. Target (issue 15): every ratio <= 1.2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant.launch import run

FORMATS = {"bf16": None, "Int8Rowwise": dq.Int8Rowwise(), "Int4Groupwise(128)": dq.Int4Groupwise(128)}
TARGET = 1.2


def ops(w, x):
    """name -> zero-argument callable, for one weight DTensor ``w`` (Shard(0)) and activation ``x``."""
    mesh = w.device_mesh
    local = w.to_local()
    return {
        "linear (1 token, colwise)": lambda: F.linear(x, w),
        "full_tensor": lambda: w.full_tensor(),
        "redistribute S(0)->S(1)": lambda: w.redistribute(mesh, [Shard(1)]),
        "DTensor .t()": lambda: w.t(),
        "local .t()": lambda: local.t(),
        "local view(-1)": lambda: local.view(-1),
    }


@torch.no_grad()
def measure(size: int, repeat: int):
    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    dense = torch.randn(size, size, dtype=torch.bfloat16) * size**-0.5
    x = distribute_tensor(torch.randn(1, size, dtype=torch.bfloat16), mesh, [Replicate()])
    calls = {}
    for name, fmt in FORMATS.items():
        w = dense if fmt is None else dq.quantize(dense, fmt)
        calls[name] = ops(distribute_tensor(w, mesh, [Shard(0)]), x)
    times = {name: {op: [] for op in c} for name, c in calls.items()}
    for op in calls["bf16"]:
        for name in calls:
            calls[name][op]()  # warm-up
        for _ in range(repeat):
            for name in calls:
                t0 = time.perf_counter()
                calls[name][op]()
                times[name][op].append(time.perf_counter() - t0)
    return {name: {op: statistics.median(t) for op, t in ts.items()} for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    res = run(measure, args.world, args.size, args.repeat, timeout=1800)[0]
    print(
        f"per-op time, {args.size}x{args.size} weight Shard(0) over {args.world} gloo ranks x 1 thread, "
        f"median of {args.repeat} interleaved calls; ratio to the same op on a dense bf16 DTensor"
    )
    names = list(res)
    print(f"{'op':<28}" + "".join(f"{n + ' us':>16}" for n in names) + "".join(f"{n + ' x':>22}" for n in names[1:]))
    missed = []
    for op in res["bf16"]:
        base = res["bf16"][op]
        ratios = [res[n][op] / base for n in names[1:]]
        print(f"{op:<28}" + "".join(f"{res[n][op] * 1e6:>16.1f}" for n in names) + "".join(f"{r:>22.2f}" for r in ratios))
        missed += [f"{op} {n} {r:.2f}x" for n, r in zip(names[1:], ratios) if r > TARGET]
    print(f"target (every ratio <= {TARGET}):", "MISSED " + "; ".join(missed) if missed else "met")


if __name__ == "__main__":
    main()
