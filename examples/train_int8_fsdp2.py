"""Train a small LLaMA from scratch with int8 weights and 8-bit AdamW under FSDP2, save, resume on another world size.

    python examples/train_int8_fsdp2.py [--ranks 2] [--resume-ranks 3] [--steps 40] [--out /tmp/train_int8_fsdp2]

Builds the model of dtensor_quant/testing/tiny_llama.py in bf16 and makes every Linear of its
blocks a trainable int8 weight (``dq.quantize_(..., trainable=True)``: the
parameters *are* int8 codes with a bf16 scale per row; there is no bf16
master copy). Each block is an FSDP2 unit over ``--ranks`` local processes
(gloo on CPU, NCCL when every rank has a GPU), so the all-gathers move the
int8 bytes. ``dq.optim.AdamW8bit`` keeps both moments in 8 bits
(BlockFloat8) as DTensors sharded like their parameters, and updates each
int8 weight with one stochastically rounded requantization per step.

It trains on synthetic data (token sequences that follow a fixed random
successor table), writes the loss of every step to ``OUT/loss.csv``, and
after ``--steps`` saves the model and the optimizer -- int8 weights, 8-bit
moments, each weight's stochastic-rounding count -- as a sharded
torch.distributed.checkpoint in ``OUT/checkpoint`` (dtensor_quant.checkpoint:
atomic, reshardable). Then it starts ``--resume-ranks`` fresh processes,
loads the checkpoint into a model and optimizer built for that world size,
checks that every weight and every moment holds the saved bytes, and trains
``--resume-steps`` more steps from there.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import rank_pool as launch
from dtensor_quant.testing import tiny_llama

CFG = tiny_llama.Config(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=768, max_seq_len=128)
BATCH, SEQ = 12, 64  # 12 sequences a step, split over 1, 2, 3, 4 or 6 ranks


def in_blocks(module, fqn: str) -> bool:
    return fqn.startswith("layers.")


def build(mesh, device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model from scratch (the same on every rank and world size), int8 blocks, FSDP2, 8-bit AdamW."""
    model = tiny_llama.build(CFG, seed=0, dtype=torch.bfloat16).to(device)
    dq.quantize_(model, dq.Int8Rowwise(), filter_fn=in_blocks, trainable=True, seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dq.optim.AdamW8bit(model.parameters(), lr=3e-3, weight_decay=0.01)


def batches(first: int, last: int):
    """Steps ``first..last - 1`` of one fixed stream of batches (a resumed run continues the same stream)."""
    stream = tiny_llama.synthetic_batches(last, BATCH, SEQ, CFG.vocab_size, noise=0.1, seed=0)
    for step, tokens in enumerate(stream):
        if step >= first:
            yield step, tokens


def train(model, opt, first: int, last: int, log=None) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, start = [], time.perf_counter()
    for step, tokens in batches(first, last):
        tokens = tokens.chunk(world)[rank].to(next(model.parameters()).device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0:
            done = step + 1 - first
            rate = (time.perf_counter() - start) / done
            print(f"\r  step {step + 1}/{last}  loss {losses[-1]:.4f}  {rate:.2f} s/step", end="", flush=True)
            if log is not None:
                log.write(f"{step + 1},{losses[-1]:.6f}\n")
    if rank == 0:
        print()
    return losses


def snapshot(model, opt) -> list[torch.Tensor]:
    """Every weight and moment as whole bytes (a full gather of each): what must survive the round trip."""
    out = []
    with torch.no_grad():
        for p in model.parameters():
            for t in (p, *(v for k, v in opt.state[p].items() if k != "step")):
                if not isinstance(t, torch.Tensor):
                    continue
                full = t.full_tensor() if isinstance(t, DTensor) else t
                inner = full.inner.values() if isinstance(full, dq.QuantizedTensor) else [full]
                out += [i.contiguous().view(torch.uint8).clone() for i in inner]
    return out


def device_and_mesh():
    world = dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if launch.device_type(world) == "cuda"
        else torch.device("cpu")
    )
    return device, init_device_mesh(device.type, (world,))


def first_run(out: str, steps: int) -> dict:
    device, mesh = device_and_mesh()
    model, opt = build(mesh, device)
    if dist.get_rank() == 0:
        print(f"training from scratch on {dist.get_world_size()} ranks: int8 weights, 8-bit AdamW")
    with open(pathlib.Path(out) / "loss.csv", "w") if dist.get_rank() == 0 else _Null() as log:
        if dist.get_rank() == 0:
            log.write("step,loss\n")
        losses = train(model, opt, 0, steps, log)
    model_sd, optim_sd = get_state_dict(model, opt)
    dq.checkpoint.save({"model": model_sd, "optim": optim_sd}, pathlib.Path(out) / "checkpoint")
    local = [p.to_local() for p in model.parameters()]
    weight = sum(t.nbytes_stored if isinstance(t, dq.QuantizedTensor) else t.numel() * t.element_size() for t in local)
    return {"losses": losses, "saved": snapshot(model, opt), "weight_bytes": weight}


def resume(out: str, steps: int, more: int) -> dict:
    device, mesh = device_and_mesh()
    model, opt = build(mesh, device)
    model_sd, optim_sd = get_state_dict(model, opt)  # the layout to load into: this world size's shards
    dq.checkpoint.load({"model": model_sd, "optim": optim_sd}, pathlib.Path(out) / "checkpoint")
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = snapshot(model, opt)
    if dist.get_rank() == 0:
        print(f"resumed on {dist.get_world_size()} ranks")
    losses = train(model, opt, steps, steps + more)
    return {"loaded": loaded, "losses": losses}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, text):
        pass


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--resume-ranks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--resume-steps", type=int, default=10)
    ap.add_argument("--out", default="/tmp/train_int8_fsdp2")
    args = ap.parse_args(argv)
    if BATCH % args.ranks or BATCH % args.resume_ranks:
        raise SystemExit(f"--ranks and --resume-ranks must divide the batch of {BATCH} sequences")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    first = launch.run_script(first_run, args.ranks, args.out, args.steps)[0]
    second = launch.run_script(resume, args.resume_ranks, args.out, args.steps, args.resume_steps)[0]
    identical = len(first["saved"]) == len(second["loaded"]) and all(
        torch.equal(a, b) for a, b in zip(first["saved"], second["loaded"])
    )
    print(
        f"\nloss {first['losses'][0]:.3f} -> {first['losses'][-1]:.3f} in {args.steps} steps on {args.ranks} ranks; "
        f"{second['losses'][-1]:.3f} after {args.resume_steps} more on {args.resume_ranks}"
    )
    print(f"weights on rank 0: {first['weight_bytes'] / 2**20:.2f} MiB (int8 blocks, bf16 embeddings and norms)")
    print(f"resumed on {args.resume_ranks} ranks with every weight and moment byte-identical: {identical}")
    if not identical:
        raise SystemExit("the resumed model differs from the saved one")
    return {"losses": first["losses"], "resumed": second["losses"], "identical": identical}


if __name__ == "__main__":
    main()
