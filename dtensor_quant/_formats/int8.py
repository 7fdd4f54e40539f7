"""Int8Rowwise: symmetric int8 with one scale per output row.

Layout: ``qdata`` int8 ``[out, in]`` follows both dims one-to-one; ``scale``
``[out, 1]`` (the weight's dtype, or ``scale_dtype``) follows rows and is
constant along ``in``. So any row or column sharding is legal, and quantizing
a column-sharded weight all-reduces the row maxima.

Math: ``w ~= q * scale``, in float32, rounded once to the output dtype; with
``scale_dtype`` rounded to it first, then converted (compressed-tensors'
``int-quantized`` checkpoints: int8 ``weight`` and bf16 ``weight_scale``
``[out, 1]``, dequantized as ``q.to(bf16) * scale``).

Activations (``activations="int8-token"``, ``"int8-token-per-rank"``, or ``"int8-tensor"`` with
``input_scale``; :mod:`dtensor_quant._core.activations`): ``linear`` quantizes each activation to int8 as
declared, multiplies the codes in int32 (``torch._int_mm``, exact) and scales the sum by ``x_scale * scale``
(W8A8: compressed-tensors' ``int-quantized`` with ``input_activations``). Default None: weight-only.

Extremes (docs/hostile_input.md): the scale is the row's finite maximum, so
an Inf saturates to +-127 * scale and a NaN makes its row NaN (int8 has no NaN
code); ``127 * scale`` is capped at the largest scale-dtype value finite in the
weight's dtype (``safe_scale``), so finite weights never dequantize to Inf.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import activations, native
from .._core.format import QuantFormat, Reducer, compact_repr, dtype_param, unpack_through
from .._core.layout import Constant, OneToOne
from .._core.producers import COMPRESSED_TENSORS, ct_8bit_holds, ct_8bit_layout
from .._core.reductions import block_reduce, block_stat_abs, canonical_nan, safe_scale, scaled_into
from .._core.stochastic import Noise

_QMAX = 127
# torch 2.13's CPU kernel is vectorized for bf16 only: in fp32/fp16 it runs slower than dequantize + mm
# (docs/performance.md), so fp32 takes the tiles and fp16 dequantizes.
_KERNEL_DTYPES = (torch.bfloat16,)


def _has_kernel(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    key = {"cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key)


# floor(u + w / s) clamped to +-127 (NaN to 0) with u the hash noise of each element's global index:
# the torch expression of quantize_stochastic in one pass, the same bits (addcdiv divides, then adds).
SR_KERNEL = native.declare("int8_stochastic", Path(__file__).with_name("int8_stochastic.cpp"), {"gcols": 1})


def sr_codes(weight: torch.Tensor, scale: torch.Tensor, noise: Noise) -> torch.Tensor | None:
    """The stochastically rounded int8 codes of float32 ``weight`` ``[rows, cols]`` with float32 row ``scale``
    from the C++ kernel, or None where it cannot run (given noise values, not the CPU, no compiler)."""
    if noise.values is not None or weight.device.type != "cpu" or weight.ndim != 2 or len(noise.offsets) != 2:
        return None
    loaded = native.load(SR_KERNEL)
    if loaded is None:
        return None
    run, _ = loaded
    w, s = weight.contiguous(), scale.reshape(-1).contiguous()
    out = torch.empty(w.shape, dtype=torch.int8)
    row0, col0 = noise.offsets
    run(
        w,
        s,
        out,
        w.shape[0],
        w.shape[1],
        noise.key,
        row0,
        col0,
        noise.global_shape[1],
        int(noise.wide),
        native.level_out(),
    )
    return out


# Two one-pass helpers of the training path (int8_rows.h), the bits of their torch expressions: each row's largest
# finite |w| (NaN if any; ``block_reduce(block_stat_abs(w), 1, None, "max")``) and float32 values ``float(q) * s``
# (``unpack``).
ROWS_KERNELS = {  # int8_rows.h's two helpers, an entry point each
    name: native.declare(f"int8_{name}", Path(__file__).with_name(f"int8_{name}.cpp"))
    for name in ("row_absmax", "values")
}


def _row_absmax(weight: torch.Tensor) -> torch.Tensor:
    """Each row's largest finite ``|w|`` as float32 ``[rows, 1]``, NaN where the row has one (int8 has no NaN code;
    an Inf saturates to +-127 * scale without costing its row its precision)."""
    loaded = native.load(ROWS_KERNELS["row_absmax"]) if weight.device.type == "cpu" and weight.ndim == 2 else None
    if loaded is None:
        return block_reduce(block_stat_abs(weight), 1, None, "max")
    w = weight.float().contiguous()
    out = torch.empty((w.shape[0], 1), dtype=torch.float32)
    loaded[0](w, out, w.shape[0], w.shape[1], native.level_out())
    return canonical_nan(out)


def _scale(weight: torch.Tensor, reduce: Reducer, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Each row's ``amax / 127`` in ``dtype``, its products finite in ``out_dtype`` too (the weight's)
    (rows cut into column shards reduce their maxima)."""
    return safe_scale(reduce(_row_absmax(weight), "max", "scale"), _QMAX, dtype, out_dtype)


