"""Float8Blockwise: e4m3fn values with one float32 scale per 128x128 block (DeepSeek-V3's FP8 layout).

Layout: ``qdata`` float8_e4m3fn ``[out, in]`` follows both dims one-to-one;
``scale_inv`` float32 ``[ceil(out/b), ceil(in/b)]`` is blocked by ``b`` on
both dims, so a shard boundary on either dim must fall on a block boundary.
Every statistic lies inside one block, so quantizing a legal shard needs no
collective at all.

This is the layout DeepSeek-V3, Qwen3-FP8 and others publish (safetensors
``weight`` float8_e4m3fn plus ``weight_scale_inv``, config
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128,
128]}``); ``checkpoint_suffixes`` names the two tensors so that
:mod:`dtensor_quant.hf` reads and writes them as they are.

Math: ``scale_inv = amax(block) / 448``; ``q = e4m3fn(w / scale_inv)``;
``w ~= float32(q) * scale_inv`` (exactly what torch's
``QuantizedHuggingFaceStorageReader`` computes when it dequantizes).

``Float8Blockwise(128, scale_dtype=torch.bfloat16)`` stores ``scale_inv`` in
bf16 (rounded up, so no code clips) and rounds each product to bf16 before
the output dtype: compressed-tensors' FP8 block checkpoints (``weight`` e4m3,
``weight_scale`` bf16 ``[ceil(out/128), ceil(in/128)]``, dequantized as
``q.to(bf16) * scale``). float32 is the default and normalizes to None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core import native
from .._core.format import QuantFormat, Reducer, compact_repr, dtype_param, int_params, unpack_through
from .._core.layout import Blocked, OneToOne
from .._core.producers import (
    COMPRESSED_TENSORS,
    CT_BASE_ARGS,
    FP8_BLOCKS,
    Holds,
    ProducerLayout,
    StoredAs,
    scales_in_model_dtype,
)
from .._core.reductions import block_reduce, block_stat_abs, expand_blocks, safe_scale
from .float8 import codes_into, kernel_linear, kernel_prepare, table_fits

_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass(frozen=True)
class Float8Blockwise(QuantFormat):
    block_size: int = 128
    #: The dtype of ``scale_inv``: None (float32, DeepSeek-V3's), bfloat16 or float16; see the module docstring.
    scale_dtype: torch.dtype | None = None

    block_size_params = ("block_size",)

    producer_notes = {COMPRESSED_TENSORS: "Float8Blockwise"}
    #: compressed-tensors' fp8 square blocks, and DeepSeek-V3's (``quant_method: fp8``, ``weight_block_size``);
    #: the scales in the dtype the file holds them in.
    producer_holds = (
        Holds(COMPRESSED_TENSORS, ("float-quantized", "naive-quantized"), (("num_bits", 8), ("type", "float"),
              ("strategy", "block"), ("symmetric", True)), ("block_size", "scale_dtype")),
        Holds(FP8_BLOCKS, ("block",), (), ("block_size", "scale_dtype")),
    )  # fmt: skip

    def producer_layout(self, producer, dtype):
        """compressed-tensors: fp8 e4m3, square blocks (``float-quantized``); the scales (float32 by default) in the
        model's dtype. DeepSeek's fp8: the codes as ``weight``, the scales as ``weight_scale_inv``, as they are."""
        if producer == FP8_BLOCKS:
            sd = self.scale_dtype or torch.float32
            inner = (("qdata", StoredAs("same", "{key}", torch.float8_e4m3fn)),
                     ("scale_inv", StoredAs("same", "{key}_scale_inv", sd)))  # fmt: skip
            return ProducerLayout(producer, "block", {"weight_block_size": [self.block_size] * 2}, inner)
        if producer != COMPRESSED_TENSORS:
            return None
        sd, b = self.scale_dtype or torch.float32, self.block_size
        args = dict(CT_BASE_ARGS, num_bits=8, type="float", strategy="block", block_structure=[b, b])
        inner = (("qdata", StoredAs("same", "{key}", torch.float8_e4m3fn)),
                 ("scale_inv", StoredAs("same", "{key}_scale", sd)))  # fmt: skip
        return scales_in_model_dtype(sd, dtype) or ProducerLayout(producer, "float-quantized", args, inner)

    def __post_init__(self):
        int_params(self)
        if self.block_size < 1:
            raise ValueError(f"Float8Blockwise needs block_size >= 1, got {self.block_size}")
        dtype_param(self, "scale_dtype")
        if self.scale_dtype == torch.float32:
            object.__setattr__(self, "scale_dtype", None)  # the default: one format, one identity

    __repr__ = compact_repr

    @property
    def layout(self):
        b = self.block_size
        return {"qdata": (OneToOne(), OneToOne()), "scale_inv": (Blocked(b), Blocked(b))}

    @property
    def checkpoint_suffixes(self) -> dict[str, str]:
        """Hugging Face key of each inner tensor, appended to the weight's key."""
        return {"qdata": "", "scale_inv": "_scale_inv"}

    @property
    def hf_quantization_config(self) -> dict:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [self.block_size] * 2}

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        b = self.block_size
        stat = block_stat_abs(weight, keep_nan=False)  # finite values only: e4m3fn codes a NaN in its element
        amax = reduce(block_reduce(block_reduce(stat, 1, b, "max"), 0, b, "max"), "max", "scale_inv")
        if self.scale_dtype is None:
            scale = (amax / _E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        else:
            scale = safe_scale(amax, _E4M3_MAX, self.scale_dtype, weight.dtype)
        full = expand_blocks(expand_blocks(scale.float(), 0, b, weight.shape[0]), 1, b, weight.shape[1])
        q = (weight.float() / full).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        return {"qdata": q, "scale_inv": scale}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        values = inner["qdata"].to(torch.float32) * inner["scale_inv"].float()
        return (values.to(self.scale_dtype) if self.scale_dtype else values).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """``dequantize``'s bits: the codes by table lookup into float32, one multiply per block.

        Column blocks are whole (unpack's contract); the last row block may be partial.
        """
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        qdata, scale, b = inner["qdata"], inner["scale_inv"], self.block_size
        rows, cols = out.shape
        if cols % b or scale.dtype != (self.scale_dtype or torch.float32):
            return False
        if tuple(scale.shape) != (-(-rows // b), cols // b):
            return False
        scale = scale.float()  # exact; the product of an e4m3 code and a bf16/fp16 scale is exact in fp32 too
        fits = out.dtype == torch.float32 and table_fits(out)
        values = out if fits else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        if not table_fits(values):
            return False
        codes_into(qdata, values)
        whole = rows // b
        values[: whole * b].view(whole, b, cols // b, b).mul_(scale[:whole, None, :, None])
        if rows % b:
            values[whole * b :].view(rows - whole * b, cols // b, b).mul_(scale[whole, None, :, None])
        if not fits:
            out.copy_(values)
        return True

    def prepare(self, inner):
        """float8's kernels with a scale per row and block of columns, their inputs built on first use.

        The product ``float32(code) * scale_inv`` rounds to fp32 and then to the activation's dtype, as in
        ``dequantize``. Shards start on block boundaries, so row ``r`` of a shard has scale row ``r // b``.
        """
        return native.Lazy(lambda: self._kernel_inputs(inner))

    def _kernel_inputs(self, inner):
        scale, b = inner["scale_inv"], self.block_size
        if inner["qdata"].ndim != 2:
            return None
        rows, cols = inner["qdata"].shape
        if scale.dtype != (self.scale_dtype or torch.float32) or cols % b or scale.shape[0] != -(-rows // b):
            return None
        return kernel_prepare(inner["qdata"], scale.float().repeat_interleave(b, 0)[:rows], b)

    def linear(self, x, prepared, bias):
        """bf16 or fp32 activations, up to ``native.TILES_MAX_TOKENS`` rows: the kernels; else None.

        The kernels round each weight at most once, to bf16: a bf16 ``scale_dtype`` rounds there whatever the
        activations; an fp16 one would round to fp16 first, so such a weight dequantizes instead.
        """
        return kernel_linear(x, prepared, bias, self.scale_dtype)

    def __str__(self) -> str:
        dtype = f", scale_dtype={str(self.scale_dtype).removeprefix('torch.')}" if self.scale_dtype else ""
        return f"Float8Blockwise({self.block_size}{dtype})"
