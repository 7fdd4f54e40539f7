"""The planner's whole-model report for 17 real model shapes, every built-in format: its length, width and verdicts.

For each model of bench/model_shapes.py (12) plus Qwen2.5-72B, Mixtral-8x7B,
DeepSeek-V2-Lite and gpt-oss-20b, its transformers config is written
locally (no weights), the model built on the meta device with its own TP
plan, and ``python -m dtensor_quant plan --config DIR --format F`` run in
this process for every built-in format at TP 1, 2, 4, 8. Printed per model
and format: the report's lines and widest line (issue 34's target: at most
40 and 120), and its verdict per degree (``=`` legal as is, ``a`` with
adapt_tp_plan, ``p`` with padding, ``b`` with both, ``-`` not at all).

    PYTHONPATH=. python bench/plan_reports.py                 # torch/transformers' head rule
    PYTHONPATH=. python bench/plan_reports.py --runtime vllm --models Qwen2-7B Llama-3-70B
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from model_shapes import FORMATS, MODELS, MORE, write_config

from dtensor_quant.__main__ import main

TP = (1, 2, 4, 8)
LETTER = {"legal as is": "=", "legal with adapt_tp_plan": "a", "legal with padding": "p",
          "legal with adapt_tp_plan and padding": "b", "not at all": "-"}  # fmt: skip


def report(config_dir: str, fmt: str, runtime: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--config", config_dir, "--format", fmt, "--runtime", runtime, "--tp", *map(str, TP)])
    lines = out.getvalue().splitlines()
    return lines[:-2]  # the timing line (and the blank before it) is not the report


def verdicts(lines: list[str]) -> str:
    """``==a-`` from the report's first lines (``  tp=2, tp=4: legal with ...``)."""
    got = {}
    for line in lines:
        if line.startswith("  tp=") or line.startswith("  every mesh"):
            where, _, text = line.strip().partition(": ")
            status = next((s for s in sorted(LETTER, key=len, reverse=True) if text.startswith(s)), None)
            letter = LETTER[status] if status else "x"  # another mix of remedies (expand_scales by hand)
            tps = TP if where == "every mesh" else [int(t) for t in where.removeprefix("tp=").split(", ")]
            for t in tps:
                got[t] = letter
    return "".join(got.get(t, "?") for t in TP)


def main_() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=[*MODELS, *MORE])
    ap.add_argument("--runtime", default="torch", choices=["torch", "vllm"])
    ap.add_argument("--formats", nargs="+", default=[repr(f) for f in FORMATS])
    args = ap.parse_args()
    worst = (0, 0)
    print(f"TP {TP}; verdicts: = as is, a adapt_tp_plan, p padding, b both, - not at all ({args.runtime})")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = write_config(name, Path(tmp) / name)
            cells = []
            for fmt in args.formats:
                lines = report(path, fmt, args.runtime)
                n, width = len(lines), max(map(len, lines))
                worst = (max(worst[0], n), max(worst[1], width))
                cells.append(f"{fmt.split('(')[0]} {verdicts(lines)} {n}L/{width}c")
            print(f"{name:<17} " + "  ".join(cells), flush=True)
    print(f"longest report: {worst[0]} lines (target <= 40); widest line: {worst[1]} columns (target <= 120)")
    return 0 if worst[0] <= 40 and worst[1] <= 120 else 1


if __name__ == "__main__":
    sys.exit(main_())
