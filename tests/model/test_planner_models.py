"""the planner on whole models (_model/planner/layers.py): a TP plan's wildcard keys, identical layers collapsed,
totals, width, CSV.

Transformers models are built on the meta device from their configs (no
weights): a tiny Llama and Mixtral for the rules, and Llama-3-70B's real
shapes for the report a new user reads.
"""

import csv
import io

import pytest
import torch
from torch import nn

import dtensor_quant as dq
from dtensor_quant.__main__ import main
from dtensor_quant._model.padding import mlp_padding
from dtensor_quant._model.planner.layers import PlanKeys, layers_of
from dtensor_quant._model.planner.plan import Layer, plan, stored_bytes

transformers = pytest.importorskip("transformers", reason="the whole-model planner tests build transformers models")

TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=1000, tie_word_embeddings=False)  # fmt: skip
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip


def llama(config=TINY, device="meta"):
    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def styles(layers):
    return {layer.name: layer.style for layer in layers}


def test_wildcard_keys_of_the_models_own_plan():
    model = llama()
    got = styles(layers_of(model, model._tp_plan, dense=True))
    assert len(got) == len(dict(model.named_parameters()))  # one style per weight, none listed twice
    for i in range(4):
        assert got[f"model.layers.{i}.self_attn.q_proj"] == got[f"model.layers.{i}.mlp.up_proj"] == "colwise"
        assert got[f"model.layers.{i}.self_attn.o_proj"] == got[f"model.layers.{i}.mlp.down_proj"] == "rowwise"
        assert got[f"model.layers.{i}.input_layernorm.weight"] == "replicate"
    assert got["lm_head"] == "colwise"  # colwise_gather_output
    assert got["model.embed_tokens"] == "colwise"  # embedding_rowwise: the vocabulary rows, Shard(0)
    # torch ParallelStyles (dq.hf.tp_plan) give the same styles; a weight the plan does not name is replicated
    assert styles(layers_of(model, dq.hf.tp_plan(model), dense=True)) == got
    partial = {k: v for k, v in model._tp_plan.items() if not k.endswith("down_proj")}
    assert styles(layers_of(model, partial))["model.layers.3.mlp.down_proj"] == "replicate"
    assert set(styles(layers_of(model))) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_plan_keys_match_like_parallelize_module():
    keys = PlanKeys({"layers.*.wo": "rowwise", "layers.1.wo": "colwise", "layers.*.w?": "colwise", "x*": "rowwise"})
    assert keys.get("layers.0.wo") == "colwise"  # the later pattern has the last word
    assert keys.get("layers.1.wo") == "colwise"  # an exact key wins
    assert keys.get("layers.12.w1") == "colwise" and keys.get("layers.1.w12") is None
    assert keys.get("x.y") is None and keys.get("xy") == "rowwise"  # '*' stays inside its atom
    with pytest.raises(ValueError, match="unknown TP style 'diagonal'"):
        layers_of(llama(), {"lm_head": "diagonal"})


def test_packed_experts_and_module_hooks_of_a_moe_plan():
    config = transformers.MixtralConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                        num_local_experts=4)  # fmt: skip
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    fmt = dq.Int4Groupwise(128)
    # transformers declared the experts in Mixtral's own TP plan until 5.24; 5.25 moved them to an expert-parallel
    # plan (base_model_ep_plan). The keys as those versions wrote them, whatever version is installed:
    experts = {
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.experts.down_proj": "rowwise",
    }
    result = plan(model, fmt, tp=[1, 2, 3], tp_plan={**model._tp_plan, **experts})
    rows = {layer.name: (layer, cells) for layer, cells in result.rows}
    layer, cells = rows["model.layers.0.mlp.experts.gate_up_proj"]
    assert layer.style == "packed_colwise" and layer.shape == (4, 768, 256)
    for c in cells:  # each half [4, 384, 256] cut on its rows: legal iff that is, twice the bytes
        half = plan([Layer("half", (4, 384, 256), "colwise")], fmt, tp=[c.tp]).rows[0][1][0]
        assert c.legal == half.legal and c.nbytes == 2 * half.nbytes
    assert rows["model.layers.1.mlp.experts.down_proj"][0].style == "rowwise"
    assert rows["model.layers.0.mlp.gate.weight"][0].style == "replicate"  # the router: not in the plan


