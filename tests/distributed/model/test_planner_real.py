"""The planner against reality: every degree it calls legal runs transformers' TP plan and equals one process;
every degree it refuses fails.

Tiny transformers Llama and Qwen2 models (random weights, written here; 4
attention heads), quantized with ``quantize_`` and parallelized with their
own TP plan (``dq.hf.tp_plan``) on gloo ranks. The planner's verdict per
degree (``Plan.summary()``) decides what each rank does: "legal as is" runs
the plan, "legal with adapt_tp_plan" runs the adapted plan, "not at all"
must fail -- by the head rule (a 2-KV-head model at TP 4 fails in
``k_proj(...).view``) or by the layout (``LayoutError`` before any data moves).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant._model.planner.cells import Layer, check
from dtensor_quant._model.planner.plan import plan
from dtensor_quant._model.planner.verdict import ADAPT, AS_IS, NO
from dtensor_quant.testing import mesh, same_bits, weight
from dtensor_quant.testing.bounds import gamma
from tests.support.extra_formats import FORMATS

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, head_dim=64,
            vocab_size=1024, tie_word_embeddings=False)  # fmt: skip
# (model, KV heads, format): the 2-KV-head Llama is refused at TP 4 by the head rule alone (int8) and at TP 2 by
# the layout too (128x128 FP8 blocks cannot cut k_proj's 128 rows); Qwen2 (q/k/v biases) with 4 KV heads takes
# int4 g128 at TP 2 as is and at TP 4 only with adapt_tp_plan (o_proj's and down_proj's column shards of 64 and
# 192 are no whole groups).
CASES = [("llama", 2, dq.Int8Rowwise()), ("llama", 2, dq.Float8Blockwise(128)), ("qwen2", 4, dq.Int4Groupwise(128))]


def build(kind: str, kv_heads: int, device="cpu"):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    with torch.device(device):
        return model_cls(config_cls(**BASE, num_key_value_heads=kv_heads))


def verdict(kind: str, kv_heads: int, fmt, tp: int):
    model = build(kind, kv_heads, "meta")
    return plan(model, fmt, tp=[tp], tp_plan=model._tp_plan).summary()[0]


def run_at_world_size(kind: str, kv_heads: int, fmt, status: str):
    """On every rank: the one-process logits, and the TP run's (or how it failed)."""
    tp = dist.get_world_size()
    ids = torch.randint(0, BASE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    reference, model = build(kind, kv_heads), build(kind, kv_heads)
    for m in (reference, model):
        dq.quantize_(m, fmt)
    with torch.no_grad():
        one = reference(ids).logits
    try:
        tp_plan = dq.hf.tp_plan(model)
        if status == ADAPT:
            tp_plan, _ = dq.adapt_tp_plan(model, tp_plan, tp)
        parallelize_module(model, mesh(tp), tp_plan)
        with torch.no_grad():
            out = model(ids).logits
    except Exception as e:
        return "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return "ran", one, out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("kind", "kv_heads", "fmt"), CASES, ids=lambda v: str(v).split("(")[0])
def test_planner_verdicts_hold_on_real_ranks(ranks, world, kind, kv_heads, fmt):
    v = verdict(kind, kv_heads, fmt, world)
    assert verdict(kind, kv_heads, fmt, 1).status == AS_IS
    results = ranks(world).run(run_at_world_size, kind, kv_heads, fmt, v.status)
    if v.status == NO:  # the head rule: k_proj(...).view; the layout: LayoutError, before any data moves
        # A degree the head rule refuses may also be one the layout refuses: then the layout's LayoutError comes
        # first (a weight is cut, and refused, before the forward reaches k_proj(...).view).
        want = ("is invalid for input of size", "LayoutError: ") if "heads" in v.why else ("LayoutError: ",)
        assert all(r[0] == "failed" and any(w in r[1] for w in want) for r in results), (v, results)
        return
    assert all(r[0] == "ran" for r in results), (v, results)
    # float32 on the same quantized weights: only the row-parallel all-reduces regroup sums; each logit is within
    # the summation bound of the longest chain of reductions (every layer's MLP width), twice (both runs).
    chain = BASE["intermediate_size"] * BASE["num_hidden_layers"]
    for _, one, out in results:
        bound = 2 * gamma(chain) * float(one.abs().max())
        assert float((out - one).abs().max()) <= bound, (v, float((out - one).abs().max()), bound)


def test_the_cases_cover_every_verdict():
    """The three verdicts the real runs check, as the planner gives them (head rule and layout)."""
    got = {(kind, str(fmt), tp): verdict(kind, kv, fmt, tp) for kind, kv, fmt in CASES for tp in (2, 4)}
    assert got[("llama", "Int8Rowwise()", 2)].status == AS_IS
    assert got[("llama", "Int8Rowwise()", 4)].status == NO and "2 KV heads" in got[("llama", "Int8Rowwise()", 4)].why
    assert got[("llama", "Float8Blockwise(128)", 2)].status == NO and "k_proj" in got[
        ("llama", "Float8Blockwise(128)", 2)].why  # fmt: skip
    assert got[("qwen2", "Int4Groupwise(group_size=128)", 2)].status == AS_IS
    adapted = got[("qwen2", "Int4Groupwise(group_size=128)", 4)]
    assert adapted.status == ADAPT and {s.split(".")[-1].split()[0] for s in adapted.switched} == {
        "o_proj", "down_proj"}  # fmt: skip


# -- FSDP2: the dp verdict against fully_shard -----------------------------------------------------------------


def fsdp_outcomes(names, rows_list):
    """On every rank, per (format, rows): what ``dq.fsdp.fully_shard`` and torch's ``fully_shard`` (then an
    unshard) do with a ``[rows, 256]`` weight over every rank: "gathered" (bit-exact to the one-process weight)
    or "refused" (``LayoutError``: dq's before any collective, torch's at the unshard)."""
    world, out = dist.get_world_size(), []
    for name in names:
        for rows in rows_list:
            q = dq.quantize(weight((rows, 256), seed=1), FORMATS[name])
            got = []
            for shard in (dq.fsdp.fully_shard, torch_fully_shard):
                model = nn.Sequential(nn.Linear(256, rows, bias=False))
                model[0].weight = nn.Parameter(dq.quantize(weight((rows, 256), seed=1), FORMATS[name]), False)
                try:
                    shard(model, mesh=mesh(world))
                    model.unshard()
                except dq.LayoutError:
                    got.append("refused")
                    continue
                assert same_bits(model[0].weight.detach(), q.dequantize()), (name, rows)
                got.append("gathered")
            out.append(((name, rows), tuple(got)))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_planner_fsdp_verdicts_hold_on_real_ranks(ranks, world):
    """Every format, 1-3 rows over dp=world: the plan's verdict is what fully_shard does. FSDP2 pads every
    rank's shard to ``ceil(rows / dp)`` rows, so one row of a format blocked over several rows (NF4, BnbNF4,
    Float8Blockwise) cannot be gathered, although torch.chunk would leave it whole (the plan said legal)."""
    results = ranks(world).run(fsdp_outcomes, list(FORMATS), [1, 2, 3])
    assert all(r == results[0] for r in results)
    one_row_refused = set()
    for (name, rows), got in results[0]:
        cell = check(Layer("w", (rows, 256), "colwise"), FORMATS[name], dp=world, tp=1)
        expected = "gathered" if cell.legal else "refused"
        assert got == (expected, expected), (name, rows, got, cell.why)
        if rows == 1 and not cell.legal:
            assert "FSDP2 over dp=" in cell.why and "nearest legal dp: 1" in cell.alternatives, cell
            one_row_refused.add(name)
    assert {"nf4", "bnbnf4", "f8block128"} <= one_row_refused  # the cases the plan used to call legal
    assert len(results[0]) == 3 * len(FORMATS)
