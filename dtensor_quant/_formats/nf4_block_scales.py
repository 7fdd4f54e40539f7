"""NF4BlockScales: NF4 codes with one plain scale per block -- no double quantization.

Two uses, one layout:

* bitsandbytes' NF4 *without* double quantization (``quantize_4bit(...,
  compress_statistics=False)``, transformers' ``BitsAndBytesConfig(
  bnb_4bit_use_double_quant=False)``): one float32 absolute maximum per
  block of ``block_size`` values of the flat weight, ``levels="bitsandbytes"``.
* The exact expansion of a double-quantized weight (:class:`~dtensor_quant.NF4`,
  :class:`~dtensor_quant.BnbNF4`): each block's scale as their dequantize
  computes it, stored as is (``NF4.expanded_format`` / ``expand_inner``;
  :func:`dtensor_quant.expand_scales` on a tensor). Every weight dequantizes to
  the same bits. What it changes is sharding: the double-quantized formats
  share a second-level scale over ``block_size * 256`` consecutive weights
  (16,384 by default), which a tensor-parallel cut must not split; here only
  the ``block_size`` blocks remain, so any cut on a block boundary is legal
  (Qwen2.5-0.5B's 896-wide attention at TP 2). vLLM does the same when it
  loads a double-quantized bitsandbytes checkpoint (``_dequantize_dq``).
  The cost: scales of 16 (bf16 NF4) or 32 (BnbNF4) bits per block instead of
  8, i.e. 4.25 or 4.5 bits per weight instead of about 4.13.

``levels`` picks the arithmetic, the two producers' (bit for bit):

* ``"bitsandbytes"``: the paper's float32 levels; ``scale`` float32;
  ``w = output_dtype(level * scale)`` computed in float32 (BnbNF4's).
* ``"torchao"``: torchao's levels (4 decimals) in the scale's dtype; ``scale``
  in the weight's dtype; ``w = output_dtype(level * scale)`` computed in that
  dtype (NF4's: its block scale ``scaler / factor + mean``, rounded and
  clamped as NF4 does, is what is stored).

Quantize stores each block's absolute maximum (``"bitsandbytes"``: in
float32, the codes as :class:`~dtensor_quant.BnbNF4` picks them, equal to
bitsandbytes'; ``"torchao"``: in the weight's dtype, codes as NF4 picks
them). An all-zero block dequantizes to zeros; a NaN poisons its own block
only; an Inf saturates to +-(its block's scale), which its finite values set.

Layout (:func:`~dtensor_quant._core.layout.flat_blocked`): ``qdata`` uint8
packs 2 codes per byte over the flat index (the first in the high nibble),
``scale`` blocks ``block_size`` weights of the flat index. A bitsandbytes
checkpoint stores them as ``weight`` (uint8 ``[numel/2, 1]``) and ``absmax``
(float32 ``[numel/block_size]``), in this order.

Kernels: NF4's (the one-token kernel for one bf16 token, the tiles for more
tokens and for fp32 activations), fed the stored scales and the levels in
float32, so each weight they use is ``dequantize``'s value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._core import native
from .._core.format import FlatBlockedFormat, QuantFormat, Reducer, expansion_of, int_params
from .._core.layout import flat_blocked
from .._core.producers import BITSANDBYTES, Holds, ProducerLayout, StoredAs
from .._core.reductions import block_stat_abs, expand_to, nibbles_into, reduce_to
from .bnb_nf4 import NF4_LEVELS_F32, BnbNF4, nf4_codes
from .nf4 import NF4, NF4_LEVELS, flat_kernel_inputs, kernel_linear, nearest_codes

LEVELS = {"bitsandbytes": NF4_LEVELS_F32, "torchao": NF4_LEVELS}


@dataclass(frozen=True)
class NF4BlockScales(FlatBlockedFormat):
    block_size: int = 64
    levels: str = "bitsandbytes"

    inner_names = ("qdata", "scale")
    block_size_params = ("block_size",)
    #: bitsandbytes NF4 without double quantization: float32 ``absmax`` per block, bitsandbytes' levels.
    producer_holds = (
        Holds(BITSANDBYTES, ("nf4",), (("double_quant", False),), ("block_size",), (("levels", "bitsandbytes"),)),
    )

    def producer_layout(self, producer, dtype):
        """bitsandbytes (``levels="bitsandbytes"``): ``weight`` uint8 ``[n/2, 1]`` (the codes over the flat weight,
        first in the high nibble) and ``.absmax`` float32, row-major, as they are; its ``.quant_map`` holds the
        levels this format computes with."""
        if producer != BITSANDBYTES or self.levels != "bitsandbytes":
            return None
        inner = (("qdata", StoredAs("flat", "{key}", torch.uint8, (("trailing", (1,)),))),
                 ("scale", StoredAs("flat", "{key}.absmax", torch.float32)))  # fmt: skip
        constants = (("{key}.quant_map", torch.tensor(NF4_LEVELS_F32, dtype=torch.float32)),)
        return ProducerLayout(producer, "nf4", {"blocksize": self.block_size}, inner, constants=constants)

    def __post_init__(self):
        int_params(self)
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"NF4BlockScales needs an even block_size >= 2, got {self.block_size}")
        if self.levels not in LEVELS:
            raise ValueError(f"NF4BlockScales: levels must be one of {sorted(LEVELS)}, got {self.levels!r}")

    def layout_for(self, shape):
        self.check_shape(torch.Size(shape))
        return {"qdata": flat_blocked(2, shape, packed=True), "scale": flat_blocked(self.block_size, shape)}

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        shape, layout = weight.shape, self.layout_for(reduce.full_shape)
        # each block's maximum (over every shard holding part of it, where a block of whole rows spans a column cut)
        absmax = reduce(reduce_to(block_stat_abs(weight), layout["scale"], "max"), "max", "scale")
        if self.levels == "bitsandbytes":
            scale = absmax  # float32, as bitsandbytes' absmax
            pairs = nf4_codes(weight, scale, layout, shape)
        else:
            scale = absmax.to(weight.dtype)
            scales = expand_to(scale, layout["scale"], shape)
            normalized = torch.where(scales == 0, 0, weight / scales).clamp(-1, 1)  # a zero block: 0; Inf: +-1
            codes = nearest_codes(normalized)
            pairs = codes.reshape(*(r.inner_len(n) for r, n in zip(layout["qdata"], shape)), 2)
        return {"qdata": (pairs[..., 0] << 4) | pairs[..., 1], "scale": scale}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        scale, qdata = inner["scale"], inner["qdata"]
        codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).long().flatten(-2)
        if any(c != s and s != 1 for c, s in zip(codes.shape[-2:], scale.shape[-2:])):
            # codes packed across rows (odd widths; the scales then vary per element): in flat order
            codes = codes.reshape(*codes.shape[:-2], *scale.shape[-2:])
        levels = torch.tensor(LEVELS[self.levels], dtype=scale.dtype, device=qdata.device)
        return (levels[codes] * scale).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """On the flat index: levels by table lookup (one per byte) in the scale's dtype, times each block's scale."""
        scale = self.block_scales(inner, out.numel())
        if scale is None:
            return False
        fits = out.dtype == scale.dtype and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=scale.dtype, device=out.device)
        nibbles_into(inner["qdata"], LEVELS[self.levels], values, high_first=True)
        values.view(-1, self.block_size).mul_(scale.unsqueeze(-1))
        if not fits:
            out.copy_(values)
        return True

    def block_scales(self, inner: dict[str, torch.Tensor], numel: int) -> torch.Tensor | None:
        """Each block's scale in flat order; None unless the blocks are whole."""
        scale = inner["scale"].reshape(-1)
        if numel % self.block_size or scale.numel() != numel // self.block_size or inner["qdata"].numel() * 2 != numel:
            return None
        return scale

    def inner_expanded_from(self, fmt: QuantFormat, inner: dict[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
        """The inner tensors for a fresh ``[out, in]`` weight of NF4 or BnbNF4 ``fmt``: the same codes, and each
        block's scale as ``fmt.block_scales`` (the math of its dequantize) computes it."""
        scale = fmt.block_scales(inner, shape[0] * shape[1])
        assert scale is not None, "inner_expanded_from takes a whole weight laid out as a fresh one"
        rels = self.layout_for(shape)["scale"]
        return {"qdata": inner["qdata"], "scale": scale.reshape(*(r.inner_len(n) for r, n in zip(rels, shape)))}

    kernel_needs_whole_blocks = True

    def prepare(self, inner):
        """The kernels' inputs, built by the first call that runs one (:class:`~dtensor_quant._core.native.Lazy`)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes, block scales in float32, levels in float32, rounds)`` for NF4's kernels, or None.

        ``rounds``: a bf16 scale (``levels="torchao"`` of a bf16 weight) rounds
        every weight to bf16 whatever the activations. Needs blocks inside each
        row (``in % block_size == 0``, ``block_size % 32 == 0``; the library
        checks the rest: ``kernel_needs_whole_blocks``), no fp16 scale (dequantize
        rounds each product to fp16 first) and an x86 CPU with AVX2 or AVX-512.
        """
        dtype = inner["scale"].dtype
        if dtype == torch.float16:
            return None
        return flat_kernel_inputs(self, inner, LEVELS[self.levels], dtype, rounds=dtype == torch.bfloat16)

    def linear(self, x, prepared, bias):
        """NF4's kernels: one bf16 token through the one-token kernel, bf16 or fp32 activations up to
        ``native.TILES_MAX_TOKENS`` through the tiles; else None (dequantize + mm)."""
        return kernel_linear(x, prepared, bias, self.block_size)

    def __str__(self) -> str:
        return f"NF4BlockScales(block_size={self.block_size}, levels={self.levels!r})"


@expansion_of(NF4, BnbNF4)
def _expanded(fmt: NF4 | BnbNF4) -> NF4BlockScales:
    """NF4's and BnbNF4's scales expanded: their blocks, their levels and arithmetic."""
    return NF4BlockScales(fmt.block_size, levels="torchao" if isinstance(fmt, NF4) else "bitsandbytes")
