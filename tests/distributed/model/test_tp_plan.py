"""model/tp_plan on live ranks:
a row-parallel layer its format cannot cut by columns becomes column-parallel, bit-exactly.

A SwiGLU MLP with the real MLP width of TinyLlama (5632) and a small model
dim (256): NF4's scale factors cover 16,384 consecutive weights, so the
down-projection ``[256, 5632]`` cannot be cut along its columns at TP 2 or
4, while 128 or 64 of its rows are whole factor blocks.

Bit-exact where each output element is the same computation on one rank as on
one process: the fused decode kernel sums each output row by itself. A GEMM
(dequantize + mm, past 4 tokens or without the kernel) of a narrower shard may
block its sums otherwise, so there the TP output is compared within the
summation's bound (:mod:`dtensor_quant.testing.bounds`).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import dtensor_quant as dq
from dtensor_quant._formats import nf4
from dtensor_quant._model.tp_plan import adapt_tp_plan
from dtensor_quant.testing import assert_within, linear_error_bound, mesh, weight
from dtensor_quant.testing.bounds import unit_roundoff
from tests.model.test_tp_plan import MLP, PLAN, Block, quantized


def switched_mlp(dim, hidden, tokens, kernels=False, why="5632 columns are cut"):
    """The TP MLP's outputs against one process's, for a few token counts."""
    tp = dist.get_world_size()
    model = quantized(MLP(dim, hidden), dim, dq.NF4())
    reference = quantized(MLP(dim, hidden), dim, dq.NF4())
    plan, switched = adapt_tp_plan(model, PLAN, tp, kernels=kernels)
    assert list(switched) == ["w2"] and why in switched["w2"], switched
    assert type(plan["w2"]) is ColwiseParallel and plan["w1"] is PLAN["w1"] and plan["w3"] is PLAN["w3"]
    parallelize_module(model, mesh(tp), plan)
    assert model.w2.weight.placements == (Shard(0),)
    out, calls, original = {}, [], nf4.fused_linear
    nf4.fused_linear = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    down_inputs = {}
    for key, m in (("tp", model), ("one process", reference)):  # what each w2 multiplies (after TP's input prep)
        m.w2.register_forward_pre_hook(lambda mod, args, key=key: down_inputs.__setitem__(key, args[0]))
    try:
        with torch.no_grad():
            for n in tokens:
                x = weight((1, n, dim), seed=100 + n)
                calls.clear()
                y = model(x)
                out[n] = [len(calls)]
                y_ref = reference(x)
                out[n] += [torch.equal(y, y_ref), (y.float() - y_ref.float()).abs().max().item()]
                if out[n][0] < 3:  # a GEMM somewhere: within the bound, the hidden units' difference carried
                    h = down_inputs["tp"]
                    h, h_ref = h.full_tensor() if isinstance(h, DTensor) else h, down_inputs["one process"]
                    w2 = reference.w2.weight.dequantize()
                    carried = (h - h_ref).double().abs() @ w2.double().abs().t()
                    bound = linear_error_bound(h, w2) + linear_error_bound(h_ref, w2) + carried
                    assert_within(y, y_ref, bound, f"{n} tokens at TP {tp}")
    finally:  # the ranks live on for other tests
        nf4.fused_linear = original
    return switched["w2"], out, nf4.kernel() is not None  # DTENSOR_QUANT_NATIVE=0, or no AVX2: no kernel


@pytest.mark.parametrize("world", [2, 4])
def test_switched_down_projection_matches_one_process(ranks, world):
    results = ranks(world).run(switched_mlp, 256, 5632, (1, 2, 5))
    assert len({why for why, _, _ in results}) == 1  # one reason, on every rank
    for _, out, kernels in results:
        # Every output element is computed on one rank from the same bytes as on one process, with no partial
        # sums: bit-exact through the decode kernel (1-4 tokens), which sums each output row by itself; past 4
        # tokens (dequantize + mm) within the bound, checked on the ranks.
        assert out[1][0] == (3 if kernels else 0), out  # one token: w1, w3 and the switched w2 run the kernel
        assert all(equal for calls, equal, _ in out.values() if calls == 3), out


def test_kernels_switches_a_legal_cut_the_kernel_cannot_run_on(ranks):
    """MLP 2048: NF4 can cut w2 [256, 2048] by columns, but a factor spans 8 whole rows, so a column shard is
    not laid out as a fresh weight and the fused kernel would not run on it; with ``kernels`` it is switched."""
    if nf4.kernel() is None:
        pytest.skip("no fused NF4 kernel here (DTENSOR_QUANT_NATIVE=0, or no AVX2 or C++ compiler)")
    model = quantized(MLP(256, 2048), 256, dq.NF4())
    assert adapt_tp_plan(model, PLAN, 2) == (PLAN, {})
    assert ranks(2).run(fused_calls_unswitched, 256, 2048) == [2, 2]  # w1 and w3 only: w2 dequantizes
    why = "column shards are not laid out as a fresh weight"
    for _, out, _ in ranks(2).run(switched_mlp, 256, 2048, (1,), True, why):
        assert out[1][0] == 3 and out[1][1], out  # the kernel runs on the switched w2, bit-exactly


def fused_calls_unswitched(dim, hidden):
    model = quantized(MLP(dim, hidden), dim, dq.NF4())
    parallelize_module(model, mesh(dist.get_world_size()), PLAN)
    calls, original = [], nf4.fused_linear
    nf4.fused_linear = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        with torch.no_grad():
            model(weight((1, 1, dim), seed=3))
    finally:
        nf4.fused_linear = original
    return len(calls)


def switched_sequence_parallel(dim, hidden):
    tp = dist.get_world_size()
    model = quantized(Block(dim, hidden), dim, dq.NF4())
    reference = quantized(Block(dim, hidden), dim, dq.NF4())
    reference.norm.load_state_dict(model.norm.state_dict())
    plan = {
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(),
        "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    plan, switched = adapt_tp_plan(model, plan, mesh(tp))
    assert list(switched) == ["mlp.w2"] and plan["mlp.w2"].output_layouts == (Shard(1),)
    parallelize_module(model, mesh(tp), plan)
    x = weight((1, 2 * tp, dim), seed=7)
    with torch.no_grad():
        local = model(x.chunk(tp, dim=1)[dist.get_rank()])  # sequence shards in, sequence shards out
        expected = reference(x).chunk(tp, dim=1)[dist.get_rank()]
    return torch.equal(local, expected)


def test_sequence_parallel_output_stays_sequence_sharded(ranks):
    assert all(ranks(2).run(switched_sequence_parallel, 256, 5632))


def unswitchable(dim, hidden, fmt):
    """Neither cut legal: the error, on every rank, before parallelize_module or any collective."""
    model = quantized(MLP(dim, hidden), dim, fmt)
    try:
        adapt_tp_plan(model, PLAN, dist.get_world_size(), expand_scales=False)
    except dq.LayoutError as e:
        return str(e)
    raise AssertionError("a layer no cut can hold was not refused")


def test_unswitchable_refused_on_every_rank(ranks):
    errors = ranks(4).run(unswitchable, 64, 5632, dq.NF4())
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("no tensor-parallel cut is legal at TP 4 for w1 [5632, 64]"), errors[0]
    # w1 and w3 column-parallel: 1408 rows are no whole number of 256-row factors; w2 neither way
    assert "w2 [64, 5632] in NF4(block_size=64, scaler_block_size=256): row-parallel: the 5632 columns" in errors[0]
    assert "column-parallel: the 64 rows" in errors[0], errors[0]
    assert errors[0].count("expand_scales=True stores it as NF4BlockScales(block_size=64, levels='torchao')") == 3


class Attention(nn.Module):
    """Qwen2.5-0.5B's attention projections (hidden 896, 14 heads, 2 KV heads of 64), without the attention."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(896, 896, bias=False, dtype=torch.bfloat16)
        self.k_proj = nn.Linear(896, 128, bias=False, dtype=torch.bfloat16)
        self.v_proj = nn.Linear(896, 128, bias=False, dtype=torch.bfloat16)
        self.o_proj = nn.Linear(896, 896, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.o_proj(self.q_proj(x)), self.k_proj(x), self.v_proj(x)


ATTENTION_PLAN = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                  "o_proj": RowwiseParallel()}  # fmt: skip


