"""Ranks of their own for fault-injection tests: start N processes, kill one, watch the others.

The shared rank pool cannot host these tests: a killed rank breaks its
process group for every rank of the pool. :func:`run_ranks` starts fresh
processes (``spawn``) with a gloo process group over a TCP store on
127.0.0.1 (on a port the OS gives rank 0), runs one importable function on every rank and
says what each rank did: returned, raised (its exception's type and text),
died (the signal) or hung (killed by the harness after ``timeout``).

The parent sees each event as it happens (a rank's report on its pipe, a
process's sentinel), so ``Outcome.at`` of a survivor minus that of the dead
rank is how long the survivor took to notice, to the millisecond. A rank that
reported stays alive until every rank has reported or died: its exit would
otherwise close its connections and make the others fail for that reason,
not for the library's.

Kill points are chosen in the rank's own code, by wrapping a function
(:func:`die_at`), so the library carries no test hook.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class Outcome:
    rank: int
    kind: str  # "returned", "raised", "died" or "hung"
    value: Any = None  # what the function returned; for "raised", the exception's ``lost_ranks`` (if any)
    error_type: str = ""  # the exception's class name ("raised")
    error: str = ""  # its text
    trace: str = ""
    at: float = field(default=0.0, repr=False)  # time.monotonic() in the parent when seen

    def __str__(self) -> str:
        what = {"returned": repr(self.value), "raised": f"{self.error_type}: {self.error}\n{self.trace}"}
        return f"rank {self.rank} {self.kind}: {what.get(self.kind, '')}"


def _child(rank: int, world: int, pg_timeout: float, conn, fn, args) -> None:
    timeout = timedelta(seconds=pg_timeout)
    if rank == 0:  # the store on a port the OS picks: a free port chosen beforehand can be taken meanwhile
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        conn.send(("port", store.port))
    else:
        store = dist.TCPStore("127.0.0.1", conn.recv(), world, is_master=False, timeout=timeout)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        conn.send(("returned", fn(*args), "", "", ""))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        conn.send(("raised", getattr(e, "lost_ranks", None), type(e).__name__, str(e), traceback.format_exc()))
    try:
        conn.recv()  # stay alive until the parent has seen every rank
    except EOFError:
        pass
    os._exit(0)  # no process-group teardown with a dead peer


def run_ranks(world: int, fn, *args, timeout: float = 90.0, pg_timeout: float = 300.0) -> list[Outcome]:
    """``fn(*args)`` on ``world`` fresh ranks; one :class:`Outcome` per rank.

    ``pg_timeout`` is the process group's timeout: far above what the tests
    allow a survivor, so a survivor that only fails by timing out shows as slow.
    """
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=_child, args=(rank, world, pg_timeout, child_end, fn, args), daemon=True)
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    try:
        if not conns[0].poll(timeout) or (port := conns[0].recv()[1]) is None:  # EOFError if it died
            raise RuntimeError(f"rank 0 did not start its store within {timeout} s")
        for conn in conns[1:]:
            conn.send(port)
        while len(outcomes) < world and time.monotonic() < deadline:
            waiting = {}
            for r in range(world):
                if r not in outcomes:
                    waiting[conns[r]] = r
                    waiting[procs[r].sentinel] = r
            for ready in wait(list(waiting), timeout=deadline - time.monotonic()):
                r = waiting[ready]
                if r in outcomes:
                    continue
                now = time.monotonic()
                try:
                    kind, value, etype, text, trace = conns[r].recv()
                    outcomes[r] = Outcome(r, kind, value, etype, text, trace, now)
                except (EOFError, OSError):
                    procs[r].join(5)
                    code = procs[r].exitcode
                    name = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
                    outcomes[r] = Outcome(r, "died", error=name, at=now)
        for r in range(world):
            outcomes.setdefault(r, Outcome(r, "hung", at=time.monotonic()))
    finally:
        for conn in conns:
            with _quiet():
                conn.send(None)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    return [outcomes[r] for r in range(world)]


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (OSError, EOFError, ValueError))


def die() -> None:
    """SIGKILL this process: no handler, no clean-up, no flush (as the OOM killer or a node failure)."""
    os.kill(os.getpid(), signal.SIGKILL)


def die_at(owner, name: str, *, after: bool = False, when=None) -> None:
    """Replace ``owner.name`` so that this process dies on its first call (before it, or ``after`` it returns).

    ``when(*args, **kwargs)``, if given, chooses the call: the process dies on the first call it accepts.
    """
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return original(*args, **kwargs)
        if not after:
            die()
        result = original(*args, **kwargs)
        die()
        return result

    setattr(owner, name, wrapper)


def survivors(outcomes: list[Outcome], dead: int) -> list[Outcome]:
    """Every rank but ``dead``, after checking that ``dead`` died of SIGKILL."""
    assert outcomes[dead].kind == "died" and outcomes[dead].error == "SIGKILL", "\n".join(map(str, outcomes))
    return [o for o in outcomes if o.rank != dead]
