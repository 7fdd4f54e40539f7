"""Float8Rowwise and Float8Tensorwise: e4m3fn values with one scale per row, or one in all.

Layout: ``qdata`` float8_e4m3fn ``[out, in]`` follows both dims one-to-one;
``scale`` (the weight's dtype) is ``[out, 1]`` (one-to-one on rows, constant
on columns) or ``[1, 1]`` (constant everywhere: never sent by a collective,
and all-reduced over every sharded mesh dim when a sharded weight is
quantized). Collectives move the float8 bytes as uint8: gloo has no float8.

Math: ``q = clamp(w / scale, +-448)`` rounded to e4m3fn with ``scale =
amax / 448``; ``w ~= float(q) * scale``, in float32, rounded once to the output
dtype. ``Float8Rowwise(scale_dtype=...)`` stores the scale in that dtype and
rounds the product to it before converting: compressed-tensors'
``float-quantized`` per-channel checkpoints (e4m3 ``weight``, bf16
``weight_scale`` ``[out, 1]``, dequantized as ``q.to(bf16) * scale``);
``Float8Tensorwise(scale_dtype=...)`` the same with one scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import native
from ..core.format import QuantFormat, Reducer, compact_repr, dtype_param, unpack_through
from ..core.layout import Constant, OneToOne
from ..core.reductions import block_reduce, safe_scale, scaled_into

_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _quantize(weight: torch.Tensor, amax: torch.Tensor, scale_dtype=None) -> dict[str, torch.Tensor]:
    scale = safe_scale(amax, _E4M3_MAX, scale_dtype or weight.dtype)
    q = (weight.float() / scale.float()).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return {"qdata": q, "scale": scale}


def _quantize_stochastic(weight: torch.Tensor, amax: torch.Tensor, noise, dtype) -> dict:
    """``_quantize`` with each code rounded at random between its two e4m3 neighbours (scale in ``dtype``).

    The nearest code decides which neighbours bracket the value (e4m3fn magnitudes
    are ordered like their 7 low bits); the value rounds to the upper one with
    probability its distance from the lower one over the gap.
    """
    scale = safe_scale(amax, _E4M3_MAX, dtype)
    x = (weight.float() / scale.float()).clamp(-_E4M3_MAX, _E4M3_MAX)
    bits = x.to(torch.float8_e4m3fn).view(torch.uint8)
    sign, mag = bits & 0x80, (bits & 0x7F).long()
    table = _magnitudes(x.device)
    ax, av = x.abs(), table[mag]
    lo = torch.where(av > ax, (mag - 1).clamp_(min=0), mag)  # the code at or below |x|
    hi = torch.where(av < ax, (mag + 1).clamp_(max=0x7E), mag)  # the code at or above |x|
    lo_v, hi_v = table[lo], table[hi]
    up = noise.uniform() < (ax - lo_v) / (hi_v - lo_v)  # False where |x| is on a code (0 / 0 is NaN)
    out = (torch.where(up, hi, lo).to(torch.uint8) | sign).view(torch.float8_e4m3fn)
    out = torch.where(x.isnan(), x.to(torch.float8_e4m3fn), out)  # NaN stays NaN
    return {"qdata": out, "scale": scale}


_MAGNITUDES: dict[str, torch.Tensor] = {}


def _magnitudes(device) -> torch.Tensor:
    """float32 value of each e4m3fn magnitude code 0..127 (127 is NaN)."""
    key = str(device)
    if key not in _MAGNITUDES:
        _MAGNITUDES[key] = torch.arange(128, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
    return _MAGNITUDES[key]


def _dequantize(inner: dict[str, torch.Tensor], dtype: torch.dtype, scale_dtype=None) -> torch.Tensor:
    values = inner["qdata"].float() * inner["scale"].float()
    return (values.to(scale_dtype) if scale_dtype else values).to(dtype)


_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}
_TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # every e4m3fn value is exact in these
_CHUNK = 1 << 18


def codes_into(qdata: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(qdata)`` for e4m3fn codes and a contiguous bf16/fp16/fp32 ``out``, through a 256-entry table.

    torch 2.13 converts float8 to float one element at a time on CPU (about
    10 ns each); one ``index_select`` per byte is 5-7x faster (a 5632x2048
    weight: 10-16 ms instead of 70-110 ms on one loaded AVX-512 core). The
    table holds exactly what ``copy_`` gives for each code, NaN included.
    """
    key = (out.dtype, str(out.device))
    table = _TABLES.get(key)
    if table is None:
        codes = torch.arange(256, dtype=torch.uint8, device=out.device).view(torch.float8_e4m3fn)
        table = _TABLES[key] = torch.empty(256, dtype=out.dtype, device=out.device).copy_(codes)
    codes, flat = qdata.reshape(-1).view(torch.uint8), out.view(-1)
    # int32 indices a chunk at a time: one buffer that stays in cache, not a fresh 4-byte copy of every code
    index = torch.empty(min(_CHUNK, codes.numel()), dtype=torch.int32, device=out.device)
    for start in range(0, codes.numel(), _CHUNK):
        n = min(_CHUNK, codes.numel() - start)
        torch.index_select(table, 0, index[:n].copy_(codes[start : start + n]), out=flat[start : start + n])


