"""The planner on whole models: a TP plan's wildcard keys, identical layers collapsed, totals, width, CSV.

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
from dtensor_quant.model.plan_layers import PlanKeys, layers_of
from dtensor_quant.model.planner import Layer, plan, stored_bytes

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
    result = plan(model, fmt, tp=[1, 2, 3], tp_plan=model._tp_plan)
    rows = {layer.name: (layer, cells) for layer, cells in result.rows}
    layer, cells = rows["model.layers.0.mlp.experts.gate_up_proj"]
    assert layer.style == "packed_colwise" and layer.shape == (4, 768, 256)
    for c in cells:  # each half [4, 384, 256] cut on its rows: legal iff that is, twice the bytes
        half = plan([Layer("half", (4, 384, 256), "colwise")], fmt, tp=[c.tp]).rows[0][1][0]
        assert c.legal == half.legal and c.nbytes == 2 * half.nbytes
    assert rows["model.layers.1.mlp.experts.down_proj"][0].style == "rowwise"
    assert rows["model.layers.0.mlp.gate.weight"][0].style == "replicate"  # the router: not in the plan


def test_totals_are_the_shards_stored_bytes():
    """The report's bytes per rank against torch.chunk of really quantized weights (and bf16 for the rest)."""
    fmt = dq.Int8Rowwise()
    model = llama(device="cpu").to(torch.bfloat16)
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
