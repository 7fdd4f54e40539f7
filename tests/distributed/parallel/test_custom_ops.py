"""_parallel/custom_ops on live ranks: quantize / dequantize / linear on DTensors: strategies, cache keys, results.

References are single-process: the full weight quantized once, and the dense
matmul of its dequantized values, compared within the bound of the summation
(:mod:`dtensor_quant.testing.bounds`): a sharded matmul sums in another order
or blocks a narrower GEMM otherwise, and the order depends on the CPU. register_sharding keys its cache only on
arguments from the first int on, so every discriminating argument (format,
dtype) is exercised with more than one value in the same process, in an
order that would reuse a wrong cached decision if it were not keyed.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._core.format_ids import format_id
from dtensor_quant._parallel import custom_ops as ops
from dtensor_quant.testing import FORMATS, assert_same_bits, assert_within, linear_error_bound, mesh, weight


def quantize_op_case(fmt_name, shape, spec):
    """The quantize op on a sharded dense DTensor == distributing the single-process quantized weight."""
    fmt, m = FORMATS[fmt_name], mesh(2)
    placement = [Shard(int(spec[1]))] if spec.startswith("S") else [Replicate()]
    w = weight(shape, seed=3)
    dense = distribute_tensor(w, m, placement)
    with wire.record() as log:
        got = ops.quantize(dense, fmt)
    assert isinstance(got, DTensor) and got.placements == tuple(placement) and got.shape == w.shape
    expected = distribute_tensor(dq.quantize(w, fmt), m, placement)
    assert_same_bits(got.to_local(), expected.to_local(), f"{fmt_name} {spec}")
    # Only block statistics travel (one per row at most), never the weight.
    stats = [t for t in log.transfers if t.op != "dtensor_quant::agree"]  # the ranks' one-time format check
    assert sum(t.nbytes for t in stats) <= 4 * shape[0], log.transfers
    return len(stats)


@pytest.mark.parametrize(
    "fmt_name,spec,collectives",
    [("int8", "R", 0), ("int8", "S0", 0), ("int8", "S1", 1), ("int4g64", "S1", 0), ("int4g128", "S0", 0)],
)
def test_quantize_op_on_dtensor(ranks, fmt_name, spec, collectives):
    assert ranks(2).run(quantize_op_case, fmt_name, (24, 512), spec) == [collectives] * 2


def cache_keys_on_format_and_dtype():
    """Same input specs, different format or dtype, in the order a non-keyed cache would get wrong."""
    m = mesh(2)
    w = weight((16, 384), seed=4)
    dense = distribute_tensor(w, m, [Shard(1)])  # 192 columns per rank: int8 yes, int4 g128 no
    q8 = ops.quantize(dense, FORMATS["int8"])
    shard_dims, groups = [1], [m.get_group(0).group_name]
    errors = []
    try:  # straight to the op, past the wrapper's own check: only the strategy can refuse now
        torch.ops.dtensor_quant.quantize(dense, format_id(FORMATS["int4g128"]), shard_dims, groups, list(dense.shape))
    except RuntimeError as e:
        errors.append(str(e))
    try:  # mismatched groups: the strategy refuses instead of reducing over the wrong ranks
        torch.ops.dtensor_quant.quantize(dense, format_id(FORMATS["int8"]), [0], groups, list(dense.shape))
    except RuntimeError as e:
        errors.append(str(e))
    dtypes = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16):
        d = ops.dequantize(q8, dtype)
        assert isinstance(d, DTensor) and d.placements == (Shard(1),)
        assert torch.equal(d.full_tensor(), dq.quantize(w, FORMATS["int8"]).dequantize(dtype))
        dtypes.append((d.dtype, d.to_local().dtype))
    return errors, dtypes


def test_cache_keys_on_every_discriminating_argument(ranks):
    for errors, dtypes in ranks(2).run(cache_keys_on_format_and_dtype):
        assert len(errors) == 2
        assert "Int4Groupwise(group_size=128)" in errors[0] and "multiple of 128" in errors[0]
        assert "shard_dims=[1]" in errors[1]
        assert dtypes == [(d, d) for d in (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16)]


def linear_op_case(fmt_name, x_spec, w_spec, with_bias):
    """The linear op on DTensors against the single-process quantized linear."""
    fmt, m = FORMATS[fmt_name], mesh(2)
    w = weight((64, 384), seed=5, dtype=torch.float32)
    x = weight((2, 3, 384), seed=6, dtype=torch.float32)
    bias = weight((64,), seed=7, dtype=torch.float32) if with_bias else None
    q = dq.quantize(w, fmt)
    expected = F.linear(x, q, bias)
    dq_w = distribute_tensor(q, m, [w_spec])
    dx = distribute_tensor(x, m, [x_spec])
    dbias = distribute_tensor(bias, m, [Shard(0) if w_spec == Shard(0) else Replicate()]) if with_bias else None
    with wire.record() as log:
        out = ops.linear(dx, dq_w, dbias)
    assert isinstance(out, DTensor)
    # The quantized weight never moves: nothing quantized (and no weight-sized tensor) on the wire.
    assert not any(t.quantized for t in log.transfers), log.transfers
    full = out.full_tensor()
    if w_spec == Shard(0) and x_spec == Replicate():
        assert out.placements == (Shard(2),)  # each rank computes whole output columns
    # Column-parallel sums each element on one rank, but a GEMM of half the width may block it otherwise;
    # row-parallel sums partial sums; sequence-sharded GEMMs see other shapes. All within the bound:
    assert_within(full, expected, 2 * linear_error_bound(x, q.dequantize(), bias), f"{fmt_name} {x_spec} {w_spec}")
    return out.placements[0]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "x_spec,w_spec,placement",
    [
        (Replicate(), Shard(0), Shard(2)),  # column-parallel
        (Shard(2), Shard(1), Partial()),  # row-parallel: partial sums
        (Shard(1), Replicate(), Shard(1)),  # sequence-sharded input, replicated weight
    ],
)
def test_linear_op_on_dtensor(ranks, x_spec, w_spec, placement, with_bias):
    for fmt_name in ("int8", "int4g64"):
        assert ranks(2).run(linear_op_case, fmt_name, x_spec, w_spec, with_bias) == [placement] * 2


def linear_strategy_respects_layout():
    """Input sharded on its last dim, weight replicated: int8 may go row-parallel, int4 g128 may not.

    Row-parallel would split the replicated weight at column 192, inside a
    group of 128; the strategy leaves that option out for int4 (keyed on the
    format id, after int8 took it with the same input specs).
    """
    m = mesh(2)
    w = weight((64, 384), seed=8, dtype=torch.float32)
    x = distribute_tensor(weight((4, 384), seed=9, dtype=torch.float32), m, [Shard(1)])
    results = []
    for name in ("int8", "int4g128", "int8"):
        q = dq.quantize(w, FORMATS[name])
        out = ops.linear(x, distribute_tensor(q, m, [Replicate()]))
        bound = 2 * linear_error_bound(x.full_tensor(), q.dequantize())  # partial sums, then the all-reduce
        assert_within(out.full_tensor(), F.linear(x.full_tensor(), q), bound, name)
        results.append(out.placements[0])
    return results


def test_linear_strategy_follows_the_format(ranks):
    results = ranks(2).run(linear_strategy_respects_layout)
    for r in results:
        assert r[0] == r[2] == Partial() and r[1] != Partial(), r


def dequantize_keeps_placements():
    m = mesh(2)
    q = dq.quantize(weight((32, 256), seed=10), FORMATS["int4g64"])
    for p in ([Shard(0)], [Shard(1)], [Replicate()]):
        d = ops.dequantize(distribute_tensor(q, m, p), torch.float32)
        assert d.placements == tuple(p)
        assert torch.equal(d.full_tensor(), q.dequantize(torch.float32))
    try:
        ops.quantize(DTensor.from_local(weight((4, 64)), m, [Partial()]), FORMATS["int8"])
    except dq.LayoutError as e:
        return str(e)
    return "not refused"


def test_dequantize_op_and_partial_refusal(ranks):
    for message in ranks(2).run(dequantize_keeps_placements):
        assert "Partial" in message, message
