"""NF4: QLoRA's 4-bit NormalFloat with double-quantized block scales, on the flattened weight.

The algorithm and its dtype flow are torchao's ``to_nf4`` (QLoRA paper,
bitsandbytes, torchtune), defined on the row-major *flattened* weight:

* every ``block_size`` consecutive weights share a scale, their absolute
  maximum (in the weight's dtype); each weight becomes the index of the
  nearest of the 16 NF4 levels of ``w / scale`` (two codes per byte, first in
  the high nibble; ties go to the lower level);
* the scales are centred by their mean, and every ``scaler_block_size``
  consecutive scales share a factor ``256 / (2 * absmax)``; the centred
  scales are stored as ``round(scale * factor)`` in int8;
* dequantized: ``level * (scaler / factor + mean)``, in the weight's dtype.

What is bit-identical to torchao 0.18's ``to_nf4`` on the same finite input
without all-zero blocks: the codes, the int8 scalers, the factors, the mean
and the dequantized weight, for bf16 and fp16 weights; for fp32 the codes,
and everything else whenever torch's float32 mean rounds like ours (below). The 16 levels are torchao's table (the
paper's values rounded to 4 decimals, then to the weight's dtype); bitsandbytes
keeps the paper's float32 values, which in bf16 and fp16 differ from this
table in one level (-0.0911 vs -0.09105) by one ulp. The mean is the float64
sum of the scales divided by their count, rounded once to the dtype -- the
value torch's CPU ``mean`` gives unless its float32 accumulation rounds across
a dtype rounding boundary (not seen in the tests); it is the same on every
sharding because float64 sums of the scales are exact.

Layout (:func:`~dtensor_quant.layout.flat_blocked`, from the weight's shape):
``qdata`` packs 2 codes per byte and ``scaler`` blocks ``block_size`` weights,
``factor`` blocks ``block_size * scaler_block_size`` weights, all over the flat
index, and ``mean`` is constant. Where a block fits inside a row (or a factor
covers whole rows) the relations are the per-dim ones and column shards work
(row-parallel TP); otherwise the blocks run across rows and only row cuts
with a multiple of ``block_size * scaler_block_size`` elements before them
are legal -- torchao's own FSDP2 rule, plus uneven shards.

Extreme and non-finite input, where this departs from torchao (identical
otherwise):

* an all-zero block gets code 7 (level 0.0) and dequantizes to exact zeros
  (torchao divides 0/0 and keeps the code its NaN search gives);
* the mean is over the *finite* block scales, so a NaN or Inf weight makes
  its own factor NaN (or 0) and with it the ``block_size * scaler_block_size``
  weights that factor covers -- never fewer, because a block's own scale is
  an int8 that cannot hold NaN, and never more (in torchao the mean, and so
  the whole weight, becomes NaN);
* the factor is clamped to the dtype's max: in fp16 a factor's spread below
  128 / 65504 ~ 0.002 (weights of std ~1e-3) would make it Inf and every scale
  of its blocks the mean;
* a dequantized scale that rounds past the dtype's max (fp16 weights near
  65504) is clamped to it, so finite weights never dequantize to Inf.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core import native
from ..core.format import QuantFormat, Reducer
from ..core.layout import Constant, flat_blocked
from ..core.reductions import expand_to, nibbles_into, reduce_to

# torchao's table (to_nf4): the QLoRA levels rounded to 4 decimals.
NF4_LEVELS = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class NF4(QuantFormat):
    block_size: int = 64
    scaler_block_size: int = 256

    inner_names = ("qdata", "scaler", "factor", "mean")
    block_size_params = ("block_size", "scaler_block_size")

    def __post_init__(self):
        if self.block_size < 2 or self.block_size % 2 or self.scaler_block_size < 1:
            raise ValueError(f"NF4 needs an even block_size >= 2 and scaler_block_size >= 1, got {self}")

    def check_shape(self, shape):
        super().check_shape(shape)
        numel = shape[0] * shape[1]
        if numel % self.block_size:
            raise ValueError(
                f"{self}: a {tuple(shape)} weight has {numel} elements, not a multiple of block_size "
                f"{self.block_size} (the blocks run over the flattened weight)"
            )

    def layout_for(self, shape):
        self.check_shape(torch.Size(shape))
        return {
            "qdata": flat_blocked(2, shape, packed=True),
            "scaler": flat_blocked(self.block_size, shape),
            "factor": flat_blocked(self.block_size * self.scaler_block_size, shape),
            "mean": (Constant(), Constant()),
        }

    @property
    def layout(self):
        raise ValueError(f"{self}'s layout depends on the weight's shape: use layout_for(shape)")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        dtype, shape = weight.dtype, weight.shape
        layout = self.layout_for(reduce.full_shape)
        absmax = reduce_to(weight.abs(), layout["scaler"], "max").to(dtype)
        # The mean of the finite block scales: a NaN or Inf weight poisons its own factor's blocks, not all.
        finite = absmax.isfinite()
        stats = torch.stack([torch.where(finite, absmax, 0).double().sum(), finite.double().sum()])
        total, count = reduce(stats.reshape(1, 1, 2), "sum", "mean").reshape(2)
        mean = (total / count).to(dtype).reshape(1, 1)
        centred = absmax - mean
        # The factors' blocks, and each scale's factor, through the logical grid both follow.
        spread = reduce_to(expand_to(centred.abs(), layout["scaler"], shape), layout["factor"], "max")
        factor = (256 / (2 * reduce(spread, "max", "factor").to(dtype))).to(dtype)
        # A spread below 128 / max (fp16: 0.002) would make the factor Inf and every scale the mean.
        factor = factor.clamp(max=torch.finfo(dtype).max)
        per_scale = reduce_to(expand_to(factor, layout["factor"], shape), layout["scaler"], "max").to(dtype)
        scaler = (centred * per_scale).round().clamp(-128, 127)
        scales = expand_to(absmax, layout["scaler"], shape)
        codes = self._nearest(torch.where(scales == 0, 0, weight / scales))  # a zero block: level 0.0, not 0/0
        pairs = codes.reshape(*(r.inner_len(n) for r, n in zip(layout["qdata"], shape)), 2)
        return {
            "qdata": (pairs[..., 0] << 4) | pairs[..., 1],
            "scaler": scaler.to(torch.int8),
            "factor": factor,
            "mean": mean,
        }

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        mean, factor = inner["mean"], inner["factor"]
        scale = (inner["scaler"] / factor).to(mean.dtype) + mean
        # A finite block of a weight near the dtype's max may round its scale past it: keep it finite
        # (a factor of 0 or NaN comes from an Inf or NaN weight, and stays non-finite).
        big = torch.finfo(mean.dtype).max
        scale = torch.where(factor.isfinite() & (factor > 0), scale.clamp(-big, big), scale)
        qdata = inner["qdata"]
        codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).long().flatten(-2)  # scale broadcasts over it
        if any(c != s and s != 1 for c, s in zip(codes.shape[-2:], scale.shape[-2:])):
            # codes packed across rows (odd widths; the scales then vary per element): in flat order
            codes = codes.reshape(*codes.shape[:-2], *scale.shape[-2:])
        levels = torch.tensor(NF4_LEVELS, dtype=mean.dtype, device=qdata.device)
        return (levels[codes] * scale).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """On the flat index: levels by table lookup (one per byte), times each block's scale.

        Every inner tensor, whatever its relations, stores its blocks in flat
        row-major order, so the scales are computed once per block (not per
        element) and broadcast over it. Needs whole scaler blocks.
        """
        scale = self._block_scales(inner, out.numel())
        if scale is None:
            return False
        mean = inner["mean"]
        fits = out.dtype == mean.dtype and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=mean.dtype, device=out.device)
        nibbles_into(inner["qdata"], NF4_LEVELS, values, high_first=True)
        values.view(-1, self.block_size).mul_(scale.unsqueeze(-1))
        if not fits:
            out.copy_(values)
        return True

    def _block_scales(self, inner: dict[str, torch.Tensor], numel: int) -> torch.Tensor | None:
        """Each block's dequantized scale, in flat order (the weight's dtype); None unless the blocks are whole."""
        mean, scaler, factor = inner["mean"], inner["scaler"].reshape(-1), inner["factor"].reshape(-1)
        if numel % self.block_size or scaler.numel() != numel // self.block_size or inner["qdata"].numel() * 2 != numel:
            return None
        per_scaler = factor.repeat_interleave(self.scaler_block_size).narrow(0, 0, scaler.numel())
        scale = (scaler / per_scaler).to(mean.dtype) + mean.reshape(())
        big = torch.finfo(mean.dtype).max  # the same clamp as dequantize: finite weights stay finite
        return torch.where(per_scaler.isfinite() & (per_scaler > 0), scale.clamp(-big, big), scale)

    # The fused one-token kernel (dtensor_quant.native): each block's 16 weights bf16(level * scale) are one
    # AVX-512 register (two with AVX2), each code picks its weight with vpermps, an FMA adds weight * x in fp32.
    # The codes are read once, at memory speed; no dense weight is ever written.
    kernel_needs_whole_blocks = True

    def prepare(self, inner):
        """The fused kernel's inputs, built by the first call that runs it (:class:`~dtensor_quant.native.Lazy`)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes, block scales in fp32, levels in fp32)`` for the fused kernel, or None where it cannot run.

        It needs whole blocks inside each row (``in % block_size == 0``, the
        library checks the rest: ``kernel_needs_whole_blocks``), a bf16 or
        fp32 weight (fp16 rounds each product to fp16 before the activation's
        dtype), and an x86 CPU with AVX2 or AVX-512 where the kernel was built.
        """
        qdata, mean, bs = inner["qdata"], inner["mean"], self.block_size
        if qdata.device.type != "cpu" or qdata.ndim != 2 or mean.dtype not in _KERNEL_WEIGHT_DTYPES or bs % 32:
            return None
        rows, cols = qdata.shape[0], qdata.shape[1] * 2
        if not rows or cols % bs or kernel() is None:
            return None
        scale = self._block_scales(inner, rows * cols)
        if scale is None:
            return None
        levels = torch.tensor(NF4_LEVELS, dtype=mean.dtype).float()
        return qdata.contiguous(), scale.float().reshape(rows, cols // bs).contiguous(), levels

    def linear(self, x, prepared, bias):
        """bf16 activations, at most ``_KERNEL_MAX_TOKENS`` rows (decode): the fused kernel; else None."""
        if x.dtype != torch.bfloat16 or x.shape[0] > _KERNEL_MAX_TOKENS or prepared.get() is None:
            return None
        out = fused_linear(x, prepared.get(), self.block_size)
        return out + bias if bias is not None and out is not None else out

    @staticmethod
    def _nearest(normalized: torch.Tensor) -> torch.Tensor:
        levels = torch.tensor(NF4_LEVELS, dtype=normalized.dtype, device=normalized.device)
        return (normalized.unsqueeze(-1) - levels).abs().min(dim=-1).indices.to(torch.uint8)

    def __str__(self) -> str:
        return f"NF4(block_size={self.block_size}, scaler_block_size={self.scaler_block_size})"


# fp16 weights round each product to fp16 first; the kernel rounds once, to bf16.
_KERNEL_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
# Each token is one pass over the codes: past a few, dequantize + mm (one decode, then a real GEMM) wins.
_KERNEL_MAX_TOKENS = 4

_KERNEL_SOURCE = r"""
// out[m, n] = bf16(sum_k x[m, k] * w[n, k]), w[n, k] = bf16(level[code] * scale[n, k / bs]): NF4.dequantize's values.
__attribute__((target("avx512f,avx512bw")))
static float dq_nf4_row(const uint8_t* row, const float* scale, const float* xe, const float* xo, const float* levels,
                        int64_t K, int64_t bs) {
    const __m512 lv = _mm512_loadu_ps(levels);
    const __m512i mask = _mm512_set1_epi32(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / bs; ++b) {
        __m512 table = dq_round_bf16_512(_mm512_mul_ps(lv, _mm512_set1_ps(scale[b])));  // the block's 16 weights
        for (int64_t i = b * bs / 2; i < (b + 1) * bs / 2; i += 16) {  // 16 bytes: 32 weights
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
            __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);  // weight 2j
            __m512 low = _mm512_permutexvar_ps(_mm512_and_si512(codes, mask), table);  // weight 2j + 1
            acc0 = _mm512_fmadd_ps(high, _mm512_loadu_ps(xe + i), acc0);
            acc1 = _mm512_fmadd_ps(low, _mm512_loadu_ps(xo + i), acc1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// The same with AVX2: the 16 weights in two registers, a code's bit 3 picks between them.
__attribute__((target("avx2,fma")))
static float dq_nf4_row_avx2(const uint8_t* row, const float* scale, const float* xe, const float* xo,
                             const float* levels, int64_t K, int64_t bs) {
    const __m256 lv0 = _mm256_loadu_ps(levels), lv1 = _mm256_loadu_ps(levels + 8);
    const __m256i mask = _mm256_set1_epi32(15);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / bs; ++b) {
        const __m256 s = _mm256_set1_ps(scale[b]);
        const __m256 t0 = dq_round_bf16_256(_mm256_mul_ps(lv0, s)), t1 = dq_round_bf16_256(_mm256_mul_ps(lv1, s));
        for (int64_t i = b * bs / 2; i < (b + 1) * bs / 2; i += 8) {  // 8 bytes: 16 weights
            __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
            __m256i hi = _mm256_srli_epi32(codes, 4), lo = _mm256_and_si256(codes, mask);
            __m256 high = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
            __m256 low = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
            acc0 = _mm256_fmadd_ps(high, _mm256_loadu_ps(xe + i), acc0);
            acc1 = _mm256_fmadd_ps(low, _mm256_loadu_ps(xo + i), acc1);
        }
    }
    return dq_sum_256(_mm256_add_ps(acc0, acc1));
}

// level 1: AVX2, 2: AVX-512.
static void dq_nf4(const uint8_t* codes, const float* scale, const float* levels, const uint16_t* x, uint16_t* out,
                   int64_t M, int64_t N, int64_t K, int64_t bs, int64_t level, int64_t threads) {
    float* xs = new float[K];  // x's even elements (the high nibbles'), then its odd ones
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t i = 0; i < K / 2; ++i) {
            xs[i] = dq_bf16_float(x[m * K + 2 * i]);
            xs[K / 2 + i] = dq_bf16_float(x[m * K + 2 * i + 1]);
        }
        #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* row = codes + n * (K / 2);
            const float* s = scale + n * (K / bs);
            float acc = level >= 2 ? dq_nf4_row(row, s, xs, xs + K / 2, levels, K, bs)
                                   : dq_nf4_row_avx2(row, s, xs, xs + K / 2, levels, K, bs);
            out[m * N + n] = dq_bf16_rne(acc);
        }
    }
    delete[] xs;
}