def test_totals_are_the_shards_stored_bytes():
    """The report's bytes per rank against torch.chunk of really quantized weights (and bf16 for the rest).

    4 KV heads: TP 4 keeps whole heads (TINY's 2 KV heads would be refused at TP 4 by the head rule)."""
    fmt = dq.Int8Rowwise()
    model = llama(dict(TINY, num_key_value_heads=4), device="cpu").to(torch.bfloat16)
    result = plan(model, fmt, tp=[1, 2, 4], tp_plan=model._tp_plan)
    dq.quantize_(model, fmt)
    shard_dim = {layer.name: layer.style for layer, _ in result.rows}
    for tp in (1, 2, 4):
        want = 0
        for name, p in model.named_parameters():
            owner = name.removesuffix(".weight") if name.endswith(".weight") else name
            style = shard_dim.get(owner, shard_dim.get(name))
            dim = {"colwise": 0, "rowwise": 1}.get(style)
            if name.endswith("bias") or p.ndim == 1:
                dim = None
            pieces = torch.chunk(p, tp, dim=dim) if dim is not None and tp > 1 else [p]
            if isinstance(p.data, dq.QuantizedTensor):
                want += max(piece.nbytes_stored for piece in pieces)
            else:
                want += max(piece.numel() for piece in pieces) * 2  # dense parameters count in bf16
        assert result.total_bytes(1, tp) == want, (tp, result.total_bytes(1, tp), want)
    text = str(result)
    assert "model.layers.{0..3}.mlp.down_proj x4" in text and "model per rank in bf16" in text


def test_llama3_70b_report_is_readable():
    """Llama-3-70B's real shapes on meta with its own TP plan: 723 parameters, one row per kind, within 120 columns."""
    model = llama(LLAMA3_70B)
    result = plan(model, dq.NF4(), tp=[1, 2, 4, 8], tp_plan=model._tp_plan)
    text = str(result)
    lines = text.splitlines()
    assert len(result.rows) == 723 and len(lines) < 40 and max(map(len, lines)) <= 120, (len(lines), text)
    assert "model.layers.{0..79}.mlp.down_proj x80" in text
    flat = " ".join(text.split())
    # NF4's factor blocks run across the rows of [8192, 28672]: no column cut; the switch keeps tp 2, 4, 8
    assert "(1) model.layers.{0..79}.mlp.down_proj x80 [8192x28672, row-parallel] refused at tp=2, 4, 8" in flat
    assert "column-parallel on a gathered input (dtensor_quant.adapt_tp_plan)" in flat
    one = plan(model, dq.NF4(), tp=[1], tp_plan=model._tp_plan)
    q = stored_bytes(dq.NF4(), (28672, 8192))
    assert one.total_bytes(1, 1) == sum(c[0].nbytes for _, c in one.rows) and q == one.rows[5][1][0].nbytes


@pytest.mark.slow
def test_many_meshes_fit_the_width_and_csv_has_every_cell():
    model = llama()
    tp, dp = list(range(1, 9)), [8, 16, 32, 64, 128, 256]
    result = plan(model, dq.NF4(), tp=tp, dp=dp, tp_plan=model._tp_plan)
    lines = result.render().splitlines()
    assert max(map(len, lines)) <= 120 and sum(line.startswith("layer ") for line in lines) > 1  # blocks of meshes
    assert max(map(len, result.render(width=0).splitlines())) > 120  # one block: as wide as it takes
    rows = list(csv.DictReader(io.StringIO(result.csv())))
    assert len(rows) == len(result.rows) * 48
    refused = [r for r in rows if r["legal"] == "0"]
    assert refused and all(r["why"] and r["bytes"] == "" for r in refused)
    assert {r["layer"] for r in rows} == {layer.name for layer, _ in result.rows}


