"""core/dispatch: an op no handler implements raises UnsupportedOpError naming the op and the format."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import assert_same_bits


def test_unsupported_op_names_op_and_format():
    q = dq.quantize(torch.randn(16, 64), dq.NF4(32, 4))
    with pytest.raises(dq.UnsupportedOpError, match=r"aten\.mul.*NF4\(block_size=32"):
        q * 2
    # copy_ from dense is an initialisation (_ops/init.py): the dense values quantized, as dq.quantize gives them
    dense = torch.randn(16, 64)
    q.copy_(dense)
    assert_same_bits(q, dq.quantize(dense, dq.NF4(32, 4)))
