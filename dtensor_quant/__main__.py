"""Command line: ``python -m dtensor_quant plan ...`` (see dtensor_quant._model.planner.plan) and
``python -m dtensor_quant kernels [--build]`` (which C++ kernels run on this machine, on which vector path; with
``--build``, every kernel built into the cache first) and ``python -m dtensor_quant config`` (every environment
variable the library reads, with its value in force).

A user error (a format, shape, path or option it cannot use) is one line on
stderr naming what would work, and exit status 2 -- never a traceback
(:func:`run`); :func:`main` raises them, for code and tests.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from ._core import config, native, native_build
from ._model.format_spec import parse_format
from ._model.planner.checkpoint import stored_layers
from ._model.planner.plan import ALL_STYLES, RUNTIMES, STYLES, Layer, attention_role, kind_from_name, layers_of, plan


def _load(target: str):
    """``package.module:attr`` or ``path/to/file.py:attr``."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise SystemExit(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise SystemExit(f"{where}: no such file (give MODULE:FUNCTION or FILE.py:FUNCTION)")
        sys.path.insert(0, str(path.parent))  # let the file import its neighbours
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise SystemExit(f"cannot import {where!r} ({e}); give MODULE:FUNCTION or FILE.py:FUNCTION") from None
    if not hasattr(module, attr):
        raise SystemExit(f"{where} has no {attr!r}; give MODULE:FUNCTION or FILE.py:FUNCTION")
    return getattr(module, attr)


def _shape(text: str, heads=None) -> list[Layer]:
    """``[NAME=][EXPERTSx]OUTxIN[:STYLE]``; an attention projection's NAME takes ``heads`` (--heads)."""
    name, _, rest = text.rpartition("=")
    dims, _, style = rest.partition(":")
    try:
        shape = tuple(int(v) for v in dims.lower().split("x"))
        assert len(shape) in (2, 3) and min(shape) >= 0
    except (ValueError, AssertionError):
        raise SystemExit(
            f"bad --shape {text!r}: expected [NAME=][EXPERTSx]OUTxIN[:colwise|rowwise], "
            "e.g. wo=4096x4096:rowwise or experts=8x28672x4096"
        ) from None
    if style and style not in ALL_STYLES:
        raise SystemExit(f"bad --shape {text!r}: style must be one of {', '.join(ALL_STYLES)}")
    role = attention_role(name) if heads else ""
    extra = {"heads": tuple(heads), "role": role} if role else {}
    return [Layer(name or dims, shape, s, kind_from_name(name), **extra) for s in ([style] if style else STYLES)]


