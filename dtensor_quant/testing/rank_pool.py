"""Run a function on N local ranks with a process group: once, or on a pool kept alive.

Starting a process group costs seconds, so tests and benchmarks keep a
:class:`RankPool` per world size and send it one function after another::

    with RankPool(4) as pool:
        results = pool.run(my_fn, arg)      # my_fn(arg) on ranks 0..3

``my_fn`` must be importable (defined at module level). Ranks use gloo on
CPU, or NCCL with one GPU per rank when CUDA has enough devices. A rank that
raises makes :meth:`RankPool.run` raise :class:`RankError` with every rank's
traceback; ranks that stop answering (a hang) are killed after ``timeout``
seconds and the pool restarts on the next call. A rank that dies (a crash,
``os._exit``, a kill) is seen at once through its process sentinel and its
pipe (the parent closes its copy of each rank's end, so a dead rank's pipe
reads EOF): the call fails within ``grace`` seconds with the rank's exit code,
and the pool restarts on the next call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank to (exception, traceback text)."""

    def __init__(self, errors: dict[int, tuple[BaseException, str]]):
        self.errors = errors
        lines = [f"rank {r}: {tb.rstrip()}" for r, (_, tb) in sorted(errors.items())]
        super().__init__("\n".join(lines))


def device_type(world_size: int) -> str:
    """``"cuda"`` when every rank can have its own GPU, else ``"cpu"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "cuda"
    return "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, device: str, pg_timeout: float | None, conn: Connection) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=None if pg_timeout is None else timedelta(seconds=pg_timeout),
    )
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away
            break
        except Exception as e:  # the function or its arguments do not unpickle here: say so, keep serving
            conn.send(("err", (RuntimeError(_unpicklable(e)), traceback.format_exc() + _unpicklable(e))))
            continue
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # report everything, keep serving
            try:
                conn.send(("err", (e, traceback.format_exc())))
            except Exception:  # the exception itself does not pickle
                conn.send(("err", (RuntimeError(repr(e)), traceback.format_exc())))
    conn.close()
    os._exit(0)  # skip interpreter teardown: the pool is going away as a whole


def _unpicklable(e: BaseException) -> str:
    return (
        f"the function or its arguments cannot be unpickled on the rank ({type(e).__name__}: {e}). Functions run on "
        "the ranks must be importable there: define them at module level in a file (the ranks cannot import a "
        "script read from stdin or given with python -c)"
    )


@contextlib.contextmanager
def _spawnable_main():
    """Start ranks without re-running a main script that is not a file.

    A spawned process re-imports the parent's ``__main__`` from its path; for
    a script read from stdin (``python - < x.py``) that path is ``<stdin>``,
    and every rank would die at start with FileNotFoundError. Hiding the path
    while the ranks start lets them start; functions defined in such a script
    still cannot reach them (the rank says so).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path) or getattr(getattr(main, "__spec__", None), "name", None):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class RankPool:
    """``world_size`` processes in one process group, kept alive across calls."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        device: str | None = None,
        pg_timeout: float | None = None,
        grace: float = 10.0,
    ):
        """``timeout``: seconds to wait for every rank's answer; ``pg_timeout``: the process
        group's collective timeout (torch's default when None) -- short ones let tests
        that kill a rank see the others fail instead of hang; ``grace``: seconds the other
        ranks get to report after one died (a collective with the dead rank fails in gloo
        at once; one that blocks is not waited for longer)."""
        self.world_size, self.timeout, self.pg_timeout, self.grace = world_size, timeout, pg_timeout, grace
        self.device = device or device_type(world_size)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    @property
    def started(self) -> bool:
        """Whether the ranks are running (a call after a hang or a dead rank starts them again)."""
        return bool(self._procs)

    def start(self) -> RankPool:
        if self._procs:
            return self
        ctx = mp.get_context("spawn")
        port = _free_port()
        with _spawnable_main():
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                args = (rank, self.world_size, port, self.device, self.pg_timeout, child)
                p = ctx.Process(target=_worker, args=args, daemon=True)
                p.start()
                child.close()  # the rank holds the only other end now: its death reads as EOF here
                self._procs.append(p)
                self._conns.append(parent)
        self._collect(self.timeout)
        return self

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order."""
        self.start()
        for conn in self._conns:
            try:
                conn.send((fn, args, kwargs))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass  # the rank died since the last call: _collect reports it
        return self._collect(timeout or self.timeout)

    def _collect(self, timeout: float) -> list[Any]:
        """Every rank's reply; raises as soon as a rank dies (after ``grace`` for the others) or on timeout."""
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        died_at = None
        while pending:
            until = deadline if died_at is None else min(deadline, died_at + self.grace)
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], max(0.0, until - time.monotonic()))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                exited = self._procs[rank].sentinel in ready
                if conn not in ready and not (exited and conn.poll()):
                    if not exited:
                        continue
                    replies[rank] = self._died(rank)
                else:
                    try:
                        replies[rank] = conn.recv()
                    except (EOFError, OSError):
                        replies[rank] = self._died(rank)
                if replies[rank][0] == "died" and died_at is None:
                    died_at = time.monotonic()
                del pending[rank]
        errors = {r: v for r, (kind, v) in replies.items() if kind in ("err", "died")}
        for r in pending:
            if died_at is None:
                errors[r] = (TimeoutError(f"rank {r}: no answer"), f"no answer after {timeout:.0f} s (hang?)")
            else:
                errors[r] = (
                    TimeoutError(f"rank {r}: no answer"),
                    f"no answer {self.grace:.0f} s after a rank died (blocked in a collective with it?)",
                )
        if pending or died_at is not None:
            self.close(force=True)  # a hung or lost rank: the process group is unusable; the next call restarts
        if errors:
            raise RankError(errors)
        return [replies[r][1] for r in range(self.world_size)]

    def _died(self, rank: int) -> tuple[str, tuple[BaseException, str]]:
        proc = self._procs[rank]
        proc.join(timeout=5)
        reason = _exit_reason(proc.exitcode)
        return "died", (
            RuntimeError(f"rank {rank} died: it {reason}"),
            f"rank {rank} {reason} before answering (its own traceback, if any, is on its stderr)",
        )

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=0 if force else 5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def run(fn: Callable, world_size: int, *args, timeout: float = 600.0, **kwargs) -> list[Any]:
    """``fn(*args, **kwargs)`` once on ``world_size`` fresh local ranks."""
    with RankPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)


def under_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_script(fn: Callable, world_size: int, *args, **kwargs) -> list[Any]:
    """What an example's ``main`` runs: every rank's ``fn(*args, **kwargs)``, in rank order.

    Under ``torchrun`` this process is one rank: it joins the process group
    (NCCL with one GPU per rank when there are enough, else gloo), runs ``fn``
    and gathers every rank's result to every rank. Otherwise ``fn`` runs on
    ``world_size`` fresh local ranks (:func:`run`).
    """
    if not under_torchrun():
        return run(fn, world_size, *args, **kwargs)
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    device = device_type(world)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        gathered = [None] * world
        dist.all_gather_object(gathered, fn(*args, **kwargs))
    finally:
        dist.destroy_process_group()
    return gathered
