"""_parallel/gather_dim on live ranks: a gather along any dim gives what torch's own path gives.

``all_gather_single`` is patched for quantized locals; each case gathers the
same DTensor with the patch and with torch's code (``patch("gather_dim").removed()``) and
compares the results in full -- inner bytes (NaN payloads included),
relations, orientation, logical shape and strides -- and against the
single-process reference ``Q`` (``full_tensor`` must give back its bytes).
Under a dispatch mode (``CommDebugMode``) the patch leaves the gather to
torch, so the mode still sees the collective, and the result is the same.
"""

import pytest
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_quant as dq
from dtensor_quant._core.layout import LayoutError
from dtensor_quant._parallel.fast_redistribute import patch, with_shortcuts
from dtensor_quant.testing import FORMATS, assert_same_bits, legal, mesh, placements, weight


def _same(ours, theirs, what):
    assert ours.fmt == theirs.fmt and ours.rels == theirs.rels and ours.dims == theirs.dims, what
    assert ours.shape == theirs.shape and ours.stride() == theirs.stride() and ours.dtype == theirs.dtype, what
    assert_same_bits(ours, theirs, what)


@with_shortcuts
def _gathers(fmt_name, shape, mesh_shape, src, transposed):
    fmt, m = FORMATS[fmt_name], mesh(*mesh_shape)
    q = dq.quantize(weight(shape, 3), fmt)
    q = q.t() if transposed else q
    dt = distribute_tensor(q, m, placements(src))
    swap = {"R": "R", "S0": "S1", "S1": "S0"} if transposed else {t: t for t in ("R", "S0", "S1")}
    # legality is the weight's: a placement of the transposed view cuts the weight's other dim
    targets = [t for t in swap if legal(fmt, shape, mesh_shape, swap[t])] if len(mesh_shape) == 1 else []
    for round_ in range(3):  # the first gather of a layout decides, the later ones look the decision up
        ours = [dt.full_tensor()] + [dt.redistribute(m, placements(t)).to_local() for t in targets]
        for o, t, what in zip(ours, [None, *targets], ["full_tensor", *targets]):
            what = f"{fmt_name} {tuple(q.shape)} {src} -> {what}, round {round_}"
            try:
                with patch("gather_dim").removed():
                    theirs = dt.full_tensor() if t is None else dt.redistribute(m, placements(t)).to_local()
            except LayoutError:  # torch's stack-then-cut cannot cut the stacked blocks: the one-step gather can
                theirs = q if t is None else distribute_tensor(q, m, placements(t)).to_local()
                assert_same_bits(o, theirs, what)
                continue
            _same(o, theirs, what)
    assert_same_bits(ours[0], q, "full_tensor")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_dim1_gathers_are_torchs(ranks, world, fmt_name):
    shape = (64, 96 * world) if not fmt_name.startswith(("nf4", "bnb", "f8block")) else (256, 256 * world)
    for transposed in (False, True):
        if legal(FORMATS[fmt_name], shape, (world,), "S0" if transposed else "S1"):
            ranks(world).run(_gathers, fmt_name, shape, (world,), "S1", transposed)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_dim0_gathers_are_torchs(ranks, world, fmt_name):
    """full_tensor and every redistribute from Shard(0), uneven over 3 ranks (a padded last shard)."""
    shape = (10 * world - 2, 128) if not fmt_name.startswith(("nf4", "bnb", "f8block")) else (128 * world, 256)
    for transposed in (False, True):
        if legal(FORMATS[fmt_name], shape, (world,), "S1" if transposed else "S0"):
            ranks(world).run(_gathers, fmt_name, shape, (world,), "S0", transposed)


def test_a_2d_mesh_and_a_3d_stack(ranks):
    ranks(4).run(_gathers, "int8", (64, 128), (2, 2), "S0,S1", False)
    ranks(4).run(_gathers, "int4g32", (64, 128), (2, 2), "S1,S1", False)
    ranks(2).run(_stack)


@with_shortcuts
def _stack():
    m = mesh(2)
    q = dq.quantize(weight((4, 32, 128), 5), FORMATS["int4g32"])
    for d in (1, 2):
        dt = distribute_tensor(q, m, [Shard(d)])
        ours = dt.full_tensor()
        with patch("gather_dim").removed():
            theirs = dt.full_tensor()
        _same(ours, theirs, f"stack Shard({d})")
        assert_same_bits(ours, q, f"stack Shard({d})")


def test_a_dispatch_mode_still_sees_the_collective(ranks):
    ranks(2).run(_left_to_torch)


