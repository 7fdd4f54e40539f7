"""fsdp/reshard_after_forward: integer ``reshard_after_forward`` with quantized parameters:
FSDP2 keeps a quantized post-forward shard.

With ``reshard_after_forward=k`` each rank keeps, after the forward, its 1/k
of every gathered inner tensor -- still the stored bytes -- and the backward
all-gathers those over groups of k ranks
(:func:`dtensor_quant.fsdp.install_fsdp_post_forward_reshard`). Checks:
the backward's weight is bit-identical to the forward's (so a run with k gives
exactly the losses of a run with ``True``, and both match one process), each
forward all-gather sends one rank's padded shard and each backward one sends
``world / k`` of them, in ``uint8``; frozen bases (QLoRA) and trainable
weights gathered quantized (``GatherQuantized``), 4 ranks with k=2, uneven
shards, bf16 mixed precision, activation checkpointing, HSDP, CPU offload, and
k=2 on 2 ranks (torch's ``True``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh, weight
from tests.distributed.fsdp.test_all_gather import expected_bytes, quantized_model
from tests.support.training import (
    batches,
    floor_bytes,
    gather_quantized_model,
    gather_quantized_reference,
    qlora_model,
    reference_losses,
    train,
)

STEPS = 4


def one_linear(fmt_name, shape, k):
    """Forward then backward through one FSDP2 Linear: the backward's weight is the forward's, bit for bit."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    world = torch.distributed.get_world_size()
    model, q = quantized_model(fmt_name, shape)
    x = weight((3, shape[1]), seed=2, dtype=torch.float32).requires_grad_()
    g = weight((3, shape[0]), seed=3, dtype=torch.float32)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, q.dequantize())
    y_ref.backward(g)

    fully_shard(model, mesh=mesh(world), reshard_after_forward=k)
    fsdp_param = model._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    with wire.record() as forward:
        y = model(x)
    # after the forward: the module shows its own quantized shard, the gathered bytes are freed
    assert fsdp_param.sharded_state == ShardedState.SHARDED_POST_FORWARD
    assert isinstance(model[0].weight.to_local(), dq.QuantizedTensor)
    assert all(t.untyped_storage().nbytes() == 0 for t in fsdp_param.all_gather_outputs)
    kept = fsdp_param._sharded_post_forward_param_data.inputs
    assert all(t.dtype == torch.uint8 for t in kept)
    with wire.record() as backward:
        y.backward(g)
    assert torch.equal(y, y_ref), (y - y_ref).abs().max()
    assert torch.equal(x.grad, x_ref.grad), (x.grad - x_ref.grad).abs().max()
    one_shard = expected_bytes(q, world)
    return (
        [(t.dtype, t.nbytes) for t in forward.all_gathers().transfers],
        [(t.dtype, t.nbytes) for t in backward.all_gathers().transfers],
        one_shard,
        sum(t.numel() for t in kept),
    )


@pytest.mark.parametrize(
    "fmt_name,shape", [("int8", (16, 1536)), ("int4g32", (10, 1536)), ("nf4", (128, 1536)), ("nf4", (30, 14336))]
)
def test_backward_weight_is_the_forward_weight(ranks, fmt_name, shape):
    """4 ranks, k=2 (uneven for 10 rows: 3, 3, 3, 1): one shard forward, two shards backward, all uint8.

    NF4 [30, 14336] is legal at 4 ranks (8 rows, whole factors) but cannot be cut in 2 (15 rows):
    the post-forward shard keeps whole rank inputs, so it never needs that cut (torch's init once
    made it, to read a size, and the layout refused it).
    """
    for forward, backward, one_shard, kept in ranks(4).run(one_linear, fmt_name, shape, 2):
        assert forward == [(torch.uint8, one_shard)], (forward, one_shard)
        assert backward == [(torch.uint8, 2 * one_shard)], (backward, one_shard)
        assert kept == 2 * one_shard


# -- training: the losses of k=2 are exactly those of True, and match one process -------


