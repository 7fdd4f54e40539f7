"""_parallel/shard_to_shard on live ranks: ``Shard(i) -> Shard(j)`` in one gather and one cut is torch's result.

``placement_types.shard_dim_alltoall`` is patched for quantized locals on a
CPU mesh; each case redistributes the same DTensor with the patch and with
torch's code (``patch("shard_to_shard").removed()``) and compares the local pieces in full --
inner bytes, relations, orientation, logical shape and strides -- and with
the piece ``distribute_tensor`` of the single-process weight gives this
rank. A target the layout cannot cut raises the same error on every rank,
whichever piece the rank keeps; under a dispatch mode the patch leaves the
redistribute to torch, so the mode still sees the collective.
"""

import pytest
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
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
def _moves(fmt_name, shape, mesh_shape, src, dst, transposed):
    fmt, m = FORMATS[fmt_name], mesh(*mesh_shape)
    q = dq.quantize(weight(shape, 3), fmt)
    q = q.t() if transposed else q
    dt = distribute_tensor(q, m, placements(src))
    expected = distribute_tensor(q, m, placements(dst)).to_local()
    for round_ in range(3):  # the first move of a layout decides, the later ones look the decisions up
        what = f"{fmt_name} {tuple(q.shape)} {src} -> {dst}, round {round_}"
        ours = dt.redistribute(m, placements(dst)).to_local()
        with patch("shard_to_shard").removed():
            theirs = dt.redistribute(m, placements(dst)).to_local()
        _same(ours, theirs, what)
        _same(ours, expected, what + " (distribute_tensor's piece)")


def _swap(spec, transposed):
    return {"S0": "S1", "S1": "S0"}[spec] if transposed else spec


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_moves_are_torchs(ranks, world, fmt_name):
    """Both directions, the weight and its transposed view, uneven over 3 ranks (padded pieces)."""
    blocky = fmt_name.startswith(("nf4", "bnb", "f8block"))
    shape = (128 * world, 256 * world) if blocky else (10 * world - 2, 128 * world)
    for transposed in (False, True):
        for src, dst in (("S0", "S1"), ("S1", "S0")):
            if all(legal(FORMATS[fmt_name], shape, (world,), _swap(s, transposed)) for s in (src, dst)):
                ranks(world).run(_moves, fmt_name, shape, (world,), src, dst, transposed)


def test_real_widths(ranks):
    """Widths of real MLPs (11008 = 86 groups of 128; 14336 uneven over 3 ranks, padded) and a 3-D expert stack,
    where the toy widths above never show a padded column cut."""
    ranks(2).run(_moves, "int4g128", (32, 11008), (2,), "S0", "S1", False)
    ranks(2).run(_moves, "int4g128", (32, 11008), (2,), "S1", "S0", False)
    ranks(3).run(_moves, "int8", (18, 14336), (3,), "S1", "S0", False)
    ranks(3).run(_moves, "int8", (18, 14336), (3,), "S0", "S1", False)
    ranks(2).run(_moves, "int4g128", (2, 16, 11008), (2,), "S2", "S1", False)


def test_a_2d_mesh(ranks):
    ranks(4).run(_moves, "int8", (64, 128), (2, 2), "S0,S1", "S1,S0", False)
    ranks(4).run(_moves, "int4g32", (64, 256), (2, 2), "R,S0", "R,S1", False)


def test_a_cut_the_layout_refuses_raises_on_every_rank(ranks):
    """Int4 groups of 32 over 96 columns: Shard(1) on 2 ranks would cut a group at 48. Every rank raises the
    error torch's path raises, whichever piece it would keep."""
    assert ranks(2).run(_refused) == [True, True]


@with_shortcuts
def _refused():
    m = mesh(2)
    q = dq.quantize(weight((64, 96), 5), FORMATS["int4g32"])
    dt = distribute_tensor(q, m, [Shard(0)])
    errors = []
    for patched in (True, False):
        try:
            if patched:
                dt.redistribute(m, [Shard(1)])
            else:
                with patch("shard_to_shard").removed():
                    dt.redistribute(m, [Shard(1)])
        except LayoutError as e:
            errors.append(str(e))
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert "not a multiple of 32" in errors[0], errors[0]
    dist.barrier()  # every rank got here: none is left waiting in a collective
    return True


def test_a_dispatch_mode_still_sees_the_collective(ranks):
    ranks(2).run(_left_to_torch)


@with_shortcuts
def _left_to_torch():
    m = mesh(2)
    q = dq.quantize(weight((64, 128), 4), FORMATS["int8"])
    dt = distribute_tensor(q, m, [Shard(1)])
    with CommDebugMode() as comm:  # a dispatch mode: torch's path, and the mode sees the collective
        seen = dt.redistribute(m, [Shard(0)]).to_local()
    assert comm.get_total_counts() >= 1
    assert_same_bits(seen, distribute_tensor(q, m, [Shard(0)]).to_local(), "under CommDebugMode")


def test_one_gather_and_one_cut_without_dispatch(ranks):
    """The patch never enters ``__torch_dispatch__`` here (a dim-0 piece is contiguous: no copy); torch's code
    (its gather already in one step, _parallel/gather_dim) splits the result into every rank's piece: the day it
    stops, the patch is no longer needed."""
    ours, torchs = ranks(2).run(_dispatched)[0]
    assert ours == [], ours
    assert torchs == ["aten.split.Tensor"], torchs


@with_shortcuts
def _dispatched():
    from dtensor_quant._core import dispatch, tensor

    m = mesh(2)
    q = dq.quantize(weight((64, 128), 7), FORMATS["int8"])
    dt = distribute_tensor(q, m, [Shard(1)])
    dt.redistribute(m, [Shard(0)])  # the decisions made once
    seen, original = [], dispatch.torch_dispatch
    tensor.QuantizedTensor.__torch_dispatch__ = classmethod(
        lambda cls, func, types, args=(), kwargs=None: (
            seen.append(str(func)) or original(cls, func, types, args, kwargs)
        )
    )
    try:
        dt.redistribute(m, [Shard(0)])
        ours = list(seen)
        seen.clear()
        with patch("shard_to_shard").removed():
            dt.redistribute(m, [Shard(0)])
    finally:
        tensor.QuantizedTensor.__torch_dispatch__ = classmethod(original)
    return ours, seen
