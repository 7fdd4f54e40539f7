"""The planner's report: identical layers collapsed into one row, totals per rank, lines that fit a terminal.

A transformer repeats one block: ``model.layers.0.mlp.down_proj`` to
``model.layers.79.mlp.down_proj`` have one shape, one style and so one
verdict per mesh. They make one row, ``model.layers.{0..79}.mlp.down_proj
x80``; the totals count each row times its count. Mesh columns that do not
fit the width go to further blocks of the same table; every refusal note is
wrapped. :func:`csv_rows` gives every layer on every mesh, uncollapsed.
"""

from __future__ import annotations

import csv
import io
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .plan_cells import DENSE_BYTES, Cell, Layer, local_shape, mesh_and_placements, numel, size, stored_bytes

WIDTH = 120
_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")  # an atom of a dotted name that is a number: a layer or expert index


@dataclass
class Group:
    """Layers that differ only in their numeric atoms (layer index, expert index): one row of the report."""

    template: str  # the name with "{}" for each numeric atom
    layer: Layer  # the first of them
    cells: list[Cell]
    indices: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.indices)

    @property
    def label(self) -> str:
        if self.count == 1:
            return self.layer.name
        columns = list(zip(*self.indices))
        sets = [sorted(set(c)) for c in columns]
        full = numel(len(s) for s in sets) == self.count
        return self.template.format(*(_ranges(s) if full else "*" for s in sets))


def _ranges(values: list[int]) -> str:
    """``{0..79}``, ``{0..2,4..7}``; ``*`` past three runs."""
    runs, start = [], values[0]
    for prev, v in zip(values, values[1:] + [None]):
        if v is None or v != prev + 1:  # a run ends at prev
            runs.append(str(start) if start == prev else f"{start}..{prev}")
            start = v
    return "{" + ",".join(runs) + "}" if len(runs) <= 3 else "*"


def groups(rows: Sequence[tuple[Layer, list[Cell]]]) -> list[Group]:
    """The rows collapsed: one group per (name without its numbers, shape, style, kind, dense), in order."""
    out: dict[tuple, Group] = {}
    for layer, cells in rows:
        template = _NUMBER.sub("{}", layer.name.replace("{", "{{").replace("}", "}}"))
        key = (template, layer.shape, layer.style, layer.kind, layer.dense)
        group = out.get(key)
        if group is None:
            group = out[key] = Group(template, layer, cells)
        group.indices.append(tuple(int(n) for n in _NUMBER.findall(layer.name)))
    return list(out.values())


def mesh_label(dp: int, tp: int) -> str:
    return f"dp={dp},tp={tp}" if dp > 1 and tp > 1 else (f"dp={dp}" if dp > 1 else f"tp={tp}")


def render(p, width: int = WIDTH) -> str:
    """The plan ``p`` as text: collapsed rows, totals per rank, notes; no line longer than ``width`` (0: no limit)."""
    rows = groups(p.rows)
    notes = {i: n + 1 for n, i in enumerate(i for i, g in enumerate(rows) if any(not c.legal for c in g.cells))}
    one_style = len({layer.name for layer, _ in p.rows}) == len(p.rows)
    table = [["layer", "shape", "style", *(mesh_label(d, t) for d, t in p.meshes)]]
    small = [g for g in rows if g.layer.dense and len(g.layer.shape) == 1]  # norms and biases: one row
    for i, g in enumerate(rows):
        if g in small:
            continue
        label = g.label + (f" x{g.count}" if g.count > 1 else "") + (" (bf16)" if g.layer.dense else "")
        cells = [size(c.nbytes) if c.legal else f"NO ({notes[i]})" for c in g.cells]
        table.append([label, "x".join(map(str, g.layer.shape)), _style(g.layer), *cells])
    if small:
        count = sum(g.count for g in small)
        per_mesh = [sum(g.count * g.cells[m].nbytes for g in small) for m in range(len(p.meshes))]
        table.append([f"1-D parameters x{count} (bf16)", "", "norms", *(size(b) for b in per_mesh)])
    lines = [
        f"{p.fmt}: bytes each rank stores per weight (largest shard); NO = refused, see notes"
        + (f"; expert stacks over ep={p.ep}" if p.ep > 1 else "")
    ]
    if one_style:
        totals = [_total(p, rows, m) for m in range(len(p.meshes))]
        whole = "model" if any(g.layer.dense for g in rows) else "weights"
        table.append([f"{whole} per rank", "", "", *(("~" if t[1] else "") + size(t[0]) for t in totals)])
        table.append([f"{whole} per rank in bf16", "", "", *(size(_bf16(p, rows, m)) for m in range(len(p.meshes)))])
    lines += _blocks(table, width)
    if one_style and any(t[1] for t in totals):
        lines.append("~: refused weights counted at their whole size divided by the ranks that share them")
    if notes:
        lines.append("")
    for i, number in notes.items():
        lines += _note(number, rows[i], p, width)
    return "\n".join(lines)


