"""QLoRA fine-tuning of the small LLaMA-style model with FSDP2 across N local ranks.

    python examples/qlora_fsdp2.py [--ranks 2] [--format int4] [--steps 30] [--out /tmp/qlora_fsdp2]
    python examples/qlora_fsdp2.py --hf path/to/hf_model     # a transformers model from its HF directory

Builds the model of dtensor_quant/testing/tiny_llama.py in bf16, quantizes every Linear of its
blocks (frozen; Int4Groupwise(128) or Int8Rowwise), adds rank-16 LoRA
adapters with fp32 masters, and shards each block with FSDP2 (bf16 mixed
precision, fp32 gradient reduction) over ``--ranks`` local processes: gloo
on CPU, NCCL when every rank has a GPU. FSDP2 all-gathers only the stored
quantized bytes of the base weights (see docs/fsdp.md).

It fine-tunes on synthetic data (sequences that follow a fixed random
successor table, so the loss has something to learn) with a progress bar,
writes the loss of every step to ``OUT/loss.csv``, and at the end saves the
whole fine-tuned model -- the quantized base as its stored bytes, the trained
adapters -- as a sharded torch.distributed.checkpoint in ``OUT/checkpoint``
(dtensor_quant.checkpoint: atomic, reshardable, see docs/checkpoint.md),
then loads it into a fresh model whose every weight differs and checks that
every byte came back.

With ``--hf DIR`` the base is a transformers model read from a local Hugging
Face directory: built on the meta device, quantized, then each rank reads its
checkpoint slices with ``dq.hf.load`` (docs/huggingface.md); at the end the
fine-tuned model is also exported with the adapters merged, as a Hugging Face
directory in ``OUT/hf`` that ``from_pretrained`` reads (``dq.hf.save``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import dtensor_quant as dq
from dtensor_quant import parse_format
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.lora import add_lora_, lora_parameters
from dtensor_quant.testing import rank_pool as launch
from dtensor_quant.testing import same_bits, tiny_llama

CFG = tiny_llama.Config(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=768, max_seq_len=128)
FORMATS = ("int4", "int8")  # --format choices, read by parse_format: int4 is Int4Groupwise(128)


def in_blocks(module, fqn: str) -> bool:
    return fqn.startswith(("layers.", "model.layers."))  # tiny_llama's blocks, or a transformers model's


def build(fmt: dq.QuantFormat, device: torch.device, seed: int = 0, hf: str | None = None) -> torch.nn.Module:
    """The pretrained-stand-in base (``seed``, or the HF model in ``hf``), quantized and frozen, with fresh adapters.

    The adapters come from ``seed + 1``. A Hugging Face base is built on the meta device and quantized there,
    then every rank reads the checkpoint (each weight quantized with the statistics of the whole tensor).
    """
    if hf is None:
        model = tiny_llama.build(CFG, seed=seed, dtype=torch.bfloat16).to(device)
        dq.quantize_(model, fmt, filter_fn=in_blocks)
    else:
        import transformers

        config = transformers.AutoConfig.from_pretrained(hf)
        with dq.hf.init_empty():
            model = getattr(transformers, config.architectures[0])(config)
        model.to(torch.bfloat16)
        dq.quantize_(model, fmt, filter_fn=in_blocks)
        dq.hf.materialize(model, device)
        dq.hf.load(model, hf)
    return add_lora_(model, rank=16, alpha=32, filter_fn=in_blocks, seed=seed + 1)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (possibly sharded, possibly quantized) parameters hold the same bytes."""
    a = a.full_tensor() if isinstance(a, DTensor) else a
    b = b.full_tensor() if isinstance(b, DTensor) else b
    if isinstance(a, dq.QuantizedTensor) or isinstance(b, dq.QuantizedTensor):
        quantized = isinstance(a, dq.QuantizedTensor) and isinstance(b, dq.QuantizedTensor)
        return quantized and a.fmt == b.fmt and all(same_bits(a.inner[n], t) for n, t in b.inner.items())
    return same_bits(a, b)


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers if hasattr(model, "layers") else model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def synthetic_batches(steps: int, batch: int, seq: int, seed: int = 0, vocab: int = CFG.vocab_size):
    return tiny_llama.synthetic_batches(steps, batch, seq, vocab, noise=0.1, seed=seed)


