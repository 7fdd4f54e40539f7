"""One token through one weight: every format's matmul path against bf16's, on one thread, one process.

    python bench/gemv.py                        # TinyLlama's w1 [5632, 2048] and w2 [2048, 5632]
    python bench/gemv.py --shapes 4096x4096 --rounds 9

What bench/decode.py's model step is made of, without DTensor, dispatch or
all-reduces: ``F.linear(x, W)`` for a bf16 ``x`` of one row, for the dense
bf16 weight (oneDNN's GEMV) and each quantized one through the library
(torch's int8/int4 kernels; the fused kernels of NF4 (also BnbNF4's and MXFP4's),
float8 and Int4GroupwiseIntZero from ``dtensor_quant._core.native``; every vector
level of those, forced, too; and the
plain path they replaced, dequantize + mm). All variants run in turn within
each round; each time is the median over the rounds of the mean of
``--calls`` calls. ``GB/s`` is the weight's stored bytes (codes and scales) over that
time: how close a path comes to streaming the weight from memory once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._formats import float8, int4_zero, nf4
from dtensor_quant._ops.unpack import dense

FORMATS = {
    "Int8Rowwise": dq.Int8Rowwise(),
    "Int4Groupwise(128)": dq.Int4Groupwise(128),
    "NF4": dq.NF4(),
    "Float8Rowwise": dq.Float8Rowwise(),
    # the layouts pre-quantized checkpoints load into (AWQ/GPTQ, bitsandbytes, gpt-oss)
    "Int4GroupwiseIntZero(fp16)": dq.Int4GroupwiseIntZero(128, scale_dtype=torch.float16),
    "BnbNF4": dq.BnbNF4(),
    "MXFP4": dq.MXFP4(),
}
LEVELS = {  # each fused kernel's vector paths, by the level its max_level argument takes
    "NF4": (nf4, {1: "AVX2", 2: "AVX-512"}),
    "BnbNF4": (nf4, {1: "AVX2", 2: "AVX-512"}),  # NF4's kernel with bitsandbytes' tables
    "MXFP4": (nf4, {1: "AVX2", 2: "AVX-512"}),  # NF4's kernel with the e2m1 values
    "Int4GroupwiseIntZero(fp16)": (int4_zero, {1: "AVX2", 2: "AVX-512"}),
    "Float8Rowwise": (float8, {1: "AVX2", 2: "AVX-512", 3: "AVX-512 BF16"}),
}


def variants(shape):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    x = torch.randn((1, shape[1]), generator=torch.Generator().manual_seed(1)).bfloat16()
    out = {"bf16": (lambda: F.linear(x, w), w.numel() * 2)}
    for name, fmt in FORMATS.items():
        q = dq.quantize(w, fmt)
        nbytes = sum(t.numel() * t.element_size() for t in q.inner.values())
        out[name] = (lambda q=q: F.linear(x, q), nbytes)
        if name in LEVELS:
            module, levels = LEVELS[name]
            prepared, best = fmt.prepare(q.inner).get(), (module.kernel() or (None, 0))[1]
            for level, isa in levels.items():
                if prepared is not None and level <= best:
                    args = () if module is float8 else (getattr(fmt, "block_size", None) or fmt.group_size,)
                    out[f"{name} kernel, {isa}"] = (
                        lambda p=prepared, a=args, lv=level, m=module: m.fused_linear(x, p, *a, max_level=lv),
                        nbytes,
                    )
            out[f"{name} dequantize + mm"] = (lambda q=q: x @ dense(q, torch.bfloat16).t(), nbytes)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["5632x2048", "2048x5632"], help="out x in")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"one bf16 token, 1 thread, {os.cpu_count()} CPU cores, median of {args.rounds} rounds x {args.calls} calls")
    for spec in args.shapes:
        shape = tuple(int(n) for n in spec.split("x"))
        runs = variants(shape)
        times = {name: [] for name in runs}
        for fn, _ in runs.values():
            fn()  # warm-up: kernel builds, prepared weights
        for _ in range(args.rounds):
            for name, (fn, _) in runs.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - start) / args.calls)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"\n[{shape[0]}, {shape[1]}]   load average {os.getloadavg()[0]:.1f}")
        print(f"{'path':<46}{'ms':>8}{'x bf16':>8}{'GB/s':>7}")
        for name, (_, nbytes) in runs.items():
            print(f"{name:<46}{ms[name]:>8.3f}{ms[name] / ms['bf16']:>8.2f}{nbytes / ms[name] / 1e6:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