def int_matmul(codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """``codes @ w_codes.T`` of int8 ``[tokens, in]`` and ``[out, in]``, exact: int32 (int64 past int32's reach).

    ``torch._int_mm`` (CPU: VNNI/AMX through oneDNN, any shape; CUDA needs ``tokens > 16`` and multiples of 8);
    where it refuses, or ``in`` is long enough for an int32 sum to overflow, a float64 matmul of the codes, exact
    below 2**53.
    """
    if codes.shape[1] == 1:  # an outer product; torch 2.13's CPU _int_mm misreads [m, 1] operands (strides 1, 1)
        return codes.int() * w_codes.int().t()
    if codes.shape[1] <= _INT32_SAFE_K:
        try:
            return torch._int_mm(codes, w_codes.t())
        except RuntimeError:
            pass
    return (codes.double() @ w_codes.double().t()).to(torch.int64)


_INT32_SAFE_K = (2**31 - 1) // (128 * 128)  # |code products| <= 128 * 128: an int32 sum of this many never overflows


# The W8A8 kernel (int8_w8a8.cpp): the activation quantized per token in one pass, the epilogue in one pass, and
# on AMX-INT8 the whole linear with the products in tiles; each step the bits of the reference arithmetic.
W8A8_KERNEL = native.declare(
    "int8_w8a8", Path(__file__).with_name("int8_w8a8.cpp"), {"max_level": native.BEST_LEVEL, "threads": 1}
)
# its stages; its flags: native.F32 and activations.kernel_statistic's
_QUANTIZE, _EPILOGUE, _WHOLE, _MAXIMA = 1, 2, 3, 4


def w8a8_kernel():
    """``(the W8A8 kernel, its best level here)``, built on first use; None where it cannot run. Levels: 1 AVX2,
    2 AVX-512 (quantize and epilogue, torch's ``_int_mm`` between them), 4 AMX-INT8 (the whole linear)."""
    return native.load(W8A8_KERNEL)


def w8a8_native(x, q, w_scale, scheme, input_scale, loaded=None, max_level: int | None = None):
    """:func:`w8a8_linear` without the bias through the W8A8 kernel ``loaded`` (default: :func:`w8a8_kernel`), or
    None where it cannot run (no kernel, an activation dtype other than bf16/fp32, ``in`` past int32's exact
    reach). ``w_scale``: the weight's scales as fp32 ``[out]``; ``max_level`` caps the vector level (default:
    ``DTENSOR_QUANT_MAX_LEVEL``). The kernel's buffers are made here, once per call: this runs for every token
    batch of a prefill, so it stays lean."""
    if loaded is None:
        loaded = w8a8_kernel()
    k = x.shape[1]
    if loaded is None or x.dtype not in native.TILE_DTYPES or x.device.type != "cpu" or not 0 < k <= _INT32_SAFE_K:
        return None
    run, best = loaded
    level = min(best, native.cap() if max_level is None else max_level)
    x = x.contiguous()
    tokens, n = x.shape[0], q.shape[0]
    # under TP: the maxima of the whole row, this rank's taken by the kernel's own pass (stage 4)
    maxima = functools.partial(local_token_absmax, run, level) if scheme.dynamic and not scheme.per_rank else None
    stat, flags = activations.kernel_statistic(x, scheme, input_scale, maxima)
    flags |= native.F32 if x.dtype == torch.float32 else 0
    # x_scale and ran are read back within this call only: per-thread scratch, not an allocation per call
    x_scale = native.scratch((tokens, 1), torch.float32)
    out = torch.empty((tokens, n), dtype=x.dtype)
    ran = native.scratch((1,), torch.int64)  # the level the kernel ran (it always writes it)
    threads = torch.get_num_threads()
    if level >= 4 and not k % 64:
        run(x, stat, q, w_scale, _EMPTY, x_scale, _EMPTY, out, tokens, n, k, _WHOLE, flags, level, threads, ran)
        if ran.item():
            return out
    codes = torch.empty((tokens, k), dtype=torch.int8)
    run(x, stat, q, w_scale, codes, x_scale, _EMPTY, out, tokens, n, k, _QUANTIZE, flags, level, threads, ran)
    if not ran.item():
        return None
    acc = int_matmul(codes, q)
    if acc.dtype != torch.int32:  # torch's int8 mm refused: the float64 sum, scaled by the reference's epilogue
        return activations.scale_output(acc, x_scale, w_scale, x.dtype)
    run(x, stat, q, w_scale, codes, x_scale, acc, out, tokens, n, k, _EPILOGUE, flags, level, threads, ran)
    return out


_EMPTY = torch.empty(0)


def local_token_absmax(run, level: int, x: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |x|`` of a contiguous bf16/fp32 ``x`` as fp32 ``[tokens, 1]``: the value of
    :func:`activations.token_absmax_local` (NaN kept, sign bits clear), in the W8A8 kernel's one pass (stage 4)
    in place of torch's five ops (26 us against a few at 32 x 2816 bf16 tokens). A new tensor: the reduction
    all-reduces it in place and the kernel reads it after."""
    tokens, k = x.shape
    amax = torch.empty(tokens, dtype=torch.float32)
    ran = native.scratch((1,), torch.int64)
    flags = native.F32 if x.dtype == torch.float32 else 0
    run(x, _EMPTY, _EMPTY, _EMPTY, _EMPTY, amax, _EMPTY, _EMPTY, tokens, 0, k, _MAXIMA, flags, level, 1, ran)
    return amax.view(tokens, 1) if ran.item() else activations.token_absmax_local(x)


def w8a8_linear(x, q, scale, scheme, input_scale, bias, native_inputs=None):
    """``x @ W.T + bias`` with ``x`` quantized to int8 as ``scheme`` says: the reference arithmetic of
    :func:`dtensor_quant._core.activations.reference_linear`, through the W8A8 kernel (:func:`w8a8_native`;
    ``native_inputs`` the weight's fp32 scales and the loaded kernel, from ``prepare``) where it runs, else in
    torch with the integer sum through :func:`int_matmul`."""
    out = None
    if native_inputs is not None and native_inputs[1] is not None:
        out = w8a8_native(x, q, native_inputs[0], scheme, input_scale, native_inputs[1])
    if out is None:
        codes, x_scale = activations.quantize_activation(x, scheme, input_scale)
        out = activations.scale_output(int_matmul(codes, q), x_scale, scale, x.dtype)
    return out + bias if bias is not None else out


@dataclass(frozen=True)
class Int8Rowwise(QuantFormat):
    #: The dtype of ``scale`` (None: the weight's); see the module docstring.
    scale_dtype: torch.dtype | None = None
    #: How ``linear`` quantizes its activation (None: weight-only); see the module docstring.
    activations: str | None = None
    #: The static scheme's per-tensor activation scale.
    input_scale: float | None = None

    layout = {
        "qdata": (OneToOne(), OneToOne()),
        "scale": (OneToOne(), Constant()),
    }
    block_size_params = ()  # no blocks: every row and column cut is legal

    producer_notes = {COMPRESSED_TENSORS: "Int8Rowwise"}
    producer_holds = ct_8bit_holds(layout, "int")

    def producer_layout(self, producer, dtype):
        """compressed-tensors: int8, channel, symmetric (``int-quantized``); the scales in the model's dtype."""
        return ct_8bit_layout(self, producer, dtype, torch.int8, "int")

    def __post_init__(self):
        dtype_param(self, "scale_dtype")
        activations.parse(type(self).__name__, self.activations, self.input_scale, "int8")
        if self.input_scale is not None:
            object.__setattr__(self, "input_scale", float(self.input_scale))

    __repr__ = compact_repr

    @property
    def activation_scheme(self):
        return activations.SCHEMES.get(self.activations)

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        scale = _scale(weight, reduce, self.scale_dtype or weight.dtype, weight.dtype)
        q = torch.round(weight.float() / scale.float()).clamp(-_QMAX, _QMAX).to(torch.int8)
        return {"qdata": q, "scale": scale}

    def quantize_stochastic(self, weight, reduce, noise, dtype):
        """``floor(noise + w / scale)``: the scale of ``quantize``, the codes rounded at random.

        On the CPU a kernel draws the noise and rounds in one pass (:func:`sr_codes`); the same bits.
        """
        scale = _scale(weight, reduce, self.scale_dtype or dtype, dtype)
        q = sr_codes(weight.float(), scale.float(), noise)
        if q is None:
            q = torch.addcdiv(noise.uniform(), weight.float(), scale.float()).floor_().clamp_(-_QMAX, _QMAX)
            q = q.nan_to_num_(0.0).to(torch.int8)
        return {"qdata": q, "scale": scale}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        values = inner["qdata"].float() * inner["scale"].float()
        return (values.to(self.scale_dtype) if self.scale_dtype else values).to(dtype)

    def unpack(self, inner, out):
        if self.scale_dtype is not None and out.dtype != self.scale_dtype:
            return unpack_through(self, inner, out, self.scale_dtype)
        q, scale = inner["qdata"], inner["scale"]
        loaded = (
            native.load(ROWS_KERNELS["values"]) if out.dtype == torch.float32 and out.device.type == "cpu" else None
        )
        if loaded is not None and out.is_contiguous() and out.ndim == 2:
            q, s = q.contiguous(), scale.float().reshape(-1).contiguous()
            loaded[0](q, s, out, out.shape[0], out.shape[1], native.level_out())
            return True
        scaled_into(q, scale, out)
        return True

    def prepare(self, inner):
        """``(codes, scales)`` for torch's int8 mm, and a :class:`~dtensor_quant._core.native.Lazy` of the tiled
        kernel's inputs (int8.cpp), built by the first call that runs it."""
        q, scale = inner["qdata"].contiguous(), inner["scale"].reshape(-1).contiguous()
        if self.activations is not None:  # the W8A8 kernel's inputs in place of the tiles'
            loaded = w8a8_kernel() if q.device.type == "cpu" else None
            return q, scale, (scale.float().contiguous(), loaded)
        return q, scale, native.Lazy(functools.partial(_tile_inputs, q, scale))

    def linear(self, x, prepared, bias):
        """With an activation scheme: :func:`w8a8_linear`, always. Weight-only: bf16 activations of up to
        ``_TORCH_MAX_TOKENS`` rows: ``aten._weight_int8pack_mm`` (per-row scale;
        CPU, CUDA if built in, untested here; any count on CUDA); more rows, or fp32 activations: the tiled kernel
        (int8.cpp); else None (dequantize + mm)."""
        q, scale, tile_inputs = prepared
        if self.activations is not None:
            return w8a8_linear(x, q, scale, self.activation_scheme, self.input_scale, bias, tile_inputs)
        tokens = x.shape[0]
        # The CPU kernel reads past the row end (segfaults on torch 2.13) unless in % 8 == 0.
        if (
            x.dtype in _KERNEL_DTYPES
            and self.scale_dtype in (None, x.dtype)  # torch's kernel rounds the scales to the activations' dtype
            and (tokens <= _TORCH_MAX_TOKENS or x.device.type != "cpu")
            and 0 not in q.shape
            and not q.shape[1] % 8
            and _has_kernel(x.device.type)
        ):
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
            return out + bias if bias is not None else out
        # The tiles round each weight at most once, to bf16: a bf16 scale_dtype rounds there whatever the
        # activations; an fp16 one would round to fp16 first, so such a weight dequantizes.
        if self.scale_dtype not in (None, torch.float32, torch.bfloat16):
            return None
        inputs = native.inputs_for(x, tile_inputs)
        if inputs is None:
            return None
        out = tiled_linear(x, inputs, rounds=self.scale_dtype == torch.bfloat16)
        return out + bias if bias is not None and out is not None else out

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")


# torch's int8 kernel reads the weight once per token: from 2 tokens on the tiles, which read it once, win.
_TORCH_MAX_TOKENS = 1

KERNEL = native.declare("int8", Path(__file__).with_name("int8.cpp"), native.MATMUL_PROBE)


def kernel():
    """``(the tiled kernel, its best vector level here)``, built on first use; None where it cannot run.
    Levels: 1 AVX2, 2 AVX-512, 3 AVX-512 BF16, 4 AMX (the tiles only)."""
    return native.load(KERNEL)


def _tile_inputs(q: torch.Tensor, scale: torch.Tensor):
    """``(codes, scales in fp32)`` for the tiled kernel, or None where it cannot run (``in % 32``, not a CPU,
    no kernel here)."""
    if q.device.type != "cpu" or q.ndim != 2 or 0 in q.shape or q.shape[1] % 32 or kernel() is None:
        return None
    return q, scale.float().contiguous()


def tiled_linear(x: torch.Tensor, prepared, max_level: int | None = None, rounds: bool = False) -> torch.Tensor | None:
    """``x @ W.T`` in ``x``'s dtype (bf16 or fp32) through the tiled kernel; None if refused. ``max_level`` caps
    the vector path (1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX, bf16 ``x`` only); ``rounds``: every weight is rounded
    to bf16 even for fp32 ``x`` (a bf16 ``scale_dtype``)."""
    codes, scale = prepared
    if x.shape[1] != codes.shape[1]:
        raise ValueError(f"int8 kernel: activation width {x.shape[1]} != weight width {codes.shape[1]}")
    return native.matmul(
        kernel(),
        (codes, scale),
        x,
        codes.shape[0],
        (),
        tiles=True,
        round_weights=rounds or x.dtype == torch.bfloat16,
        max_level=max_level,
    )
