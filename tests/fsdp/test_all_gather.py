"""fsdp/all_gather on one process: what FSDP2's hooks do with pieces they are handed."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import assert_same_bits, weight
from tests.support.extra_formats import FORMATS


@pytest.mark.parametrize("fmt_name", ["pertensor", "f8tensor", "nf4"])
def test_unsent_constants_are_not_concatenated_or_compared(fmt_name):
    """A scale FSDP2 never sends is the same tensor in every piece: no cat, no equal (a host sync on CUDA)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtensor_quant.fsdp import post_all_gather, pre_all_gather

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    class TwoRanks:
        def size(self):
            return 2

    q = dq.quantize(weight((128, 256)), FORMATS[fmt_name])
    inputs, meta = pre_all_gather(q[:64], TwoRanks(), q.shape, dense=False)
    assert set(meta.sent) != set(q.fmt.inner_names)  # the format keeps something unsent
    gathered = [torch.cat(pair) for pair in zip(inputs, pre_all_gather(q[64:], TwoRanks(), q.shape, dense=False)[0])]
    with Ops() as ops:
        full, _ = post_all_gather(gathered, meta, torch.bfloat16)
    assert "aten::equal" not in ops.names and "aten::cat" not in ops.names, ops.names
    assert_same_bits(full, q)
