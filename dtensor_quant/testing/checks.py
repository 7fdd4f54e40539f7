"""The checks of the conformance kit. Each runs on every rank and returns a one-line detail.

A check takes ``(fmt, shape)``, raises AssertionError (or any error) when the
capability does not hold, and compares against a single-process reference
computed on the same rank.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .._core import activations
from .._core.format import QuantFormat, check_shape
from .._core.layout import LayoutError
from .._parallel import wire
from .._parallel.quantize import quantize
from .bounds import assert_within, linear_error_bound, unit_roundoff
from .tools import assert_local_matches, assert_same_bits, legal, mesh, weight

CANDIDATE_SHAPES = [(64, 256), (64, 512), (32, 1024), (64, 2048), (16, 4096), (128, 4096), (64, 16384)]


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[QuantFormat, tuple[int, int]], str]
    distributed: bool = True


def _accepts(fmt: QuantFormat, shape) -> bool:
    try:
        check_shape(fmt, shape)
    except ValueError:
        return False
    return True


def pick_shape(fmt: QuantFormat, world_size: int) -> tuple[int, int]:
    """The first candidate weight shape the format holds and can shard both ways over ``world_size``."""
    accepted = [s for s in CANDIDATE_SHAPES if _accepts(fmt, s)]
    if not accepted:
        raise ValueError(f"{fmt} accepts none of the kit's shapes {CANDIDATE_SHAPES}: pass shape=")
    for s in accepted:
        if all(legal(fmt, s, (world_size,), [Shard(d)]) for d in (0, 1)):
            return s
    return accepted[0]


def _placements(fmt, shape, world):
    return [p for p in ([Replicate()], [Shard(0)], [Shard(1)]) if legal(fmt, shape, (world,), p)]


# -- the checks ------------------------------------------------------------------


def quantize_dequantize(fmt: QuantFormat, shape) -> str:
    w = weight(shape)
    q = quantize(w, fmt)
    rels = fmt.layout_for(shape)
    for name, t in q.inner.items():
        expected = tuple(r.inner_len(n) for r, n in zip(rels[name], shape))
        assert tuple(t.shape) == expected, f"inner '{name}' is {tuple(t.shape)}, the layout says {expected}"
    dense = q.dequantize()
    assert dense.shape == w.shape and dense.dtype == w.dtype, "dequantize() changed the shape or dtype"
    err = ((dense.float() - w.float()).norm() / w.float().norm()).item()
    assert err == err and err < 1.0, f"relative error {err:.3g} on Gaussian weights"
    return f"relative error {err:.3g}, {q.nbytes_stored / (w.numel() * 2):.3f}x the bytes of bf16"


def distribute_and_gather(fmt: QuantFormat, shape) -> str:
    world = dist.get_world_size()
    m, q = mesh(world), quantize(weight(shape), fmt)
    dense = q.dequantize()
    done = []
    for placements in _placements(fmt, shape, world):
        for src in (0, None):
            dt = distribute_tensor(q, m, placements, src_data_rank=src)
            assert_local_matches(dt, dense, f"distribute_tensor {placements}")
            assert_same_bits(dt.full_tensor(), q, f"full_tensor from {placements}")
        done.append(str(placements[0]))
    return "distribute_tensor + full_tensor bit-exact for " + ", ".join(done)


def redistribute(fmt: QuantFormat, shape) -> str:
    world = dist.get_world_size()
    m, q = mesh(world), quantize(weight(shape), fmt)
    dense = q.dequantize()
    options = _placements(fmt, shape, world)
    with wire.record() as log:
        for src in options:
            dt = distribute_tensor(q, m, src)
            for dst in options:
                moved = dt.redistribute(m, dst)
                assert_local_matches(moved, dense, f"{src[0]} -> {dst[0]}")
                assert_same_bits(moved.full_tensor(), q, f"{src[0]} -> {dst[0]}")
    high = {d for d in log.dtypes() if d.is_floating_point and d.itemsize >= 2}
    assert not high, f"a collective sent {high}: the stored bytes should travel"
    return f"{len(options) ** 2} placement pairs bit-exact, wire dtypes {sorted(str(d) for d in log.dtypes())}"


def uneven_shards(fmt: QuantFormat, shape) -> str:
    world = dist.get_world_size()
    m = mesh(world)
    rows = next(
        (r for r in range(shape[0] + 1, shape[0] * 2) if r % world and legal(fmt, (r, shape[1]), (world,), [Shard(0)])),
        None,
    )
    if rows is None:
        return f"not applicable: no row count near {shape[0]} shards unevenly and legally over {world}"
    q = quantize(weight((rows, shape[1])), fmt)
    dt = distribute_tensor(q, m, [Shard(0)])
    assert_local_matches(dt, q.dequantize(), "uneven Shard(0)")
    assert_same_bits(dt.full_tensor(), q, "uneven full_tensor")
    if legal(fmt, (rows, shape[1]), (world,), [Shard(1)]):
        assert_same_bits(dt.redistribute(m, [Shard(1)]).full_tensor(), q, "uneven Shard(0) -> Shard(1)")
    return f"{rows} rows over {world} ranks bit-exact"


def quantize_sharded(fmt: QuantFormat, shape) -> str:
    world = dist.get_world_size()
    m, w = mesh(world), weight(shape, seed=1)
    counts = []
    for placements in _placements(fmt, shape, world):
        reference = distribute_tensor(quantize(w, fmt), m, placements).to_local()
        dense = distribute_tensor(w, m, placements)
        with wire.record() as log:
            got = quantize(dense, fmt)
        assert_same_bits(got.to_local(), reference, f"quantize(DTensor {placements[0]})")
        counts.append(f"{placements[0]}: {len(log)}")
    return "bit-identical to quantize-then-distribute; collectives " + ", ".join(counts)


def misaligned_errors(fmt: QuantFormat, shape) -> str:
    world = dist.get_world_size()
    m = mesh(world)
    for dim in (0, 1):
        for n in range(shape[dim] // 2, shape[dim] * 3):
            trial = list(shape)
            trial[dim] = n
            if not _accepts(fmt, trial) or legal(fmt, trial, (world,), [Shard(dim)]):
                continue
            q = quantize(weight(trial), fmt)
            with wire.record() as log:
                try:
                    distribute_tensor(q, m, [Shard(dim)])
                except LayoutError as e:
                    assert len(log) == 0, "a collective ran before the error"
                    assert f"dim {dim}" in str(e), f"the error does not name the dim: {e}"
                    return f"Shard({dim}) of {tuple(trial)} over {world}: LayoutError on every rank, no collective"
            raise AssertionError(f"Shard({dim}) of {tuple(trial)} over {world} ranks is misaligned but did not raise")
    return "not applicable: every shard boundary is legal for this layout"


def transposed(fmt: QuantFormat, shape) -> str:
    world = dist.get_world_size()
    m, q = mesh(world), quantize(weight(shape), fmt).t()
    done = []
    for dim in (0, 1):
        # Shard(dim) of w.t() cuts the weight's dim 1 - dim
        if legal(fmt, shape, (world,), [Shard(1 - dim)]):
            dt = distribute_tensor(q, m, [Shard(dim)])
            assert_same_bits(dt.full_tensor(), q, f"w.t() Shard({dim})")
            done.append(f"Shard({dim})")
    return "w.t() shards and gathers bit-exactly: " + ", ".join(done)


def _shared_tmpdir() -> str:
    """A fresh directory every rank of the default group agrees on (made by rank 0)."""
    path = [tempfile.mkdtemp(prefix="dtensor_quant_kit_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _linear_with(weight: torch.Tensor) -> torch.nn.Module:
    from .._checkpoint.state_dict import register

    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return register(module)


def checkpoint_reshard(fmt: QuantFormat, shape) -> str:
    """Save under one placement with torch.distributed.checkpoint, load under every other, bit-exactly."""
    from .. import checkpoint

    world = dist.get_world_size()
    m, q = mesh(world), quantize(weight(shape, seed=2), fmt)
    options = _placements(fmt, shape, world)
    src = next(p for p in options if p != [Replicate()]) if len(options) > 1 else options[0]
    root = _shared_tmpdir()
    path = f"{root}/ckpt"
    with wire.record() as log:
        checkpoint.save(_linear_with(distribute_tensor(q, m, src)), path)
    done = []
    for dst in options:
        target = _linear_with(distribute_tensor(quantize(weight(shape, seed=9), fmt), m, dst))
        checkpoint.load(target, path)
        assert_same_bits(target.weight.full_tensor(), q, f"saved as {src[0]}, loaded as {dst[0]}")
        done.append(str(dst[0]))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    high = {d for d in log.dtypes() if d.is_floating_point and d.itemsize >= 2}
    assert not high, f"the save sent {high} between ranks"
    return f"saved as {src[0]}, loaded bit-exactly as " + ", ".join(done)


def tensor_parallel(fmt: QuantFormat, shape) -> str:
    """ColwiseParallel and RowwiseParallel Linear layers agree with the one-process quantized layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    m, q = mesh(world), quantize(weight(shape, seed=3), fmt)
    x = weight((4, shape[1]), seed=4)
    reference = torch.nn.functional.linear(x, q)
    done = []
    for style, placement in ((ColwiseParallel(use_local_output=False), Shard(0)), (RowwiseParallel(), Shard(1))):
        if not legal(fmt, shape, (world,), [placement]):
            continue
        module = parallelize_module(_linear_with(q), m, style)
        assert isinstance(module.weight, DTensor) and module.weight.placements == (placement,)
        inputs = x if placement == Shard(0) else DTensor.from_local(x.chunk(world, -1)[dist.get_rank()], m, [Shard(-1)])
        out = module(inputs)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        assert err < 2e-2, f"{type(style).__name__}: relative difference {err:.3g} from one process"
        done.append(f"{type(style).__name__} ({err:.1e})")
    return "matches one process up to reduction order: " + ", ".join(done) if done else "not applicable"


