"""Weights with fewer rows than ranks, on live ranks: every move is quantize-then-shard's, or refused first.

A weight of 0-3 rows over 1-4 ranks leaves some ranks a zero-size shard (torch.chunk's trailing pieces).
For every format, from each placement the layout allows (``Replicate``, ``Shard(0)``, ``Shard(1)``) to each
of them and to ``full_tensor``, every rank's local piece must hold exactly the bytes of the single-process
weight cut by DTensor (``distribute_tensor(q, ..., src_data_rank=None)``: a local chunk, no collective)
and dequantize to DTensor's chunk of the dense values, and every gather must give back the weight's bytes.
A target the layout cannot hold (``check_placements``) raises the same ``LayoutError`` on every rank with
nothing on the wire. (Zero-size shards crashed every gather of formats with wider inner dtypes: a
``uint8`` view of an empty piece at an odd storage offset.)
"""

import pytest
import torch
from torch.distributed.tensor import distribute_tensor

import dtensor_quant as dq
from dtensor_quant.testing import (
    FORMATS,
    assert_local_matches,
    assert_same_bits,
    legal,
    mesh,
    placements,
    weight,
)

MOVES = ["R", "S0", "S1"]


def _holds(fmt, shape) -> bool:
    try:
        fmt.check_shape(torch.Size(shape))
    except ValueError:
        return False
    return True


def every_move(fmt_names, shapes, mesh_shape, moves=MOVES):
    """On every rank: each legal source of each weight moved to each target; ``[(case, outcome)]``."""
    m = mesh(*mesh_shape)
    out = []
    for fmt_name in fmt_names:
        fmt = FORMATS[fmt_name]
        for shape in shapes:
            if not _holds(fmt, shape):
                continue
            q = dq.quantize(weight(shape, seed=sum(shape) + m.size()), fmt)
            dense = q.dequantize()
            for src in moves:
                if not legal(fmt, shape, mesh_shape, src):
                    continue
                dt = distribute_tensor(q, m, placements(src))
                for dst in [*moves, "full"]:
                    what = f"{fmt_name} {shape} on mesh {mesh_shape}: {src} -> {dst}"
                    out.append(((fmt_name, shape, src, dst), _move(dt, q, dense, m, dst, what)))
    return out


def _move(dt, q, dense, m, dst, what):
    with dq.wire.record() as log:
        try:
            moved = dt.full_tensor() if dst == "full" else dt.redistribute(m, placements(dst))
        except dq.LayoutError as e:
            assert len(log) == 0, f"{what}: refused after {log.transfers}"
            return str(e)
    if dst == "full":
        assert_same_bits(moved, q, what)
        return "ok"
    assert_local_matches(moved, dense, what)  # DTensor's chunk of the dense values
    expected = distribute_tensor(q, m, placements(dst), src_data_rank=None).to_local()  # quantize-then-shard
    assert_same_bits(moved.to_local(), expected, what)
    assert_same_bits(moved.full_tensor(), q, what + ", gathered back")
    return "ok"


def _check(results, fmt_names, mesh_shape, moves=MOVES):
    """Every rank saw the same outcomes, and each is what check_placements says of the target."""
    assert all(r == results[0] for r in results), "the ranks disagree"
    seen = set()
    for (fmt_name, shape, src, dst), outcome in results[0]:
        fmt = FORMATS[fmt_name]
        ok = dst == "full" or legal(fmt, shape, mesh_shape, dst)
        assert (outcome == "ok") == ok, (fmt_name, shape, mesh_shape, src, dst, outcome)
        if not ok:
            assert "would be legal with size" in outcome, outcome  # check_placements' error, legal sizes named
        seen.add((fmt_name, dst))
    assert seen == {(f, d) for f in fmt_names for d in [*moves, "full"]}, seen  # every format, every target


# One format per kind of layout (rows, column groups, flat blocks with a global constant, nested blocks,
# a per-tensor constant, 2-D blocks, microscaling); every other format: slow (the two cases together check every
# format; each format's moves are checked on their own, so the slow case need not repeat FEW's).
FEW = ["int8", "int4g32", "nf4", "bnbnf4", "f8tensor", "f8block32", "mxfp4"]
REST = [name for name in FORMATS if name not in FEW]


@pytest.mark.parametrize("names", [FEW, pytest.param(REST, marks=pytest.mark.slow)], ids=["few", "rest"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_to_three_rows(ranks, world, names):
    shapes = [(rows, 256) for rows in range(4)]
    _check(ranks(world).run(every_move, names, shapes, (world,)), names, (world,))


def test_zero_to_three_rows_on_a_2d_mesh(ranks):
    """2x2: both mesh dims cut one weight dim, or each its own, or one replicates; some ranks hold nothing."""
    moves = ["R,R", "S0,R", "R,S1", "S0,S1", "S1,S0", "S0,S0"]
    shapes = [(rows, 256) for rows in range(4)]
    _check(ranks(4).run(every_move, FEW, shapes, (2, 2), moves), FEW, (2, 2), moves)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_zero_to_three_rows_real_widths(ranks, world):
    """MLP widths (11008 = 86 groups of 128, uneven over 3 and 4 ranks; 14336) where columns cut unevenly."""
    shapes = [(rows, width) for width in (11008, 14336) for rows in range(4)]
    names = ["int8", "int4g128", "nf4", "f8block128", "mxfp4"]
    _check(ranks(world).run(every_move, names, shapes, (world,)), names, (world,))
