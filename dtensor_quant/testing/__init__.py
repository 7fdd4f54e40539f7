"""The conformance kit: run the whole battery on a format -- a built-in one or your own.

    from dtensor_quant.testing import check_format
    report = check_format(MyFormat(), world_size=2)
    print(report)                 # one line per capability: ok / FAILED and why
    report.raise_if_failed()

Or, in pytest, one test per capability::

    from dtensor_quant.testing import CHECKS, run_check

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
    def test_my_format(check):
        run_check(check, MyFormat())

The checks run on real local ranks (gloo on CPU) and compare against a
single-process reference, bit-exactly where the math allows. The format must
be importable by the spawned ranks (defined at module level).

For tests of your own, the same toolkit the project's tests use: ``FORMATS``
(the built-in format instances by name, with :func:`pick` / :func:`where` to
take a subset), :func:`pool` (live ranks per world size; the pytest fixture
``ranks`` is in :mod:`dtensor_quant.testing.fixtures`), :func:`mesh`,
:func:`placements`, :func:`legal`, :func:`weight`, :func:`same_bits`, :func:`assert_same_bits`,
:func:`assert_local_matches` and :func:`reference_dequantize`; for a float result computed
another way (another kernel, summation order or reduction length), :func:`linear_error_bound`
and :func:`assert_within` (:mod:`dtensor_quant.testing.bounds`: bit-exact comparisons are for
bytes and for the same computation).

:mod:`dtensor_quant.testing.tiny_llama` is the small LLaMA-style model (random weights, no
download) that the examples, the tests and the benches build.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._core.format import QuantFormat
from .._ops.matmul import record_paths
from .bounds import assert_within, gamma, linear_error_bound, unit_roundoff
from .checks import CHECKS, Check, pick_shape
from .rank_pool import RankError, RankPool
from .registry import FORMATS, has_kernel, is_default, pick, where
from .tools import (
    assert_local_matches,
    assert_redistributes_exactly,
    assert_same_bits,
    close_pools,
    legal,
    mesh,
    placements,
    pool,
    rank,
    reference_dequantize,
    same_bits,
    weight,
)


@dataclass
class Outcome:
    check: Check
    ok: bool
    detail: str


@dataclass
class Report:
    fmt: QuantFormat
    shape: tuple[int, int]
    world_size: int
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    def raise_if_failed(self) -> None:
        failed = [o for o in self.outcomes if not o.ok]
        if failed:
            raise AssertionError(f"{self.fmt} fails: " + "; ".join(f"{o.check.name}: {o.detail}" for o in failed))

    def __str__(self) -> str:
        width = max(len(o.check.name) for o in self.outcomes) if self.outcomes else 10
        lines = [f"{self.fmt} on a {self.shape[0]}x{self.shape[1]} weight, {self.world_size} ranks"]
        for o in self.outcomes:
            lines.append(f"  {o.check.name:<{width}}  {'ok    ' if o.ok else 'FAILED'}  {o.detail}")
        return "\n".join(lines)


def run_check(check: Check, fmt: QuantFormat, world_size: int = 2, shape=None, pool: RankPool | None = None) -> str:
    """Run one check; raises AssertionError (with every rank's error) if it fails, else returns its detail."""
    shape = tuple(shape) if shape else pick_shape(fmt, world_size)
    own = pool is None
    pool = pool or RankPool(world_size, device="cpu")
    try:
        details = pool.run(check.fn, fmt, shape) if check.distributed else [check.fn(fmt, shape)]
    except RankError as e:
        raise AssertionError(f"{check.name}: {e}") from None
    finally:
        if own:
            pool.close()
    return details[0]


def check_format(
    fmt: QuantFormat, world_size: int = 2, shape=None, checks=None, pool: RankPool | None = None
) -> Report:
    """Every check in ``checks`` (default: all) on ``fmt``; never raises, reports.

    Starts ``world_size`` local ranks unless ``pool`` (a started RankPool) is given.
    """
    shape = tuple(shape) if shape else pick_shape(fmt, world_size)
    report = Report(fmt, shape, world_size)
    own = pool is None
    pool = pool or RankPool(world_size, device="cpu")
    unstarted = None  # why the ranks cannot start: then no later check tries again (each try costs a start)
    try:
        for check in checks or CHECKS:
            if check.distributed and unstarted is None and not pool.started:
                try:
                    pool.start()  # first use, or a restart after a check hung or killed a rank
                except RankError as e:
                    why = (str(e).strip().splitlines() or ["?"])[-1]
                    unstarted = f"not run: the {world_size} ranks could not start: {why}"
            if check.distributed and unstarted:
                report.outcomes.append(Outcome(check, False, unstarted[:300]))
                continue
            try:
                detail = run_check(check, fmt, world_size, shape, pool)
                report.outcomes.append(Outcome(check, True, detail))
            except Exception as e:  # the kit reports every failure, whatever raised it
                lines = str(e).strip().splitlines() or [type(e).__name__]
                report.outcomes.append(Outcome(check, False, lines[-1][:300]))
    finally:
        if own:
            pool.close()
    return report


__all__ = [
    "CHECKS",
    "FORMATS",
    "Check",
    "Report",
    "assert_local_matches",
    "assert_redistributes_exactly",
    "assert_same_bits",
    "assert_within",
    "check_format",
    "close_pools",
    "gamma",
    "has_kernel",
    "is_default",
    "legal",
    "linear_error_bound",
    "mesh",
    "pick",
    "pick_shape",
    "placements",
    "pool",
    "rank",
    "record_paths",
    "reference_dequantize",
    "run_check",
    "same_bits",
    "unit_roundoff",
    "weight",
    "where",
]
