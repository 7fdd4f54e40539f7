"""model/trainable on live ranks: trainable quantized weights under FSDP2, tensor parallelism, both, and DCP resharding.

The reference is one process updating the same model with the same
gradients: every sharded run must hold the same bytes, because each shard
requantizes its own rows with the statistics of the whole weight (reduced
over the shards that share them) and noise keyed by the global element index.
Gradients are injected, so the only thing that differs is the sharding.
"""

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh

FORMATS = {"int8": dq.Int8Rowwise(), "float8": dq.Float8Rowwise(), "float8t": dq.Float8Tensorwise()}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


def model(fmt_name, rows=10, tp=None, quantize_first=False):
    """Two Linears ([rows, 64], [16, rows]): 10 rows shard unevenly over 3 ranks (4, 4, 2)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, rows, bias=False), nn.Linear(rows, 16, bias=True)).to(torch.bfloat16)
    if quantize_first:
        dq.quantize_(m, FORMATS[fmt_name], trainable=True, seed=3)
    if tp is not None:
        parallelize_module(m, tp, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    if not quantize_first:
        dq.quantize_(m, FORMATS[fmt_name], trainable=True, seed=3)
    return m


def sharded(m, fsdp_mesh):
    for layer in m:
        fully_shard(layer, mesh=fsdp_mesh)
    return fully_shard(m, mesh=fsdp_mesh)


def step(m, opt, seed):
    """One optimizer step with gradients drawn from ``seed`` (the same global values everywhere)."""
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if isinstance(p, DTensor):
            grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = grad
    opt.step()
    opt.zero_grad()


def snapshot(m) -> list:
    """Every parameter as full bytes: inner tensors of quantized ones (as uint8 where 1 byte), else values."""
    out = []
    for p in m.parameters():
        p = p.detach()
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if isinstance(full, dq.QuantizedTensor):
            out.append({n: _bytes(t).clone() for n, t in full.inner.items()})
        else:
            out.append(full.clone())
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same(a: list, b: list) -> bool:
    return all(
        all(torch.equal(x[n], y[n]) for n in x) if isinstance(x, dict) else torch.equal(x, y) for x, y in zip(a, b)
    )


def trained(fmt_name, opt_name, steps, how=None):
    """The model after ``steps`` injected steps: one process (how=None), FSDP2, TP or FSDP2 + TP."""
    world = dist.get_world_size() if how else 1
    if how is None:
        m = model(fmt_name)
    elif how == "fsdp":
        m = sharded(model(fmt_name), mesh(world))
    elif how in ("tp", "tp-quantize-first"):
        m = model(fmt_name, rows=32, tp=mesh(world), quantize_first=how == "tp-quantize-first")
    elif how == "2d":
        m2 = mesh(2, world // 2)
        m = sharded(model(fmt_name, rows=32, tp=m2["tp"]), m2["dp"])
    opt = OPTIMIZERS[opt_name](list(m.parameters()))
    for s in range(steps):
        step(m, opt, s)
    counts = [st["sr_step"] for st in opt.state_dict()["state"].values() if "sr_step" in st]
    return snapshot(m), counts


def reference(fmt_name, opt_name, steps, rows):
    m = model(fmt_name, rows=rows)
    opt = OPTIMIZERS[opt_name](list(m.parameters()))
    for s in range(steps):
        step(m, opt, s)
    return snapshot(m)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw-foreach"])
def test_fsdp2_updates_give_the_bytes_of_one_process(ranks, world, opt_name):
    """Even (2 ranks) and uneven (3 ranks: 4, 4 and 2 rows) shards, SGD with momentum and foreach AdamW."""
    expected = reference("int8", opt_name, 4, rows=10)
    for got, counts in ranks(world).run(trained, "int8", opt_name, 4, "fsdp"):
        assert same(got, expected)
        assert counts == [4 * (2 if opt_name.startswith("adamw") else 1)] * 2  # AdamW: mul_ (decay) + addcdiv_


def test_fsdp2_single_tensor_adamw_and_float8(ranks):
    assert same(ranks(3).run(trained, "int8", "adamw", 3, "fsdp")[1][0], reference("int8", "adamw", 3, rows=10))
    assert same(
        ranks(2).run(trained, "float8", "adamw-foreach", 3, "fsdp")[0][0],
        reference("float8", "adamw-foreach", 3, rows=10),
    )


@pytest.mark.parametrize("fmt_name", ["int8", "float8t"])
@pytest.mark.parametrize("how", ["tp", "tp-quantize-first"])
def test_tensor_parallel_updates_give_the_bytes_of_one_process(ranks, fmt_name, how):
    """Colwise (row shards) and Rowwise (column shards: the row scales are all-reduced over the TP group)."""
    expected = reference(fmt_name, "adamw-foreach", 3, rows=32)
    for got, _ in ranks(2).run(trained, fmt_name, "adamw-foreach", 3, how):
        assert same(got, expected)


@pytest.mark.slow  # four ranks on two cores
def test_fsdp2_with_tensor_parallel_gives_the_bytes_of_one_process(ranks):
    expected = reference("int8", "adamw-foreach", 3, rows=32)
    for got, _ in ranks(4).run(trained, "int8", "adamw-foreach", 3, "2d"):
        assert same(got, expected)


# -- DCP: save on 2 ranks, resume on 3 and on 1 ----------------------------------------


def _steps_then_save(path, k):
    m = sharded(model("int8"), mesh(dist.get_world_size()))
    opt = OPTIMIZERS["adamw-foreach"](list(m.parameters()))
    for s in range(k):
        step(m, opt, s)
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, planner=dq.checkpoint.SavePlanner())
    return snapshot(m)


def _resume(path, k, n):
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    m = model("int8")
    if distributed:
        m = sharded(m, mesh(dist.get_world_size()))
    opt = OPTIMIZERS["adamw-foreach"](list(m.parameters()))
    model_sd, optim_sd = get_state_dict(m, opt)
    planner = dq.checkpoint.LoadPlanner()  # the model's state dict holds tensors
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, planner=planner, no_dist=not distributed)
    set_state_dict(m, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = snapshot(m)
    for s in range(k, n):
        step(m, opt, s)
    return loaded, snapshot(m)


def test_save_on_2_ranks_resume_on_3_and_on_1_bit_exactly(ranks):
    """Weights, optimizer states and each weight's stochastic-rounding count reshard exactly."""
    path = tempfile.mkdtemp(prefix="dq_trainable_")
    try:
        saved = ranks(2).run(_steps_then_save, path, 3)[0]
        assert same(saved, reference("int8", "adamw-foreach", 3, rows=10))
        uninterrupted = reference("int8", "adamw-foreach", 6, rows=10)
        for loaded, end in ranks(3).run(_resume, path, 3, 6) + [_resume(path, 3, 6)]:
            assert same(loaded, saved)
            assert same(end, uninterrupted)
    finally:
        shutil.rmtree(path, ignore_errors=True)
