"""Keep a tensor-parallel degree when a quantized weight cannot be cut along its columns.

A row-parallel Linear (torch's ``RowwiseParallel``) shards its weight's
columns (``Shard(1)``). A format whose blocks run along a row, or across
rows of the flattened weight (NF4's scale factors cover 16,384 consecutive
weights), can refuse that cut at a degree where it accepts a cut of the
rows (``Shard(0)``): TinyLlama's down-projection ``[2048, 5632]`` in NF4 at
TP 2 and 4. Such a layer can still be tensor-parallel as

    ColwiseParallel(input_layouts=<the row style's input>, output_layouts=<the row style's output>)

torch's ColwiseParallel wraps the incoming activation (sharded on its last
dim after a column-parallel layer) with that layout and redistributes it to
``Replicate`` (an all-gather), each rank computes its rows of the output
fully, and the output ``Shard(-1)`` is redistributed to the row style's
output layout (an all-gather for ``Replicate``; an all-to-all for
sequence parallelism's ``Shard(1)``). Every output element is computed on
one rank exactly as on one process: no partial sums, so no reordered
additions. The cost at decode is two small all-gathers instead of one
all-reduce, and a rank holds ``1/tp`` of the weight as before.

:func:`adapt_tp_plan` makes that switch for exactly the layers that need it
and says which and why; it never switches a layer whose row-parallel cut
is legal.

Where neither cut is legal because of a double-quantized format's
second-level blocks (NF4's and BnbNF4's factors of 16,384 weights:
Qwen2.5-0.5B's 896-wide attention at TP 2, column- and row-parallel alike),
it stores that weight's block scales expanded (:func:`~.expand_scales.expand_scales`:
:class:`~dtensor_quant.NF4BlockScales`, every weight the same bits, 1-3
bytes more per 64 weights) and keeps the planned style. What still cannot
be cut is refused, on every rank alike and before any collective.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .._core.format import QuantFormat
from .._core.layout import LayoutError
from .._core.tensor import QuantizedTensor
from .._ops.unpack import whole_blocks
from .._parallel.quantize import quantize
from .expand_scales import expand_scales
from .planner.cells import Layer, check
from .planner.layers import is_pattern, key_matches

log = logging.getLogger(__name__)


def adapt_tp_plan(
    model: nn.Module,
    plan: dict[str, ParallelStyle],
    tp: int | DeviceMesh,
    fmt: QuantFormat | None = None,
    kernels: bool = False,
    expand_scales: bool = True,
) -> tuple[dict[str, ParallelStyle], dict[str, str]]:
    """``plan`` with every row-parallel Linear whose weight cannot take ``Shard(1)`` at ``tp`` made column-parallel.

    ``model``: not yet parallelized; its quantized weights give their own
    format, and ``fmt`` (if given) is the format dense weights will be
    quantized to after ``parallelize_module``. ``tp``: the TP degree or the
    1-D TP mesh. Returns ``(new plan, {fqn: why})``: the switched layers, each
    with the planner's reason the row-parallel cut was refused, and the layers
    whose scales were expanded. Raises :class:`LayoutError` naming every layer
    that no cut can hold.

    ``expand_scales``: a quantized weight that neither cut can hold, but whose
    format's ``expanded_format`` can take the planned cut, is replaced in
    ``model`` by :func:`dtensor_quant.expand_scales` of it (the same values;
    False: refuse it instead). Column-parallel layers are checked for this too.

    ``kernels``: also switch a layer whose column shards are legal but not
    laid out as a fresh weight, where its format's kernel needs that
    (``kernel_needs_whole_blocks``) and its row shards are: such a shard
    would be dequantized at every call (NF4's ``wo`` [2048, 2048] at TP 2,
    whose factors span 8 whole rows).
    """
    degree = tp.size() if isinstance(tp, DeviceMesh) else int(tp)
    if isinstance(tp, DeviceMesh) and tp.ndim != 1:
        raise ValueError(f"adapt_tp_plan takes the 1-D tensor-parallel mesh, got a {tp.ndim}-D mesh {tp.mesh.shape}")
    new, switched, refused = {}, {}, []
    for key, style in plan.items():
        if type(style) not in (RowwiseParallel, ColwiseParallel) or degree == 1:
            new[key] = style
            continue
        # A key with "*" (transformers' _tp_plan: "model.layers.*.mlp.down_proj") stays one key unless
        # some module it matches is switched; then every match gets its own entry, in the same place.
        fqns = _matching(model, key) if is_pattern(key) else [key]
        styles = {
            fqn: _adapted(model, fqn, style, degree, fmt, kernels, expand_scales, switched, refused) for fqn in fqns
        }
        if all(s is style for s in styles.values()):
            new[key] = style
        else:
            new.update(styles)
    if refused:  # nothing has changed in the model yet
        raise LayoutError(
            f"no tensor-parallel cut is legal at TP {degree} for "
            + "; ".join(refused)
            + ". Choose another degree (python -m dtensor_quant plan), a smaller block size, "
            "dtensor_quant.pad_for_tp, or leave the layer unquantized or replicated."
        )
    _expand_noted(model, switched, degree)
    return new, switched


def _matching(model: nn.Module, pattern: str) -> list[str]:
    """The module names ``pattern`` matches: :func:`~.planner.layers.key_matches`, ``parallelize_module``'s rule."""
    return [name for name, _ in model.named_modules() if name and key_matches(pattern, name)]


