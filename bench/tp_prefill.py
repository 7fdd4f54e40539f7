"""Prefill of a LLaMA-shaped model at TP 2 with quantized activations (W8A8 int8, FP8) against bf16, one run.

    python bench/tp_prefill.py                       # TinyLlama widths (2048 / 5632), 2 blocks, 32/128/512 tokens
    python bench/tp_prefill.py --quick               # 1 block, 32/128 tokens, 3 rounds: 17-61 s here (load 2-7)
    python bench/tp_prefill.py --layers 4 --tokens 128 512 --rounds 9 --pin

The model is the examples' (dtensor_quant/testing/tiny_llama.py: RMSNorm,
RoPE, grouped-query attention, SwiGLU) at TinyLlama-1.1B's widths (dim 2048,
32 heads, 4 kv heads, SwiGLU 5632), random weights from a seed, bf16,
sharded over 2 gloo ranks with one thread each in torchtitan's plan (q/k/v and
w1/w3 column-parallel, wo and w2 row-parallel, logits gathered). Variants,
each the same model:

* ``bf16``: dense;
* ``w8a8``: every Linear ``Int8Rowwise(activations="int8-token")``, the
  per-token scales of a row-parallel layer's input all-reduced over the TP
  ranks before quantizing (one process's model; ``tokens x 4`` bytes more on
  the wire per row-parallel layer);
* ``w8a8-per-rank`` (``--per-rank-scales``, on by default):
  ``activations="int8-token-per-rank"``, each rank's scale taken from its
  own slice, nothing extra on the wire (vLLM's behaviour: another model);
* ``fp8a8``: ``Float8Rowwise(activations="fp8-token")``, reduced scales.

End-to-end: one forward of ``tokens`` positions (batch 1, the logits
included). Per layer: the MLP's down-projection ``w2`` ``[2048, 5632]``
alone, row-parallel (its input sharded on features, its output all-reduced),
and the up-projection ``w1`` ``[5632, 2048]`` column-parallel. Each round runs
every variant once in turn (a barrier before each call), so load from
elsewhere hits all alike; a call's time is the slowest rank's and a
variant's time the median over the rounds, by two clocks: wall-clock (what a
user waits, collectives included) and each rank's thread CPU time (on a
machine shared with other jobs, the time a rank waits for a core -- or for
the other rank inside a collective -- does not count). Every number is a
ratio to bf16 measured in the same run.

Targets (issue 35), by both clocks: end-to-end prefill at TP 2 at most 0.7x bf16 (w8a8);
per layer at TP 2, row- and column-parallel, W8A8 at most 0.8 / 0.6 / 0.55x
bf16 at 32 / 128 / 512 tokens and FP8 dynamic at most 1.0x at 128. Each is
printed as met or MISSED from this run's numbers. Writes docs/tp_prefill.csv
(not with --quick).
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
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.testing import tiny_llama
from dtensor_quant.testing.rank_pool import run

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = dict(dim=2048, hidden_dim=5632, n_heads=32, n_kv_heads=4, vocab_size=1024)  # TinyLlama-1.1B's
FORMATS = {
    "bf16": None,
    "w8a8": dq.Int8Rowwise(activations="int8-token"),
    "w8a8-per-rank": dq.Int8Rowwise(activations="int8-token-per-rank"),
    "fp8a8": dq.Float8Rowwise(activations="fp8-token"),
}
PER_RANK = ("w8a8-per-rank",)
E2E_GOAL = {"w8a8": 0.7}  # end-to-end prefill at TP 2, any token count
LAYER_GOALS = {"w8a8": {32: 0.8, 128: 0.6, 512: 0.55}, "fp8a8": {128: 1.0}}  # per layer, row- and column-parallel


def tp_plan(model: tiny_llama.Transformer) -> dict:
    """torchtitan's plan without sequence parallelism: the attention and MLP inputs column-parallel, their
    outputs row-parallel, the logits column-parallel and gathered."""
    plan = {"output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.layers)):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    return plan


def build_model(cfg, fmt, mesh) -> nn.Module:
    model = tiny_llama.build(cfg, seed=0)
    if fmt is not None:
        dq.quantize_(model, fmt)
    return parallelize_module(model, mesh, tp_plan(model))


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


@torch.no_grad()
def interleaved(calls: dict, rounds: int) -> dict[str, dict[str, float]]:
    """{clock: {call: seconds}}: the median over ``rounds`` of each call's time, the calls interleaved, a call's
    time the slowest rank's, by both clocks (wall-clock, and this thread's CPU time, which leaves out the time
    a rank waits for a core -- or for the other rank in a collective)."""
    for fn in calls.values():
        fn()  # warm-up: kernel caches, prepared weights, DTensor's sharding propagation
    mine = {clock: {name: [] for name in calls} for clock in CLOCKS}
    for _ in range(rounds):
        for name, fn in calls.items():
            dist.barrier()
            starts = {clock: read() for clock, read in CLOCKS.items()}
            fn()
            for clock, read in CLOCKS.items():
                mine[clock][name].append(read() - starts[clock])
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {
        clock: {name: statistics.median(max(r[clock][name][i] for r in every) for i in range(rounds)) for name in calls}
        for clock in CLOCKS
    }


def measure(cfg_kwargs: dict, tokens: list[int], rounds: int, formats: list[str], pin: bool, layer_tokens: list[int]):
    """On every rank; rank 0's rows are used."""
    torch.set_num_threads(1)
    if pin:  # rank r on CPU r: the ranks never share a core
        os.sched_setaffinity(0, {dist.get_rank() % os.cpu_count()})
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    cfg = tiny_llama.Config(**cfg_kwargs)
    rows = []
    models = {name: build_model(cfg, FORMATS[name], mesh) for name in formats}
    for n in tokens:
        prompt = torch.randint(cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        ms = interleaved({name: (lambda m=m, p=prompt: m(p)) for name, m in models.items()}, rounds)
        rows += _rows("end-to-end", n, ms)
        rows += [wire_row(name, n, m, prompt) for name, m in models.items()]
    del models
    if layer_tokens:
        tp = dist.get_world_size()
        dim, hidden = cfg.dim, cfg.hidden_dim
        for what, (out_f, in_f, style, in_local) in {
            f"w2 [{dim}, {hidden}] row-parallel": (dim, hidden, RowwiseParallel, hidden // tp),
            f"w1 [{hidden}, {dim}] column-parallel": (hidden, dim, ColwiseParallel, dim),
        }.items():
            mods = {
                name: common.linear(out_f, in_f, FORMATS[name], mesh, style, seed=out_f * 7 + in_f) for name in formats
            }
            for n in layer_tokens:
                x = torch.randn(n, in_local, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
                ms = interleaved({name: (lambda m=m, x=x: m(x)) for name, m in mods.items()}, rounds)
                rows += _rows(what, n, ms)
            del mods
    return rows


@torch.no_grad()
def wire_row(name: str, tokens: int, model: nn.Module, prompt: torch.Tensor) -> dict:
    """What one forward puts on the wire from this rank: all bytes, and the per-token maxima's all-reduces."""
    with wire.record() as log:
        model(prompt)
    maxima = [t for t in log.transfers if "all_reduce" in t.op and t.nbytes == tokens * 4]
    return dict(
        what="wire",
        tokens=tokens,
        format=name,
        bytes=log.nbytes,
        token_max_reduces=len(maxima),
        over=",".join(sorted({f"{t.mesh_dim}{list(t.ranks or ())}" for t in maxima})) or "-",
    )


def _rows(what: str, tokens: int, by_clock: dict[str, dict[str, float]]) -> list[dict]:
    return [
        dict(what=what, tokens=tokens, clock=clock, format=name, ms=s * 1e3, ratio_vs_bf16=s / seconds["bf16"])
        for clock, seconds in by_clock.items()
        for name, s in seconds.items()
    ]


def goals(rows: list[dict]) -> list[str]:
    """One line per target: met or MISSED, with this run's ratio."""
    lines = []
    for r in rows:
        if r["what"] == "end-to-end":
            goal = E2E_GOAL.get(r["format"])
        else:
            goal = LAYER_GOALS.get(r["format"], {}).get(r["tokens"])
        if goal is not None:
            met = r["ratio_vs_bf16"] <= goal
            lines.append(
                f"{r['format']} {r['what']} at {r['tokens']} tokens ({r['clock']} time) <= {goal}x bf16: "
                f"{'met' if met else 'MISSED'} ({r['ratio_vs_bf16']:.2f}x)"
            )
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--per-rank-scales",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure W8A8 with each rank's own per-token scales (vLLM's behaviour: no all-reduce of the "
        "token maxima, another model than one process's)",
    )
    ap.add_argument("--no-layer-table", dest="layer_table", action="store_false", help="end-to-end only")
    ap.add_argument("--pin", action="store_true", help="pin rank r to CPU r")
    ap.add_argument(
        "--quick", action="store_true", help="1 block, 32 and 128 tokens, 3 rounds, layers at 128 only; no CSV"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="where tp_prefill.csv goes")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.rounds = 1, [32, 128], 3
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    formats = [f for f in FORMATS if args.per_rank_scales or f not in PER_RANK]
    cfg = dict(WIDTHS, n_layers=args.layers, max_seq_len=max(args.tokens))
    start = time.perf_counter()
    layer_tokens = (args.tokens[-1:] if args.quick else args.tokens) if args.layer_table else []
    rows = run(measure, args.tp, cfg, args.tokens, args.rounds, formats, args.pin, layer_tokens, timeout=3600)[0]
    quant = [f for f in formats if f != "bf16"]
    timed = [r for r in rows if r["what"] != "wire"]
    print(
        f"prefill at TP {args.tp}: {args.tp} gloo ranks x 1 thread{' (pinned)' if args.pin else ''}, "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; {args.layers} block(s) of dim "
        f"{WIDTHS['dim']} / SwiGLU {WIDTHS['hidden_dim']}; median of {args.rounds} interleaved rounds, the slowest "
        f"rank's time; ratio to bf16 in the same run ({time.perf_counter() - start:.0f} s)"
    )
    for clock, label in (("wall", "wall-clock time"), ("cpu", "CPU time of each rank's thread (no waiting)")):
        print(f"\n{label}\n{'':<36}{'tokens':>7}{'bf16 ms':>10}" + "".join(f"{f + ' x':>16}" for f in quant))
        for what in dict.fromkeys(r["what"] for r in timed):
            for n in dict.fromkeys(r["tokens"] for r in timed if r["what"] == what):
                cells = {r["format"]: r for r in timed if (r["what"], r["tokens"], r["clock"]) == (what, n, clock)}
                print(
                    f"{what:<36}{n:>7}{cells['bf16']['ms']:>10.1f}"
                    + "".join(f"{cells[f]['ratio_vs_bf16']:>16.2f}" for f in quant)
                )
    print("\none end-to-end forward on the wire, from rank 0 (dq.wire.record()):")
    print(f"{'tokens':>7}  {'format':<16}{'bytes':>12}  all-reduces of the token maxima (mesh dim [ranks])")
    for r in rows:
        if r["what"] == "wire":
            n = r["tokens"]
            print(f"{n:>7}  {r['format']:<16}{r['bytes']:>12}  {r['token_max_reduces']} x {n * 4} B over {r['over']}")
    print("\ntargets (issue 35):")
    for line in goals(timed):
        print("  " + line)
    if not args.quick:
        path = args.out / "tp_prefill.csv"
        common.write_csv([dict(r, tp=args.tp, layers=args.layers, rounds=args.rounds) for r in timed], path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
