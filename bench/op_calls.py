"""Python calls per op of bench/op_overhead.py, quantized against dense: a measure of the library's own work
that load does not move.

    python bench/op_calls.py [--world 2] [--size 256] [--top 0]

Wall-clock ratios on a shared machine spread by +-0.3; the number of Python
function calls an op makes (``sys.setprofile``'s ``call`` events, Python
functions only, and ``c_call`` events, builtins and C methods called from
Python) is the same on every run. Each op of ``op_overhead.ops`` runs on
every rank (the collectives need them all) after two warm-up calls (the
memoised decisions), and rank 0 counts one call. ``--top N`` lists, per
quantized op, the N Python functions called most often.
"""

from __future__ import annotations

import argparse
import collections
import sys

import op_overhead
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant.testing.rank_pool import run


def _count(fn):
    """``(python calls, C calls, Counter of Python function names, Counter of torch ops, bytecodes)`` of a
    call of ``fn`` (the torch ops -- ``aten::``, ``c10d::``... as the profiler records them -- from a second
    call, the bytecode instructions from a third)."""
    py, c, names = 0, 0, collections.Counter()

    def prof(frame, event, arg):
        nonlocal py, c
        if event == "call":
            py += 1
            code = frame.f_code
            names[f"{code.co_filename.rsplit('/', 2)[-2:][-1]}:{code.co_name}"] += 1
        elif event == "c_call":
            c += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        fn()
    ops = collections.Counter({e.key: e.count for e in p.key_averages() if "::" in e.key})
    return py, c, names, ops, _bytecodes(fn)


def _bytecodes(fn) -> int:
    """Python bytecode instructions one call of ``fn`` executes (``sys.settrace`` opcode events)."""
    n = 0

    def trace(frame, event, arg):
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


@torch.no_grad()
def measure(size: int, shortcuts: bool):
    torch.set_num_threads(1)
    if shortcuts:
        dq.enable_fast_redistribute()
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    dense = torch.randn(size, size, dtype=torch.bfloat16) * size**-0.5
    x = distribute_tensor(torch.randn(1, size, dtype=torch.bfloat16), mesh, [Replicate()])
    calls = {}
    for name, fmt in op_overhead.FORMATS.items():
        calls[name] = op_overhead.ops(dense if fmt is None else dq.quantize(dense, fmt), mesh, x)
    rows = -(-size // world)
    bare_local = torch.Tensor._make_wrapper_subclass(op_overhead.Bare, (rows, size), dtype=torch.bfloat16)
    bare = DTensor.from_local(bare_local, mesh, [Shard(0)], run_check=False, shape=dense.shape, stride=dense.stride())
    calls[op_overhead.BARE] = {
        "DTensor .t()": lambda: bare.t(),
        "local .t()": lambda: bare_local.t(),
        "local view(-1)": lambda: bare_local.view(-1),
    }
    out = {}
    for name, table in calls.items():
        for op, fn in table.items():
            fn()
            fn()
            if rank == 0:
                out[name, op] = _count(fn)
            else:  # as many calls as rank 0 makes in _count
                fn()
                fn()
                fn()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument(
        "--diff", action="store_true", help="per quantized op, the Python functions it calls more often than dense"
    )
    ap.add_argument("--torch-path", action="store_true", help="leave the redistribute shortcuts off")
    args = ap.parse_args()
    res = run(measure, args.world, args.size, not args.torch_path, timeout=600)[0]
    names = list(dict.fromkeys(n for n, _ in res))
    ops = list(dict.fromkeys(op for _, op in res))
    print(f"Python calls (py) and C calls (c) for one call of each op, rank 0 of {args.world}, {args.size}^2 weight")
    print("torch ops (op: every aten/c10d op the profiler records, nested ones included), bytecodes (bc)")
    print(f"{'op':<26}" + "".join(f"{n + ' py':>9}{n + ' c':>9}{n + ' op':>9}{n + ' bc':>9}" for n in names))
    for op in ops:
        cells = [res.get((n, op)) for n in names]
        print(
            f"{op:<26}"
            + "".join(f"{c[0]:>9}{c[1]:>9}{sum(c[3].values()):>9}{c[4]:>9}" if c else f"{'':>36}" for c in cells)
        )
    if args.diff:
        for (name, op), (_, _, fns, _, _) in res.items():
            if name in ("bf16", op_overhead.BARE):
                continue
            more = fns - res["bf16", op][2]
            print(f"\n{name} {op}, {sum(more.values())} more: " + ", ".join(f"{f} {k}" for f, k in more.most_common()))
    if args.top:
        for (name, op), (_, _, fns, tops, _) in res.items():
            if name == op_overhead.BARE:
                continue
            print(f"\n{name} {op}: " + ", ".join(f"{f} {k}" for f, k in fns.most_common(args.top)))
            print("  ops: " + ", ".join(f"{f} {k}" for f, k in tops.most_common()))


if __name__ == "__main__":
    main()
