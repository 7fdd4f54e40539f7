"""parallel/liveness: what counts as a collective that a dead peer made fail; no process group, no roll call.

The roll call itself runs on ranks of their own in tests/distributed/checkpoint/test_faults.py.
"""

import pytest
import torch.distributed as dist

import dtensor_quant as dq
from dtensor_quant._parallel.liveness import describe, is_collective_failure

GLOO_DEAD_PEER = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:54978. "
    "This is typically caused by a remote worker crashing."
)


def test_a_dead_peer_is_a_collective_failure_and_a_refusal_is_not():
    assert is_collective_failure(RuntimeError(GLOO_DEAD_PEER))
    assert is_collective_failure(dist.DistNetworkError("Broken pipe"))
    assert not is_collective_failure(RuntimeError("the ranks hold this tensor in different layouts"))
    assert not is_collective_failure(ValueError(GLOO_DEAD_PEER))


def test_without_a_process_group_no_rank_is_lost():
    assert not dist.is_initialized()
    assert dq.lost_ranks() == []


def test_the_message_names_the_ranks():
    assert describe([1], "how").startswith("rank 1 stopped answering")
    assert describe([0, 2], "how").startswith("ranks 0, 2 stopped answering")
    assert "every rank answered" in describe([], "how")


def test_lost_ranks_takes_a_process_group():
    """Before: a KeyError from c10d's group lookup (with a process group), or [] (without one)."""
    for bad in ("world", 5, ["world"]):
        with pytest.raises(TypeError, match="takes a ProcessGroup"):
            dq.lost_ranks(bad)
