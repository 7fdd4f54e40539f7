"""The planner's verdicts: one weight on one mesh, legal with its bytes per rank or refused with why.

For a weight ``[out, in]`` (or a fused expert stack ``[E, out, in]``) and a
mesh ``(dp, tp)`` it checks the placements the weight would get, with the
rule DTensor, FSDP2 and DCP are held to (:func:`~dtensor_quant.check_placements`):
tensor parallelism shards the rows (``colwise``, ``Shard(0)``), the columns
(``rowwise``, ``Shard(1)``) or nothing (``replicate``) on the tp dim;
``packed_colwise``/``packed_rowwise`` (transformers' fused gate_up and
experts) shard each half of the rows or columns the same way. FSDP2 shards
dim 0 on the dp dim (a ``_StridedShard`` when tensor parallelism already
shards dim 0). FSDP2 pads uneven dim-0 shards; it cannot shard other dims
unevenly, which is why it is only ever asked for dim 0 here. Its padding is
also why one rule more holds on the dp dim than ``check_placements``' chunks:
a shard of one row, padded with a row on the other ranks, cuts a block of
several rows (NF4, BnbNF4, Float8Blockwise) where ``torch.chunk`` would leave
it whole; :func:`bad_cut` asks ``dtensor_quant.fsdp.fully_shard``'s own rule
(:func:`~dtensor_quant._fsdp.fully_shard.padded_legal`), so a degree the plan
calls legal is one ``fully_shard`` takes.

An attention projection also obeys the head rule of the runtime that will
run it (:func:`heads_refusal`): torch's and transformers' TP give each rank
whole heads, so the degree must divide the attention heads and the KV heads;
vLLM replicates the KV heads when the degree is a multiple of them (each
rank then holds one whole KV head: k/v are cut ``kv_heads`` ways) and still
needs the query heads divisible. A layer's ``heads`` and ``role`` say which
rule applies; the nearest degrees a refusal names satisfy layout and heads
together.

A model repeats a few shapes many times, so a verdict is computed once per
(shape, style, format, mesh) and what a refusal suggests (nearest legal
degrees, a smaller block size, the padding that would make it legal) only
when someone reads it: a 70B model over 48 meshes has a few hundred
distinct cells, and rendering it reads the hints of a few.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..._core.format import QuantFormat, Reducer, check_shape, weight_layout
from ..._core.layout import MAX_LISTED_MESH_SIZE, chunk_boundaries
from ..._fsdp.fully_shard import padded_legal
from ..._parallel.placements import dim_alignment, first_bad_cut, shard_like
from ..._parallel.quantize import quantize
from ..padding import mlp_padding, zero_padded
from ..vocab_padding import vocab_length

STYLES = {"colwise": Shard(0), "rowwise": Shard(1)}
#: Styles of a weight on the tp dim: its rows, its columns, each half of them (transformers' packed
#: gate_up weights), or the whole weight on every tp rank.
ALL_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise", "replicate")
PACKED = {"packed_colwise": "colwise", "packed_rowwise": "rowwise"}
DENSE_BYTES = 2  # a weight left unquantized (an embedding, a norm) is counted in bf16

#: The runtimes whose head rule the planner applies: torch/transformers TP, vLLM (KV heads replicated).
RUNTIMES = ("torch", "vllm")

# What padding can fix without changing a model's outputs: the intermediate size of a SwiGLU MLP
# (dtensor_quant.pad_for_tp) and the vocabulary of the output head and embeddings (pad_vocab_for_tp).
PADDABLE_KINDS = ("mlp", "vocab")


@dataclass(frozen=True)
class Layer:
    """A weight to plan: its name, shape and tensor-parallel style.

    ``kind``: ``"mlp"`` for a SwiGLU MLP's gate/up/down weight, ``"vocab"``
    for the output head or an embedding (padding can fix those), else ``""``.
    ``dense``: left unquantized (embeddings, norms): counted in bf16, always legal.
    ``heads``: ``(attention heads, KV heads)`` of the model, for an attention
    projection whose ``role`` is ``"q"`` (cut into whole query heads: q, o,
    MLA's q_b/kv_b) or ``"kv"`` (whole KV heads: k, v); empty: no head rule.
    ``fmt``: this weight's own format (a checkpoint's stored one), else the
    plan's; ``stored``: its block size is fixed by the files, so no smaller
    one is proposed and padding only where the quantized bytes pad exactly.
    """

    name: str
    shape: tuple[int, ...]  # [out, in], [experts, out, in] for a fused expert stack, [n] for a norm or bias
    style: str  # one of ALL_STYLES
    kind: str = ""
    dense: bool = False
    heads: tuple[int, ...] = ()
    role: str = ""
    fmt: QuantFormat | None = None
    stored: bool = False


@dataclass(frozen=True)
class Cell:
    """One layer on one mesh: legal with ``nbytes`` per rank, or refused ``why``.

    A refused cell's ``alternatives`` (nearest legal degrees, a smaller block
    size, the column-parallel switch) and ``padding`` (``(dim, padded length,
    extra bytes of the whole weight)``: what ``pad_for_tp`` or
    ``pad_vocab_for_tp`` would apply, for an MLP or output head only) are
    computed when read.
    """

    dp: int
    tp: int
    placements: tuple[Placement, ...]
    nbytes: int | None = None
    why: str | None = None
    # (shape, style, fmt, ep, kind, heads, role, runtime, stored) of a refused cell, for its hints
    subject: tuple | None = field(default=None, repr=False, compare=False)
    fixed_alternatives: str | None = field(default=None, repr=False, compare=False)

    @property
    def legal(self) -> bool:
        return self.why is None

    @property
    def alternatives(self) -> str | None:
        if self.legal:
            return None
        if self.fixed_alternatives is not None or self.subject is None:
            return self.fixed_alternatives
        return _hints(*self.subject, self.dp, self.tp)

    @property
    def heads_refused(self) -> bool:
        """Refused by the runtime's head rule (no layout, padding or switch fixes that)."""
        return not self.legal and self.subject is not None and heads_refusal(self.subject[5], self.tp, self.subject[7])

    @property
    def padding(self) -> tuple[int, int, int] | None:
        if self.legal or self.fixed_alternatives is not None or self.subject is None:
            return None
        return _padding(*self.subject, self.dp, self.tp)


