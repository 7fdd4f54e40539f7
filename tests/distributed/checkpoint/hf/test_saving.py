"""checkpoint/hf/saving on live ranks: dq.hf.save loses nothing:
every placement, LoRA wrappers (the library's and peft's), padded MLPs, failures.

Each export is read back with the safetensors package (and ``from_pretrained``)
and compared with the one-process reference: the same checkpoint loaded into
the same model in one process, dequantized. Quantizing a sharded weight gives
the bytes of quantizing it whole, so the dequantized values are the same
computation and are compared bit for bit.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh, rank
from tests.support import hf_cases as hc
from tests.support.hf_export_cases import build, peft_model

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

WORLD = {"single": 1, "tp2": 2, "fsdp2": 2, "2d": 4, "hsdp": 4, "ep2": 2}


def dense_values(model) -> dict[str, torch.Tensor]:
    """Every parameter of a one-process model as the bf16 values an export should hold."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = (t.dequantize(torch.bfloat16) if isinstance(t, dq.QuantizedTensor) else t).detach().clone()
    return out


def placements_of(model) -> set[str]:
    return {str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}


def load_and_save(kind, layout, fmt_name, src, out):
    model = build(kind, layout, fmt_name)
    dq.hf.load(model, src)
    dq.hf.save(model, out, max_shard_bytes=200_000)  # several files and an index
    return placements_of(model)


