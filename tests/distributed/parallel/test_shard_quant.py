"""_parallel/shard_quant on live ranks: quantizing a sharded DTensor gives the bytes of quantizing it whole, with a
collective only where a block spans shards, NaN and Inf included (gloo's MAX/MIN drop NaN by rank order).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.testing import (
    FORMATS,
    assert_same_bits,
    mesh,
    placements,
    weight,
)
from tests.parallel.test_shard_quant import poisoned

EXTREME_FORMATS = ["int8", "int4g32", "f8row", "f8tensor"]  # NF4's extremes belong to its rewrite (issue 12)


def quantize_sharded(fmt_name, shape, mesh_shape, src):
    """quantize(DTensor) == distribute_tensor(quantize(full)), inner tensor by inner tensor."""
    fmt, m = FORMATS[fmt_name], mesh(*mesh_shape)
    w = weight(shape, seed=3)
    reference = distribute_tensor(dq.quantize(w, fmt), m, placements(src))
    dense = distribute_tensor(w, m, placements(src))
    with wire.record() as log:
        got = dq.quantize(dense, fmt)
    assert isinstance(got, DTensor) and got.placements == reference.placements
    assert_same_bits(got.to_local(), reference.to_local(), f"quantize on {src}")
    return len([t for t in log.transfers if t.op != "dtensor_quant::agree"])  # the ranks' one-time format check


@pytest.mark.parametrize(
    "fmt_name,src,collectives",
    [
        ("int8", "S0", 0),  # each row's scale lives on one rank
        ("int8", "S1", 1),  # each row's maximum spans ranks: one all-reduce
        ("int8", "R", 0),
        ("int4g32", "S0", 0),
        ("int4g32", "S1", 0),  # groups align with shards: nothing to reduce
        ("f8row", "S1", 1),
        ("f8tensor", "S0", 1),  # one scale for the whole weight: always reduced
        ("f8tensor", "S1", 1),
        ("nf4b32s16", "S0", 1),  # the global mean of the block scales
        ("nf4b32s16", "S1", 2),  # the mean, and each scaler block's maximum across columns
        ("nf4b32s4", "S0", 1),
    ],
)
def test_quantize_sharded_dtensor(ranks, fmt_name, src, collectives):
    """quantize(DTensor) equals quantize-then-distribute, with a collective only where a block spans shards."""
    counts = ranks(4).run(quantize_sharded, fmt_name, (16, 256), (4,), src)
    assert counts == [collectives] * 4


@pytest.mark.parametrize("fmt_name", ["nf4", "bnbnf4", "nf4bs"])
def test_quantize_sharded_where_a_block_is_whole_rows(ranks, fmt_name):
    """Rows of 32 under blocks of 64: a block is two whole rows, so a column cut puts half of every block on each
    rank; each block's maximum must be the whole block's (it was each rank's half's, silently other bytes)."""
    ranks(2).run(quantize_sharded, fmt_name, (64, 32), (2,), "S1")


def test_quantize_sharded_2d(ranks):
    # rows over mesh dim 0 (nothing to reduce), columns over mesh dim 1: one all-reduce of the row maxima
    assert ranks(4).run(quantize_sharded, "int8", (12, 256), (2, 2), "S0,S1") == [1] * 4


def quantize_poisoned_sharded(fmt_name, shape, dtype, seed, kinds, placement, world=2):
    from torch.distributed.tensor import distribute_tensor

    fmt = FORMATS[fmt_name]
    w = poisoned(shape, dtype, seed, kinds)
    m = mesh(world)
    got = dq.quantize(distribute_tensor(w, m, placements(placement)), fmt)
    want = distribute_tensor(dq.quantize(w, fmt), m, placements(placement))
    full = got.full_tensor()  # every collective first: a failed assertion must not leave a rank waiting
    assert_same_bits(got.to_local(), want.to_local(), f"{fmt_name} {kinds} {placement}")
    assert_same_bits(full, dq.quantize(w, fmt), "full")


@pytest.mark.parametrize("fmt_name", [*EXTREME_FORMATS, "nf4b32s4"])
@pytest.mark.parametrize("placement", ["S0", "S1"])
def test_non_finite_quantize_sharded_is_bit_identical(ranks, fmt_name, placement):
    """gloo's MAX/MIN drop NaN depending on rank order; the reductions carry NaN on their own."""
    cases = [(["nan"], 0), (["-nan", "inf"], 1), (["-inf", "nan", "inf"], 2)]
    for kinds, seed in cases:
        args = (fmt_name, (8, 256), torch.bfloat16, seed, kinds, placement)
        ranks(2).run(quantize_poisoned_sharded, *args)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    fmt_name=st.sampled_from(EXTREME_FORMATS),
    placement=st.sampled_from(["S0", "S1"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    kinds=st.lists(st.sampled_from(["nan", "-nan", "inf", "-inf"]), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_non_finite_sweep_on_three_ranks(ranks, fmt_name, placement, dtype, kinds, seed):
    """Three ranks give gloo's MAX more orders to drop a NaN in; any positions, kinds and dtypes."""
    args = (fmt_name, (6, 192), dtype, seed, kinds, placement, 3)
    ranks(3).run(quantize_poisoned_sharded, *args)
