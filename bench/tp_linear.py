"""Tensor-parallel linear layers: quantized (Int8Rowwise, Int4Groupwise) against dense bf16, one run.

    python bench/tp_linear.py                      # TP 1 and 2, decode and prefill shapes
    python bench/tp_linear.py --tp 1 2 4 --repeat 20 --shape 4096x4096 --tokens 1 8

Each layer is an ``nn.Linear`` in bf16 sharded with torch's ColwiseParallel
(the weight's rows split, no communication) or RowwiseParallel (columns split,
the output all-reduced), quantized with ``dtensor_quant.quantize_`` or left
dense, on local ranks (gloo). A forward of ``tokens`` rows is timed as the
median of ``repeat`` calls after a warm-up, the all-reduce included; the
formats' calls are interleaved so that load from elsewhere hits them alike.
Decode shapes are batches of 1-16 tokens, prefill a block of 128 (timed
3 times: dense bf16 matmuls are slow on CPUs without bf16 instructions).

It prints every time as a ratio to dense bf16 at the same TP degree and
shape (below 1: quantized is faster), writes docs/tp_linear.csv and, if
matplotlib is installed (``pip install dtensor_quant[bench]``),
docs/tp_linear.png. The goal (issue 3): quantized decode faster than dense
bf16 at every TP degree measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import common
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.testing.rank_pool import RankPool

# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(128)")}}
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# LLaMA-7B attention projections: wq column-parallel, wo row-parallel (--shape for others).
LAYERS = [("wq", 4096, 4096, "colwise"), ("wo", 4096, 4096, "rowwise")]
DECODE, PREFILL = (1, 4, 16), (128,)
DOCS = Path(__file__).resolve().parents[1] / "docs"


@torch.no_grad()
def interleaved_ms(modules: dict[str, nn.Module], x: torch.Tensor, repeat: int) -> dict[str, float]:
    """Median ms per call of each module, calls interleaved so that load from elsewhere hits all alike."""
    for module in modules.values():
        module(x)  # warm-up: kernel caches (int4 repacks its weight once)
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(repeat):
        for name, module in modules.items():
            dist.barrier()
            start = time.perf_counter()
            module(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def measure(layers, tokens, repeat, threads) -> list[dict]:
    """On every rank of one TP degree; rank 0's rows are returned."""
    tp = dist.get_world_size()
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    mesh = init_device_mesh("cpu", (tp,))
    rows = []
    for name, out_f, in_f, style in layers:
        modules = {
            fmt_name: common.linear(out_f, in_f, fmt, mesh, STYLES[style] if mesh.size() > 1 else None)
            for fmt_name, fmt in FORMATS.items()
        }
        for n in tokens:
            in_local = in_f // tp if style == "rowwise" and tp > 1 else in_f
            x = torch.randn(n, in_local, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
            ms = interleaved_ms(modules, x, repeat if n in DECODE else max(3, repeat // 3))
            for fmt_name in FORMATS:
                rows.append(
                    dict(
                        tp=tp,
                        threads_per_rank=threads,
                        layer=name,
                        shape=f"{out_f}x{in_f}",
                        style=style,
                        tokens=n,
                        phase="decode" if n in DECODE else "prefill",
                        format=fmt_name,
                        ms=ms[fmt_name],
                        ratio_vs_bf16=ms[fmt_name] / ms["bf16"],
                    )
                )
        del modules
    return rows


def plot(rows, path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False

    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(1, len(layers), figsize=(6 * len(layers), 4.2), squeeze=False)
    for ax, name in zip(axes[0], layers):
        for (fmt, tp), style in _series(rows, name):
            pts = sorted(
                (r["tokens"], r["ratio_vs_bf16"])
                for r in rows
                if r["layer"] == name and r["format"] == fmt and r["tp"] == tp
            )
            ax.plot(*zip(*pts), marker="o", linestyle=style, label=f"{fmt}, TP={tp}")
        first = next(r for r in rows if r["layer"] == name)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per forward (decode: 1-16, prefill: 128)")
        ax.set_ylabel("time / dense bf16 time (same TP)")
        ax.set_title(f"{name} {first['shape']} ({first['style']}-parallel)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _series(rows, name):
    keys = dict.fromkeys((r["format"], r["tp"]) for r in rows if r["layer"] == name and r["format"] != "bf16")
    return [(k, "-" if k[1] == 1 else "--") for k in keys]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="+", default=[*DECODE, *PREFILL])
    ap.add_argument("--shape", nargs="+", metavar="OUTxIN", help="layers to bench both ways instead of wq/wo")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads per rank (default: CPU cores / TP degree); 1 is steadier on a busy machine",
    )
    ap.add_argument("--out", type=Path, default=DOCS, help="where tp_linear.csv / .png go")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    layers = LAYERS
    if args.shape:
        dims = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
        layers = [(s, o, i, s) for o, i in dims for s in STYLES]
    rows = []
    for tp in args.tp:
        print(f"TP={tp}: starting {tp} rank(s) ...", flush=True)
        with RankPool(tp, device="cpu", timeout=3600) as pool:
            rows += pool.run(measure, layers, args.tokens, args.repeat, args.threads)[0]
    threads = ", ".join(f"TP={tp}: {t}" for tp, t in dict.fromkeys((r["tp"], r["threads_per_rank"]) for r in rows))
    print(f"\nbf16 activations, {os.cpu_count()} CPU cores, threads per rank {threads}, median of {args.repeat}")
    print(f"{'layer':<20}{'TP':>3}{'tokens':>8}  {'format':<20}{'ms':>10}{'x bf16':>8}")
    for r in rows:
        print(
            f"{r['layer'] + ' ' + r['shape']:<20}{r['tp']:>3}{r['tokens']:>8}  {r['format']:<20}"
            f"{r['ms']:>10.2f}{r['ratio_vs_bf16']:>8.2f}"
        )
    common.write_csv(rows, args.out / "tp_linear.csv")
    decode = [r for r in rows if r["phase"] == "decode" and r["format"] != "bf16"]
    worst = max(decode, key=lambda r: r["ratio_vs_bf16"]) if decode else None
    print(
        f"\nwrote {args.out / 'tp_linear.csv'}"
        + (
            f" and {args.out / 'tp_linear.png'}"
            if plot(rows, args.out / "tp_linear.png")
            else " (install matplotlib for the plot: pip install dtensor_quant[bench])"
        )
    )
    if worst:
        met = worst["ratio_vs_bf16"] < 1
        print(
            f"goal, quantized decode faster than dense bf16 at every TP degree: {'met' if met else 'MISSED'} "
            f"(slowest: {worst['format']} {worst['layer']} TP={worst['tp']} tokens={worst['tokens']} "
            f"at {worst['ratio_vs_bf16']:.2f}x bf16)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
