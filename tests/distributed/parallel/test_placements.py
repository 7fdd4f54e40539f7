"""_parallel/placements on live ranks: a placement a quantized layout cannot take is refused on every rank,
before any collective.

A Partial placement meets one error, LayoutError with one message, at every entry point: a quantized tensor
cannot hold partial sums (adding codes and scales is not adding values), so wherever a Partial placement
reaches a quantized weight -- the placement check, quantizing a Partial DTensor, the reducing collectives of a
redistribute, the checkpoint entries -- the library raises ``dq.layout.partial_refused``'s LayoutError before
any collective. Misaligned shards (a cut inside a block) are refused the same way.
"""

import time

import pytest
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant._parallel import custom_ops
from dtensor_quant.testing import (
    mesh,
    weight,
)
from tests.parallel.test_placements import assert_partial_refusal


def distribute_misaligned():
    m = mesh(3)
    q = dq.quantize(weight((4, 256)), dq.Int4Groupwise(64))
    with wire.record() as log:
        try:
            distribute_tensor(q, m, [Shard(1)])
        except dq.LayoutError as e:
            return ("LayoutError", len(log), str(e))
    return ("no error", len(log), "")


def quantize_misaligned():
    m = mesh(3)
    dense = distribute_tensor(weight((4, 256)), m, [Shard(1)])
    with wire.record() as log:
        try:
            dq.quantize(dense, dq.Int4Groupwise(64))
        except dq.LayoutError as e:
            return ("LayoutError", len(log), str(e))
    return ("no error", len(log), "")


@pytest.mark.parametrize("fn", [distribute_misaligned, quantize_misaligned])
def test_misaligned_errors_on_every_rank_before_any_collective(ranks, fn):
    start = time.monotonic()
    results = ranks(3).run(fn, timeout=60)
    assert time.monotonic() - start < 30
    for kind, collectives, msg in results:
        assert kind == "LayoutError" and collectives == 0, (kind, collectives)
        assert "dim 1" in msg and "64" in msg
    assert "1, 2, 4" in results[0][2] and ", 3," not in results[0][2]


def partial_refused():
    m = mesh(2)
    q = dq.quantize(weight((4, 64)), dq.Int8Rowwise())
    errors = []
    try:
        dq.quantize(DTensor.from_local(weight((4, 64)), m, [Partial()]), dq.Int8Rowwise())
    except dq.LayoutError as e:
        errors.append(str(e))
    try:
        DTensor.from_local(q, m, [Partial()]).full_tensor()
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_partial_refused_on_every_rank(ranks):
    for errors in ranks(2).run(partial_refused, timeout=60):
        assert len(errors) == 2 and all("Partial" in e for e in errors), errors


def refusals():
    """Every entry point where a Partial placement meets a quantized weight, run on each rank."""
    m, fmt = mesh(2), dq.Int8Rowwise()
    w = weight((4, 64))
    q = dq.quantize(w, fmt)
    cases = {
        "quantize(from_local Partial)": lambda: dq.quantize(DTensor.from_local(w, m, [Partial()]), fmt),
        "quantize(distribute_tensor Partial)": lambda: dq.quantize(distribute_tensor(w, m, [Partial()]), fmt),
        "custom op quantize(Partial)": lambda: custom_ops.quantize(DTensor.from_local(w, m, [Partial()]), fmt),
        "full_tensor of Partial": lambda: DTensor.from_local(q, m, [Partial()]).full_tensor(),
        "redistribute Partial -> Replicate": lambda: DTensor.from_local(q, m, [Partial()]).redistribute(
            m, [Replicate()]
        ),
        "redistribute Partial -> Shard(0)": lambda: DTensor.from_local(q, m, [Partial()]).redistribute(m, [Shard(0)]),
        "redistribute Partial(avg) -> Replicate": lambda: DTensor.from_local(q, m, [Partial("avg")]).full_tensor(),
        "checkpoint entries of a Partial weight": lambda: _entries_of(DTensor.from_local(q, m, [Partial()])),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except Exception as e:
            out[name] = e
    return out


def _entries_of(param):
    """What a checkpoint save makes of the weight (dq.checkpoint.save, its SavePlanner): the entry form, which has
    no way to store a pending sum. (``state_dict()`` holds the weight itself, Partial as it is, like a dense one.)"""
    lin = nn.Linear(64, 4, bias=False)
    lin.weight = nn.Parameter(param, requires_grad=False)
    return dq.checkpoint.entries_from_state(dq.checkpoint.register(lin).state_dict())


def test_partial_refused_with_one_error_everywhere(ranks):
    for rank, errors in enumerate(ranks(2).run(refusals, timeout=120)):
        for name, error in errors.items():
            assert error is not None, f"rank {rank}: {name} did not raise"
            assert_partial_refusal(error, f"rank {rank}: {name}")


def torch_refusals():
    """Where torch itself refuses first; recorded so that a change in torch shows up here."""
    m = mesh(2)
    q = dq.quantize(weight((4, 64)), dq.Int8Rowwise())
    out = {}
    try:  # DTensor refuses any redistribute *to* Partial before a local op runs
        distribute_tensor(q, m, [Replicate()]).redistribute(m, [Partial()])
    except RuntimeError as e:
        out["redistribute to Partial"] = (type(e).__name__, "internal use only" in str(e))
    try:  # distribute_tensor(..., [Partial()]) divides the local tensor by the mesh size: dense math
        distribute_tensor(q, m, [Partial()])
    except dq.UnsupportedOpError as e:
        out["distribute_tensor Partial(sum)"] = (type(e).__name__, "aten.div" in str(e))
    return out


def test_torch_refuses_partial_targets_first(ranks):
    expected = {
        "redistribute to Partial": ("RuntimeError", True),
        "distribute_tensor Partial(sum)": ("UnsupportedOpError", True),
    }
    assert ranks(2).run(torch_refusals, timeout=60) == [expected, expected]


class RowParallelLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(384, 64, bias=False)  # 192 columns per rank: cuts a group of 128

    def forward(self, x):
        return self.proj(x)


def misaligned_row_parallel(quantize_first):
    m = mesh(2)
    model = RowParallelLayer()
    plan = {"proj": RowwiseParallel()}
    with wire.record() as log:
        try:
            if quantize_first:
                dq.quantize_(model, dq.Int4Groupwise(128))
                parallelize_module(model, m, plan)
            else:
                parallelize_module(model, m, plan)
                log.transfers.clear()  # the dense scatter; the refusal must come before any collective of ours
                dq.quantize_(model, dq.Int4Groupwise(128))
        except dq.LayoutError as e:
            return str(e), len(log)
    return "no error", len(log)


@pytest.mark.parametrize("quantize_first", [True, False])
def test_misaligned_row_parallel_refused_on_every_rank(ranks, quantize_first):
    start = time.monotonic()
    for message, collectives in ranks(2).run(misaligned_row_parallel, quantize_first, timeout=60):
        assert "multiple of 128" in message, message
        assert collectives == 0
        if not quantize_first:
            assert message.startswith("proj.weight:")  # quantize_ names the module
    assert time.monotonic() - start < 30
