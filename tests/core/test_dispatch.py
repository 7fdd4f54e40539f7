"""core/dispatch: an op no handler implements raises UnsupportedOpError naming the op and the format."""

import pytest
import torch

import dtensor_quant as dq


def test_unsupported_op_names_op_and_format():
    q = dq.quantize(torch.randn(16, 64), dq.NF4(32, 4))
    with pytest.raises(dq.UnsupportedOpError, match=r"aten\.mul.*NF4\(block_size=32"):
        q * 2
    with pytest.raises(dq.LayoutError, match="requantize"):
        q.copy_(torch.randn(16, 64))
