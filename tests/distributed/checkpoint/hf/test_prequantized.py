"""checkpoint/hf/prequantized on live ranks: producers' checkpoints read as stored into sharded models (dq.hf).

For each kind (:mod:`tests.support.producers`): the model is built on meta, quantized by
``dq.hf.quantize_like_checkpoint``, sharded (TP 2 with transformers' own
plan, or FSDP2 over 2 ranks), materialized and loaded. Every quantized weight
must dequantize bit for bit to the producer's own dequantization of the
file, every dense tensor equal the file's, and every rank read exactly the
bytes of its slices (counted at the ``preadv`` calls, compared with a count
made here from the producer's layout).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.testing import mesh
from tests.support import producers as pr
from tests.support.producers import build

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)._local_tensor
    return full


def load_and_check(kind: str, layout: str, path: str) -> dict:
    model, chosen = build(layout, path)
    result = dq.hf.load(model, path)
    ref = pr.reference(path)
    expected, quantized = 0, []
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        want = _local(ref[name].to(p.dtype), p)
        if isinstance(local, dq.QuantizedTensor):
            quantized.append(name)
            got = local.dequantize(p.dtype)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                f"{name}: {int((got != want).sum())} of {got.numel()} values differ from the producer's"
            )
            offset = (
                compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1]
                if isinstance(p, DTensor)
                else (0, 0)
            )
            expected += pr.file_bytes(kind, offset, tuple(local.shape), tuple(p.shape))
        else:
            assert torch.equal(local.detach(), want), name
            expected += local.numel() * local.element_size()
    assert sorted(result.prequantized) == sorted(chosen) == sorted(quantized)
    expected += pr.metadata_bytes(kind, path)
    assert not result.quantized
    assert result.bytes_read == expected, (result.bytes_read, expected)
    formats = sorted({str(v.fmt) for v in chosen.values()})
    return {"read": result.bytes_read, "file": result.file_bytes, "formats": formats}


KINDS = ["ct_int8", "ct_fp8", "ct_fp8_block", "ct_int4", "ct_int4_asym", "ct_mxfp4", "gptq", "awq", "bnb", "bnb_single"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ct_int4", "gptq", "bnb"])
def test_prequantized_checkpoint_loads_as_stored_fsdp2_over_tp(ranks, producer_checkpoints, kind):
    """2-D: FSDP2 over TP on 2 x 2 ranks, where the layout allows (rows of 128 groups, 8-row zero words, factors)."""
    ranks(4).run(load_and_check, kind, "2d", producer_checkpoints[kind])


@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
@pytest.mark.parametrize("kind", KINDS)
def test_prequantized_checkpoint_loads_as_stored(ranks, producer_checkpoints, kind, layout):
    path = producer_checkpoints[kind]
    stats = ranks(2).run(load_and_check, kind, layout, path)
    # each of the 2 ranks reads about half the file: its shards, its half of the dense tensors, small records
    for s in stats:
        assert 0.4 < s["read"] / s["file"] < 0.6, s


def tp2_logits(path: str) -> dict:
    """Logits of the model at TP 2 and in one process (on every rank), both loaded as stored, in float32."""
    ids = torch.randint(0, pr.hc.CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    out = {}
    for layout in ("tp2", "single"):
        model = build(layout, path, torch.float32)[0]
        dq.hf.load(model, path)
        with torch.no_grad():
            logits = model(ids).logits
        out[layout] = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return out


def test_prequantized_bnb_model_runs_at_tp2(ranks, producer_checkpoints):
    """vLLM refuses a pre-quantized bitsandbytes model at any TP > 1; here it runs, and matches one process.

    Both run float32 on the same (bitsandbytes-dequantized) weights; they differ only in how the row-parallel
    sums are split (2 partial sums all-reduced), which float32 rounds within a few ulps of the largest logit.
    """
    for r in ranks(2).run(tp2_logits, producer_checkpoints["bnb"]):
        tp, one = r["tp2"], r["single"]
        assert torch.isfinite(tp).all()
        bound = 64 * torch.finfo(torch.float32).eps * float(one.abs().max())
        assert float((tp - one).abs().max()) <= bound, (float((tp - one).abs().max()), bound)


# -- back out: compressed-tensors, which vLLM and transformers read ----------------------------------------------

EXPORTS = {
    "int8": {"proj": dq.Int8Rowwise()},
    "int4z": {"proj": dq.Int4GroupwiseIntZero(128)},
    "fp8": {"proj": dq.Float8Rowwise()},
    "fp8block": {"proj": dq.Float8Blockwise(128, scale_dtype=torch.bfloat16)},
    "mxfp4": {"proj": dq.MXFP4()},
    # three schemes in one model: compressed-tensors groups them (transformers' dequantizing reader takes one
    # scheme for all dense layers, so this one is read back by this library only)
    "mixed": {"self_attn": dq.Int8Rowwise(), "gate_proj": dq.Int4GroupwiseIntZero(128),
              "up_proj": dq.Int4GroupwiseIntZero(128), "down_proj": dq.Float8Rowwise()},
}  # fmt: skip


def export_tp2(src: str, out: str, name: str) -> dict:
    """A TP-2 model, quantized on load from a dense checkpoint, saved as compressed-tensors.

    Returns rank 0's view of every quantized weight, gathered and dequantized (the values the export must keep).
    """
    import transformers

    with dq.hf.init_empty():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**pr.hc.CONFIG))
    model.to(torch.bfloat16)
    for part, fmt in EXPORTS[name].items():
        dq.quantize_(model, fmt, filter_fn=lambda m, fqn, part=part: part in fqn and fqn != "lm_head")
    parallelize_module(model, mesh(2), dq.hf.tp_plan(model))
    dq.hf.materialize(model)
    dq.hf.load(model, src)
    dq.hf.save(model, out, quantization="compressed-tensors")
    return {n: p.full_tensor().dequantize() for n, p in model.named_parameters()
            if isinstance(p, DTensor) and isinstance(p.to_local(), dq.QuantizedTensor)}  # fmt: skip


def reload_tp2(path: str, want: dict) -> list[str]:
    """The export read back as stored into a TP-2 model: the same values."""
    model = build("tp2", path)[0]
    result = dq.hf.load(model, path)
    for name, p in model.named_parameters():
        if name in want:
            assert torch.equal(p.full_tensor().dequantize(), want[name]), name
    return sorted(result.prequantized)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_tp2_model_saves_as_compressed_tensors_and_reloads(ranks, producer_checkpoints, tmp_path, name):
    import json

    import transformers

    pytest.importorskip("compressed_tensors", reason="compressed-tensors (a test extra) reads the export")
    out = str(tmp_path / "ct")
    want = ranks(2).run(export_tp2, producer_checkpoints["dense"], out, name)[0]
    assert len(want) == 14
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head"] and len(config["config_groups"]) == len(set(EXPORTS[name].values()))
    if name != "mixed":
        # compressed-tensors, through transformers, decompresses every weight to the model's values
        back = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
        ).state_dict()
        for key, values in want.items():
            assert torch.equal(back[key].view(torch.int16), values.view(torch.int16)), key
    # and this library reads it back as stored, at TP 2, to the same values
    assert ranks(2).run(reload_tp2, out, want)[0] == sorted(want)


def resave(src: str, out: str) -> None:
    model = build("tp2", src)[0]
    dq.hf.load(model, src)
    dq.hf.save(model, out, quantization="compressed-tensors")


@pytest.mark.parametrize("kind", ["ct_int4", "ct_int4_asym", "ct_fp8_block"])
def test_compressed_tensors_checkpoint_saves_back_byte_for_byte(ranks, producer_checkpoints, tmp_path, kind):
    """Loaded as stored at TP 2 and saved as compressed-tensors: every quantized tensor of the file, as it was."""
    src = producer_checkpoints[kind]
    ranks(2).run(resave, src, str(tmp_path / "out"))
    before, after = pr.hc.read_all(src), pr.hc.read_all(tmp_path / "out")
    quantized = [k for k in before if k.endswith(("_packed", "_scale", "_zero_point", "_shape")) or
                 before[k].dtype in (torch.int8, torch.float8_e4m3fn)]  # fmt: skip
    assert quantized and set(quantized) <= set(after)
    for k in quantized:
        assert torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)), k


# -- gpt-oss: fused MXFP4 experts held [E, in, out] by the model ------------------------------------------------


def load_gptoss(layout: str, path: str) -> dict:
    """The tiny gpt-oss quantized like its checkpoint (experts split over 2 ranks by EP, or whole), loaded as stored."""
    import transformers

    with dq.hf.init_empty():
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**pr.GPTOSS))
    model.to(torch.bfloat16)
    chosen = dq.hf.quantize_like_checkpoint(model, path)
    if layout == "ep2":  # expert parallelism: each rank holds half of every fused expert stack
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if name in ("gate_up_proj", "down_proj"):
                    dt = distribute_tensor(p.detach(), mesh(2), [Shard(0)], src_data_rank=None)
                    setattr(module, name, torch.nn.Parameter(dt, requires_grad=False))
    dq.hf.materialize(model)
    result = dq.hf.load(model, path)
    ref, expected = pr.reference(path), 0
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        want = _local(ref[name].to(p.dtype), p)
        if isinstance(local, dq.QuantizedTensor):
            got = local.dequantize(p.dtype)
            assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), name
            expected += pr.file_bytes("gptoss", None, tuple(local.shape), tuple(p.shape))
        else:
            assert torch.equal(local.detach(), want), name
            expected += local.numel() * local.element_size()
    assert sorted(result.prequantized) == sorted(chosen) and len(chosen) == 4
    assert result.bytes_read == expected, (result.bytes_read, expected)
    finite = True
    if layout == "single":  # the model runs on the transposed quantized experts (EP needs a token dispatch: not here)
        ids = torch.randint(0, pr.GPTOSS["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            finite = bool(torch.isfinite(model(ids).logits).all())
    return {"read": result.bytes_read, "file": result.file_bytes, "finite": finite}


@pytest.mark.parametrize("layout", ["ep2", "single"])
def test_gptoss_mxfp4_experts_load_as_stored(ranks, producer_checkpoints, layout):
    """FSDP2 refuses the transposed views these experts are (fully_shard: "needs contiguous parameters")."""
    path = producer_checkpoints["gptoss"]
    # bytes read equal the slices exactly (checked on the ranks); under EP the dense attention is replicated
    for s in ranks(2).run(load_gptoss, layout, path) if layout == "ep2" else [load_gptoss(layout, path)]:
        assert s["finite"] and s["read"] <= s["file"], s


@pytest.mark.parametrize("kind", ["ct_w8a8", "ct_fp8"])
def test_prequantized_w8a8_model_at_tp2_equals_one_process(ranks, producer_checkpoints, kind):
    """A W8A8 / FP8-dynamic checkpoint loaded as stored runs at TP 2 with its activation scheme: the row-parallel
    layers reduce each token's statistic over the ranks, so every activation gets its one-process code and the
    logits differ from one process only by the ranks' float sums of partial outputs (a few ulps of the largest
    logit; float32 model)."""
    for r in ranks(2).run(tp2_logits, producer_checkpoints[kind]):
        tp, one = r["tp2"], r["single"]
        assert torch.isfinite(tp).all()
        bound = 64 * torch.finfo(torch.float32).eps * float(one.abs().max())
        assert float((tp - one).abs().max()) <= bound, (float((tp - one).abs().max()), bound)