def expanded_attention(fmt):
    """At TP 2 no cut of the four is legal in NF4/BnbNF4 (a 16384-value factor spans 18.3 rows of 896);
    adapt_tp_plan expands their scales, keeps the plan, and the outputs are one process's."""
    model, reference = quantized(Attention(), 896, fmt), quantized(Attention(), 896, fmt)
    before = {n: p.dequantize() for n, p in model.named_parameters()}
    plan, changed = adapt_tp_plan(model, ATTENTION_PLAN, mesh(2))
    assert plan == ATTENTION_PLAN and sorted(changed) == sorted(ATTENTION_PLAN), changed
    assert all(type(p.fmt) is dq.NF4BlockScales and torch.equal(p.dequantize(), before[n])
               for n, p in model.named_parameters())  # fmt: skip
    parallelize_module(model, mesh(2), plan)
    rank, out, seen = dist.get_rank(), {}, {}
    model.o_proj.register_forward_pre_hook(lambda mod, args: seen.__setitem__("h", args[0]))
    w_o = reference.o_proj.weight.dequantize().double()
    for tokens in (1, 6):
        x = weight((1, tokens, 896), seed=10 + tokens)
        with torch.no_grad():
            (o, k, v), (o_ref, k_ref, v_ref) = model(x), reference(x)
            h_ref = reference.q_proj(x)
        # column-parallel: each rank's rows of the output, computed from the same bytes as in one process -- bit
        # for bit through NF4's kernel (each row summed by itself); a GEMM of fewer rows may block its sums
        # otherwise (DTENSOR_QUANT_NATIVE=0), so there within the bound
        mine = [h_ref.chunk(2, -1)[rank], k_ref.chunk(2, -1)[rank], v_ref.chunk(2, -1)[rank]]
        h = seen["h"].to_local() if isinstance(seen["h"], DTensor) else seen["h"]  # as RowwiseParallel wraps it
        out[tokens] = []
        for got, want, lin in zip((h, k, v), mine, (reference.q_proj, reference.k_proj, reference.v_proj)):
            if nf4.kernel() is not None:
                out[tokens].append(torch.equal(got, want))
            else:
                rows = lin.weight.dequantize().chunk(2, 0)[rank]
                assert_within(got, want, 2 * linear_error_bound(x, rows), f"column-parallel at {tokens} tokens")
                out[tokens].append(True)
        # row-parallel o_proj (its input is q_proj's, as checked): two bf16 partial sums added in bf16 by the
        # all-reduce, where one process sums once
        halves = [linear_error_bound(a, b) for a, b in zip(h_ref.chunk(2, -1), w_o.chunk(2, -1))]
        exact = h_ref.double() @ w_o.t()
        tp_bound = sum(halves) + unit_roundoff(torch.bfloat16) * (exact.abs() + sum(halves))
        assert_within(o, o_ref, tp_bound + linear_error_bound(h_ref, w_o), f"o_proj at {tokens} tokens")
    return changed["o_proj"], out


@pytest.mark.parametrize("fmt", [dq.NF4(), dq.BnbNF4()], ids=str)
def test_double_quantized_attention_runs_at_tp2_expanded(ranks, fmt):
    results = ranks(2).run(expanded_attention, fmt)
    assert len({why for why, _ in results}) == 1 and "the same values" in results[0][0], results
    for _, out in results:
        assert all(all(v) for v in out.values()), out
