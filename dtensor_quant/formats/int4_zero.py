"""Int4GroupwiseIntZero: 4-bit codes with a scale and an *integer* zero point per group of inputs.

The layout pre-quantized asymmetric int4 checkpoints hold, whatever their
packing: compressed-tensors' asymmetric ``pack-quantized`` (``weight_packed``,
``weight_scale``, ``weight_zero_point``), AutoAWQ's GEMM (``qweight``,
``qzeros``, ``scales``) and GPTQ's (``qweight``, ``qzeros`` holding z - 1,
``scales``). A loader repacks their words into these bytes without touching a
value.

Layout: ``qdata`` uint8 ``[out, in/2]`` holds two unsigned codes ``q`` in
``[0, 15]`` per byte along ``in`` (even index in the low nibble, as
:class:`~dtensor_quant.Int4Groupwise` and compressed-tensors' int32 words
store them); ``scale`` ``[out, ceil(in/group_size)]`` (the weight's dtype, or
``scale_dtype``) and ``zero`` uint8 ``[out, ceil(in/group_size)]`` hold one
value per group along ``in``. The zero point is in the codes' domain and may
be anything a uint8 holds: GPTQ v1 checkpoints store ``z - 1`` in four bits,
which reads back as ``z`` in ``[1, 16]``.

Math, the producers' own (compressed-tensors ``(q - z) * scale`` in the
scale's dtype, AWQ and GPTQ ``(q - z) * scales`` in fp16)::

    w ~= scale_dtype((q - z) * scale), then converted to the output dtype

``q - z`` is an exact small integer and its product with a 16-bit scale is
exact in float32, so rounding that once to the scale's dtype is bit-equal
to computing it in the scale's dtype. A compressed-tensors code ``q_ct`` in
``[-8, 7]`` with zero ``z_ct`` is ``q = q_ct + 8``, ``z = z_ct + 8`` here.

Kernel: a fused one-token ``x @ W.T`` (bf16 activations, 1-4 tokens; C++
built once per machine by :mod:`~dtensor_quant.core.native`) whose every
weight is ``dequantize``'s bf16 value bit for bit, fp16 scales rounded there
first (tests/test_fused_kernels.py).

Quantize (min-max, the range widened to include 0 as compressed-tensors'
observer does): ``scale = (max - min) / 15`` rounded up to the scale's dtype
(no code clips), ``z = round(-min / scale)``, ``q = clamp(round(w / scale) +
z, 0, 15)``. A group with NaN or Inf gets a NaN scale and dequantizes to NaN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core import native
from ..core.format import QuantFormat, Reducer, compact_repr, dtype_param
from ..core.layout import Blocked, OneToOne, Packed
from ..core.reductions import block_reduce, expand_blocks, nibbles_into

_CODES = tuple(float(c) for c in range(16))


def _round_up(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` value >= ``x64`` (float64), or the dtype's largest finite value if none."""
    y = x64.to(dtype)
    y = torch.where(y.double() < x64, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.clamp(max=torch.finfo(dtype).max)


@dataclass(frozen=True)
class Int4GroupwiseIntZero(QuantFormat):
    group_size: int = 128
    #: The dtype of ``scale`` (None: the weight's): fp16 for AWQ and GPTQ, bf16 for compressed-tensors.
    scale_dtype: torch.dtype | None = None

    block_size_params = ("group_size",)

    def __post_init__(self):
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"Int4GroupwiseIntZero needs an even group_size >= 2, got {self.group_size}")
        dtype_param(self, "scale_dtype")

    __repr__ = compact_repr

    @property
    def layout(self):
        g = self.group_size
        return {
            "qdata": (OneToOne(), Packed(2)),
            "scale": (OneToOne(), Blocked(g)),
            "zero": (OneToOne(), Blocked(g)),
        }

    def check_shape(self, shape):
        super().check_shape(shape)
        if shape[1] % 2:
            raise ValueError(f"{self} packs two values per byte along dim 1, which must be even; got {tuple(shape)}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        g, n_in, dtype = self.group_size, weight.shape[1], self.scale_dtype or weight.dtype
        lo = reduce(block_reduce(weight, 1, g, "min"), "min", "scale").double().clamp(max=0)
        hi = reduce(block_reduce(weight, 1, g, "max"), "max", "scale").double().clamp(min=0)
        finite = lo.isfinite() & hi.isfinite()
        tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        scale = _round_up(((hi - lo) / 15).clamp(min=tiny), dtype)
        if not weight.is_meta:  # a model built on "meta" has no values to fit
            scale = self._fit_range(scale, lo, finite, dtype)
        zero = torch.where(finite, (-lo / scale.double()).round().clamp(0, 15), 0)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        codes = (weight.float() / expand_blocks(scale.float(), 1, g, n_in)).round()
        codes = codes + expand_blocks(zero.float(), 1, g, n_in)
        q = torch.where(codes.isnan(), 0, codes).clamp(0, 15).to(torch.uint8)
        return {"qdata": q[:, ::2] | (q[:, 1::2] << 4), "scale": scale, "zero": zero.to(torch.uint8)}

    @staticmethod
    def _fit_range(scale, lo, finite, dtype):
        """Shrink ``scale`` where an end code would dequantize past ``dtype``'s range (Inf).

        ``(q - z) * scale`` reaches ``max(z, 15 - z) * scale``: a group as wide
        as the dtype's range (fp16 weights near +-65504, or fp16 scales for
        larger weights) gets the widest scale that keeps it finite and clips
        its far end, as rounding to the scale's dtype could otherwise give Inf.
        """
        big = torch.finfo(dtype).max
        for _ in range(4):  # z moves with the scale; two rounds settle it
            zero = (-lo / scale.double()).round().clamp(0, 15)
            reach = torch.maximum(zero, 15 - zero)
            bad = finite & (reach * scale.double() > big)
            if not bool(bad.any()):
                break
            fit = (big / reach).to(dtype)
            fit = torch.where(fit.double() * reach > big, torch.nextafter(fit, torch.zeros_like(fit)), fit)
            scale = torch.where(bad, fit, scale)
        return scale

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed, scale = inner["qdata"], inner["scale"]
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
        return ((q - inner["zero"].float()) * scale.float()).to(scale.dtype).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """Codes by table lookup (one per byte) in fp32, minus each group's zero, times its scale, as ``dequantize``."""
        scale, rows = inner["scale"], out.shape[0]
        fits = out.dtype == torch.float32 == scale.dtype and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        nibbles_into(inner["qdata"], _CODES, values, high_first=False)
        grouped = values.view(rows, -1, self.group_size)
        grouped.sub_(inner["zero"].float().unsqueeze(-1)).mul_(scale.float().unsqueeze(-1))
        if not fits:
            out.copy_(values if out.dtype == scale.dtype else values.to(scale.dtype))
        return True

    def prepare(self, inner):
        """The fused kernel's inputs, built by the first call that runs it (``native.Lazy``)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes, scales and zeros in float32 [out, in/g], whether to round to fp16)``, or None where it cannot run.

        The kernel needs whole groups (``in % group_size == 0``), ``group_size % 32 == 0``, a
        bf16, fp16 or fp32 scale and an x86 CPU with AVX2 (and F16C) or AVX-512.
        """
        qdata, scale, g = inner["qdata"], inner["scale"], self.group_size
        if qdata.device.type != "cpu" or qdata.ndim != 2 or g % 32 or scale.dtype not in _KERNEL_SCALE_DTYPES:
            return None
        rows, cols = qdata.shape[0], qdata.shape[1] * 2
        if not rows or cols % g or tuple(scale.shape) != (rows, cols // g) or kernel() is None:
            return None
        half = int(scale.dtype == torch.float16)  # bf16 and fp32 products need no rounding before bf16's
        return qdata.contiguous(), scale.float().contiguous(), inner["zero"].float().contiguous(), half

    def linear(self, x, prepared, bias):
        """bf16 activations, at most ``_KERNEL_MAX_TOKENS`` rows (decode): the fused kernel; else None."""
        if x.dtype != torch.bfloat16 or x.shape[0] > _KERNEL_MAX_TOKENS or prepared.get() is None:
            return None
        out = fused_linear(x, prepared.get(), self.group_size)
        return out + bias if bias is not None and out is not None else out

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")


_KERNEL_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Each token is one pass over the codes: past a few, dequantize + mm (one decode, then a real GEMM) wins.
_KERNEL_MAX_TOKENS = 4

# The fused one-token kernel (dtensor_quant.core.native). Per group: the 16 weights its codes can stand for,
# bf16(scale_dtype((c - z) * s)) for c = 0..15 -- (c - z) * s is exact in fp32, fp16 scales round there first,
# as dequantize does -- in one AVX-512 register (two with AVX2); each code picks its weight with a permute and an
# FMA adds weight * x in fp32. The codes are read once, at memory speed; no dense weight is written.
_KERNEL_SOURCE = r"""
__attribute__((target("avx512f,avx512bw,f16c")))
static float dq_i4z_row(const uint8_t* row, const float* scale, const float* zero, const float* xe, const float* xo,
                        int64_t K, int64_t g, int64_t half) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i mask = _mm512_set1_epi32(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / g; ++b) {
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(zero[b])), _mm512_set1_ps(scale[b]));
        if (half) t = _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512 table = dq_round_bf16_512(t);
        for (int64_t i = b * g / 2; i < (b + 1) * g / 2; i += 16) {  // 16 bytes: 32 weights
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
            __m512 low = _mm512_permutexvar_ps(_mm512_and_si512(codes, mask), table);  // weight 2j
            __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);  // weight 2j + 1
            acc0 = _mm512_fmadd_ps(low, _mm512_loadu_ps(xe + i), acc0);
            acc1 = _mm512_fmadd_ps(high, _mm512_loadu_ps(xo + i), acc1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// The same with AVX2: the 16 weights in two registers, a code's bit 3 picks between them.
__attribute__((target("avx2,fma,f16c")))
static float dq_i4z_row_avx2(const uint8_t* row, const float* scale, const float* zero, const float* xe,
                             const float* xo, int64_t K, int64_t g, int64_t half) {
    const __m256 iota0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), iota1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i mask = _mm256_set1_epi32(15);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / g; ++b) {
        const __m256 s = _mm256_set1_ps(scale[b]), z = _mm256_set1_ps(zero[b]);
        __m256 t0 = _mm256_mul_ps(_mm256_sub_ps(iota0, z), s), t1 = _mm256_mul_ps(_mm256_sub_ps(iota1, z), s);
        if (half) {
            t0 = _mm256_cvtph_ps(_mm256_cvtps_ph(t0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            t1 = _mm256_cvtph_ps(_mm256_cvtps_ph(t1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        t0 = dq_round_bf16_256(t0);
        t1 = dq_round_bf16_256(t1);
        for (int64_t i = b * g / 2; i < (b + 1) * g / 2; i += 8) {  // 8 bytes: 16 weights
            __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
            __m256i lo = _mm256_and_si256(codes, mask), hi = _mm256_srli_epi32(codes, 4);
            __m256 low = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
            __m256 high = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
            acc0 = _mm256_fmadd_ps(low, _mm256_loadu_ps(xe + i), acc0);
            acc1 = _mm256_fmadd_ps(high, _mm256_loadu_ps(xo + i), acc1);
        }
    }
    return dq_sum_256(_mm256_add_ps(acc0, acc1));
}

// level 1: AVX2, 2: AVX-512. scale, zero: [N, K / g] in fp32; half: round each product to fp16 first.
extern "C" void kernel(const uint8_t* codes, const float* scale, const float* zero, const uint16_t* x, uint16_t* out,
                       int64_t M, int64_t N, int64_t K, int64_t g, int64_t half, int64_t max_level, int64_t threads,
                       int64_t* level) {
    bool f16c = __builtin_cpu_supports("f16c");
    int64_t best = g % 32 || !f16c ? 0 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
    level[0] = best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    float* xs = new float[K];  // x's even elements (the low nibbles'), then its odd ones
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t i = 0; i < K / 2; ++i) {
            xs[i] = dq_bf16_float(x[m * K + 2 * i]);
            xs[K / 2 + i] = dq_bf16_float(x[m * K + 2 * i + 1]);
        }
        #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* row = codes + n * (K / 2);
            const float* s = scale + n * (K / g);
            const float* z = zero + n * (K / g);
            float acc = level[0] >= 2 ? dq_i4z_row(row, s, z, xs, xs + K / 2, K, g, half)
                                      : dq_i4z_row_avx2(row, s, z, xs, xs + K / 2, K, g, half);
            out[m * N + n] = dq_bf16_rne(acc);
        }
    }
    delete[] xs;
}
"""
_ARGTYPES = [
    "const uint8_t*", "const float*", "const float*", "const uint16_t*", "uint16_t*",
    "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t*",
]  # fmt: skip


def _probe(kernel) -> int:
    level, empty = native.level_out(), torch.empty(0)
    kernel(empty, empty, empty, empty, empty, 0, 0, 0, 32, 0, 2, 1, level)
    return int(level)


def kernel():
    """``(the fused kernel, its best vector level here)``, built on first use; None where it cannot run."""
    return native.load("int4_zero", _KERNEL_SOURCE, _ARGTYPES, _probe)


def fused_linear(x: torch.Tensor, prepared, group_size: int, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in bf16 through the fused kernel, from :meth:`Int4GroupwiseIntZero.kernel_inputs`; None if refused.

    ``max_level`` caps the vector path (1: AVX2, 2: AVX-512; default: the best here).
    """
    codes, scale, zero, half = prepared
    run, level = kernel()
    level = level if max_level is None else min(level, max_level)
    x = x.contiguous()
    k = codes.shape[1] * 2
    if x.shape[1] != k:
        raise ValueError(f"Int4GroupwiseIntZero kernel: activation width {x.shape[1]} != weight width {k}")
    out = x.new_empty((x.shape[0], codes.shape[0]))
    ran = native.level_out()
    args = (x.shape[0], codes.shape[0], k, group_size, half, level, torch.get_num_threads(), ran)
    run(codes, scale, zero, x, out, *args)
    return out if int(ran) else None  # 0: refused (flush-to-zero turned on since the probe)
