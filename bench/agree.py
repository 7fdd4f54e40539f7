"""What the ranks' format-agreement check costs per collective: full_tensor with and without it.

    python bench/agree.py [--world 2] [--repeat 200]

The check (dtensor_quant._parallel.agree) exchanges an 8-byte fingerprint the first
time a (process group, layout) pair is seen; after that it builds the layout
key and looks it up in a set. This times ``full_tensor()`` of a quantized
DTensor with the check as shipped and with it replaced by a no-op,
interleaved call by call, and prints the medians and their difference, plus
the key-and-lookup cost alone on one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant._parallel import agree
from dtensor_quant.testing.rank_pool import run

SHAPES = [(256, 256), (4096, 4096)]


def measure(repeat):
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    real, rows = agree.check_same, []
    for shape in SHAPES:
        w = dq.quantize(torch.randn(shape).to(torch.bfloat16), dq.Int4Groupwise(128))
        dt = distribute_tensor(w, mesh, [Shard(0)])
        dt.full_tensor()  # the one-time exchange
        on, off = [], []
        for _ in range(repeat):
            for checked, times in ((True, on), (False, off)):
                agree.check_same = real if checked else (lambda *a, **k: None)
                torch.distributed.barrier()
                t0 = time.perf_counter()
                dt.full_tensor()
                times.append(time.perf_counter() - t0)
        agree.check_same = real
        local, name = dt.to_local(), mesh.get_group().group_name
        t0 = time.perf_counter()
        for _ in range(10000):
            _ = agree.agreed(name, agree.layout_key(local))
        lookup = (time.perf_counter() - t0) / 10000
        rows.append((shape, statistics.median(on), statistics.median(off), lookup))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    rows = run(measure, args.world, args.repeat)[0]
    print(f"{'shape':>12} {'checked ms':>11} {'unchecked ms':>13} {'diff us':>8} {'key+lookup us':>14}")
    for shape, on, off, lookup in rows:
        print(f"{shape!s:>12} {on * 1e3:11.3f} {off * 1e3:13.3f} {(on - off) * 1e6:8.1f} {lookup * 1e6:14.1f}")


if __name__ == "__main__":
    main()
