"""testing/rank_pool: the rank pool never waits for a dead rank:
a call fails in seconds with the rank's exit, then the pool restarts.

Before: the parent kept a copy of one rank's pipe end, so that rank's death
never read as EOF (the call waited the whole ``timeout``, 300 s by default);
the next call wrote into the dead rank's pipe (BrokenPipeError); a script
read from stdin could not start its ranks at all.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

import dtensor_quant as dq
from dtensor_quant.testing import (
    CHECKS,
    FORMATS,
    check_format,
    mesh,
    weight,
)
from dtensor_quant.testing.rank_pool import RankError, RankPool


def die_on_last_rank(code):
    """The last rank exits at once; the others wait for it in a collective."""
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(code)
    dist.barrier()
    return "passed a barrier without the dead rank"


def die_on_last_rank_while_others_compute(seconds):
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(5)
    time.sleep(seconds)  # not in a collective: nothing tells this rank that the other one died
    return "slept"


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


@pytest.fixture(scope="module")
def own_pool():
    """A pool of its own: these tests kill ranks, the session's shared pools must not pay the restarts."""
    pool = RankPool(2, timeout=300, device="cpu", grace=3)
    yield pool
    pool.close(force=True)


@pytest.mark.slow
def test_dead_rank_fails_the_call_in_seconds_and_the_pool_restarts(own_pool):
    own_pool.start()
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        own_pool.run(die_on_last_rank, 7)
    elapsed = time.monotonic() - t0
    assert elapsed < 60, f"the call waited {elapsed:.0f} s for a dead rank"  # the timeout is 300 s
    error, trace = info.value.errors[1]
    assert "died" in str(error) and "exited with code 7" in trace, trace
    assert 0 in info.value.errors  # the survivor's view is reported too (gloo: connection reset)
    assert not own_pool.started
    assert own_pool.run(rank_and_size) == [(0, 2), (1, 2)]  # the next call restarts the ranks


@pytest.mark.slow
def test_survivor_outside_a_collective_is_not_waited_for(own_pool):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        own_pool.run(die_on_last_rank_while_others_compute, 100)
    elapsed = time.monotonic() - t0
    assert elapsed < 60, f"the call waited {elapsed:.0f} s after a rank died"  # grace is 3 s, the rank sleeps 100
    assert "exited with code 5" in info.value.errors[1][1]
    assert "after a rank died" in info.value.errors[0][1]
    assert own_pool.run(rank_and_size) == [(0, 2), (1, 2)]


STDIN_SCRIPT = textwrap.dedent(
    """
    import time
    import torch.distributed as dist
    from dtensor_quant.testing.rank_pool import RankError, RankPool

    def defined_here():
        return 1

    pool = RankPool(2, timeout=300, device="cpu")
    t0 = time.monotonic()
    print("ranks", pool.run(dist.get_rank))  # an importable function runs
    try:
        pool.run(defined_here)
    except RankError as e:
        print("refused", "must be importable" in str(e))
    print("ranks", pool.run(dist.get_world_size))  # the pool still serves
    print("seconds", round(time.monotonic() - t0))
    pool.close()
    """
)


@pytest.mark.slow
def test_script_read_from_stdin():
    """``python - < script.py``: ranks start (the main path ``<stdin>`` is no file); its own functions are refused."""
    out = subprocess.run(
        [sys.executable, "-"], input=STDIN_SCRIPT, capture_output=True, text=True, timeout=300, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:3] == ["ranks [0, 1]", "refused True", "ranks [2, 2]"], out.stdout + out.stderr[-3000:]
    assert int(lines[3].split()[1]) < 150, lines  # the pool's timeout is 300 s


class CountingPool(RankPool):
    """A pool whose ranks cannot start (CUDA ranks on a machine without GPUs), counting the tries."""

    starts = 0

    def start(self):
        if not self.started:
            CountingPool.starts += 1
        return super().start()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="CUDA ranks start here")
def test_check_format_starts_the_ranks_once():
    pool = CountingPool(2, timeout=300, device="cuda", grace=3)
    checks = [c for c in CHECKS if c.distributed][:4] + [c for c in CHECKS if c.name == "quantize/dequantize"]
    try:
        report = check_format(FORMATS["int8"], pool=pool, checks=checks)
    finally:
        pool.close(force=True)
    assert CountingPool.starts == 1
    failed = [o for o in report.outcomes if not o.ok]
    assert failed and all("could not start" in o.detail for o in failed), report
    assert all(o.check.distributed for o in failed)
    assert any(o.ok for o in report.outcomes)  # the single-process checks still ran


def test_rank_error_reports_every_rank(ranks):
    with pytest.raises(RankError) as info:
        ranks(2).run(partial_refused_raises)
    assert set(info.value.errors) == {0, 1}


def partial_refused_raises():
    DTensor.from_local(dq.quantize(weight((4, 64)), dq.Int8Rowwise()), mesh(2), [Partial()]).full_tensor()
