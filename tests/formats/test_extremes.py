"""Every format on extreme and non-finite weights: finite where the dense value is finite, NaN only where the
rule of docs/hostile_input.md says, and within the format's error bound of the dense value.

One property test over every built-in format (the registry, the optimizer-state formats, every ``scale_dtype``
a format accepts) in fp32, bf16 and fp16, on random, extreme (the dtype's max, its smallest subnormal, +-Inf,
NaN, all-zero blocks) and mixed weights, drawn by hypothesis. The rules it checks:

* a finite weight dequantizes finite, and an Inf does not change any other weight's value: quantizing with the
  Inf replaced by 0 gives the same values everywhere else (block statistics are over finite values);
* NaN appears only at NaN weights, except where the format's code has no NaN: then a NaN poisons its own block
  (at most ``poison_unit`` weights per NaN) and nothing else;
* every finite weight is within ``rel * max|w| + floor`` of its dense value (``rel``: the format's worst code
  rounding relative to its block's maximum, bounded by the tensor's; ``floor``: the smallest scale the scale's
  dtype holds, and the output dtype's own rounding).

Documented exceptions (docs/hostile_input.md): BlockLog4(nonnegative) keeps a block with an Inf at absmax = Inf
(every value of the block reads Inf: an optimizer's "no step"); scales narrower than the weight (fp16 scales of
fp32/bf16 weights) saturate weights beyond their range (bf16 scales: past 3.39e38; fp16: past 65504).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtensor_quant as dq
from dtensor_quant.testing import FORMATS

_SCALED = (dq.Int8Rowwise, dq.Float8Rowwise, dq.Float8Tensorwise, dq.Float8Blockwise, dq.Int4Groupwise,
           dq.Int4GroupwiseIntZero)  # fmt: skip
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _all_formats() -> dict[str, dq.QuantFormat]:
    out = dict(FORMATS)
    for name, fmt in FORMATS.items():
        if isinstance(fmt, _SCALED):
            for sd in _SCALE_DTYPES:
                out[f"{name}:{str(sd).removeprefix('torch.')}"] = type(fmt)(
                    *[getattr(fmt, f) for f in ("group_size", "block_size") if hasattr(fmt, f)], scale_dtype=sd
                )
    out |= {
        "bf8": dq.BlockFloat8(64),
        "bf8nn": dq.BlockFloat8(64, nonnegative=True),
        "bl4": dq.BlockLog4(64),
        "bl4nn": dq.BlockLog4(64, nonnegative=True),
    }
    return out


ALL = _all_formats()
ROWS, COLS = 8, 512


def _kind(fmt) -> str:
    return type(fmt).__name__


def _rel(fmt) -> float:
    """The worst code rounding relative to a block's maximum (the module docstring of each format)."""
    return {
        "Int8Rowwise": 1 / 127,  # half a code of amax / 127, plus the scale's rounding
        "Int4Groupwise": 2 / 15,  # half a code of range / 15, range <= 2 max, plus scale and zero rounding
        "Int4GroupwiseIntZero": 2 / 15,
        "NF4": 0.16,  # half NF4's widest level gap (1 - 0.7230) plus the int8 scale step spread / 256
        "BnbNF4": 0.16,
        "NF4BlockScales": 0.14,
        "Float8Rowwise": 1 / 16,  # e4m3: 3 fraction bits
        "Float8Tensorwise": 1 / 16,
        "Float8Blockwise": 1 / 16,
        "MXFP4": 1 / 3,  # e2m1 between 4 and 6 (a gap of 2) under a power-of-two scale
        "BlockFloat8": 1 / 8,  # e4m3 (1/16) or e5m2 (2 fraction bits)
        "BlockLog4": 0.3,  # signed: half the gap 0.5..1; nonnegative: 1 - 2**-0.5 (log rounding)
    }[_kind(fmt)]


def _scale_dtype(fmt, dtype: torch.dtype) -> torch.dtype:
    sd = getattr(fmt, "scale_dtype", None)
    if sd is not None:
        return sd
    if isinstance(fmt, (dq.Float8Blockwise, dq.BnbNF4, dq.NF4BlockScales, dq.BlockFloat8, dq.BlockLog4, dq.MXFP4)):
        return torch.float32  # float32 (or e8m0) scales whatever the weight
    return dtype


def _poison_unit(fmt) -> int:
    """How many weights one NaN may make NaN: 1 where the code holds NaN, else the block the code cannot say
    it in (a row, a group, an NF4 factor's blocks, an e8m0 block)."""
    if isinstance(fmt, (dq.Float8Rowwise, dq.Float8Tensorwise, dq.Float8Blockwise, dq.BlockFloat8)):
        return 1
    if isinstance(fmt, dq.BlockLog4):
        return 0  # a NaN state takes a finite code (docs): nothing reads NaN
    if isinstance(fmt, dq.Int8Rowwise):
        return COLS
    if isinstance(fmt, (dq.Int4Groupwise, dq.Int4GroupwiseIntZero)):
        return fmt.group_size
    if isinstance(fmt, dq.NF4):
        return fmt.block_size * fmt.scaler_block_size
    if isinstance(fmt, dq.BnbNF4):
        return fmt.block_size * fmt.nested_block_size
    if isinstance(fmt, dq.NF4BlockScales):
        return fmt.block_size
    if isinstance(fmt, dq.MXFP4):
        return 32
    raise AssertionError(f"no poison unit for {fmt}")


def _saturates(fmt, dtype: torch.dtype) -> float:
    """The largest weight the format's scale dtype holds (finite weights beyond it saturate: documented)."""
    sd = _scale_dtype(fmt, dtype)
    return min(torch.finfo(sd).max, torch.finfo(dtype).max)


