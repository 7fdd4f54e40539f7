"""The conformance kit on every built-in format and on the documented custom format."""

import pytest
from custom_format import Ternary  # examples/custom_format.py, the format docs/custom_format.md writes

import dtensor_quant as dq
from dtensor_quant.testing import CHECKS, check_format, is_default, run_check, where

# every built-in format as a user first meets it (its default parameters), the documented custom one,
# and the optimizer-state formats of dq.optim (AdamW8bit's and AdamW4bit's moments)
KIT_FORMATS = [*where(is_default).values(), Ternary(), dq.BlockFloat8(), dq.BlockLog4()]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
@pytest.mark.parametrize("fmt", KIT_FORMATS, ids=str)
def test_format_passes_kit(ranks, fmt, check):
    run_check(check, fmt, world_size=2, pool=ranks(2))


def test_report_names_a_failing_capability(ranks):
    """A broken format is reported, capability by capability, not crashed on."""
    report = check_format(BrokenLayout(), world_size=2, pool=ranks(2))
    assert not report.ok
    failed = {o.check.name for o in report.outcomes if not o.ok}
    assert "quantize/dequantize" in failed, str(report)
    with pytest.raises(AssertionError, match="BrokenLayout"):
        report.raise_if_failed()


class BrokenLayout(dq.Int8Rowwise):
    """Declares a per-tensor scale but stores one per row: the kit must catch the lie."""

    layout = {"qdata": (dq.OneToOne(), dq.OneToOne()), "scale": (dq.Constant(), dq.Constant())}

    def __str__(self):
        return "BrokenLayout()"
