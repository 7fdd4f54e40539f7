"""Mixture-of-experts weights: sharding a 3-D expert stack and a MoE layer forward, quantized vs bf16, one run.

    python bench/moe.py [--world 2] [--experts 8] [--hidden 2048] [--inter 768] [--tokens 64] [--repeat 5]

Part 1 (on ``--world`` local gloo ranks): one ``gate_up_proj [E, 2I, H]``
stack in bf16, Int8Rowwise, Int4Groupwise(128) and NF4. For each move --
``distribute_tensor`` over the experts (expert parallelism), ``full_tensor``
from it, expert -> tensor parallel (``Shard(0) -> Shard(1)``), and
``full_tensor`` from tensor parallel -- it records every collective with
``dtensor_quant.wire`` and prints bytes each rank sends and the median time,
both also as a ratio to bf16 measured in the same run.

Part 2 (this process): the forward of a transformers ``MixtralExperts``
layer (top-2 routing of ``--tokens`` tokens) with its own eager loop and
its ``grouped_mm`` path, bf16 weights vs the same weights quantized (bf16
activations: int8/int4 take torch's weight-only kernels, NF4 dequantizes each
expert it runs). Median of ``--repeat`` interleaved runs, ratios to bf16.
Defaults: Qwen3-30B-A3B's expert widths (H 2048, I 768) with 8 experts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.model.format_spec import parse_format
from dtensor_quant.testing.rank_pool import run

# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(128)", "NF4")}}


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


def layer_forward(args):
    """Median seconds of a MixtralExperts forward per (implementation, format), measured interleaved."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts)
    torch.manual_seed(0)
    base = MixtralExperts(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(base.gate_up_proj, std=0.02)
    torch.nn.init.normal_(base.down_proj, std=0.02)
    layers, refused = {}, {}
    for name, fmt in FORMATS.items():
        m = MixtralExperts(cfg).to(torch.bfloat16)
        m.load_state_dict(base.state_dict())
        try:
            layers[name] = m if fmt is None else dq.quantize_(m, fmt)
        except ValueError as e:  # e.g. NF4's scaler blocks on a width whose block count does not divide 256
            refused[name] = str(e).split(": ", 1)[-1][:150]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, generator=g)
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    times = {}
    with torch.no_grad():
        for impl in ("eager", "grouped_mm"):
            for m in layers.values():
                m.config._experts_implementation = impl
                m(x, index, weights)  # warm-up: kernels prepare their packed weights once
            samples = {name: [] for name in layers}
            for _ in range(args.repeat):  # interleaved: background load hits every format alike
                for name, m in layers.items():
                    m.config._experts_implementation = impl
                    t0 = time.perf_counter()
                    m(x, index, weights)
                    samples[name].append(time.perf_counter() - t0)
            for name in layers:
                times[(impl, name)] = statistics.median(samples[name])
    nbytes = {name: sum((p.nbytes_stored if isinstance(p, dq.QuantizedTensor) else p.numel() * 2)
                        for p in m.parameters()) for name, m in layers.items()}  # fmt: skip
    return times, nbytes, refused


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    shape = (args.experts, 2 * args.inter, args.hidden)

    rows = run(shard_moves, args.world, shape, args.repeat)[0]  # rank 0's view
    print(f"gate_up_proj {shape} bf16 over {args.world} gloo ranks, median of {args.repeat}")
    print(f"{'move':<33}{'format':<20}{'bytes/rank':>12}{'x bf16':>8}{'ms':>9}{'x bf16':>8}  wire dtypes")
    for label in dict.fromkeys(r[0] for r in rows):
        base = next(r for r in rows if r[0] == label and r[1] == "bf16")
        for _, name, nbytes, dtypes, seconds in (r for r in rows if r[0] == label):
            ratio = f"{nbytes / base[2]:.3f}" if base[2] else "-"
            print(f"{label:<33}{name:<20}{nbytes:>12,}{ratio:>8}{seconds * 1e3:>9.2f}{seconds / base[4]:>8.2f}  "
                  + ", ".join(dtypes))  # fmt: skip

    times, nbytes, refused = layer_forward(args)
    print()
    print(f"MixtralExperts forward: {args.experts} experts, H {args.hidden}, I {args.inter}, "
          f"{args.tokens} tokens top-2, "
          f"bf16 activations, 1 process, median of {args.repeat} interleaved")  # fmt: skip
    print(f"{'experts impl':<14}{'format':<20}{'weight bytes':>14}{'x bf16':>8}{'ms':>9}{'x bf16':>8}")
    for impl in ("eager", "grouped_mm"):
        for name in FORMATS:
            if name in refused:
                print(f"{impl:<14}{name:<20}  not quantizable here: {refused[name]}")
                continue
            t, b = times[(impl, name)], nbytes[name]
            print(
                f"{impl:<14}{name:<20}{b:>14,}{b / nbytes['bf16']:>8.3f}"
                f"{t * 1e3:>9.2f}{t / times[(impl, 'bf16')]:>8.2f}"
            )


if __name__ == "__main__":
    main()