@with_shortcuts
def _left_to_torch():
    m = mesh(2)
    q = dq.quantize(weight((64, 128), 4), FORMATS["int8"])
    dt = distribute_tensor(q, m, [Shard(1)])
    with CommDebugMode() as comm:  # a dispatch mode: torch's path, and the mode sees the collective
        seen = dt.redistribute(m, [Replicate()]).to_local()
    assert comm.get_total_counts() >= 1
    assert_same_bits(seen, q, "under CommDebugMode")


def test_constants_that_stop_agreeing(ranks):
    """A layout whose ranks' row scales agreed on its first gather (a one-step plan kept) and differ on a later
    one (rank 1's written in place): the later gather joins them Stacked, as torch's path does."""
    ranks(2).run(_diverging_scales)


@with_shortcuts
def _diverging_scales():
    m = mesh(2)
    q = dq.quantize(weight((64, 128), 6), FORMATS["int8"])
    dt = distribute_tensor(q, m, [Shard(1)])
    _same(dt.full_tensor(), q, "agreeing")  # decides: every rank's row scales agree
    _same(dt.full_tensor(), q, "agreeing, looked up")
    if dist.get_rank() == 1:
        dt.to_local().scale.mul_(2)  # this rank's copy of the row scales now differs
    ours = dt.full_tensor()
    with patch("gather_dim").removed():
        theirs = dt.full_tensor()
    _same(ours, theirs, "diverged")
    assert any(type(r).__name__ == "Stacked" for row in ours.rels for r in row), ours.rels


def test_real_widths(ranks):
    """Widths of real MLPs (11008, 14336, uneven over 3 ranks) and a 3-D expert stack cut along its columns."""
    ranks(2).run(_real_widths, ((32, 11008), "int4g128"), ((2, 16, 11008), "int4g128"))
    ranks(3).run(_real_widths, ((16, 14336), "int8"))


@with_shortcuts
def _real_widths(*cases):
    m = mesh(dist.get_world_size())
    for shape, name in cases:
        q = dq.quantize(weight(shape, 8), FORMATS[name])
        dt = distribute_tensor(q, m, [Shard(q.ndim - 1)])
        for round_ in range(3):  # decided, then looked up
            ours = dt.full_tensor()
            with patch("gather_dim").removed():
                theirs = dt.full_tensor()
            _same(ours, theirs, f"{name} {shape}, round {round_}")
            assert_same_bits(ours, q, f"{name} {shape}, round {round_}")


def test_full_tensor_returns_the_gathered_local(ranks):
    """``full_tensor`` of a quantized local returns the gather's own result: no ``view_as`` of it through
    ``__torch_dispatch__`` (torch's ``_ToTorchTensor``, which the patch skips where autograd records nothing), the
    same tensor as torch's code gives; a DTensor already whole still gets a fresh tensor, not its own local."""
    ours, torchs = ranks(2).run(_full_tensor_ops)[0]
    assert "aten.view.default" not in ours, ours
    assert "aten.view.default" in torchs, torchs  # torch's full_tensor views the gathered local: the day it
    # stops, the patched full_tensor saves nothing


@with_shortcuts
def _full_tensor_ops():
    import torch

    from dtensor_quant._core import dispatch, tensor

    m = mesh(2)
    q = dq.quantize(weight((64, 128), 9), FORMATS["int8"])
    dt = distribute_tensor(q, m, [Shard(0)])
    dt.full_tensor()  # the decisions made once
    seen, original = [], dispatch.torch_dispatch
    tensor.QuantizedTensor.__torch_dispatch__ = classmethod(
        lambda cls, func, types, args=(), kwargs=None: (
            seen.append(str(func)) or original(cls, func, types, args, kwargs)
        )
    )
    try:
        ours = dt.full_tensor()
        ours_ops = list(seen)
        seen.clear()
        with patch("gather_dim").removed():
            theirs = dt.full_tensor()
    finally:
        tensor.QuantizedTensor.__torch_dispatch__ = classmethod(original)
    _same(ours, theirs, "full_tensor")
    assert_same_bits(ours, q, "full_tensor")
    with torch.no_grad():  # autograd records nothing either way
        _same(dt.full_tensor(), q, "full_tensor under no_grad")
    whole = distribute_tensor(q, m, [Replicate()])
    got = whole.full_tensor()
    assert got is not whole.to_local(), "full_tensor of a Replicate DTensor must be a fresh tensor"
    _same(got, q, "full_tensor of a Replicate DTensor")
    return ours_ops, seen
