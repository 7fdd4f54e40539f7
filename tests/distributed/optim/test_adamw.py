"""optim/adamw on live ranks: dq.optim's quantized moments as DTensors:
FSDP2, tensor parallelism, both, and DCP across layouts.

The moments of a DTensor parameter are DTensors of QuantizedTensors with the
parameter's placements. With the same gradients injected everywhere, every
sharded run must hold one process's bytes -- weights (trainable int8) and
both moments -- and a checkpoint saved under FSDP2 on 2 ranks must load under
FSDP2 on 3 ranks, TP on 2 and one process, and continue bit for bit.
"""

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh

BITS = {8: dq.optim.AdamW8bit, 4: dq.optim.AdamW4bit}


def model(how: str | None):
    """[64, 256] and [256, 64] Linears: 64 rows shard 22/22/20 over 3 ranks; 64 columns 32/32 under TP."""
    world = dist.get_world_size() if how else 1
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 64, bias=False), nn.Linear(64, 256, bias=True)).to(torch.bfloat16)
    if how in ("tp", "2d"):
        tp = mesh(world) if how == "tp" else mesh(2, world // 2)["tp"]
        parallelize_module(m, tp, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    dq.quantize_(m, dq.Int8Rowwise(), trainable=True, seed=3)
    if how in ("fsdp", "2d"):
        dp = mesh(world) if how == "fsdp" else mesh(2, world // 2)["dp"]
        for layer in m:
            fully_shard(layer, mesh=dp)
        fully_shard(m, mesh=dp)
    return m


def optimizer(m, bits: int):
    return BITS[bits](list(m.parameters()), lr=1e-2, block_size=32, min_quantized_numel=1024)


def steps(m, opt, first: int, last: int) -> None:
    for s in range(first, last):
        g = torch.Generator().manual_seed(s)
        for p in m.parameters():
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad
        opt.step()
        opt.zero_grad()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) if t.element_size() == 1 else t).clone()


def snapshot(m, opt) -> list:
    """Full bytes of every parameter and moment, and which moments are quantized."""
    out = []
    with torch.no_grad():
        for p in m.parameters():
            for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if isinstance(full, dq.QuantizedTensor):
                    out.append({n: _bytes(v) for n, v in full.inner.items()})
                else:
                    out.append(full.clone())
    return out


def same(a: list, b: list) -> bool:
    return all(
        all(torch.equal(x[n], y[n]) for n in x) if isinstance(x, dict) else torch.equal(x, y) for x, y in zip(a, b)
    )


def trained(how, bits, n):
    m = model(how)
    opt = optimizer(m, bits)
    steps(m, opt, 0, n)
    kinds = []
    for p in m.parameters():
        state = opt.state[p]["exp_avg"]
        local = state._local_tensor if isinstance(state, DTensor) else state
        placements = tuple(state.placements) if isinstance(state, DTensor) else None
        assert placements is None or placements == tuple(p.placements)
        kinds.append(type(local).__name__)
    return snapshot(m, opt), kinds


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("how,world", [("fsdp", 2), ("fsdp", 3), ("tp", 2)])
def test_sharded_moments_hold_the_bytes_of_one_process(ranks, bits, how, world):
    expected, kinds = trained(None, bits, 3)
    assert kinds == ["QuantizedTensor", "QuantizedTensor", "Tensor"]  # the bias keeps dense moments
    for got, got_kinds in ranks(world).run(trained, how, bits, 3):
        assert got_kinds == kinds
        assert same(got, expected)


@pytest.mark.slow  # four ranks on two cores
def test_fsdp2_with_tensor_parallel_moments(ranks):
    expected, _ = trained(None, 8, 3)
    for got, _ in ranks(4).run(trained, "2d", 8, 3):
        assert same(got, expected)


def decided_globally():
    """A weight of 6 rows over 4 ranks: shards of 2, 2, 2 and 0 rows; 4096 elements in all."""
    lin = nn.Linear(1024, 6, bias=False)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh(4), [Shard(0)]))
    opt = dq.optim.AdamW8bit([lin.weight], lr=1e-3, min_quantized_numel=4096)
    lin.weight.grad = distribute_tensor(torch.ones(6, 1024), mesh(4), [Shard(0)])
    opt.step()
    local = opt.state[lin.weight]["exp_avg"].to_local()
    full = opt.state[lin.weight]["exp_avg"].full_tensor()
    return type(local).__name__, tuple(local.shape), full.dequantize(torch.float32)