def qlora_train(fmt_name, cfg_name, reshard, mp, layout="fsdp"):
    from tests.distributed.model.test_lora import _policy

    world = torch.distributed.get_world_size()
    model = qlora_model(fmt_name, cfg_name)
    m = mesh(1, world) if layout == "hsdp" else mesh(world)  # HSDP: (replicate, shard) = (1, world)
    floor = {floor_bytes(layer, world, getattr(torch, mp) if mp else None) for layer in model.layers}
    if layout == "ac":  # the backward recomputes each block's forward from the post-forward gather
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if layout == "offload" else {}
    for layer in model.layers:
        fully_shard(layer, mesh=m, reshard_after_forward=reshard, mp_policy=_policy(mp), **extra)
    fully_shard(model, mesh=m, reshard_after_forward=reshard, mp_policy=_policy(mp), **extra)
    with wire.record() as log:
        losses = train(model, batches(STEPS, cfg_name), dp_group=torch.distributed.group.WORLD)
    # a block unit mixes quantized bases and dense adapters/norms: one uint8 all-gather each
    return losses, sorted(t.nbytes for t in log.all_gathers().transfers if t.dtype == torch.uint8), floor


def gq_train(fmt_name, reshard):
    world = torch.distributed.get_world_size()
    model = gather_quantized_model(fmt_name, "even")
    m = mesh(world)
    floor = {floor_bytes(layer, world) for layer in model.layers}
    for layer in model.layers:
        fully_shard(layer, mesh=m, reshard_after_forward=reshard)
    fully_shard(model, mesh=m, reshard_after_forward=reshard)
    with wire.record() as log:
        losses = train(model, batches(STEPS, "even"), lr=3e-3, dp_group=m.get_group())
    return losses, sorted(t.nbytes for t in log.all_gathers().transfers if t.dtype == torch.uint8), floor


