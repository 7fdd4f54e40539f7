"""Single-process checks of N-D (mixture-of-experts) weights: quantize, slice, select, forward.

Every built-in format and a user format quantize ``[experts, out, in]`` with
their 2-D math per expert; the derived ops work along all three dims; a tiny
transformers Mixtral and Qwen3-MoE run their own forward (eager per-expert
loop and the grouped_mm path) on quantized experts.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from extra_formats import EXTRA_FORMATS
from torch.distributed.tensor import Replicate, Shard

import dtensor_quant as dq
from dtensor_quant.testing import assert_same_bits, pick, weight

# every relation at (3, 64, 512): the built-ins at blocks that fit, and the test-only user formats
EXPERT_FORMATS = [*pick("int8", "f8row", "f8tensor", "f8block32", "int4g64", "nf4").values(), *EXTRA_FORMATS.values()]


@pytest.mark.parametrize("fmt", EXPERT_FORMATS, ids=str)
def test_experts_quantize_like_each_expert_alone(fmt):
    w = weight((3, 64, 512))
    q = dq.quantize(w, fmt)
    assert q.shape == w.shape and q.dtype == w.dtype
    for e in range(3):
        alone = dq.quantize(w[e].clone(), fmt)
        assert_same_bits(q[e], alone, f"expert {e}")  # select of one expert: the same bytes as quantizing it alone
        assert torch.equal(q[e].dequantize(), alone.dequantize())
    assert torch.equal(q.dequantize(), torch.stack([dq.quantize(w[e], fmt).dequantize() for e in range(3)]))
    # 4-D: two leading dims
    q4 = dq.quantize(w.reshape(3, 1, 64, 512), fmt)
    assert_same_bits(q4[2][0], dq.quantize(w[2], fmt), "4-D [2][0]")


@pytest.mark.parametrize("fmt", EXPERT_FORMATS, ids=str)
def test_expert_ops_along_every_dim(fmt):
    w = weight((4, 64, 512), seed=1)
    q = dq.quantize(w, fmt)
    dense = q.dequantize()
    for dim, size in ((0, 1), (0, 3), (1, 32), (1, 64 // 2), (2, 256)):
        try:
            parts = torch.split(q, size, dim)
        except dq.LayoutError:
            assert dim > 0  # a block along a matrix dim may forbid the cut; experts never do
            continue
        assert [p.shape[dim] for p in parts] == [p.shape[dim] for p in torch.split(dense, size, dim)]
        for p, d in zip(parts, torch.split(dense, size, dim)):
            assert torch.equal(p.dequantize(), d)
        assert torch.equal(torch.cat(parts, dim).dequantize(), dense)
    # narrow of experts, transpose of the matrix dims, index with a tensor, unbind
    assert torch.equal(q[1:3].dequantize(), dense[1:3])
    assert torch.equal(q.transpose(-2, -1).dequantize(), dense.transpose(-2, -1))
    assert torch.equal(q.transpose(1, 2)[3].dequantize(), dense[3].t())
    assert torch.equal(q[torch.tensor([3, 0, 3])].dequantize(), dense[[3, 0, 3]])
    assert [torch.equal(a.dequantize(), b) for a, b in zip(q.unbind(0), dense.unbind(0))] == [True] * 4
    with pytest.raises(dq.UnsupportedOpError, match="leading"):
        q.select(1, 0)


@pytest.mark.parametrize("fmt", [dq.Int8Rowwise(), dq.Int4Groupwise(64), dq.NF4(64, 256), dq.Float8Rowwise()], ids=str)
def test_selected_expert_takes_the_linear_kernels(fmt):
    w = weight((3, 64, 512), seed=2)
    q = dq.quantize(w, fmt)
    x = weight((5, 512), seed=3)
    for e in range(3):
        expected = F.linear(x, dq.quantize(w[e], fmt))
        assert torch.equal(F.linear(x, q[e]), expected)  # same kernel, same bits
        assert torch.equal(F.linear(x, q.transpose(1, 2)[e].t()), expected)


@pytest.mark.parametrize("fmt", [dq.Int8Rowwise(), dq.NF4(64, 256)], ids=str)
def test_grouped_mm_matches_a_loop_over_experts(fmt):
    w = weight((4, 64, 512), seed=4)
    q = dq.quantize(w, fmt)
    x = weight((10, 512), seed=5)
    offs = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # expert 1 gets no rows; row 9 is past the end
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    starts = [0, 3, 3, 7]
    for g in range(4):
        s, e = starts[g], int(offs[g])
        assert torch.equal(out[s:e], F.linear(x[s:e], q[g]))
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))
    x3 = weight((4, 2, 512), seed=6)
    out3 = torch._grouped_mm(x3, q.transpose(-2, -1))
    assert all(torch.equal(out3[g], F.linear(x3[g], q[g])) for g in range(4))


def test_grouped_mm_refuses_invalid_offs():
    """Before: decreasing offs dropped groups and ends past the input returned other row counts, silently."""
    q = dq.quantize(weight((3, 64, 512), seed=4), dq.Int8Rowwise())
    x = weight((10, 512), seed=5)
    cases = {
        "non-decreasing": torch.tensor([4, 2, 9], dtype=torch.int32),  # group 1 would be dropped: 8 rows of 10
        "non-negative": torch.tensor([-2, 3, 9], dtype=torch.int32),
        "past the input's 10 rows": torch.tensor([3, 7, 12], dtype=torch.int32),  # 12 rows out of 10 in
        "integer tensor": torch.tensor([3.0, 7.0, 9.0]),
        r"one end per expert \(3\)": torch.tensor([3, 9], dtype=torch.int32),
    }
    for words, offs in cases.items():
        with pytest.raises(ValueError, match=words):
            torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=torch.tensor([0, 10, 10]))  # int64 and empty groups: fine
    assert out.shape == (10, 64) and torch.equal(out, F.linear(x, q[1]))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("fmt", [dq.NF4(), dq.Float8Rowwise(), dq.Int4Groupwise(128), dq.Int8Rowwise()], ids=str)
def test_moe_layer_runs_each_experts_tokens_through_kernels_without_a_dense_expert(monkeypatch, fmt, impl):
    """A MixtralExperts layer at Qwen3-30B-A3B's widths (H 2048, I 768; 4 experts), 12 tokens top-2: both the
    eager per-expert loop and grouped_mm run every expert's rows through the format's kernels (one-token or
    tiled) and never dequantize an expert; the output is the dequantized layer's within the kernels' rounding."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from dtensor_quant.ops.matmul import record_paths

    cfg = MixtralConfig(hidden_size=2048, intermediate_size=768, num_local_experts=4)
    torch.manual_seed(0)
    layer = MixtralExperts(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(layer.gate_up_proj, std=0.02)
    torch.nn.init.normal_(layer.down_proj, std=0.02)
    reference = copy.deepcopy(layer)
    dq.quantize_(layer, fmt)
    for name in ("gate_up_proj", "down_proj"):
        getattr(reference, name).data = getattr(layer, name).dequantize()
    for m in (layer, reference):
        m.config._experts_implementation = impl
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 2048, generator=g).to(torch.bfloat16)
    weights, index = torch.randn(12, 4, generator=g).softmax(-1).topk(2, dim=-1)
    weights = weights.to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x, index, weights)

        def refuse(*args, **kwargs):
            raise AssertionError("a dense expert was made")

        monkeypatch.setattr(type(fmt), "dequantize", refuse)
        monkeypatch.setattr(type(fmt), "unpack", refuse)
        with record_paths() as paths:
            out = layer(x, index, weights)
    assert set(paths) == {(str(fmt), "kernel")} and paths[(str(fmt), "kernel")] == 2 * len(index.unique())
    ref = expected.float()
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_empty_expert_stack():
    w = weight((0, 64, 512))
    for fmt in (dq.Int8Rowwise(), dq.NF4(64, 256), dq.Int4Groupwise(64)):
        q = dq.quantize(w, fmt)
        assert q.shape == (0, 64, 512) and q.dequantize().shape == (0, 64, 512)
        full = dq.quantize(weight((2, 64, 512)), fmt)
        assert torch.equal(torch.cat([full, q]).dequantize(), full.dequantize())


