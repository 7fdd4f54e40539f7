"""Formats that exist only to exercise every relation along FSDP2's dim 0.

The built-in formats follow rows one-to-one. These three add what a per-tensor
(float8-style), per-column or row-block scale does to an FSDP2 all-gather:
a scale that is not sent at all, one that is sent and found equal, and one
whose blocks constrain the shard length.
"""

from dataclasses import dataclass

import torch

from dtensor_quant import Blocked, Constant, OneToOne, QuantFormat
from dtensor_quant._core.reductions import block_reduce, expand_blocks
from dtensor_quant.testing import FORMATS as BUILTIN


def _codes(weight, scale):
    return torch.round(weight.float() / scale.float()).clamp(-127, 127).to(torch.int8)


def _scale(amax, dtype):
    return (amax / 127).clamp(min=1e-12).to(dtype)


@dataclass(frozen=True)
class PerTensorInt8(QuantFormat):
    """One scale for the whole weight: constant along both dims, never sent."""

    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (Constant(), Constant())}
    block_size_params = ()

    def quantize(self, weight, reduce):
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, None, "max")
        scale = _scale(reduce(amax, "max", "scale"), weight.dtype)
        return {"qdata": _codes(weight, scale), "scale": scale}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


@dataclass(frozen=True)
class ColumnInt8(QuantFormat):
    """One scale per input column: constant along rows, so every row shard holds all of it."""

    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (Constant(), OneToOne())}
    block_size_params = ()

    def quantize(self, weight, reduce):
        scale = _scale(reduce(block_reduce(weight.abs(), 0, None, "max"), "max", "scale"), weight.dtype)
        return {"qdata": _codes(weight, scale), "scale": scale}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


@dataclass(frozen=True)
class RowBlockInt8(QuantFormat):
    """One scale per block of ``rows`` output rows: row shards must hold whole blocks."""

    rows: int = 4

    block_size_params = ("rows",)

    @property
    def layout(self):
        return {"qdata": (OneToOne(), OneToOne()), "scale": (Blocked(self.rows), Constant())}

    def quantize(self, weight, reduce):
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, self.rows, "max")
        scale = _scale(reduce(amax, "max", "scale"), weight.dtype)
        return {"qdata": _codes(weight, expand_blocks(scale, 0, self.rows, weight.shape[0])), "scale": scale}

    def dequantize(self, inner, dtype):
        # the library hands the scale over repeated per row (see QuantFormat.dequantize)
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


# The test-only formats by name, and the registry the tests that use them run from.
EXTRA_FORMATS = {"pertensor": PerTensorInt8(), "column": ColumnInt8(), "rowblock4": RowBlockInt8(4)}
FORMATS = BUILTIN | EXTRA_FORMATS
