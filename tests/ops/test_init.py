"""ops/init: nn.init on a quantized weight gives the bytes of the same dense init, quantized (one process).

The reference is a dense weight of the same shape and dtype, initialised
with a generator in the same state, then ``dq.quantize``'d: bit-identical.
"""

import pytest
import torch
from torch import nn

import dtensor_quant as dq
from dtensor_quant import UnsupportedOpError

FORMATS = {"int8": dq.Int8Rowwise(), "nf4": dq.NF4(64), "int4": dq.Int4Groupwise(64), "f8t": dq.Float8Tensorwise()}

INITS = {
    "normal": lambda w, g: nn.init.normal_(w, std=0.02, generator=g),
    "uniform": lambda w, g: nn.init.uniform_(w, -0.1, 0.1, generator=g),
    "kaiming": lambda w, g: nn.init.kaiming_uniform_(w, a=5**0.5, generator=g),
    "xavier": lambda w, g: nn.init.xavier_normal_(w, generator=g),
    "trunc_normal": lambda w, g: nn.init.trunc_normal_(w, std=0.02, generator=g),  # the rejection branch
    "trunc_normal_narrow": lambda w, g: nn.init.trunc_normal_(w, std=1.0, a=-0.2, b=0.3, generator=g),
    "zeros": lambda w, g: nn.init.zeros_(w),
    "constant": lambda w, g: nn.init.constant_(w, 0.25),
}


def same(q, ref) -> bool:
    return all(
        torch.equal(getattr(q, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)) for n in q.fmt.inner_names
    )


def quantized_linear(fmt, shape=(48, 256), dtype=torch.float32, trainable=False):
    m = nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    return dq.quantize_(m, fmt, trainable=trainable)


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_init_equals_the_dense_init_quantized(fmt_name, init):
    fmt = FORMATS[fmt_name]
    m = quantized_linear(fmt)
    INITS[init](m.weight, torch.Generator().manual_seed(7))
    dense = torch.empty(m.weight.shape)
    INITS[init](dense, torch.Generator().manual_seed(7))
    assert same(m.weight, dq.quantize(dense, fmt))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_init_draws_in_the_logical_dtype_and_from_the_default_generator(dtype):
    m = quantized_linear(dq.Int8Rowwise(), dtype=dtype)
    torch.manual_seed(11)
    nn.init.normal_(m.weight)
    after = torch.rand(3)  # the generator moved as far as the dense init moves it
    torch.manual_seed(11)
    dense = nn.init.normal_(torch.empty(m.weight.shape, dtype=dtype))
    assert torch.equal(after, torch.rand(3))
    assert same(m.weight, dq.quantize(dense, dq.Int8Rowwise()))


def test_trainable_weight_init_rounds_to_nearest_and_keeps_its_count():
    fmt = dq.Int8Rowwise()
    m = quantized_linear(fmt, trainable=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    nn.init.trunc_normal_(m.weight, std=0.02, generator=torch.Generator().manual_seed(1))
    dense = nn.init.trunc_normal_(torch.empty(m.weight.shape), std=0.02, generator=torch.Generator().manual_seed(1))
    assert same(m.weight, dq.quantize(dense, fmt))
    m(torch.randn(2, 256)).sum().backward()
    opt.step()
    assert opt.state_dict()["state"][0]["sr_step"] == 1  # one update; the init is not counted


def test_copy_from_dense_and_from_a_broadcast_value():
    fmt = dq.NF4(64)
    m = quantized_linear(fmt)
    dense = torch.randn(m.weight.shape)
    with torch.no_grad():
        m.weight.copy_(dense)
    assert same(m.weight, dq.quantize(dense, fmt))
    with torch.no_grad():
        m.weight.copy_(torch.arange(256.0) / 256)  # broadcast along rows, as copy_ into a dense weight does
    assert same(m.weight, dq.quantize((torch.arange(256.0) / 256).expand(48, 256).contiguous(), fmt))


def test_meta_model_to_empty_then_init_as_torchtitan_orders_it():
    """Build on meta, quantize, to_empty, initialise: the bytes of quantizing the initialised dense model."""
    fmt = dq.Int8Rowwise()
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(256, 64, bias=False), nn.Linear(64, 32, bias=False))
    dq.quantize_(m, fmt)
    m.to_empty(device="cpu")
    torch.manual_seed(5)
    for layer in m:
        nn.init.trunc_normal_(layer.weight, std=0.02)
    torch.manual_seed(5)
    for layer in m:
        dense = nn.init.trunc_normal_(torch.empty(layer.weight.shape), std=0.02)
        assert same(layer.weight, dq.quantize(dense, fmt))


def test_expert_stack_init_quantizes_each_expert():
    fmt = dq.Int8Rowwise()

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3, 16, 64))

    m = dq.quantize_(Experts(), fmt)
    nn.init.normal_(m.w, generator=torch.Generator().manual_seed(2))
    dense = nn.init.normal_(torch.zeros(3, 16, 64), generator=torch.Generator().manual_seed(2))
    assert same(m.w, dq.quantize(dense, fmt))


def test_the_dense_values_close_at_the_next_other_op():
    """After a matmul the weight reads as its quantized bytes again: a frozen weight's values are refused."""
    m = quantized_linear(dq.Int8Rowwise())
    nn.init.normal_(m.weight)
    assert (m.weight < 10).all()  # the initialisation is open: its dense values are read
    m(torch.randn(1, 256))
    with pytest.raises(UnsupportedOpError):
        m.weight < 10  # noqa: B015


def test_a_transposed_view_is_refused_naming_the_way():
    m = quantized_linear(dq.Int8Rowwise())
    with pytest.raises(dq.LayoutError, match="transposed view"), torch.no_grad():
        m.weight.t().normal_()
