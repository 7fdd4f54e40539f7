"""Serve a Hugging Face model tensor-parallel with quantized weights, loading each rank's slices only.

    python examples/hf_tp_inference.py path/to/model --world 2 --format int8
    python examples/hf_tp_inference.py path/to/model --write-tiny llama   # first write a tiny random Llama there
    torchrun --nproc-per-node 2 examples/hf_tp_inference.py path/to/model --format int4:128
    python examples/hf_tp_inference.py path/to/Llama-GPTQ --world 2        # a pre-quantized checkpoint, as stored

``path/to/model`` is a local directory as ``save_pretrained`` writes it
(``config.json`` and ``model.safetensors`` or a sharded index). A directory
whose ``config.json`` has a ``quantization_config`` (compressed-tensors, GPTQ,
AWQ, bitsandbytes NF4, FP8 blocks) is served as stored: without ``--format``
each weight takes the format that holds its layout
(``dq.hf.quantize_like_checkpoint``) and is read without dequantizing; a
dense directory is quantized with ``--format`` (default int8). Every rank:

1. builds the transformers model with its parameters on the meta device
   (``dq.hf.init_empty``: nothing allocated);
2. quantizes its Linear weights (``dq.quantize_``, or like the checkpoint; still meta);
3. applies the model's own tensor-parallel plan (transformers'
   ``_tp_plan``, as torch ParallelStyles: ``dq.hf.tp_plan``);
4. allocates its own shards (``dq.hf.materialize``) and reads its own slices
   of the checkpoint (``dq.hf.load``), quantizing them with the statistics of
   the whole tensors;
5. generates greedily.

Rank 0 then runs the same model on one process and checks that the tokens are
equal; it prints the bytes each rank read against the size of the files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant import parse_format
from dtensor_quant.testing import rank_pool as launch


def model_class(path: Path):
    """The transformers class named by ``config.json`` (``architectures``)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    return config, getattr(transformers, config.architectures[0])