def placements_for(style: str, dp: int, tp: int, ndim: int = 2) -> tuple[Placement, Placement]:
    """The (dp, tp) placements of a weight of ``ndim`` dims in ``style``: FSDP2 on dim 0, TP per the style."""
    style = PACKED.get(style, style)
    if ndim == 1:  # a bias or norm: a column-parallel layer's bias follows its rows, anything else is whole
        tp_p = Shard(0) if tp > 1 and style == "colwise" else Replicate()
        return (Shard(0) if dp > 1 else Replicate()), tp_p
    lead = ndim - 2  # expert dims in front of the matrix
    tp_p = Shard(STYLES[style].dim + lead) if tp > 1 and style in STYLES else Replicate()
    if dp == 1:
        return Replicate(), tp_p
    fsdp = _StridedShard(0, split_factor=tp) if tp > 1 and style == "colwise" and not lead else Shard(0)
    return fsdp, tp_p


def mesh_and_placements(shape, style: str, dp: int, tp: int, ep: int):
    """The mesh and placements of a ``shape`` weight; with ``ep`` > 1 a leading expert-parallel mesh dim."""
    placements = placements_for(style, dp, tp, len(shape))
    if ep == 1:
        return (dp, tp), placements
    return (ep, dp, tp), (Shard(0) if len(shape) > 2 else Replicate(), *placements)


