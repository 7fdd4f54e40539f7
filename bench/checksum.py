"""What the per-chunk CRC32 costs: dq.checkpoint save and load with and without it, one process.

    python bench/checksum.py [--shape 4096 4096] [--layers 4] [--repeat 5]

Saves and loads an Int4Groupwise(128) model of ``layers`` Linear layers with
dq.checkpoint, alternating runs with the checksums on and off (the writer's
and reader's checks replaced by DCP's plain ones), and prints the medians and
their ratio. The files sit in the page cache, so this is the CPU cost of
CRC32 plus the extra read, not disk time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 4096])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    out, inp = args.shape
    net = torch.nn.Sequential(*[torch.nn.Linear(inp, out, bias=False) for _ in range(args.layers)]).bfloat16()
    dq.quantize_(net, dq.Int4Groupwise(128))
    checked = (ckpt.AtomicFileSystemWriter.write_data, ckpt.VerifyingFileSystemReader.prepare_local_plan)
    unchecked = (
        lambda self, plan, planner: dcp.FileSystemWriter.write_data(self, plan, planner),
        lambda self, plan: plan,
    )
    times = {True: ([], []), False: ([], [])}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeat):
            for on in (True, False):
                ckpt.AtomicFileSystemWriter.write_data, ckpt.VerifyingFileSystemReader.prepare_local_plan = (
                    checked if on else unchecked
                )
                path = f"{d}/c{i}{on}"
                t0 = time.perf_counter()
                ckpt.save(net, path)
                t1 = time.perf_counter()
                ckpt.load(net, path)
                t2 = time.perf_counter()
                times[on][0].append(t1 - t0)
                times[on][1].append(t2 - t1)
    ckpt.AtomicFileSystemWriter.write_data, ckpt.VerifyingFileSystemReader.prepare_local_plan = checked
    mb = sum(p.nbytes_stored for p in net.parameters()) / 2**20
    print(f"{args.layers} x Int4Groupwise(128) {out}x{inp}: {mb:.1f} MiB stored")
    for i, what in enumerate(("save", "load")):
        on, off = statistics.median(times[True][i]), statistics.median(times[False][i])
        print(f"{what}: with CRC32 {on * 1e3:7.1f} ms, without {off * 1e3:7.1f} ms, ratio {on / off:.2f}x")


if __name__ == "__main__":
    main()
