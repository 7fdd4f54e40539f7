"""A weight whose format quantizes its activations never runs weight-only arithmetic in a forward.

Every forward path that would dequantize such a weight and multiply the
activation as it comes (the weight on the left, a weight stored ``[in, out]``,
a batch of them on the left, an expert stack not transposed) raises
``UnsupportedOpError`` naming the path and F.linear; the canonical forms run the
scheme (equal to ``F.linear`` bit for bit); the backward's ``grad @ W`` is dense
by design and equals the dequantized weight's gradient.
"""

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant import UnsupportedOpError
from dtensor_quant.testing import weight

FORMATS = [
    dq.Int8Rowwise(activations="int8-token"),
    dq.Int8Rowwise(activations="int8-tensor", input_scale=0.02),
    dq.Float8Rowwise(activations="fp8-token"),
    dq.Float8Tensorwise(activations="fp8-tensor", input_scale=0.01),
]


def _case(fmt):
    w, x = weight((32, 64), seed=1), weight((5, 64), seed=2)
    return dq.quantize(w, fmt), dq.quantize(w.t().contiguous(), fmt), x


REFUSED = {
    "weight on the left": lambda q, qio, x: q @ x.t(),
    "weight on the left, torch.matmul": lambda q, qio, x: torch.matmul(q, x.t()),
    "weight stored [in, out]": lambda q, qio, x: x @ qio,
    "weight stored [in, out], 3-D x": lambda q, qio, x: torch.matmul(x.expand(2, 5, 64), qio),
    "weight stored [in, out], transposed 3-D x": lambda q, qio, x: torch.matmul(
        x.expand(2, 5, 64).transpose(0, 1).contiguous().transpose(0, 1), qio
    ),
    "broadcast weight on the left": lambda q, qio, x: torch.matmul(q, x.t().expand(3, 64, 5)),
    "expert stack stored [experts, in, out]": lambda q, qio, x: torch._grouped_mm(
        x, dq.quantize(torch.stack([qio.dequantize()] * 2), q.fmt), offs=torch.tensor([2, 5], dtype=torch.int32)
    ),
}


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("path", list(REFUSED))
def test_forward_paths_that_would_dequantize_refuse(fmt, path):
    q, qio, x = _case(fmt)
    with pytest.raises((UnsupportedOpError, RuntimeError), match=r"F\.linear") as info:
        REFUSED[path](q, qio, x)
    assert fmt.activation_scheme.spelling in str(info.value), str(info.value)


def test_weight_only_formats_still_dequantize():
    """The guard is the activation scheme's: a weight-only format keeps its dense paths (a matmul, dense by
    definition)."""
    fmt = dq.Int8Rowwise()
    q, qio, x = _case(fmt)
    torch.testing.assert_close(q @ x.t(), q.dequantize() @ x.t(), rtol=0, atol=0)
    torch.testing.assert_close(x @ qio, x @ qio.dequantize(), rtol=0, atol=0)


CANONICAL = {
    "x @ W.t()": lambda q, x: x @ q.t(),
    "torch.matmul(x, W.t())": lambda q, x: torch.matmul(x, q.t()),
    "addmm": lambda q, x: torch.addmm(torch.zeros(q.shape[0]), x, q.t()),
    "3-D transposed x": lambda q, x: F.linear(x.expand(2, 5, 64).transpose(0, 1).contiguous().transpose(0, 1), q)[0],
}


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("path", list(CANONICAL))
def test_canonical_forms_run_the_scheme(fmt, path):
    q, _, x = _case(fmt)
    assert torch.equal(CANONICAL[path](q, x), F.linear(x, q)), path


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("column_major", [False, True])
def test_backward_grad_at_w_is_dense(fmt, column_major):
    """``grad @ W`` (and, for a column-major activation, ``W.t() @ grad.t()``) dequantizes inside the
    backward: the input gradient is the dense weight's."""
    q, _, x = _case(fmt)
    x = (x.t().contiguous().t() if column_major else x.clone()).requires_grad_()
    g = weight((5, 32), seed=3)
    F.linear(x, q).backward(g)
    assert torch.equal(x.grad, g @ q.dequantize()), "input gradient is not grad @ dequantized W"