def quantized_activations(fmt: QuantFormat, shape) -> str:
    """A declared activation scheme (``fmt.activation_scheme``): ``F.linear`` computes the scheme's arithmetic.

    The activation is quantized as :func:`dtensor_quant._core.activations.quantize_activation` declares, the
    code values times the weight's values summed: the result is within the summation bound of that exact
    value (plus the weight's own rounding to its ``scale_dtype``, where it has one, and, for bf16 outputs, one
    rounding of the sum to bf16 before the scales). Weight-only formats: not applicable.
    """
    scheme = fmt.activation_scheme
    if scheme is None:
        return "not applicable (weight-only)"
    q = quantize(weight(shape, seed=11), fmt)
    done = []
    for dtype in (torch.float32, torch.bfloat16):
        x = weight((5, shape[1]), seed=12).to(dtype)
        got = torch.nn.functional.linear(x, q.to(dtype))
        codes, x_scale = activations.quantize_activation(x, scheme, getattr(fmt, "input_scale", None))
        xv, wv = codes.double() * x_scale.double(), q.dequantize(torch.float32).double()
        rounding = unit_roundoff(getattr(fmt, "scale_dtype", None) or torch.float32)
        bound = linear_error_bound(xv, wv, out_dtype=dtype, weight_error=wv.abs() * rounding)
        exact = xv @ wv.t()
        if dtype != torch.float32:  # a kernel may round its sum to the output dtype once before the scales
            bound = bound + unit_roundoff(dtype) * (exact.abs() + bound)
        assert_within(got, exact, bound, f"{fmt} with {str(dtype).removeprefix('torch.')} activations")
        done.append(str(dtype).removeprefix("torch."))
    return f"{scheme.spelling}: the declared arithmetic within its bound ({', '.join(done)})"