def test_command_line_from_a_config(tmp_path, capsys):
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    out = tmp_path / "plan.csv"
    assert (
        main(["plan", "--format", "int4:128", "--config", str(tmp_path), "--tp", "1", "2", "3", "--csv", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("TP plan: LlamaForCausalLM._tp_plan (9 keys)")
    assert "model.layers.{0..3}.self_attn.o_proj x4" in text and max(map(len, text.splitlines())) <= 120
    assert len(list(csv.DictReader(io.StringIO(out.read_text())))) == 3 * len(dict(llama().named_parameters()))
    assert main(["plan", "--format", "int4:128", "--config", str(tmp_path), "--tp-plan", "none", "--tp", "2"]) == 0
    assert "model.layers.{0..3}.self_attn.o_proj x4  256x256   colwise" in capsys.readouterr().out


def test_padding_proposed_is_the_padding_applied():
    """The planner's proposal for an MLP and the output head is exactly what pad_for_tp / pad_vocab_for_tp apply.

    Float8Blockwise(128) at TP 2: 640-wide MLPs (320 per rank) and 1000 rows of vocabulary (500 per rank)
    are refused; padded to 768 and 1024 every quantized weight is legal, on a model built on meta.
    """
    fmt = dq.Float8Blockwise(128)
    model = llama(dict(TINY, intermediate_size=640, num_key_value_heads=4))
    before = plan(model, fmt, tp=[2], tp_plan=model._tp_plan)
    proposed = {layer.name: cells[0].padding[:2] for layer, cells in before.rows if not cells[0].legal}
    mlps = {f"model.layers.{i}.mlp.{n}" for i in range(4) for n in ("gate_proj", "up_proj", "down_proj")}
    assert set(proposed) == mlps | {"lm_head"}, set(proposed)
    applied = dq.pad_for_tp(model, 2, fmt)
    assert applied == {f"model.layers.{i}.mlp": (640, 768) for i in range(4)}
    assert {n: p for n, p in proposed.items() if n != "lm_head"} == {n: (1 if "down" in n else 0, 768) for n in mlps}
    assert proposed["lm_head"] == (0, 1024)
    assert dq.pad_vocab_for_tp(model, 2, fmt) == {"lm_head": (1000, 1024)}
    after = plan(model, fmt, tp=[2], tp_plan=model._tp_plan)
    assert not after.refusals, [layer.name for layer, _ in after.refusals]


class _Head(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


@pytest.mark.parametrize(("vocab", "hidden", "padded"), [(151936, 1536, 152064), (32064, 3072, 32128)])
def test_nf4_heads_of_qwen25_and_phi3_at_tp8_are_legal_padded(vocab, hidden, padded):
    """Qwen2.5-1.5B's and Phi-3-mini's NF4 output heads at TP 8: refused as is, the proposal is what pads them."""
    ((_, (cell,)),) = plan([("lm_head", (vocab, hidden), "colwise")], dq.NF4(), tp=[8]).rows
    assert not cell.legal and cell.padding[:2] == (0, padded)
    with torch.device("meta"):
        model = _Head(vocab, hidden)
    assert dq.pad_vocab_for_tp(model, 8, dq.NF4()) == {"lm_head": (vocab, padded)}
    assert plan([("lm_head", tuple(model.lm_head.weight.shape), "colwise")], dq.NF4(), tp=[8]).rows[0][1][0].legal


def test_llama3_70b_nf4_down_projection_padded_or_switched():
    """Llama-3-70B's NF4 down_proj (row-parallel, its columns cannot be cut): padded at TP 2, switched at 4 and 8."""
    layer = Layer("model.layers.0.mlp.down_proj", (8192, 28672), "rowwise", "mlp")
    cells = {c.tp: c for c in plan([layer], dq.NF4(), tp=[2, 4, 8]).rows[0][1]}
    assert not any(c.legal for c in cells.values())
    assert cells[2].padding[:2] == (1, mlp_padding(28672, 8192, dq.NF4(), 2)) == (1, 32768)
    assert cells[4].padding is None and cells[8].padding is None  # no padding within reach keeps equal legal shards
    column = plan([Layer(layer.name, layer.shape, "colwise", "mlp")], dq.NF4(), tp=[2, 4, 8]).rows[0][1]
    assert all(c.legal for c in column)  # what adapt_tp_plan switches to
    assert all("adapt_tp_plan" in cells[t].alternatives for t in (2, 4, 8))
