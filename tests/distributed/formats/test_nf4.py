"""formats/nf4 on live ranks: NF4 at the real widths of open models, sharded:
DTensor, FSDP2 and DCP, bit-exact vs one process.

Bit-exact: the stored bytes and dequantized values, and FSDP2's forward against the same dense
matmul on one process. The fused one-token kernel sums the same products in its own order, so it
is compared within the summation's bound (:mod:`dtensor_quant.testing.bounds`).

At most of these widths a factor's 256 block scales run across rows
(``FlatBlocked``): a row cut is legal when the elements before it are a
multiple of 64 * 256 (8 rows at 14336 columns, 32 at 3584, 128 at 29568),
column cuts never. Rows are chosen small, the columns real.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant.checkpoint import register
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import assert_same_bits, assert_within, linear_error_bound, mesh, rank, same_bits, weight
from tests.formats.test_nf4 import rows_per_cut


def dtensor_roundtrip(shape):
    """distribute (Shard(0)), full_tensor, redistribute, and quantize of a sharded dense DTensor."""
    world = dist.get_world_size()
    w = weight(shape, seed=shape[1])
    q = dq.quantize(w, dq.NF4())
    m = mesh(world)
    dt = distribute_tensor(q, m, [Shard(0)])
    expected = torch.chunk(q.dequantize(), world)
    local = dt.to_local()
    if rank() < len(expected):
        assert torch.equal(local.dequantize(), expected[rank()])
    assert_same_bits(dt.full_tensor(), q, "full_tensor")
    assert_same_bits(dt.redistribute(m, [Replicate()]).to_local(), q, "S0 -> R")
    back = dt.redistribute(m, [Replicate()]).redistribute(m, [Shard(0)])
    assert_same_bits(back.full_tensor(), q, "R -> S0")
    sharded = dq.quantize(distribute_tensor(w, m, [Shard(0)]), dq.NF4())  # each rank quantizes its rows
    assert_same_bits(sharded.full_tensor(), q, "quantized shard by shard")
    try:
        dt.redistribute(m, [Shard(1)])
    except dq.LayoutError as e:
        return str(e)
    raise AssertionError("Shard(1) of a flat-blocked NF4 weight was not refused")


DTENSOR_CASES = [(2, (16, 14336)), (3, (46, 14336)), (4, (30, 14336)), (2, (64, 3584)), (4, (256, 768))]


@pytest.mark.parametrize("world,shape", DTENSOR_CASES)
def test_dtensor_bit_exact(ranks, world, shape):
    errors = ranks(world).run(dtensor_roundtrip, shape)
    # the same error on every rank
    assert len(set(errors)) == 1 and "blocked over the flattened weight" in errors[0], errors


def fsdp_gather(shape):
    world = dist.get_world_size()
    q = dq.quantize(weight(shape, seed=shape[1]), dq.NF4())
    lin = nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
    lin.weight = nn.Parameter(q, requires_grad=False)
    model = nn.Sequential(lin)
    x = weight((2, shape[1]), seed=5)
    y_kernel = model(x)  # one process: NF4's fused kernel (or dequantize + mm where it cannot run)
    fully_shard(model, mesh=mesh(world))
    chunks = torch.chunk(q.dequantize(), world)
    local = model[0].weight.to_local()
    if rank() < len(chunks):
        assert torch.equal(local.dequantize(), chunks[rank()])
    model.unshard()  # a frozen weight is dequantized once per all-gather, bit-exactly
    assert same_bits(model[0].weight.detach(), q.dequantize()), "unsharded"
    model.reshard()
    y = model(x)
    # FSDP2's forward is the dense matmul of the gathered values: the same computation as one process's
    # dequantize + mm, bit for bit; the fused kernel sums the same products in its own order (bf16 out).
    assert torch.equal(y, torch.nn.functional.linear(x, q.dequantize()))
    assert_within(y, y_kernel, 2 * linear_error_bound(x, q.dequantize()), "FSDP2 vs the one-process kernel")


FSDP_CASES = [
    (2, (16, 14336)),
    (3, (46, 14336)),
    (4, (30, 14336)),
    (4, (128, 3584)),
    (2, (128, 11008)),
    (3, (96, 18944)),
]


@pytest.mark.parametrize("world,shape", FSDP_CASES)
def test_fsdp2_bit_exact(ranks, world, shape):
    ranks(world).run(fsdp_gather, shape)


@pytest.mark.slow
@pytest.mark.parametrize("world,cols", [(2, 29568), (2, 5632)])
def test_fsdp2_widest(ranks, world, cols):
    ranks(world).run(fsdp_gather, (2 * rows_per_cut(cols), cols))


def fsdp_refused(shape):
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16))
    dq.quantize_(model, dq.NF4())
    try:
        fully_shard(model, mesh=mesh(dist.get_world_size()))
    except dq.LayoutError as e:
        return str(e)
    return "not refused"


def test_fsdp2_illegal_degree_names_legal_ones(ranks):
    errors = ranks(3).run(fsdp_refused, (32, 14336))  # chunks of 11 rows: not whole factors (8 rows)
    assert len(set(errors)) == 1 and "Legal FSDP2 sizes: 1, 2, 4" in errors[0], errors


def dcp_save(shape, path, world_src):
    q = dq.quantize(weight(shape, seed=shape[1]), dq.NF4())
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16))
    model[0].weight = nn.Parameter(distribute_tensor(q, mesh(world_src), [Shard(0)]), requires_grad=False)
    register(model)
    dq.checkpoint.save(model, path)


def dcp_load(shape, path):
    world = dist.get_world_size()
    q = dq.quantize(weight(shape, seed=shape[1]), dq.NF4())
    other = dq.quantize(weight(shape, seed=99), dq.NF4())
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16))
    model[0].weight = nn.Parameter(distribute_tensor(other, mesh(world), [Shard(0)]), requires_grad=False)
    register(model)
    dq.checkpoint.load(model, path)
    assert_same_bits(model[0].weight.full_tensor(), q, "loaded")
    expected = torch.chunk(q.dequantize(), world)
    if rank() < len(expected):
        assert torch.equal(model[0].weight.to_local().dequantize(), expected[rank()])


@pytest.mark.parametrize("src,dst", [(2, 3), (4, 2)])
def test_dcp_reshard_bit_exact(ranks, tmp_path, src, dst):
    shape = (128, 3584) if 4 in (src, dst) else (48, 14336)  # whole factors per shard at both degrees
    path = str(tmp_path / "ckpt")
    ranks(src).run(dcp_save, shape, path, src)
    ranks(dst).run(dcp_load, shape, path)
