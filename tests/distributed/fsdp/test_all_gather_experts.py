"""fsdp/all_gather on live ranks, for quantized expert stacks:
QLoRA on a tiny transformers Mixtral / Qwen3-MoE, and DCP reshards.

The experts ``[E, out, in]`` are frozen quantized parameters that FSDP2 shards
along the expert dim (``Shard(0)``, uneven when the ranks do not divide the
experts, some ranks holding none when there are fewer experts than ranks);
LoRA adapters on the attention projections train. Losses equal one process.
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.lora import add_lora_
from dtensor_quant.testing import FORMATS, mesh, tiny_llama
from tests.support.examples import moe_inference
from tests.support.training import train

STEPS, BATCH, SEQ = 3, 8, 8


class Logits(nn.Module):
    """The transformers model as ``tokens -> logits`` (what the shared training loop calls)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens).logits


def moe_qlora(kind, fmt_name, experts, impl="eager"):
    model = moe_inference.tiny_moe(kind, torch.float32, seed=0, experts=experts)
    model.set_experts_implementation(impl)
    dq.quantize_(model, FORMATS[fmt_name])
    add_lora_(model, rank=4, alpha=8, filter_fn=lambda m, fqn: "self_attn" in fqn, seed=1)
    return Logits(model)


def data():
    return list(tiny_llama.synthetic_batches(STEPS, BATCH, SEQ, 128, noise=0.2, seed=3))


@functools.cache
def reference(kind, fmt_name, experts, impl):
    return tuple(train(moe_qlora(kind, fmt_name, experts, impl), data(), lr=1e-2))


def fsdp_moe_qlora(kind, fmt_name, experts, impl):
    world = torch.distributed.get_world_size()
    model = moe_qlora(kind, fmt_name, experts, impl)
    dp = mesh(world)
    for layer in model.model.model.layers:
        fully_shard(layer, mesh=dp, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mesh=dp, mp_policy=MixedPrecisionPolicy())
    stack = model.model.model.layers[0].mlp.experts.gate_up_proj
    local = stack.to_local()
    assert isinstance(local, dq.QuantizedTensor) and stack.shape[0] == experts
    losses = train(model, data(), lr=1e-2, dp_group=dp.get_group())
    with wire.record() as log, torch.no_grad():
        model(data()[0][:2])
    sent = log.all_gathers().nbytes  # what this rank contributed to one forward's all-gathers
    dense = sum(4 * p.numel() for p in model.parameters()) / world  # the same shards in float32
    return losses, local.shape[0], sent / dense


@pytest.mark.parametrize(
    "world,kind,fmt_name,experts,impl",
    [
        pytest.param(2, "mixtral", "int8", 4, "eager", id="2r-mixtral-int8"),
        # fewer experts than ranks: one rank holds none
        pytest.param(4, "mixtral", "int4g64", 3, "eager", id="4r-3experts-int4", marks=pytest.mark.slow),
        pytest.param(2, "qwen3_moe", "nf4b64s8", 3, "grouped_mm", id="2r-qwen3-nf4-uneven-grouped_mm"),
        pytest.param(4, "qwen3_moe", "f8row", 4, "eager", id="4r-qwen3-f8", marks=pytest.mark.slow),
    ],
)
def test_fsdp2_qlora_on_quantized_experts(ranks, world, kind, fmt_name, experts, impl):
    results = ranks(world).run(fsdp_moe_qlora, kind, fmt_name, experts, impl, timeout=300)
    expected = reference(kind, fmt_name, experts, impl)
    for losses, _, ratio in results:
        assert losses == pytest.approx(list(expected), rel=2e-5), (losses, expected)
        assert ratio < 0.4, ratio  # the experts travel as their stored bytes (float32 would be 1.0)
    assert expected[-1] < expected[0]
    per_rank = [n for _, n, _ in results]
    assert sum(per_rank) == experts and max(per_rank) == -(-experts // world)


def _experts_on_dim_1(param):
    return Shard(1) if param.ndim == 3 else None


def refuse_shard_1():
    model = moe_qlora("mixtral", "int8", 4)
    try:
        fully_shard(model.model.model.layers[0], mesh=mesh(2), shard_placement_fn=_experts_on_dim_1)
    except ValueError as e:
        return str(e)
    return "not refused"


def test_shard_placement_fn_dim1_is_refused_with_the_alternative(ranks):
    for message in ranks(2).run(refuse_shard_1):
        assert "Shard(0)" in message and "fewer experts than ranks" in message, message
