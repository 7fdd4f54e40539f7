"""dtensor_quant, end to end, on 2 local CPU ranks: serve, fine-tune, checkpoint, reshard.

    python examples/demo.py [--format int4] [--steps 8] [--tokens 16]

One small LLaMA-style model (dtensor_quant/testing/tiny_llama.py, random weights from a seed)
goes through the whole story, each stage against the same thing in bf16
measured in the same run:

1. quantize it and serve it tensor-parallel (torch's ColwiseParallel /
   RowwiseParallel) -- weight bytes per rank, decode tokens/s, and the tokens
   against the model quantized on one process;
2. fine-tune it with QLoRA under FSDP2 -- FSDP2 all-gathers only the stored
   quantized bytes;
3. save the fine-tuned model with torch.distributed.checkpoint under FSDP2's
   layout (rows sharded) and load it under tensor parallelism (rows for
   q/k/v, columns for wo/w2) -- every stored byte must come back.

It prints one summary table at the end; progress is shown while it runs.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import shutil
import sys
import tempfile
import time

# qlora_fsdp2 and tp_inference: the examples beside this one (Python puts a script's folder first on sys.path).
import qlora_fsdp2
import torch
import torch.distributed as dist
import tp_inference
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant import parse_format, wire
from dtensor_quant.lora import lora_parameters, lora_tp_plan
from dtensor_quant.testing import tiny_llama
from dtensor_quant.testing.rank_pool import run

CFG = qlora_fsdp2.CFG  # 2 blocks, dim 256, 8 heads (4 kv), SwiGLU 768, vocab 512
FORMATS = ("int4", "int8", "nf4")  # --format choices, read by parse_format: Int4Groupwise(128), NF4(64, 256)


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def serve(fmt, mesh, tokens: int) -> dict:
    """Stage 1: tensor-parallel greedy decoding, quantized vs bf16, tokens vs one process."""
    prompt = torch.randint(CFG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    window = -(-(8 + tokens) // 2) * 2
    reference = tiny_llama.build(CFG, seed=0)
    dq.quantize_(reference, fmt)
    expected, _ = tp_inference.timed_generate(reference, prompt, tokens, window)
    quantized = tp_inference.build_tp(CFG, fmt, mesh)
    dense = tp_inference.build_tp(CFG, None, mesh)
    got, q_s = tp_inference.timed_generate(quantized, prompt, tokens, window)
    _, d_s = tp_inference.timed_generate(dense, prompt, tokens, window)
    tie = tp_inference.explain_difference(quantized, reference, got, expected, window)
    return {
        "bytes": tp_inference.linear_bytes(quantized),
        "tok_s": (tokens / q_s, tokens / d_s),
        "tokens_match": tie is None,
        "near_tie": tie is not None and tie["near_tie"],
    }


def train(model, steps: int) -> tuple[list[float], wire.WireLog]:
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    world, rank, losses = dist.get_world_size(), dist.get_rank(), []
    with wire.record() as log:
        for step, batch in enumerate(qlora_fsdp2.synthetic_batches(steps, 8, 64), start=1):
            losses.append(tiny_llama.train_step(model, opt, batch.chunk(world)[rank]))
            if rank == 0:
                print(
                    f"\r    step {step}/{steps}  loss {losses[-1]:.3f}", end="\n" if step == steps else "", flush=True
                )
    return losses, log


def finetune(fmt, mesh, steps: int):
    """Stage 2: QLoRA under FSDP2; the bf16 base trained the same way is the baseline for the all-gather."""
    model = qlora_fsdp2.shard(qlora_fsdp2.build(fmt, torch.device("cpu")), mesh)
    losses, log = train(model, steps)
    dense = tiny_llama.build(CFG, seed=0)
    from dtensor_quant.lora import add_lora_

    dense = qlora_fsdp2.shard(add_lora_(dense, rank=16, alpha=32, filter_fn=qlora_fsdp2.in_blocks, seed=1), mesh)
    say("    (the same fine-tuning with a bf16 base, for the all-gather baseline)")
    _, dense_log = train(dense, 2)
    per_step = log.all_gathers().nbytes / steps
    dense_per_step = dense_log.all_gathers().nbytes / 2
    return model, losses, per_step, dense_per_step, log.all_gathers().dtypes()


def reshard(model, fmt, mesh, root: str) -> dict:
    """Stage 3: save under FSDP2's layout, load under tensor parallelism, compare every byte."""
    path = f"{root}/checkpoint"
    start = time.perf_counter()
    dq.checkpoint.save(model, path)
    save_s = time.perf_counter() - start
    target = qlora_fsdp2.build(fmt, torch.device("cpu"), seed=1000)  # every weight differs before loading
    plan = tp_inference.tp_plan(target)
    outside = {k: v for k, v in plan.items() if not k.startswith("layers.")}
    blocks = lora_tp_plan({k: v for k, v in plan.items() if k.startswith("layers.")})  # the LoRA-wrapped Linears
    parallelize_module(target, mesh, {**outside, **blocks})
    dq.checkpoint.load(target, path)
    saved, loaded = dict(model.named_parameters()), dict(target.named_parameters())
    placements = {str(p.placements) for n, p in target.named_parameters() if n.endswith("base.weight")}
    size = sum(f.stat().st_size for f in pathlib.Path(path).glob("*.distcp"))
    return {
        "bit_exact": all(qlora_fsdp2.same_bytes(p, loaded[k]) for k, p in saved.items()),
        "size": size,
        "save_s": save_s,
        "placements": sorted(placements),
    }


