"""Quantized activations: how a format's matmul quantizes its input, declared as part of the format.

A weight-only format multiplies the activation as it comes. A format may
instead declare an activation scheme (``Int8Rowwise(activations="int8-token")``):
its ``linear`` then quantizes each activation as declared and multiplies the
codes, so the arithmetic the checkpoint's producer specified (compressed-tensors'
``input_activations``) is the one served. The scheme is a field of the format,
so it is part of the format's identity, its repr, its checkpoint record and
every derived op, like the layout.

The schemes (``SCHEMES``), each the reference arithmetic of
:func:`reference_linear`:

* ``"int8-token"``: symmetric per-token dynamic int8. Each row ``t`` of ``x``
  has ``s_t = absmax_t / 127`` (fp32), codes ``clamp(round(x / s_t), -128, 127)``;
  ``y = float(sum_k qx * qw) * s_t * w_scale``, the sum exact in int32, rounded
  once to the output dtype (vLLM's ``scaled_int8_quant`` and W8A8 GEMM).
* ``"fp8-token"``: per-token dynamic e4m3: ``s_t = absmax_t / 448``, codes
  ``clamp(x / s_t, +-448)`` rounded to e4m3fn; the products of two e4m3 values
  are exact in fp32 and their sum is an fp32 sum (within the bound of
  :mod:`dtensor_quant.testing.bounds`), then scaled as above.
* ``"int8-tensor"`` / ``"fp8-tensor"``: static per-tensor: one ``input_scale``
  (a format parameter, calibrated by the producer, ``input_scale`` in
  compressed-tensors) for every token; no statistics.
* ``"...-token-per-rank"``: the dynamic schemes with each rank's statistic taken
  from its own slice of a row-parallel layer's input (vLLM's behaviour under
  tensor parallelism), explicitly. Without the suffix, the per-token absmax is
  reduced over the mesh dims that cut the reduction dim before quantizing
  (:func:`token_stat_reduction`, installed by
  :mod:`dtensor_quant._parallel.activation_stats`), so tensor parallelism
  quantizes every token exactly as one process does.

A row whose absmax is 0 takes scale 1 (codes 0, output 0); a NaN or Inf in a
row makes that row's output NaN (its scale is NaN or Inf; with a static scale
the row's scale is made NaN): nothing is clipped silently into finite numbers.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActivationScheme:
    """One declared activation scheme (see the module docstring)."""

    spelling: str
    codes: str  # "int8" or "fp8"
    dynamic: bool  # per-token statistics at run time; else one static input_scale
    per_rank: bool = False  # dynamic only: the statistic of this rank's slice, not reduced

    @property
    def qmin(self) -> float:
        return -128.0 if self.codes == "int8" else -448.0

    @property
    def qmax(self) -> float:
        return 127.0 if self.codes == "int8" else 448.0

    @property
    def exact(self) -> bool:
        """Whether the matmul of the codes is exact (integer): kernels then equal the reference bit for bit."""
        return self.codes == "int8"


SCHEMES = {
    s.spelling: s
    for s in (
        ActivationScheme("int8-token", "int8", True),
        ActivationScheme("int8-token-per-rank", "int8", True, per_rank=True),
        ActivationScheme("int8-tensor", "int8", False),
        ActivationScheme("fp8-token", "fp8", True),
        ActivationScheme("fp8-token-per-rank", "fp8", True, per_rank=True),
        ActivationScheme("fp8-tensor", "fp8", False),
    )
}


def parse(fmt_name: str, spelling: str | None, input_scale, codes: str) -> ActivationScheme | None:
    """The scheme a format declares (None: weight-only), checked; ``ValueError`` saying what exists.

    ``codes`` is the code kind the format's weights multiply with (``"int8"``, ``"fp8"``).
    """
    valid = sorted(s for s, sch in SCHEMES.items() if sch.codes == codes)
    if spelling is None:
        if input_scale is not None:
            raise ValueError(
                f"{fmt_name}: input_scale={input_scale!r} needs a static activation scheme "
                f"(activations='{codes}-tensor'); weight-only formats take none"
            )
        return None
    scheme = SCHEMES.get(spelling)
    if scheme is None or scheme.codes != codes:
        raise ValueError(
            f"{fmt_name}: activations={spelling!r} is not a scheme of this format; it takes one of {valid} "
            "or None (weight-only)"
        )
    if scheme.dynamic and input_scale is not None:
        raise ValueError(
            f"{fmt_name}: activations={spelling!r} computes its scale per token; input_scale={input_scale!r} is "
            f"for the static scheme '{codes}-tensor'"
        )
    if not scheme.dynamic:
        if isinstance(input_scale, bool) or not isinstance(input_scale, (int, float)):
            raise ValueError(
                f"{fmt_name}: activations={spelling!r} is static and needs input_scale, a positive float (the "
                f"checkpoint's input_scale); got {input_scale!r}"
            )
        if not (math.isfinite(input_scale) and input_scale > 0):
            raise ValueError(f"{fmt_name}: input_scale must be finite and positive; got {input_scale!r}")
    declare(scheme)
    return scheme


def declare(scheme: ActivationScheme | None) -> None:
    """A format holding ``scheme`` exists in this process (built, or unpickled on a rank): the first reduced
    dynamic scheme runs the :func:`on_reduced_scheme` hooks."""
    if scheme is not None and scheme.dynamic and not scheme.per_rank and not _DECLARED:
        _DECLARED.append(True)
        while _ON_REDUCED:
            _ON_REDUCED.pop()()


_ON_REDUCED: list[Callable[[], None]] = []
_DECLARED: list[bool] = []  # non-empty once a reduced scheme was declared


def on_reduced_scheme(hook: Callable[[], None]) -> None:
    """Call ``hook()`` once, when the process first declares a dynamic scheme whose statistic is reduced.

    How the layer above installs the tensor-parallel reduction
    (:mod:`dtensor_quant._parallel.activation_stats`) without changing torch at import.
    """
    if _DECLARED:
        hook()
    else:
        _ON_REDUCED.append(hook)


# -- per-token statistics and their reduction under tensor parallelism -----------------------------------------

_LOCAL = threading.local()


@contextlib.contextmanager
def token_stat_reduction(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside the block, every dynamic per-token absmax (``[tokens, 1]`` fp32) goes through ``reduce`` first.

    What a row-parallel matmul installs around its local product: ``reduce``
    all-reduces the maxima over the mesh dims that cut the reduction dim, so
    each rank quantizes with the statistic of the whole row.
    """
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(reduce)
    try:
        yield
    finally:
        stack.pop()


