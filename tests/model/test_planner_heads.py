"""_model/planner: the runtime's head rule, the verdict per mesh after adaptation, a checkpoint planned as stored, and
the command line's formats and one-line errors.

Models are transformers configs built on the meta device (no weights); the
planner-vs-real check on live ranks is tests/distributed/model/test_planner_real.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dtensor_quant as dq
from dtensor_quant.__main__ import run
from dtensor_quant._model.format_spec import parse_format, plannable_formats
from dtensor_quant._model.planner.cells import padding_cost
from dtensor_quant._model.planner.layers import key_matches, layers_of
from dtensor_quant._model.planner.plan import Layer, heads_refusal, plan
from dtensor_quant._model.planner.verdict import ADAPT, AS_IS, BOTH, NO, PADDING
from dtensor_quant._model.tp_plan import adapt_tp_plan

transformers = pytest.importorskip("transformers", reason="the head rule is read from transformers configs")
ROOT = Path(__file__).resolve().parents[2]

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=2, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064)  # fmt: skip
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=1024, tie_word_embeddings=False)  # fmt: skip


def meta(config_cls, model_cls, **fields):
    with torch.device("meta"):
        return model_cls(config_cls(**fields))


def cells(result, name):
    return {c.tp: c for layer, cs in result.rows if layer.name == name for c in cs}


def test_head_rule_refuses_what_torch_cannot_run_and_vllm_replication_allows():
    llama = meta(transformers.LlamaConfig, transformers.LlamaForCausalLM, **TINY)
    torch_ = plan(llama, dq.Int8Rowwise(), tp=[1, 2, 4], tp_plan=llama._tp_plan)
    k = cells(torch_, "model.layers.0.self_attn.k_proj")
    assert k[2].legal and not k[4].legal and "does not divide the 2 KV heads" in k[4].why
    assert [v.status for v in torch_.summary()] == [AS_IS, AS_IS, NO]
    assert "vLLM serves this degree" in k[4].alternatives  # 4 heads over 4 ranks, each KV head on 2 of them
    vllm = plan(llama, dq.Int8Rowwise(), tp=[4, 8], tp_plan=llama._tp_plan, runtime="vllm")
    k = cells(vllm, "model.layers.0.self_attn.k_proj")
    assert k[4].legal and k[4].nbytes == cells(torch_, "model.layers.0.self_attn.k_proj")[2].nbytes  # cut 2 ways
    assert not k[8].legal and "attention heads" in k[8].why  # 8 does not divide the 4 query heads
    assert [v.status for v in vllm.summary()] == [AS_IS, NO]

    qwen = meta(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **QWEN25_7B)
    result = plan(qwen, dq.Int8Rowwise(), tp=[4, 7, 8, 14], tp_plan=qwen._tp_plan)
    by_tp = {v.tp: v for v in result.summary()}
    assert by_tp[4].status == AS_IS and all(by_tp[t].status == NO for t in (7, 8, 14))
    assert by_tp[8].nearest == (4, None)  # 7 and 14 divide the 28 heads but not the 4 KV heads
    assert "nearest legal tp with whole heads: 4" in cells(result, "model.layers.0.self_attn.k_proj")[8].alternatives
    assert cells(result, "model.layers.0.mlp.up_proj")[7].legal  # the MLP has no heads
    vllm = plan(qwen, dq.Int8Rowwise(), tp=[8, 28], tp_plan=qwen._tp_plan, runtime="vllm")
    assert [v.status for v in vllm.summary()] == [NO, AS_IS]  # 28 divides the heads and is a multiple of 4 KV heads


def test_heads_refusal_rules():
    assert heads_refusal((32, 8), 8) is None and heads_refusal((32, 8), 16)  # torch: both divisible
    assert heads_refusal((32, 8), 16, "vllm") is None and heads_refusal((32, 8), 12, "vllm")  # 12 % 8, 32 % 12
    assert heads_refusal((28, 4), 8, "vllm") and heads_refusal((28, 4), 28, "vllm") is None
    assert heads_refusal((), 3) is None and heads_refusal((4, 2), 1) is None
    with pytest.raises(ValueError, match="KV heads dividing the heads"):
        plan([("attn.q_proj", (64, 64), "colwise")], dq.Int8Rowwise(), heads=(4, 3))


def test_summary_names_the_switched_layers_and_the_padding_bytes():
    # NF4 on a Llama-3-70B block: down_proj's columns cannot be cut at any tp > 1, the switch keeps them.
    layers = [Layer("model.layers.0.mlp.down_proj", (8192, 28672), "rowwise", "mlp"),
              Layer("model.layers.0.mlp.gate_proj", (28672, 8192), "colwise", "mlp")]  # fmt: skip
    (v,) = plan(layers, dq.NF4(), tp=[2]).summary()
    assert v.status == ADAPT and v.switched == ("model.layers.0.mlp.down_proj",) and not v.padded
    # 128x128 FP8 blocks, MLP width 640 at TP 2: gate/up rows need padding (320 is no whole block), down is
    # switched; pad_for_tp pads all three to 768, so the bytes added are all three's
    fmt = dq.Float8Blockwise(128)
    mlp = [Layer("mlp.gate_proj", (640, 256), "colwise", "mlp"), Layer("mlp.up_proj", (640, 256), "colwise", "mlp"),
           Layer("mlp.down_proj", (256, 640), "rowwise", "mlp")]  # fmt: skip
    result = plan(mlp, fmt, tp=[2])
    (v,) = result.summary()
    assert cells(result, "mlp.gate_proj")[2].padding[:2] == (0, 768)
    want = 2 * padding_cost((640, 256), 0, 768, fmt) + padding_cost((256, 640), 1, 768, fmt)
    assert v.status == BOTH and v.switched == ("mlp.down_proj",) and v.padded == (("pad_for_tp", want),)
    result = plan([Layer("lm_head", (151936, 1536), "colwise", "vocab")], dq.NF4(), tp=[8])
    (v,) = result.summary()
    pad = result.rows[0][1][0].padding
    assert v.status == PADDING and v.padded == (("pad_vocab_for_tp", pad[2]),) and pad[2] > 0
    assert str(v).startswith("tp=8: legal with padding: pad_vocab_for_tp +")
    assert str(result).splitlines()[1] == "  tp=8: " + v.text()  # the report's first lines


def test_tied_head_is_planned_as_the_head():
    tied = meta(transformers.LlamaConfig, transformers.LlamaForCausalLM, **dict(TINY, tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    layers = {layer.name: layer for layer in layers_of(tied, tied._tp_plan, dense=True)}
    assert not layers["lm_head"].dense and layers["lm_head"].style == "colwise" and layers["lm_head"].kind == "vocab"
    assert layers["model.embed_tokens"].dense  # quantize_ leaves the embedding's parameter dense: both are held
    real = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(TINY, tie_word_embeddings=True)))
    dq.quantize_(real, dq.Int8Rowwise())
    assert isinstance(real.lm_head.weight, dq.QuantizedTensor)
    assert not isinstance(real.model.embed_tokens.weight, dq.QuantizedTensor)


def test_one_star_rule_for_the_planner_and_adapt_tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert key_matches("layers.*.wo", "layers.3.wo") and not key_matches("layers.*.wo", "layers.3.attn.wo")
    assert key_matches("layers.?.w[12]", "layers.3.w2") and not key_matches("layers.?.w[12]", "layers.13.w2")
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for block in model.layers:
        block.attn = nn.Module()
        block.attn.wo = nn.Linear(5632, 256, bias=False)
        block.wo = nn.Linear(5632, 256, bias=False)
    dq.quantize_(model, dq.NF4())
    plan_ = {"layers.*.wo": RowwiseParallel(), "layers.[01].attn.wo": ColwiseParallel()}
    new, switched = adapt_tp_plan(model, plan_, 2)
    assert set(switched) == {"layers.0.wo", "layers.1.wo"}  # '*' and '[01]' stay inside their atom
    assert new["layers.[01].attn.wo"] is plan_["layers.[01].attn.wo"] and "layers.*.wo" not in new
    planned = {layer.name: layer.style for layer in layers_of(model, plan_)}
    assert planned == {"layers.0.attn.wo": "colwise", "layers.0.wo": "rowwise", "layers.1.attn.wo": "colwise",
                       "layers.1.wo": "rowwise"}  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "want"),
    [("fp8", dq.Float8Rowwise()), ("float8", dq.Float8Rowwise()), ("float8-row", dq.Float8Rowwise()),
     ("int4", dq.Int4Groupwise(128)), ("nf4", dq.NF4()), ("bnb-nf4", dq.BnbNF4()), ("mxfp4", dq.MXFP4()),
     ("NF4(block_size=32)", dq.NF4(32)), ("Int4Groupwise(group_size=64)", dq.Int4Groupwise(64)),
     ("int4:group_size=32", dq.Int4Groupwise(32)), ("Float8Rowwise(scale_dtype=torch.float16)",
     dq.Float8Rowwise(scale_dtype=torch.float16)), ("bnb_nf4:32", dq.BnbNF4(32))],
)  # fmt: skip
def test_format_names_people_type(spec, want):
    assert parse_format(spec) == want


def test_only_plannable_formats_are_offered():
    assert "FlatBlockedFormat" not in plannable_formats() and "NF4" in plannable_formats()
    with pytest.raises(ValueError, match="unknown format 'FlatBlockedFormat'"):
        parse_format("FlatBlockedFormat")


@pytest.mark.parametrize(
    ("argv", "fix"),
    [(["--format", "int3", "--shape", "8x8"], "expected one of"),
     (["--format", "FlatBlockedFormat", "--shape", "8x8"], "expected one of"),
     (["--format", "NF4(block=3)", "--shape", "64x64"], "NF4 takes block_size"),
     (["--format", "nf4", "--config", "/nonexistent"], "no config.json"),
     (["--format", "nf4", "--shape", "8x8x8x8"], "expected [NAME=]"),
     (["--format", "nf4", "--shape", "8x8", "--tp", "0"], "degrees >= 1"),
     (["--format", "nf4", "--model", "no_such_module:f"], "cannot import"),
     (["--shape", "8x8"], "give --format"),
     (["--format", "nf4", "--bogus"], "unrecognized arguments"),
     (["--checkpoint", "/nonexistent", "--format", "nf4"], "leave out --format")],
)  # fmt: skip
def test_user_errors_are_one_line_with_exit_2(capsys, argv, fix):
    assert run(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and fix in err and "Traceback" not in err, err


def test_python_dash_m_user_error_has_no_traceback():
    """The real entry point, in a fresh process: exit status 2, one line, no traceback; an alias runs."""
    env = {"PYTHONPATH": str(ROOT), "PATH": ""}
    cmd = [sys.executable, "-m", "dtensor_quant", "plan", "--format"]
    bad = subprocess.run([*cmd, "float8x", "--shape", "8x8"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if "error" in line] == bad.stderr.strip().splitlines()[-1:]
    good = subprocess.run([*cmd, "fp8", "--shape", "64x64"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert good.returncode == 0 and "Float8Rowwise()" in good.stdout, good.stderr


def test_checkpoint_planned_as_stored(tmp_path, capsys, monkeypatch):
    """An FP8 block checkpoint (DeepSeek's layout, 128x128 blocks): its block size, never a smaller one; padding
    only where the stored bytes pad exactly; no weight read."""
    from dtensor_quant._checkpoint.hf.io.safetensors_io import Checkpoint
    from dtensor_quant._model.planner.checkpoint import stored_layers
    from tests.support import hf_cases as hc

    config = dict(TINY, intermediate_size=640)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    tensors = model.state_dict()
    hc.write_fp8(tensors, tmp_path, {k for k in tensors if k.endswith("proj.weight")}, False,
                 model.config.to_dict())  # fmt: skip
    assert run(["plan", "--checkpoint", str(tmp_path), "--tp", "1", "2", "--max-lines", "0"]) == 0
    out = capsys.readouterr().out
    assert "stored: fp8 (128x128 block scales, float32) x14" in out and "Float8Blockwise(128) as stored" in out
    assert "would be legal here" not in out  # a dense plan of the same model proposes Float8Blockwise(64)
    assert "lm_head (bf16)" in out  # the producer left it dense
    assert run(["plan", "--config", str(tmp_path), "--format", "Float8Blockwise(128)", "--tp", "2",
                "--max-lines", "0"]) == 0  # fmt: skip
    assert "Float8Blockwise(64) would be legal here" in capsys.readouterr().out
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    layers, methods = stored_layers(meta_model, tmp_path, layers_of(meta_model, meta_model._tp_plan, dense=True))
    assert methods == {"fp8 (128x128 block scales, float32)": 14}
    assert {layer.fmt for layer in layers if not layer.dense} == {dq.Float8Blockwise(128)}

    def no_reads(self, *args, **kwargs):
        raise AssertionError("planning a checkpoint read tensor bytes")

    monkeypatch.setattr(Checkpoint, "read", no_reads)  # headers only
    stored_layers(meta_model, tmp_path, layers_of(meta_model, meta_model._tp_plan))
