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

from .cells import DENSE_BYTES, Cell, Layer, local_shape, mesh_and_placements, numel, size, stored_bytes

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


def render(p, width: int = WIDTH, max_lines: int = 0) -> str:
    """The plan ``p`` as text: collapsed rows, totals per rank, notes; no line longer than ``width`` (0: no limit).

    ``max_lines`` (0: no limit): past it, the notes are given in short (two
    lines each at most: where, why, the remedies by name); ``csv_rows`` keeps
    every word.
    """
    rows = groups(p.rows)
    notes, shared = {}, {}  # row -> note number; rows refused alike (q/k/v by the head rule, gate/up) share one
    for i, g in enumerate(rows):
        refused = [c for c in g.cells if not c.legal]
        if not refused:
            continue
        alike = all(c.heads_refused for c in refused)
        key = (tuple((c.dp, c.tp, c.why) for c in refused), refused[0].alternatives, refused[0].padding, g.count,
               None if alike else (g.layer.shape, g.layer.style))  # fmt: skip
        notes[i] = shared.setdefault(key, len(shared) + 1)
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
    title = f"{_formats(p)}: bytes each rank stores per weight (largest shard); NO = refused, see notes"
    title += f"; expert stacks over ep={p.ep}" if p.ep > 1 else ""
    lines = textwrap.wrap(title, width, subsequent_indent="    ", break_long_words=False) if width else [title]
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
    numbers = sorted(set(notes.values()))
    full = []
    for number in numbers:
        full += _note(number, [rows[i] for i, n in notes.items() if n == number], p, width)
    for short in (2, 1):  # past max_lines: each note in two lines at most, then in one
        if not (numbers and max_lines and len(lines) + len(full) > max_lines):
            break
        full = ["Notes in short (every word: --csv, or --max-lines 0):"]
        for number in numbers:
            full += _note(number, [rows[i] for i, n in notes.items() if n == number], p, width, short=short)
    return "\n".join(lines + full)


def _formats(p) -> str:
    """The plan's format, or the formats its layers carry (a checkpoint's, as stored)."""
    own = {}
    for layer, _ in p.rows:
        if layer.fmt is not None and not layer.dense:
            own[str(layer.fmt)] = own.get(str(layer.fmt), 0) + 1
    if not own:
        return str(p.fmt)
    if len(own) == 1:
        return f"{next(iter(own))} as stored"
    return "as stored: " + ", ".join(f"{f} x{n}" for f, n in own.items())


_HEADS = ("lm_head", "output", "embed_out")


def _style(layer: Layer) -> str:
    head = layer.name.rpartition(".")[2] in _HEADS
    if layer.kind == "vocab" and layer.dense and not head:  # an embedding [vocab, dim]: torch calls its row cut rowwise
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
        total += g.count * -(-stored_bytes(g.layer.fmt or p.fmt, g.layer.shape) // ways)
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
        every = width - sum(widths[1:]) - 2 * (len(widths) - 1)  # the names' room with every mesh in one block
        if widths[0] > every >= min(28, widths[0]):  # shorter names rather than a second block
            room = every
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


def _note(number: int, same: list[Group], p, width: int, short: int = 0) -> list[str]:
    """The note of one row, or of rows refused alike (q, k, v by the same head rule: one note).

    ``short``: at most that many lines: where, why without the layout's details, and the remedies by name.
    """
    g = same[0]
    refused = [c for c in g.cells if not c.legal]
    first = refused[0]
    kind = {"rowwise": "row-parallel", "colwise": "column-parallel"}.get(g.layer.style, g.layer.style)
    labels = [s.label for s in same]
    head, _, _ = labels[0].rpartition(".")
    if len(same) == 1:
        who = labels[0]
    elif all(x.rpartition(".")[0] == head for x in labels):
        who = head + ".{" + ",".join(x.rpartition(".")[2] for x in labels) + "}"
    else:
        who = ", ".join(labels)
    who += f" x{g.count}" if g.count > 1 else ""
    alike = len({(s.layer.shape, s.layer.style) for s in same}) == 1
    what = f" [{'x'.join(map(str, g.layer.shape))}, {kind}]" if alike else ""
    text = f"({number}) {who}{what} refused at {where_meshes(refused, p.meshes)}"
    if short:
        return _short_note(text, first, g.layer, width, short)
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


def _short_note(text: str, first: Cell, layer: Layer, width: int, max_lines: int) -> list[str]:
    why = re.sub(r" \([^()]*(\([^()]*\)[^()]*)*\)", "", first.why)  # without "('qdata' is packed by 2, ...)"
    at = f" (tp={first.tp})" if first.tp > 1 else ""
    text += f": {why}{at}."
    hints, later = [], []
    for item in (first.alternatives or "").split("; "):
        if item.startswith("nearest"):
            hints.append(item.split(" (none above")[0])
        elif "adapt_tp_plan)" in item and "column-parallel" in item:
            hints.append("column-parallel switch (adapt_tp_plan)")
        elif "expand_scales" in item:
            hints.append("scales expanded (adapt_tp_plan)")
        elif item:
            later.append(item)  # a smaller block size: the longest, last
    if first.padding:
        fn = "pad_vocab_for_tp" if layer.kind == "vocab" else "pad_for_tp"
        hints.append(f"{fn} to {first.padding[1]} (+{size(first.padding[2])})")
    hints += later
    if hints:
        text += " " + "; ".join(hints)[0].upper() + "; ".join(hints)[1:] + "."
    if not width:
        return [text]
    return textwrap.wrap(text, width, subsequent_indent="    ", max_lines=max_lines, placeholder=" ...",
                         break_long_words=False, break_on_hyphens=False)  # fmt: skip


def where_meshes(refused, meshes: list[tuple[int, int]]) -> str:
    """Some meshes (anything with ``dp`` and ``tp``: cells, verdicts) in few words: ``every mesh``, ``tp=2, 4, 8``,
    ``tp=3 (every dp); dp=8,16 with tp=6``."""
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
    """The padding proposal of a refused cell (at tensor-parallel degree ``tp``), naming what applies it exactly.

    Short: what the functions guarantee (no output changes; exact zero
    blocks, or pad before quantizing) is docs/planning.md's.
    """
    dim, length, extra = padding
    at = f"for tp={tp}, " if tp else ""
    if kind == "vocab":
        return (
            f"Or, {at}zero-pad the vocabulary from {shape[dim]} to {length} (+{size(extra)} for the whole weight) "
            f"with dtensor_quant.pad_vocab_for_tp(model, tp, fmt): the padded logits never show."
        )
    what = "rows" if dim == 0 else "columns"
    return (
        f"Or, {at}zero-pad its {what} from {shape[dim]} to {length} (+{size(extra)} for the whole weight) with "
        f"dtensor_quant.pad_for_tp(model, tp, fmt) (gate/up rows and down columns alike; no output changes)."
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
                "bf16" if layer.dense else str(layer.fmt or p.fmt), c.dp, c.tp, " ".join(map(str, c.placements)),
                int(c.legal),
                "" if c.nbytes is None else c.nbytes, c.why or "", c.alternatives or "",
                *("" if v is None else v for v in pad),
            ])  # fmt: skip
    return out.getvalue()