def reducing() -> bool:
    """Whether a :func:`token_stat_reduction` block is open in this thread (a row-parallel matmul's)."""
    return bool(getattr(_LOCAL, "stack", None))


def token_absmax(x: torch.Tensor, scheme: ActivationScheme) -> torch.Tensor:
    """Each row's ``max |x|`` as fp32 ``[tokens, 1]`` (NaN if the row has one), reduced as the scheme says.

    Every sign bit of the result is clear (``+0``, never ``-0``; NaN too), as
    :func:`dtensor_quant._core.reductions.reduce_magnitude_max` needs to reduce the bits as they are."""
    amax = token_absmax_local(x)
    stack = getattr(_LOCAL, "stack", None)
    if stack and not scheme.per_rank:
        amax = stack[-1](amax)
    return amax


def token_absmax_local(x: torch.Tensor) -> torch.Tensor:
    """:func:`token_absmax` of this rank's ``x`` alone (no reduction): fp32 ``[tokens, 1]``, sign bits clear."""
    magnitude = _MAGNITUDE_BITS.get(x.dtype)
    if not x.shape[-1]:
        amax = x.new_zeros((x.shape[0], 1), dtype=torch.float32)
    elif magnitude is not None:
        # The largest of the bit patterns with the sign cleared: an IEEE float's bits sort as its value when
        # it is not negative, and every NaN's above +inf, so one integer pass gives max |x| exactly, NaN kept
        # (for bf16 several times faster than torch's amax and amin, which run at every row-parallel matmul).
        itype, mask = magnitude
        amax = x.view(itype).bitwise_and(mask).amax(-1, keepdim=True).view(x.dtype).float()
    else:  # max |x| as max(max x, -min x): exact in x's dtype, no |x| copy; NaN kept; then the sign bit cleared
        amax = torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_()).float()
        amax = amax.view(torch.int32).bitwise_and(0x7FFFFFFF).view(torch.float32)
    return amax


_MAGNITUDE_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}

# The flag bits of the activation kernels (int8_w8a8.cpp, float8_a8.cpp) that say where the scale comes from.
GIVEN_MAXIMA = 2  # ``stat`` holds each token's max |x| (reduced over the mesh): the kernel takes it, not its own
STATIC_SCALE = 4  # ``stat`` holds the static input_scale
_NO_STAT = torch.empty(0)


