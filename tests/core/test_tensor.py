"""core/tensor: QuantizedTensor's constructor, its compile-cache key and what ``.data =`` does to a parameter."""

import pytest
import torch

import dtensor_quant as dq


@pytest.mark.slow  # two fresh interpreters
def test_compile_cache_key_is_stable_and_discriminating():
    """torch.compile's AOT cache keys a QuantizedTensor by metadata: equal across processes, never across formats."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, dtensor_quant as dq;"
        "print(dq.quantize(torch.randn(64, 256), dq.Int4Groupwise(32))._stable_hash_for_caching())"
    )
    seeds = [
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": s},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for s in ("1", "2")
    ]
    w = torch.randn(64, 256)
    assert seeds[0] == seeds[1] == dq.quantize(w, dq.Int4Groupwise(32))._stable_hash_for_caching()
    others = {dq.quantize(w, f)._stable_hash_for_caching() for f in (dq.Int4Groupwise(64), dq.Int8Rowwise())}
    others.add(dq.quantize(w, dq.Int4Groupwise(32)).t()._stable_hash_for_caching())
    assert seeds[0] not in others and len(others) == 3


def test_constructor_refuses_inner_tensors_the_format_does_not_declare():
    q = dq.quantize(torch.randn(8, 16), dq.Int8Rowwise())
    with pytest.raises(dq.LayoutError, match=r"inner tensors \('scale',\).*declares \('qdata', 'scale'\)"):
        dq.QuantizedTensor({"scale": q.scale}, q.fmt, q.rels, q.dims, q.shape, q.dtype)


@pytest.mark.parametrize("fmt_b", [dq.Int8Rowwise(), dq.NF4(), dq.Float8Rowwise()], ids=str)
def test_assigning_data_takes_the_new_weights_values_and_keeps_the_parameters_tags(fmt_b):
    # torch's .data setter swaps only the C++ metadata: the old inner tensors (the values) used to stay.
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    a = dq.quantize(torch.randn(64, 256, dtype=torch.bfloat16), dq.Int4Groupwise(128))
    b = dq.quantize(torch.randn(32, 256, dtype=torch.bfloat16), fmt_b)
    lin = torch.nn.Linear(256, 64, bias=False)
    lin.weight = torch.nn.Parameter(a, requires_grad=False)
    lin(x), lin.weight.t()  # caches a linear plan and kernel inputs on the old weight
    lin.weight.tag = "kept"
    lin.weight.data = b
    assert lin.weight.fmt == fmt_b and lin.weight.shape == b.shape and lin.weight.tag == "kept"
    assert torch.equal(lin.weight.dequantize(), b.dequantize())
    assert torch.equal(lin(x), torch.nn.functional.linear(x, b))
    with pytest.raises(ValueError, match="Quantize it first"):
        lin.weight.data = torch.randn(32, 256)


def test_dequantize_takes_a_floating_point_dtype():
    """Before: dequantize(torch.int8) truncated every value without a word; a dtype name failed inside torch."""
    q = dq.quantize(torch.randn(8, 64), dq.Int8Rowwise())
    for bad in (torch.int8, torch.int32, "float32"):
        with pytest.raises(ValueError, match=r"floating-point torch\.dtype"):
            q.dequantize(bad)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_the_storage_has_no_data_pointer_and_says_where_the_bytes_are():
    """A wrapper subclass has no bytes of its own: torch's placeholder storage keeps its sizes; ``data_ptr()``
    raises as before (a RuntimeError), now naming the inner tensors and torchtitan's way out."""
    q = dq.quantize(torch.randn(8, 64), dq.Int8Rowwise())
    storage = q.untyped_storage()
    assert isinstance(storage, torch.UntypedStorage) and storage.nbytes() == q.numel() * q.element_size()
    with pytest.raises(RuntimeError, match=r"inner tensors.*dtensor_quant\.torchtitan\.CheckpointManager"):
        storage.data_ptr()
    assert q.qdata.untyped_storage().data_ptr() == q.qdata.data_ptr()  # the inner tensors' storages are real
    assert type(torch.randn(3).untyped_storage()) is torch.UntypedStorage  # plain tensors untouched
