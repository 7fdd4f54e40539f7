"""Which layer x tensor-parallel degree cells of popular open models each built-in format can shard.

Walks the real Linear shapes of a handful of models (from their published
configs; no weights, no allocation) through the planner for every built-in
format and prints, per model and format, how many (layer, TP degree) cells
are legal out of all, which layer kinds are refused where, and how many the
zero-padding of ``dtensor_quant.pad_for_tp`` would make legal. Then times the
planner on a whole 70B-class model (80 layers, vocabulary 152k, TP 1-8 x
FSDP 8-256).

    PYTHONPATH=. python bench/model_shapes.py
"""

from __future__ import annotations

import time

from dtensor_quant.model.planner import Layer, plan
from dtensor_quant.testing import is_default, where

# name: (layers, hidden, intermediate, q out, kv out, vocab) -- from each model's config.json
MODELS = {
    "TinyLlama-1.1B": (22, 2048, 5632, 2048, 256, 32000),
    "Llama-2-7B": (32, 4096, 11008, 4096, 4096, 32000),
    "Llama-3-8B": (32, 4096, 14336, 4096, 1024, 128256),
    "Mistral-7B": (32, 4096, 14336, 4096, 1024, 32000),
    "Qwen2-7B": (28, 3584, 18944, 3584, 512, 152064),
    "Gemma-2-9B": (42, 3584, 14336, 4096, 2048, 256000),
    "Qwen2-72B": (80, 8192, 29568, 8192, 1024, 152064),
}
FORMATS = list(where(is_default).values())  # every built-in format with its defaults, from the test registry
TP = (1, 2, 4, 8)


def layers(n_layers, hidden, inter, q, kv, vocab, per_layer_only=False) -> list[Layer]:
    """One transformer block's Linears (gate/up/q/k/v column-parallel, o/down row-parallel), times n_layers."""
    block = [
        ("q_proj", (q, hidden), "colwise"),
        ("k_proj", (kv, hidden), "colwise"),
        ("v_proj", (kv, hidden), "colwise"),
        ("o_proj", (hidden, q), "rowwise"),
        ("gate_proj", (inter, hidden), "colwise"),
        ("up_proj", (inter, hidden), "colwise"),
        ("down_proj", (hidden, inter), "rowwise"),
    ]
    out = [Layer(f"layers.{i}.{n}", s, st) for i in range(1 if per_layer_only else n_layers) for n, s, st in block]
    return out + [Layer("lm_head", (vocab, hidden), "colwise")]


def table() -> str:
    rows = [["model", *(str(f) for f in FORMATS)]]
    notes = []
    for model, cfg in MODELS.items():
        row = [model]
        for fmt in FORMATS:
            result = plan(layers(*cfg), fmt, tp=TP)
            cells = [c for _, cs in result.rows for c in cs]
            legal = sum(c.legal for c in cells)
            padded = sum(c.legal or c.padding is not None for c in cells)
            row.append(f"{legal}/{len(cells)}" + (f" (+{padded - legal} padded)" if padded > legal else ""))
            refused = sorted({(layer.name.split(".")[-1], c.tp) for layer, c in result.refusals})
            if refused:
                kinds: dict[str, list[int]] = {}
                for kind, tp in refused:
                    kinds.setdefault(kind, []).append(tp)
                where = "; ".join(f"{k} at TP {', '.join(map(str, v))}" for k, v in kinds.items())
                notes.append(f"{model}, {fmt}: refused {where}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines + [""] + notes)


def time_70b() -> str:
    out = []
    big = layers(*MODELS["Qwen2-72B"])
    for fmt in FORMATS:
        start = time.perf_counter()
        result = plan(big, fmt, tp=range(1, 9), dp=[8, 16, 32, 64, 128, 256])
        str(result)
        elapsed = time.perf_counter() - start
        cells = sum(len(cs) for _, cs in result.rows)
        out.append(f"{fmt}: {len(big)} layers x 48 meshes = {cells} cells planned and rendered in {elapsed:.1f} s")
    return "\n".join(out)


if __name__ == "__main__":
    print(f"Legal (layer, TP degree) cells, TP in {TP}; '+N padded': refused cells the planner's zero-padding")
    print("proposal makes legal (exact for per-row/per-group formats, see docs/planning.md)\n")
    print(table())
    print("\nQwen2-72B-shaped model, TP 1-8 x FSDP 8-256 (each format once, after the table, in the same process):")
    print(time_70b())