def _adapted(model, fqn, style, degree, fmt, kernels, expand, switched, refused) -> ParallelStyle:
    """``style`` for the module ``fqn``, or its column-parallel replacement (noted in ``switched``).

    A weight no cut can hold gets its scales expanded where that makes the planned cut legal (``expand``).
    """
    module = model.get_submodule(fqn)
    if not isinstance(module, nn.Linear):  # an Embedding: row-parallel means Shard(0) there
        return style
    weight = module.weight
    if isinstance(weight, DTensor):
        raise ValueError(f"{fqn}: adapt the plan before parallelize_module (its weight is already a DTensor)")
    wfmt = weight.fmt if isinstance(weight, QuantizedTensor) else fmt
    if wfmt is None:
        return style
    shape = tuple(weight.shape)
    col = check(Layer(fqn, shape, "colwise"), wfmt, 1, degree)
    if type(style) is ColwiseParallel:
        if not col.legal:
            why = f"column-parallel: {col.why}"
            _expand_or_refuse(module, fqn, "colwise", wfmt, degree, expand, why, switched, refused)
        return style
    row = check(Layer(fqn, shape, "rowwise"), wfmt, 1, degree)
    if row.legal:
        if not (kernels and col.legal and wfmt.kernel_needs_whole_blocks):
            return style
        if _kernel_ready(shape, wfmt, degree, 1, weight.dtype) or not _kernel_ready(
            shape, wfmt, degree, 0, weight.dtype
        ):
            return style
        row = dataclasses.replace(
            row, why=f"its column shards are not laid out as a fresh weight: {wfmt}'s kernel would dequantize them"
        )
    elif not col.legal:
        why = f"row-parallel: {row.why}; column-parallel: {col.why}"
        _expand_or_refuse(module, fqn, "rowwise", wfmt, degree, expand, why, switched, refused)
        return style
    switched[fqn] = row.why
    log.info("%s: column-parallel with a gathered input at TP %d, not row-parallel: %s", fqn, degree, row.why)
    return ColwiseParallel(
        input_layouts=style.input_layouts[0] or Shard(-1),
        output_layouts=style.output_layouts[0] or Replicate(),
        use_local_output=style.use_local_output,
    )


def _expand_or_refuse(module, fqn, planned, fmt, degree, expand, why, switched, refused) -> None:
    """Note ``module.weight`` for its scales expanded where that makes the ``planned`` cut legal (``switched``
    holds the module until :func:`_expand_noted` replaces its weight); else note the refusal."""
    weight, shape = module.weight, tuple(module.weight.shape)
    wider = fmt.expanded_format()
    legal = wider is not None and check(Layer(fqn, shape, planned), wider, 1, degree).legal
    if legal and expand and isinstance(weight, QuantizedTensor):
        switched[fqn] = _Expand(module, f"scales stored expanded as {wider} (the same values): {why}")
        return
    if legal:
        how = "quantize it as" if not isinstance(weight, QuantizedTensor) else "expand_scales=True stores it as"
        why += f" ({how} {wider}, the same values, to keep TP {degree})"
    refused.append(f"{fqn} {list(shape)} in {fmt}: {why}")


@dataclasses.dataclass
class _Expand:
    module: nn.Module
    why: str


def _expand_noted(model: nn.Module, switched: dict, degree: int) -> None:
    """Replace each noted weight by its expanded scales, wherever the model holds it (a tied weight stays tied,
    expanded once however many of its holders the plan names)."""
    made: list[nn.Parameter] = []  # the replacements: a later holder of a tied weight already holds one
    for fqn, note in list(switched.items()):
        if not isinstance(note, _Expand):
            continue
        old = note.module.weight
        if not any(old is p for p in made):
            new = nn.Parameter(expand_scales(old), requires_grad=old.requires_grad)
            made.append(new)
            for m in model.modules():
                for name, p in m._parameters.items():
                    if p is old:
                        m._parameters[name] = new
        switched[fqn] = note.why
        log.info("%s: %s at TP %d", fqn, note.why, degree)


def _kernel_ready(shape, fmt: QuantFormat, tp: int, dim: int, dtype) -> bool:
    """Whether every ``tp``-way shard along ``dim`` is laid out as a fresh weight (on meta tensors: no data)."""
    q = quantize(torch.empty(shape, dtype=dtype, device="meta"), fmt)
    return all(whole_blocks(piece) for piece in torch.chunk(q, tp, dim=dim))