extern "C" void kernel(const uint8_t* codes, const float* scale, const float* levels, const uint16_t* x,
                       uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t bs, int64_t max_level,
                       int64_t threads, int64_t* level) {
    int64_t best = bs % 32 ? 0 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
    level[0] = best < max_level ? best : max_level;
    if (level[0] > 0 && M > 0) dq_nf4(codes, scale, levels, x, out, M, N, K, bs, level[0], threads);
}
"""
_ARGTYPES = [
    "const uint8_t*", "const float*", "const float*", "const uint16_t*", "uint16_t*",
    "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t*",
]  # fmt: skip


def _probe(kernel) -> int:
    level, empty = native.level_out(), torch.empty(0)
    kernel(empty, empty, empty, empty, empty, 0, 0, 0, 64, 2, 1, level)
    return int(level)


def kernel():
    """``(the fused kernel, its best vector level here)``, built on first use; None where it cannot run."""
    return native.load("nf4", _KERNEL_SOURCE, _ARGTYPES, _probe)


def fused_linear(x: torch.Tensor, prepared, block_size: int, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in bf16 through the fused kernel, from :meth:`NF4.kernel_inputs` (bf16 ``x``); None if refused.

    ``max_level`` caps the vector path (1: AVX2, 2: AVX-512; default: the best here).
    """
    codes, scale, levels = prepared
    run, level = kernel()
    level = level if max_level is None else min(level, max_level)
    x = x.contiguous()
    out = x.new_empty((x.shape[0], codes.shape[0]))
    k = codes.shape[1] * 2
    if x.shape[1] != k:
        raise ValueError(f"NF4 kernel: activation width {x.shape[1]} != weight width {k}")
    ran = native.level_out()
    run(codes, scale, levels, x, out, x.shape[0], codes.shape[0], k, block_size, level, torch.get_num_threads(), ran)
    return out if int(ran) else None  # 0: refused (flush-to-zero turned on since the probe)
