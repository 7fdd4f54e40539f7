"""The verdict per mesh after adaptation: legal as is, with ``adapt_tp_plan``, with padding, or not at all.

A cell refused as it is can still run: a row-parallel Linear whose columns
cannot be cut is switched to column-parallel on a gathered input, or a
double-quantized weight that no cut holds gets its scales stored expanded
(both :func:`~dtensor_quant.adapt_tp_plan`); an MLP or the output head can
be zero-padded (:func:`~dtensor_quant.pad_for_tp`,
:func:`~dtensor_quant.pad_vocab_for_tp`). This module decides, for every
mesh of a plan, the cheapest of those that makes every weight legal -- the
switch costs no bytes, padding does -- and says which layers it touches and
how many bytes padding adds. What none fixes (the runtime's head rule, a
cut no remedy reaches) is "not at all", with the nearest tensor-parallel
degrees at which the model does run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._core.layout import MAX_LISTED_MESH_SIZE
from .cells import Cell, Layer, check, heads_refusal, heads_rule, legal_at, padding_cost, size, stored_bytes
from .report import groups, mesh_label
from .report import where_meshes as _where

AS_IS, ADAPT, PADDING, BOTH, NO = (
    "legal as is",
    "legal with adapt_tp_plan",
    "legal with padding",
    "legal with adapt_tp_plan and padding",
    "not at all",
)


@dataclass(frozen=True)
class Verdict:
    """One mesh's verdict: ``status`` (one of the five above) and what it takes.

    ``switched``: layers ``adapt_tp_plan`` makes column-parallel; ``expanded``:
    layers whose scales it stores expanded; ``padded``: ``((function, bytes
    added), ...)``; ``why``: what keeps a "not at all" mesh from running;
    ``nearest``: the nearest tp below and above (same dp) at which it runs.
    """

    dp: int
    tp: int
    status: str
    switched: tuple[str, ...] = ()
    expanded: tuple[str, ...] = ()
    padded: tuple[tuple[str, int], ...] = ()
    why: str = ""
    nearest: tuple[int | None, int | None] = (None, None)
    by_hand: tuple[str, ...] = ()  # layers whose FSDP cut needs their scales expanded (dq.expand_scales)

    @property
    def runs(self) -> bool:
        return self.status != NO

    def text(self, nearest: bool = True) -> str:
        """What it takes, without the mesh: ``legal with padding: pad_for_tp +16.5 MiB``."""
        parts = []
        if self.switched:
            parts.append(f"{join_labels(self.switched)} column-parallel on a gathered input")
        if self.expanded:
            parts.append(f"{join_labels(self.expanded)} with scales expanded")
        if self.by_hand:
            parts.append(f"{join_labels(self.by_hand)} with scales expanded before fully_shard")
        parts += [f"{fn} +{size(extra)}" for fn, extra in self.padded]
        if self.status == NO:
            near = [str(t) for t in self.nearest if t is not None]
            parts = [self.why] + ([f"nearest tp that runs: {' or '.join(near)}"] if near and nearest else [])
        return self.status + (": " + "; ".join(parts) if parts else "")

    def __str__(self) -> str:
        return f"{mesh_label(self.dp, self.tp)}: {self.text()}"


def join_labels(labels) -> str:
    """``a.{0..3}.q_proj x4``, ``a.{0..3}.k_proj x4`` -> ``a.{0..3}.{q_proj,k_proj} x4``: rows of one block, once."""
    by: dict[tuple[str, str], list[str]] = {}
    for label in labels:
        name, _, count = label.partition(" ")
        head, dot, last = name.rpartition(".")
        by.setdefault((head + dot, count), []).append(last)
    out = []
    for (head, count), lasts in by.items():
        name = head + (lasts[0] if len(lasts) == 1 else "{" + ",".join(lasts) + "}")
        out.append(name + (f" {count}" if count else ""))
    return ", ".join(out)


def verdicts(p) -> list[Verdict]:
    """The verdict of every mesh of plan ``p`` (see :class:`Verdict`)."""
    rows = groups(p.rows)
    return [_verdict(p, rows, m) for m in range(len(p.meshes))]


def _verdict(p, rows, m: int, nearest: bool = True) -> Verdict:
    dp, tp = p.meshes[m]
    cells = [(g, g.cells[m]) for g in rows]
    return _classify(p, cells, dp, tp, nearest)


def _classify(p, cells, dp: int, tp: int, nearest: bool) -> Verdict:
    switched, expanded, by_hand, no, pads = [], [], [], [], {}
    for g, c in cells:
        if c.legal:
            continue
        layer, label = g.layer, g.label + (f" x{g.count}" if g.count > 1 else "")
        fix = _remedy(p, layer, c)
        if fix == "switch":
            switched.append(label)
        elif fix == "expand":
            expanded.append(label)
        elif fix == "expand_scales":
            by_hand.append(label)
        elif fix == "pad":
            pads.setdefault(layer.kind, []).append((g, c))
        else:
            no.append((label, c))
    if no:
        heads = next((heads_rule(c.subject[5], p.runtime) for _, c in no if c.heads_refused), None)
        label, c = no[0]
        why = heads or f"{label}: {c.why}"
        if not heads and len(no) > 1:
            more = len(no) - 1
            why += f" (and {more} more {'row' if more == 1 else 'rows'})"
        near = _nearest_running(p, dp, tp) if nearest else (None, None)
        return Verdict(dp, tp, NO, why=why, nearest=near)
    padded = tuple((fn, _padding_bytes(p, kind, pads[kind])) for kind, fn in _PAD_FUNCTIONS if kind in pads)
    used = [what for what, needed in (("adapt_tp_plan", switched or expanded), ("expand_scales", by_hand),
                                      ("padding", padded)) if needed]  # fmt: skip
    status = "legal with " + " and ".join(used) if used else AS_IS
    return Verdict(dp, tp, status, tuple(switched), tuple(expanded), padded, by_hand=tuple(by_hand))


_PAD_FUNCTIONS = (("mlp", "pad_for_tp"), ("vocab", "pad_vocab_for_tp"))


def _remedy(p, layer: Layer, c: Cell) -> str | None:
    """What fixes a refused cell: ``"switch"``, ``"expand"`` (adapt_tp_plan), ``"expand_scales"`` (by hand),
    ``"pad"``, or None.

    adapt_tp_plan acts where the tensor-parallel cut itself (on one FSDP
    rank) is refused: the switch first (no bytes); between expanded scales
    and padding, the one that adds fewer bytes. A cut refused only with
    FSDP's on top is adapt_tp_plan's business no more: ``dq.expand_scales``
    before ``fully_shard``, or padding.
    """
    if c.heads_refused or layer.dense:
        return None
    fmt = layer.fmt or p.fmt
    heads = tuple(layer.heads) if layer.role else ()
    args = (c.dp, c.tp, p.ep, heads, layer.role, p.runtime)
    by_tp = c.tp > 1 and not legal_at(layer.shape, layer.style, fmt, 1, *args[1:])  # adapt_tp_plan's own check
    if by_tp and layer.style == "rowwise" and len(layer.shape) == 2 and legal_at(layer.shape, "colwise", fmt, *args):
        return "switch"
    expanded = fmt.expanded_format()
    if expanded is not None and len(layer.shape) == 2 and legal_at(layer.shape, layer.style, expanded, *args):
        extra = stored_bytes(expanded, layer.shape) - stored_bytes(fmt, layer.shape)
        if c.padding is not None and c.padding[2] <= extra:  # the fewer bytes
            return "pad"
        return "expand" if by_tp else "expand_scales"
    if c.padding is not None:
        return "pad"
    return None


def _padding_bytes(p, kind: str, refused) -> int:
    """Bytes the padding adds: for an MLP every gate/up/down weight of the padded width (pad_for_tp pads all
    three to one length), for the head its own rows."""
    if kind == "vocab":
        return sum(g.count * c.padding[2] for g, c in refused)
    lengths = {g.layer.shape[c.padding[0]]: c.padding[1] for g, c in refused}  # width -> padded width
    total = 0
    for g in groups(p.rows):
        layer = g.layer
        if layer.kind != "mlp" or layer.dense or len(layer.shape) != 2:
            continue
        dim = 0 if layer.style == "colwise" else 1
        if layer.shape[dim] in lengths:
            total += g.count * padding_cost(tuple(layer.shape), dim, lengths[layer.shape[dim]], layer.fmt or p.fmt)
    return total


def _nearest_running(p, dp: int, tp: int) -> tuple[int | None, int | None]:
    """The nearest tp below and above ``tp`` (same ``dp``) at which the whole model runs, adapted or padded."""
    limit = max(MAX_LISTED_MESH_SIZE, 2 * tp)
    rows = groups(p.rows)
    below = next((t for t in range(tp - 1, 0, -1) if _runs(p, rows, dp, t)), None)
    above = next((t for t in range(tp + 1, limit + 1) if _runs(p, rows, dp, t)), None)
    return below, above


def _runs(p, rows, dp: int, tp: int) -> bool:
    for g in rows:  # the head rule first: it refuses a degree without any layout work
        if g.layer.role and not g.layer.dense and heads_refusal(tuple(g.layer.heads), tp, p.runtime):
            return False
    cells = [(g, check(g.layer, p.fmt, dp, tp, p.ep, p.runtime)) for g in rows]
    return _classify(p, cells, dp, tp, nearest=False).runs


def summary_lines(p, width: int) -> list[str]:
    """The first lines of the report: meshes with the same verdict on one line, wrapped to ``width``."""
    import textwrap

    by_text: dict[str, list[Verdict]] = {}
    for v in p.summary():  # meshes with the same verdict share a line; "not at all" names the degrees that run
        by_text.setdefault(v.text(nearest=False), []).append(v)
    runtime = "vLLM's head rule, KV heads replicated" if p.runtime == "vllm" else "torch/transformers TP"
    lines = [f"Verdict per mesh ({runtime}):"]
    for text, vs in by_text.items():
        where = _where(vs, p.meshes) if len(p.meshes) > 1 else mesh_label(vs[0].dp, vs[0].tp)
        near = sorted({t for v in vs for t in v.nearest if t is not None})
        if vs[0].status == NO and near:
            text += (
                f"; nearest tp that runs: {' or '.join(map(str, near)) if len(near) < 3 else ', '.join(map(str, near))}"
            )
        line = f"  {where}: {text}"
        if width:
            lines += textwrap.wrap(line, width, subsequent_indent="      ", break_long_words=False,
                                   break_on_hyphens=False)  # fmt: skip
        else:
            lines.append(line)
    return lines
