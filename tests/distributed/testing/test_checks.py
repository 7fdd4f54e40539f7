"""testing/checks, the conformance kit, on every built-in format and on the documented custom format
(examples/custom_format.py)."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import CHECKS, check_format, is_default, run_check, where
from tests.support.examples.custom_format import Ternary  # the format docs/custom_format.md writes

# every built-in format as a user first meets it (its default parameters), the documented custom one,
# and the optimizer-state formats of dq.optim (AdamW8bit's and AdamW4bit's moments)
KIT_FORMATS = [*where(is_default).values(), Ternary(), dq.BlockFloat8(), dq.BlockLog4()]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
@pytest.mark.parametrize("fmt", KIT_FORMATS, ids=str)
def test_format_passes_kit(ranks, fmt, check):
    run_check(check, fmt, world_size=2, pool=ranks(2))


# The formats pre-quantized checkpoints load into (issue 22): the registry's defaults above run at 2 ranks;
# here the same kit at 1, 3 and 4 ranks (uneven shards, an empty rank for 3 experts over 4), and the
# scale-dtype options at 2.
PREQUANTIZED = [dq.Int4GroupwiseIntZero(128), dq.MXFP4(), dq.BnbNF4(), dq.NF4BlockScales()]
SCALE_DTYPES = [
    dq.Int4GroupwiseIntZero(64, scale_dtype=torch.float16),
    dq.Int4Groupwise(128, scale_dtype=torch.float16),
    dq.Int8Rowwise(scale_dtype=torch.bfloat16),
    dq.Float8Rowwise(scale_dtype=torch.bfloat16),
    dq.Float8Tensorwise(scale_dtype=torch.float32),
    dq.Float8Blockwise(128, scale_dtype=torch.bfloat16),
    dq.NF4BlockScales(levels="torchao"),  # NF4's scales expanded: in the weight's dtype, torchao's arithmetic
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("fmt", PREQUANTIZED, ids=str)
def test_prequantized_formats_pass_kit_on_more_ranks(ranks, fmt, world):
    # One rank all-gathers nothing: the kit's FSDP2 checks assert the stored bytes crossed the wire.
    checks = [c for c in CHECKS if world > 1 or not c.name.startswith("FSDP2")]
    check_format(fmt, world_size=world, checks=checks, pool=ranks(world)).raise_if_failed()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", SCALE_DTYPES, ids=str)
def test_scale_dtype_formats_pass_kit(ranks, fmt):
    check_format(fmt, world_size=2, pool=ranks(2)).raise_if_failed()


# Formats that quantize their activations (issue 35): every capability of the kit, and their arithmetic.
ACTIVATIONS = [
    dq.Int8Rowwise(activations="int8-token"),
    dq.Float8Rowwise(scale_dtype=torch.bfloat16, activations="fp8-token"),
    dq.Float8Tensorwise(activations="fp8-tensor", input_scale=0.01),
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ACTIVATIONS, ids=str)
def test_activation_formats_pass_kit(ranks, fmt):
    report = check_format(fmt, world_size=2, pool=ranks(2))
    report.raise_if_failed()
    (arithmetic,) = [o for o in report.outcomes if o.check.name == "quantized activations"]
    assert "not applicable" not in arithmetic.detail, arithmetic.detail


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
