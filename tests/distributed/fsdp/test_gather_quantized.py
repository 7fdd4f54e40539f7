"""fsdp/gather_quantized on live ranks: trainable high-precision weights that FSDP2 all-gathers quantized.

The reference is the same wrapped weight on one process, whose matmul
quantizes the whole master: FSDP2 must gather exactly those bytes (scales
reduced across shards where the layout needs it), forward with them, and
hand the master the dense straight-through gradient.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._fsdp.gather_quantized import GatherQuantized
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import assert_same_bits, assert_within, gamma, mesh, rank, weight
from tests.support.extra_formats import FORMATS, RowBlockInt8
from tests.support.training import batches, floor_bytes, gather_quantized_model, gather_quantized_reference, train


def gather_and_grad(fmt_name, shape, mp):
    """Unshard a wrapped Linear: quantize(master) bit for bit; its gradient reaches the master shard."""
    world = torch.distributed.get_world_size()
    fmt, param_dtype = FORMATS[fmt_name], getattr(torch, mp) if mp else None
    master = weight(shape, seed=4, dtype=torch.float32)
    x = weight((3, shape[1]), seed=5, dtype=param_dtype or torch.float32)

    ref_w = nn.Parameter(GatherQuantized(master.clone(), fmt, quant_dtype=param_dtype))
    y_ref = F.linear(x, ref_w)
    y_ref.float().sum().backward()
    expected = ref_w.detach().quantized()

    lin = nn.Linear(shape[1], shape[0], bias=False)
    lin.weight = nn.Parameter(GatherQuantized(master.clone(), fmt, quant_dtype=param_dtype))
    model = nn.Sequential(lin)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh(world), mp_policy=policy)
    with wire.record() as log:
        model.unshard()
    full = lin.weight
    assert isinstance(full, dq.QuantizedTensor) and full.dtype == (param_dtype or torch.float32)
    assert_same_bits(full.to(expected.dtype), expected, f"{fmt_name} over {world}")
    assert log.all_gathers().dtypes() == {torch.uint8}

    y = model(x)
    assert torch.equal(y, y_ref), (y - y_ref).abs().max()
    y.float().sum().backward()
    grad = lin.weight.grad  # the master's shard, after FSDP2's reduce-scatter
    assert isinstance(lin.weight.to_local(), GatherQuantized)
    chunks = torch.chunk(ref_w.grad, world)
    local = grad.to_local()
    if rank() < len(chunks):
        # every rank computed the same gradient; FSDP2 sums the world's copies and divides: world + 1 roundings
        want = chunks[rank()].to(local.dtype)
        assert_within(local, want, gamma(world + 1) * want.double().abs(), "master gradient")
    else:  # a rank past the last row (4 ranks, 5 rows) holds no gradient rows
        assert local.numel() == 0, local.shape


@pytest.mark.parametrize("world,shape", [(2, (16, 256)), (3, (10, 256)), (4, (5, 256))])
@pytest.mark.parametrize("fmt_name", ["int8", "int4g32", "pertensor", "column"])
def test_gathered_weight_and_gradient(ranks, fmt_name, world, shape):
    """Per-tensor and per-column scales are all-reduced across the shards before quantizing."""
    ranks(world).run(gather_and_grad, fmt_name, shape, None)


@pytest.mark.parametrize("fmt_name,world,shape", [("int8", 2, (16, 256)), ("rowblock4", 3, (22, 256))])
def test_gathered_weight_bf16(ranks, fmt_name, world, shape):
    ranks(world).run(gather_and_grad, fmt_name, shape, "bfloat16")


def scale_reduction_collectives(fmt_name):
    """All-reduces the pre-hook issues: one per weight whose scale spans shards, none otherwise."""
    lin = nn.Linear(256, 16, bias=False)
    lin.weight = nn.Parameter(GatherQuantized(weight((16, 256), dtype=torch.float32), FORMATS[fmt_name]))
    model = nn.Sequential(lin)
    fully_shard(model, mesh=mesh(2))
    with wire.record() as log:
        model.unshard()
    return sum("all_reduce" in t.op or "allreduce" in t.op for t in log.transfers)


@pytest.mark.parametrize("fmt_name,expected", [("int8", 0), ("int4g32", 0), ("pertensor", 1), ("column", 1)])
def test_scale_reduction_only_where_the_layout_needs_it(ranks, fmt_name, expected):
    assert ranks(2).run(scale_reduction_collectives, fmt_name) == [expected, expected]


# -- training: FSDP2 == the same wrapped model on one process -------------------


def fsdp_train(fmt_name, cfg_name, steps, mp):
    world = torch.distributed.get_world_size()
    mp_dtype = getattr(torch, mp) if mp else None
    model = gather_quantized_model(fmt_name, cfg_name, quant_dtype=mp_dtype)  # None: plain bf16 all-gather
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32 if mp else None)
    m = mesh(world)
    for layer in model.layers:
        fully_shard(layer, mesh=m, mp_policy=policy)
    fully_shard(model, mesh=m, mp_policy=policy)
    return train(model, batches(steps, cfg_name), lr=3e-3, dp_group=m.get_group())


@pytest.mark.parametrize(
    "world,fmt_name,cfg_name,mp,rel",
    [
        pytest.param(2, "int8", "even", None, 2e-5, id="2r-int8"),
        pytest.param(2, "pertensor", "even", None, 2e-5, id="2r-pertensor"),
        pytest.param(3, "int4g32", "uneven", "bfloat16", 5e-3, id="3r-uneven-int4-bf16", marks=pytest.mark.slow),
    ],
)
def test_training_matches_single_process(ranks, world, fmt_name, cfg_name, mp, rel):
    expected = gather_quantized_reference(fmt_name, cfg_name, 4, mp)
    for losses in ranks(world).run(fsdp_train, fmt_name, cfg_name, 4, mp, timeout=300):
        assert losses == pytest.approx(list(expected), rel=rel), (losses, expected)
    assert expected[-1] < expected[0]


@pytest.mark.slow
def test_50_step_loss_curve_stays_close_to_bf16(ranks):
    """bf16 mixed precision on 2 ranks: the quantized all-gathers train like the bf16 one.

    bench/fsdp_gather_quantized.py prints the same comparison for a larger model.
    """
    curves = {
        name: ranks(2).run(fsdp_train, name, "even", 50, "bfloat16", timeout=900)[0]
        for name in (None, "int8", "int4g32")
    }
    base = curves[None]
    assert sum(base[-5:]) / 5 < 0.6 * base[0]  # it learns
    for name, limit in [("int8", 0.02), ("int4g32", 0.04)]:
        losses = curves[name]
        mean_rel = sum(abs(a - b) / b for a, b in zip(losses, base)) / len(base)
        final_ratio = (sum(losses[-5:]) / 5) / (sum(base[-5:]) / 5)
        print(f"{name}: mean |dloss|/loss {mean_rel:.4f}, final x bf16 {final_ratio:.4f}")
        print("  bf16 ", " ".join(f"{v:.3f}" for v in base))
        print(f"  {name}", " ".join(f"{v:.3f}" for v in losses))
        assert mean_rel < limit and abs(final_ratio - 1) < 0.03, (name, mean_rel, final_ratio, losses, base)


# -- combined with tensor parallelism -------------------------------------------------


def tp_fsdp_train(fmt_name, steps):
    """ColwiseParallel/RowwiseParallel over tp, FSDP2 over dp on a 2x2 mesh; block all-gathers at the floor."""
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.distributed.model.test_lora import TP_PLAN

    model = gather_quantized_model(fmt_name, "even")
    m = mesh(2, 2)
    for layer in model.layers:
        parallelize_module(layer, m["tp"], TP_PLAN)
    floor = {floor_bytes(layer, 2) for layer in model.layers}
    for layer in model.layers:
        fully_shard(layer, mesh=m["dp"])
    fully_shard(model, mesh=m["dp"])
    with wire.record() as log:
        losses = train(model, batches(steps, "even"), lr=3e-3, dp_group=m["dp"].get_group())
    blocks = [t.nbytes for t in log.all_gathers().transfers if t.dtype == torch.uint8]
    assert len(blocks) >= 2 * steps * len(model.layers) and set(blocks) == floor, (sorted(set(blocks)), floor)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", ["int8", "pertensor"])
def test_tensor_parallel_plus_fsdp_2x2(ranks, fmt_name):
    """A row-parallel weight's per-row (or per-tensor) scale spans TP shards: all-reduced over tp as well."""
    expected = gather_quantized_reference(fmt_name, "even", 4)
    for losses in ranks(4).run(tp_fsdp_train, fmt_name, 4, timeout=300):
        assert losses == pytest.approx(list(expected), rel=2e-5), (losses, expected)


def misaligned_tp():
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    lin = nn.Linear(64, 24, bias=False)  # rows 24 over tp 2: 12, not a multiple of RowBlockInt8(8)'s 8
    lin.weight = nn.Parameter(GatherQuantized(weight((24, 64), dtype=torch.float32), RowBlockInt8(8)))
    model = nn.Sequential(lin)
    m = mesh(2, 2)
    parallelize_module(model, m["tp"], {"0": ColwiseParallel()})
    with wire.record() as log:
        try:
            fully_shard(model, mesh=m["dp"])
        except ValueError as e:
            return type(e).__name__, len(log.all_gathers()), str(e)
    return "no error", 0, ""


def test_tensor_parallel_cut_through_a_block_is_refused_on_every_rank(ranks):
    results = ranks(4).run(misaligned_tp)
    assert all(
        kind == "LayoutError" and gathers == 0 and "tensor parallelism" in msg for kind, gathers, msg in results
    ), results
