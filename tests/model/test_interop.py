"""model/interop: torchao zero-copy adapters, tested only where torchao is installed."""

import pytest
import torch

import dtensor_quant as dq

torchao = pytest.importorskip("torchao")


def test_nf4_from_torchao_shares_bytes_and_values():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    theirs = to_nf4(w)
    ours = dq.interop.from_torchao(theirs)
    assert ours.qdata.data_ptr() == theirs.quantized_data.data_ptr()  # a view, not a copy
    assert torch.equal(ours.dequantize(), theirs.get_original_weight())
    native = dq.quantize(w, dq.NF4())
    for name in ("qdata", "scaler", "factor", "mean"):
        assert torch.equal(getattr(native, name), getattr(ours, name)), name


def test_int8_from_torchao():
    from torchao.quantization import Int8Tensor, PerRow

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    theirs = Int8Tensor.from_hp(w, PerRow())
    ours = dq.interop.from_torchao(theirs)
    assert ours.qdata.data_ptr() == theirs.qdata.data_ptr()
    expected = (theirs.qdata.float() * theirs.scale.float()).to(torch.bfloat16)
    assert torch.equal(ours.dequantize(), expected)
    shards = torch.chunk(ours, 4, dim=1)  # now shardable the DTensor way
    assert torch.equal(torch.cat([s.dequantize() for s in shards], 1), expected)


def test_unsupported_torchao_tensor_is_refused():
    with pytest.raises(ValueError, match="NF4Tensor"):
        dq.interop.from_torchao(torch.randn(2, 2))
