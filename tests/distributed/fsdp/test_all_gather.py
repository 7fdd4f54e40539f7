"""fsdp/all_gather on live ranks: FSDP2 all-gathers quantized weights as their stored bytes.

Each check compares against the single-process quantized weight ``q``: the
weight FSDP2 unshards must hold ``q``'s bytes exactly (with the logical dtype
``mp_policy.param_dtype``), the all-gather must move only the stored bytes of
the padded shard, and the result must view FSDP2's buffers rather than copy
them -- on even, uneven and empty shards, for every relation along dim 0.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._core.layout import Constant
from dtensor_quant._parallel.placements import dim_alignment
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh, rank, same_bits, weight
from tests.support.extra_formats import FORMATS


def quantized_model(fmt_name, shape, dtype=torch.float32):
    """``nn.Sequential(Linear)`` whose weight is ``q``, the reference quantized weight."""
    q = dq.quantize(weight(shape, seed=1, dtype=dtype), FORMATS[fmt_name])
    lin = nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    lin.weight = nn.Parameter(q, requires_grad=False)
    return nn.Sequential(lin), q


def expected_bytes(q: dq.QuantizedTensor, world: int) -> int:
    """Bytes one rank sends: the inner tensors of its padded shard that are not constant everywhere."""
    rows = -(-q.shape[0] // world)
    total = 0
    for name, rels in zip(q.fmt.inner_names, q.rels):
        if all(isinstance(r, Constant) for r in rels):
            continue
        shape = [r.inner_len(n) for r, n in zip(rels, (rows, q.shape[1]))]
        total += shape[0] * shape[1] * getattr(q, name).element_size()
    return total


def gather_exact(fmt_name, shape, mp):
    world = torch.distributed.get_world_size()
    model, q = quantized_model(fmt_name, shape)
    dtype = getattr(torch, mp) if mp else q.dtype
    x = weight((3, shape[1]), seed=2, dtype=dtype)
    y_ref = F.linear(x, q.dequantize(dtype))
    fully_shard(model, mesh=mesh(world), mp_policy=MixedPrecisionPolicy(param_dtype=getattr(torch, mp) if mp else None))
    local = model[0].weight.to_local()
    chunks = torch.chunk(q.dequantize(), world)  # trailing ranks may hold nothing
    assert isinstance(local, dq.QuantizedTensor)
    if rank() < len(chunks):
        assert torch.equal(local.dequantize(), chunks[rank()]), "local shard differs from torch.chunk of q"
    else:
        assert local.shape[0] == 0

    with wire.record() as log:
        model.unshard()
    # a frozen weight is dequantized once per all-gather into a dense parameter
    full = model[0].weight
    assert type(full) is nn.Parameter and full.dtype == dtype and full.shape == q.shape, full
    assert same_bits(full.detach(), q.dequantize(dtype)), f"{fmt_name} {shape} over {world}"
    gathers = log.all_gathers()
    if world == 1:
        assert len(gathers) == 0  # FSDP2 copies locally
    else:
        assert gathers.dtypes() == {torch.uint8}, gathers.transfers
        assert gathers.nbytes == expected_bytes(q, world), (gathers.nbytes, expected_bytes(q, world))

    # the quantized bytes are freed once dequantized; the dense weight is freed at reshard
    fsdp_param = model._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    assert all(t.untyped_storage().nbytes() == 0 for t in fsdp_param.all_gather_outputs)
    model.reshard()
    assert full.untyped_storage().nbytes() == 0

    # later gathers refill the same parameter in place (out=)
    model.unshard()
    assert model[0].weight is full
    assert same_bits(full.detach(), q.dequantize(dtype)), "second gather"
    y = model(x)
    assert torch.equal(y, y_ref), (y - y_ref).abs().max()


GATHER_CASES = [
    (1, (16, 256)),  # a mesh of one
    (2, (16, 256)),  # even
    (3, (10, 256)),  # uneven: 4, 4, 2
    (4, (10, 256)),  # uneven: 3, 3, 3, 1
    (4, (5, 256)),  # an empty shard: 2, 2, 1, 0
]


@pytest.mark.parametrize("world,shape", GATHER_CASES)
@pytest.mark.parametrize("fmt_name", ["int8", "int4g32", "pertensor", "column", "f8row", "f8tensor"])
def test_unsharded_weight_is_bit_exact(ranks, fmt_name, world, shape):
    ranks(world).run(gather_exact, fmt_name, shape, None)


def fewer_rows_than_ranks(fmt_names, rows_list):
    """Each weight of 0-3 rows over every rank: ``[(case, "gathered" | "refused")]``; a gather is checked
    bit-exactly (:func:`gather_exact`), a refusal must come from fully_shard with nothing sent."""
    world, out = torch.distributed.get_world_size(), []
    for fmt_name in fmt_names:
        for rows in rows_list:
            model, _ = quantized_model(fmt_name, (rows, 256))
            with wire.record() as log:
                try:
                    fully_shard(model, mesh=mesh(world))
                except dq.LayoutError as e:
                    assert len(log) == 0 and "Legal FSDP2 sizes" in str(e), (log.transfers, str(e))
                    out.append(((fmt_name, rows), "refused"))
                    continue
            gather_exact(fmt_name, (rows, 256), None)  # on a fresh model
            out.append(((fmt_name, rows), "gathered"))
    return out


# One format per kind of dim-0 relation (rows, row blocks, flat blocks, a per-tensor constant); all of them: slow.
FEW = ["int8", "nf4", "f8tensor", "f8block32", "mxfp4"]


@pytest.mark.parametrize("names", [FEW, pytest.param(list(FORMATS), marks=pytest.mark.slow)], ids=["few", "all"])
def test_fewer_rows_than_ranks(ranks, names):
    """Zero-row shards (an all-gather of no rows' bytes). FSDP2 pads every shard to ``ceil(rows / ranks)``
    rows, so one row of a format blocked over several rows cannot be gathered (torch.chunk would leave it
    whole): refused when sharding, not at the first unshard."""
    world = 4
    results = ranks(world).run(fewer_rows_than_ranks, names, range(4))
    assert all(r == results[0] for r in results)
    for (fmt_name, rows), outcome in results[0]:
        padded = -(-rows // world)
        expected = "refused" if padded % dim_alignment(FORMATS[fmt_name], (rows, 256), 0) else "gathered"
        assert outcome == expected, (fmt_name, rows, outcome)
    assert len(results[0]) == len(names) * 4


@pytest.mark.parametrize("world,shape", [(2, (128, 256)), (3, (46, 1024)), (4, (126, 512))])
def test_nf4(ranks, world, shape):
    """NF4: packed codes, per-block scalers, double-quantized factors in row blocks, a global mean."""
    ranks(world).run(gather_exact, "nf4", shape, None)


@pytest.mark.parametrize("world,shape", [(2, (16, 256)), (3, (22, 256)), (4, (16, 256))])
def test_row_blocks(ranks, world, shape):
    """Scales per 4 rows: padded shards of 8, 8, 8 (last partial) and 4 rows hold whole blocks."""
    ranks(world).run(gather_exact, "rowblock4", shape, None)


@pytest.mark.parametrize("world,shape", [(2, (16, 256)), (3, (10, 256))])
@pytest.mark.parametrize("fmt_name", ["int8", "int4g128"])
def test_param_dtype_is_the_logical_dtype(ranks, fmt_name, world, shape):
    """bf16 mixed precision: same bytes on the wire, logical dtype bf16, bf16 kernel."""
    ranks(world).run(gather_exact, fmt_name, shape, "bfloat16")


# -- the wire: only stored bytes, measured with dtensor_quant.wire ---------------


def step_gathers(fmt_name):
    """All-gathers of one forward + backward through 4 FSDP2-sharded 512x512 bf16 Linears."""
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)]).to(torch.bfloat16)
    model.requires_grad_(False)
    if fmt_name != "bf16":
        dq.quantize_(model, FORMATS[fmt_name])
    m = mesh(torch.distributed.get_world_size())
    for layer in model:
        fully_shard(layer, mesh=m)
    fully_shard(model, mesh=m)
    x = weight((4, 512), seed=3).requires_grad_()
    with wire.record() as log:
        model(x).float().sum().backward()
    gathers = log.all_gathers()
    return gathers.nbytes, len(gathers), sorted(str(d) for d in gathers.dtypes())


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp_all_gather_bytes(ranks, world):
    """Int8Rowwise <= 0.51x and Int4Groupwise(128) <= 0.27x of bf16's bytes; never a float dtype."""
    base_bytes, base_count, base_dtypes = ranks(world).run(step_gathers, "bf16")[0]
    # wire sees every FSDP2 all-gather: one padded bf16 shard of each layer per gather
    assert base_dtypes == ["torch.bfloat16"] and base_count >= 4
    assert base_bytes == base_count * 512 * 512 * 2 // world
    for fmt_name, limit in [("int8", 0.51), ("int4g128", 0.27)]:
        nbytes, count, dtypes = ranks(world).run(step_gathers, fmt_name)[0]
        assert dtypes == ["torch.uint8"], f"{fmt_name}: high-precision all-gather {dtypes}"
        assert count == base_count
        assert nbytes / base_bytes <= limit, (fmt_name, nbytes / base_bytes)


# -- refusals: every rank, before any all-gather ----------------------------------


def refuse(kind):
    world = torch.distributed.get_world_size()
    fmt_name, shape = ("rowblock4", (20, 64)) if kind.startswith("misaligned") else ("int8", (16, 64))
    model, _ = quantized_model(fmt_name, shape)
    m = mesh(world)
    with wire.record() as log:
        try:
            if kind == "placement":
                fully_shard(model, mesh=m, shard_placement_fn=lambda p: Shard(1))
            elif kind == "placement_plain_fully_shard":
                torch_fully_shard(model, mesh=m, shard_placement_fn=lambda p: Shard(1))
                model(weight((2, 64)))
            elif kind == "misaligned":
                fully_shard(model, mesh=m)
            elif kind == "misaligned_plain_fully_shard":
                torch_fully_shard(model, mesh=m)
        except ValueError as e:
            return type(e).__name__, len(log.all_gathers()), str(e)
    return "no error", len(log.all_gathers()), ""


@pytest.mark.parametrize(
    "kind,world,words",
    [
        ("placement", 2, "Shard(0)"),
        ("placement_plain_fully_shard", 2, "Shard(0) only"),
        ("misaligned", 3, "Legal FSDP2 sizes: 1, 5, 6"),
        ("misaligned_plain_fully_shard", 3, "multiple of 4"),
    ],
)
def test_refused_on_every_rank_before_any_all_gather(ranks, kind, world, words):
    results = ranks(world).run(refuse, kind, timeout=60)
    for kind_of_error, gathers, msg in results:
        assert kind_of_error in ("ValueError", "LayoutError") and gathers == 0, (kind_of_error, gathers, msg)
        assert words in msg, msg
    assert len({msg for _, _, msg in results}) == 1  # the same verdict everywhere