@pytest.mark.slow  # four ranks on two cores
def test_quantized_or_not_is_decided_from_the_global_shape(ranks):
    """Every shard of a 4096-element weight is quantized, even the empty one and those of 2048 (ao#4912)."""
    results = ranks(4).run(decided_globally)
    assert [r[0] for r in results] == ["QuantizedTensor"] * 4
    assert [r[1] for r in results] == [(2, 1024)] * 3 + [(0, 1024)]
    for *_, full in results:
        torch.testing.assert_close(full, torch.full((6, 1024), 0.1), rtol=0.07, atol=0)


def refused_cut():
    m = nn.Sequential(nn.Linear(256, 96, bias=False), nn.Linear(96, 256, bias=False)).to(torch.bfloat16)
    parallelize_module(m, mesh(2), {"0": ColwiseParallel(), "1": RowwiseParallel()})
    try:
        dq.optim.AdamW8bit(m.parameters(), block_size=32, min_quantized_numel=1024)
    except dq.LayoutError as e:
        return str(e)
    return None


def test_a_state_placement_that_cuts_a_block_is_refused_on_every_rank(ranks):
    """96 columns over 2 ranks: 48 per rank, not a multiple of the state's 32-column blocks."""
    for message in ranks(2).run(refused_cut):
        assert message is not None and "multiple of 32" in message


# -- DCP: save under FSDP2 on 2 ranks; load under FSDP2 on 3, TP on 2 and one process -----------


def _save(path, bits, k):
    m = model("fsdp")
    opt = optimizer(m, bits)
    steps(m, opt, 0, k)
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, planner=dq.checkpoint.SavePlanner())
    return snapshot(m, opt)


def _resume(path, how, bits, k, n):
    m = model(how)
    opt = optimizer(m, bits)
    model_sd, optim_sd = get_state_dict(m, opt)
    planner = dq.checkpoint.LoadPlanner()  # the model's state dict holds tensors
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, planner=planner, no_dist=how is None)
    set_state_dict(m, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = snapshot(m, opt)
    steps(m, opt, k, n)
    return loaded, snapshot(m, opt)


@pytest.mark.parametrize("bits", [8, 4])
def test_save_in_one_layout_load_in_any_other_bit_exactly(ranks, bits):
    path = tempfile.mkdtemp(prefix="dq_optim_")
    try:
        saved = ranks(2).run(_save, path, bits, 2)[0]
        uninterrupted, _ = trained(None, bits, 4)
        results = ranks(3).run(_resume, path, "fsdp", bits, 2, 4) + ranks(2).run(_resume, path, "tp", bits, 2, 4)
        for loaded, end in results + [_resume(path, None, bits, 2, 4)]:
            assert same(loaded, saved)  # codes and scales of weights and moments, in the new layout
            assert same(end, uninterrupted)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def refused_block_size():
    """AdamW8bit's default 256-value blocks on a 256-wide Linear under row-parallel TP 2 (128 columns each)."""
    m = nn.Linear(256, 64, bias=False)
    parallelize_module(m, mesh(2), RowwiseParallel())
    try:
        dq.optim.AdamW8bit(m.parameters(), min_quantized_numel=1024)
    except dq.LayoutError as e:
        message = str(e)
    else:
        return None
    return message, dq.optim.AdamW8bit(m.parameters(), block_size=128, min_quantized_numel=1024) is not None


def test_a_refused_block_size_names_one_that_works(ranks):
    for message, works in ranks(2).run(refused_block_size):
        assert "block_size=128 works" in message and works