def table_fits(out: torch.Tensor) -> bool:
    """Whether :func:`codes_into` can write ``out``."""
    return out.dtype in _TABLE_DTYPES and out.is_contiguous() and out.device.type == "cpu"


def _unpack(inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
    """``scaled_into``'s bits, the codes read by :func:`codes_into`, the scale multiplied in ``out``'s dtype."""
    qdata, scale = inner["qdata"], inner["scale"]
    if not table_fits(out):
        scaled_into(qdata, scale, out)
    elif out.dtype == scale.dtype:  # the product rounds once in out's dtype, as in scaled_into
        codes_into(qdata, out)
        out.mul_(scale)
    else:  # float32 product, one rounding into out (an fp32 weight gathered as bf16, say)
        values = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        codes_into(qdata, values)
        out.copy_(values.mul_(scale.float()))
    return True


# -- the fused one-token kernel (dtensor_quant.native) ------------------------------------------------------
# Each weight is bf16(float(code) * scale), as _dequantize computes it, and is multiplied by x in fp32: the codes
# are read once, at memory speed, and no dense weight is written. NaN codes (0x7F, 0xFF) never reach it: prepare
# sends such a weight to dequantize + mm.

# Each token is one pass over the codes: past a few, dequantize + mm (one decode, then a real GEMM) wins.
_KERNEL_MAX_TOKENS = 4

_KERNEL_SOURCE = r"""
// 32 codes -> their e4m3 values times 2^-120, as fp32: the bf16 bits (sign | magnitude << 4) in each lane's upper
// half. lo holds bytes 8l..8l+3 of every 128-bit lane l, hi bytes 8l+4..8l+7 (dq_x_order says where x goes).
__attribute__((target("avx512f,avx512bw")))
static inline void dq_e4m3_raw(const uint8_t* p, __m512& lo, __m512& hi) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i bits = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x7F0)),
                                   _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(short(0x8000))));
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), bits));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), bits));
}

// The same for 16 codes with AVX2: lo holds bytes 8l..8l+3 of each 128-bit lane, hi bytes 8l+4..8l+7.
__attribute__((target("avx2,fma")))
static inline void dq_e4m3_raw_avx2(const uint8_t* p, __m256& lo, __m256& hi) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i bits = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 4), _mm256_set1_epi16(0x7F0)),
                                   _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(short(0x8000))));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), bits));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), bits));
}

// Where x[j] of a chunk of 2 * half codes goes: the lo lanes, then the hi lanes (half: 16 AVX-512, 8 AVX2).
static inline int64_t dq_x_order(int64_t j, int64_t half) { return 8 * ((j % half) / 4) + 4 * (j / half) + j % 4; }

// Integer rounding, exact for any scale. kSmall: every scale of the row below 2^7 in magnitude, so s * 2^120 is
// finite and one multiply gives the exact product, which cannot be NaN (no NaN code, finite scale).
template <bool kSmall>
__attribute__((target("avx2,fma")))
static float dq_f8_row_avx2(const uint8_t* row, const float* s, const float* xf, int64_t K, int64_t g) {
    const __m256 up = _mm256_set1_ps(0x1p120f);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), vs = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (k % g == 0) vs = _mm256_set1_ps(kSmall ? s[k / g] * 0x1p120f : s[k / g]);
        __m256 lo, hi;
        dq_e4m3_raw_avx2(row + k, lo, hi);
        if (kSmall) {
            lo = dq_round_bf16_256_finite(_mm256_mul_ps(lo, vs));
            hi = dq_round_bf16_256_finite(_mm256_mul_ps(hi, vs));
        } else {
            lo = dq_round_bf16_256(_mm256_mul_ps(_mm256_mul_ps(lo, up), vs));
            hi = dq_round_bf16_256(_mm256_mul_ps(_mm256_mul_ps(hi, up), vs));
        }
        acc0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xf + k), acc0);
        acc1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xf + k + 8), acc1);
    }
    return dq_sum_256(_mm256_add_ps(acc0, acc1));
}

// The same with AVX-512 (value * 2^-120 * 2^120 is exact, subnormal codes too).
template <bool kSmall>
__attribute__((target("avx512f,avx512bw")))
static float dq_f8_row(const uint8_t* row, const float* s, const float* xf, int64_t K, int64_t g) {
    const __m512 up = _mm512_set1_ps(0x1p120f);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), vs = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (k % g == 0) vs = _mm512_set1_ps(kSmall ? s[k / g] * 0x1p120f : s[k / g]);
        __m512 lo, hi;
        dq_e4m3_raw(row + k, lo, hi);
        if (kSmall) {
            lo = dq_round_bf16_512_finite(_mm512_mul_ps(lo, vs));
            hi = dq_round_bf16_512_finite(_mm512_mul_ps(hi, vs));
        } else {
            lo = dq_round_bf16_512(_mm512_mul_ps(_mm512_mul_ps(lo, up), vs));
            hi = dq_round_bf16_512(_mm512_mul_ps(_mm512_mul_ps(hi, up), vs));
        }
        acc0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xf + k), acc0);
        acc1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xf + k + 16), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Every scale of the row in [2^-117, 2^7): every product is 0 or a normal fp32, where vcvtne2ps2bf16 rounds to
// nearest even exactly like dq_bf16_rne, and s * 2^120 is finite, so one multiply gives the exact product;
// vdpbf16ps multiplies the bf16 pairs exactly and accumulates in fp32.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static float dq_f8_row_bf16(const uint8_t* row, const float* s, const uint16_t* xb, int64_t K, int64_t g) {
    __m512 acc = _mm512_setzero_ps(), vs = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (k % g == 0) vs = _mm512_set1_ps(s[k / g] * 0x1p120f);
        __m512 lo, hi;
        dq_e4m3_raw(row + k, lo, hi);
        __m512bh w = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, vs), _mm512_mul_ps(lo, vs));
        acc = _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_loadu_si512(xb + k));
    }
    return _mm512_reduce_add_ps(acc);
}

// scale: [N, K / g], one per row and group of g columns (g = K: per row). w[n, k] = bf16(float(code) * scale).
// level 1: AVX2, 2: AVX-512, 3: AVX-512 with BF16 (the rows it is exact for).
extern "C" void kernel(const uint8_t* codes, const float* scale, const uint16_t* x, uint16_t* out, int64_t M,
                       int64_t N, int64_t K, int64_t g, int64_t max_level, int64_t threads, int64_t* level) {
    int64_t best = K % 32 || g % 32 || K % g ? 0 : dq_avx512_bf16() ? 3 : dq_avx512() ? 2 : dq_avx2() ? 1 : 0;
    level[0] = best < max_level ? best : max_level;
    if (level[0] <= 0 || M <= 0) return;
    const int64_t half = level[0] >= 2 ? 16 : 8;
    uint16_t* xb = new uint16_t[K];  // x in dq_e4m3_raw's order, as bf16 and as fp32
    float* xf = new float[K];
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) {
            xb[k] = x[m * K + k - k % (2 * half) + dq_x_order(k % (2 * half), half)];
            xf[k] = dq_bf16_float(xb[k]);
        }
        #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const float* s = scale + n * (K / g);
            bool small = true, normal = true;  // NaN and Inf scales are neither
            for (int64_t i = 0; i < K / g; ++i) {
                small &= std::fabs(s[i]) < 128;
                normal &= std::fabs(s[i]) < 128 && std::fabs(s[i]) >= 0x1p-117f;
            }
            const uint8_t* row = codes + n * K;
            float acc = level[0] == 3 && normal ? dq_f8_row_bf16(row, s, xb, K, g)
                        : level[0] >= 2         ? (small ? dq_f8_row<true>(row, s, xf, K, g)
                                                         : dq_f8_row<false>(row, s, xf, K, g))
                        : small                 ? dq_f8_row_avx2<true>(row, s, xf, K, g)
                                                : dq_f8_row_avx2<false>(row, s, xf, K, g);
            out[m * N + n] = dq_bf16_rne(acc);
        }
    }
    delete[] xb;
    delete[] xf;
}
"""
_ARGTYPES = [
    "const uint8_t*", "const float*", "const uint16_t*", "uint16_t*",
    "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t*",
]  # fmt: skip


def _probe(kernel) -> int:
    level, empty = native.level_out(), torch.empty(0)
    kernel(empty, empty, empty, empty, 0, 0, 32, 32, 3, 1, level)
    return int(level)


def kernel():
    """``(the fused kernel, its best vector level here)``, built on first use; None where it cannot run."""
    return native.load("float8", _KERNEL_SOURCE, _ARGTYPES, _probe)


def kernel_prepare(qdata: torch.Tensor, scale: torch.Tensor, group: int):
    """``(codes as uint8, fp32 scales [out, in / group])`` for the fused kernel, or None where it cannot run.

    ``scale`` holds one scale per row (or one for all, broadcast) and per
    ``group`` columns. It needs an x86 CPU with AVX2 or AVX-512, ``in`` and
    ``group`` multiples of 32, and no NaN code (checked once here; the library
    caches the result per weight).
    """
    rows, cols = qdata.shape if qdata.ndim == 2 else (0, 0)
    if qdata.device.type != "cpu" or not rows or cols % 32 or group % 32 or cols % group or kernel() is None:
        return None
    codes = qdata.contiguous().view(torch.uint8)
    if bool(((codes & 0x7F) == 0x7F).any()):
        return None
    return codes, scale.float().expand(rows, cols // group).contiguous()


def _prepare(inner):
    return native.Lazy(lambda: kernel_prepare(inner["qdata"], inner["scale"], inner["qdata"].shape[-1]))


def fused_linear(x: torch.Tensor, prepared, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in bf16 through the fused kernel from :func:`kernel_prepare`'s result (bf16 ``x``); None if refused.

    ``max_level`` caps the vector path (1: AVX2, 2: AVX-512, 3: AVX-512 BF16; default: the best here).
    """
    codes, scale = prepared
    run, level = kernel()
    x = x.contiguous()
    (rows, cols), group = codes.shape, codes.shape[1] // scale.shape[1]
    if x.shape[1] != cols:
        raise ValueError(f"float8 kernel: activation width {x.shape[1]} != weight width {cols}")
    out = x.new_empty((x.shape[0], rows))
    ran = native.level_out()
    level = level if max_level is None else min(level, max_level)
    run(codes, scale, x, out, x.shape[0], rows, cols, group, level, torch.get_num_threads(), ran)
    return out if int(ran) else None  # 0: refused (flush-to-zero turned on since the probe)


def kernel_linear(x, prepared, bias):
    """``linear`` of the float8 formats, from a :class:`~dtensor_quant.native.Lazy` of :func:`kernel_prepare`."""
    if x.dtype != torch.bfloat16 or x.shape[0] > _KERNEL_MAX_TOKENS or prepared.get() is None:
        return None
    out = fused_linear(x, prepared.get())
    return out + bias if bias is not None and out is not None else out


@dataclass(frozen=True)
class Float8Rowwise(QuantFormat):
    #: The dtype of ``scale`` (None: the weight's); see the module docstring.
    scale_dtype: torch.dtype | None = None

    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (OneToOne(), Constant())}
    block_size_params = ()  # no blocks: every row and column cut is legal

    def __post_init__(self):
        dtype_param(self, "scale_dtype")

    __repr__ = compact_repr

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        return _quantize(weight, reduce(block_reduce(weight.abs(), 1, None, "max"), "max", "scale"), self.scale_dtype)

    def quantize_stochastic(self, weight, reduce, noise, dtype):
        amax = reduce(block_reduce(weight.abs(), 1, None, "max"), "max", "scale")
        return _quantize_stochastic(weight, amax, noise, self.scale_dtype or dtype)

    def dequantize(self, inner, dtype):
        return _dequantize(inner, dtype, self.scale_dtype)

    def unpack(self, inner, out):
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        return _unpack(inner, out)

    def prepare(self, inner):
        return _prepare(inner)

    def linear(self, x, prepared, bias):
        """bf16 activations, at most ``_KERNEL_MAX_TOKENS`` rows (decode): the fused kernel; else None.

        The kernel rounds each weight once, to bf16: with a ``scale_dtype`` other than bf16 that
        would skip dequantize's rounding to it, so such a weight dequantizes instead.
        """
        if self.scale_dtype not in (None, x.dtype):
            return None
        return kernel_linear(x, prepared, bias)

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")


@dataclass(frozen=True)
class Float8Tensorwise(QuantFormat):
    #: The dtype of ``scale`` (None: the weight's): compressed-tensors' per-tensor FP8 keeps it in its own dtype.
    scale_dtype: torch.dtype | None = None

    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (Constant(), Constant())}
    block_size_params = ()  # no blocks: every row and column cut is legal

    def __post_init__(self):
        dtype_param(self, "scale_dtype")

    __repr__ = compact_repr

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, None, "max")
        return _quantize(weight, reduce(amax, "max", "scale"), self.scale_dtype)

    def quantize_stochastic(self, weight, reduce, noise, dtype):
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, None, "max")
        return _quantize_stochastic(weight, reduce(amax, "max", "scale"), noise, self.scale_dtype or dtype)

    def dequantize(self, inner, dtype):
        return _dequantize(inner, dtype, self.scale_dtype)

    def unpack(self, inner, out):
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        return _unpack(inner, out)

    def prepare(self, inner):
        return _prepare(inner)

    def linear(self, x, prepared, bias):
        """bf16 activations, at most ``_KERNEL_MAX_TOKENS`` rows (decode): the fused kernel; else None.

        A ``scale_dtype`` other than the activations' dequantizes instead (see Float8Rowwise.linear).
        """
        if self.scale_dtype not in (None, x.dtype):
            return None
        return kernel_linear(x, prepared, bias)

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")