def test_bad_expert_shape_names_the_matrix():
    with pytest.raises(ValueError, match=r"each \[out, in\] matrix"):
        dq.quantize(weight((2, 8, 100)), dq.NF4(64, 256))
    with pytest.raises(ValueError, match="at least 2 dims"):
        dq.quantize(weight((64,)), dq.Int8Rowwise())


# -- transformers MoE models --------------------------------------------------------


def tiny_moe(kind: str, dtype=torch.float32, seed=0):
    """A 2-layer transformers Mixtral or Qwen3-MoE with 4 experts (real model classes, tiny widths)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64}  # fmt: skip
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=128, num_local_experts=4, **common))
    else:
        cfg = Qwen3MoeConfig(moe_intermediate_size=128, intermediate_size=256, num_experts=4, head_dim=16,
                             decoder_sparse_step=1, mlp_only_layers=[], **common)  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
    return model.to(dtype).eval()


def set_experts_impl(model, impl: str) -> None:
    model.config._experts_implementation = impl
    for m in model.modules():
        if hasattr(m, "gate_up_proj"):
            m.config._experts_implementation = impl


def dequantized_copy(model):
    out = copy.deepcopy(model)
    for m in out.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if isinstance(p, dq.QuantizedTensor):
                setattr(m, name, torch.nn.Parameter(p.dequantize(), requires_grad=False))
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize(
    "fmt",
    [
        dq.Int8Rowwise(),
        dq.Int4Groupwise(64),
        dq.NF4(64, 64),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(32),
    ],
    ids=str,
)
def test_quantize_moe_model_covers_every_expert(kind, fmt):
    model = tiny_moe(kind)
    dense = []
    dq.quantize_(model, fmt, left_dense=dense)
    experts = [n for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    assert len(experts) == 4  # two layers, two fused stacks each
    quantized = set(dq.model.quantized_fqns(model))
    assert set(experts) <= quantized
    # every parameter is either quantized or listed with a reason; the routers stay dense (listed)
    assert quantized | {n for n, _ in dense} == {n for n, _ in model.named_parameters()}
    assert {n for n, _ in dense if n.endswith("mlp.gate.weight")} == {
        f"model.layers.{i}.mlp.gate.weight" for i in range(2)
    }
    reference = dequantized_copy(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    for impl in ("eager", "grouped_mm"):
        set_experts_impl(model, impl)
        set_experts_impl(reference, impl)
        with torch.no_grad():  # the kernels sum in another order than dequantize + mm: fp32 reordering only
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5, msg=impl)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_bf16_moe_kernels_close_to_dequantized(kind):
    """bf16 activations take the int8/int4 weight-only kernels, which round differently from dequantize + mm."""
    for fmt in (dq.Int8Rowwise(), dq.Int4Groupwise(64)):
        model = dq.quantize_(tiny_moe(kind, torch.bfloat16), fmt)
        reference = dequantized_copy(model)
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(8))
        for impl in ("eager", "grouped_mm", "batched_mm"):
            set_experts_impl(model, impl)
            set_experts_impl(reference, impl)
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0.05, atol=0.05)


def test_quantize_never_skips_silently():
    model = tiny_moe("mixtral")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*multiple of block_size"):
        dq.quantize_(model, dq.NF4(96, 256))  # 64 x 64 = 4096 elements are not a multiple of 96: an error, not a skip
    dense = []
    dq.quantize_(tiny_moe("mixtral"), dq.Int8Rowwise(), lambda m, fqn: "experts" not in fqn, left_dense=dense)
    assert sum(why == "excluded by filter_fn" for _, why in dense) == 4
    with pytest.raises(ValueError, match=r"no nn.Linear weight and no fused expert"):
        dq.quantize_(torch.nn.Sequential(torch.nn.LayerNorm(8)), dq.Int8Rowwise())


# -- planner --------------------------------------------------------------------------


def test_planner_takes_expert_stacks_and_ep():
    from dtensor_quant.model.planner import plan, stored_bytes

    fmt = dq.Int4Groupwise(128)
    layers = [("experts.gate_up", (8, 2 * 1536, 2048), "colwise"), ("experts.down", (8, 2048, 1536), "rowwise"),
              ("wo", (2048, 2048), "rowwise")]  # fmt: skip
    result = plan(layers, fmt, tp=[1, 2, 3, 4], dp=[1, 2], ep=2)
    for layer, cells in result.rows:
        for c in cells:
            mesh_shape = (2, c.dp, c.tp)
            assert c.placements[0] == (Shard(0) if len(layer.shape) == 3 else Replicate())
            try:
                dq.check_placements(layer.shape, fmt, mesh_shape, c.placements)
                legal = True
            except dq.LayoutError:
                legal = False
            assert c.legal == legal, (layer, c)
    cells = {(layer.name, c.dp, c.tp): c for layer, cs in result.rows for c in cs}
    # down's 1536 inputs over tp=3: 512-column shards, a multiple of 128: legal; over tp=4: 384, legal
    assert cells[("experts.down", 1, 3)].legal and cells[("experts.down", 1, 4)].legal
    assert not cells[("wo", 1, 3)].legal and "nearest legal tp" in cells[("wo", 1, 3)].alternatives
    # bytes: 8 experts over ep=2 and dp=2 -> 2 experts per rank, each its 2-D format's bytes
    one = dq.quantize(weight((2 * 1536, 2048)), fmt).nbytes_stored
    assert cells[("experts.gate_up", 2, 1)].nbytes == 2 * one == stored_bytes(fmt, (2, 2 * 1536, 2048))
    text = str(result)
    assert "8x3072x2048" in text and "ep=2" in text


def test_planner_lists_a_models_expert_stacks():
    from dtensor_quant.model.planner import layers_of

    with torch.device("meta"):
        model = tiny_moe("mixtral")
    names = {layer.name for layer in layers_of(model)}
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= names