def check_gathers(gathers, floor, world, k, layers):
    """Per step and block: a forward gather of one shard, a backward one of world/k shards.

    With activation checkpointing too: FSDP2 does not reshard after the recomputed forward.
    """
    (one,) = floor  # both blocks have the same shapes
    assert gathers == sorted([one, one * (world // k)] * STEPS * layers), (sorted(set(gathers)), one)


@pytest.mark.parametrize(
    "world,fmt_name,cfg_name,mp,layout",
    [
        pytest.param(4, "int8", "even", None, "fsdp", id="4r-int8"),
        pytest.param(4, "int4g32", "uneven", "bfloat16", "fsdp", id="4r-uneven-int4-bf16"),
        pytest.param(4, "int4g32", "uneven", None, "ac", id="4r-uneven-int4-ac"),
        pytest.param(4, "int8", "even", None, "hsdp", id="4r-hsdp-1x4-int8"),
        pytest.param(4, "int8", "even", None, "offload", id="4r-cpu-offload-int8"),
        pytest.param(2, "int8", "even", None, "fsdp", id="2r-int8-trivial"),
    ],
)
@pytest.mark.slow
def test_qlora_reshard_to_2(ranks, world, fmt_name, cfg_name, mp, layout):
    from tests.distributed.model.test_lora import TOLERANCE

    pool = ranks(world)
    with_k = pool.run(qlora_train, fmt_name, cfg_name, 2, mp, layout, timeout=300)
    with_true = pool.run(qlora_train, fmt_name, cfg_name, True, mp, layout, timeout=300)
    expected = reference_losses(fmt_name, cfg_name, STEPS, mp)
    for (losses, gathers, floor), (losses_true, gathers_true, _) in zip(with_k, with_true):
        assert losses == losses_true, (losses, losses_true)  # the same weights, gathered another way
        assert losses == pytest.approx(list(expected), rel=TOLERANCE[mp]), (losses, expected)
        check_gathers(gathers, floor, world, 2, 2)
        if world == 2:
            assert gathers == gathers_true
    assert expected[-1] < expected[0]


@pytest.mark.parametrize("fmt_name", ["int8", pytest.param("pertensor", marks=pytest.mark.slow)])
def test_gather_quantized_reshard_to_2(ranks, fmt_name):
    """Trainable weights: the backward reuses the forward's quantized bytes (and its all-reduced scale)."""
    pool = ranks(4)
    with_k = pool.run(gq_train, fmt_name, 2, timeout=300)
    with_true = pool.run(gq_train, fmt_name, True, timeout=300)
    expected = gather_quantized_reference(fmt_name, "even", STEPS)
    for (losses, gathers, floor), (losses_true, _, _) in zip(with_k, with_true):
        assert losses == losses_true, (losses, losses_true)
        assert losses == pytest.approx(list(expected), rel=2e-5), (losses, expected)
        check_gathers(gathers, floor, 4, 2, 2)


# -- refused, on every rank, before any collective ----------------------------------------


def refuse(kind):
    model, _ = quantized_model("int8", (16, 64))
    m = mesh(4)
    if kind == "tensor_parallel":  # a DTensor parameter: torch's FSDP2 cannot reshard it to 2 ranks
        m = mesh(4, 1)
        extra = nn.Linear(64, 8, bias=False)
        parallelize_module(extra, m["tp"], ColwiseParallel())
        model.append(extra)
    with wire.record() as log:
        try:
            if kind == "not_a_factor":
                fully_shard(model, mesh=m, reshard_after_forward=3)
            elif kind == "tensor_parallel":
                fully_shard(model, mesh=m["dp"], reshard_after_forward=2)
        except ValueError as e:
            return type(e).__name__, len(log.transfers), str(e)
    return "no error", len(log.transfers), ""


@pytest.mark.parametrize(
    "kind,words", [("not_a_factor", "use one of 1, 2, 4"), ("tensor_parallel", "DTensor (tensor-parallel)")]
)
def test_refused_on_every_rank_before_any_collective(ranks, kind, words):
    results = ranks(4).run(refuse, kind, timeout=60)
    for kind_of_error, collectives, msg in results:
        assert kind_of_error == "ValueError" and collectives == 0, (kind_of_error, collectives, msg)
        assert words in msg, msg
    assert len({msg for _, _, msg in results}) == 1


def plain_torch_fully_shard():
    """torch's own fully_shard after the fix is installed: the same bytes (the fix is in torch's FSDPParam)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from dtensor_quant._fsdp.reshard_after_forward import install_fsdp_post_forward_reshard

    install_fsdp_post_forward_reshard()
    model, q = quantized_model("int4g32", (16, 1536))
    torch_fully_shard(model, mesh=mesh(4), reshard_after_forward=2)
    x = weight((3, 1536), seed=2, dtype=torch.float32).requires_grad_()
    y = model(x)
    with wire.record() as log:
        y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(y) @ q.dequantize())
    return [(t.dtype, t.nbytes) for t in log.all_gathers().transfers], expected_bytes(q, 4)


def test_plain_torch_fully_shard_after_install(ranks):
    for gathers, one_shard in ranks(4).run(plain_torch_fully_shard):
        assert gathers == [(torch.uint8, 2 * one_shard)], (gathers, one_shard)


def torch_own_integer_reshard():
    """With the patch removed (torch's own FSDP2 members back), an integer reshard of a quantized weight."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from dtensor_quant.fsdp import install_fsdp_post_forward_reshard

    patch = install_fsdp_post_forward_reshard()
    model, _ = quantized_model("int4g32", (16, 1536))
    with patch.removed():
        torch_fully_shard(model, mesh=mesh(4), reshard_after_forward=2)
        x = weight((3, 1536), seed=2, dtype=torch.float32).requires_grad_()
        try:
            model(x).sum().backward()
        except (AssertionError, NotImplementedError, RuntimeError) as e:
            return type(e).__name__
    return "no error"


def test_torch_still_needs_the_reshard_patch(ranks):
    """torch 2.13's own FSDP2 cannot keep a post-forward shard of a parameter with all-gather hooks.

    The day torch can, this fails and fsdp/reshard_after_forward.py can go.
    """
    outcomes = ranks(4).run(torch_own_integer_reshard, timeout=120)
    assert outcomes == ["AssertionError"] * 4, outcomes  # torch asserts one dense all-gather output


# -- usage patterns: forward twice, no_grad forwards, accumulation, toggling ------------------------------


def mixed_unit_patterns(k, gathered_quantized=False):
    """Two FSDP2 units, each a frozen quantized Linear and a trainable dense one (one unit, mixed), on 4 ranks.

    One run of: two forwards before one backward; a no_grad forward (no backward follows) between steps and
    before a forward of the next; 2 micro-batches accumulated; a no_grad eval between a backward and
    ``optimizer.step()``; ``set_reshard_after_forward`` off for an eval and back on. Returns every loss, eval
    output and updated dense weight (full), to compare bit for bit.
    """
    blocks = []
    for i in range(2):
        frozen = nn.Linear(128, 64, bias=False)
        q = dq.quantize(weight((64, 128), seed=10 + i, dtype=torch.float32) * 0.1, dq.NF4(32, 4))
        frozen.weight = nn.Parameter(q, requires_grad=False)
        dense = nn.Linear(64, 128, bias=False)
        dense.weight = nn.Parameter(weight((128, 64), seed=20 + i, dtype=torch.float32) * 0.1)
        blocks.append(nn.Sequential(frozen, dense))
    model = nn.Sequential(*blocks)
    if gathered_quantized:  # the trainable Linears all-gathered in Int8Rowwise (GatherQuantized)
        from dtensor_quant._fsdp.gather_quantized import GatherQuantized, gather_quantized_

        gather_quantized_(model, dq.Int8Rowwise(), filter_fn=lambda m, fqn: fqn.endswith(".1"))
        assert all(isinstance(b[1].weight, GatherQuantized) for b in blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh(4), reshard_after_forward=k)
    fully_shard(model, mesh=mesh(4), reshard_after_forward=k)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    xs = [weight((3, 128), seed=30 + i, dtype=torch.float32) for i in range(6)]
    seen = []

    def loss(x):
        return model(x).square().mean()

    def step(micro):
        for x in micro:
            total = sum(loss(xi) for xi in x) if isinstance(x, tuple) else loss(x)
            total.backward()
            seen.append(total.detach())
        opt.step()
        opt.zero_grad()

    step([(xs[0], xs[1])])  # two forwards, one backward
    with torch.no_grad():
        seen.append(model(xs[2]))  # no backward follows
    step([xs[3], xs[4]])  # accumulated
    with torch.no_grad():
        seen.append(model(xs[2]))
    seen.append(loss(xs[5]).detach())  # a grad forward after a no_grad one, then none
    loss(xs[3]).backward()
    with torch.no_grad():
        seen.append(model(xs[2]))  # an eval between a backward and its step: the next forward sees the step
    opt.step()
    opt.zero_grad()
    step([xs[0]])
    # (toggled after a backward: torch 2.13 itself fails an all-gather of a group left post-forward-sharded)
    model.set_reshard_after_forward(False)
    with torch.no_grad():
        seen.append(model(xs[2]))
    model.set_reshard_after_forward(True)
    step([xs[1]])
    seen += [b[1].weight.full_tensor().detach() for b in blocks]
    return [t.dequantize() if hasattr(t, "dequantize") else t for t in seen]


@pytest.mark.parametrize("gathered_quantized", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_mixed_unit_usage_patterns_match_reshard_true(ranks, gathered_quantized):
    """Integer k gives exactly what ``True`` gives through every pattern, on every rank."""
    pool = ranks(4)
    args = (gathered_quantized,)
    with_k = pool.run(mixed_unit_patterns, 2, *args, timeout=300)
    with_true = pool.run(mixed_unit_patterns, True, *args, timeout=300)
    for got, want in zip(with_k, with_true):
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.isfinite().all() and torch.equal(a, b), i
    assert not torch.equal(with_k[0][-1], weight((128, 64), seed=21, dtype=torch.float32) * 0.1)  # it trained
