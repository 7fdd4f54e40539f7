"""Int4Groupwise: asymmetric 4-bit with a scale and a zero point per group of inputs.

Layout: ``qdata`` uint8 ``[out, in/2]`` holds two 4-bit codes per byte along
``in`` (even index in the low nibble); ``scale`` and ``zero`` ``[out,
ceil(in/group_size)]`` (the weight's dtype, or ``scale_dtype``) hold one value
per group along ``in``. Column shards must therefore start on a group boundary.

Math (torch's int4 convention, zero point in the float domain)::

    w ~= (q - 8) * scale + zero,   q in [0, 15]

computed in float32 and rounded once to the output dtype. With
``scale_dtype`` (a checkpoint's fp16 or bf16 scales in a model of another
dtype: GPTQ and AWQ store fp16, compressed-tensors bf16) the value is rounded
to ``scale_dtype`` first and then converted, which is what those producers
compute (``(q - 8) * scale`` in the scale's dtype): a symmetric checkpoint's
codes and scales, with ``zero = 0``, dequantize bit for bit as its producer
does. The codes are compressed-tensors' ``weight_packed`` bytes as stored
(int32 words, element ``i`` at bits ``4i``, stored ``q + 8``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import native
from .._core.format import QuantFormat, Reducer, compact_repr, dtype_param, int_params, unpack_through
from .._core.layout import Blocked, OneToOne, Packed
from .._core.producers import COMPRESSED_TENSORS, CT_BASE_ARGS, Holds, ProducerLayout, StoredAs, scales_in_model_dtype
from .._core.reductions import block_reduce, expand_blocks, finite_or_nan, largest_finite, nibbles_into

_CODES_MINUS_8 = tuple(float(c - 8) for c in range(16))


# torch's int4 mm kernels (CPU and CUDA) take only these; other group sizes dequantize.
_KERNEL_GROUP_SIZES = (32, 64, 128, 256)


def _fit_range(scale, zero, lo, hi, dtype, out_dtype):
    """Step ``scale`` down (and ``zero`` with it) where code 0 or 15 would dequantize to Inf in ``dtype``.

    Dequantize computes ``(q - 8) * scale + zero`` in float32, rounds it to
    ``dtype`` then to the weight's ``out_dtype``; a group whose range touches
    their maximum can round one ulp past it. Groups with
    NaN stay as they are (they dequantize to NaN).
    """
    finite = lo.isfinite() & hi.isfinite()
    # (q - 8) * scale must not overflow float32 itself: a group wider than 15/8 of float32's maximum
    # (bf16/fp32 values of both signs near 3.4e38) gets the widest scale that fits and clips its top.
    cap = torch.tensor(torch.finfo(torch.float32).max / 8, dtype=torch.float64).to(dtype)
    if not torch.isfinite(cap.float() * 8):
        cap = torch.nextafter(cap, torch.zeros_like(cap))
    wide = finite & (scale > cap)
    scale = torch.where(wide, cap, scale)
    zero = torch.where(wide, (lo + scale.to(lo.dtype) * 8).to(dtype), zero)
    for _ in range(8):
        s, z = scale.float(), zero.float()
        ends = torch.stack([(7 * s + z).to(dtype).to(out_dtype), (-8 * s + z).to(dtype).to(out_dtype)])
        bad = finite & ~ends.isfinite().all(0)
        if not bool(bad.any()):
            break
        scale = torch.where(bad, torch.nextafter(scale, torch.zeros_like(scale)), scale)
        zero = torch.where(bad, (lo + scale.to(lo.dtype) * 8).to(dtype), zero)
    return scale, zero


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


@dataclass(frozen=True)
class Int4Groupwise(QuantFormat):
    group_size: int = 128
    #: The dtype of ``scale`` and ``zero`` (None: the weight's); see the module docstring.
    scale_dtype: torch.dtype | None = None

    block_size_params = ("group_size",)

    producer_notes = {COMPRESSED_TENSORS: "Int4Groupwise with zero points 0"}
    #: compressed-tensors' symmetric int4 groups: stored q + 8, no zero point, so ``(q - 8) * scale``.
    producer_holds = (
        Holds(COMPRESSED_TENSORS, ("pack-quantized",), (("num_bits", 4), ("type", "int"), ("strategy", "group"),
              ("symmetric", True)), ("group_size", "scale_dtype")),
    )  # fmt: skip

    def producer_layout(self, producer, dtype):
        """compressed-tensors: int4, symmetric groups (``pack-quantized``): the codes in int32 words, the scales in
        the model's dtype, no zero point (a weight whose zero points are not all 0 is refused when written)."""
        if producer != COMPRESSED_TENSORS:
            return None
        sd = self.scale_dtype or dtype
        args = dict(CT_BASE_ARGS, num_bits=4, type="int", strategy="group", group_size=self.group_size)
        zero = StoredAs("fill", "", sd, (("value", 0.0),), refusal="has nonzero zero points; compressed-tensors' "
                        "symmetric int4 has none (Int4GroupwiseIntZero writes integer zero points)")  # fmt: skip
        inner = (("qdata", StoredAs("words", "{key}_packed", torch.int32)),
                 ("scale", StoredAs("same", "{key}_scale", sd)), ("zero", zero))  # fmt: skip
        layout = ProducerLayout(producer, "pack-quantized", args, inner, records=("weight_shape",))
        return scales_in_model_dtype(sd, dtype) or layout

    def __post_init__(self):
        int_params(self)
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"Int4Groupwise needs an even group_size >= 2, got {self.group_size}")
        dtype_param(self, "scale_dtype")

    __repr__ = compact_repr

    @property
    def layout(self):
        return {
            "qdata": (OneToOne(), Packed(2)),
            "scale": (OneToOne(), Blocked(self.group_size)),
            "zero": (OneToOne(), Blocked(self.group_size)),
        }

    def check_shape(self, shape):
        super().check_shape(shape)
        if shape[1] % 2:
            raise ValueError(f"{self} packs two values per byte along dim 1, which must be even; got {tuple(shape)}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        g, n_in, dtype = self.group_size, weight.shape[1], self.scale_dtype or weight.dtype
        stat = finite_or_nan(weight)  # an Inf does not set its group's range: it saturates to code 0 or 15
        lo = reduce(block_reduce(stat, 1, g, "min"), "min", "scale")
        hi = reduce(block_reduce(stat, 1, g, "max"), "max", "scale")
        # weights beyond what the scale dtype can give back in the weight's dtype (fp16 scales of larger
        # weights) saturate there; within both ranges this changes nothing
        limit = largest_finite(dtype, weight.dtype)
        lo, hi = lo.clamp(min=-limit), hi.clamp(max=limit)
        finite = lo.isfinite() & hi.isfinite()
        scale = ((hi - lo).clamp(min=1e-6) / 15).to(dtype)
        zero = (lo + scale.float() * 8).to(dtype)
        # A group whose range overflows float32 (bf16/fp32 values near +-3.4e38) is computed in
        # float64, that group only; every other group keeps the float32 math bit for bit.
        wide = (hi - lo).isinf() & finite
        any_wide = not weight.is_meta and bool(wide.any())
        if any_wide:
            lo64, hi64 = lo.double(), hi.double()
            scale = torch.where(wide, ((hi64 - lo64) / 15).to(dtype), scale)
            zero = torch.where(wide, (lo64 + scale.double() * 8).to(dtype), zero)
        if not weight.is_meta:
            scale, zero = _fit_range(scale, zero, lo.double(), hi.double(), dtype, weight.dtype)
        lo_q = zero.float() - scale.float() * 8
        w = weight.float()
        q = ((w - expand_blocks(lo_q, 1, g, n_in)) / expand_blocks(scale.float(), 1, g, n_in)).round().clamp(0, 15)
        if any_wide:
            rows = wide.any(1).nonzero().squeeze(1)
            s64, lo_q64 = scale[rows].double(), zero[rows].double() - scale[rows].double() * 8
            q64 = (weight[rows].double() - expand_blocks(lo_q64, 1, g, n_in)) / expand_blocks(s64, 1, g, n_in)
            q[rows] = torch.where(expand_blocks(wide[rows], 1, g, n_in), q64.round().clamp(0, 15).float(), q[rows])
        q = q.to(torch.uint8)
        return {"qdata": q[:, ::2] | (q[:, 1::2] << 4), "scale": scale, "zero": zero}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed = inner["qdata"]
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
        values = (q - 8) * inner["scale"].float() + inner["zero"].float()
        return (values.to(self.scale_dtype) if self.scale_dtype else values).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """``q - 8`` by table lookup (one per byte) in fp32, then the group's scale and zero, as ``dequantize``."""
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        rows = out.shape[0]
        values = (
            out
            if out.dtype == torch.float32 and out.is_contiguous()
            else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        )
        nibbles_into(inner["qdata"], _CODES_MINUS_8, values, high_first=False)
        grouped = values.view(rows, -1, self.group_size)
        grouped.mul_(inner["scale"].float().unsqueeze(-1)).add_(inner["zero"].float().unsqueeze(-1))
        if values is not out:
            out.copy_(values)
        return True

    def prepare(self, inner):
        """``(torch's int4 mm, the tiled kernel)``: each one's inputs, built by the first call that runs it.

        :meth:`linear` runs torch's kernel for a few bf16 tokens (decode; any count on CUDA) and this library's
        tiled kernel (int4.cpp) for more tokens and for fp32 activations, on CPU.
        """
        return native.Lazy(functools.partial(self._torch_inputs, inner)), native.Lazy(
            functools.partial(self._tile_inputs, inner)
        )

    def _torch_inputs(self, inner):
        """Repack for torch's int4 mm on this device where its shape rules allow it, else None.

        Both kernels take group sizes 32, 64, 128 and 256 only.
        CPU: ``aten._convert_weight_to_int4pack_for_cpu`` (int32 codes, out % 16 == 0).
        CUDA (untested here: no GPU in CI): ``aten._convert_weight_to_int4pack``, which wants
        the even code in the high nibble, out % 8 == 0 and in % (16 * inner_k_tiles) == 0.
        Both take the same ``[groups, out, 2]`` scale/zero tensor: torch's convention is ours.
        """
        qdata = inner["qdata"]
        n_out, n_in = qdata.shape[0], qdata.shape[1] * 2
        if not n_out or n_in % self.group_size or self.group_size not in _KERNEL_GROUP_SIZES:
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
            or n_out % 8
            or tiles is None
        ):
            return None
        high_first = ((qdata & 0xF) << 4) | (qdata >> 4)
        return "cuda", torch.ops.aten._convert_weight_to_int4pack(high_first.contiguous(), tiles), scale_zeros

    def _tile_inputs(self, inner):
        """``(codes, scales and zeros in fp32)`` for the tiled kernel (int4.cpp), or None where it cannot run:
        ``in`` and the group size multiples of 32 and whole groups, on an x86 CPU where it was built."""
        qdata, g = inner["qdata"], self.group_size
        n_in = qdata.shape[-1] * 2
        if qdata.device.type != "cpu" or qdata.ndim != 2 or n_in % 32 or g % 32 or n_in % g or kernel() is None:
            return None
        fp32 = [inner[name].float().contiguous() for name in ("scale", "zero")]
        if any(tuple(t.shape) != (qdata.shape[0], n_in // g) for t in fp32):
            return None
        return (qdata.contiguous(), *fp32)

    def linear(self, x, prepared, bias):
        """bf16 activations of up to ``_TORCH_MAX_TOKENS`` rows (any on CUDA): torch's int4 weight-only mm
        (``_weight_int4pack_mm_for_cpu``; CUDA: ``_weight_int4pack_mm``); more rows, or fp32 activations: the
        tiled kernel (int4.cpp); else None (dequantize + mm).

        torch 2.13's CPU kernel is vectorized for bf16 only (in fp32 it runs several times slower than in bf16;
        docs/performance.md), and past a few tokens it runs slower than bf16's own GEMM: each token is a pass
        over the weight.
        """
        torch_inputs, tile_inputs = prepared
        tokens = x.shape[0]
        # torch's kernel rounds the scales to the activations' dtype: only right when that is scale_dtype.
        torchs_ok = self.scale_dtype in (None, x.dtype)
        if x.dtype == torch.bfloat16 and torchs_ok and (tokens <= _TORCH_MAX_TOKENS or x.device.type != "cpu"):
            if torch_inputs.get() is not None:
                device, packed, scale_zeros = torch_inputs.get()
                mm = (
                    torch.ops.aten._weight_int4pack_mm_for_cpu
                    if device == "cpu"
                    else torch.ops.aten._weight_int4pack_mm
                )
                out = mm(x.contiguous(), packed, self.group_size, scale_zeros.to(x.dtype))
                return out + bias if bias is not None else out
        # The tiles round each weight at most once, to bf16: a bf16 scale_dtype rounds there whatever the
        # activations; an fp16 one would round to fp16 first, so such a weight dequantizes.
        if self.scale_dtype not in (None, torch.float32, torch.bfloat16):
            return None
        inputs = native.inputs_for(x, tile_inputs)
        if inputs is None:
            return None
        out = tiled_linear(x, inputs, self.group_size, rounds=self.scale_dtype == torch.bfloat16)
        return out + bias if bias is not None and out is not None else out

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")


# torch's int4 kernel reads the weight once per token: it beats bf16 for a token or two, the tiles from 3 on.
_TORCH_MAX_TOKENS = 2

KERNEL = native.declare("int4", Path(__file__).with_name("int4.cpp"), native.MATMUL_PROBE | {"g": 32})


def kernel():
    """``(the tiled kernel, its best vector level here)``, built on first use; None where it cannot run.
    Levels: 1 AVX2, 2 AVX-512, 3 AVX-512 BF16, 4 AMX (the tiles only)."""
    return native.load(KERNEL)


def tiled_linear(
    x: torch.Tensor, prepared, group_size: int, max_level: int | None = None, rounds: bool = False
) -> torch.Tensor | None:
    """``x @ W.T`` in ``x``'s dtype (bf16 or fp32) through the tiled kernel from ``Int4Groupwise._tile_inputs``;
    None if refused. ``max_level`` caps the vector path (1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX, bf16 ``x`` only);
    ``rounds``: every weight is rounded to bf16 even for fp32 ``x`` (a bf16 ``scale_dtype``)."""
    codes, scale, zero = prepared
    if x.shape[1] != codes.shape[1] * 2:
        raise ValueError(f"int4 kernel: activation width {x.shape[1]} != weight width {codes.shape[1] * 2}")
    rounds = rounds or x.dtype == torch.bfloat16
    return native.matmul(
        kernel(),
        (codes, scale, zero),
        x,
        codes.shape[0],
        (group_size,),
        tiles=True,
        round_weights=rounds,
        max_level=max_level,
    )