def compile_linear(fmt: QuantFormat, shape) -> str:
    """torch.compile(backend="aot_eager") of a quantized Linear gives the eager result."""
    torch._dynamo.reset()
    q = quantize(weight(shape, seed=5), fmt)
    x = weight((3, shape[1]), seed=6)
    eager = torch.nn.functional.linear(x, q)
    compiled = torch.compile(lambda x, w: torch.nn.functional.linear(x, w), backend="aot_eager", fullgraph=True)(x, q)
    assert torch.equal(compiled, eager), "the compiled quantized Linear differs from eager"
    return "aot_eager, fullgraph: identical to eager"


def _lora_model(fmt: QuantFormat, shape) -> torch.nn.Module:
    from .._model.lora import add_lora_

    base = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=False))
    base[0].weight = torch.nn.Parameter(quantize(weight(shape, seed=7), fmt), requires_grad=False)
    return add_lora_(base, rank=4, seed=0)


def _train(model, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for step in range(steps):
        x = weight((8, model[0].base.in_features), seed=100 + step, dtype=torch.float32)
        loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fsdp2_qlora(fmt: QuantFormat, shape) -> str:
    """QLoRA under FSDP2: same losses as one process; the base weight's all-gather moves its stored bytes."""
    from ..fsdp import fully_shard

    world = dist.get_world_size()
    if not legal(fmt, shape, (world,), [Shard(0)]):
        return f"not applicable: the layout cannot shard {shape[0]} rows over {world} ranks"
    reference = _train(_lora_model(fmt, shape))
    model = _lora_model(fmt, shape)
    stored = model[0].base.weight.nbytes_stored
    fully_shard(model[0].base, mesh=mesh(world))  # the quantized weight alone in one all-gather
    fully_shard(model, mesh=mesh(world))
    with wire.record() as log:
        losses = _train(model)
    # FSDP2 dequantizes the gathered weight once (to bf16 here) and runs dense matmuls; one process runs
    # the format's kernel, which may keep the codes exact and scale after accumulating. The two agree to
    # the rounding of the dequantized weight to bf16: its unit roundoff.
    rel = torch.finfo(torch.bfloat16).eps / 2
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= rel * abs(b) + 1e-6, f"step {step}: loss {a} under FSDP2, {b} on one process"
    base = [t for t in log.all_gathers().transfers if t.dtype == torch.uint8]
    assert base, "no uint8 all-gather: the quantized weight was not gathered as stored bytes"
    per_gather = max(t.nbytes for t in base)
    limit = stored / world * 1.05 + 64 * len(fmt.inner_names)
    assert per_gather <= limit, (
        f"each rank sent {per_gather} bytes per all-gather; its share of the payload is {stored / world:.0f}"
    )
    dense = shape[0] * shape[1] * 2 / world
    return f"{len(losses)} steps match one process; base all-gather {per_gather / dense:.3f}x its bf16 bytes"


def fsdp2_quantized_allgather(fmt: QuantFormat, shape) -> str:
    """A trainable weight FSDP2 all-gathers quantized: the gathered bytes are those of quantize(master)."""
    from .._fsdp.gather_quantized import gather_quantized_
    from ..fsdp import fully_shard

    world = dist.get_world_size()
    if not legal(fmt, shape, (world,), [Shard(0)]):
        return f"not applicable: the layout cannot shard {shape[0]} rows over {world} ranks"
    master = weight(shape, seed=8)
    model = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=False))
    model[0].weight = torch.nn.Parameter(master.clone())
    gather_quantized_(model, fmt)
    fully_shard(model, mesh=mesh(world))
    x = weight((4, shape[1]), seed=9)
    with wire.record() as log:
        out = model(x)
    expected = torch.nn.functional.linear(x, quantize(master, fmt))
    assert torch.equal(out, expected), "the forward with the gathered weight differs from quantize(master)"
    out.float().sum().backward()
    grad = model[0].weight.grad
    assert grad is not None and grad.dtype == master.dtype, "no high-precision gradient reached the master weight"
    assert log.all_gathers().transfers, "FSDP2 all-gathered nothing: the weight was not sharded"
    floats = {d for d in log.all_gathers().dtypes() if d.is_floating_point}
    assert not floats, f"FSDP2 all-gathered {floats}"
    return "forward bit-identical to quantize(master); gradient reaches the master; uint8 on the wire"


