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

Activations (``activations="fp8-token"``, ``"fp8-token-per-rank"``, or ``"fp8-tensor"`` with
``input_scale``; :mod:`dtensor_quant._core.activations`): ``linear`` quantizes each activation to e4m3fn as
declared, multiplies the code values (each product exact, summed in fp32; the weight dequantized in the tile
with scale 1, or an fp32 matmul of the values where the tiles cannot run; with bf16 activations the tiles'
sum comes out rounded to bf16 once before the scales) and scales the sum by ``x_scale * scale``
(compressed-tensors' ``float-quantized`` FP8 dynamic/static). Default None: weight-only.

Extremes (docs/hostile_input.md): the scale is the finite values' maximum, so
a NaN weight is NaN in its own element only (e4m3fn's NaN code), an Inf
saturates to +-448 * scale, and ``448 * scale`` is capped where rounding to the
scale's dtype, then the weight's, would overflow (``safe_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import activations, native
from .._core.format import QuantFormat, Reducer, compact_repr, dtype_param, unpack_through
from .._core.layout import Constant, OneToOne
from .._core.producers import COMPRESSED_TENSORS, ct_8bit_holds, ct_8bit_layout
from .._core.reductions import block_reduce, block_stat_abs, safe_scale, scaled_into

_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _stat(weight: torch.Tensor) -> torch.Tensor:
    """``|w|`` for the scale: its finite values only. e4m3fn codes a NaN by itself (NaN there, nowhere else) and
    an Inf saturates to +-448 * scale (torch's conversion, after the clamp)."""
    return block_stat_abs(weight, keep_nan=False)


def _quantize(weight: torch.Tensor, amax: torch.Tensor, scale_dtype=None) -> dict[str, torch.Tensor]:
    scale = safe_scale(amax, _E4M3_MAX, scale_dtype or weight.dtype, weight.dtype)
    q = (weight.float() / scale.float()).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return {"qdata": q, "scale": scale}


def _quantize_stochastic(weight: torch.Tensor, amax: torch.Tensor, noise, dtype, out_dtype=None) -> dict:
    """``_quantize`` with each code rounded at random between its two e4m3 neighbours (scale in ``dtype``).

    The nearest code decides which neighbours bracket the value (e4m3fn magnitudes
    are ordered like their 7 low bits); the value rounds to the upper one with
    probability its distance from the lower one over the gap.
    """
    scale = safe_scale(amax, _E4M3_MAX, dtype, out_dtype)
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

    torch 2.13 converts float8 to float one element at a time on CPU; one
    ``index_select`` per byte through the table is several times faster
    (docs/performance.md). The
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


# -- the kernels (float8.cpp, loaded by dtensor_quant._core.native) ----------------------------------------------------
# Each weight is float(code) * scale in fp32, rounded to bf16 for bf16 activations, as _dequantize computes it. One
# bf16 token: each weight is multiplied by x as it is made (the codes read once per token, at memory speed);
# more, or fp32 activations: the tiled matmul of native_tiles.h (each weight dequantized once into a tile in cache).
# NaN codes (0x7F, 0xFF) never reach them: prepare sends such a weight to dequantize + mm.

# The one-token kernel reads the codes once per token: from 2 tokens on the tiles, which read them once, win.
_ONE_TOKEN_MAX = 1

KERNEL = native.declare("float8", Path(__file__).with_name("float8.cpp"), native.MATMUL_PROBE | {"K": 32, "g": 32})


def kernel():
    """``(the kernels' entry point, their best vector level here)``, built on first use; None where it cannot run.
    Levels: 1 AVX2, 2 AVX-512, 3 AVX-512 BF16, 4 AMX (the tiles only)."""
    return native.load(KERNEL)


def kernel_prepare(qdata: torch.Tensor, scale: torch.Tensor, group: int):
    """``(codes as uint8, fp32 scales [out, in / group])`` for the kernels, or None where they cannot run.

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


def _matmul(x: torch.Tensor, prepared, tiles: bool, max_level: int | None, rounds: bool) -> torch.Tensor | None:
    codes, scale = prepared
    (rows, cols), group = codes.shape, codes.shape[1] // scale.shape[1]
    if x.shape[1] != cols:
        raise ValueError(f"float8 kernel: activation width {x.shape[1]} != weight width {cols}")
    rounds = rounds or x.dtype == torch.bfloat16
    return native.matmul(
        kernel(), (codes, scale), x, rows, (group,), tiles=tiles, round_weights=rounds, max_level=max_level
    )


def fused_linear(x: torch.Tensor, prepared, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in bf16 through the one-token kernel from :func:`kernel_prepare`'s result (bf16 ``x``); None if
    refused. ``max_level`` caps the vector path (1: AVX2, 2: AVX-512, 3: AVX-512 BF16; default: the best here)."""
    return _matmul(x, prepared, False, max_level, True)


def tiled_linear(x: torch.Tensor, prepared, max_level: int | None = None, rounds: bool = False) -> torch.Tensor | None:
    """``x @ W.T`` in ``x``'s dtype (bf16 or fp32) through the tiled kernel from :func:`kernel_prepare`'s result;
    None if refused. ``max_level`` as for :func:`fused_linear`, and 4: AMX (3 and 4 with bf16 ``x`` only);
    ``rounds``: every weight is rounded to bf16 even for fp32 ``x`` (a bf16 ``scale_dtype``)."""
    return _matmul(x, prepared, True, max_level, rounds)


def kernel_linear(x, prepared, bias, scale_dtype: torch.dtype | None = None):
    """``linear`` of the float8 formats, from a :class:`~dtensor_quant._core.native.Lazy` of :func:`kernel_prepare`.

    ``scale_dtype``: the dtype dequantize rounds each product to before the output's (None: none); the kernels
    round to bf16 only, so fp16 dequantizes.
    """
    inputs = native.inputs_for(x, prepared) if scale_dtype in (None, torch.float32, torch.bfloat16) else None
    if inputs is None:
        return None
    if x.dtype == torch.bfloat16 and x.shape[0] <= _ONE_TOKEN_MAX:
        out = fused_linear(x, inputs)
    else:
        out = tiled_linear(x, inputs, rounds=scale_dtype == torch.bfloat16)
    return out + bias if bias is not None and out is not None else out


# -- quantized activations: e4m3 x e4m3 products summed in fp32 --------------------------------------------------


def fp8_matmul(codes: torch.Tensor, prepared, dtype: torch.dtype) -> torch.Tensor:
    """``float(codes) @ float(W codes).T`` for e4m3fn ``[tokens, in]`` codes: each product exact, summed in fp32.

    The codes' values go to :func:`values_matmul`, in bf16 for bf16 activations (``dtype``; exact), else fp32.
    """
    wide = dtype if dtype == torch.bfloat16 else torch.float32
    values = torch.empty(codes.shape, dtype=wide, device=codes.device)
    if table_fits(values):
        codes_into(codes, values)
    else:
        values.copy_(codes)
    return values_matmul(values, prepared)


def values_matmul(values: torch.Tensor, prepared) -> torch.Tensor:
    """``values @ float(W codes).T`` for activation code values (bf16 or fp32, each an e4m3 value).

    The tiled float8 kernel with unit scales (each weight dequantized in the tile): for bf16 ``values`` the sum
    comes out rounded once to bf16, the tiles' output (AVX-512 BF16 / AMX speed); for fp32 it stays fp32. Where
    the tiles cannot run: an fp32 matmul of the code values.
    """
    w_codes, unit = prepared
    inputs = native.inputs_for(values, unit)
    out = _matmul(values, inputs, True, None, values.dtype == torch.bfloat16) if inputs is not None else None
    if out is not None:
        return out
    w = torch.empty(w_codes.shape, dtype=torch.float32, device=w_codes.device)
    if table_fits(w):
        codes_into(w_codes, w)
    else:
        w.copy_(w_codes)
    return values.float() @ w.t()


def _prepare_activations(inner):
    """``(codes, Lazy of the tiled kernel's inputs with unit scales)`` for :func:`fp8_matmul`."""
    q = inner["qdata"]
    unit = torch.ones((q.shape[0], 1), dtype=torch.float32, device=q.device)
    return q, native.Lazy(lambda: kernel_prepare(q, unit, q.shape[-1]))


# The passes around the product for fp8 activations (float8_a8.cpp): each token quantized to e4m3 and written as
# the values the tiles multiply, in one pass; the scales applied to the tiles' sums in one pass.
A8_KERNEL = native.declare(
    "float8_a8", Path(__file__).with_name("float8_a8.cpp"), {"max_level": native.BEST_LEVEL, "threads": 1}
)
_A8_QUANTIZE, _A8_EPILOGUE, _A8_WHOLE = 1, 2, 3  # stages (3: all of it on AMX, the codes in acc's place)
# its flags: native.F32 and activations.kernel_statistic's
_EMPTY = torch.empty(0)


def a8_kernel():
    """``(the fp8-activation kernel, its best level here)``, built on first use; None where it cannot run.
    Levels: 1 plain C++, 2 AVX-512, 4 AMX (the whole linear in one call)."""
    return native.load(A8_KERNEL)


def fp8_native(x, matmul_inputs, w_scale, scheme, input_scale, loaded=None, max_level: int | None = None):
    """:func:`fp8_linear` without the bias through the fp8-activation kernel ``loaded`` (default:
    :func:`a8_kernel`) around :func:`values_matmul`, or None where it cannot run (no kernel, activations not
    bf16/fp32 on the CPU). ``w_scale``: the weight's scales as fp32 ``[out]``."""
    if loaded is None:
        loaded = a8_kernel()
    if loaded is None or x.dtype not in native.TILE_DTYPES or x.device.type != "cpu" or not x.shape[1]:
        return None
    run, best = loaded
    level = min(best, native.cap() if max_level is None else max_level)
    x = x.contiguous()
    (tokens, k), n = x.shape, w_scale.shape[0]
    stat, flags = activations.kernel_statistic(x, scheme, input_scale)  # under TP: the maxima of the whole row
    flags |= native.F32 if x.dtype == torch.float32 else 0
    # x_scale and ran are read back within this call only: per-thread scratch, not an allocation per call
    x_scale = native.scratch((tokens, 1), torch.float32)
    ran = native.scratch((1,), torch.int64)  # the level the kernel ran (it always writes it)
    threads = torch.get_num_threads()
    whole = native.inputs_for(x, matmul_inputs[1]) if level >= 4 and x.dtype == torch.bfloat16 else None
    if whole is not None:  # AMX: the three passes in one call, the tiles' sums scaled as they leave the tiles
        out = torch.empty((tokens, n), dtype=x.dtype)  # the codes go straight to the tiles: no values tensor
        run(x, stat, w_scale, _EMPTY, x_scale, whole[0], out, tokens, n, k, _A8_WHOLE, flags, level, threads, ran)
        if ran.item():
            return out
    values = torch.empty((tokens, k), dtype=x.dtype)
    run(x, stat, w_scale, values, x_scale, _EMPTY, _EMPTY, tokens, n, k, _A8_QUANTIZE, flags, level, threads, ran)
    if not ran.item():
        return None
    acc = values_matmul(values, matmul_inputs)
    if acc.dtype != x.dtype:  # the fp32 matmul where the tiles could not run, for bf16 activations
        return activations.scale_output(acc, x_scale, w_scale, x.dtype)
    out = torch.empty((tokens, n), dtype=x.dtype)
    run(x, stat, w_scale, values, x_scale, acc, out, tokens, n, k, _A8_EPILOGUE, flags, level, threads, ran)
    return out


def fp8_linear(fmt, x, prepared, bias):
    """``x @ W.T + bias`` with ``x`` quantized to e4m3 as ``fmt`` declares (the reference arithmetic of
    :func:`dtensor_quant._core.activations.reference_linear`, the sum through :func:`values_matmul`): through
    :func:`fp8_native` where it runs, else in torch."""
    scale, matmul_inputs, native_inputs = prepared
    scheme = fmt.activation_scheme
    out = None
    if native_inputs is not None and native_inputs[1] is not None:
        out = fp8_native(x, matmul_inputs, native_inputs[0], scheme, fmt.input_scale, native_inputs[1])
    if out is None:
        codes, x_scale = activations.quantize_activation(x, scheme, fmt.input_scale)
        out = activations.scale_output(fp8_matmul(codes, matmul_inputs, x.dtype), x_scale, scale, x.dtype)
    return out + bias if bias is not None else out


class _Activations:
    """The activation fields' checks, shared by both float8 formats (their dataclass fields are their own)."""

    def _check_activations(self):
        activations.parse(type(self).__name__, self.activations, self.input_scale, "fp8")
        if self.input_scale is not None:
            object.__setattr__(self, "input_scale", float(self.input_scale))

    @property
    def activation_scheme(self):
        return activations.SCHEMES.get(self.activations)

    def prepare(self, inner):
        if self.activations is not None:
            scale = inner["scale"]
            loaded = a8_kernel() if scale.device.type == "cpu" else None
            w_scale = scale.float().reshape(-1).expand(inner["qdata"].shape[0]).contiguous()
            return scale, _prepare_activations(inner), (w_scale, loaded)
        return _prepare(inner)

    def linear(self, x, prepared, bias):
        """bf16 or fp32 activations, up to ``native.TILES_MAX_TOKENS`` rows: the kernels; else None. With an
        activation scheme: :func:`fp8_linear`, always.

        The kernels round each weight at most once, to bf16: a bf16 ``scale_dtype`` rounds there whatever the
        activations; an fp16 one would round to fp16 first, so such a weight dequantizes instead.
        """
        if self.activations is not None:
            return fp8_linear(self, x, prepared, bias)
        return kernel_linear(x, prepared, bias, self.scale_dtype)


@dataclass(frozen=True)
class Float8Rowwise(_Activations, QuantFormat):
    #: The dtype of ``scale`` (None: the weight's); see the module docstring.
    scale_dtype: torch.dtype | None = None
    #: How ``linear`` quantizes its activation (None: weight-only); see the module docstring.
    activations: str | None = None
    #: The static scheme's per-tensor activation scale.
    input_scale: float | None = None

    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (OneToOne(), Constant())}
    block_size_params = ()  # no blocks: every row and column cut is legal

    producer_notes = {COMPRESSED_TENSORS: "Float8Rowwise"}
    producer_holds = ct_8bit_holds(layout, "float")

    def producer_layout(self, producer, dtype):
        """compressed-tensors: fp8 e4m3, channel (``float-quantized``); the scales in the model's dtype."""
        return ct_8bit_layout(self, producer, dtype, torch.float8_e4m3fn, "float")

    def __post_init__(self):
        dtype_param(self, "scale_dtype")
        self._check_activations()

    __repr__ = compact_repr

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        return _quantize(weight, reduce(block_reduce(_stat(weight), 1, None, "max"), "max", "scale"), self.scale_dtype)

    def quantize_stochastic(self, weight, reduce, noise, dtype):
        amax = reduce(block_reduce(_stat(weight), 1, None, "max"), "max", "scale")
        return _quantize_stochastic(weight, amax, noise, self.scale_dtype or dtype, dtype)

    def dequantize(self, inner, dtype):
        return _dequantize(inner, dtype, self.scale_dtype)

    def unpack(self, inner, out):
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        return _unpack(inner, out)

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")


@dataclass(frozen=True)
class Float8Tensorwise(_Activations, QuantFormat):
    #: The dtype of ``scale`` (None: the weight's): compressed-tensors' per-tensor FP8 keeps it in its own dtype.
    scale_dtype: torch.dtype | None = None
    #: How ``linear`` quantizes its activation (None: weight-only); see the module docstring.
    activations: str | None = None
    #: The static scheme's per-tensor activation scale.
    input_scale: float | None = None

    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (Constant(), Constant())}
    block_size_params = ()  # no blocks: every row and column cut is legal

    producer_notes = {COMPRESSED_TENSORS: "Float8Tensorwise"}
    producer_holds = ct_8bit_holds(layout, "float")

    def producer_layout(self, producer, dtype):
        """compressed-tensors: fp8 e4m3, tensor (``float-quantized``); the scale in the model's dtype."""
        return ct_8bit_layout(self, producer, dtype, torch.float8_e4m3fn, "float")

    def __post_init__(self):
        dtype_param(self, "scale_dtype")
        self._check_activations()

    __repr__ = compact_repr

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        amax = block_reduce(block_reduce(_stat(weight), 1, None, "max"), 0, None, "max")
        return _quantize(weight, reduce(amax, "max", "scale"), self.scale_dtype)

    def quantize_stochastic(self, weight, reduce, noise, dtype):
        amax = block_reduce(block_reduce(_stat(weight), 1, None, "max"), 0, None, "max")
        return _quantize_stochastic(weight, reduce(amax, "max", "scale"), noise, self.scale_dtype or dtype, dtype)

    def dequantize(self, inner, dtype):
        return _dequantize(inner, dtype, self.scale_dtype)

    def unpack(self, inner, out):
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        return _unpack(inner, out)

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")
