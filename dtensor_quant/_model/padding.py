"""Zero-padding that makes a tensor-parallel degree legal when a block size forbids it.

Qwen2-72B's MLP is 29568 wide: 231 groups of 128, so int4 g128 shards its
down-projection's columns (row-parallel) only at TP 1. Padding the
intermediate dimension to 29696 (232 groups) makes TP 2, 4 and 8 legal and
changes no output of a SwiGLU MLP ``down(silu(gate(x)) * up(x))``: the padded
rows of gate and up give ``silu(0) * 0 = 0`` (``0`` with a zero bias), and the
padded columns of down multiply those zeros. Gate/up rows and down columns
are padded together; padding one without the other would change the shapes
the forward sees.

Exactness. The padded hidden units are exact zeros and the original bytes
are untouched, so the padded model's output sums the same nonzero products as
the unpadded one's, plus exact zeros. It is bit-identical only where the
matmul sums the longer reduction in the same order -- which the CPU's GEMM
decides (MKL blocks 29696 fp32 terms otherwise than 29568 under AVX-512 and
AMX, not under AVX2) -- and within the summation's rounding bound everywhere;
a tensor-parallel output likewise, the all-reduce summing the ranks' partial
products in another order, as for any row-parallel layer. Quantized
formats whose statistics are per block (int8/float8 per row, int4 per group)
quantize the original rows and columns exactly as before, and their all-zero
padding blocks dequantize to exact zeros (checked when padding). A format
with a statistic over the whole weight (NF4's mean, a per-tensor scale) would
quantize the original part differently after padding: padding such a
quantized weight is refused, and padding it before quantizing gives a model
equal to the padded dense one, not to the unpadded quantized one.

The padding is recorded on the MLP module as a persistent buffer
``tp_padding = [original, padded]``, so checkpoints of a padded model hold it
and a model must be padded the same way before it loads one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard

# MLP_NAMES, the (gate, up, down) child names of the SwiGLU MLPs of HF transformers and of gpt-fast/torchtitan,
# and PADDING_BUFFER, the buffer that records the padding, live with dq.hf (it saves and loads padded MLPs unpadded).
from .._checkpoint.hf.tensors import MLP_NAMES, PADDING_BUFFER
from .._core.format import QuantFormat, check_shape
from .._core.layout import LayoutError
from .._core.tensor import QuantizedTensor
from .._ops.layout_ops import cat_dim
from .._parallel.placements import dim_alignment, first_bad_cut
from .._parallel.quantize import quantize

# How far past the original length the search for a legal one goes (in units of the degree).
SEARCH_STEPS = 4096


@functools.lru_cache(maxsize=4096)
def legal_length(
    shape: tuple[int, ...], dim: int, fmt: QuantFormat, mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> int | None:
    """The smallest length ``>= shape[dim]`` of ``dim`` that ``placements`` cut into equal, legal shards.

    Equal shards, because uneven ones cost DTensor extra padding collectives
    and other engines (vLLM, SGLang) load only even ones; the original length
    is kept if it is already legal, even or not. None when nothing within
    ``SEARCH_STEPS`` times the mesh size is legal.
    """
    ways = _prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Shard) and p.dim % len(shape) == dim)
    if _fits(shape, fmt, mesh_shape, placements):
        return shape[dim]
    start = -(-shape[dim] // ways) * ways
    for n in range(start, start + SEARCH_STEPS * ways + 1, ways):
        # Equal shards: every boundary is a multiple of n / ways, so that must be a multiple of the
        # alignment the padded weight's layout needs (arithmetic; the full check confirms it).
        trial = shape[:dim] + (n,) + shape[dim + 1 :]
        try:
            check_shape(fmt, trial)
        except ValueError:
            continue
        if (n // ways) % dim_alignment(fmt, trial, dim) == 0 and _fits(trial, fmt, mesh_shape, placements):
            return n
    return None


def _fits(shape, fmt, mesh_shape, placements) -> bool:
    try:
        check_shape(fmt, shape)
    except ValueError:
        return False
    return first_bad_cut(shape, fmt, mesh_shape, placements) is None


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def mlp_padding(intermediate: int, hidden: int, fmt: QuantFormat, tp: int) -> int | None:
    """The smallest intermediate size ``>= intermediate`` at which a SwiGLU MLP is legal at ``tp``.

    Gate/up ``[I, H]`` are column-parallel (``Shard(0)``), down ``[H, I]``
    row-parallel (``Shard(1)``); both must be legal at the same ``I``.
    """
    n = intermediate
    for _ in range(SEARCH_STEPS):
        a = legal_length((n, hidden), 0, fmt, (tp,), (Shard(0),))
        b = legal_length((hidden, n), 1, fmt, (tp,), (Shard(1),))
        if a is None or b is None:
            return None
        if a == b:
            return a
        n = max(a, b)
    return None


def find_mlps(model: nn.Module, names: Sequence[tuple[str, str, str]] = MLP_NAMES):
    """``(fqn, module, (gate, up, down))`` for every module with three Linear children so named."""
    for fqn, module in model.named_modules():
        for trio in names:
            children = [getattr(module, n, None) for n in trio]
            if all(isinstance(c, nn.Linear) for c in children):
                yield fqn, module, tuple(children)
                break


def pad_for_tp(
    model: nn.Module, tp_degree: int, fmt: QuantFormat, names: Sequence[tuple[str, str, str]] = MLP_NAMES
) -> dict[str, tuple[int, int]]:
    """Zero-pad every SwiGLU MLP of ``model`` whose intermediate size ``fmt`` cannot shard at ``tp_degree``.

    Works on dense or quantized (not yet distributed) weights, in place, on
    any device -- meta too (a model built there to load a checkpoint into);
    returns ``{mlp fqn: (original, padded)}`` for the MLPs it padded. Then
    ``parallelize_module`` with gate/up column-parallel and down row-parallel
    works at ``tp_degree``. Raises ``ValueError`` before changing anything if
    an MLP cannot be padded exactly (see the module docstring).
    """
    plans = []
    for fqn, module, (gate, up, down) in find_mlps(model, names):
        inter, hidden = gate.out_features, gate.in_features
        if up.out_features != inter or down.in_features != inter:
            raise ValueError(
                f"{fqn}: gate {tuple(gate.weight.shape)}, up {tuple(up.weight.shape)}, down "
                f"{tuple(down.weight.shape)} do not form a SwiGLU MLP"
            )
        for lin in (gate, up, down):
            if isinstance(lin.weight, DTensor):
                raise ValueError(f"{fqn}: pad the MLP before distributing it (its weights are already DTensors)")
        padded = mlp_padding(inter, hidden, fmt, tp_degree)
        if padded is None:
            raise ValueError(
                f"{fqn}: no intermediate size up to {inter + SEARCH_STEPS * tp_degree} makes {fmt} legal for "
                f"gate/up rows and down columns at TP {tp_degree} (check_placements on the padded shapes says why)"
            )
        if padded != inter:
            plans.append((fqn, module, gate, up, down, inter, padded))
    new, originals = {}, {}
    for fqn, module, gate, up, down, inter, padded in plans:  # compute every new weight before changing any
        originals[fqn] = original_size(module, inter, fqn)
        new[fqn] = [zero_padded(lin.weight, dim, padded, fqn) for lin, dim in ((gate, 0), (up, 0), (down, 1))]
    done = {}
    for fqn, module, gate, up, down, inter, padded in plans:
        for lin, w in zip((gate, up, down), new[fqn]):
            lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
        for lin in (gate, up):
            lin.out_features = padded
            if lin.bias is not None:
                bias = F.pad(lin.bias.detach(), (0, padded - inter))
                lin.bias = nn.Parameter(bias, requires_grad=lin.bias.requires_grad)
        down.in_features = padded
        original = originals[fqn]
        # A real (CPU) buffer even in a model built on meta: its value is known now, and materializing
        # a meta model (to_empty on meta tensors only, as dtensor_quant.hf does) keeps real buffers.
        module.register_buffer(PADDING_BUFFER, torch.tensor([original, padded], dtype=torch.int64, device="cpu"))
        done[fqn] = (original, padded)
    return done


def original_size(module: nn.Module, size: int, fqn: str) -> int:
    """The size before any padding (an MLP's intermediate size, a vocabulary): the recorded one if padded already.

    ``size`` is the current one, returned when ``module`` records no padding.
    """
    if not hasattr(module, PADDING_BUFFER):
        return size
    recorded = module.get_buffer(PADDING_BUFFER)
    if recorded.is_meta:
        raise ValueError(
            f"{fqn}: its {PADDING_BUFFER} buffer (the original intermediate size of an earlier padding) is on the "
            "meta device, so its value is unknown; load or set it before padding again"
        )
    return int(recorded[0])


def zero_padded(w: torch.Tensor, dim: int, length: int, where: str) -> torch.Tensor:
    """``w`` with zeros appended along ``dim`` up to ``length``: dense by F.pad, quantized by whole new blocks.

    Raises ``ValueError`` (``where`` names the weight) when a quantized
    weight cannot be padded without changing its original blocks.
    """
    w = w.detach()
    amount = length - w.shape[dim]
    if not isinstance(w, QuantizedTensor):
        return F.pad(w, (0, amount) if dim == 1 else (0, 0, 0, amount))
    shape = list(w.shape)
    shape[dim] = amount
    zeros = quantize(torch.zeros(shape, dtype=w.dtype, device=w.device), w.fmt)
    # Whether the format's zeros are exact zeros needs values: on the CPU for a weight on meta.
    values = zeros if not zeros.is_meta else quantize(torch.zeros(shape, dtype=w.dtype), w.fmt)
    if values.dequantize().count_nonzero():
        raise ValueError(f"{where}: {w.fmt} does not quantize zeros to exact zeros; cannot pad it exactly")
    full = list(w.shape)
    full[dim] = length
    why = (
        f"{where}: padding a quantized {w.fmt} weight along dim {dim} would not keep its blocks and add new "
        "ones (a statistic over the whole weight, or a layout that changes with the width). Pad the dense "
        "model before quantizing."
    )
    try:
        out = cat_dim([w, zeros], dim)
    except (LayoutError, RuntimeError):  # RuntimeError: the pieces' inner tensors do not even line up
        raise ValueError(why) from None
    if out.rels != tuple(w.fmt.layout_for(full).values()):
        raise ValueError(why)
    return out
