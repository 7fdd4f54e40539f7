"""_parallel/collectives on live ranks, for quantized expert stacks ``[experts, out, in]``: EP and TP.

``Shard(0)`` puts whole experts on each rank (expert parallelism), ``Shard(1)``
/ ``Shard(2)`` shard inside every expert (tensor parallelism), and a 2-D mesh
does both. Every move is checked bit-exactly against one process, with
quantized bytes only on the wire, including uneven expert counts.
"""

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.testing import (
    FORMATS,
    assert_redistributes_exactly,
    assert_same_bits,
    assert_within,
    legal,
    linear_error_bound,
    mesh,
    pick,
    placements,
    unit_roundoff,
    weight,
)

# the (E, 32, 512) sweeps: blocks that fit 512 columns (nf4b64s8: one scaler factor per row)
TOY_FORMATS = list(pick("int8", "int4g64", "nf4b64s8", "f8row", "f8tensor", "f8block32"))


def expert_roundtrip(fmt_name, shape, mesh_shape, src, targets):
    fmt, m = FORMATS[fmt_name], mesh(*mesh_shape)
    w = weight(shape, seed=11)
    q = dq.quantize(w, fmt)
    targets = [t for t in targets if legal(fmt, shape, mesh_shape, t)]
    with wire.record() as log:
        dt = distribute_tensor(q, m, placements(src))
        assert_redistributes_exactly(dt, q, targets, src)
        # quantizing the sharded dense stack gives the same bytes (EP needs no reduction at all)
        got = dq.quantize(distribute_tensor(w, m, placements(src), src_data_rank=None), fmt)
        assert_same_bits(got.to_local(), dt.to_local(), f"quantize on {src}")
    moved_dense = {t.dtype for t in log.transfers if not t.quantized and t.dtype != torch.uint8}
    assert {t.dtype for t in log.transfers if t.quantized} <= {torch.uint8}
    # the only dense traffic allowed: the scale statistics quantize() reduces (float32 maxima travel as
    # int32 keys in IEEE total order so NaN survives the all-reduce; sums as float64)
    assert moved_dense <= {torch.float32, torch.int32, torch.float64}, moved_dense
    return len(targets)


def _cases_1d():
    for world in (2, 4):
        for fmt_name in TOY_FORMATS:
            for experts in (3, 4, 5):  # 3 and 5 experts shard unevenly (3 over 4 ranks: one holds none)
                quick = experts == 3 and fmt_name in ("int8", "nf4b64s8", "int4g64")
                yield pytest.param(world, fmt_name, experts, marks=() if quick else pytest.mark.slow)


@pytest.mark.parametrize("world,fmt_name,experts", list(_cases_1d()))
def test_expert_parallel_1d(ranks, world, fmt_name, experts):
    shape, targets = (experts, 32, 512), ["R", "S0", "S1", "S2"]
    movable = [t for t in targets if legal(FORMATS[fmt_name], shape, (world,), t)]
    for src in movable:
        assert ranks(world).run(expert_roundtrip, fmt_name, shape, (world,), src, targets) == [len(movable)] * world


@pytest.mark.parametrize("fmt_name", ["nf4", "int4g128", "int8"])  # nf4: a scaler factor runs across rows
@pytest.mark.parametrize("width", [14336, 11008])
def test_expert_parallel_at_real_widths(ranks, fmt_name, width):
    """Experts of a real model's width (Mixtral's 14336, Llama-2's 11008) with few rows; every legal move."""
    shape, targets = (3, 8, width), ["R", "S0", "S1", "S2"]
    movable = [t for t in targets if legal(FORMATS[fmt_name], shape, (2,), t)]
    sources = [s for s in ("S0", "S2", "R") if s in movable]
    assert sources, f"no legal placement of {shape} for {fmt_name}"
    for src in sources:
        assert ranks(2).run(expert_roundtrip, fmt_name, shape, (2,), src, targets) == [len(movable)] * 2


