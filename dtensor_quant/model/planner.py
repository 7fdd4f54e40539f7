"""Which tensor-parallel and FSDP degrees a quantized model can take -- decided before any data exists.

    python -m dtensor_quant plan --format int4:128 --shape 4096x4096:rowwise --shape 11008x4096:colwise --tp 1 2 3 4 8
    python -m dtensor_quant plan --format int4:128 --model dtensor_quant.testing.tiny_llama:build \\
        --tp-plan examples/tp_inference.py:tp_plan --tp 1 2 3 4 --dp 1 2

    >>> print(plan([("wo", (4096, 4096), "rowwise")], Int4Groupwise(128), tp=[2, 3]))

For every Linear weight ``[out, in]`` and every mesh ``(dp, tp)`` it checks the
placements the weight would get, with the same rule DTensor, FSDP2 and DCP
are held to (:func:`~dtensor_quant.check_placements`): tensor parallelism
shards the weight's rows (column-parallel, ``Shard(0)``) or its columns
(row-parallel, ``Shard(1)``) on the tp dim; FSDP2 shards dim 0 on the dp dim
(a ``_StridedShard`` when tensor parallelism already shards dim 0). FSDP2
pads uneven dim-0 shards; it cannot shard other dims unevenly, which is why
it is only ever asked for dim 0 here.

A refused degree is explained: where the cut falls, the alignment the
layout needs and which inner tensor needs it, the nearest legal degrees, and,
for a format with a block size, the largest block size that would be legal.
Legal cells show the bytes the largest shard holds on one rank.

Fused expert stacks ``[E, out, in]`` (mixture-of-experts layers) are planned
too: with ``ep`` > 1 a leading mesh dim of that size shards their experts
(``Shard(0)``, expert parallelism; 2-D weights are replicated over it), tensor
parallelism shards inside every expert (``colwise``: its out dim, ``rowwise``:
its in dim) and FSDP2 shards the experts within each expert-parallel group.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..core.format import QuantFormat, Reducer, check_shape, weight_layout
from ..core.layout import MAX_LISTED_MESH_SIZE
from ..dist.placements import first_bad_cut
from .padding import legal_length
from .quantize_model import is_matmul_weight

STYLES = {"colwise": Shard(0), "rowwise": Shard(1)}


@dataclass(frozen=True)
class Layer:
    name: str
    shape: tuple[int, ...]  # [out, in], or [experts, out, in] for a fused expert stack
    style: str  # "colwise" or "rowwise" (of each [out, in] matrix)


@dataclass(frozen=True)
class Cell:
    """One layer on one mesh: legal with ``nbytes`` per rank, or refused ``why`` with ``alternatives``."""

    dp: int
    tp: int
    placements: tuple[Placement, ...]
    nbytes: int | None = None
    why: str | None = None
    alternatives: str | None = None
    padding: tuple[int, int, int] | None = None  # (dim, padded length, extra bytes of the whole weight)

    @property
    def legal(self) -> bool:
        return self.why is None


@dataclass
class Plan:
    fmt: QuantFormat
    meshes: list[tuple[int, int]]
    rows: list[tuple[Layer, list[Cell]]]
    ep: int = 1  # expert-parallel degree of the expert stacks

    @property
    def refusals(self) -> list[tuple[Layer, Cell]]:
        return [(layer, c) for layer, cells in self.rows for c in cells if not c.legal]

    def total_bytes(self, dp: int, tp: int) -> int | None:
        """Bytes of every planned weight on one rank (None if a layer is refused on this mesh)."""
        cells = [c for _, cells in self.rows for c in cells if (c.dp, c.tp) == (dp, tp)]
        return None if any(not c.legal for c in cells) else sum(c.nbytes for c in cells)

    def __str__(self) -> str:
        return render(self)


def _placements(style: str, dp: int, tp: int, ndim: int = 2) -> tuple[Placement, Placement]:
    lead = ndim - 2  # expert dims in front of the matrix
    tp_p = Shard(STYLES[style].dim + lead) if tp > 1 else Replicate()
    if dp == 1:
        return Replicate(), tp_p
    fsdp = _StridedShard(0, split_factor=tp) if tp > 1 and style == "colwise" and not lead else Shard(0)
    return fsdp, tp_p


def _mesh_and_placements(layer: Layer, dp: int, tp: int, ep: int):
    """The mesh and placements of ``layer``; with ``ep`` > 1 a leading expert-parallel mesh dim."""
    placements = _placements(layer.style, dp, tp, len(layer.shape))
    if ep == 1:
        return (dp, tp), placements
    return (ep, dp, tp), (Shard(0) if len(layer.shape) > 2 else Replicate(), *placements)


def _local_shape(shape, mesh, placements) -> tuple[int, ...]:
    """The largest local shard (rank 0's: torch.chunk puts the remainder last)."""
    local = list(shape)
    for n, p in zip(mesh, placements):
        if isinstance(p, (Shard, _StridedShard)):
            local[p.dim] = -(-local[p.dim] // n)
    return tuple(local)


def stored_bytes(fmt: QuantFormat, shape: Sequence[int], dtype=torch.bfloat16, full_shape=None) -> int:
    """Bytes ``fmt`` stores for a shard of ``shape`` of a ``full_shape`` weight: its quantize, on a meta tensor."""
    if 0 in shape:
        return 0
    experts = 1
    for n in shape[:-2]:  # an expert stack stores each matrix as the 2-D format does
        experts *= n
    full = tuple(full_shape or shape)[-2:]
    inner = fmt.quantize(torch.empty(tuple(shape[-2:]), dtype=dtype, device="meta"), Reducer(full))
    return experts * sum(t.numel() * t.element_size() for t in inner.values())


def check(layer: Layer, fmt: QuantFormat, dp: int, tp: int, ep: int = 1) -> Cell:
    return _check(tuple(layer.shape), layer.style, fmt, dp, tp, ep)


@functools.lru_cache(maxsize=65536)
def _check(shape: tuple[int, ...], style: str, fmt: QuantFormat, dp: int, tp: int, ep: int = 1) -> Cell:
    """One verdict per (shape, style, format, mesh): a model repeats a few shapes many times."""
    layer = Layer("", shape, style)
    mesh, placements = _mesh_and_placements(layer, dp, tp, ep)
    try:
        check_shape(fmt, shape)
    except ValueError as e:  # the format cannot hold the weight at all (e.g. odd columns for int4)
        return Cell(dp, tp, placements, why=str(e), alternatives="leave this layer unquantized (filter_fn)")
    if first_bad_cut(shape, fmt, mesh, placements) is not None:  # check_placements' rule, without its message
        return Cell(
            dp,
            tp,
            placements,
            why=_why(layer, fmt, mesh, placements),
            alternatives=_alternatives(layer, fmt, mesh, placements),
            padding=_padding(layer, fmt, mesh, placements),
        )
    local = _local_shape(shape, mesh, placements)
    return Cell(dp, tp, placements, nbytes=stored_bytes(fmt, local, full_shape=shape))


def _why(layer: Layer, fmt: QuantFormat, mesh, placements) -> str:
    dim, bad, factor = first_bad_cut(layer.shape, fmt, mesh, placements)
    layout = weight_layout(fmt, layer.shape)
    needs = ", ".join(f"'{n}' is {rels[dim]}" for n, rels in layout.items() if rels[dim].factor > 1)
    what = {len(layer.shape) - 2: "rows", len(layer.shape) - 1: "columns"}.get(dim, "experts")
    return (
        f"the {layer.shape[dim]} {what} are cut at {what[:-1]} {bad}, not a multiple of {factor} ({needs}; dim {dim})"
    )


def _legal_at(layer: Layer, fmt: QuantFormat, dp: int, tp: int, ep: int = 1) -> bool:
    """Whether ``layer`` is legal on mesh (dp, tp) with the placements the planner gives that mesh.

    FSDP's ``_StridedShard`` takes the tp size as its split factor and tp 1 is
    no tensor parallelism at all, so a resized mesh gets its own placements.
    """
    return first_bad_cut(layer.shape, fmt, *_mesh_and_placements(layer, dp, tp, ep)) is None


def nearest_degrees(
    layer: Layer, fmt: QuantFormat, dp: int, tp: int, which: str, limit: int, ep: int = 1
) -> tuple[int | None, int | None]:
    """The nearest legal sizes below and above the current one of mesh dim ``which`` ("tp" or "dp").

    Searched outward from the current size, so a large mesh costs only the
    sizes between it and its nearest legal neighbours; above stops at ``limit``.
    """
    now = tp if which == "tp" else dp
    below = above = None
    for step in range(1, max(now, limit - now) + 1):
        for n in (now - step, now + step):
            if not 1 <= n <= limit or (n < now and below is not None) or (n > now and above is not None):
                continue
            if _legal_at(layer, fmt, *((dp, n) if which == "tp" else (n, tp)), ep):
                below, above = (n, above) if n < now else (below, n)
        if below is not None and above is not None:
            break
    return below, above


def _alternatives(layer: Layer, fmt: QuantFormat, mesh, placements) -> str:
    dim = first_bad_cut(layer.shape, fmt, mesh, placements)[0]
    dp, tp = mesh[-2:]
    ep = mesh[0] if len(mesh) == 3 else 1
    out = []
    for mesh_dim, name in ((len(mesh) - 1, "tp"), (len(mesh) - 2, "dp")):
        p = placements[mesh_dim]
        if not isinstance(p, (Shard, _StridedShard)) or p.dim != dim:
            continue
        now = mesh[mesh_dim]
        limit = max(MAX_LISTED_MESH_SIZE, 2 * now)
        below, above = nearest_degrees(layer, fmt, dp, tp, name, limit, ep)
        near = [str(x) for x in (below, above) if x is not None]
        text = f"nearest legal {name}: {' or '.join(near) if near else 'none'}"
        if above is None:
            text += f" (none above {now} up to {limit}, where the search stops)"
        out.append(text)
    smaller = _smaller_block(layer, fmt, mesh, placements)
    if smaller:
        out.append(f"{smaller} would be legal here")
    colwise = dataclasses.replace(layer, style="colwise")
    if layer.style == "rowwise" and len(layer.shape) == 2 and tp > 1 and _legal_at(colwise, fmt, dp, tp, ep):
        out.append(f"or keep tp={tp} with this layer column-parallel on a gathered input (dtensor_quant.adapt_tp_plan)")
    return "; ".join(out)


def _padding(layer: Layer, fmt: QuantFormat, mesh, placements) -> tuple[int, int, int] | None:
    """The smallest zero-padding of the refused dim that makes this mesh legal: (dim, length, extra bytes)."""
    if len(layer.shape) > 2:  # padding is planned for 2-D SwiGLU weights, not expert stacks
        return None
    dim = first_bad_cut(layer.shape, fmt, mesh, placements)[0]
    length = legal_length(tuple(layer.shape), dim, fmt, tuple(mesh), tuple(placements))
    if length is None:
        return None
    return dim, length, padding_cost(tuple(layer.shape), dim, length, fmt)


def padding_cost(shape: tuple[int, int], dim: int, length: int, fmt: QuantFormat) -> int:
    """Bytes ``fmt`` stores for a ``shape`` weight padded along ``dim`` to ``length``, minus unpadded."""
    padded = list(shape)
    padded[dim] = length
    return stored_bytes(fmt, tuple(padded)) - stored_bytes(fmt, tuple(shape))


def _smaller_block(layer: Layer, fmt: QuantFormat, mesh, placements) -> QuantFormat | None:
    """The same format with the largest smaller block size (one of ``fmt.block_size_params``) that this mesh allows.

    Only down to a quarter of the current size: smaller blocks cost more in scales than they are worth.
    """
    if not dataclasses.is_dataclass(fmt):
        return None
    for name in fmt.block_size_params:
        value = getattr(fmt, name)
        if not isinstance(value, int):
            continue
        size = value // 2
        while size >= max(1, value // 4):
            try:
                candidate = dataclasses.replace(fmt, **{name: size})
                check_shape(candidate, layer.shape)
                if first_bad_cut(layer.shape, candidate, mesh, placements) is None:
                    return candidate
                size //= 2
            except ValueError:
                size //= 2
    return None


def layers_of(model: nn.Module, tp_plan: dict | None = None, styles: dict[str, str] | None = None) -> list[Layer]:
    """The Linear layers of ``model`` with their TP style (from a torch TP plan or ``styles``; else both)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = dict(styles or {})
    for fqn, style in (tp_plan or {}).items():
        if isinstance(style, ColwiseParallel):
            styles[fqn] = "colwise"
        elif isinstance(style, RowwiseParallel):
            styles[fqn] = "rowwise"
    out = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            shape = (module.out_features, module.in_features)
            out += [Layer(fqn, shape, s) for s in ([styles[fqn]] if fqn in styles else STYLES)]
            continue
        for name, p in module.named_parameters(recurse=False):  # fused expert stacks [E, out, in]
            if is_matmul_weight(module, name, p):
                key = f"{fqn}.{name}" if fqn else name
                out += [Layer(key, tuple(p.shape), s) for s in ([styles[key]] if key in styles else STYLES)]
    return out


def _as_layers(source) -> list[Layer]:
    if isinstance(source, nn.Module):
        return layers_of(source)
    out = []
    for i, item in enumerate(source):
        if isinstance(item, Layer):
            out.append(item)
        elif len(item) in (2, 3) and all(isinstance(v, int) for v in item):  # a bare (out, in) or (E, out, in)
            out += [Layer(f"layer{i}", tuple(item), s) for s in STYLES]
        else:
            name, shape, *style = item
            out += [Layer(name, tuple(shape), s) for s in (style or STYLES)]
    return out


def plan(
    source: nn.Module | Iterable,
    fmt: QuantFormat,
    tp: Sequence[int] = (1, 2, 4, 8),
    dp: Sequence[int] = (1,),
    tp_plan: dict | None = None,
    ep: int = 1,
) -> Plan:
    """Check every layer of ``source`` on every mesh ``(dp, tp)``.

    ``source``: a model (its ``nn.Linear`` layers; build it on the meta device
    to avoid allocating), or a list of ``(out, in)``, ``(name, (out, in))`` or
    ``(name, (out, in), "colwise"|"rowwise")``; a shape ``(experts, out,
    in)`` is a fused expert stack. Layers without a style are planned both
    ways; ``tp_plan`` (torch ParallelStyles by module name) gives a model's
    styles. ``ep`` > 1 shards every expert stack's experts over a leading
    mesh dim of that size (expert parallelism) and replicates 2-D weights over it.
    """
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    layers = layers_of(source, tp_plan) if isinstance(source, nn.Module) else _as_layers(source)
    for layer in layers:
        if layer.style not in STYLES:
            raise ValueError(f"{layer.name}: style must be one of {list(STYLES)}, got {layer.style!r}")
    meshes = [(d, t) for d in dp for t in tp]
    return Plan(fmt, meshes, [(layer, [check(layer, fmt, d, t, ep) for d, t in meshes]) for layer in layers], ep)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _label(dp: int, tp: int) -> str:
    return f"dp={dp},tp={tp}" if dp > 1 and tp > 1 else (f"dp={dp}" if dp > 1 else f"tp={tp}")


def render(p: Plan) -> str:
    # One note per distinct refusal: layers of one shape and style refused for one reason share it.
    notes: dict[tuple, list] = {}
    for layer, c in p.refusals:
        key = (layer.shape, layer.style, c.why, c.alternatives, c.padding)
        entry = notes.setdefault(key, [len(notes) + 1, [], []])
        entry[1] += [layer.name] if layer.name not in entry[1] else []
        entry[2] += [_label(c.dp, c.tp)] if _label(c.dp, c.tp) not in entry[2] else []
    table = [["layer", "shape", "style", *(_label(d, t) for d, t in p.meshes)]]
    for layer, cells in p.rows:
        row = [layer.name, "x".join(map(str, layer.shape)), layer.style]
        for c in cells:
            note = None if c.legal else notes[(layer.shape, layer.style, c.why, c.alternatives, c.padding)][0]
            row.append(_size(c.nbytes) if c.legal else f"NO ({note})")
        table.append(row)
    if len({layer.name for layer, _ in p.rows}) == len(p.rows):  # one style per layer: totals make sense
        totals = [p.total_bytes(d, t) for d, t in p.meshes]
        bf16 = [
            sum(2 * _numel(layer.shape) // (d * t * (p.ep if len(layer.shape) > 2 else 1)) for layer, _ in p.rows)
            for d, t in p.meshes
        ]
        table.append(["total per rank", "", "", *("--" if t is None else _size(t) for t in totals)])
        table.append(["bf16 per rank", "", "", *(_size(b) for b in bf16)])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [
        f"{p.fmt}: bytes each rank stores per weight (largest shard); NO = refused, see notes"
        + (f"; expert stacks over ep={p.ep}" if p.ep > 1 else "")
    ]
    lines += [
        "  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))).rstrip()
        for r in table
    ]
    lines += [""] if notes else []
    for (shape, style, why, alternatives, padding), (number, names, meshes) in notes.items():
        who = names[0] + (f" (and {len(names) - 1} more like it)" if len(names) > 1 else "")
        kind = "row-parallel" if style == "rowwise" else "column-parallel"
        where = "every mesh" if len(meshes) == len(p.meshes) > 1 else "; ".join(meshes)
        lines.append(f"({number}) {who} [{'x'.join(map(str, shape))}, {kind}] at {where}: {why}. {alternatives}.")
        if padding:
            lines.append("    " + padding_hint(shape, padding))
    return "\n".join(lines)


def padding_hint(shape, padding: tuple[int, int, int]) -> str:
    dim, length, extra = padding
    what = "rows" if dim == 0 else "columns"
    return (
        f"Or zero-pad its {what} from {shape[dim]} to {length} (+{_size(extra)} for the whole weight): "
        f"dtensor_quant.pad_for_tp(model, tp, fmt) pads a SwiGLU MLP's gate/up rows and down columns "
        f"together, which changes no output."
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
