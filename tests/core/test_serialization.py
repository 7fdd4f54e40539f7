"""core/tensor: torch.save / torch.load of quantized tensors with torch.load's default ``weights_only=True``.

The library registers what a pickled QuantizedTensor names (the tensor's
rebuild function, the relations, every format class) as safe globals, so a
user's ``torch.load`` needs no ``weights_only=False``.
"""

from __future__ import annotations

import dataclasses
import io
import pickletools
import zipfile
from pathlib import Path

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
        rebuild({}, "int8", (), (), (1,), torch.float32, (1,), False)  # what earlier files call
    with pytest.raises(dq.LayoutError, match="not a QuantizedTensor's parts: format str"):
        dq.QuantizedTensor({}, "int8", (), (), (1,), torch.float32, (1,), False)  # what files call now


# -- the paths a file names: public ones only; the private ones of earlier files still load ---------------

_DATA = Path(__file__).resolve().parent / "data"


def _globals_named(obj) -> set[str]:
    """Every ``module.name`` global the pickle of ``obj`` (``torch.save``'s ``data.pkl``) refers to."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data = next(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
    names, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            names.add(".".join(strings[-2:]))
        if isinstance(arg, str):
            strings.append(arg)
    return names


def _every_format():
    """One instance of every format class the package exports, and the conformance kit's instances."""
    classes = {
        v for v in vars(dq).values() if isinstance(v, type) and issubclass(v, QuantFormat) and v is not QuantFormat
    }
    assert classes, "no format class exported"
    return {type(f).__name__ + repr(f): f for f in FORMATS.values()} | {c.__name__: c() for c in classes}


@pytest.mark.parametrize("fmt", list(_every_format().values()), ids=list(_every_format()))
def test_a_pickle_of_every_format_names_only_public_paths(fmt):
    q = dq.quantize(weight((32, 256), seed=2), fmt)
    views = {"weight": lambda: q, "transposed": q.t, "a flat view": lambda: q.view(-1), "rows": lambda: q[128:]}
    saved = 0
    for what, make in views.items():
        try:
            t = make()
        except (dq.LayoutError, dq.UnsupportedOpError):  # a view this layout refuses: nothing to save
            continue
        ours = {n for n in _globals_named(t) if n.startswith("dtensor_quant")}
        assert ours and not [n for n in ours if "._" in n], f"{fmt} {what}: {sorted(ours)}"
        assert all(n.split(".")[1] in dq.__all__ for n in ours), f"{fmt} {what}: {sorted(ours)}"
        saved += 1
    assert saved >= 2  # the weight and its transpose, at least


def test_every_relation_and_the_tensor_are_named_by_the_package_root():
    for cls in (dq.QuantizedTensor, dq.OneToOne, dq.Packed, dq.Blocked, dq.Constant, dq.Stacked, dq.FlatBlocked,
                dq.InFlat, dq.Opaque):  # fmt: skip
        assert cls.__module__ == "dtensor_quant" and getattr(dq, cls.__qualname__) is cls
        assert cls in torch.serialization.get_safe_globals()


def test_a_file_written_with_the_private_paths_still_loads_weights_only():
    """``data/quantized_private_paths.pt``: written by the package before pickles named public paths (it names
    ``dtensor_quant._core.tensor.rebuild``, ``dtensor_quant._formats.int8.Int8Rowwise``, ...): every format
    class, a transposed weight and a flat view. Loaded with ``weights_only=True``, each is bit for bit the
    same weight quantized now."""
    path = _DATA / "quantized_private_paths.pt"
    with zipfile.ZipFile(path) as z:
        data = next(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
    assert b"dtensor_quant._core.tensor" in data and b"dtensor_quant._formats.int8" in data  # what it tests
    loaded = torch.load(path, weights_only=True)
    w = weight((32, 128), seed=5)
    fmts = {
        type(f).__name__: f
        for f in (
            dq.Int8Rowwise(),
            dq.Int4Groupwise(32),
            dq.Int4GroupwiseIntZero(32),
            dq.NF4(32, 4),
            dq.BnbNF4(),
            dq.NF4BlockScales(),
            dq.Float8Rowwise(),
            dq.Float8Tensorwise(),
            dq.Float8Blockwise(32),
            dq.MXFP4(),
            dq.BlockFloat8(),
            dq.BlockLog4(),
        )
    }
    assert set(loaded) == {*fmts, "Int8Rowwise.t", "NF4.view"}
    for name, fmt in fmts.items():
        assert loaded[name].fmt == fmt
        assert_same_bits(loaded[name], dq.quantize(w, fmt), name)
    assert_same_bits(loaded["Int8Rowwise.t"], dq.quantize(w, dq.Int8Rowwise()).t(), "transposed")
    assert_same_bits(loaded["NF4.view"], dq.quantize(w, dq.NF4(32, 4)).view(-1), "flat view")
    assert loaded["NF4.view"].rels == dq.quantize(w, dq.NF4(32, 4)).view(-1).rels
    # and a file saved now of the same tensors names none of those paths, and loads to the same bits
    again = _round_trip(loaded)
    for name, t in loaded.items():
        assert_same_bits(again[name], t, name)