def kernel_statistic(
    x: torch.Tensor, scheme: ActivationScheme, input_scale, local_absmax: Callable | None = None
) -> tuple[torch.Tensor, int]:
    """``(stat, flag bits)`` for a format's activation kernel, the same for every code kind.

    A static scheme: its ``input_scale`` (fp32 ``[1]``) and :data:`STATIC_SCALE`. A dynamic scheme inside a
    :func:`token_stat_reduction` block (a row-parallel matmul, the scheme not per-rank): the reduced
    per-token maxima (fp32 ``[tokens]``) and :data:`GIVEN_MAXIMA`. Otherwise nothing: the kernel takes each
    token's maximum in its own quantizing pass.

    ``local_absmax(x)``, where given, computes this rank's maxima as :func:`token_absmax` does before it reduces
    them (fp32, ``[tokens]`` or ``[tokens, 1]``, every sign bit clear) -- a kernel's one pass in place of
    torch's several.
    """
    if not scheme.dynamic:
        return torch.full((1,), float(input_scale), dtype=torch.float32), STATIC_SCALE
    stack = getattr(_LOCAL, "stack", None)  # reducing(), inlined: this runs every call
    if not scheme.per_rank and stack:
        amax = token_absmax(x, scheme) if local_absmax is None else stack[-1](local_absmax(x))
        return amax.reshape(-1).contiguous(), GIVEN_MAXIMA
    return _NO_STAT, 0


def quantize_activation(x: torch.Tensor, scheme: ActivationScheme, input_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a 2-D activation: int8 or float8_e4m3fn codes ``[tokens, in]``, fp32 scale.

    The scale is ``[tokens, 1]`` for the dynamic schemes, ``[1, 1]`` for the static ones.
    """
    if scheme.dynamic:
        amax = token_absmax(x, scheme)
        scale = torch.where(amax == 0, 1.0, amax / scheme.qmax)
    else:
        scale = torch.full((1, 1), float(input_scale), dtype=torch.float32, device=x.device)
        bad = ~x.isfinite().all(-1, keepdim=True)
        if bool(bad.any()):  # a token holding NaN or Inf: its row NaN, as a dynamic scale makes it
            scale = torch.where(bad, float("nan"), scale.expand(x.shape[0], 1))
    v = torch.div(x, scale)  # fp32: x promoted exactly, then divided
    if scheme.codes == "int8":
        # int8 has no NaN code: a NaN quotient (a NaN or Inf scale, or 0 / 0 under a scale that underflowed) is
        # code 0, its row's non-finite scale carrying the NaN to the output
        codes = v.round_().clamp_(scheme.qmin, scheme.qmax).nan_to_num_(0.0).to(torch.int8)
    else:
        codes = v.clamp_(scheme.qmin, scheme.qmax).to(torch.float8_e4m3fn)
    return codes, scale


def scale_output(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float(acc) * x_scale * w_scale`` in fp32, rounded once to ``dtype``: the epilogue of every scheme.

    ``acc`` is the ``[tokens, out]`` sum of code products (int32 or fp32), ``x_scale`` ``[tokens, 1]`` or
    ``[1, 1]``, ``w_scale`` the weight's stored scale ``[out, 1]`` or ``[1, 1]`` (any dtype: read as fp32).
    """
    out = torch.mul(acc, x_scale).mul_(w_scale.float().reshape(1, -1))  # acc promoted to fp32 exactly first
    return out if out.dtype == dtype else out.to(dtype)


def reference_linear(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: ActivationScheme,
    input_scale=None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scheme's reference arithmetic for ``x @ W.T + bias`` (2-D ``x``), spelled out in plain torch.

    int8: the code products summed exactly (in float64, exact below 2**53, then int32); fp8: the code values'
    products summed in fp64 and rounded to fp32 (closer to the exact sum than any fp32 order). Then
    :func:`scale_output` and the bias in the output dtype. Kernels are checked against it: bit for bit for
    int8, within the fp32 summation bound for fp8.
    """
    codes, x_scale = quantize_activation(x, scheme, input_scale)
    acc = codes.double() @ w_codes.double().t()
    acc = acc.to(torch.int32) if scheme.exact else acc.float()
    out = scale_output(acc, x_scale, w_scale, x.dtype)
    return out + bias if bias is not None else out
