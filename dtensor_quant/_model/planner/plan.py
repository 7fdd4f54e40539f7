"""Which tensor-parallel and FSDP degrees a quantized model can take -- decided before any data exists.

    python -m dtensor_quant plan --format int4:128 --shape 4096x4096:rowwise --shape 11008x4096:colwise --tp 1 2 3 4 8
    python -m dtensor_quant plan --format nf4 --model my_models.py:llama3_70b --tp-plan model --tp 1 2 4 8

    >>> print(plan([("wo", (4096, 4096), "rowwise")], Int4Groupwise(128), tp=[2, 3]))

For every weight and every mesh ``(dp, tp)`` it checks the placements the
weight would get with the rule DTensor, FSDP2 and DCP are held to
(:mod:`.cells`); the weights and their styles come from a model and its
TP plan, wildcards included (:mod:`.layers`), and the report collapses
identical layers and adds up the bytes per rank (:mod:`.report`).

A refused degree is explained: where the cut falls, the alignment the
layout needs and which inner tensor needs it, the nearest legal degrees, and,
for a format with a block size, the largest block size that would be legal;
for an MLP or the vocabulary, the zero-padding that would make it legal.
Legal cells show the bytes the largest shard holds on one rank.

Attention projections obey the head rule of the runtime (``runtime``:
``"torch"`` for torch's and transformers' TP, ``"vllm"``, which replicates
KV heads): the heads come from a model's config or ``heads=(H, KV)``.
The report opens with the verdict per mesh after adaptation
(:mod:`.verdict`, ``Plan.summary()``): legal as is, with
``adapt_tp_plan``, with padding, or not at all.

Fused expert stacks ``[E, out, in]`` (mixture-of-experts layers) are planned
too: with ``ep`` > 1 a leading mesh dim of that size shards their experts
(``Shard(0)``, expert parallelism; 2-D weights are replicated over it), tensor
parallelism shards inside every expert (``colwise``: its out dim, ``rowwise``:
its in dim) and FSDP2 shards the experts within each expert-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from ..._core.format import QuantFormat
from .cells import ALL_STYLES, RUNTIMES, STYLES, Cell, Layer, check, heads_refusal, nearest_degrees, stored_bytes
from .layers import attention_role, kind_from_name, layers_of, model_heads
from .report import WIDTH, csv_rows, groups, padding_hint, render
from .verdict import Verdict, summary_lines, verdicts

__all__ = [
    "ALL_STYLES",
    "RUNTIMES",
    "STYLES",
    "Cell",
    "Layer",
    "Plan",
    "Verdict",
    "attention_role",
    "check",
    "csv_rows",
    "groups",
    "heads_refusal",
    "kind_from_name",
    "layers_of",
    "model_heads",
    "nearest_degrees",
    "padding_hint",
    "plan",
    "render",
    "stored_bytes",
]


MAX_LINES = 40  # a report a terminal shows whole: past it, the notes are given in short


@dataclass
class Plan:
    fmt: QuantFormat  # the plan's format; a layer with its own (``Layer.fmt``: a checkpoint's) keeps that
    meshes: list[tuple[int, int]]
    rows: list[tuple[Layer, list[Cell]]]
    ep: int = 1  # expert-parallel degree of the expert stacks
    runtime: str = "torch"  # whose head rule: "torch" (torch/transformers TP) or "vllm"

    @property
    def refusals(self) -> list[tuple[Layer, Cell]]:
        return [(layer, c) for layer, cells in self.rows for c in cells if not c.legal]

    def total_bytes(self, dp: int, tp: int) -> int | None:
        """Bytes of every planned weight on one rank (None if a layer is refused on this mesh)."""
        m = self.meshes.index((dp, tp))
        cells = [cells[m] for _, cells in self.rows]
        return None if any(not c.legal for c in cells) else sum(c.nbytes for c in cells)

    def summary(self) -> list[Verdict]:
        """Per mesh: legal as is, with ``adapt_tp_plan`` (which layers), with padding (bytes added), or not at all."""
        if not hasattr(self, "_summary"):
            self._summary = verdicts(self)
        return self._summary

    def render(self, width: int = WIDTH, max_lines: int = MAX_LINES) -> str:
        """The report: the verdict per mesh, then identical layers collapsed, totals per rank, refusals explained;
        lines within ``width``; past ``max_lines`` (0: no limit) the notes in short."""
        head = summary_lines(self, width)
        return "\n".join([*head, render(self, width, max_lines and max(max_lines - len(head), 1))])

    def csv(self) -> str:
        """Every layer on every mesh as CSV, nothing collapsed."""
        return csv_rows(self)

    def __str__(self) -> str:
        return self.render()


def _as_layers(source, heads) -> list[Layer]:
    out = []
    for i, item in enumerate(source):
        if isinstance(item, Layer):
            out.append(item)
        elif len(item) in (2, 3) and all(isinstance(v, int) for v in item):  # a bare (out, in) or (E, out, in)
            out += [Layer(f"layer{i}", tuple(item), s) for s in STYLES]
        else:
            name, shape, *style = item
            role = attention_role(name) if heads else ""
            extra = {"heads": tuple(heads), "role": role} if role else {}
            out += [Layer(name, tuple(shape), s, kind_from_name(name), **extra) for s in (style or STYLES)]
    return out


def plan(
    source: nn.Module | Iterable,
    fmt: QuantFormat,
    tp: Sequence[int] = (1, 2, 4, 8),
    dp: Sequence[int] = (1,),
    tp_plan: dict | None = None,
    ep: int = 1,
    dense: bool | None = None,
    heads: tuple[int, int] | None = None,
    runtime: str = "torch",
) -> Plan:
    """Check every layer of ``source`` on every mesh ``(dp, tp)``.

    ``source``: a model (its matmul weights; build it on the meta device to
    avoid allocating), or a list of :class:`Layer`, ``(out, in)``, ``(name,
    (out, in))`` or ``(name, (out, in), style)``; a shape ``(experts, out,
    in)`` is a fused expert stack. Layers without a style are planned both
    ways. ``tp_plan`` gives a model's styles: ``{module or parameter name,
    '*' allowed: torch ParallelStyle or transformers style name}`` (a model's
    own ``_tp_plan`` works as it is); weights it does not name are
    replicated. ``dense``: also plan the parameters left unquantized
    (embeddings, norms), in bf16, so the totals are the whole model's
    (default: with a ``tp_plan``). ``ep`` > 1 shards every expert stack's
    experts over a leading mesh dim of that size (expert parallelism) and
    replicates 2-D weights over it.

    ``heads``: ``(attention heads, KV heads)``; attention projections
    (``...attn.q_proj``, ``k_proj``, ...) then obey ``runtime``'s head rule:
    ``"torch"`` (torch/transformers TP: the degree divides both) or
    ``"vllm"`` (KV heads replicated when the degree is a multiple of them).
    A model's own config gives its heads when ``heads`` is None.
    """
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {list(RUNTIMES)}, got {runtime!r}")
    if heads is not None and (len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1]):
        raise ValueError(f"heads must be (attention heads, KV heads), KV heads dividing the heads; got {heads}")
    if isinstance(source, nn.Module):
        layers = layers_of(source, tp_plan, dense=bool(tp_plan) if dense is None else dense, heads=heads)
    else:
        layers = _as_layers(source, heads)
    for layer in layers:
        if layer.style not in ALL_STYLES:
            raise ValueError(f"{layer.name}: style must be one of {list(ALL_STYLES)}, got {layer.style!r}")
    meshes = [(d, t) for d in dp for t in tp]
    rows = [(layer, [check(layer, fmt, d, t, ep, runtime) for d, t in meshes]) for layer in layers]
    return Plan(fmt, meshes, rows, ep, runtime)
