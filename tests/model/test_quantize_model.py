"""model/quantize_model: ``quantize_`` of whole models, and what it refuses.

A tiny transformers Mixtral and Qwen3-MoE have every expert quantized and run
their own forward (eager per-expert loop and the grouped_mm path) on them.
(The N-D weights themselves: tests/parallel/test_shard_quant.py quantizes them,
tests/ops/test_layout_ops.py slices them, tests/ops/test_matmul.py multiplies.)
"""

import copy

import pytest
import torch

import dtensor_quant as dq

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
    quantized = set(dq.quantized_fqns(model))
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


# -- trainable quantized weights are refused before a backward -------------------------------------


def test_trainable_quantized_parameter_is_refused_before_backward_single_process():
    net = dq.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 32)), dq.Int4Groupwise(32))
    net[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"0\.weight is quantized and has requires_grad=True"):
        net(torch.randn(2, 64))
    with torch.no_grad():  # inference is fine
        net(torch.randn(2, 64))


def test_quantize_takes_a_model_and_a_format():
    """Before: AttributeError ('Tensor' object has no attribute 'named_modules'; 'str' ... 'check_weight')."""
    with pytest.raises(TypeError, match="takes a model"):
        dq.quantize_(torch.randn(4, 4), dq.Int8Rowwise())
    with pytest.raises(TypeError, match="format instance"):
        dq.quantize_(torch.nn.Linear(4, 4), "int8")
    with pytest.raises(TypeError, match="takes a weight tensor"):
        dq.quantize([[1.0, 2.0]], dq.Int8Rowwise())
