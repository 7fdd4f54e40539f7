"""One-token tensor-parallel decode of a small LLaMA-like model: every format against bf16, one run.

    python bench/decode.py                                  # TP 1, 2, 4; eager; all built-in formats
    python bench/decode.py --tp 1 2 --compile               # eager and torch.compile (inductor) side by side
    python bench/decode.py --formats int8 nf4 --rounds 5 --calls 20

The model is dtensor_quant/testing/tiny_llama.py's at TinyLlama-1.1B's widths (dim 2048, MLP
5632, 32 query and 4 key/value heads; ``--layers`` blocks, vocabulary
``--vocab``), sharded with torchtitan's plan (examples/tp_inference.py) over
local gloo ranks, one thread per rank. Every Linear (the output head too) is
quantized with ``dtensor_quant.quantize_`` or left dense (bf16). Where a
format cannot cut a row-parallel weight's columns at a degree (NF4's w2
[2048, 5632] at TP 2 and 4), ``dtensor_quant.adapt_tp_plan`` makes it
column-parallel with a gathered input, and the row's ``plan`` column says so.

One decode step is a forward of one token (``[1, 1]``): the weights are read
once, the regime where weight-only quantization should win. Each round times
``--calls`` forwards of every variant in turn (a barrier before each), so
load from elsewhere hits all alike; each variant's time is the median over
all rounds. Ratios are to bf16 in the same mode (eager quantized / eager
bf16, compiled quantized / compiled bf16) at the same TP degree. The goal
(issue 15): every format at most 0.85x of bf16's time at TP 1, 2 and 4, and
compiled no worse relative to compiled bf16 than eager is to eager bf16.

Writes docs/decode.csv and (with matplotlib) docs/decode.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import common  # noqa: E402
import tp_inference  # noqa: E402

from dtensor_quant._core.layout import LayoutError  # noqa: E402
from dtensor_quant._model.format_spec import parse_format  # noqa: E402
from dtensor_quant.testing import tiny_llama  # noqa: E402
from dtensor_quant.testing.rank_pool import RankPool  # noqa: E402

FORMATS = ["int8", "int4:128", "nf4", "float8rowwise", "float8tensorwise", "float8blockwise:128"]
GOAL = 0.85


def config(layers: int, vocab: int) -> tiny_llama.Config:
    """TinyLlama-1.1B's widths (head_dim 64); few layers and a small vocabulary keep five engineers' RAM free."""
    return tiny_llama.Config(
        vocab_size=vocab, dim=2048, n_layers=layers, n_heads=32, n_kv_heads=4, hidden_dim=5632, max_seq_len=16
    )


def build(cfg, spec: str | None, mesh, compiled: bool):
    model = tp_inference.build_tp(cfg, parse_format(spec) if spec else None, mesh, dtype=torch.bfloat16)
    model.eval()
    return torch.compile(model, backend="inductor") if compiled else model


@torch.no_grad()
def measure(cfg, specs, rounds: int, calls: int, compile_too: bool, threads: int) -> list[dict]:
    """On every rank of one TP degree; rank 0's rows are returned."""
    torch.set_num_threads(threads)
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    token = torch.tensor([[7]])
    modes = ["eager", "compiled"] if compile_too else ["eager"]
    variants = {(mode, name): None for mode in modes for name in ["bf16", *specs]}
    compile_s, skipped, notes = {}, {}, {}
    for mode, name in list(variants):
        start = time.perf_counter()
        try:
            model = build(cfg, None if name == "bf16" else name, mesh, mode == "compiled")
        except LayoutError as e:  # raised on every rank alike: the format cannot hold this TP plan
            skipped[name] = str(e).split(":")[0] + f": {tp}-way TP plan not legal for this layout"
            del variants[mode, name]
            continue
        notes[name] = plan_note(model.tp_switched)
        first = model(token)  # warm-up: kernel caches (int4 repacks once), compilation
        compile_s[mode, name] = time.perf_counter() - start
        variants[mode, name] = model
        if mode == "compiled":  # compiled decode must give eager's logits
            eager = variants["eager", name](token)
            diff = (first.float() - eager.float()).abs().max().item()
            compile_s[mode, name, "max_abs_diff"] = diff
    times: dict = {key: [] for key in variants}
    for _ in range(rounds):
        for key, model in variants.items():
            for _ in range(calls):
                dist.barrier()
                start = time.perf_counter()
                model(token)
                times[key].append(time.perf_counter() - start)
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    rows = []
    for (mode, name), t in ms.items():
        rows.append(
            {
                "tp": tp,
                "mode": mode,
                "format": str(parse_format(name)) if name != "bf16" else "bf16",
                "ms": t,
                "ratio_vs_bf16": t / ms[mode, "bf16"],
                "setup_s": compile_s[mode, name],
                "max_abs_diff_vs_eager": compile_s.get((mode, name, "max_abs_diff"), ""),
                "plan": notes[name],
            }
        )
    for name, why in skipped.items():
        rows.append(
            {
                "tp": tp,
                "mode": "skipped",
                "format": name,
                "ms": float("nan"),
                "ratio_vs_bf16": float("nan"),
                "setup_s": 0.0,
                "max_abs_diff_vs_eager": why,
                "plan": "",
            }
        )
    return rows


