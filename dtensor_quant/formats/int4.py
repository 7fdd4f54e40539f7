"""Int4Groupwise: asymmetric 4-bit with a scale and a zero point per group of inputs.

Layout: ``qdata`` uint8 ``[out, in/2]`` holds two 4-bit codes per byte along
``in`` (even index in the low nibble); ``scale`` and ``zero`` ``[out,
ceil(in/group_size)]`` (the weight's dtype) hold one value per group along
``in``. Column shards must therefore start on a group boundary.

Math (torch's int4 convention, zero point in the float domain)::

    w ~= (q - 8) * scale + zero,   q in [0, 15]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks import block_reduce, expand_blocks, nibbles_into
from ..format import QuantFormat, Reducer
from ..layout import Blocked, OneToOne, Packed

_CODES_MINUS_8 = tuple(float(c - 8) for c in range(16))


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


@dataclass(frozen=True)
class Int4Groupwise(QuantFormat):
    group_size: int = 128

    def __post_init__(self):
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"Int4Groupwise needs an even group_size >= 2, got {self.group_size}")

    @property
    def layout(self):
        return {
            "qdata": (OneToOne(), Packed(2)),
            "scale": (OneToOne(), Blocked(self.group_size)),
            "zero": (OneToOne(), Blocked(self.group_size)),
        }

    def check_weight(self, shape, dtype):
        super().check_weight(shape, dtype)
        if shape[1] % 2:
            raise ValueError(f"{self} packs two values per byte along dim 1, which must be even; got {tuple(shape)}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        g, n_in = self.group_size, weight.shape[1]
        lo = reduce(block_reduce(weight, 1, g, "min"), "min", "scale")
        hi = reduce(block_reduce(weight, 1, g, "max"), "max", "scale")
        scale = ((hi - lo).clamp(min=1e-6) / 15).to(weight.dtype)
        zero = (lo + scale.float() * 8).to(weight.dtype)
        lo_q = zero.float() - scale.float() * 8
        w = weight.float()
        q = ((w - expand_blocks(lo_q, 1, g, n_in)) / expand_blocks(scale.float(), 1, g, n_in)).round().clamp(0, 15)
        q = q.to(torch.uint8)
        return {"qdata": q[:, ::2] | (q[:, 1::2] << 4), "scale": scale, "zero": zero}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed = inner["qdata"]
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
        return ((q - 8) * inner["scale"].float() + inner["zero"].float()).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """``q - 8`` by table lookup (one per byte) in fp32, then the group's scale and zero, as ``dequantize``."""
        rows = out.shape[0]
        values = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        nibbles_into(inner["qdata"], _CODES_MINUS_8, values, high_first=False)
        grouped = values.view(rows, -1, self.group_size)
        grouped.mul_(inner["scale"].float().unsqueeze(-1)).add_(inner["zero"].float().unsqueeze(-1))
        if values is not out:
            out.copy_(values)
        return True

    def prepare(self, inner):
        """Repack for torch's int4 mm on this device where its shape rules allow it, else None.

        CPU: ``aten._convert_weight_to_int4pack_for_cpu`` (int32 codes, out % 16 == 0).
        CUDA (untested here: no GPU in CI): ``aten._convert_weight_to_int4pack``, which wants
        the even code in the high nibble, out % 8 == 0 and in % (16 * inner_k_tiles) == 0.
        Both take the same ``[groups, out, 2]`` scale/zero tensor: torch's convention is ours.
        """
        qdata = inner["qdata"]
        n_out, n_in = qdata.shape[0], qdata.shape[1] * 2
        if not n_out or n_in % self.group_size:
            return None
        scale_zeros = torch.stack([inner["scale"], inner["zero"]], dim=-1).transpose(0, 1).contiguous()
        if qdata.device.type == "cpu":
            if n_out % 16 or n_in % 32:
                return None
            codes = torch.stack([qdata & 0xF, qdata >> 4], dim=-1).flatten(-2).to(torch.int32)
            return "cpu", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2), scale_zeros
        tiles = next((t for t in (8, 4, 2) if n_in % (16 * t) == 0), None)
        if (
            qdata.device.type != "cuda"
            or not _has_kernel("aten::_weight_int4pack_mm", "CUDA")
            or self.group_size not in (32, 64, 128, 256)
            or n_out % 8
            or tiles is None
        ):
            return None
        high_first = ((qdata & 0xF) << 4) | (qdata >> 4)
        return "cuda", torch.ops.aten._convert_weight_to_int4pack(high_first.contiguous(), tiles), scale_zeros

    def linear(self, x, prepared, bias):
        """torch's int4 weight-only mm, bf16 activations: ``_weight_int4pack_mm_for_cpu`` (CUDA: ``_weight_int4pack_mm``).

        fp32/fp16 activations dequantize instead: torch 2.13's CPU kernel is vectorized for
        bf16 only (on an AVX2 CPU it runs 10-30x slower in fp32 than in bf16).
        """
        if prepared is None or x.dtype != torch.bfloat16:
            return None
        device, packed, scale_zeros = prepared
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu if device == "cpu" else torch.ops.aten._weight_int4pack_mm
        out = mm(x.contiguous(), packed, self.group_size, scale_zeros.to(x.dtype))
        return out + bias if bias is not None else out

    def __str__(self) -> str:
        return f"Int4Groupwise(group_size={self.group_size})"
