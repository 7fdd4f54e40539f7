"""Tensor-parallel greedy decoding of a small LLaMA-style model with quantized weights.

    python examples/tp_inference.py --world 2 --format int4:128
    python examples/tp_inference.py --world 4 --format int8 --sequence-parallel --compile aot_eager
    torchrun --nproc-per-node 2 examples/tp_inference.py --format int8

The model is dtensor_quant/testing/tiny_llama.py's (RMSNorm, RoPE, grouped-query attention,
SwiGLU), built from a seed: nothing is downloaded. Its Linear weights are
quantized with ``dtensor_quant.quantize_`` and the model is sharded with
torch's own ParallelStyles in torchtitan's plan (attention and MLP inputs
column-parallel, their outputs row-parallel, optionally sequence-parallel
norms), over N local ranks: gloo on CPU, NCCL when every rank has a GPU.

It generates greedily and checks the tokens against the same model quantized
on one process, then prints tokens/s and the weight bytes each rank holds,
against the same model in bf16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import dtensor_quant as dq
from dtensor_quant import parse_format, quantized_fqns, weight_bytes
from dtensor_quant.testing import rank_pool as launch
from dtensor_quant.testing import record_paths, tiny_llama


def tp_plan(model: tiny_llama.Transformer, sequence_parallel: bool = False) -> dict:
    """torchtitan's plan: q/k/v and w1/w3 column-parallel, wo and w2 row-parallel, logits replicated.

    With ``sequence_parallel`` the residual stream between blocks stays sharded
    along the sequence: norms run on sequence shards and each block gathers
    its input (PrepareModuleInput) and reduce-scatters its output.
    """
    sp = sequence_parallel
    row_out = {"output_layouts": Shard(1)} if sp else {}
    plan = {"output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())}
    if sp:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        if sp:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
            plan[p + "attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan[p + "feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[p + name] = ColwiseParallel()
        plan[p + "attention.wo"] = RowwiseParallel(**row_out)
        plan[p + "feed_forward.w2"] = RowwiseParallel(**row_out)
    return plan


def build_tp(cfg, fmt, mesh, *, seed=0, dtype=torch.bfloat16, quantize_first=True, sequence_parallel=False):
    """The model quantized (``fmt`` None: left dense) and tensor-parallel over ``mesh``.

    ``quantize_first`` quantizes the full weights and lets parallelize_module
    shard the quantized tensors; otherwise the dense DTensor weights are
    quantized shard by shard after sharding. Both give the same bytes.

    A row-parallel layer whose format cannot cut its columns at this degree
    (NF4's down-projection at TinyLlama's widths), or whose column shards its
    kernel could not run on (NF4's ``wo``), is made column-parallel with a
    gathered input (``dq.adapt_tp_plan``); ``model.tp_switched`` maps each
    such layer to the reason.
    """
    model = tiny_llama.build(cfg, seed, dtype).to(mesh.device_type)
    model.freqs = model.freqs.to(mesh.device_type)
    if fmt is not None and quantize_first:
        dq.quantize_(model, fmt)
    plan, model.tp_switched = dq.adapt_tp_plan(model, tp_plan(model, sequence_parallel), mesh, fmt, kernels=True)
    parallelize_module(model, mesh, plan)
    if fmt is not None and not quantize_first:
        dq.quantize_(model, fmt)
    return model


def timed_generate(model, prompt, new_tokens, pad_to_multiple=1):
    """Tokens and seconds of a second generate (the first builds kernel caches / compiles)."""
    tiny_llama.generate(model, prompt, 1, pad_to_multiple)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    tokens = tiny_llama.generate(model, prompt, new_tokens, pad_to_multiple)
    return tokens, time.perf_counter() - start


def run(args) -> dict:
    """One rank's part: TP quantized, TP bf16 and single-process quantized runs."""
    world, device = dist.get_world_size(), "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    cfg, fmt = tiny_llama.Config(n_layers=args.layers), parse_format(args.format)
    dtype = getattr(torch, args.dtype)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    # Every step runs one fixed, padded window (a causal model ignores the padding after its last
    # token): DTensor then propagates shardings once instead of for every new sequence length, which
    # would dominate the time, and sequence parallelism gets the even split it needs.
    window = args.prompt_len + args.tokens
    pad = -(-window // world) * world

    reference = tiny_llama.build(cfg, args.seed, dtype).to(device)
    reference.freqs = reference.freqs.to(device)
    dq.quantize_(reference, fmt)
    expected, ref_s = timed_generate(reference, prompt, args.tokens, pad)

    kwargs = dict(
        seed=args.seed, dtype=dtype, quantize_first=not args.quantize_after, sequence_parallel=args.sequence_parallel
    )
    model = build_tp(cfg, fmt, mesh, **kwargs)
    dense = build_tp(cfg, None, mesh, **kwargs)
    if args.compile != "none":  # both, so that tokens/s compare like with like
        model, dense = (torch.compile(m, backend=args.compile) for m in (model, dense))
    with record_paths() as paths:  # which path each quantized matmul took: the format's kernel, or dequantize + mm
        tokens, tp_s = timed_generate(model, prompt, args.tokens, pad)
    _, dense_s = timed_generate(dense, prompt, args.tokens, pad)
    n = args.tokens * args.batch
    return {
        "match": torch.equal(tokens, expected),
        "tie": explain_difference(model, reference, tokens, expected, pad),
        "tokens": tokens[0, args.prompt_len :].tolist(),
        "tok_s": {"tp_quantized": n / tp_s, "tp_dense": n / dense_s, "one_process_quantized": n / ref_s},
        "bytes": linear_bytes(model),
        "switched": model.tp_switched,
        "paths": dict(paths),
        "rows_per_matmul": args.batch * pad,
    }


def linear_bytes(model) -> dict:
    """This rank's bytes for the quantized Linear weights, the same weights in bf16, and all parameters."""
    quantized = [model.get_parameter(n) for n in quantized_fqns(model)]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in quantized]
    return {
        "quantized": sum(t.nbytes_stored for t in local),
        "bf16": sum(2 * t.numel() for t in local),
        "all_parameters": weight_bytes(model),
    }


# A different reduction order rounds logits differently (bf16 partial sums are rounded before the
# all-reduce); that may flip the argmax of two logits within rounding of each other. More than
# this, relative to the largest logit, is not rounding (bf16 keeps 8 bits: 2**-8 per rounding).
ROUNDING_BOUND = 2**-5


@torch.no_grad()
def explain_difference(model, reference, tokens, expected, pad_to_multiple=1) -> dict | None:
    """At the first differing token: is it a near-tie that rounding explains? (None: no difference.)

    Runs both models on the common prefix; the TP model's pick was the reference's runner-up
    within twice the largest logit difference between the two models, and that difference
    is within rounding of the logits' size.
    """
    diff = (tokens != expected).nonzero()
    if diff.numel() == 0:
        return None
    pos = int(diff[:, 1].min())
    row = int(diff[diff[:, 1] == pos][0, 0])
    prefix = F.pad(expected[:, :pos], (0, -pos % pad_to_multiple))
    ref, tp = reference(prefix)[:, pos - 1].float(), model(prefix)[:, pos - 1].float()
    noise = (ref - tp).abs().max().item()
    gap = (ref[row, expected[row, pos]] - ref[row, tokens[row, pos]]).item()
    scale = ref.abs().max().item()
    return {
        "position": pos,
        "row": row,
        "gap": gap,
        "noise": noise,
        "scale": scale,
        "near_tie": gap <= 2 * noise and noise <= ROUNDING_BOUND * scale,
    }


def report(args, results: list[dict]) -> bool:
    world, r = len(results), results[0]
    print(
        f"{world} ranks, {args.format}, {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.tokens} new tokens"
        + (", sequence-parallel" if args.sequence_parallel else "")
        + (f", compiled ({args.compile})" if args.compile != "none" else "")
    )
    if r["switched"]:
        print(
            f"column-parallel with a gathered input instead of row-parallel at TP {world}: "
            + "".join(f"\n  {fqn}: {why}" for fqn, why in r["switched"].items())
        )
    print(f"tokens (rank 0): {r['tokens']}")
    equal = all(x["match"] for x in results)
    print(f"tokens equal to the one-process quantized model on every rank: {equal}")
    ok = equal or all(x["tie"]["near_tie"] for x in results)
    if not equal:
        t = r["tie"]
        print(
            f"  first difference at position {t['position']} (row {t['row']}): the one-process model's top two "
            f"logits differ by {t['gap']:.4f}; the TP logits differ from it by up to {t['noise']:.4f} "
            f"(logits up to {t['scale']:.2f}): " + ("a near-tie flipped by rounding" if ok else "NOT rounding")
        )
    t = r["tok_s"]
    speedup = t["tp_quantized"] / t["tp_dense"]
    print(
        f"tokens/s (no KV cache, {args.prompt_len + args.tokens}-token window): TP quantized "
        f"{t['tp_quantized']:.1f}, TP {args.dtype} {t['tp_dense']:.1f} (quantized {speedup:.2f}x as fast), "
        f"one-process quantized {t['one_process_quantized']:.1f}"
    )
    print(describe_paths(r["paths"], r["rows_per_matmul"], slow=speedup < 1))
    for rank, x in enumerate(results):
        b = x["bytes"]
        print(
            f"rank {rank}: Linear weights {b['quantized'] / 2**20:.2f} MiB quantized vs {b['bf16'] / 2**20:.2f} MiB "
            f"in bf16 ({b['quantized'] / b['bf16']:.3f}x); all parameters {b['all_parameters'] / 2**20:.2f} MiB "
            f"(embedding and norms stay {args.dtype})"
        )
    return ok


def describe_paths(paths: dict, rows: int, slow: bool) -> str:
    """Rank 0's quantized matmuls by path, and, where quantized is slower than dense, what that path costs."""
    kernel = sum(n for (_, path), n in paths.items() if path == "kernel")
    dequant = {fmt: n for (fmt, path), n in paths.items() if path == "dequantize"}
    line = f"quantized matmuls on rank 0 ({rows} rows each): {kernel} through the format's kernel, " + (
        f"{sum(dequant.values())} dequantized ({', '.join(f'{f}: {n}' for f, n in dequant.items())})"
        if dequant
        else "none dequantized"
    )
    if not slow:
        return line
    if dequant:
        why = (
            "each dequantized matmul decodes the whole weight every step (no kernel for this format, dtype, "
            "orientation or layout: see docs/performance.md); that, not the kernels, is what is slow"
        )
    else:
        why = (
            "every matmul ran a kernel, yet dense is faster: each rank's weights of this small model stay in "
            "cache, so bf16 is not waiting on memory, and a kernel's own cost (decoding every weight it uses, "
            "dispatch) shows; at real widths (bench/prefill.py, docs/performance.md) the kernels match bf16"
        )
    return f"{line}\n  quantized slower than dense: {why}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    ap.add_argument("--format", default="int4:128", help="int8, int4, int4:64, ... (default int4:128)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--quantize-after", action="store_true", help="parallelize first, then quantize the shards")
    ap.add_argument("--compile", default="none", choices=["none", "aot_eager", "inductor"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not launch.under_torchrun():
        print(f"starting {args.world} local ranks ...", flush=True)
    results = launch.run_script(run, args.world, args)
    ok = report(args, results) if int(os.environ.get("RANK", 0)) == 0 else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