def plan_note(switched: dict) -> str:
    """'torchtitan' or, where adapt_tp_plan switched row-parallel layers, which ones (by their name in a block)."""
    if not switched:
        return "torchtitan"
    names = sorted({fqn.split(".", 2)[-1] for fqn in switched})
    return f"torchtitan, {'+'.join(names)} column-parallel (gathered input) x{len(switched)}"


def plot(rows, path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False

    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "skipped"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.2), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes):
        fmts = [f for f in dict.fromkeys(r["format"] for r in rows if r["mode"] == mode) if f != "bf16"]
        tps = sorted({r["tp"] for r in rows})
        width = 0.8 / max(len(fmts), 1)
        for i, fmt in enumerate(fmts):
            vals = [
                next(
                    (r["ratio_vs_bf16"] for r in rows if r["mode"] == mode and r["format"] == fmt and r["tp"] == tp),
                    float("nan"),
                )
                for tp in tps
            ]  # nan: not measured, or the layout cannot hold the TP plan
            ax.bar([j + i * width for j in range(len(tps))], vals, width, label=fmt)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.axhline(GOAL, color="red", linewidth=1, linestyle="--", label=f"goal {GOAL}x")
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tps))], [f"TP={tp}" for tp in tps])
        ax.set_ylabel(f"one-token decode time / {mode} bf16 (log)")
        ax.set_title(f"{mode}: dim 2048, MLP 5632, one token")
        ax.legend(fontsize=7)
    switched = sorted(
        {f"{r['format']} TP={r['tp']}" for r in rows if r.get("plan", "torchtitan") not in ("torchtitan", "")}
    )
    if switched:
        fig.text(
            0.01,
            0.005,
            "not torchtitan's plan (down-projection column-parallel, gathered input): " + ", ".join(switched),
            fontsize=7,
        )
    fig.tight_layout(rect=(0, 0.03 if switched else 0, 1, 1))
    fig.savefig(path, dpi=110)
    return True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--formats", nargs="+", default=FORMATS, help="format specs (dtensor_quant._model.format_spec)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5, help="timed forwards per variant per round")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--compile", action="store_true", help="also torch.compile (inductor) every variant")
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="where decode.csv / .png go")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = config(args.layers, args.vocab)
    rows = []
    for tp in args.tp:
        print(f"TP={tp}: starting {tp} rank(s) ...", flush=True)
        with RankPool(tp, device="cpu", timeout=3600) as pool:
            rows += pool.run(measure, cfg, args.formats, args.rounds, args.calls, args.compile, args.threads)[0]
        for r in rows:
            if r["tp"] == tp:
                print(
                    f"  {r['mode']:<9}{r['format']:<44}{r['ms']:>9.2f} ms{r['ratio_vs_bf16']:>7.2f}x  {r['plan']}",
                    flush=True,
                )
    print(
        f"\none-token decode, dim {cfg.dim}, MLP {cfg.hidden_dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
        f"bf16 activations, {args.threads} thread(s) per rank, {os.cpu_count()} CPU cores, "
        f"median of {args.rounds}x{args.calls} calls, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'TP':>3}  {'mode':<9}{'format':<32}{'ms':>9}{'x bf16':>8}  {'max|compiled-eager|':>20}  plan")
    for r in rows:
        diff = r["max_abs_diff_vs_eager"]
        if r["mode"] == "skipped":
            print(f"{r['tp']:>3}  {'skipped':<9}{r['format']:<32}  {diff}")
            continue
        print(
            f"{r['tp']:>3}  {r['mode']:<9}{r['format']:<32}{r['ms']:>9.2f}{r['ratio_vs_bf16']:>8.2f}"
            f"  {diff if diff == '' else f'{diff:.3g}':>20}  {r['plan']}"
        )
    common.write_csv(rows, args.out / "decode.csv")
    print(
        f"\nwrote {args.out / 'decode.csv'}"
        + (f" and {args.out / 'decode.png'}" if plot(rows, args.out / "decode.png") else "")
    )
    quant = [r for r in rows if r["format"] != "bf16" and r["mode"] != "skipped"]
    worst = max((r for r in quant if r["mode"] == "eager"), key=lambda r: r["ratio_vs_bf16"], default=None)
    if worst:
        print(
            f"goal, eager decode <= {GOAL}x bf16 at every TP degree for every format: "
            f"{'met' if worst['ratio_vs_bf16'] <= GOAL else 'MISSED'} (worst: {worst['format']} TP={worst['tp']} "
            f"at {worst['ratio_vs_bf16']:.2f}x)"
        )
    if args.compile:
        eager = {(r["tp"], r["format"]): r["ratio_vs_bf16"] for r in quant if r["mode"] == "eager"}
        behind = [r for r in quant if r["mode"] == "compiled" and r["ratio_vs_bf16"] > eager[r["tp"], r["format"]]]
        print(
            "goal, compiled ratio <= eager ratio: "
            + (
                "met"
                if not behind
                else "MISSED for "
                + ", ".join(
                    f"{r['format']} TP={r['tp']} "
                    f"({r['ratio_vs_bf16']:.2f}x vs eager {eager[r['tp'], r['format']]:.2f}x)"
                    for r in behind
                )
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
