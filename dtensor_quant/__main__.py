"""Command line: ``python -m dtensor_quant plan ...`` (see dtensor_quant.model.planner)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from .model.format_spec import parse_format
from .model.planner import STYLES, Layer, layers_of, plan


def _load(target: str):
    """``package.module:attr`` or ``path/to/file.py:attr``."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise SystemExit(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        sys.path.insert(0, str(path.parent))  # let the file import its neighbours
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, attr)


def _shape(text: str) -> list[Layer]:
    """``[NAME=][EXPERTSx]OUTxIN[:colwise|rowwise]``."""
    name, _, rest = text.rpartition("=")
    dims, _, style = rest.partition(":")
    try:
        shape = tuple(int(v) for v in dims.lower().split("x"))
        assert len(shape) in (2, 3)
    except (ValueError, AssertionError):
        raise SystemExit(
            f"bad --shape {text!r}: expected [NAME=][EXPERTSx]OUTxIN[:colwise|rowwise], "
            "e.g. wo=4096x4096:rowwise or experts=8x28672x4096"
        ) from None
    if style and style not in STYLES:
        raise SystemExit(f"bad --shape {text!r}: style must be colwise or rowwise")
    return [Layer(name or dims, shape, s) for s in ([style] if style else STYLES)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dtensor_quant")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="which TP/FSDP degrees each quantized weight can take, and why not")
    p.add_argument("--format", required=True, help="int8, int4, int4:64, Int4Groupwise(32), ...")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="[NAME=]OUTxIN[:STYLE]",
        help="a Linear weight [out, in]; STYLE colwise or rowwise (default: both)",
    )
    p.add_argument("--model", metavar="MODULE:FN", help="a function returning the model (built on the meta device)")
    p.add_argument("--tp-plan", metavar="MODULE:FN", help="a function model -> {fqn: ParallelStyle} (the TP styles)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="tensor-parallel degrees")
    p.add_argument("--dp", type=int, nargs="+", default=[1], help="FSDP degrees (FSDP2 shards dim 0)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the [EXPERTSxOUTxIN] stacks")
    args = ap.parse_args(argv)

    fmt = parse_format(args.format)
    layers = [layer for s in args.shape for layer in _shape(s)]
    if args.model:
        with torch.device("meta"):
            model = _load(args.model)()
        tp_plan = _load(args.tp_plan)(model) if args.tp_plan else None
        layers += layers_of(model, tp_plan)
    if not layers:
        ap.error("give --model or at least one --shape")
    result = plan(layers, fmt, tp=args.tp, dp=args.dp, ep=args.ep)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
