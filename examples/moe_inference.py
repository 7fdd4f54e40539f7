"""Serve a tiny transformers mixture-of-experts model with quantized experts sharded over local ranks.

    python examples/moe_inference.py --world 2 --model mixtral --format int8
    python examples/moe_inference.py --world 4 --model qwen3_moe --format nf4:64,64
    python examples/moe_inference.py --world 4 --tp 2 --format int4:64     # 2 expert groups x 2-way TP

The model is a real transformers 5 ``MixtralForCausalLM`` or
``Qwen3MoeForCausalLM`` built from a small config and a seed (nothing is
downloaded). ``dtensor_quant.quantize_`` quantizes its Linears and its fused
expert stacks ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; the
expert stacks are then distributed as DTensors over an ``ep`` mesh dim with
``Shard(0)``: each rank holds whole experts, as quantized bytes (an uneven
expert count leaves some ranks with fewer). With ``--tp`` each expert is
also sharded over a ``tp`` mesh dim: ``gate_up_proj`` by
``_StridedShard(1, split_factor=2)`` (rank ``j`` holds gate chunk ``j`` and
up chunk ``j``, so SwiGLU runs locally) and ``down_proj`` by ``Shard(2)``
(its partial outputs are summed over ``tp``). Everything else is replicated.

Routing: every rank computes the router on all tokens, then handles its
slice of the tokens. Dispatch and combine are ``torch.distributed.
all_to_all_single`` with per-rank split sizes (after one small all-to-all of
the counts): torch's own variable-size all-to-all, the collective
torchtitan's expert parallelism uses, available on gloo and NCCL. Each
routed token row crosses the wire once to the rank owning its expert and
once back; nothing else moves but the final all-gather of the token slices.
(``torch.distributed._functional_collectives.all_to_all_single`` is the same
collective for traced code; the eager in-place form keeps this example short.)
The owner runs each local expert once on all rows routed to it, through the
library's weight-only kernels on the selected quantized expert. The origin
adds the weighted expert outputs in ascending expert order, as the model's own
eager loop does, so with expert parallelism alone the logits are
bit-identical to one process. Tensor parallelism sums partial products in
another order (which the CPU's GEMM also picks), so its logits are checked to
be close and its tokens to be equal -- or, where one differs, to be a near-tie
of the one-process logits that their measured difference explains.
"""

from __future__ import annotations

import argparse
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import dtensor_quant as dq
from dtensor_quant import parse_format, weight_bytes


