"""_parallel/redistribute_check on live ranks: a target the layout cannot hold is refused before anything is sent.

Before the check, ``Shard(0) -> Shard(1)`` of a weight whose new cut splits a group ran two all-gathers
and then raised about the padded intermediate DTensor builds. Now every rank raises
``check_placements``' ``LayoutError`` (the legal mesh sizes named) and neither ``dq.wire.record()`` nor
torch's ``CommDebugMode`` sees a collective -- whether the library's shortcuts (gather_dim,
shard_to_shard) are installed or torch's own steps run -- for a weight, its transposed view, an uneven
split over 3 ranks and a 2-D mesh whose first step would have gathered.
"""

import contextlib
import math

import pytest
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_quant as dq
from dtensor_quant._parallel.fast_redistribute import patch, with_shortcuts
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh, placements, weight

CASES = [  # fmt, weight shape, mesh, src, dst, transposed
    ("int4g128", (64, 384), (2,), "S0", "S1", False),  # the new cut at 192 splits a group of 128
    ("int4g128", (64, 640), (3,), "S0", "S1", False),  # 5 groups over 3 ranks: chunks of 214
    ("int4g128", (64, 384), (2,), "S1", "S0", True),  # the transposed view: its dim 0 is the weight's dim 1
    ("int4g128", (64, 384), (2, 2), "S0,R", "R,S1", False),  # 2-D: the first step would gather dim 0
    ("nf4b64s8", (64, 384), (2,), "S0", "S1", False),  # blocks over the flat index
    ("mxfp4", (4, 64), (4,), "S0", "S1", False),  # chunks of 16 columns, blocks of 32
]


def _no_shortcuts():
    """torch's own redistribute steps: the opt-in shortcuts removed for the block."""
    stack = contextlib.ExitStack()
    for name in ("gather_dim", "shard_to_shard"):
        stack.enter_context(patch(name).removed())
    return stack


@with_shortcuts
def refused(fmt_name, shape, mesh_shape, src, dst, transposed):
    """The refusal's message on this rank, the same under each way of running the move."""
    m = mesh(*mesh_shape)
    q = dq.quantize(weight(shape, 2), FORMATS[fmt_name])
    q = q.t() if transposed else q
    dt = distribute_tensor(q, m, placements(src))
    messages = []
    for how in ("shortcuts", "torch's steps", "CommDebugMode"):
        scope = _no_shortcuts() if how == "torch's steps" else contextlib.nullcontext()
        comm = CommDebugMode() if how == "CommDebugMode" else contextlib.nullcontext()
        with scope, comm, dq.wire.record() as log:
            with pytest.raises(dq.LayoutError) as e:
                dt.redistribute(m, placements(dst))
        assert len(log) == 0, f"{how}: sent {log.transfers} before refusing"
        if how == "CommDebugMode":
            assert comm.get_total_counts() == 0, comm.get_comm_counts()
        messages.append(str(e.value))
    assert len(set(messages)) == 1, messages
    # The DTensor is untouched and still moves where its layout allows.
    assert_same_bits(dt.full_tensor(), q, "full_tensor after the refusal")
    return messages[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3]}-to-{c[4]}-mesh{c[2]}{'-t' if c[5] else ''}")
def test_a_target_the_layout_cannot_hold_is_refused_before_any_collective(ranks, case):
    fmt_name, shape, mesh_shape, _src, dst, transposed = case
    messages = ranks(math.prod(mesh_shape)).run(refused, *case)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    # check_placements' own message for the weight (not its view): the legal mesh sizes named.
    dst_weight = placements({"S0": "S1", "S1": "S0"}[dst] if transposed else dst)
    with pytest.raises(dq.LayoutError) as expected:
        dq.check_placements(shape, FORMATS[fmt_name], mesh_shape, dst_weight)
    assert str(expected.value) in messages[0], (messages[0], str(expected.value))
    assert "would be legal with size" in messages[0]