def _from_config(path: str):
    """A transformers causal LM built from a config (its directory or config.json) on the meta device."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise SystemExit("--config needs transformers (pip install transformers)") from None
    where = Path(path).parent if path.endswith(".json") else Path(path)
    if not (where / "config.json").is_file():
        raise SystemExit(f"{path}: no config.json there (give a Hugging Face model directory or its config.json)")
    config = AutoConfig.from_pretrained(str(where))
    return AutoModelForCausalLM.from_config(config)


def _model_and_plan(args):
    """The model (on the meta device) and the TP plan to plan it with, with a line saying which plan that is."""
    with torch.device("meta"):
        model = _from_config(args.config or args.checkpoint) if args.config or args.checkpoint else _load(args.model)()
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model {args.model}: returned a {type(model).__name__}, not a model (an nn.Module)")
    own = getattr(model, "_tp_plan", None) or None
    if args.tp_plan in (None, "model"):
        if own is None and args.tp_plan == "model":
            raise SystemExit(f"{type(model).__name__} declares no TP plan (_tp_plan); give --tp-plan MODULE:FN")
        if own is None:
            return model, None, "no TP plan: every matmul weight is listed column- and row-parallel"
        return model, dict(own), f"TP plan: {type(model).__name__}._tp_plan ({len(own)} keys)"
    if args.tp_plan == "none":
        return model, None, "no TP plan: every matmul weight is listed column- and row-parallel"
    tp_plan = _load(args.tp_plan)(model)
    if not isinstance(tp_plan, dict):
        raise SystemExit(f"--tp-plan {args.tp_plan}: returned a {type(tp_plan).__name__}, not a plan (a dict)")
    return model, tp_plan, f"TP plan: {args.tp_plan} ({len(tp_plan)} keys)"


#: Each C++ kernel (its module in dtensor_quant._formats) and the formats whose matmuls run it.
KERNELS = {
    "nf4": "NF4, BnbNF4, NF4BlockScales, MXFP4",
    "float8": "Float8Rowwise, Float8Tensorwise, Float8Blockwise",
    "int4": "Int4Groupwise",
    "int4_zero": "Int4GroupwiseIntZero",
    "int8": "Int8Rowwise",
}
#: The kernels of quantized activations (W8A8, FP8): ``name: (module, its loader, the formats, levels in words)``.
#: Their levels mean other work than the tiles': the passes around the product, or (AMX) the whole linear.
ACTIVATION_KERNELS = {
    "int8_w8a8": (
        "int8",
        "w8a8_kernel",
        "Int8Rowwise, activations int8-*",
        {4: "AMX-INT8 tiles (the whole linear)"},
    ),
    "float8_a8": (
        "float8",
        "a8_kernel",
        "Float8Rowwise, Float8Tensorwise, activations fp8-*",
        {4: "AMX tiles, unit scales (the whole linear; fp32 activations: AVX-512 passes)"},
    ),
}
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile",
              "amx_bf16", "amx_int8")  # fmt: skip


def kernels() -> list[str]:
    """The report of ``python -m dtensor_quant kernels``: for each C++ kernel, whether it built here and the
    vector path its tiles (several tokens, bf16 activations) take; where none runs, why (the matmuls of those
    formats then dequantize the weight and multiply densely)."""
    lines = [f"DTENSOR_QUANT_NATIVE={os.environ.get('DTENSOR_QUANT_NATIVE', '1')}"]
    if native.cap() < native.BEST_LEVEL:
        cap = native.cap()
        lines.append(f"DTENSOR_QUANT_MAX_LEVEL={cap}: no kernel goes past {native.LEVEL_NAMES[cap]}")
    flags = native_build.cpu_features()
    have = " ".join(f for f in _CPU_FLAGS if f in flags) or "(no /proc/cpuinfo flags)"
    lines.append(f"CPU: {have}; torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    lines.append(f"cache: {native.cache_folder()}")
    lines.append(f"{'kernel':<11}{'formats':<51}tiles (several tokens)")
    for name, formats in KERNELS.items():
        module = importlib.import_module(f"{__package__}._formats.{name}")
        with warnings.catch_warnings():  # the report says why, in its own line
            warnings.simplefilter("ignore", native.KernelUnavailableWarning)
            built = module.kernel()
        if built is not None:
            level = min(built[1], native.cap())
            path = f"{native.LEVEL_NAMES[level]} tiles"
        elif not native.enabled():
            path = "none (DTENSOR_QUANT_NATIVE=0)"
        else:
            why = native.why_unavailable(module.KERNEL) or "unavailable"
            path = f"none ({why.splitlines()[0][:100]})"
        lines.append(f"{name:<11}{formats:<51}{path}")
    for name, (module_name, loader, formats, words) in ACTIVATION_KERNELS.items():
        module = importlib.import_module(f"{__package__}._formats.{module_name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", native.KernelUnavailableWarning)
            built = getattr(module, loader)()
        if built is not None:
            level = min(built[1], native.cap())
            path = words.get(level, f"{native.LEVEL_NAMES[level]} passes around the product")
        elif not native.enabled():
            path = "none (DTENSOR_QUANT_NATIVE=0)"
        else:
            path = "none: torch's passes around the product"
        lines.append(f"{name:<11}{formats:<51}{path}")
    lines.append("(one token: the one-token kernels, at most AVX-512 BF16; no kernel: dequantize + mm)")
    lines.append("(AVX2, AVX-512, AVX-512 BF16 tiles: the CPU's vector instructions; AMX tiles: its matrix units)")
    return lines


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one line (:func:`run` prints it, exit status 2)."""

    def error(self, message):
        raise SystemExit(f"{message} (see {self.prog} --help)")


