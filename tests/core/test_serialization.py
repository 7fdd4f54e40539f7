"""core/tensor: torch.save / torch.load of quantized tensors with torch.load's default ``weights_only=True``.

The library registers what a pickled QuantizedTensor names (the tensor's
rebuild function, the relations, every format class) as safe globals, so a
user's ``torch.load`` needs no ``weights_only=False``.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from torch import nn

import dtensor_quant as dq
from dtensor_quant._core.format import QuantFormat
from dtensor_quant.testing import FORMATS, assert_same_bits, weight


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True: torch's default


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_round_trips_bit_for_bit(name):
    q = dq.quantize(weight((256, 512), seed=3), FORMATS[name])
    for what, t in (("weight", q), ("transposed", q.t()), ("rows 128:", q[128:])):
        loaded = _round_trip(t)
        assert_same_bits(loaded, t, f"{name} {what}")
        assert loaded.rels == t.rels and loaded.dims == t.dims and loaded.stride() == t.stride(), what
        assert torch.equal(loaded.dequantize(), t.dequantize()), what
        assert loaded.notes.bytes is not t.notes.bytes  # its own bytes' record, not the saving process's


def test_every_format_class_of_the_package_is_a_safe_global():
    safe = set(torch.serialization.get_safe_globals())
    assert {type(f) for f in FORMATS.values()} <= safe


def test_a_format_defined_outside_the_package_registers_itself():
    @dataclasses.dataclass(frozen=True)
    class MyInt8(dq.Int8Rowwise):
        pass

    assert MyInt8 in torch.serialization.get_safe_globals() and issubclass(MyInt8, QuantFormat)


def test_a_model_state_dict_round_trips():
    def model(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).bfloat16()
        return dq.quantize_(m, dq.Int8Rowwise(), filter_fn=lambda mod, fqn: fqn == "0")
        # (one quantized Linear and one dense one)

    saved, target = model(0), model(1)
    target.load_state_dict(_round_trip(saved.state_dict()))
    assert_same_bits(target[0].weight, saved[0].weight, "0.weight")
    for name in ("0.bias", "2.weight", "2.bias"):
        assert torch.equal(target.get_parameter(name), saved.get_parameter(name)), name
    params = _round_trip(dict(saved.named_parameters()))  # the parameters themselves, quantized ones included
    assert_same_bits(params["0.weight"], saved[0].weight, "0.weight")


def test_trainable_weight_keeps_requires_grad():
    m = dq.quantize_(nn.Sequential(nn.Linear(64, 64)).bfloat16(), dq.Int8Rowwise(), trainable=True, seed=1)
    loaded = _round_trip(m[0].weight)
    assert loaded.requires_grad
    assert_same_bits(loaded.detach(), m[0].weight.detach(), "trainable")


def test_a_file_that_is_no_quantized_tensor_is_refused():
    from dtensor_quant._core.tensor import rebuild

    with pytest.raises(dq.LayoutError, match="not a pickled QuantizedTensor"):
        rebuild({}, "int8", (), (), (1,), torch.float32, (1,), False)
