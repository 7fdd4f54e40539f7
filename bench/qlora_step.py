"""QLoRA training step under FSDP2: this library vs torchao's NF4 vs the bf16 base, one interleaved run.

    python bench/qlora_step.py [--dims 2048 4096] [--layers 4] [--tokens 512] [--repeat 7] [--world 2]

``--layers`` frozen ``dim x dim`` bf16 Linears, each wrapped in a rank-16
LoRALinear (fp32 adapters), each its own FSDP2 unit with bf16 mixed precision
(fp32 gradient reduction), on ``--world`` gloo ranks with one thread each.
One step is a forward of ``--tokens`` rows per rank, backward, AdamW on the
adapters. Variants: the bf16 base (the baseline), this library's NF4,
Int4Groupwise(128) and Int8Rowwise, and torchao's NF4 (``to_nf4``, skipped
with a note when torchao is not installed: ``pip install --no-deps torchao``).

All variants are built first, then stepped round-robin ``--repeat`` times so
that load from elsewhere hits them alike; the medians are printed as ratios
to bf16 measured in the same run. Also per rank: the all-gather bytes of one
step (dtensor_quant.wire; ratios to bf16) and the peak memory of one step
(torch.profiler's CPU allocation events: what the rank holds before the step
-- shards, adapters, optimizer state -- plus the highest point reached during
it). Targets (issue 15): NF4 faster than torchao's NF4, every 4-bit format
within 1.3x of bf16, peak memory at or below bf16's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import common
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.lora import LoRALinear
from dtensor_quant.testing.rank_pool import run

OURS = {s: parse_format(s) for s in ("NF4", "Int4Groupwise(128)", "Int8Rowwise")}  # the labels are format specs


def build(variant: str, dim: int, layers: int, mesh):
    torch.manual_seed(0)
    bases = [nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16) for _ in range(layers)]
    for base in bases:
        base.weight.data.normal_(0, dim**-0.5)
        base.requires_grad_(False)
        if variant == "torchao NF4":
            base.weight = nn.Parameter(common.torchao_nf4()(base.weight.data), requires_grad=False)
        elif variant in OURS:
            dq.quantize_(base, OURS[variant])
    model = nn.Sequential(*[LoRALinear(base, rank=16, alpha=32) for base in bases])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def step(model, opt, x):
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def peak_bytes(fn) -> int:
    """Highest CPU bytes allocated above the level at the start of ``fn()`` (the profiler's allocation events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    level = peak = 0
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return peak


def resident_bytes(model, opt) -> int:
    """Bytes of this rank's shards and optimizer state (what it holds between steps)."""
    seen, total = set(), 0
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    while tensors:
        t = tensors.pop()
        if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass: its inner tensors hold the bytes
            tensors += [
                i for i in (getattr(t, name) for name in t.__tensor_flatten__()[0]) if isinstance(i, torch.Tensor)
            ]
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(dim: int, layers: int, tokens: int, repeat: int, variants: list[str]):
    torch.set_num_threads(1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(rank)
    x = torch.randn(tokens, dim, dtype=torch.float32)
    built = {v: build(v, dim, layers, mesh) for v in variants}
    rows = {}
    for v, (model, opt) in built.items():
        step(model, opt, x)  # lazy init, kernels
        with wire.record() as log:
            step(model, opt, x)
        peak = resident_bytes(model, opt) + peak_bytes(functools.partial(step, model, opt, x))
        rows[v] = {"bytes": log.all_gathers().nbytes, "peak": peak, "times": []}
    for _ in range(repeat):
        for v, (model, opt) in built.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(model, opt, x)
            rows[v]["times"].append(time.perf_counter() - t0)
    for row in rows.values():
        row["step_s"] = statistics.median(row.pop("times"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    variants = ["bf16", *OURS]
    if common.torchao_nf4() is not None:
        variants.insert(1, "torchao NF4")
    else:
        print("torchao is not installed (pip install --no-deps torchao): its NF4 is skipped")
    missed = []
    for dim in args.dims:
        rows = run(measure, args.world, dim, args.layers, args.tokens, args.repeat, variants, timeout=3600)[0]
        base = rows["bf16"]
        print(
            f"\nQLoRA step, FSDP2 on {args.world} gloo ranks x 1 thread, {args.layers} frozen {dim}x{dim} Linears "
            f"+ LoRA r16, bf16 mixed precision, {args.tokens} tokens/rank, median of {args.repeat} interleaved"
        )
        print(
            f"{'variant':<20}{'step ms':>9}{'x bf16':>8}{'all-gather B':>14}{'x bf16':>8}{'peak MiB':>10}{'x bf16':>8}"
        )
        for v, row in rows.items():
            ratio = row["step_s"] / base["step_s"]
            print(
                f"{v:<20}{row['step_s'] * 1e3:>9.1f}{ratio:>8.2f}"
                f"{row['bytes']:>14,}{row['bytes'] / base['bytes']:>8.3f}"
                f"{row['peak'] / 2**20:>10.1f}{row['peak'] / base['peak']:>8.2f}"
            )
            if v in OURS and v != "Int8Rowwise" and ratio > 1.3:
                missed.append(f"dim {dim} {v}: {ratio:.2f}x bf16")
            if v in OURS and row["peak"] > base["peak"]:
                missed.append(f"dim {dim} {v}: peak {row['peak'] / base['peak']:.2f}x bf16")
        if "torchao NF4" in rows:
            vs = rows["NF4"]["step_s"] / rows["torchao NF4"]["step_s"]
            print(f"NF4 vs torchao NF4: {vs:.2f}x step time")
            if vs >= 1:
                missed.append(f"dim {dim} NF4: {vs:.2f}x torchao's step")
    print(
        "\ntargets (NF4 < torchao NF4, 4-bit <= 1.3x bf16, peak <= bf16):",
        "MISSED " + "; ".join(missed) if missed else "met",
    )


if __name__ == "__main__":
    main()