@pytest.mark.parametrize(
    "fmt_name", [n if n in ("int8", "nf4b64s8") else pytest.param(n, marks=pytest.mark.slow) for n in TOY_FORMATS]
)
@pytest.mark.parametrize("src", ["S0,S1", "S0,S2", "S0,R", "R,S1"])
def test_expert_and_tensor_parallel_2d(ranks, fmt_name, src):
    """Experts over mesh dim 0 (EP), inside each expert over mesh dim 1 (TP), and every move between them."""
    shape = (3, 32, 512)
    if not legal(FORMATS[fmt_name], shape, (2, 2), src):
        pytest.skip("illegal for this layout")
    targets = ["S0,S1", "S0,S2", "S0,R", "R,S1", "R,R", "S1,S0"]
    movable = [t for t in targets if legal(FORMATS[fmt_name], shape, (2, 2), t)]
    assert ranks(4).run(expert_roundtrip, fmt_name, shape, (2, 2), src, targets) == [len(movable)] * 4


def expert_linear(fmt_name, specs):
    """An expert picked from a sharded stack runs F.linear on its local shard like one process."""
    fmt, m = FORMATS[fmt_name], mesh(2, 2)
    w = weight((4, 32, 512), seed=12)
    q = dq.quantize(w, fmt)
    dt = distribute_tensor(q, m, placements(specs))
    x = weight((3, 512), seed=13)
    local = dt.to_local()
    ep = dt.placements[0]
    # this rank's experts: torch.chunk over mesh dim 0
    first = m.get_local_rank(0) * -(-4 // 2) if isinstance(ep, Shard) else None
    for i in range(local.shape[0]):
        e = first + i if first is not None else i
        full = torch.nn.functional.linear(x, q[e])
        if dt.placements[1] == Shard(1):  # out features sharded: this rank's columns of the output
            cols = torch.chunk(full, 2, dim=-1)[m.get_local_rank(1)]
            # the same sums, but a kernel over half the columns may block them otherwise (the CPU decides)
            w = torch.chunk(q[e].dequantize(torch.float32), 2)[m.get_local_rank(1)]
            w_err = unit_roundoff(torch.bfloat16) * w.abs()  # a kernel may use the values before bf16 rounding
            bound = 2 * linear_error_bound(x, w, out_dtype=torch.bfloat16, weight_error=w_err)
            assert_within(torch.nn.functional.linear(x, local[i]), cols, bound, f"expert {e}")
        else:  # the whole expert: the same kernel on the same bytes
            assert torch.equal(torch.nn.functional.linear(x, local[i]), full)
    return local.shape[0]


@pytest.mark.parametrize("specs", ["S0,S1", "S0,R"])
def test_selected_local_expert_linear(ranks, specs):
    # 4 experts: 2 on each rank under EP
    assert ranks(4).run(expert_linear, "int8", specs) == [2] * 4


def misaligned():
    """Int4 g128 on 384 columns over 4 ranks: chunks of 96 cut groups inside every expert."""
    q = dq.quantize(weight((2, 8, 384)), dq.Int4Groupwise(128))
    try:
        distribute_tensor(q, mesh(4), [Shard(2)])
    except dq.LayoutError as e:
        return "LayoutError" if "not a multiple of 128" in str(e) else str(e)
    return "no error"


def test_misaligned_tp_inside_experts_raises_on_every_rank(ranks):
    assert ranks(4).run(misaligned) == ["LayoutError"] * 4


def fewer_experts_than_ranks():
    """3 experts over 4 ranks: quantize and dequantize of the DTensor keep Shard(0) and move nothing."""
    m, w = mesh(4), weight((3, 8, 256), seed=14)
    dense = distribute_tensor(w, m, [Shard(0)], src_data_rank=None)
    with wire.record() as log:
        q = dq.quantize(dense, dq.Int8Rowwise())
        back = dq.dequantize(q)
    moved = [t for t in log.transfers if t.op != "dtensor_quant::agree"]  # the ranks' one-time format check
    assert q.placements == back.placements == (Shard(0),) and not moved, (q.placements, back.placements, moved)
    expected = dq.quantize(w, dq.Int8Rowwise()).dequantize()
    assert torch.equal(back.full_tensor(), expected)
    return back.to_local().shape[0]


def test_fewer_experts_than_ranks_stay_sharded(ranks):
    assert ranks(4).run(fewer_experts_than_ranks) == [1, 1, 1, 0]
