"""Error bounds for a float result computed two ways: another kernel, summation order or reduction length.

A floating-point sum depends on its order, and the order is the library's
choice: MKL blocks an fp32 GEMM one way under AVX-512 (and AMX) and another
under AVX2, oneDNN's bf16 GEMM differs again, a longer zero-padded reduction
or a row-parallel all-reduce regroups the terms, and a fused kernel sums in
its own order. So two computations of the same matmul are compared against a
bound derived from the summation; bit-exact comparisons are kept for bytes
and for the same computation (the same op on the same operands).

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
2002, sections 3.1 and 3.5): a sum of ``K`` products evaluated in any order --
recursive, blocked, pairwise, with or without FMA -- in a float format of unit
roundoff ``u`` differs from the exact value by at most
``gamma_K * sum_i |a_i * b_i|`` with ``gamma_K = K u / (1 - K u)``. A result
then rounded to a narrower dtype (a bf16 output of an fp32 accumulation) adds
one rounding, ``u_out * |value|``. Two computations that each satisfy the bound
differ by at most twice it. The bound is computed from the actual operands (in
float64), so it is as tight as the data allows and holds on every CPU.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next float of ``dtype`` (2**-24 for fp32, 2**-8 for bf16)."""
    return torch.finfo(dtype).eps / 2


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """``k u / (1 - k u)``: the relative error bound of a ``k``-term sum in ``dtype``, in any order."""
    ku = k * unit_roundoff(dtype)
    if ku >= 1:
        raise ValueError(f"a {k}-term sum in {dtype} has no useful error bound (k * u = {ku:.3g} >= 1)")
    return ku / (1 - ku)


def linear_error_bound(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    accumulate: torch.dtype = torch.float32,
    weight_error: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """Elementwise bound (float64) on ``|computed F.linear(x, w, bias) - exact|`` for any summation order.

    ``x`` is ``[..., K]``, ``w`` the dense ``[N, K]`` weight values the computation multiplies (a
    quantized weight's ``dequantize()``), ``bias`` ``[N]``. The products are summed in ``accumulate``
    (fp32 on every CPU path of torch and of this library, bf16 and fp16 inputs included) and the
    result rounded to ``out_dtype`` (default: ``x``'s dtype). ``weight_error`` bounds how far the
    weight values a kernel uses may be from ``w`` (absolute, elementwise or scalar): a weight-only
    int8 kernel scales the integer sum instead of multiplying by the rounded dequantized weights.
    """
    xa, wa = x.detach().double().abs(), w.detach().double().abs()
    terms = xa @ wa.transpose(-2, -1)
    k = x.shape[-1]
    if bias is not None:
        terms = terms + bias.detach().double().abs()
        k += 1
    bound = gamma(k, accumulate) * terms
    if not isinstance(weight_error, float) or weight_error:
        we = weight_error.double() if isinstance(weight_error, torch.Tensor) else torch.tensor(weight_error).double()
        bound = bound + xa @ we.expand_as(wa).transpose(-2, -1)
    out = out_dtype or x.dtype
    if unit_roundoff(out) > unit_roundoff(accumulate):
        exact = x.detach().double() @ w.detach().double().transpose(-2, -1)
        if bias is not None:
            exact = exact + bias.detach().double()
        bound = bound + unit_roundoff(out) * (exact.abs() + bound)
    return bound


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """``|actual - expected| <= bound`` elementwise, compared in float64, with the worst element named."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual.detach().double() - expected.detach().double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    over = ~(diff <= bound)  # NaN counts as over
    if over.any():
        ratio = torch.where(over, diff / bound.clamp_min(torch.finfo(torch.float64).tiny), 0)
        i = int(ratio.reshape(-1).argmax())
        at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), diff.shape))
        raise AssertionError(
            f"{what}: {int(over.sum())} of {diff.numel()} elements differ by more than the bound; worst at {at}: "
            f"|{actual.reshape(-1)[i].item():.9g} - {expected.reshape(-1)[i].item():.9g}| = "
            f"{diff.reshape(-1)[i].item():.3g} > {bound.reshape(-1)[i].item():.3g}"
        )


__all__ = ["assert_within", "gamma", "linear_error_bound", "unit_roundoff"]
