"""A new format in one page: ternary weights (BitNet b1.58 style), two bits each, four per byte.

    python examples/custom_format.py      # runs the conformance kit on 2 local ranks

Everything DTensor, FSDP2 and DCP need comes from ``layout``; the class holds
only the layout, the math and (here) no kernel, so matmuls dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import dtensor_quant as dq
from dtensor_quant import block_reduce


@dataclass(frozen=True)
class Ternary(dq.QuantFormat):
    """w ~= scale[row] * t with t in {-1, 0, +1}; scale = mean |w| of the row."""

    layout = {
        "qdata": (dq.OneToOne(), dq.Packed(4)),  # [out, in/4] uint8: 4 codes of 2 bits per byte
        "scale": (dq.OneToOne(), dq.Constant()),  # [out, 1]: one per row, the same on every column shard
    }
    block_size_params = ()  # no block size for the planner to shrink (a Blocked(b) field would be named here)

    def check_shape(self, shape):  # shape rules only: the planner asks before any weight exists
        super().check_shape(shape)
        if shape[1] % 4:
            raise ValueError(f"{self} packs 4 values per byte: in_features must be a multiple of 4, got {shape[1]}")

    def quantize(self, weight, reduce):
        # mean |w| per row = (sum over the row) / in_features; a column-sharded row sums across shards
        total = reduce(block_reduce(weight.abs(), 1, None, "sum"), "sum", "scale")
        scale = (total / reduce.full_shape[1]).clamp(min=1e-8).to(weight.dtype)
        codes = (weight.float() / scale.float()).round().clamp(-1, 1).to(torch.uint8) + 1  # 0, 1, 2
        packed = codes[:, 0::4] | codes[:, 1::4] << 2 | codes[:, 2::4] << 4 | codes[:, 3::4] << 6
        return {"qdata": packed, "scale": scale}

    def dequantize(self, inner, dtype):
        packed = inner["qdata"]
        codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)
        return ((codes.float() - 1) * inner["scale"].float()).to(dtype)

    def __str__(self) -> str:
        return "Ternary()"


if __name__ == "__main__":
    from dtensor_quant.testing import check_format

    print(check_format(Ternary(), world_size=2))
