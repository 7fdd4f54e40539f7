"""model/lora on one process: LoRA adapters on frozen quantized Linears, and their TP plan."""

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import dtensor_quant as dq
from dtensor_quant.lora import LoRALinear, add_lora_, lora_parameters, lora_tp_plan
from dtensor_quant.testing import weight


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 16))


def test_lora_starts_as_the_base_and_trains_only_adapters():
    model = small_model()
    x = weight((4, 64), dtype=torch.float32)
    expected = model(x)
    dq.quantize_(model, dq.Int8Rowwise(), filter_fn=lambda m, fqn: fqn == "0")
    base_out = model(x)
    add_lora_(model, rank=4, alpha=8)
    assert isinstance(model[0], LoRALinear) and isinstance(model[2], LoRALinear)
    assert torch.equal(model(x), base_out)  # lora_b starts at zero
    assert set(lora_parameters(model)) == {f"{i}.lora_{ab}.weight" for i in (0, 2) for ab in "ab"}
    model(x).sum().backward()
    assert model[0].lora_b.weight.grad is not None and model[0].base.weight.grad is None
    assert (base_out - expected).abs().max() < 0.05  # int8 base


def test_lora_same_adapters_for_the_same_seed():
    a, b = add_lora_(small_model(), seed=3), add_lora_(small_model(), seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_lora_casts_inputs_to_the_adapter_dtype():
    lin = LoRALinear(nn.Linear(16, 8, dtype=torch.bfloat16), rank=2, alpha=4)
    nn.init.normal_(lin.lora_b.weight)
    out = lin(weight((3, 16)))
    assert out.dtype == torch.bfloat16 and lin.lora_a.weight.dtype == torch.float32


def test_lora_tp_plan():
    plan = lora_tp_plan({"wq": ColwiseParallel(), "wo": RowwiseParallel(), "norm": SequenceParallel()})
    assert set(plan) == {"wq.base", "wq.lora_b", "wo.base", "wo.lora_a", "norm"}
    assert isinstance(plan["wq.lora_b"], ColwiseParallel) and isinstance(plan["wo.lora_a"], RowwiseParallel)
