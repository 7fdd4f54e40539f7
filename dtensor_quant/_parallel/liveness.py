"""Which ranks stopped answering, once a collective has failed: a roll call through the store.

A rank killed in the middle of a collective closes its connections, and gloo
fails the collective at once on the ranks that talk to it -- with an error
that names an address, not a rank (``Connection closed by peer
[127.0.0.1]:54978``; the port is sometimes the dead rank's, sometimes an
ephemeral one of the survivor's). :func:`lost_ranks`, called by every
survivor (the checkpoint saves call it when one of their collectives fails;
a training loop can call it in its ``except``), writes ``<key>/<rank>`` into
the process group's store and waits up to :data:`ROLL_CALL_SECONDS` for the
group's other ranks to write theirs. Those that never do are named: dead, or
stuck somewhere else. Survivors find each other within milliseconds; the
wait is paid only for the ranks that do not come.

If the store itself stopped answering, its host is the one that died: rank 0
under ``init_process_group``'s default ``env://`` (or ``tcp://``) init, which
runs the store in rank 0's process; the launcher's agent under torchrun
(``TORCHELASTIC_USE_AGENT_STORE``), whose store outlives any rank.

What it cannot do: release a rank that waits on a *survivor* rather than on
the dead rank (a point-to-point receive from a rank that has raised and
moved on). gloo closes a group's connections only when the process group
object is freed or the process exits; ``ProcessGroup.abort`` and
``shutdown`` leave a peer's pending receive waiting (measured, torch 2.13).
Such a rank is released when the survivor's process exits -- as it does when
the error propagates -- or at the process group's timeout. The saves'
collectives (DCP's exchanges of plans and results, ``dq.hf.save``'s
agreements) are all-gathers and gathers with every rank, so every survivor
is told directly (``tests/distributed/checkpoint/test_faults.py``, 2 and 3
ranks).

Cost: nothing until a collective fails; then one store write, a poll every
50 ms, and :data:`ROLL_CALL_SECONDS` when some rank is gone.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

#: How long survivors wait for each other in the roll call (seconds).
ROLL_CALL_SECONDS = 3.0
_POLL = 0.05
_KEY = "dtensor_quant/roll_call"
_calls: Counter = Counter()  # roll calls this process made per group: the key of the next one

# What gloo's TCP transport says when a peer is gone (its errors are plain RuntimeErrors).
_GLOO_PEER_GONE = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective (or the store) failing, as a dead or stuck peer makes it fail."""
    if isinstance(error, dist.DistError):  # NCCL's and the store's errors, timeouts
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in _GLOO_PEER_GONE)


def lost_ranks(process_group=None, window: float = ROLL_CALL_SECONDS) -> list[int]:
    """The global ranks of ``process_group`` that stopped answering, after a collective on it failed.

    Call it on every surviving rank, in the ``except`` of the failed step (a
    training step whose all-gather raised ``Connection closed by peer``, say)::

        except RuntimeError as e:
            raise RuntimeError(f"ranks {dq.lost_ranks()} died") from e

    Each rank answers a roll call through the store and waits up to
    ``window`` seconds for the other ranks of ``process_group`` (default: the
    default group). Empty if every rank answered (a collective that timed
    out, no rank died). The group itself has a member that is gone: no
    collective over all of it can complete again; restart the job. Checkpoint
    saves do this themselves (:class:`~dtensor_quant.checkpoint.CheckpointSaveError`'s
    ``lost_ranks``).
    """
    return roll_call(process_group, window)[0]


def roll_call(process_group=None, window: float = ROLL_CALL_SECONDS) -> tuple[list[int], str]:
    """:func:`lost_ranks` and a sentence saying how they were found; ``process_group`` may be a list of groups
    (a mesh's: the roll call is over all their ranks)."""
    groups = process_group if isinstance(process_group, (list, tuple)) else [process_group]
    bad = [g for g in groups if g is not None and not isinstance(g, dist.ProcessGroup)]
    if bad:  # before: a KeyError from c10d's group lookup, or [] without a process group
        raise TypeError(f"lost_ranks takes a ProcessGroup (or None: the default group), got {bad[0]!r}")
    if not dist.is_initialized():
        return [], "no process group"
    groups = [g or c10d._get_default_group() for g in groups]
    ranks = sorted({r for g in groups for r in dist.get_process_group_ranks(g)})
    name = "+".join(sorted(g.group_name for g in groups))
    key = f"{_KEY}/{name}/{_calls[name]}"
    _calls[name] += 1
    store = c10d._get_default_store()
    me = dist.get_rank()
    previous = store.timeout
    try:
        store.set_timeout(timedelta(seconds=max(window, 1.0)))
        store.set(f"{key}/{me}", "here")
        deadline = time.monotonic() + window
        while True:
            missing = [r for r in ranks if not store.check([f"{key}/{r}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(_POLL)
    except Exception:  # the store is gone with its host
        return _store_host_lost()
    finally:
        try:
            store.set_timeout(previous)
        except Exception:
            pass
    return missing, f"no answer to a roll call through the store within {window:g} s"


def _store_host_lost() -> tuple[list[int], str]:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return [], "the launcher's store stopped answering too"
    return [0], "the process group's store, which rank 0 hosts (env:// or tcp:// init), stopped answering"


def describe(ranks: list[int], how: str) -> str:
    """``"rank 1 stopped answering (...)"``, or that no rank could be named."""
    if not ranks:
        return f"a collective failed, but every rank answered afterwards or none could be asked ({how})"
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{who} stopped answering (killed, crashed or stuck: {how})"