def story(fmt_name: str, steps: int, tokens: int, root: str) -> dict:
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    torch.manual_seed(0)
    fmt, mesh = parse_format(fmt_name), init_device_mesh("cpu", (dist.get_world_size(),))
    say(f"[1/3] quantize ({fmt}) and serve tensor-parallel over {mesh.size()} ranks ...")
    served = serve(fmt, mesh, tokens)
    say(f"[2/3] QLoRA fine-tuning under FSDP2, {steps} steps ...")
    model, losses, gathered, dense_gathered, dtypes = finetune(fmt, mesh, steps)
    say("[3/3] checkpoint under FSDP2 (rows sharded), load under tensor parallelism ...")
    saved = reshard(model, fmt, mesh, root)
    return {"served": served, "losses": losses, "gathered": (gathered, dense_gathered), "dtypes": dtypes, **saved}


def table(fmt_name: str, r: dict) -> str:
    s, b = r["served"], r["served"]["bytes"]
    q_tok, d_tok = s["tok_s"]
    match = "yes" if s["tokens_match"] else ("a near-tie flipped by bf16 rounding" if s["near_tie"] else "NO")
    rows = [
        (
            "Linear weight bytes per rank (TP=2)",
            f"{b['quantized'] / 2**20:.2f} MiB",
            f"{b['bf16'] / 2**20:.2f} MiB",
            f"{b['quantized'] / b['bf16']:.3f}x",
        ),
        ("TP decode tokens/s (no KV cache)", f"{q_tok:.1f}", f"{d_tok:.1f}", f"{q_tok / d_tok:.2f}x"),
        ("TP tokens == one-process quantized model", match, "", ""),
        (
            "FSDP2 all-gather bytes per step, whole model*",
            f"{r['gathered'][0] / 2**20:.2f} MiB",
            f"{r['gathered'][1] / 2**20:.2f} MiB",
            f"{r['gathered'][0] / r['gathered'][1]:.3f}x",
        ),
        ("FSDP2 all-gather dtypes", ", ".join(sorted(str(d).removeprefix("torch.") for d in r["dtypes"])), "", ""),
        ("QLoRA loss, first -> last step", f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", "", ""),
        ("checkpoint on disk (whole model)", f"{r['size'] / 2**20:.2f} MiB", "", ""),
        ("FSDP2 -> TP reload, every byte identical", "yes" if r["bit_exact"] else "NO", "", ""),
    ]
    width = max(len(row[0]) for row in rows)
    out = [f"\n{'':<{width}}  {fmt_name:>22}  {'bf16':>12}  {'ratio':>7}"]
    out += [f"{name:<{width}}  {a:>22}  {b_:>12}  {c:>7}" for name, a, b_, c in rows]
    out.append(
        "\n* the block Linears are quantized; embeddings, norms, the output layer and the LoRA adapters stay "
        "bf16 on the wire\n  (blocks with adapters travel as one uint8 buffer: FSDP2 packs mixed dtypes)."
    )
    out.append(
        f"reloaded base weights under TP placements {', '.join(r['placements'])}; bytes are per rank, "
        "measured with dtensor_quant.wire; tokens/s vary with machine load."
    )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=FORMATS, default="int4")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    print(f"dtensor_quant demo: a small LLaMA-style model, {parse_format(args.format)}, on 2 local CPU ranks (gloo)")
    print("starting 2 ranks ...", flush=True)
    root = tempfile.mkdtemp(prefix="dtensor_quant_demo_")
    try:
        result = run(story, 2, args.format, args.steps, args.tokens, root)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(args.format, result))
    ok = result["bit_exact"] and (result["served"]["tokens_match"] or result["served"]["near_tie"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
