"""model/peft_merge and model/peft_layer on live ranks: PEFT adapters (with a LoRA bias) merged into tensor-parallel
quantized Linears stay sharded and equal the one-process merge; adapters made for a local shard are refused."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.testing import assert_same_bits, mesh

peft = pytest.importorskip("peft", reason="peft (a test extra) is what this merges")


def _base():
    torch.manual_seed(0)
    return dq.quantize_(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).bfloat16(), dq.Int8Rowwise())


def _lora(model, register: bool):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0", "2"], init_lora_weights=False, lora_bias=True)
    torch.manual_seed(1)
    return peft.get_peft_model(model, dq.lora.peft_config(config) if register else config)


def _sharded(register: bool):
    """The PEFT model made whole, then its base Linears sharded (the adapters stay whole on every rank)."""
    plan = {"base_model.model.0.base_layer": ColwiseParallel(), "base_model.model.2.base_layer": RowwiseParallel()}
    return parallelize_module(_lora(_base(), register), mesh(2), plan)


def merged_shards_equal_the_one_process_merge():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's rounding warning
        want = dq.lora.merge_and_unload(_lora(_base(), False))
        ours = dq.lora.merge_and_unload(_sharded(False))
        peft_own = _sharded(True).merge_and_unload()
    for i in ("0", "2"):
        for merged in (ours, peft_own):
            w, b = merged.get_submodule(i).weight, merged.get_submodule(i).bias
            assert isinstance(w, DTensor) and isinstance(w.to_local(), dq.QuantizedTensor), i
            assert_same_bits(w.full_tensor(), want.get_submodule(i).weight, f"{i}.weight")
            assert torch.equal(b.full_tensor(), want.get_submodule(i).bias), f"{i}.bias"
        assert_same_bits(ours.get_submodule(i).weight.to_local(), peft_own.get_submodule(i).weight.to_local(), i)
    return True


def test_tensor_parallel_merges_equal_the_one_process_merge(ranks):
    assert ranks(2).run(merged_shards_equal_the_one_process_merge, timeout=300) == [True, True]


def adapters_of_a_local_shard_are_refused():
    model = parallelize_module(_base(), mesh(2), {"0": ColwiseParallel()})  # sharded first: PEFT sees local shapes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = _lora(model, False)
    before = model[0].weight
    try:
        dq.lora.merge_and_unload(peft_model)
    except ValueError as e:
        assert model[0].weight is before  # nothing changed
        return str(e)
    raise AssertionError("merged adapters made for a local shard")


def test_adapters_made_for_a_local_shard_are_refused_on_every_rank(ranks):
    for message in ranks(2).run(adapters_of_a_local_shard_are_refused, timeout=300):
        assert "local shard" in message and "before sharding" in message