_KINDS = ("normal", "max", "subnormal", "tiny", "zero", "inf", "nan", "mixed")


def _row(kind: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    info = torch.finfo(dtype)
    base = torch.randn(COLS, generator=g, dtype=torch.float64)
    if kind == "normal":
        return base
    if kind == "max":  # the dtype's max in a few places, ordinary values elsewhere
        r = base.clone()
        r[torch.randint(COLS, (5,), generator=g)] = info.max * base.sign()[:5]
        return r
    if kind == "subnormal":
        return base.sign() * info.smallest_normal * info.eps * torch.randint(1, 4, (COLS,), generator=g)
    if kind == "tiny":  # normal values far below 1 (Adam's second moments of small gradients)
        return base * info.smallest_normal * 8
    if kind == "zero":
        return torch.zeros(COLS, dtype=torch.float64)
    r = base.clone()
    places = torch.randint(COLS, (3,), generator=g)
    if kind == "inf":
        r[places] = math.inf * torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    elif kind == "nan":
        r[places[0]] = math.nan
    else:  # every extreme at once
        r[:128] *= info.smallest_normal
        r[128:160] = 0
        r[200] = info.max
        r[places] = torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)
    return r


def _weight(kinds, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([_row(k, dtype, g) for k in kinds]).to(dtype)


def check(name: str, dtype: torch.dtype, w: torch.Tensor) -> None:
    fmt = ALL[name]
    nonneg = getattr(fmt, "nonnegative", False)
    if nonneg:
        w = w.abs()
    d = dq.quantize(w, fmt).dequantize()
    assert d.dtype == dtype and d.shape == w.shape
    finite, nan = w.isfinite(), w.isnan()
    inf_blocks = isinstance(fmt, dq.BlockLog4) and nonneg and bool(w.isinf().any())
    if inf_blocks:  # documented: such a block reads Inf; check the others through the clean weight below
        return check_clean_rows(fmt, w, d)
    # NaN only where the dense value is NaN, or within the block of one where the code has no NaN
    spurious = d.isnan() & ~nan
    assert int(spurious.sum()) <= int(nan.sum()) * max(_poison_unit(fmt) - 1, 0), (name, int(spurious.sum()))
    assert not (d.isinf() & finite).any(), f"{name}: a finite weight dequantized to Inf"
    if not w.isinf().any() and not nan.any():
        _within_bound(fmt, dtype, w, d)
        return
    # an Inf changes nothing else: the same values as with 0 in its place (NaN-free rows only, for int codes)
    clean = torch.where(w.isinf(), 0, w)
    ref = dq.quantize(clean, fmt).dequantize()
    same = finite & ~d.isnan() & ~ref.isnan()
    if _poison_unit(fmt) > 1 and nan.any():
        # a NaN moves statistics shared beyond its block (NF4's mean of block scales): compare NaN-free weights
        ref = dq.quantize(torch.where(nan, 0, clean), fmt).dequantize()
        if isinstance(fmt, (dq.NF4, dq.BnbNF4)):
            return  # the shared mean: checked for finiteness above
        same = same & ~ref.isnan()
    assert torch.equal(d[same], ref[same]), f"{name}: a non-finite weight changed other weights' values"
    if not nan.any():
        assert d[~finite].isinf().logical_or(d[~finite].isfinite()).all()


def check_clean_rows(fmt, w, d) -> None:
    """BlockLog4(nonnegative): rows without an Inf dequantize as on their own."""
    rows = ~w.isinf().any(1)
    ref = dq.quantize(w[rows], fmt).dequantize()
    assert torch.equal(d[rows], ref)


def _within_bound(fmt, dtype, w, d) -> None:
    w64, d64 = w.double(), d.double()
    top = w64.abs().amax().item()
    limit = _saturates(fmt, dtype)
    fits = w64.abs() <= limit
    sd = _scale_dtype(fmt, dtype)
    sub = torch.finfo(sd).smallest_normal * torch.finfo(sd).eps
    floor = max(448 * sub, 2e-38) + torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    if isinstance(fmt, dq.Int4Groupwise):
        floor += 1e-6 / 15  # its documented floor: a group's range is at least 1e-6 (torchao's int4 reference)
    bound = _rel(fmt) * min(top, limit) * (1 + 2 * torch.finfo(sd).eps) + floor
    bound = bound + torch.finfo(dtype).eps * w64.abs()  # the output dtype's rounding
    err = (d64 - w64).abs()
    assert (err[fits] <= bound[fits]).all(), (fmt, dtype, (err - bound)[fits].max().item(), top)
    assert d.isfinite().all()


FAST = ["int8", "int4g32", "int4z128", "nf4", "bnbnf4", "nf4bs", "f8row", "f8tensor", "f8block32", "mxfp4",
        "bf8", "bf8nn", "bl4", "bl4nn", "int8:bfloat16", "int8:float16", "f8row:bfloat16", "f8row:float16",
        "f8block128:bfloat16", "int4g128:float16", "int4z128:bfloat16"]  # fmt: skip
SLOW = [n for n in ALL if n not in FAST]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", FAST)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(_KINDS), min_size=ROWS, max_size=ROWS), seed=st.integers(0, 2**16))
def test_extremes(name, dtype, kinds, seed):
    check(name, dtype, _weight(kinds, dtype, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", _KINDS)
def test_each_kind_whole_tensor(name, dtype, kind):
    """Every row of one kind: a block of the dtype's max, all-subnormal, all-zero, ... (what mixing may miss)."""
    check(name, dtype, _weight([kind] * ROWS, dtype, 0))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", SLOW)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(_KINDS), min_size=ROWS, max_size=ROWS), seed=st.integers(0, 2**16))
def test_extremes_every_format(name, dtype, kinds, seed):
    check(name, dtype, _weight(kinds, dtype, seed))