def build_kernels(say=print) -> int:
    """``kernels --build``: every kernel the package declares built into the cache (or found there), a line
    each as it goes; the number that did not build (a CPU without the vector ISA is no error)."""
    importlib.import_module(f"{__package__}._formats")
    importlib.import_module(f"{__package__}._core.stochastic")
    if not native.enabled():
        say("DTENSOR_QUANT_NATIVE=0: no kernel is built")
        return 0
    todo, failed = sorted(native.DECLARED.values(), key=lambda k: k.name), 0
    level = native_build.LEVEL_TAGS[native_build.cpu_level()]
    say(f"{len(todo)} kernels, built for {level} into {native.cache_folder()}")
    for i, kernel in enumerate(todo, 1):
        start, step = time.perf_counter(), f"[{i}/{len(todo)}]"
        with warnings.catch_warnings():  # the line says why
            warnings.simplefilter("ignore", native.KernelUnavailableWarning)
            built = native.load(kernel, lambda line, step=step: say(f"{step} {line}"))
        took = f"{time.perf_counter() - start:.1f} s"
        if built is None:
            why = native.why_unavailable(kernel) or "unavailable"
            failed += why.startswith("it did not build")
            say(f"{step} {kernel.name}: cannot run here ({took}): {why.splitlines()[0][:200]}")
        else:
            say(f"{step} {kernel.name}: ready, level {built[1]} ({took})")
    return failed


