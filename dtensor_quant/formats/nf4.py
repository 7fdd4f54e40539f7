"""NF4: QLoRA's 4-bit NormalFloat with double-quantized block scales.

The algorithm is the reference one (QLoRA paper, bitsandbytes, torchao's
NF4Tensor, with torchao's dtype flow). The 16 levels are the paper's values;
torchao rounds them to 4 decimals, which in bf16 moves a few levels by one
ulp, so codes agree except within ~1e-4 of a decision boundary:

* every ``block_size`` consecutive weights of a row share a scale, their
  absolute maximum; each weight becomes the index of the nearest of the 16
  NF4 levels of ``w / scale`` (two codes per byte, first in the high nibble);
* the scales are centred by their global mean, and every
  ``scaler_block_size`` consecutive scales (row-major) share a factor
  ``128 / absmax``; the centred scales are stored as ``round(scale * factor)``
  in int8.

Layout of a ``[out, in]`` weight (``in % block_size == 0``; ``b`` blocks per row):

* ``qdata``  uint8 ``[out, in/2]``: one-to-one on rows, packed by 2 on columns;
* ``scaler`` int8 ``[out, b]``: one-to-one on rows, blocked by ``block_size``;
* ``factor`` ``[ceil(out/r), 1]`` when a scaler block spans ``r = scaler_block_size/b``
  whole rows (blocked by ``r`` on rows, constant on columns), or ``[out,
  b/scaler_block_size]`` when a row holds several (blocked by
  ``block_size*scaler_block_size`` on columns);
* ``mean``   ``[1, 1]``: constant.

So row shards must hold whole scaler blocks and column shards whole blocks;
quantizing a column-sharded weight all-reduces the factor statistics and the
mean, which is why the mean is summed in float64 (the same value whatever the
sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks import block_reduce, expand_blocks, nibbles_into
from ..format import QuantFormat, Reducer
from ..layout import Blocked, Constant, OneToOne, Packed

NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class NF4(QuantFormat):
    block_size: int = 64
    scaler_block_size: int = 256

    inner_names = ("qdata", "scaler", "factor", "mean")

    def __post_init__(self):
        if self.block_size < 2 or self.block_size % 2 or self.scaler_block_size < 1:
            raise ValueError(f"NF4 needs an even block_size >= 2 and scaler_block_size >= 1, got {self}")

    def _scaler_rows(self, n_in: int) -> int | None:
        """Rows per scaler block when one spans whole rows, None when a row holds several."""
        per_row = n_in // self.block_size
        return self.scaler_block_size // per_row if self.scaler_block_size % per_row == 0 else None

    def check_weight(self, shape, dtype):
        super().check_weight(shape, dtype)
        n_in = shape[1]
        if n_in % self.block_size:
            raise ValueError(f"{self}: in_features {n_in} must be a multiple of block_size {self.block_size}")
        per_row = n_in // self.block_size
        if self.scaler_block_size % per_row and per_row % self.scaler_block_size:
            raise ValueError(
                f"{self}: a weight with {per_row} blocks per row ({n_in} / {self.block_size}) cannot keep "
                f"scaler blocks of {self.scaler_block_size} aligned with its rows; one must divide the other"
            )

    def layout_for(self, shape):
        self.check_weight(torch.Size(shape), torch.bfloat16)
        rows = self._scaler_rows(shape[1])
        factor = (Blocked(rows), Constant()) if rows else (OneToOne(), Blocked(self.block_size * self.scaler_block_size))
        return {
            "qdata": (OneToOne(), Packed(2)),
            "scaler": (OneToOne(), Blocked(self.block_size)),
            "factor": factor,
            "mean": (Constant(), Constant()),
        }

    @property
    def layout(self):
        raise ValueError(f"{self}'s layout depends on the weight's shape: use layout_for(shape)")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        dtype, n_in = weight.dtype, weight.shape[1]
        absmax = block_reduce(weight.abs(), 1, self.block_size, "max").to(dtype)
        stats = torch.stack([absmax.double().sum(), absmax.new_tensor(absmax.numel(), dtype=torch.float64)])
        total, count = reduce(stats.reshape(1, 1, 2), "sum", "mean").reshape(2)
        mean = (total / count).to(dtype).reshape(1, 1)
        centred = absmax - mean
        rows = self._scaler_rows(reduce.full_shape[1])
        if rows:
            spread = block_reduce(block_reduce(centred.abs(), 0, rows, "max"), 1, None, "max")
        else:
            spread = block_reduce(centred.abs(), 1, self.scaler_block_size, "max")
        factor = (256 / (2 * reduce(spread, "max", "factor").to(dtype))).to(dtype)
        scaler = (centred * self._expand_factor(factor, centred.shape, rows)).round().clamp(-128, 127)
        codes = self._nearest(weight / expand_blocks(absmax, 1, self.block_size, n_in))
        return {
            "qdata": (codes[:, ::2] << 4) | codes[:, 1::2],
            "scaler": scaler.to(torch.int8),
            "factor": factor,
            "mean": mean,
        }

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        mean = inner["mean"]
        scale = (inner["scaler"] / inner["factor"]).to(mean.dtype) + mean
        qdata = inner["qdata"]
        codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).flatten(-2).long()
        levels = torch.tensor(NF4_LEVELS, dtype=mean.dtype, device=qdata.device)
        return (levels[codes] * scale).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """Levels by table lookup (one per byte), times each block's scale, computed on the block grid."""
        mean, scaler, factor = inner["mean"], inner["scaler"], inner["factor"]
        rows, cols = out.shape
        per_row = self._scaler_rows(cols)
        if per_row:
            factor = factor.repeat_interleave(per_row, 0).narrow(0, 0, rows)
        else:
            factor = factor.repeat_interleave(self.scaler_block_size, 1).narrow(1, 0, scaler.shape[1])
        scale = ((scaler / factor).to(mean.dtype) + mean).unsqueeze(-1)  # [rows, blocks, 1]
        values = out if out.dtype == mean.dtype and out.is_contiguous() else torch.empty(out.shape, dtype=mean.dtype, device=out.device)
        nibbles_into(inner["qdata"], NF4_LEVELS, values, high_first=True)
        values.view(rows, -1, self.block_size).mul_(scale)
        if values is not out:
            out.copy_(values)
        return True

    def _expand_factor(self, factor: torch.Tensor, shape, rows: int | None) -> torch.Tensor:
        """The factor of each block scale (quantize works on the small ``[out, blocks]`` grid)."""
        if rows:
            return expand_blocks(factor, 0, rows, shape[0]).expand(shape)
        return expand_blocks(factor, 1, self.scaler_block_size, shape[1])

    @staticmethod
    def _nearest(normalized: torch.Tensor) -> torch.Tensor:
        levels = torch.tensor(NF4_LEVELS, dtype=normalized.dtype, device=normalized.device)
        return (normalized.unsqueeze(-1) - levels).abs().min(dim=-1).indices.to(torch.uint8)

    def __str__(self) -> str:
        return f"NF4(block_size={self.block_size}, scaler_block_size={self.scaler_block_size})"
