"""Training with quantized all-gathers of trainable weights: loss curves and bytes vs bf16, one run.

    python bench/fsdp_gather_quantized.py [--world 2] [--steps 50] [--plot docs/fsdp_gather_quantized.png]

Trains the small LLaMA of dtensor_quant/testing/tiny_llama.py from scratch on synthetic data
(a noisy successor table, so the loss can fall) under FSDP2 with bf16 mixed
precision and fp32 masters, three times from the same seed: the plain bf16
all-gather, and every Linear of the blocks wrapped by
dtensor_quant.gather_quantized_ with Int8Rowwise and with Int4Groupwise(32)
(quantized from the bf16 copy of the master, scales in bf16). Prints both
curves step by step, the all-gather bytes per step, and how far each
quantized curve is from bf16. With matplotlib (the ``bench`` extra),
``--plot`` draws the curves.
"""

from __future__ import annotations

import argparse
import time

import common
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from dtensor_quant import wire
from dtensor_quant._fsdp.gather_quantized import gather_quantized_
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import tiny_llama
from dtensor_quant.testing.rank_pool import run

CFG = tiny_llama.Config(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=768, max_seq_len=64)
# The labels (table rows, CSV values) are format specs, read by parse_format.
FORMATS = {"bf16": None, **{s: parse_format(s) for s in ("Int8Rowwise", "Int4Groupwise(32)")}}
BATCH, SEQ, LR = 16, 64, 3e-3


def train(fmt_name: str, steps: int):
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_llama.build(CFG, seed=0, dtype=torch.float32)
    if FORMATS[fmt_name] is not None:
        gather_quantized_(
            model, FORMATS[fmt_name], quant_dtype=torch.bfloat16, filter_fn=lambda m, n: n.startswith("layers.")
        )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, layer_bytes, t0 = [], [], time.perf_counter()
    for tokens in tiny_llama.synthetic_batches(steps, BATCH, SEQ, CFG.vocab_size, noise=0.2):
        with wire.record() as log:
            losses.append(tiny_llama.train_step(model, opt, tokens.chunk(world)[rank]))
        # the blocks' all-gathers (the root unit holds embeddings, norm and output, never wrapped)
        layer_bytes.append(sum(t.nbytes for t in log.all_gathers().transfers[1:]))
    return (
        losses,
        layer_bytes[-1],
        sorted({str(t.dtype) for t in log.all_gathers().transfers[1:]}),
        time.perf_counter() - t0,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    results = {name: run(train, args.world, name, args.steps, timeout=3600)[0] for name in FORMATS}
    base_losses, base_bytes = results["bf16"][0], results["bf16"][1]
    print(
        f"small LLaMA (dim {CFG.dim}, {CFG.n_layers} layers), FSDP2 on {args.world} ranks, bf16 mixed precision, "
        f"AdamW lr {LR}, batch {BATCH}x{SEQ}, {args.steps} steps"
    )
    print(f"{'step':>5}" + "".join(f"{name:>20}" for name in FORMATS))
    for i in range(args.steps):
        print(f"{i:>5}" + "".join(f"{results[name][0][i]:>20.4f}" for name in FORMATS))
    print(
        f"\n{'format':<20}{'block all-gather B/step':>24}{'x bf16':>8}"
        f"{'mean |dloss|':>14}{'final (last 5)':>16}{'x bf16':>8}  wire"
    )
    base_final = sum(base_losses[-5:]) / 5
    for name, (losses, nbytes, dtypes, _seconds) in results.items():
        diff = sum(abs(a - b) for a, b in zip(losses, base_losses)) / len(losses)
        final = sum(losses[-5:]) / 5
        print(
            f"{name:<20}{nbytes:>24,}{nbytes / base_bytes:>8.3f}{diff:>14.4f}{final:>16.4f}"
            f"{final / base_final:>8.3f}  {', '.join(d.replace('torch.', '') for d in dtypes)}"
        )
    if args.plot:
        plot(results, args.plot, args.world)


def plot(results, path, world):
    plt = common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, (losses, *_rest) in results.items():
        label = "bf16 all-gather" if name == "bf16" else f"{name} all-gather"
        ax.plot(range(len(losses)), losses, label=label, lw=1.4 if name == "bf16" else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"FSDP2 ({world} ranks), trainable weights all-gathered quantized vs bf16", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