def local_shape(shape, mesh, placements) -> tuple[int, ...]:
    """The largest local shard (rank 0's: torch.chunk puts the remainder last)."""
    local = list(shape)
    for n, p in zip(mesh, placements):
        if isinstance(p, (Shard, _StridedShard)):
            local[p.dim] = -(-local[p.dim] // n)
    return tuple(local)


def stored_bytes(fmt: QuantFormat, shape: Sequence[int], dtype=torch.bfloat16, full_shape=None) -> int:
    """Bytes ``fmt`` stores for a shard of ``shape`` of a ``full_shape`` weight (what its quantize would hold).

    Counted from the layout: each inner tensor's length along a dim is its
    relation's ``inner_len`` of the shard's length, times its element size,
    both learned from one quantize of the whole matrix on the meta device
    (memoised per format, matrix shape and dtype); ``shape`` is a shard of a
    legal cut, as the planner gives. A format whose inner tensors do not
    have the shapes its layout gives is quantized on the meta device for
    every shard shape instead.
    """
    if 0 in shape:
        return 0
    experts = 1
    for n in shape[:-2]:  # an expert stack stores each matrix as the 2-D format does
        experts *= n
    local, full = tuple(shape[-2:]), tuple(full_shape or shape)[-2:]
    inner = _inner_entries(fmt, full, dtype)
    if inner is None:
        return experts * _quantized_bytes(fmt, local, full, dtype)
    return experts * sum(numel(r.inner_len(n) for r, n in zip(rels, local)) * size for rels, size in inner)


@functools.lru_cache(maxsize=4096)
def _inner_entries(fmt: QuantFormat, full: tuple[int, int], dtype) -> tuple | None:
    """``((relations, element size), ...)`` of ``fmt``'s inner tensors for a ``full`` matrix, or None.

    None when a quantized inner tensor's shape is not the one its relations
    give (then the layout cannot count a shard's bytes).
    """
    layout = weight_layout(fmt, full)
    inner = fmt.quantize(torch.empty(full, dtype=dtype, device="meta"), Reducer(full))
    if set(inner) != set(layout):
        return None
    if any(tuple(t.shape) != tuple(r.inner_len(n) for r, n in zip(layout[k], full)) for k, t in inner.items()):
        return None
    return tuple((layout[k], t.element_size()) for k, t in inner.items())


@functools.lru_cache(maxsize=4096)
def _quantized_bytes(fmt: QuantFormat, local: tuple[int, int], full: tuple[int, int], dtype) -> int:
    inner = fmt.quantize(torch.empty(local, dtype=dtype, device="meta"), Reducer(full))
    return sum(t.numel() * t.element_size() for t in inner.values())


def heads_refusal(heads: tuple[int, ...], tp: int, runtime: str = "torch") -> str | None:
    """Why ``runtime`` cannot run attention of ``heads`` = (attention heads, KV heads) at ``tp``, or None.

    torch/transformers: every rank computes whole heads of its own (q, k, v
    column-parallel, o row-parallel, the heads a ``view(..., -1, head_dim)``
    away), so ``tp`` divides both counts: a 2-KV-head model at TP 4 fails in
    ``k_proj(...).view``. vLLM: ``tp`` divides the attention heads, and
    divides the KV heads or is a multiple of them (each KV head is then held
    whole by ``tp / kv_heads`` ranks).
    """
    if not heads or tp == 1:
        return None
    h, kv = heads
    if runtime == "vllm":
        if h % tp:
            return f"vLLM needs tp to divide the {h} attention heads"
        if kv % tp and tp % kv:
            return f"vLLM needs tp to divide the {kv} KV heads or be a multiple of them (it replicates them)"
        return None
    bad = [f"the {n} {what}" for n, what in ((h, "attention heads"), (kv, "KV heads")) if n % tp]
    if not bad:
        return None
    return f"tp={tp} does not divide {' nor '.join(bad)}: torch/transformers TP gives each rank whole heads"


def heads_rule(heads: tuple[int, ...], runtime: str = "torch") -> str:
    """The head rule of ``runtime`` for ``heads`` in words, whatever the degree."""
    h, kv = heads
    if runtime == "vllm":
        return f"vLLM needs tp to divide the {h} attention heads, and to divide the {kv} KV heads or be a multiple"
    return (
        f"torch/transformers TP gives each rank whole heads: tp must divide the {h} attention heads and {kv} KV heads"
    )


def cut_degree(heads: tuple[int, ...], role: str, tp: int, runtime: str) -> int:
    """How many ways the layer is cut at ``tp``: ``tp``, or the KV heads where vLLM replicates them."""
    if runtime == "vllm" and role == "kv" and heads and tp > heads[1]:
        return heads[1]
    return tp


def check(layer: Layer, fmt: QuantFormat, dp: int, tp: int, ep: int = 1, runtime: str = "torch") -> Cell:
    """``layer`` on mesh ``(dp, tp)`` (behind ``ep`` expert-parallel groups): legal with its bytes, or why not.

    ``runtime`` ("torch" or "vllm") decides the head rule of an attention projection (:func:`heads_refusal`).
    """
    if layer.dense:
        return _dense(tuple(layer.shape), layer.style, dp, tp, ep)
    heads = tuple(layer.heads) if layer.role and layer.style != "replicate" else ()
    return _check(tuple(layer.shape), layer.style, layer.fmt or fmt, dp, tp, ep, layer.kind, heads,
                  layer.role if heads else "", runtime, layer.stored)  # fmt: skip


@functools.lru_cache(maxsize=65536)
def _dense(shape: tuple[int, ...], style: str, dp: int, tp: int, ep: int) -> Cell:
    mesh, placements = mesh_and_placements(shape, style, dp, tp, ep)
    return Cell(dp, tp, placements, nbytes=DENSE_BYTES * numel(local_shape(shape, mesh, placements)))


@functools.lru_cache(maxsize=65536)
def _check(
    shape: tuple[int, ...],
    style: str,
    fmt: QuantFormat,
    dp: int,
    tp: int,
    ep: int = 1,
    kind: str = "",
    heads: tuple[int, ...] = (),
    role: str = "",
    runtime: str = "torch",
    stored: bool = False,
) -> Cell:
    """One verdict per (shape, style, format, mesh, kind, heads): a model repeats a few shapes many times.

    ``kind`` only decides which padding a refusal proposes (:func:`_padding`).
    """
    subject = (shape, style, fmt, ep, kind, heads, role, runtime, stored)
    if heads and tp > 1:
        bad = heads_refusal(heads, tp, runtime)
        if bad:
            return Cell(dp, tp, mesh_and_placements(shape, style, dp, tp, ep)[1], why=bad, subject=subject)
        degree = cut_degree(heads, role, tp, runtime)
        cell = _check(shape, style, fmt, dp, degree, ep, kind, stored=stored)
        if degree != tp:  # vLLM: each KV head whole on tp / kv_heads ranks
            why = cell.why and f"k/v replicated over {tp // degree} ranks, cut {degree} ways: {cell.why}"
            return dataclasses.replace(cell, tp=tp, why=why, subject=cell.subject and subject)
        return dataclasses.replace(cell, subject=cell.subject and subject)
    if style in PACKED:  # each half (gate, up) is cut as its own weight, each rank holds a piece of both
        dim = len(shape) - (2 if style == "packed_colwise" else 1)
        if shape[dim] % 2:
            mesh, placements = mesh_and_placements(shape, style, dp, tp, ep)
            why = f"a {style} weight needs an even dim {dim}, this one has {shape[dim]}"
            return Cell(dp, tp, placements, why=why, fixed_alternatives="use colwise or rowwise for it")
        half = shape[:dim] + (shape[dim] // 2,) + shape[dim + 1 :]
        cell = _check(half, PACKED[style], fmt, dp, tp, ep, kind, stored=stored)
        if cell.legal:
            return dataclasses.replace(cell, nbytes=2 * cell.nbytes)
        return dataclasses.replace(cell, why=f"each half {list(half)} of the packed weight: {cell.why}")
    mesh, placements = mesh_and_placements(shape, style, dp, tp, ep)
    try:
        check_shape(fmt, shape)
    except ValueError as e:  # the format cannot hold the weight at all (e.g. odd columns for int4)
        return Cell(dp, tp, placements, why=str(e), fixed_alternatives="leave this layer unquantized (filter_fn)")
    if bad_cut(shape, fmt, mesh, placements) is not None:  # check_placements' rule and FSDP2's, without a message
        return Cell(dp, tp, placements, why=_why(shape, fmt, mesh, placements), subject=subject)
    local = local_shape(shape, mesh, placements)
    return Cell(dp, tp, placements, nbytes=stored_bytes(fmt, local, full_shape=shape))


def bad_cut(shape, fmt: QuantFormat, mesh, placements) -> tuple[int, int, int] | None:
    """``(dim, index, alignment)`` of the first cut the runtime cannot make, or None.

    ``check_placements``' rule (:func:`~dtensor_quant._parallel.placements.first_bad_cut`), then FSDP2's
    on the dp mesh dim (:func:`fsdp_cut`: the index is the padded shard's end, where the padding starts).
    """
    bad = first_bad_cut(shape, fmt, mesh, placements)
    if bad is None and (fsdp := fsdp_cut(tuple(shape), fmt, tuple(mesh), tuple(placements))) is not None:
        return 0, fsdp[1], fsdp[2]
    return bad


@functools.lru_cache(maxsize=65536)
def fsdp_cut(shape, fmt: QuantFormat, mesh, placements) -> tuple[int, int, int] | None:
    """``(rows, padded rows, alignment)`` of a dim-0 shard FSDP2 cannot gather over the dp mesh dim, or None.

    FSDP2 shards each rank's local tensor (the TP or EP shard, whatever the other mesh dims cut off dim 0)
    along dim 0, every piece padded to ``ceil(rows / dp)`` rows; :func:`~dtensor_quant._fsdp.fully_shard.
    padded_legal` says which of those it can gather. The dp mesh dim is the one before the last (``(dp, tp)``,
    ``(ep, dp, tp)``, as :func:`mesh_and_placements` builds them).
    """
    dp_dim = len(mesh) - 2
    if dp_dim < 0 or mesh[dp_dim] == 1 or not shard_like(placements[dp_dim]) or placements[dp_dim].dim % len(shape):
        return None
    factor = dim_alignment(fmt, shape, 0)
    if factor == 1:
        return None
    lengths = {shape[0]}  # the local lengths of dim 0 that FSDP2 shards (one per rank of the other mesh dims)
    for m, (n, p) in enumerate(zip(mesh, placements)):
        if m != dp_dim and shard_like(p) and p.dim % len(shape) == 0:
            lengths = {e - s for length in lengths for s, e in chunk_boundaries(length, n)}
    for rows in sorted(lengths):
        if not padded_legal(rows, mesh[dp_dim], factor):
            return rows, -(-rows // mesh[dp_dim]), factor
    return None


def _why(shape, fmt: QuantFormat, mesh, placements) -> str:
    if first_bad_cut(shape, fmt, mesh, placements) is None:
        rows, padded, factor = fsdp_cut(tuple(shape), fmt, tuple(mesh), tuple(placements))
        layout = weight_layout(fmt, shape)
        needs = ", ".join(f"'{n}' is {rels[0]}" for n, rels in layout.items() if rels[0].factor > 1)
        return (
            f"FSDP2 over dp={mesh[-2]} pads every rank's dim-0 shard of {rows} row{'s' * (rows != 1)} to {padded} "
            f"row{'s' * (padded != 1)} of its own, which cuts its blocks of {factor} rows ({needs}; "
            "dtensor_quant.fsdp.fully_shard refuses it; torch.chunk would leave the row whole)"
        )
    dim, bad, factor = first_bad_cut(shape, fmt, mesh, placements)
    layout = weight_layout(fmt, shape)
    # the inner tensors whose alignment this cut breaks (all that align the dim, if the rule is their joint one)
    culprits = [(n, rels) for n, rels in layout.items() if rels[dim].factor > 1 and bad % rels[dim].factor]
    culprits = culprits or [(n, rels) for n, rels in layout.items() if rels[dim].factor > 1]
    needs = ", ".join(f"'{n}' is {rels[dim]}" for n, rels in culprits)
    what = {len(shape) - 2: "rows", len(shape) - 1: "columns"}.get(dim, "experts")
    return f"the {shape[dim]} {what} are cut at {what[:-1]} {bad}, not a multiple of {factor} ({needs}; dim {dim})"


def legal_at(
    shape, style: str, fmt: QuantFormat, dp: int, tp: int, ep: int = 1, heads=(), role="", runtime="torch"
) -> bool:
    """Whether a ``shape`` weight in ``style`` is legal on mesh (dp, tp) with the placements the planner gives it.

    FSDP's ``_StridedShard`` takes the tp size as its split factor and tp 1 is
    no tensor parallelism at all, so a resized mesh gets its own placements.
    With ``heads``, the runtime's head rule too, and the cut at the degree it gives (:func:`cut_degree`).
    """
    if heads_refusal(heads, tp, runtime):
        return False
    degree = cut_degree(heads, role, tp, runtime)
    return bad_cut(tuple(shape), fmt, *mesh_and_placements(shape, style, dp, degree, ep)) is None


def nearest_degrees(
    layer: Layer, fmt: QuantFormat, dp: int, tp: int, which: str, limit: int, ep: int = 1
) -> tuple[int | None, int | None]:
    """The nearest legal sizes below and above the current one of mesh dim ``which`` ("tp" or "dp").

    Searched outward from the current size, so a large mesh costs only the
    sizes between it and its nearest legal neighbours; above stops at ``limit``.
    """
    heads = tuple(layer.heads) if layer.role and layer.style != "replicate" else ()
    return _nearest(tuple(layer.shape), layer.style, layer.fmt or fmt, dp, tp, which, limit, ep, heads, layer.role)


@functools.lru_cache(maxsize=4096)
def _nearest(
    shape, style, fmt, dp, tp, which, limit, ep, heads=(), role="", runtime="torch"
) -> tuple[int | None, int | None]:
    now = tp if which == "tp" else dp
    below = above = None
    for step in range(1, max(now, limit - now) + 1):
        for n in (now - step, now + step):
            if not 1 <= n <= limit or (n < now and below is not None) or (n > now and above is not None):
                continue
            if legal_at(shape, style, fmt, *((dp, n) if which == "tp" else (n, tp)), ep, heads, role, runtime):
                below, above = (n, above) if n < now else (below, n)
        if below is not None and above is not None:
            break
    return below, above


@functools.lru_cache(maxsize=16384)
def _hints(shape, style: str, fmt: QuantFormat, ep: int, kind, heads, role, runtime, stored, dp: int, tp: int) -> str:
    """What would make a refused cell legal: other degrees, a smaller block size, the column-parallel switch.

    Degrees are those where layout and the head rule both hold; a stored
    format (a checkpoint's) gets no smaller block size.
    """
    heads_bad = heads_refusal(heads, tp, runtime)
    degree = cut_degree(heads, role, tp, runtime)
    mesh, placements = mesh_and_placements(shape, style, dp, degree, ep)
    bad = None if heads_bad else bad_cut(shape, fmt, mesh, placements)
    out = []
    for mesh_dim, name in ((len(mesh) - 1, "tp"), (len(mesh) - 2, "dp")):
        p = placements[mesh_dim]
        if not (heads_bad and name == "tp") and (
            bad is None or not isinstance(p, (Shard, _StridedShard)) or p.dim != bad[0]
        ):
            continue
        now = (dp, tp)[mesh_dim - len(mesh) + 2]
        limit = max(MAX_LISTED_MESH_SIZE, 2 * now)
        below, above = _nearest(shape, style, fmt, dp, tp, name, limit, ep, heads, role, runtime)
        near = [str(x) for x in (below, above) if x is not None]
        what = "legal tp with whole heads" if heads and name == "tp" else f"legal {name}"
        text = f"nearest {what}: {' or '.join(near) if near else 'none'}"
        if above is None:
            text += f" (none above {now} up to {limit}, where the search stops)"
        out.append(text)
    if heads_bad:
        if runtime == "torch" and legal_at(shape, style, fmt, dp, tp, ep, heads, role, "vllm"):
            out.append("vLLM serves this degree, replicating the KV heads (--runtime vllm)")
        return "; ".join(out)
    smaller = None if stored else _smaller_block(shape, fmt, mesh, placements)
    if smaller:
        out.append(f"{smaller} would be legal here")
    if style == "rowwise" and len(shape) == 2 and tp > 1 and legal_at(shape, "colwise", fmt, dp, degree, ep):
        out.append(f"or keep tp={tp} with this layer column-parallel on a gathered input (dtensor_quant.adapt_tp_plan)")
    expanded = fmt.expanded_format()
    if expanded is not None and legal_at(shape, style, expanded, dp, degree, ep):
        extra = stored_bytes(expanded, shape) - stored_bytes(fmt, shape)
        out.append(
            f"or store its scales expanded, {expanded}: the same values, {size(extra)} more for the whole weight "
            "(dtensor_quant.expand_scales; adapt_tp_plan does it)"
        )
    return "; ".join(out)


@functools.lru_cache(maxsize=16384)
def _padding(
    shape, style: str, fmt: QuantFormat, ep: int, kind: str, heads, role, runtime, stored, dp: int, tp: int
) -> tuple[int, int, int] | None:
    """The zero-padding that ``pad_for_tp`` or ``pad_vocab_for_tp`` would apply at this tp: (dim, length, extra bytes).

    Only what those functions pad exactly: a SwiGLU MLP's intermediate dim
    (``kind`` ``"mlp"``: gate/up rows column-parallel, down columns
    row-parallel, one length for all three, :func:`~.padding.mlp_padding`)
    and the output head's vocabulary rows (``"vocab"``, column-parallel,
    :func:`~.vocab_padding.vocab_length`). The length is theirs at this tp
    degree (equal, legal tp shards), then checked on the whole mesh. None
    where the refused cut is not that tp cut, for an expert stack, or for
    any other weight. A ``stored`` weight (a checkpoint's quantized bytes)
    only where its format pads them exactly (:func:`pads_quantized`).
    """
    if kind not in PADDABLE_KINDS or len(shape) > 2 or tp == 1 or heads_refusal(heads, tp, runtime):
        return None
    mesh, placements = mesh_and_placements(shape, style, dp, tp, ep)
    dim = bad_cut(shape, fmt, mesh, placements)[0]
    if not isinstance(placements[-1], Shard) or placements[-1].dim != dim:
        return None
    if kind == "mlp" and (style, dim) in (("colwise", 0), ("rowwise", 1)):
        length = mlp_padding(shape[dim], shape[1 - dim], fmt, tp)
    elif kind == "vocab" and (style, dim) == ("colwise", 0):
        length = vocab_length(shape[0], shape[1], fmt, tp)
    else:
        return None
    if length is None:
        return None
    padded = shape[:dim] + (length,) + shape[dim + 1 :]
    if bad_cut(padded, fmt, mesh, placements) is not None:
        return None
    if stored and not pads_quantized(fmt, tuple(shape), dim, length):
        return None
    return dim, length, padding_cost(tuple(shape), dim, length, fmt)


@functools.lru_cache(maxsize=1024)
def pads_quantized(fmt: QuantFormat, shape: tuple[int, int], dim: int, length: int) -> bool:
    """Whether a quantized ``shape`` weight pads exactly to ``length`` along ``dim`` (on meta; zeros on the CPU)."""
    try:
        zero_padded(quantize(torch.empty(shape, dtype=torch.bfloat16, device="meta"), fmt), dim, length, "")
    except ValueError:
        return False
    return True


def padding_cost(shape: tuple[int, int], dim: int, length: int, fmt: QuantFormat) -> int:
    """Bytes ``fmt`` stores for a ``shape`` weight padded along ``dim`` to ``length``, minus unpadded."""
    padded = list(shape)
    padded[dim] = length
    return stored_bytes(fmt, tuple(padded)) - stored_bytes(fmt, tuple(shape))


def _smaller_block(shape, fmt: QuantFormat, mesh, placements) -> QuantFormat | None:
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
                check_shape(candidate, shape)
                if bad_cut(shape, candidate, mesh, placements) is None:
                    return candidate
                size //= 2
            except ValueError:
                size //= 2
    return None


def size(n: int) -> str:
    """``n`` bytes for a reader: ``1.5 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