def _style(layer: Layer) -> str:
    if layer.kind == "vocab" and layer.dense:  # an embedding [vocab, dim]: torch calls its row cut rowwise
        return {"colwise": "rowwise", "rowwise": "colwise"}.get(layer.style, layer.style)
    return layer.style


def _total(p, rows: list[Group], m: int) -> tuple[int, bool]:
    """Bytes per rank of every weight on mesh ``m``; refused ones estimated (and flagged)."""
    total, estimated = 0, False
    for g in rows:
        c = g.cells[m]
        if c.legal:
            total += g.count * c.nbytes
            continue
        estimated = True
        mesh, placements = mesh_and_placements(g.layer.shape, g.layer.style, c.dp, c.tp, p.ep)
        ways = numel(n for n, pl in zip(mesh, placements) if isinstance(pl, (Shard, _StridedShard)))
        total += g.count * -(-stored_bytes(p.fmt, g.layer.shape) // ways)
    return total, estimated


def _bf16(p, rows: list[Group], m: int) -> int:
    out = 0
    for g in rows:
        c = g.cells[m]
        mesh, placements = mesh_and_placements(g.layer.shape, g.layer.style, c.dp, c.tp, p.ep)
        out += g.count * DENSE_BYTES * numel(local_shape(g.layer.shape, mesh, placements))
    return out


def _blocks(table: list[list[str]], width: int) -> list[str]:
    """The table, its mesh columns split into blocks that fit ``width`` (the first three columns repeated)."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    fixed, meshes = 3, list(range(3, len(widths)))
    if width:
        room = width - sum(widths[1:fixed]) - 2 * fixed - (widths[3] if meshes else 0)
        if widths[0] > room:  # names too long: keep their ends
            widths[0] = max(room, 24)
            for r in table:
                if len(r[0]) > widths[0]:
                    keep = widths[0] - 3
                    r[0] = r[0][: keep // 2] + "..." + r[0][len(r[0]) - (keep - keep // 2) :]
    blocks, current = [], []
    for i in meshes:
        line = sum(widths[:fixed]) + 2 * (fixed - 1) + sum(widths[j] + 2 for j in current + [i])
        if current and width and line > width:
            blocks.append(current)
            current = []
        current.append(i)
    blocks.append(current)
    out = []
    for n, block in enumerate(blocks):
        if n:
            out.append("")
        cols = list(range(fixed)) + block
        for r in table:
            text = "  ".join(r[j].ljust(widths[j]) if j < fixed else r[j].rjust(widths[j]) for j in cols)
            out.append(text.rstrip())
    return out


def _note(number: int, g: Group, p, width: int) -> list[str]:
    refused = [c for c in g.cells if not c.legal]
    first = refused[0]
    kind = {"rowwise": "row-parallel", "colwise": "column-parallel"}.get(g.layer.style, g.layer.style)
    who = g.label + (f" x{g.count}" if g.count > 1 else "")
    text = f"({number}) {who} [{'x'.join(map(str, g.layer.shape))}, {kind}] refused at {_where(refused, p.meshes)}"
    if len(refused) > 1:
        text += f". At {mesh_label(first.dp, first.tp)}: {first.why}."
    else:
        text += f": {first.why}."
    if first.alternatives:
        text += f" {first.alternatives[0].upper()}{first.alternatives[1:]}."
    lines = [text]
    if first.padding and g.layer.kind in ("mlp", "vocab"):
        lines.append(padding_hint(g.layer.shape, first.padding, g.layer.kind, first.tp))
    out = []
    for i, line in enumerate(lines):
        indent = "    "
        if width:
            out += textwrap.wrap(line, width, initial_indent="" if i == 0 else indent, subsequent_indent=indent,
                                 break_long_words=False, break_on_hyphens=False)  # fmt: skip
        else:
            out.append(("" if i == 0 else indent) + line)
    return out


def _where(refused: list[Cell], meshes: list[tuple[int, int]]) -> str:
    """The refused meshes in few words: ``every mesh``, ``tp=2, 4, 8``, ``tp=3 (every dp); dp=8,16 with tp=6``."""
    if len(refused) == len(meshes) > 1:
        return "every mesh"
    dps = sorted({d for d, _ in meshes})
    by_tp: dict[int, list[int]] = {}
    for c in refused:
        by_tp.setdefault(c.tp, []).append(c.dp)
    whole = [t for t, ds in by_tp.items() if sorted(ds) == dps]
    parts = []
    if whole:
        parts.append(f"tp={', '.join(map(str, whole))}" + (" (every dp)" if len(dps) > 1 else ""))
    for t, ds in by_tp.items():
        if t not in whole:
            parts.append(f"dp={','.join(map(str, ds))} with tp={t}")
    return "; ".join(parts)


def padding_hint(shape, padding: tuple[int, int, int], kind: str = "mlp", tp: int | None = None) -> str:
    """The padding proposal of a refused cell (at tensor-parallel degree ``tp``), naming what applies it exactly."""
    dim, length, extra = padding
    at = f"for tp={tp}, " if tp else ""
    if kind == "vocab":
        return (
            f"Or, {at}zero-pad the vocabulary from {shape[dim]} to {length} (+{size(extra)} for the whole weight): "
            f"dtensor_quant.pad_vocab_for_tp(model, tp, fmt) pads the output head (and a tied embedding); "
            f"the padded logits are sliced away or set to -inf."
        )
    what = "rows" if dim == 0 else "columns"
    return (
        f"Or, {at}zero-pad its {what} from {shape[dim]} to {length} (+{size(extra)} for the whole weight): "
        f"dtensor_quant.pad_for_tp(model, tp, fmt) pads a SwiGLU MLP's gate/up rows and down columns "
        f"together to this length, which changes no output of the dense MLP (a quantized one is padded by "
        f"whole zero blocks where its format allows, else pad it before quantizing)."
    )


CSV_FIELDS = (
    "layer", "shape", "style", "kind", "dense", "format", "dp", "tp", "placements", "legal", "bytes", "why",
    "alternatives", "padding_dim", "padded_length", "padding_bytes",
)  # fmt: skip


def csv_rows(p) -> str:
    """Every layer on every mesh, one CSV row each (nothing collapsed): verdict, bytes, why and hints."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_FIELDS)
    for layer, cells in p.rows:
        for c in cells:
            pad = c.padding or (None, None, None)
            writer.writerow([
                layer.name, "x".join(map(str, layer.shape)), layer.style, layer.kind, int(layer.dense),
                "bf16" if layer.dense else str(p.fmt), c.dp, c.tp, " ".join(map(str, c.placements)), int(c.legal),
                "" if c.nbytes is None else c.nbytes, c.why or "", c.alternatives or "",
                *("" if v is None else v for v in pad),
            ])  # fmt: skip
    return out.getvalue()