def build(path: Path, fmt, dtype, mesh=None):
    """The model of ``path`` quantized in ``fmt`` and (with a mesh) tensor-parallel, weights loaded."""
    config, cls = model_class(path)
    with dq.hf.init_empty():
        model = cls(config)
    model.to(dtype).eval()
    if fmt is None:  # pre-quantized: each weight in the format that holds the producer's layout, read as stored
        model.chosen = dq.hf.quantize_like_checkpoint(model, path)
    else:
        # An FP8 block-scale checkpoint keeps lm_head dense (as DeepSeek-V3 and Qwen3-FP8 publish it).
        stored = "quantization_config" in config.to_dict() and isinstance(fmt, dq.Float8Blockwise)
        dq.quantize_(model, fmt, filter_fn=lambda m, fqn: not (stored and fqn == "lm_head"))
        model.chosen = {}
    model.tp_switched = {}
    if mesh is not None:  # row-parallel layers the format cannot cut by columns go column-parallel (said below)
        plan, model.tp_switched = dq.adapt_tp_plan(model, dq.hf.tp_plan(model), mesh, kernels=True)
        parallelize_module(model, mesh, plan)
    dq.hf.materialize(model, "cpu")
    start = time.perf_counter()
    result = dq.hf.load(model, path)
    return model, result, time.perf_counter() - start


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding without a KV cache (the whole window each step)."""
    tokens = prompt
    for _ in range(new_tokens):
        logits = model(tokens, use_cache=False).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


def _format(args, path: Path):
    """``--format``; without it: like the checkpoint when it is pre-quantized (None), else int8."""
    if args.format is not None:
        return parse_format(args.format)
    config = json.loads((path / "config.json").read_text())
    return None if "quantization_config" in config else parse_format("int8")


def run(args) -> dict:
    path, dtype = Path(args.model), getattr(torch, args.dtype)
    fmt = _format(args, path)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, result, seconds = build(path, fmt, dtype, mesh)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    tokens = generate(model, prompt, args.tokens)
    out = {"tokens": tokens[0].tolist(), "read": result.bytes_read, "file": result.file_bytes, "seconds": seconds,
           "quantized": len(result.quantized) + len(result.prequantized), "switched": model.tp_switched,
           "stored": len(result.prequantized), "chosen": sorted({str(v) for v in model.chosen.values()})}  # fmt: skip
    single = build(path, fmt, dtype)[0] if dist.get_rank() == 0 else None
    expected = [generate(single, prompt, args.tokens) if single is not None else None]
    dist.broadcast_object_list(expected, src=0)  # every rank decides alike whether to explain a difference
    out["expected"] = expected[0][0].tolist()
    out["near_tie"] = near_tie(model, single, tokens, expected[0])
    return out


@torch.no_grad()
def near_tie(model, single, tokens, expected) -> bool | None:
    """At the first differing token (None: none), on every rank (the TP forward is collective): were the
    one-process logits' top two within twice the largest difference between the two models' logits there?

    TP sums partial products in another order, and the CPU's GEMM picks its own blocking: a near-tie may
    flip on one machine and not on another.
    """
    diff = (tokens != expected).nonzero()
    if diff.numel() == 0:
        return None
    pos = int(diff[:, 1].min())
    prefix = expected[:, :pos]
    got = model(prefix, use_cache=False).logits[0, -1].float()
    tie = [None]
    if single is not None:
        ref = single(prefix, use_cache=False).logits[0, -1].float()
        gap = (ref[expected[0, pos]] - ref[tokens[0, pos]]).item()
        tie = [gap <= 2 * (ref - got).abs().max().item()]
    dist.broadcast_object_list(tie, src=0)
    return tie[0]


def report(args, results: list[dict]) -> bool:
    r = results[0]
    what = args.format or ("like the checkpoint" if r["chosen"] else "int8")
    print(f"{args.model}: {len(results)} ranks, {what}, {args.dtype}, {r['quantized']} quantized weights, "
          f"{r['stored']} read as stored")  # fmt: skip
    for layout in r["chosen"]:
        print(f"  as stored: {layout}")
    for fqn, why in r["switched"].items():
        print(f"{fqn}: column-parallel on a gathered input (dq.adapt_tp_plan): {why}")
    print(f"tokens (rank 0): {r['tokens']}")
    equal = all(x["tokens"] == r["expected"] for x in results)
    print(f"tokens equal to the one-process quantized model on every rank: {equal}")
    if not equal:
        tie = all(x["near_tie"] for x in results)
        print("  the first difference is " + ("a near-tie flipped by rounding" if tie else "NOT a near-tie"))
        equal = tie
    for rank, x in enumerate(results):
        print(f"rank {rank}: read {x['read'] / 2**20:.2f} MiB of {x['file'] / 2**20:.2f} MiB "
              f"({x['read'] / x['file']:.3f}x the files) in {x['seconds']:.2f} s")  # fmt: skip
    return equal


def write_tiny(path: Path, kind: str) -> None:
    """A tiny random model saved with save_pretrained (real MLP width 768, 2 layers)."""
    import transformers

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]  # fmt: skip
    config = config_cls(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model_cls(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="1MB")
    print(f"wrote a tiny {kind} to {path}: {json.dumps(sorted(os.listdir(path)))}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a local Hugging Face model directory")
    ap.add_argument("--world", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    ap.add_argument("--format", help="int8, int4:128, Float8Blockwise, ... (default: like the checkpoint when "
                    "its config.json has a quantization_config, else int8)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                    help="activations; float32 keeps TP's other reduction order "
                         "from flipping near-tied tokens")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--write-tiny", choices=["llama", "qwen2"], help="first write a tiny random model to MODEL")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_tiny:
        write_tiny(Path(args.model), args.write_tiny)
    if not launch.under_torchrun():
        print(f"starting {args.world} local ranks ...", flush=True)
    results = launch.run_script(run, args.world, args)
    ok = report(args, results) if int(os.environ.get("RANK", 0)) == 0 else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
