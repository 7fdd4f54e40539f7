"""BnbNF4: bitsandbytes' NF4 with double quantization, as its checkpoints store it and as it dequantizes.

The blocks are :class:`~dtensor_quant.NF4`'s (64 consecutive values of the
row-major flat weight share a scale, 256 consecutive scales share a second
one), but the arithmetic is bitsandbytes': the per-block absolute maxima are
stored as 8-bit codes of bitsandbytes' *dynamic* map (not int8 integers), the
second-level scales and the offset are float32, the 16 levels are the
paper's float32 values, and everything is computed in float32 and rounded
once to the output dtype. It differs from ``NF4`` in about a quarter of the
dequantized values, so a bitsandbytes checkpoint (unsloth's ``*-bnb-4bit``
models, ``transformers`` with ``BitsAndBytesConfig(bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)``) needs this format to load as stored.

Layout (:func:`~dtensor_quant._core.layout.flat_blocked`, from the weight's shape),
and the checkpoint tensors each inner holds as stored (a loader reshapes
them; their bytes are already in flat order):

* ``qdata`` uint8, 2 codes per byte over the flat index, the first in the
  high nibble: ``weight`` (uint8 ``[numel/2, 1]``);
* ``absmax`` uint8, one per ``block_size`` values: ``absmax`` (uint8
  ``[numel/64]``), an index into :func:`dynamic_map`;
* ``nested_absmax`` float32, one per ``block_size * nested_block_size``
  values: ``nested_absmax`` (float32 ``[ceil(numel/16384)]``);
* ``offset`` float32 ``[1, 1]``, constant: the quant_state JSON's
  ``nested_offset``.

``quant_map`` and ``nested_quant_map`` are the same in every such checkpoint
(:data:`NF4_LEVELS_F32` and :func:`dynamic_map`): a loader compares them with
these and refuses a checkpoint whose maps differ, rather than storing them.

Math (``bitsandbytes.functional.dequantize_4bit`` on CPU, step for step)::

    scale = dynamic_map[absmax] * nested_absmax + offset        (float32, two roundings)
    w     = output_dtype(NF4_LEVELS_F32[code] * scale)          (float32 product, one rounding)

Quantize follows ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)``:
the 4-bit codes (nearest level of ``w * (1 / absmax)``, ties to the lower
level) equal bitsandbytes' always. The offset is the mean of the block
maxima, here the float64 sum over the finite ones divided by their count and
rounded to float32 (the same on every sharding); torch's float32 ``mean``
that bitsandbytes takes gives the same value except when its own summation
rounds otherwise (seen once in twelve weights, by one ulp). Each 8-bit
absmax code is the nearest map entry to ``(absmax - offset) /
nested_absmax``; bitsandbytes' CPU search returns the second-nearest of two
almost equidistant entries in about 0.3% of blocks, so those codes differ
by one map step (tests/formats/test_bnb_nf4.py measures both).
A NaN weight makes its ``nested_absmax`` non-finite, and with it the
``block_size * nested_block_size`` values that scale covers, no others; an Inf
weight does not enter its block's absmax and saturates to +-absmax; an
all-zero block dequantizes to zeros.

Kernels: NF4's (the one-token kernel for one bf16 token, the tiles for more
and for fp32 activations), fed bitsandbytes' float32 levels and block
scales, so each weight they use is ``dequantize``'s value bit for bit
(tests/core/test_native.py, tests/core/test_native_tiles.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._core import native
from .._core.format import FlatBlockedFormat, Reducer, int_params
from .._core.layout import Constant, flat_blocked
from .._core.producers import BITSANDBYTES, Holds, ProducerLayout, StoredAs
from .._core.reductions import block_stat_abs, expand_to, nibbles_into, reduce_to
from .nf4 import flat_kernel_inputs, kernel_linear

# The QLoRA paper's NF4 levels in float32 (bitsandbytes' quant_map for "nf4").
NF4_LEVELS_F32 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


@functools.cache
def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (Dettmers, "8-bit approximations"), 256 float32 values, sorted.

    For each exponent ``i`` in 0..6: the midpoints of ``2**i + 1`` float32 points
    evenly spaced over [0.1, 1], times ``+-10 ** (i - 6)`` (in float32); plus 0 and 1.
    """
    values = [0.0, 1.0]
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += (means * 10.0 ** (i - 6)).tolist() + (means * -(10.0 ** (i - 6))).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``table`` (ties to the lower one); NaN gives 0."""
    right = torch.bucketize(values, table).clamp(1, table.numel() - 1)  # table[right - 1] < v <= table[right]
    left = right - 1
    pick = (values - table[right]).abs() < (values - table[left]).abs()
    return torch.where(values.isnan(), 0, torch.where(pick, right, left)).to(torch.uint8)


def nf4_codes(weight: torch.Tensor, absmax: torch.Tensor, layout, shape) -> torch.Tensor:
    """bitsandbytes' 4-bit codes ``[..., 2]`` (pairs of each byte), nearest level of ``w * (1 / absmax)``.

    ``absmax``: float32, one per block of ``layout["absmax"]`` (or ``"scale"``). Ties go to the
    lower level, a zero block to level 7 (0.0), a NaN to code 0 -- bitsandbytes' CPU search.
    """
    blocks = layout["absmax"] if "absmax" in layout else layout["scale"]
    levels = torch.tensor(NF4_LEVELS_F32, dtype=torch.float32, device=weight.device)
    inverse = expand_to(1.0 / absmax.clamp(min=1e-38), blocks, shape)
    scaled = (weight.float() * inverse).clamp(-1, 1)  # a zero block: 0, level 7
    codes = torch.bucketize(scaled, (levels[:-1] + levels[1:]) / 2).to(torch.uint8)  # ties to the lower level
    codes = torch.where(scaled.isnan(), 0, codes).to(torch.uint8)
    return codes.reshape(*(r.inner_len(n) for r, n in zip(layout["qdata"], shape)), 2)


@dataclass(frozen=True)
class BnbNF4(FlatBlockedFormat):
    block_size: int = 64
    nested_block_size: int = 256

    inner_names = ("qdata", "absmax", "nested_absmax", "offset")
    block_size_params = ("block_size", "nested_block_size")
    #: bitsandbytes NF4 with double quantization (``bnb_4bit_use_double_quant=True``), as transformers saves it.
    producer_holds = (Holds(BITSANDBYTES, ("nf4",), (("double_quant", True),), ("block_size", "nested_block_size")),)

    def producer_layout(self, producer, dtype):
        """bitsandbytes: ``weight`` uint8 ``[n/2, 1]`` (the codes over the flat weight, first in the high nibble),
        ``.absmax`` uint8 (dynamic-map codes), ``.nested_absmax`` float32, the offset in the
        ``.quant_state.bitsandbytes__nf4`` JSON; row-major, as they are. Its ``.quant_map`` and
        ``.nested_quant_map`` are the levels and the dynamic map this format computes with."""
        if producer != BITSANDBYTES:
            return None
        state = "{key}.quant_state.bitsandbytes__nf4"
        inner = (("qdata", StoredAs("flat", "{key}", torch.uint8, (("trailing", (1,)),))),
                 ("absmax", StoredAs("flat", "{key}.absmax", torch.uint8)),
                 ("nested_absmax", StoredAs("flat", "{key}.nested_absmax", torch.float32)),
                 ("offset", StoredAs("json_field", state, torch.uint8, (("field", "nested_offset"),))))  # fmt: skip
        constants = (("{key}.quant_map", torch.tensor(NF4_LEVELS_F32, dtype=torch.float32)),
                     ("{key}.nested_quant_map", dynamic_map()))  # fmt: skip
        args = {"blocksize": self.block_size, "nested_blocksize": self.nested_block_size}
        return ProducerLayout(producer, "nf4", args, inner, constants=constants)

    def __post_init__(self):
        int_params(self)
        if self.block_size < 2 or self.block_size % 2 or self.nested_block_size < 1:
            raise ValueError(f"BnbNF4 needs an even block_size >= 2 and nested_block_size >= 1, got {self}")

    def layout_for(self, shape):
        self.check_shape(torch.Size(shape))
        return {
            "qdata": flat_blocked(2, shape, packed=True),
            "absmax": flat_blocked(self.block_size, shape),
            "nested_absmax": flat_blocked(self.block_size * self.nested_block_size, shape),
            "offset": (Constant(), Constant()),
        }

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        shape = weight.shape
        layout = self.layout_for(reduce.full_shape)
        # float32, one per block; a block of whole rows spans a column cut: its maximum over every shard
        absmax = reduce(reduce_to(block_stat_abs(weight), layout["absmax"], "max"), "max", "absmax")
        pairs = nf4_codes(weight, absmax, layout, shape)
        # The offset: the mean of the finite block maxima (a NaN or Inf poisons its own nested block only).
        finite = absmax.isfinite()
        stats = torch.stack([torch.where(finite, absmax, 0).double().sum(), finite.double().sum()])
        total, count = reduce(stats.reshape(1, 1, 2), "sum", "offset").reshape(2)
        offset = (total / count).float().reshape(1, 1)
        centred = absmax - offset
        nested = reduce_to(expand_to(centred.abs(), layout["absmax"], shape), layout["nested_absmax"], "max")
        nested = reduce(nested, "max", "nested_absmax")
        per_block = reduce_to(expand_to(nested, layout["nested_absmax"], shape), layout["absmax"], "max")
        return {
            "qdata": (pairs[..., 0] << 4) | pairs[..., 1],
            "absmax": _nearest(centred / per_block, dynamic_map().to(weight.device)),
            "nested_absmax": nested,
            "offset": offset,
        }

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        device = inner["qdata"].device
        scale = dynamic_map().to(device)[inner["absmax"].long()] * inner["nested_absmax"] + inner["offset"]
        qdata = inner["qdata"]
        codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).long().flatten(-2)
        if any(c != s and s != 1 for c, s in zip(codes.shape[-2:], scale.shape[-2:])):
            # codes packed across rows (odd widths; the scales then vary per element): in flat order
            codes = codes.reshape(*codes.shape[:-2], *scale.shape[-2:])
        levels = torch.tensor(NF4_LEVELS_F32, dtype=torch.float32, device=device)
        return (levels[codes] * scale).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """On the flat index: levels by table lookup (one per byte) in float32, times each block's scale.

        Every inner tensor stores its blocks in flat row-major order, so each
        block's scale is computed once and broadcast over it. Needs whole blocks.
        """
        b, scale = self.block_size, self.block_scales(inner, out.numel())
        if scale is None:
            return False
        fits = out.dtype == torch.float32 and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        nibbles_into(inner["qdata"], NF4_LEVELS_F32, values, high_first=True)
        values.view(-1, b).mul_(scale.unsqueeze(-1))
        if not fits:
            out.copy_(values)
        return True

    def block_scales(self, inner: dict[str, torch.Tensor], numel: int) -> torch.Tensor | None:
        """Each block's float32 scale in flat order, as ``dequantize`` computes it; None unless the blocks are whole."""
        absmax, nested = inner["absmax"].reshape(-1), inner["nested_absmax"].reshape(-1)
        if numel % self.block_size or absmax.numel() != numel // self.block_size or inner["qdata"].numel() * 2 != numel:
            return None
        per_block = nested.repeat_interleave(self.nested_block_size).narrow(0, 0, absmax.numel())
        return dynamic_map().to(absmax.device)[absmax.long()] * per_block + inner["offset"].reshape(())

    # NF4's kernels (dtensor_quant._formats.nf4) compute each weight as level * scale in fp32 (rounded to bf16 for
    # bf16 activations) from float32 levels and block scales: with bitsandbytes' that is dequantize's value.
    kernel_needs_whole_blocks = True

    def prepare(self, inner):
        """The fused kernel's inputs, built by the first call that runs it (``native.Lazy``)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes, block scales in float32, levels in float32, rounds)`` for NF4's kernels, or None where they
        cannot run.

        It needs blocks inside each row (``in % block_size == 0``, ``block_size % 32 == 0``; the library
        checks the rest: ``kernel_needs_whole_blocks``) and an x86 CPU with AVX2 or AVX-512.
        """
        # dequantize rounds the fp32 product once, to the output's dtype: only bf16 activations round to bf16
        return flat_kernel_inputs(self, inner, NF4_LEVELS_F32, torch.float32, rounds=False)

    def linear(self, x, prepared, bias):
        """NF4's kernels: one bf16 token through the one-token kernel, bf16 or fp32 activations up to
        ``native.TILES_MAX_TOKENS`` through the tiles; else None (dequantize + mm)."""
        return kernel_linear(x, prepared, bias, self.block_size)

    def __str__(self) -> str:
        return f"BnbNF4(block_size={self.block_size}, nested_block_size={self.nested_block_size})"
