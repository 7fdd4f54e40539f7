"""Mixture-of-experts weights: sharding a 3-D expert stack and a MoE layer forward, quantized vs bf16, one run.

    python bench/moe.py [--world 2] [--experts 8] [--hidden 2048] [--inter 768] [--tokens 16 64] [--repeat 7]
    python bench/moe.py --forward-only                  # part 2 only: the MoE table of docs/performance.md

Part 1 (on ``--world`` local gloo ranks): one ``gate_up_proj [E, 2I, H]``
stack in bf16, Int8Rowwise, Int4Groupwise(128) and NF4. For each move --
``distribute_tensor`` over the experts (expert parallelism), ``full_tensor``
from it, expert -> tensor parallel (``Shard(0) -> Shard(1)``), and
``full_tensor`` from tensor parallel -- it records every collective with
``dtensor_quant.wire`` and prints bytes each rank sends and the median time,
both also as a ratio to bf16 measured in the same run.

Part 2 (this process, ``--threads`` threads, default 1): the forward of a
transformers ``MixtralExperts`` layer (top-2 routing of each ``--tokens``
count) with its own eager loop (one ``F.linear`` per expert hit) and its
``grouped_mm`` path (``torch._grouped_mm``), bf16 weights vs the same weights
quantized, bf16 activations. Every expert's tokens run through the format's
kernels (torch's int8/int4 kernels or NF4/float8's one-token kernels for one
or two tokens, the tiled kernels of ``dtensor_quant._core.native`` for more);
no expert is dequantized (``paths`` counts). Median of ``--repeat``
interleaved runs of this thread's CPU time (``--wall``: wall-clock), ratios
to bf16 in the same run. Defaults: Qwen3-30B-A3B's expert widths (H 2048,
I 768) with 8 experts. Targets (issue 24): 4-bit formats through grouped_mm
at most 1.0x bf16 at 16 tokens and 1.3x at 64.

Writes docs/moe.csv and (with matplotlib) docs/moe.png for part 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import common
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant._ops.matmul import record_paths
from dtensor_quant.testing.rank_pool import run

ROOT = Path(__file__).resolve().parents[1]
# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(128)", "NF4")}}
# The layer forward also times Float8Rowwise (part 1 moves the stacks of the formats above).
FORWARD_FORMATS = {**FORMATS, "Float8Rowwise": parse_format("Float8Rowwise")}
FOUR_BIT = ("Int4Groupwise(128)", "NF4")
GOALS = {16: 1.0, 64: 1.3}  # tokens -> the 4-bit formats' grouped_mm target, x bf16


def _median(fn, repeat, barrier=False):
    times = []
    for _ in range(repeat):
        if barrier:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shard_moves(shape, repeat):
    """On every rank: bytes and time of each move of the stack, per format."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = []
    for name, fmt in FORMATS.items():
        t = w if fmt is None else dq.quantize(w, fmt)
        ep = distribute_tensor(t, mesh, [Shard(0)])
        tp = ep.redistribute(mesh, [Shard(1)])
        moves = {
            "distribute_tensor Shard(0) (EP)": lambda t=t: distribute_tensor(t, mesh, [Shard(0)]),
            "full_tensor from Shard(0)": lambda ep=ep: ep.full_tensor(),
            "Shard(0) -> Shard(1) (EP -> TP)": lambda ep=ep: ep.redistribute(mesh, [Shard(1)]).to_local(),
            "full_tensor from Shard(1)": lambda tp=tp: tp.full_tensor(),
        }
        for label, step in moves.items():
            with wire.record() as log:
                step()
            rows.append((label, name, log.nbytes, sorted({str(d).replace("torch.", "") for d in log.dtypes()}),
                         _median(step, repeat, barrier=True)))  # fmt: skip
    return rows


