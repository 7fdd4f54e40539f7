"""model/lora on live ranks: QLoRA under FSDP2:
the loss of every step matches single-process training of the same model.

The model is the tiny LLaMA of ``tests/support/training.py`` with every Linear of its blocks
quantized (frozen) and LoRA-adapted (trainable, fp32 masters). The reference
trains the same model on one process with the whole batch; FSDP2 ranks take
slices of it. Variants: 2, 3 and 4 ranks (uneven shards on 3 and 4),
``reshard_after_forward`` True and False, activation checkpointing, bf16
mixed precision, tensor parallel + FSDP2 on a 2x2 mesh, torch.compile, HSDP on
a 2x2 (replicate, shard) mesh and CPU offload -- the last two also check that
every block's all-gather (quantized bases and dense adapters in one unit) is
at the byte floor.
"""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_quant import wire
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.lora import lora_tp_plan
from dtensor_quant.testing import mesh
from tests.support.training import batches, floor_bytes, qlora_model, reference_losses, train

STEPS = 4
TOLERANCE = {None: 2e-5, "bfloat16": 5e-3}  # relative, per step
TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def _policy(mp):
    if mp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, mp), reduce_dtype=torch.float32)


def fsdp_qlora(fmt_name, cfg_name, mp, reshard, ac, compiled=False, tp=False):
    world = torch.distributed.get_world_size()
    model = qlora_model(fmt_name, cfg_name)
    if tp:
        m = mesh(world // 2, 2)
        dp_mesh = m["dp"]
        for layer in model.layers:
            parallelize_module(layer, m["tp"], lora_tp_plan(TP_PLAN))
    else:
        dp_mesh = mesh(world)
    if ac:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=_policy(mp))
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=_policy(mp))
    if compiled:
        model = torch.compile(model, backend="aot_eager")
    return train(model, batches(STEPS, cfg_name), dp_group=dp_mesh.get_group())


def check(results, fmt_name, cfg_name, mp):
    expected = reference_losses(fmt_name, cfg_name, STEPS, mp)
    for losses in results:
        assert losses == pytest.approx(list(expected), rel=TOLERANCE[mp]), (losses, expected)
    assert expected[-1] < expected[0]  # it trains


@pytest.mark.parametrize(
    "world,fmt_name,cfg_name,mp,reshard,ac",
    [
        pytest.param(2, "int8", "even", None, True, False, id="2r-int8"),
        pytest.param(2, "int4g32", "even", None, False, False, id="2r-int4-no_reshard"),
        pytest.param(2, "int8", "even", None, True, True, id="2r-int8-ac"),
        pytest.param(2, "int4g32", "even", "bfloat16", True, True, id="2r-int4-bf16-ac"),
        pytest.param(2, "int8", "even", "bfloat16", False, False, id="2r-int8-bf16-no_reshard"),
        pytest.param(3, "int8", "uneven", None, True, False, id="3r-uneven-int8"),
        pytest.param(4, "int4g32", "uneven", None, True, True, id="4r-uneven-int4-ac", marks=pytest.mark.slow),
        pytest.param(4, "int8", "even", "bfloat16", False, True, id="4r-int8-bf16-ac", marks=pytest.mark.slow),
    ],
)
def test_qlora_matches_single_process(ranks, world, fmt_name, cfg_name, mp, reshard, ac):
    results = ranks(world).run(fsdp_qlora, fmt_name, cfg_name, mp, reshard, ac, timeout=300)
    check(results, fmt_name, cfg_name, mp)


@pytest.mark.parametrize(
    "fmt_name,mp",
    [
        pytest.param("int8", None, id="int8"),
        pytest.param("int4g32", "bfloat16", id="int4-bf16", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_tp_plus_fsdp_2x2(ranks, fmt_name, mp):
    """ColwiseParallel/RowwiseParallel on the quantized bases and LoRA adapters, FSDP2 over dp."""
    results = ranks(4).run(fsdp_qlora, fmt_name, "even", mp, True, False, tp=True, timeout=300)
    check(results, fmt_name, "even", mp)


@pytest.mark.slow
def test_compiled_qlora(ranks):
    """torch.compile (aot_eager) of the FSDP2 QLoRA model: quantized weights are graph inputs."""
    results = ranks(2).run(fsdp_qlora, "int8", "even", None, True, False, compiled=True, timeout=600)
    check(results, "int8", "even", None)


# -- HSDP, CPU offload: the same losses, and each block's all-gather at the byte floor -----


def fsdp_layout(fmt_name, mp, layout):
    world = torch.distributed.get_world_size()
    model = qlora_model(fmt_name, "even")
    if layout == "hsdp":  # a 2-D mesh: FSDP2 replicates over dim 0 and shards over dim 1
        m, extra = mesh(2, world // 2), {}
    else:
        m, extra = mesh(world), {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    param_dtype = getattr(torch, mp) if mp else None
    floor = {floor_bytes(layer, m.size(m.ndim - 1), param_dtype) for layer in model.layers}
    for layer in model.layers:
        fully_shard(layer, mesh=m, mp_policy=_policy(mp), **extra)
    fully_shard(model, mesh=m, mp_policy=_policy(mp), **extra)
    with wire.record() as log:
        losses = train(model, batches(STEPS, "even"), dp_group=torch.distributed.group.WORLD)
    # a block unit mixes quantized bases and dense adapters/norms: one uint8 all-gather each
    blocks = [t.nbytes for t in log.all_gathers().transfers if t.dtype == torch.uint8]
    assert len(blocks) >= 2 * STEPS * len(model.layers) and set(blocks) == floor, (sorted(set(blocks)), floor)
    return losses


@pytest.mark.parametrize(
    "world,fmt_name,mp,layout",
    [
        pytest.param(4, "int4g32", "bfloat16", "hsdp", id="hsdp-2x2-int4-bf16"),
        pytest.param(2, "int8", None, "offload", id="cpu-offload-int8"),
    ],
)
@pytest.mark.slow
def test_hsdp_and_cpu_offload(ranks, world, fmt_name, mp, layout):
    results = ranks(world).run(fsdp_layout, fmt_name, mp, layout, timeout=300)
    check(results, fmt_name, "even", mp)