def assert_export_equals(out, expected: dict[str, torch.Tensor]) -> None:
    got = hc.read_all(out)
    assert set(got) == set(expected), set(got) ^ set(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, (k, got[k].shape, v.shape)
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


SAVE_CASES = [
    ("llama", "tp2", "int8", "Shard(dim=0)"),
    ("llama", "fsdp2", "int4g128", "Shard(dim=0)"),
    # FSDP2 over TP: column-parallel weights are (_StridedShard(0), Shard(0)); before the fix every one was written
    # with half its rows zero (ranks filtered by is_shard(), which is False for _StridedShard)
    ("llama", "2d", "int8", "_StridedShard"),
    ("llama", "hsdp", "int8", "Replicate(), Shard(dim=0)"),  # one replica of each shard writes
    ("qwen3moe", "ep2", "int8", "Shard(dim=0)"),  # fused expert stacks split by expert
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,fmt_name,placement", SAVE_CASES, ids=[c[1] for c in SAVE_CASES])
def test_export_of_every_placement_equals_one_process(ranks, sources, tmp_path, kind, layout, fmt_name, placement):
    out = str(tmp_path / "export")
    seen = ranks(WORLD[layout]).run(load_and_save, kind, layout, fmt_name, sources[kind], out)[0]
    assert any(placement in s for s in seen), seen  # the placement under test is really there
    reference = build(kind, "single", fmt_name)
    dq.hf.load(reference, sources[kind])
    assert_export_equals(out, dense_values(reference))
    if layout == "2d":
        _, model_cls = hc.model_class(kind)
        back, info = model_cls.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        expected = dense_values(reference)
        for k, v in back.named_parameters():
            assert torch.equal(v.detach(), expected[k]), k


# -- LoRA: the library's adapters and peft's, merged or refused ---------------------------------


def bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bf16 units in the last place between two bf16 tensors of the same shape."""
    ia, ib = (x.view(torch.int16).int() for x in (a, b))
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude to a monotone integer line
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def merged_reference(weight: torch.Tensor, pairs) -> torch.Tensor:
    """``W + sum(scaling * B @ A)`` in fp32 over the whole weight, then bf16."""
    weight = weight.detach()
    w = weight.dequantize(torch.float32) if isinstance(weight, dq.QuantizedTensor) else weight.float()
    for a, b, s in pairs:
        w = w + (b.detach().float() @ a.detach().float()) * s
    return w.to(torch.bfloat16)


def peft_expected(wrapped) -> dict[str, torch.Tensor]:
    """The export's values of the peft model, merged by the formula, under the checkpoint's names."""
    out = {}
    base = wrapped.get_base_model()
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            pairs = [(module.lora_A[a].weight, module.lora_B[a].weight, module.scaling[a]) for a in module.lora_A]
            out[name + ".weight"] = merged_reference(module.base_layer.weight.detach(), pairs)
    return out


def save_peft(src, out, fmt_name, layout):
    wrapped = peft_model(src, fmt_name)
    expected = peft_expected(wrapped)
    if layout == "fsdp2":
        for layer in wrapped.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh(2))
        fully_shard(wrapped.get_base_model(), mesh=mesh(2))
    dq.hf.save(wrapped, out)  # the PeftModel itself: its names are read through the model it wraps
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("layout,fmt_name", [("single", None), ("fsdp2", "int8")])
def test_peft_lora_is_merged_on_save(ranks, sources, tmp_path, layout, fmt_name):
    """Before the fix the export held ``base_layer``/``lora_A`` keys and from_pretrained drew random q_proj weights."""
    pytest.importorskip("peft")
    out = str(tmp_path / "merged")
    if layout == "single":
        expected = save_peft(sources["llama"], out, fmt_name, layout)
    else:
        expected = ranks(2).run(save_peft, sources["llama"], out, fmt_name, layout)[0]
    assert len(expected) == 2
    got = hc.read_all(out)
    assert not [k for k in got if "lora" in k or "base_layer" in k], sorted(got)
    for k, v in expected.items():
        # the export sums each rank's rows of B @ A; the reference the whole product: one rounding apart at most
        assert bf16_ulps_apart(got[k], v) <= 1, k
    _, model_cls = hc.model_class("llama")
    _, info = model_cls.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.slow  # 14 s: a 2-D mesh of 4 ranks saving and reloading a merged model
def test_dq_lora_is_merged_on_save_under_2d(ranks, sources, tmp_path):
    """The library's LoRALinear on a FSDP2 x TP model: the adapters live on other meshes than their weights."""
    out = str(tmp_path / "merged")
    expected = ranks(4).run(save_dq_lora_2d, sources["llama"], out)[0]
    got = hc.read_all(out)
    assert not [k for k in got if "lora" in k or ".base." in k], sorted(got)
    assert len(expected) == 2
    for k, v in expected.items():
        assert bf16_ulps_apart(got[k], v) <= 1, k


def save_dq_lora_2d(src, out):
    model = build("llama", "single", "int8")
    dq.hf.load(model, src)
    dq.lora.add_lora_(model, rank=4, filter_fn=lambda m, fqn: fqn.endswith(("q_proj", "down_proj")))
    expected = {}
    with torch.no_grad():
        for i, p in enumerate(dq.lora.lora_parameters(model).values()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    for name, m in model.named_modules():
        if isinstance(m, dq.lora.LoRALinear):
            pairs = [(m.lora_a.weight, m.lora_b.weight, m.scaling)]
            expected[name + ".weight"] = merged_reference(m.base.weight, pairs)
    m2 = mesh(2, 2)
    plan = dq.lora.lora_tp_plan({k: v for k, v in dq.hf.tp_plan(model).items() if not k.startswith("lm_head")})
    parallelize_module(model, m2["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=m2["dp"])
    fully_shard(model, mesh=m2["dp"])
    dq.hf.save(model, out)
    return expected


# -- padded MLPs: written at the recorded original size -------------------------------------------

PADDED = dict(hc.CONFIG, hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=128, vocab_size=128)  # fmt: skip


def padded_model(src):
    """Int4 g128 at TP 2: 384 = 3 groups, so down_proj's 192 columns per rank cut a group; pad_for_tp pads to 512."""
    _, model_cls = hc.model_class("llama")
    model = model_cls.from_pretrained(src, dtype=torch.bfloat16)
    dq.quantize_(model, dq.Int4Groupwise(128), filter_fn=lambda m, fqn: fqn != "lm_head")
    padded = dq.pad_for_tp(model, 2, dq.Int4Groupwise(128))
    assert padded == {"model.layers.0.mlp": (384, 512)}, padded
    return model


def save_padded(src, out, poison_rank=None):
    model = padded_model(src)
    parallelize_module(model, mesh(2), dq.hf.tp_plan(model))
    if rank() == poison_rank:  # this rank's gate rows are 256..511, of which 384.. are padding: make them non-zero
        gate = model.model.layers[0].mlp.gate_proj
        gate.weight = torch.nn.Parameter(
            DTensor.from_local(
                torch.ones_like(gate.weight.to_local().dequantize()), mesh(2), gate.weight.placements,
                shape=gate.weight.shape, stride=gate.weight.stride(), run_check=False,
            ),
            requires_grad=False,
        )  # fmt: skip
    start = time.monotonic()
    try:
        dq.hf.save(model, out)
    except ValueError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "saved", "", time.monotonic() - start


@pytest.fixture(scope="module")
def padded_source(tmp_path_factory):
    config_cls, model_cls = hc.model_class("llama")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("padded") / "src"
    model_cls(config_cls(**PADDED)).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_padded_model_is_saved_unpadded(ranks, padded_source, tmp_path):
    """Before the fix the export held 512-wide MLP weights and from_pretrained refused it (config says 384)."""
    out = str(tmp_path / "export")
    for kind, msg, _ in ranks(2).run(save_padded, padded_source, out):
        assert kind == "saved", msg
    _, model_cls = hc.model_class("llama")
    back, info = model_cls.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference = model_cls.from_pretrained(padded_source, dtype=torch.bfloat16)
    dq.quantize_(reference, dq.Int4Groupwise(128), filter_fn=lambda m, fqn: fqn != "lm_head")
    expected = dense_values(reference)  # quantized without padding: group statistics never see the padding
    for k, v in back.named_parameters():
        assert torch.equal(v.detach(), expected[k]), k
    assert "tp_padding" not in json.dumps(sorted(hc.read_all(out)))


def load_into_padded(src):
    """A padded TP-2 model (random weights first) loading the unpadded checkpoint: zeros past the original size."""
    config_cls, model_cls = hc.model_class("llama")
    model = model_cls(config_cls(**PADDED)).to(torch.bfloat16)
    dq.quantize_(model, dq.Int4Groupwise(128), filter_fn=lambda m, fqn: fqn != "lm_head")
    dq.pad_for_tp(model, 2, dq.Int4Groupwise(128))
    parallelize_module(model, mesh(2), dq.hf.tp_plan(model))
    result = dq.hf.load(model, src)
    assert "model.layers.0.mlp.down_proj.weight" in result.quantized, result
    return dense_values(model)


def test_padded_model_loads_the_unpadded_checkpoint(ranks, padded_source):
    """Before, the shapes (and the tp_padding buffer, in no checkpoint) made dq.hf.load refuse a padded model."""
    got = ranks(2).run(load_into_padded, padded_source)[0]
    expected = dense_values(padded_model(padded_source))  # loaded unpadded in one process, then padded
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert got["model.layers.0.mlp.gate_proj.weight"].shape == (512, 256)


def test_non_zero_padding_on_one_rank_is_refused_on_every_rank(ranks, padded_source, tmp_path):
    """Rank 1 alone finds the padding it would drop non-zero: both ranks raise, the previous export stays."""
    out = tmp_path / "export"
    assert {r[0] for r in ranks(2).run(save_padded, padded_source, str(out))} == {"saved"}
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    results = ranks(2).run(save_padded, padded_source, str(out), 1, timeout=60)
    for kind, msg, seconds in results:
        assert kind == "ValueError" and "gate_proj.weight" in msg and "non-zero" in msg, (kind, msg)
        assert seconds < 30, seconds
    assert "rank 1 failed" in results[0][1]
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before
    assert not (out / ".dq_hf_save.partial").exists()


# -- failures raise on every rank, promptly -----------------------------------------------------


def save_into(src, out):
    model = build("llama", "tp2", "int8")
    dq.hf.load(model, src)
    start = time.monotonic()
    try:
        dq.hf.save(model, out)
    except OSError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "saved", "", time.monotonic() - start


def test_unwritable_path_raises_on_every_rank(ranks, sources, tmp_path):
    """Before the fix rank 0 raised and rank 1 waited in a barrier until the process group's timeout."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    results = ranks(2).run(save_into, sources["llama"], str(blocker / "export"), timeout=60)
    for kind, msg, seconds in results:
        assert kind in ("NotADirectoryError", "FileExistsError"), (kind, msg)
        assert "a_file" in msg and seconds < 30, (msg, seconds)
    assert results[1][0] == results[0][0] and "rank 0 failed" in results[1][1]


def save_plain_into(src, out):
    """Every rank calls save with a model without DTensors: rank 0 writes it."""
    model = build("llama", "single", "int8")
    dq.hf.load(model, src)
    try:
        dq.hf.save(model, out)
    except OSError as e:
        return type(e).__name__, str(e)
    return "saved", ""


def test_unwritable_path_raises_on_every_rank_for_a_model_without_dtensors(ranks, sources, tmp_path):
    """Before the fix rank 0 raised and rank 1 returned as if it had saved (rank 0 alone writes such a model)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    results = ranks(2).run(save_plain_into, sources["llama"], str(blocker / "export"), timeout=60)
    for kind, msg in results:
        assert kind in ("NotADirectoryError", "FileExistsError") and "a_file" in msg, (kind, msg)
    out = tmp_path / "export"
    assert ranks(2).run(save_plain_into, sources["llama"], str(out), timeout=60) == [("saved", "")] * 2
    reference = build("llama", "single", "int8")
    dq.hf.load(reference, sources["llama"])
    assert_export_equals(str(out), dense_values(reference))


def save_plain_failing(src, padded_src, out, how, group):
    """Every rank saves a model without DTensors that fails ``how``: a check (the padding pad_for_tp added is
    non-zero; a tensor on the meta device) or one of rank 0's writes (its file-size limit; the config's
    save_pretrained). ``group``: pass the world as ``process_group``. Returns (exception type or "saved", message)."""
    import resource
    import signal

    import torch.distributed as dist

    if how == "padding":
        model = padded_model(padded_src)
        gate = model.model.layers[0].mlp.gate_proj  # rows 384.. of 512 are padding: make them non-zero
        gate.weight = torch.nn.Parameter(torch.ones(gate.weight.shape, dtype=torch.bfloat16), requires_grad=False)
    elif how == "meta":
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    else:
        model = build("llama", "single", "int8")
        dq.hf.load(model, src)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if how == "file size" and rank() == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit raises EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    if how == "config" and rank() == 0:
        model.config.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(OSError("the config cannot be written"))
    try:
        dq.hf.save(model, out, process_group=dist.group.WORLD if group else None)
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    return "saved", ""


@pytest.mark.parametrize("group", [False, True], ids=["alone", "process_group"])
def test_every_failure_of_a_model_without_dtensors_is_raised_on_every_rank(
    ranks, sources, padded_source, tmp_path, group
):
    """The checks every calling rank makes (before: the padding and a meta tensor raised on rank 0 alone, a meta
    tensor as numpy's TypeError); with process_group, rank 0's failed writes too. Alone, those raise on rank 0
    only (documented: the others do not wait for its writes)."""
    expected = {"padding": ("ValueError", "non-zero"), "meta": ("ValueError", "meta device"),
                "file size": ("OSError", "File too large"), "config": ("OSError", "cannot be written")}  # fmt: skip
    for how, (kind, words) in expected.items():
        out = str(tmp_path / f"{how}-{group}")
        results = ranks(2).run(save_plain_failing, sources["llama"], padded_source, out, how, group, timeout=120)
        assert results[0][0] == kind and words in results[0][1], (how, results)
        if group or how in ("padding", "meta"):
            assert results[1][0] == kind and words in results[1][1], (how, results)
        else:
            assert results[1] == ("saved", ""), (how, results)
        assert not (tmp_path / f"{how}-{group}" / "model.safetensors").exists(), how


def load_from(paths):
    model = build("llama", "tp2", "int8")
    start = time.monotonic()
    try:
        dq.hf.load(model, paths[rank()])
    except ValueError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "loaded", "", time.monotonic() - start


def test_checkpoint_refused_on_one_rank_raises_on_every_rank(ranks, sources, tmp_path):
    """Rank 1 reads a damaged copy (a node-local disk): before the fix rank 0 went on into the load's collectives."""
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(sources["llama"], damaged)
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) // 2])
    results = ranks(2).run(load_from, [sources["llama"], str(damaged)], timeout=60)
    for kind, msg, seconds in results:
        assert kind == "CheckpointFormatError" and "damaged/model.safetensors" in msg, (kind, msg)
        assert seconds < 30, seconds
    assert "rank 1 failed" in results[0][1]


def save_scattered(out):
    """A weight whose rank slices are not boxes: Shard(0) then _StridedShard(0, 2) gives rank (0, 0) rows 0, 2, ..."""
    from dtensor_quant.testing import placements

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6).to(torch.bfloat16)
    module = torch.nn.Linear(6, 8, bias=False)
    dt = distribute_tensor(full, mesh(2, 2), placements("S0,SS0:2"))
    module.weight = torch.nn.Parameter(dt, requires_grad=False)
    assert torch.equal(dt.full_tensor(), full)
    dq.hf.save(module, out)
    try:
        dq.hf.load(module, out)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_a_scattered_slice_is_saved_box_by_box_and_refused_on_load(ranks, tmp_path):
    out = str(tmp_path / "export")
    messages = ranks(4).run(save_scattered, out)
    assert torch.equal(hc.read_all(out)["weight"], torch.arange(48, dtype=torch.float32).reshape(8, 6).bfloat16())
    assert all("separate boxes" in m for m in messages), messages


def rank0_alone(src, out):
    """Rank 0 loads and saves a model without DTensors while rank 1 does something else (the example's pattern)."""
    if rank() != 0:
        return "elsewhere"
    model = build("llama", "single", "int8")
    dq.hf.load(model, src)
    dq.hf.save(model, out)
    return "done"


def test_one_rank_loads_and_saves_a_plain_model_alone(ranks, sources, tmp_path):
    """A model without DTensors is this process's: its load and save agree with nobody (no collective to hang in)."""
    out = str(tmp_path / "export")
    assert ranks(2).run(rank0_alone, sources["llama"], out, timeout=60) == ["done", "elsewhere"]
    reference = build("llama", "single", "int8")
    dq.hf.load(reference, sources["llama"])
    assert_export_equals(out, dense_values(reference))


# -- the load tests' checkpoints, exported: dense and FP8 blocks as stored ------------------------------


def save_and_report(kind, layout, fmt_name, src, out):
    model = hc.build(kind, layout, fmt_name)  # the larger models of dq.hf's load tests
    dq.hf.load(model, src)
    dq.hf.save(model, out, max_shard_bytes=400_000 if layout == "tp2" else 5 << 30)  # TP-2: an index of files
    full = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        full[name] = t.dequantize() if isinstance(t, dq.QuantizedTensor) else t.detach().clone()
    return full


@pytest.mark.parametrize("kind,layout", [("qwen2", "tp2"), ("qwen2", "fsdp2"), ("qwen3moe", "ep2")])
def test_save_dense_export_reads_with_from_pretrained(ranks, checkpoints, tmp_path, kind, layout):
    _, model_cls = hc.model_class(kind)
    out = str(tmp_path / "export")
    fmt_name = "int8" if kind == "qwen3moe" else "int4g128"
    expected = hc.on(ranks, layout, save_and_report, kind, layout, fmt_name, checkpoints[kind, True], out)[0]
    from pathlib import Path

    assert (Path(out) / "model.safetensors.index.json").exists() == (layout == "tp2")
    back = model_cls.from_pretrained(out, dtype=torch.bfloat16)
    got = dict(back.named_parameters())
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k].detach(), v.to(torch.bfloat16)), k
    tokens = torch.randint(0, hc.CONFIG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(back(tokens).logits).all()


def test_save_fp8_block_writes_the_stored_bytes(ranks, fp8_checkpoints, tmp_path):
    out = str(tmp_path / "export")
    ranks(2).run(save_and_report, "llama", "tp2", "f8block128", fp8_checkpoints[True], out)
    src, back = hc.read_all(fp8_checkpoints[True]), hc.read_all(out)
    assert set(src) == set(back)
    for k, v in src.items():
        assert v.dtype == back[k].dtype and torch.equal(v.view(torch.uint8), back[k].view(torch.uint8)), k
    import json
    from pathlib import Path

    assert json.loads((Path(out) / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