def layer_forward(args, tokens, clock):
    """Median seconds of a MixtralExperts forward per (implementation, format), measured interleaved; the paths
    the quantized matmuls took; stored bytes; formats that could not quantize these widths."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts)
    torch.manual_seed(0)
    base = MixtralExperts(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(base.gate_up_proj, std=0.02)
    torch.nn.init.normal_(base.down_proj, std=0.02)
    layers, refused = {}, {}
    for name, fmt in FORWARD_FORMATS.items():
        m = MixtralExperts(cfg).to(torch.bfloat16)
        m.load_state_dict(base.state_dict())
        try:
            layers[name] = m if fmt is None else dq.quantize_(m, fmt)
        except ValueError as e:  # e.g. NF4's scaler blocks on a width whose block count does not divide 256
            refused[name] = str(e).split(": ", 1)[-1][:150]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, args.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, args.experts, generator=g)
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    times, paths = {}, {}
    with torch.no_grad():
        for impl in ("eager", "grouped_mm"):
            for name, m in layers.items():
                m.config._experts_implementation = impl
                m(x, index, weights)  # warm-up: kernels prepare their inputs once
                with record_paths() as counts:
                    m(x, index, weights)
                paths[(impl, name)] = ", ".join(f"{path} {n}" for (_, path), n in sorted(counts.items())) or "-"
            samples = {name: [] for name in layers}
            for _ in range(args.repeat):  # interleaved: background load hits every format alike
                for name, m in layers.items():
                    m.config._experts_implementation = impl
                    t0 = clock()
                    m(x, index, weights)
                    samples[name].append(clock() - t0)
            for name in layers:
                times[(impl, name)] = statistics.median(samples[name])
    nbytes = {name: sum((p.nbytes_stored if isinstance(p, dq.QuantizedTensor) else p.numel() * 2)
                        for p in m.parameters()) for name, m in layers.items()}  # fmt: skip
    return times, paths, nbytes, refused


def plot(rows, path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, len(impls), figsize=(6.5 * len(impls), 4.2), squeeze=False, sharey=True)
    for ax, impl in zip(axes[0], impls):
        for fmt in dict.fromkeys(r["format"] for r in rows if r["format"] != "bf16"):
            pts = [(r["tokens"], r["ratio_vs_bf16"]) for r in rows if r["impl"] == impl and r["format"] == fmt]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fmt)
        ax.axhline(1.0, color="grey", linewidth=1)
        for tokens, goal in GOALS.items():
            ax.plot([tokens], [goal], marker="_", markersize=20, color="red")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (top-2)")
        ax.set_ylabel("forward time / bf16 time")
        ax.set_title(f"MixtralExperts, {impl} (red: 4-bit goals)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="threads for the layer forward")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of this thread's CPU time")
    ap.add_argument("--forward-only", action="store_true", help="skip part 1 (the gloo ranks)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="where moe.csv / .png go")
    args = ap.parse_args()
    shape = (args.experts, 2 * args.inter, args.hidden)

    if not args.forward_only:
        rows = run(shard_moves, args.world, shape, args.repeat)[0]  # rank 0's view
        print(f"gate_up_proj {shape} bf16 over {args.world} gloo ranks, median of {args.repeat}")
        print(f"{'move':<33}{'format':<20}{'bytes/rank':>12}{'x bf16':>8}{'ms':>9}{'x bf16':>8}  wire dtypes")
        for label in dict.fromkeys(r[0] for r in rows):
            base = next(r for r in rows if r[0] == label and r[1] == "bf16")
            for _, name, nbytes, dtypes, seconds in (r for r in rows if r[0] == label):
                ratio = f"{nbytes / base[2]:.3f}" if base[2] else "-"
                print(f"{label:<33}{name:<20}{nbytes:>12,}{ratio:>8}{seconds * 1e3:>9.2f}"
                      f"{seconds / base[4]:>8.2f}  " + ", ".join(dtypes))  # fmt: skip
        print()

    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.thread_time
    rows = []
    for tokens in args.tokens:
        times, paths, nbytes, refused = layer_forward(args, tokens, clock)
        print(f"MixtralExperts forward: {args.experts} experts, H {args.hidden}, I {args.inter}, {tokens} tokens "
              f"top-2, bf16 activations, {args.threads} thread(s), {'wall' if args.wall else 'CPU'} time, median "
              f"of {args.repeat} interleaved, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        print(f"{'experts impl':<14}{'format':<20}{'weight bytes':>14}{'x bf16':>8}{'ms':>9}{'x bf16':>8}  paths")
        for impl in ("eager", "grouped_mm"):
            for name in FORWARD_FORMATS:
                if name in refused:
                    print(f"{impl:<14}{name:<20}  not quantizable here: {refused[name]}")
                    continue
                t, b = times[(impl, name)], nbytes[name]
                ratio = t / times[(impl, "bf16")]
                path = paths.get((impl, name), "")
                print(f"{impl:<14}{name:<20}{b:>14,}{b / nbytes['bf16']:>8.3f}{t * 1e3:>9.2f}{ratio:>8.2f}  {path}")
                rows.append({"tokens": tokens, "impl": impl, "format": name, "ms": t * 1e3, "ratio_vs_bf16": ratio,
                             "weight_bytes": b, "paths": path})  # fmt: skip
        print()
    for tokens, goal in GOALS.items():
        cells = [r for r in rows if r["tokens"] == tokens and r["impl"] == "grouped_mm" and r["format"] in FOUR_BIT]
        worst = max(cells, key=lambda r: r["ratio_vs_bf16"], default=None)
        if worst is not None:
            met = "met" if worst["ratio_vs_bf16"] <= goal else "MISSED"
            print(f"4-bit formats through grouped_mm <= {goal}x bf16 at {tokens} tokens: {met} "
                  f"(worst {worst['format']}: {worst['ratio_vs_bf16']:.2f}x)")  # fmt: skip
    common.write_csv(rows, args.out / "moe.csv")
    png = args.out / "moe.png"
    print(f"wrote {args.out / 'moe.csv'}" + (f" and {png}" if plot(rows, png) else ""))


if __name__ == "__main__":
    main()