def expert_stacks(fmt: QuantFormat, shape) -> str:
    """A fused mixture-of-experts stack ``[3, out, in]``: per-expert math, expert and tensor parallelism.

    Three experts shard unevenly over 2 ranks and leave one rank empty over 4.
    """
    world, experts = dist.get_world_size(), 3
    m, w = mesh(world), weight((experts, *shape), seed=21)
    q = quantize(w, fmt)
    for e in range(experts):
        assert_same_bits(q[e], quantize(w[e].clone(), fmt), f"expert {e} of the stack vs quantized alone")
    dense = q.dequantize()
    assert torch.equal(dense, torch.stack([quantize(w[e], fmt).dequantize() for e in range(experts)])), "dequantize"
    x = weight((3, shape[1]), seed=22)
    assert torch.equal(torch.nn.functional.linear(x, q[1]), torch.nn.functional.linear(x, quantize(w[1], fmt))), (
        "F.linear on a selected expert differs from the 2-D weight's"
    )
    done = []
    with wire.record() as log:
        for p in ([Shard(0)], [Shard(1)], [Shard(2)]):
            if not legal(fmt, q.shape, (world,), p):
                continue
            dt = distribute_tensor(q, m, p)
            assert_local_matches(dt, dense, f"distribute_tensor {p}")
            assert_same_bits(dt.full_tensor(), q, f"full_tensor from {p}")
            if p != [Shard(0)]:
                assert_same_bits(dt.redistribute(m, [Shard(0)]).full_tensor(), q, f"{p} -> Shard(0)")
            done.append(f"S{p[0].dim}")
    dense_moved = {t.dtype for t in log.transfers if not t.quantized and t.dtype != torch.uint8}
    assert not dense_moved, f"dense {dense_moved} on the wire while moving the quantized stack"
    got = quantize(distribute_tensor(w, m, [Shard(0)], src_data_rank=None), fmt)
    assert_same_bits(got.to_local(), distribute_tensor(q, m, [Shard(0)]).to_local(), "quantize(DTensor Shard(0))")
    return f"each of {experts} experts as alone; {', '.join(done)} over {world} ranks bit-exact, quantized bytes only"


CHECKS = [
    Check("quantize/dequantize", quantize_dequantize, distributed=False),
    Check("distribute_tensor/full_tensor", distribute_and_gather),
    Check("redistribute", redistribute),
    Check("uneven shards", uneven_shards),
    Check("quantize(DTensor)", quantize_sharded),
    Check("misaligned placements", misaligned_errors),
    Check("transposed weight", transposed),
    Check("tensor parallel", tensor_parallel),
    Check("FSDP2 QLoRA", fsdp2_qlora),
    Check("FSDP2 quantized all-gather", fsdp2_quantized_allgather),
    Check("DCP reshard", checkpoint_reshard),
    Check("quantized activations", quantized_activations, distributed=False),
    Check("torch.compile", compile_linear, distributed=False),
    Check("expert stacks [E, out, in]", expert_stacks),
]
