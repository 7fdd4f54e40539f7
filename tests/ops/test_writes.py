"""ops/writes: every write into a quantized tensor or its views is exact, or refused with nothing changed.

See docs/hostile_input.md for what each format does.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtensor_quant as dq
from dtensor_quant import LayoutError
from dtensor_quant.testing import FORMATS, pick, weight

HOSTILE = list(pick("int8", "int4g32", "int4g128", "nf4b32s4", "f8row", "f8tensor"))  # every relation at (16, 256)


def snapshot(q):
    return {n: t.clone() for n, t in q.inner.items()}


def unchanged(q, snap) -> bool:
    return all(torch.equal(t.view(torch.uint8), snap[n].view(torch.uint8)) for n, t in q.inner.items())


def test_copy_of_independently_quantized_pieces_is_refused():
    """Two 100-column Int4 pieces (group 128) have the destination's scale shape, not its grid."""
    fmt = dq.Int4Groupwise(128)
    w = torch.randn(16, 200) * 10
    src = torch.cat([dq.quantize(w[:, :100], fmt), dq.quantize(w[:, 100:], fmt)], 1)
    dst = dq.quantize(torch.randn(16, 200), fmt)
    assert src.scale.shape == dst.scale.shape  # shapes alone would let it through
    snap = snapshot(dst)
    with pytest.raises(LayoutError, match="stacked in runs of 100"):
        dst.copy_(src)
    assert unchanged(dst, snap)


def test_load_state_dict_of_stacked_source_is_refused():
    fmt = dq.Int4Groupwise(128)
    w = torch.randn(16, 200)
    net = torch.nn.Linear(200, 16, bias=False)
    dq.quantize_(net, fmt)
    src = torch.cat([dq.quantize(w[:, :100], fmt), dq.quantize(w[:, 100:], fmt)], 1)
    snap = snapshot(net.weight)
    with pytest.raises(RuntimeError, match="stacked in runs of 100"):  # torch wraps the LayoutError
        net.load_state_dict({"weight": src})
    assert unchanged(net.weight, snap)


@pytest.mark.parametrize("fmt_name", HOSTILE)
def test_write_into_view_sharing_scales_is_refused(fmt_name):
    fmt = FORMATS[fmt_name]
    w = dq.quantize(torch.randn(16, 256), fmt)
    snap = snapshot(w)
    with pytest.raises(LayoutError, match="outside the view"):
        w[:, :48].copy_(dq.quantize(torch.randn(16, 256) * 5, fmt)[:, :48].clone())  # 48: mid-group everywhere
    assert unchanged(w, snap)


def test_write_into_view_with_the_same_scales_is_exact():
    """A view whose shared scales equal the source's takes the codes only: exact, nothing else moves."""
    w = dq.quantize(torch.randn(16, 256), dq.Int8Rowwise())
    before = w.dequantize()
    src = w[:, :64].clone()
    src.qdata.neg_()  # same row scales, other codes
    w[:, :64].copy_(src)
    assert torch.equal(w.dequantize()[:, :64], src.dequantize())
    assert torch.equal(w.dequantize()[:, 64:], before[:, 64:])


@pytest.mark.parametrize("fmt_name", HOSTILE)
def test_inplace_arithmetic_and_set_are_refused(fmt_name):
    """(``zero_`` is an initialisation: tests/ops/test_init.py.)"""
    w = dq.quantize(torch.randn(16, 256), FORMATS[fmt_name])
    snap = snapshot(w)
    for op in (lambda: w.add_(1), lambda: w.mul_(2), lambda: w.set_(torch.zeros(16, 256))):
        with pytest.raises((NotImplementedError, LayoutError, RuntimeError)):
            op()
    assert unchanged(w, snap)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    fmt_name=st.sampled_from(HOSTILE),
    dim=st.integers(0, 1),
    a=st.integers(0, 8),
    b=st.integers(0, 8),
    same_scales=st.booleans(),
)
def test_slice_writes_are_exact_or_refused(fmt_name, dim, a, b, same_scales):
    """Any slice write: either the view gets exactly the source and nothing else moves, or nothing moves."""
    fmt = FORMATS[fmt_name]
    shape = (32, 512)
    step = shape[dim] // 8
    start, stop = sorted((a * step, b * step))
    w = dq.quantize(torch.randn(shape), fmt)
    before, snap = w.dequantize(), snapshot(w)
    try:
        view = w.narrow(dim, start, stop - start)
    except LayoutError:
        return
    src = view.clone()
    if not same_scales:
        src = dq.quantize(torch.randn(shape) * 3, fmt).narrow(dim, start, stop - start).clone()
    else:
        src.qdata.view(torch.uint8).bitwise_xor_(1)  # other codes, the same scales
    try:
        view.copy_(src)
    except LayoutError:
        assert unchanged(w, snap)
        return
    after = w.dequantize()
    expect = before.clone()
    expect.narrow(dim, start, stop - start).copy_(src.dequantize())
    assert torch.equal(after.isnan(), expect.isnan())
    assert torch.equal(after.nan_to_num(), expect.nan_to_num())


@pytest.mark.parametrize("fmt_name,words", [("int8", "inner 'scale' is"), ("f8tensor", "orientation")])
def test_a_source_of_the_other_orientation_is_refused(fmt_name, words):
    """A transposed source lays its inner tensors out along the other dims: refused with nothing written (where the
    inner shapes match, as a per-tensor scale's do, by the orientation check); the same orientation is exact."""
    fmt = FORMATS[fmt_name]
    w = dq.quantize(weight((64, 64), seed=1), fmt)
    src = dq.quantize(weight((64, 64), seed=2), fmt).t()
    snap = snapshot(w)
    with pytest.raises(LayoutError, match=words):
        w.copy_(src)
    assert unchanged(w, snap)
    w.t().copy_(src)
    assert torch.equal(w.t().dequantize(), src.dequantize())


@pytest.mark.parametrize("fmt_name", HOSTILE)
def test_a_write_bumps_every_written_inner_tensors_version(fmt_name):
    """What kernel caches key on: each inner tensor written says so (a write inside __torch_dispatch__ does not)."""
    w = dq.quantize(weight((16, 256), seed=1), FORMATS[fmt_name])
    before = {n: t._version for n, t in w.inner.items()}
    w.copy_(dq.quantize(weight((16, 256), seed=2), FORMATS[fmt_name]))
    assert all(t._version > before[n] for n, t in w.inner.items()), {
        n: (before[n], t._version) for n, t in w.inner.items()
    }
