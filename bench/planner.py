"""How long the planner takes on a whole 70B-class model; issue 24's target: NF4 over 48 meshes in <= 2 s.

The meshes are TP 1-8 x FSDP 8, 16, 32, 64, 128, 256 (48). Two models:

- ``shapes``: Qwen2-72B's 561 Linear weights, from bench/model_shapes.py
  (80 blocks of q/k/v/o/gate/up/down and the head; no torch model at all);
- ``llama``: a transformers Llama-3-70B built from its config on the meta
  device (no weights) and planned with its own TP plan (``model._tp_plan``:
  wildcard keys, transformers style names) -- 723 parameters, the
  embeddings and norms counted in bf16, as ``python -m dtensor_quant plan
  --config`` does.

Each measurement runs in a fresh process: the planner memoises every verdict,
so a second plan of the same model in one process is mostly cache hits
(printed too, as "again"). Inside it, timed apart: imports (``torch._dynamo``,
which torch's first meta-device op imports -- the price of any meta tensor
op, paid once per process, not the planner's -- and transformers' Llama),
building the model (or its layer list), then ``plan`` and rendering the
report (what the command line prints). The median of ``--runs`` runs of plan + render is
compared with the 2 s target.

    PYTHONPATH=. python bench/planner.py              # NF4, both models, 3 runs each
    PYTHONPATH=. python bench/planner.py --formats all --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 2.0
TP = list(range(1, 9))
DP = [8, 16, 32, 64, 128, 256]
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip


def format_of(spec: str):
    """``nf4``, ``int4:64`` (parse_format), or ``default:N``: the N-th built-in format with its defaults."""
    from dtensor_quant._model.format_spec import parse_format
    from dtensor_quant.testing import is_default, where

    if spec.startswith("default:"):
        return list(where(is_default).values())[int(spec.split(":")[1])]
    return parse_format(spec)


def child(case: str, fmt_name: str) -> dict:
    """One measurement in this (fresh) process."""
    import torch

    from dtensor_quant._model.planner.plan import plan

    fmt = format_of(fmt_name)
    start = time.perf_counter()
    import torch._dynamo  # what torch's first meta-device op imports (its Python meta kernels)

    if case == "llama":
        import transformers

        model_class, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA3_70B)
    imports = time.perf_counter() - start
    start = time.perf_counter()
    if case == "shapes":
        from model_shapes import MODELS, layers

        source, tp_plan = layers(*MODELS["Qwen2-72B"]), None
    else:
        with torch.device("meta"):
            source = model_class(config)
        tp_plan = source._tp_plan
    built = time.perf_counter()
    result = plan(source, fmt, tp=TP, dp=DP, tp_plan=tp_plan)
    planned = time.perf_counter()
    lines = result.render().splitlines()
    rendered = time.perf_counter()
    plan(source, fmt, tp=TP, dp=DP, tp_plan=tp_plan).render()
    again = time.perf_counter() - rendered
    return {
        "format": repr(fmt),
        "imports_s": imports,
        "build_s": built - start,
        "plan_s": planned - built,
        "render_s": rendered - planned,
        "again_s": again,
        "params": len(result.rows),
        "cells": len(result.rows) * len(result.meshes),
        "lines": len(lines),
        "width": max(map(len, lines)),
    }


def measure(case: str, fmt_name: str) -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)])
    )
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, fmt_name], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode:
        raise RuntimeError(f"{case} {fmt_name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=["nf4"], help="format names (parse_format), or 'all'")
    ap.add_argument("--cases", nargs="+", default=["shapes", "llama"], choices=["shapes", "llama"])
    ap.add_argument("--child", nargs=2, metavar=("CASE", "FORMAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    formats = args.formats
    if formats == ["all"]:
        from dtensor_quant.testing import is_default, where

        formats = [f"default:{i}" for i in range(len(where(is_default)))]
    if "llama" in args.cases:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: the llama case is skipped")
            args.cases = [c for c in args.cases if c != "llama"]
    print(f"{len(TP) * len(DP)} meshes (TP {TP[0]}-{TP[-1]} x FSDP {DP}); median of {args.runs} fresh processes each;")
    print(f"plan+render against the {TARGET_S:.0f} s target (a ratio <= 1 meets it)\n")
    header = (
        f"{'model':<8} {'format':<44} {'params':>6} {'cells':>6} {'imports':>7} {'build':>7} {'plan':>7} {'render':>7}"
    )
    print(header + f" {'plan+render':>11} {'ratio':>6} {'again':>7} {'lines':>5} {'width':>5}")
    for case in args.cases:
        for fmt_name in formats:
            runs = [measure(case, fmt_name) for _ in range(args.runs)]
            keys = ("imports_s", "build_s", "plan_s", "render_s", "again_s")
            med = {k: statistics.median(r[k] for r in runs) for k in keys}
            total = statistics.median(r["plan_s"] + r["render_s"] for r in runs)
            r = runs[0]
            print(
                f"{case:<8} {r['format']:<44} {r['params']:>6} {r['cells']:>6} {med['imports_s']:>6.2f}s "
                f"{med['build_s']:>6.2f}s "
                f"{med['plan_s']:>6.2f}s {med['render_s']:>6.2f}s {total:>10.2f}s {total / TARGET_S:>6.2f} "
                f"{med['again_s']:>6.2f}s {r['lines']:>5} {r['width']:>5}"
            )


if __name__ == "__main__":
    main()
