"""core/dispatch and its callers: every UnsupportedOpError names the fix that applies where the op came from."""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core import dispatch
from dtensor_quant.testing import weight


def _q():
    return dq.quantize(weight((8, 64)), dq.Int8Rowwise())


HINTS = {
    "an op without a handler: work on a dense copy": (lambda q: torch.sort(q), r"\.dequantize\(\) first"),
    "an in-place update of a frozen weight: make it trainable": (lambda q: q.add_(1.0), r"trainable=True"),
    "two quantized operands: dequantize one": (lambda q: torch.mm(q, q.t()), r"dequantize one of them"),
    "a quantized bias: keep biases dense": (
        lambda q: torch.addmm(q, torch.zeros(8, 64, dtype=q.dtype), q.t()),
        r"biases stay dense",
    ),
    "a permute that is no transpose": (
        lambda q: dq.quantize(weight((2, 8, 64)), q.fmt).permute(1, 0, 2),
        r"only swapping the last two dims.*transpose\(-2, -1\)",
    ),
}


@pytest.mark.parametrize("case", HINTS)
def test_each_refusal_names_its_fix(case):
    fn, fix = HINTS[case]
    with pytest.raises(dq.UnsupportedOpError, match=fix):
        fn(_q())


def test_a_context_hint_replaces_the_generic_advice_where_its_predicate_holds():
    text = " Do the thing that works here."
    predicate = dispatch.context_hint(text)(lambda func: func._schema.name == "aten::sort")
    try:
        with pytest.raises(dq.UnsupportedOpError) as info:
            torch.sort(_q())
        assert str(info.value).endswith(text) and ".dequantize() first" not in str(info.value)
        with pytest.raises(dq.UnsupportedOpError, match=r"\.dequantize\(\) first"):  # another op: the generic one
            torch.cumsum(_q(), 0)
    finally:
        dispatch.CONTEXT_HINTS.remove((predicate, text))