def main(argv=None) -> int:
    ap = _Parser(prog="python -m dtensor_quant")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="which TP/FSDP degrees each quantized weight can take, and why not")
    p.add_argument("--format", help="int8, int4, int4:64, fp8, nf4, bnb-nf4, mxfp4, NF4(block_size=32), ...")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="[NAME=]OUTxIN[:STYLE]",
        help="a Linear weight [out, in]; STYLE colwise or rowwise (default: both)",
    )
    p.add_argument("--model", metavar="MODULE:FN", help="a function returning the model (built on the meta device)")
    p.add_argument(
        "--config",
        metavar="PATH",
        help="a Hugging Face config.json (or its directory): the model is built from it on the meta device",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a pre-quantized Hugging Face checkpoint: each weight planned in the format that holds it as stored "
        "(read from config.json's quantization_config and the safetensors headers; no weights read)",
    )
    p.add_argument(
        "--tp-plan",
        metavar="MODULE:FN|model|none",
        help="a function model -> {name ('*' allowed): torch ParallelStyle or transformers style name}; "
        "'model' (the default when the model has one): its own _tp_plan; 'none': list both styles. "
        "Weights the plan does not name are replicated",
    )
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="tensor-parallel degrees")
    p.add_argument("--dp", type=int, nargs="+", default=[1], help="FSDP degrees (FSDP2 shards dim 0)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the [EXPERTSxOUTxIN] stacks")
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="torch",
        help="whose attention-head rule: torch (torch/transformers TP: heads and KV heads divisible by tp; default) "
        "or vllm (KV heads replicated when tp is a multiple of them)",
    )
    p.add_argument(
        "--heads",
        type=int,
        nargs=2,
        metavar=("HEADS", "KV_HEADS"),
        help="attention and KV heads for --shape NAMEs like attn.q_proj (a model's config gives its own)",
    )
    p.add_argument("--width", type=int, default=120, help="longest line of the report (0: no limit)")
    p.add_argument("--max-lines", type=int, default=40, help="past this many lines, the notes in short (0: every word)")
    p.add_argument("--csv", metavar="PATH", help="write every layer on every mesh as CSV ('-': to stdout, no table)")
    k = sub.add_parser("kernels", help="which C++ kernels run on this machine, on which vector path")
    k.add_argument("--build", action="store_true", help="build every kernel into the cache first, with progress")
    sub.add_parser("config", help="every environment variable the library reads, with its value in force")
    args = ap.parse_args(argv)
    if args.command == "kernels":
        failed = build_kernels() if args.build else 0
        print("\n".join(kernels()))
        return 1 if failed else 0
    if args.command == "config":
        for env, value, doc in config.describe():
            print(f"{env}={value!r}\n    {doc}")
        return 0

    sources = [n for n in ("model", "config", "checkpoint") if getattr(args, n)]
    if len(sources) > 1:
        ap.error(f"give one of --model, --config, --checkpoint, not {' and '.join('--' + n for n in sources)}")
    if args.checkpoint and args.format:
        ap.error("--checkpoint plans each weight in the format its files store; leave out --format")
    if not args.checkpoint and not args.format:
        ap.error("give --format (e.g. int4, nf4, fp8), or --checkpoint DIR for a pre-quantized checkpoint")
    for name in ("tp", "dp"):
        if min(getattr(args, name)) < 1:
            ap.error(f"--{name} takes degrees >= 1, got {getattr(args, name)}")
    if args.ep < 1 or args.width < 0 or args.max_lines < 0:
        ap.error("--ep must be >= 1, --width and --max-lines >= 0")
    if args.heads and (min(args.heads) < 1 or args.heads[0] % args.heads[1]):
        ap.error(f"--heads HEADS KV_HEADS: KV heads must divide the heads, got {args.heads}")
    fmt = parse_format(args.format) if args.format else None
    start = time.perf_counter()
    layers = [layer for s in args.shape for layer in _shape(s, args.heads)]
    header = None
    if sources:
        model, tp_plan, header = _model_and_plan(args)
        layers += layers_of(model, tp_plan, dense=tp_plan is not None, heads=args.heads)
        if args.checkpoint:
            layers, methods = stored_layers(model, args.checkpoint, layers)
            header += "\nstored: " + "; ".join(f"{m} x{n}" for m, n in methods.items())
            fmt = Counter(layer.fmt for layer in layers if layer.fmt is not None).most_common(1)[0][0]
    if not layers:
        ap.error("give --model, --config, --checkpoint or at least one --shape")
    built = time.perf_counter()
    result = plan(layers, fmt, tp=args.tp, dp=args.dp, ep=args.ep, runtime=args.runtime)
    if args.csv:
        text = result.csv()
        if args.csv == "-":
            sys.stdout.write(text)
            return 0
        Path(args.csv).write_text(text)
    above = len(header.splitlines()) if header else 0  # the report's budget counts the header lines too
    report = result.render(args.width, args.max_lines and max(args.max_lines - above, 1))
    done = time.perf_counter()
    if header:
        print(header)
    print(report)
    if args.csv:
        print(f"\nevery layer on every mesh: {args.csv}")
    what = "model built (with its imports)" if sources else "shapes read"
    print(
        f"\n{len(layers)} parameters x {len(result.meshes)} meshes: {what} in {built - start:.1f} s, "
        f"planned and rendered in {done - built:.1f} s"
    )
    return 0


def run(argv=None) -> int:
    """The command line: :func:`main`, with a user error printed as one line on stderr and exit status 2.

    User errors are what :func:`main` raises as ``SystemExit(message)`` or
    ``ValueError`` (a format, a shape, a layout, a checkpoint it cannot read),
    ``OSError`` (a path) and ``ImportError`` (a missing optional package).
    """
    try:
        return main(argv)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        message = e.code
    except (ValueError, OSError, ImportError) as e:
        message = str(e) or type(e).__name__
    print(f"python -m dtensor_quant: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(run())
