"""dq.quantize and autograd: what becomes of a tensor that requires grad (dtensor_quant/_parallel/quantize.py).

Quantizing has no gradient. A leaf with ``requires_grad=True`` (a parameter)
is quantized as a frozen weight, as ``quantize_`` freezes the weights it
quantizes; a tensor inside an autograd graph is refused, since its graph
would be cut without a word.
"""

import pytest
import torch
from torch import nn

import dtensor_quant as dq

FMT = dq.Int8Rowwise()


def test_a_parameter_is_quantized_frozen_as_quantize_model_freezes_it():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    weight = linear.weight
    q = dq.quantize(weight, FMT)
    assert not q.requires_grad and weight.requires_grad  # the input keeps its own flag
    dq.testing.assert_same_bits(q, dq.quantize(weight.detach(), FMT), "the parameter's values")
    dq.quantize_(linear, FMT)
    assert not linear.weight.requires_grad  # what quantize_ makes of the same parameter
    dq.testing.assert_same_bits(linear.weight, q, "quantize_")


def test_a_tensor_inside_an_autograd_graph_is_refused_naming_detach_and_trainable():
    leaf = torch.randn(32, 64, requires_grad=True)
    computed = leaf * 2
    with pytest.raises(ValueError, match=r"autograd graph \(grad_fn=MulBackward0\).*detach\(\).*trainable=True"):
        dq.quantize(computed, FMT)
    expected = dq.quantize(computed.detach(), FMT)
    with torch.no_grad():  # gradients off: nothing to cut, the values are quantized
        dq.testing.assert_same_bits(dq.quantize(computed, FMT), expected, "under no_grad")
    leaf.sum().backward()  # the graph was left as it was
    assert torch.equal(leaf.grad, torch.ones_like(leaf))