def progress(step: int, steps: int, loss: float, seconds: float) -> None:
    done = int(30 * step / steps)
    bar = "#" * done + "." * (30 - done)
    end = "\n" if step == steps else ""
    print(f"\r[{bar}] step {step}/{steps}  loss {loss:.4f}  {seconds / step:.2f} s/step", end=end, flush=True)


def finetune(
    fmt_name: str, steps: int, batch: int, seq: int, lr: float, out: str, hf: str | None = None
) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if launch.device_type(world) == "cuda"
        else torch.device("cpu")
    )
    mesh = init_device_mesh(device.type, (world,))
    model = shard(build(parse_format(fmt_name), device, hf=hf), mesh)
    vocab = model.config.vocab_size if hf else CFG.vocab_size
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=lr)
    if rank == 0:
        n_lora = sum(p.numel() for p in lora_parameters(model).values())
        print(f"QLoRA {fmt_name} over {world} ranks ({device.type}): {n_lora:,} trainable adapter parameters")
        os.makedirs(out, exist_ok=True)
        log = open(os.path.join(out, "loss.csv"), "w")
        log.write("step,loss\n")
    losses, start = [], time.perf_counter()
    for step, tokens in enumerate(synthetic_batches(steps, batch, seq, vocab=vocab), start=1):
        losses.append(tiny_llama.train_step(model, opt, tokens.chunk(world)[rank].to(device)))
        if rank == 0:
            log.write(f"{step},{losses[-1]:.6f}\n")
            progress(step, steps, losses[-1], time.perf_counter() - start)
    if rank == 0:
        log.close()

    # Save the whole model -- quantized base as stored bytes, trained adapters -- then load it
    # into a fresh model built from another seed (every weight differs) and compare every byte.
    path = os.path.join(out, "checkpoint")
    dq.checkpoint.save(model, path)
    fresh = shard(build(parse_format(fmt_name), device, seed=1000, hf=hf), mesh)
    dq.checkpoint.load(fresh, path)
    trained, reloaded = dict(model.named_parameters()), dict(fresh.named_parameters())
    same = all(same_bytes(p, reloaded[k]) for k, p in trained.items())
    if rank == 0:
        size = sum(f.stat().st_size for f in pathlib.Path(path).glob("*.distcp"))
        print(
            f"saved the model to {path} ({size / 2**20:.1f} MiB, DCP); reloaded into a fresh model: "
            f"{'every byte identical' if same else 'DIFFERENT'}"
        )
        print(f"loss log: {os.path.join(out, 'loss.csv')}")
    assert same, "the reloaded model differs from the saved one"
    if hf:  # the fine-tuned model for any consumer: adapters merged, dense bf16, each rank writing its slices
        dq.hf.save(model, os.path.join(out, "hf"))
        if rank == 0:
            print(f"exported the fine-tuned model (adapters merged) to {os.path.join(out, 'hf')} (Hugging Face)")
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--format", choices=FORMATS, default="int4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default="/tmp/qlora_fsdp2")
    ap.add_argument("--hf", default=None, help="a local Hugging Face model directory to fine-tune instead")
    args = ap.parse_args(argv)
    if args.batch % args.ranks:
        ap.error(f"--batch {args.batch} must split evenly over --ranks {args.ranks}")
    losses = launch.run(
        finetune, args.ranks, args.format, args.steps, args.batch, args.seq, args.lr, args.out, args.hf, timeout=3600
    )[0]
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    return losses


if __name__ == "__main__":
    main()