def tiny_moe(kind: str = "mixtral", dtype=torch.bfloat16, seed: int = 0, experts: int = 4):
    """A 2-layer transformers Mixtral or Qwen3-MoE (real model classes, tiny widths, ``experts`` experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64}  # fmt: skip
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=128, num_local_experts=experts, **common))
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(moe_intermediate_size=128, intermediate_size=256, num_experts=experts, head_dim=16,
                             decoder_sparse_step=1, mlp_only_layers=[], **common)  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {kind!r}: mixtral or qwen3_moe")
    return model.to(dtype).eval()


def experts_modules(model):
    """The fused-experts modules (transformers 5: one per MoE layer, holding gate_up_proj and down_proj)."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def shard_experts(model, mesh) -> None:
    """Experts over mesh dim ``ep`` (Shard(0)); inside each expert over ``tp`` when the mesh has it."""
    tp = "tp" in (mesh.mesh_dim_names or ())
    for m in experts_modules(model):
        plans = {
            "gate_up_proj": [Shard(0)] + ([_StridedShard(1, split_factor=2)] if tp else []),
            "down_proj": [Shard(0)] + ([Shard(2)] if tp else []),
        }
        for name, placements in plans.items():
            w = getattr(m, name).detach()
            dq.check_placements(w.shape, w.fmt, mesh.shape, placements)  # a clear error on every rank first
            setattr(m, name, torch.nn.Parameter(distribute_tensor(w, mesh, placements), requires_grad=False))
        m.forward = types.MethodType(expert_parallel_forward, m)
        m.ep_group, m.tp_group = mesh.get_group("ep"), mesh.get_group("tp") if tp else None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts module's forward with its experts on other ranks: dispatch, compute, combine.

    ``hidden_states [T, H]``, ``top_k_index``/``top_k_weights [T, k]`` are the
    same on every rank (the router is replicated); each rank dispatches the
    rows of its own slice of the tokens and all-gathers the results.
    """
    group, world, me = self.ep_group, self.ep_group.size(), dist.get_rank(self.ep_group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    n_experts, per_rank = self.num_experts, -(-self.num_experts // world)  # torch.chunk's split
    tokens, k = top_k_index.shape
    lo, hi = min(me * -(-tokens // world), tokens), min((me + 1) * -(-tokens // world), tokens)
    # (token, slot) pairs of this rank's slice, grouped by the rank that owns the expert
    token = torch.arange(lo, hi).repeat_interleave(k)
    slot = torch.arange(k).repeat(hi - lo)
    expert = top_k_index[token, slot]
    order = torch.argsort(expert // per_rank, stable=True)
    token, slot, expert = token[order], slot[order], expert[order]
    send = torch.bincount(expert // per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send, recv = send.tolist(), recv.tolist()
    rows = _all_to_all(hidden_states[token], send, recv, group)
    ids = _all_to_all(expert, send, recv, group)
    # The eager loop feeds expert e its rows in (slot, token) order; a kernel's rounding may depend
    # on which rows share a tile, so the owner restores that order before each GEMM.
    keys = _all_to_all(slot * tokens + token, send, recv, group)
    out = rows.new_empty((rows.shape[0], hidden_states.shape[1]))
    for e in range(gate_up.shape[0]):  # this rank's experts, one GEMM each on every row routed to it
        pick = (ids == me * per_rank + e).nonzero().squeeze(1)
        if pick.numel():
            pick = pick[torch.argsort(keys[pick])]
            out[pick] = self._expert_mlp(rows[pick], gate_up[e], down[e])
    back = _all_to_all(out, recv, send, group)
    # combine: weighted outputs added in ascending expert order, like the model's own eager loop
    final = torch.zeros((hi - lo, hidden_states.shape[1]), dtype=hidden_states.dtype)
    weights = top_k_weights[token, slot, None]
    for e in range(n_experts):
        pick = (expert == e).nonzero().squeeze(1)
        if pick.numel():
            final.index_add_(0, token[pick] - lo, (back[pick] * weights[pick]).to(final.dtype))
    per = -(-tokens // world)  # gloo gathers equal pieces: pad this slice to torch.chunk's size, cut after
    padded = F.pad(final, (0, 0, 0, per - final.shape[0]))
    gathered = padded.new_empty((per * world, padded.shape[1]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return gathered[:tokens]


def _expert_mlp(self, x, gate_up, down):
    """SwiGLU of one expert on quantized weights (this rank's TP shard of them, summed over ``tp``)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    y = F.linear(self.act_fn(gate) * up, down)
    if self.tp_group is not None:
        y = y.float()
        dist.all_reduce(y, group=self.tp_group)
        y = y.to(x.dtype)
    return y


def run(args) -> dict:
    """One rank's part: the sharded model and the one-process reference, same seed, same prompt."""
    world = dist.get_world_size()
    if world % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the {world} ranks")
    names = ("ep", "tp") if args.tp > 1 else ("ep",)
    shape = (world // args.tp, args.tp) if args.tp > 1 else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    fmt, dtype = parse_format(args.format), getattr(torch, args.dtype)
    prompt = torch.randint(0, 128, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))

    reference = dq.quantize_(tiny_moe(args.model, dtype, args.seed, args.experts), fmt)
    reference.set_experts_implementation("eager")  # the model's own per-expert loop (select + F.linear)
    model = dq.quantize_(tiny_moe(args.model, dtype, args.seed, args.experts), fmt)
    for m in experts_modules(model):
        m._expert_mlp = types.MethodType(_expert_mlp, m)
    shard_experts(model, mesh)
    with torch.no_grad():
        logits, expected_logits = model(prompt).logits, reference(prompt).logits
        kw = {"max_new_tokens": args.tokens, "do_sample": False, "pad_token_id": 0}
        tokens, expected = model.generate(prompt, **kw), reference.generate(prompt, **kw)
    local = [p.to_local() for p in model.parameters() if isinstance(p, DTensor)]
    return {
        "tokens_equal": torch.equal(tokens, expected),
        "near_tie": near_tie(model, reference, tokens, expected),  # every rank has the same tokens: all run it
        "logits_equal": torch.equal(logits, expected_logits),
        "max_logit_diff": (logits.float() - expected_logits.float()).abs().max().item(),
        "tokens": tokens[0, args.prompt_len :].tolist(),
        "experts_here": [t.shape[0] for t in local][:1],
        "expert_bytes": sum(t.nbytes_stored for t in local),
        "expert_bytes_bf16": sum(2 * t.numel() for t in local),
        "all_bytes": weight_bytes(model),
    }


@torch.no_grad()
def near_tie(model, reference, tokens, expected) -> bool | None:
    """At the first differing token (None: none): were the one-process logits' top two within twice the
    largest difference between the two models' logits there -- a tie that rounding flipped?"""
    diff = (tokens != expected).nonzero()
    if diff.numel() == 0:
        return None
    pos = int(diff[:, 1].min())
    row = int(diff[diff[:, 1] == pos][0, 0])
    prefix = expected[:, :pos]
    ref, got = reference(prefix).logits[:, -1].float(), model(prefix).logits[:, -1].float()
    gap = (ref[row, expected[row, pos]] - ref[row, tokens[row, pos]]).item()
    return gap <= 2 * (ref - got).abs().max().item()


def report(args, results: list[dict]) -> bool:
    r = results[0]
    mode = f"EP {len(results) // args.tp}" + (f" x TP {args.tp}" if args.tp > 1 else "")
    print(f"{args.model}, {args.experts} experts, {args.format}, {args.dtype}, {len(results)} ranks ({mode})")
    print(f"tokens (rank 0): {r['tokens']}")
    tokens_ok = all(x["tokens_equal"] for x in results)
    logits_ok = all(x["logits_equal"] for x in results)
    print(f"tokens equal to one process on every rank: {tokens_ok}")
    if not tokens_ok:
        tie = all(x["near_tie"] for x in results)
        print("  the first difference is " + ("a near-tie flipped by rounding" if tie else "NOT a near-tie"))
        tokens_ok = tie and args.tp > 1  # expert parallelism alone is bit-identical: no tie excuses it
    print(
        f"logits bit-identical to one process: {logits_ok} "
        f"(max difference {max(x['max_logit_diff'] for x in results):.3g})"
    )
    for rank, x in enumerate(results):
        print(
            f"rank {rank}: {x['experts_here'][0]} experts here, {x['expert_bytes'] / 1024:.1f} KiB quantized "
            f"vs {x['expert_bytes_bf16'] / 1024:.1f} KiB in bf16; all parameters {x['all_bytes'] / 1024:.1f} KiB"
        )
    return tokens_ok and (logits_ok or args.tp > 1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="local ranks to start")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside each expert group")
    ap.add_argument("--model", default="mixtral", choices=["mixtral", "qwen3_moe"])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--format", default="int8", help="int8, int4:64, nf4:64,64, float8rowwise, ...")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from dtensor_quant.testing.rank_pool import run as launch

    args = parse_args(argv)
    print(f"starting {args.world} local ranks ...", flush=True)
    return 0 if report(args, launch(run, args.world, args)) else 1


if __name__ == "__main__":
    sys.exit(main())
