"""Store a double-quantized weight's block scales as they are: the same values, more cuts allowed.

NF4 and BnbNF4 quantize their per-block scales once more, sharing one
second-level scale over ``block_size * 256`` consecutive weights of the
flattened weight. Where a row is no multiple of that (Qwen2.5-0.5B's 896
columns: a second-level block spans 18.3 rows) a tensor-parallel cut of
the rows lands inside one, and no cut of the columns is possible at all.
:func:`expand_scales` converts such a weight to its format's
``expanded_format`` (:class:`~dtensor_quant.NF4BlockScales`): the codes as
they are and each block's scale as the format's dequantize computes it, so
every weight dequantizes to the same bits -- nothing is requantized -- and
only the ``block_size`` blocks constrain a cut. It costs 1 (NF4, bf16
scales) or 3 (BnbNF4, float32) bytes more per 64 weights.
"""

from __future__ import annotations

from itertools import product

import torch
from torch.distributed.tensor import DTensor

from .._core.format import weight_layout
from .._core.tensor import QuantizedTensor
from .._ops.layout_ops import canonical_dims
from .._parallel.shard_quant import wrap_quantized


def expand_scales(weight: torch.Tensor) -> QuantizedTensor:
    """``weight`` (a quantized ``[..., out, in]`` weight, not a view of one) in ``weight.fmt.expanded_format()``.

    Every element dequantizes to the same bits; the result shares ``weight``'s
    codes (no copy), its scales are new. Raises ``ValueError`` for a
    format without an expanded one, a DTensor (expand before
    ``parallelize_module``, or the ``full_tensor()``), and a view or slice
    (expand the weight it came from).
    """
    if isinstance(weight, DTensor):
        raise ValueError(
            "expand_scales takes a whole quantized weight, not a DTensor: expand it before parallelize_module or "
            "distribute_tensor (dtensor_quant.adapt_tp_plan does it for the layers that need it), or expand its "
            "full_tensor()"
        )
    if not isinstance(weight, QuantizedTensor):
        raise ValueError(f"expand_scales takes a quantized weight, got a dense {type(weight).__name__}")
    fmt, shape = weight.fmt, tuple(weight.shape)
    expanded = fmt.expanded_format()
    if expanded is None:
        raise ValueError(f"{fmt} has one level of scales: there is nothing to expand")
    fresh = weight_layout(fmt, shape)
    if weight.rels != tuple(fresh[n] for n in fmt.inner_names) or weight.dims != canonical_dims(len(shape)):
        raise ValueError(
            f"expand_scales takes a {fmt} weight laid out as quantized, not a view or slice of one (this one has "
            f"shape {list(shape)} and a {'transposed' if weight.dims[-1] != (len(shape) - 1,) else 'cut'} layout): "
            "expand the weight it came from"
        )
    if 0 in shape[:-2]:
        raise ValueError(f"expand_scales: the {list(shape)} expert stack holds no matrix")
    inner, lead = weight.inner, shape[:-2]
    # each [out, in] matrix of an expert stack on its own, as the format quantized it
    given = [{n: t[i] for n, t in inner.items()} for i in product(*map(range, lead))]
    pieces = [fmt.expand_inner(g, shape[-2:]) for g in given]
    out = {}
    for n in expanded.inner_names:
        if n in inner and all(p[n] is g[n] for p, g in zip(pieces, given)):
            out[n] = inner[n]  # passed through unchanged (the codes): the stack's own tensor, not a copy
        else:
            out[n] = torch.stack([p[n] for p in pieces]).unflatten(0, lead) if lead else pieces[0][n]
    return wrap_quantized(expanded, out, shape, weight.dtype, shape)
