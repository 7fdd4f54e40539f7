"""The slots of _core/registry.py: code a lower layer calls, provided from above when the package is imported."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core import registry
from dtensor_quant._core.dispatch import METHODS


def test_every_declared_slot_is_provided_by_a_module_above_after_import():
    slots = registry.slots()
    assert {"trainable", "quantize_like", *(f"QuantizedTensor.{m}" for m in METHODS)} <= set(slots)
    for name, slot in slots.items():
        if name.startswith("test_registry."):  # declared by the tests below
            continue
        assert slot.fn is not None, f"{name} is provided by nothing after import dtensor_quant"
        assert slot.fn.__module__.startswith("dtensor_quant."), slot


def test_the_trainable_slot_answers_for_frozen_and_trainable_weights():
    torch.manual_seed(0)
    frozen = torch.nn.Sequential(torch.nn.Linear(64, 32))
    live = torch.nn.Sequential(torch.nn.Linear(64, 32))
    dq.quantize_(frozen, dq.Int8Rowwise())
    dq.quantize_(live, dq.Int8Rowwise(), trainable=True)
    trainable = registry.slot("trainable")
    assert trainable(frozen[0].weight) is None
    assert trainable(live[0].weight) is not None


def test_a_slot_is_declared_once_and_provided_once():
    slot = registry.declare("test_registry.example", "(x) -> x + 1", unprovided=lambda x: None)
    assert slot(1) is None  # nothing provides it yet: the declared answer
    with pytest.raises(RuntimeError, match="declared twice"):
        registry.declare("test_registry.example", "again")
    with pytest.raises(RuntimeError, match=r"no slot .test_registry\.missing. is declared"):
        registry.provides("test_registry.missing")(lambda x: x)

    @registry.provides("test_registry.example")
    def plus_one(x):
        return x + 1

    assert slot(1) == 2 and registry.slot("test_registry.example") is slot
    with pytest.raises(RuntimeError, match="cannot also be provided"):
        registry.provides("test_registry.example")(lambda x: x)


def test_a_slot_without_a_provider_or_an_answer_says_what_to_import():
    slot = registry.declare("test_registry.needs_package", "(x) -> y")
    with pytest.raises(RuntimeError, match="import dtensor_quant"):
        slot(0)
