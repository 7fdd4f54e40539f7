"""Which layer x tensor-parallel degree cells of popular open models each built-in format can shard.

Walks the real Linear shapes of twelve models (from their published
configs; no weights, no allocation) through the planner for every built-in
format and prints two tables:

1. every (layer, TP degree) cell at TP 1, 2, 4, 8: how many are legal, and
   how many refused ones the planner's zero-padding proposal makes legal
   (``dtensor_quant.pad_for_tp`` for an MLP, ``pad_vocab_for_tp`` for the
   output head);
2. only the cells vLLM serves (TP dividing the attention heads; k/v cut into
   whole heads, replicated when TP exceeds the KV heads; for block FP8 only
   cuts into whole blocks, as vLLM checks): each
   is legal as is, legal with that padding, legal with ``adapt_tp_plan``
   (the row-parallel layer switched to column-parallel on a gathered input),
   or refused -- issue 24 asks for no refused one.

The planner's speed on a whole 70B-class model is bench/planner.py's.

    PYTHONPATH=. python bench/model_shapes.py
"""

from __future__ import annotations

import dtensor_quant as dq
from dtensor_quant._model.planner.plan import Layer, kind_from_name, plan
from dtensor_quant.testing import is_default, where

# name: (layers, hidden, intermediate, attention heads, KV heads, head dim, vocab) -- from each model's config.json
MODELS = {
    "TinyLlama-1.1B": (22, 2048, 5632, 32, 4, 64, 32000),
    "Llama-2-7B": (32, 4096, 11008, 32, 32, 128, 32000),
    "Llama-3-8B": (32, 4096, 14336, 32, 8, 128, 128256),
    "Llama-3.2-3B": (28, 3072, 8192, 24, 8, 128, 128256),
    "Llama-3-70B": (80, 8192, 28672, 64, 8, 128, 128256),
    "Mistral-7B": (32, 4096, 14336, 32, 8, 128, 32000),
    "Qwen2.5-0.5B": (24, 896, 4864, 14, 2, 64, 151936),
    "Qwen2.5-1.5B": (28, 1536, 8960, 12, 2, 128, 151936),
    "Qwen2-7B": (28, 3584, 18944, 28, 4, 128, 152064),
    "Qwen2-72B": (80, 8192, 29568, 64, 8, 128, 152064),
    "Phi-3-mini": (32, 3072, 8192, 32, 32, 96, 32064),
    "Gemma-2-9B": (42, 3584, 14336, 16, 8, 256, 256000),
}
# The transformers config of each (model type, its fields): the shapes above, the tied embeddings and fused weights
# as each model has them, and five more (MoE and MLA among them) for whole-model reports
# (``python -m dtensor_quant plan --config``, bench/plan_reports.py). Written locally, no weights.
TYPES = {"TinyLlama-1.1B": "llama", "Llama-2-7B": "llama", "Llama-3-8B": "llama", "Llama-3.2-3B": "llama",
         "Llama-3-70B": "llama", "Mistral-7B": "mistral", "Qwen2.5-0.5B": "qwen2", "Qwen2.5-1.5B": "qwen2",
         "Qwen2-7B": "qwen2", "Qwen2-72B": "qwen2", "Phi-3-mini": "phi3", "Gemma-2-9B": "gemma2"}  # fmt: skip
TIED = {"Llama-3.2-3B", "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Gemma-2-9B"}
MORE = {
    "Qwen2.5-72B": ("qwen2", dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=29568,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=152064)),
    "Mixtral-8x7B": ("mixtral", dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000)),
    "DeepSeek-V2-Lite": ("deepseek_v2", dict(num_hidden_layers=27, hidden_size=2048, intermediate_size=10944,
                                             moe_intermediate_size=1408, num_attention_heads=16,
                                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
                                             num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128, vocab_size=102400)),
    "gpt-oss-20b": ("gpt_oss", dict(num_hidden_layers=24, hidden_size=2880, intermediate_size=2880,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, vocab_size=201088)),
}  # fmt: skip


def config_fields(name: str) -> tuple[str, dict]:
    """``(model type, config fields)`` of model ``name`` (one of MODELS or MORE)."""
    if name in MORE:
        return MORE[name]
    n_layers, hidden, inter, heads, kv_heads, head_dim, vocab = MODELS[name]
    fields = dict(num_hidden_layers=n_layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                  tie_word_embeddings=name in TIED)  # fmt: skip
    return TYPES[name], fields


def write_config(name: str, path) -> str:
    """Model ``name``'s config.json in directory ``path`` (transformers' ``save_pretrained``; no weights)."""
    import transformers

    model_type, fields = config_fields(name)
    transformers.AutoConfig.for_model(model_type, **fields).save_pretrained(path)
    return str(path)


FORMATS = list(where(is_default).values())  # every built-in format with its defaults, from the test registry
TP = (1, 2, 4, 8)


def block(hidden, inter, heads, kv_heads, head_dim, vocab) -> list[tuple[str, tuple[int, int], str]]:
    """One transformer block's Linears (q/k/v/gate/up column-parallel, o/down row-parallel) and the output head.

    Fused weights (Phi-3's qkv_proj and gate_up_proj) are listed as their
    parts, as vLLM shards them: each part cut on its own.
    """
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        ("self_attn.q_proj", (q, hidden), "colwise"),
        ("self_attn.k_proj", (kv, hidden), "colwise"),
        ("self_attn.v_proj", (kv, hidden), "colwise"),
        ("self_attn.o_proj", (hidden, q), "rowwise"),
        ("mlp.gate_proj", (inter, hidden), "colwise"),
        ("mlp.up_proj", (inter, hidden), "colwise"),
        ("mlp.down_proj", (hidden, inter), "rowwise"),
        ("lm_head", (vocab, hidden), "colwise"),
    ]


def layers(n_layers, hidden, inter, heads, kv_heads, head_dim, vocab) -> list[Layer]:
    """Every Linear of the model: the block times ``n_layers``, then the output head."""
    out = []
    for name, shape, style in block(hidden, inter, heads, kv_heads, head_dim, vocab):
        names = [name] if name == "lm_head" else [f"model.layers.{i}.{name}" for i in range(n_layers)]
        out += [Layer(n, shape, style, kind_from_name(n)) for n in names]
    return out


def served_degree(name: str, tp: int, heads: int, kv_heads: int) -> int | None:
    """The degree vLLM cuts this layer at under TP ``tp``, or None if vLLM does not serve the model at ``tp``.

    vLLM needs the attention heads divisible by TP; k/v are cut into whole
    KV heads, and replicated over ``tp / kv_heads`` ranks when TP exceeds them.
    """
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        return None
    if name.endswith(("k_proj", "v_proj")):
        return min(tp, kv_heads)
    return tp


def vllm_refuses(fmt, name: str, shape: tuple[int, int], style: str, degree: int) -> bool:
    """Whether vLLM itself refuses this cut in this format (then it serves no such cell).

    Block FP8 (``weight_block_size``): every rank's input and output
    partition must be whole blocks ("Weight output_partition_size = 64 is not
    divisible by weight quantization block_n = 128"); vLLM's LM head is not
    quantized, so it has no such rule. The other formats: vLLM's own kernels
    take any cut its heads rule allows (bitsandbytes quantizes each rank's
    shard when it loads a dense checkpoint).
    """
    if not isinstance(fmt, dq.Float8Blockwise) or name == "lm_head":
        return False
    out, inp = shape
    out, inp = (out // degree, inp) if style == "colwise" else (out, inp // degree)
    return bool(out % fmt.block_size or inp % fmt.block_size)


def cells_table() -> str:
    """Table 1: legal (layer, TP) cells per model and format, one block of each model (every block is alike)."""
    rows = [["model", *(str(f) for f in FORMATS)]]
    notes = []
    for model, cfg in MODELS.items():
        row = [model]
        shapes = [Layer(n, s, st, kind_from_name(n)) for n, s, st in block(*cfg[1:])]
        for fmt in FORMATS:
            result = plan(shapes, fmt, tp=TP)
            count = [cfg[0] if layer.name != "lm_head" else 1 for layer, _ in result.rows]
            legal = sum(n * c.legal for n, (_, cs) in zip(count, result.rows) for c in cs)
            padded = sum(n * (c.legal or c.padding is not None) for n, (_, cs) in zip(count, result.rows) for c in cs)
            total = sum(count) * len(TP)
            row.append(f"{legal}/{total}" + (f" (+{padded - legal} padded)" if padded > legal else ""))
            refused: dict[str, list[int]] = {}
            for layer, c in result.refusals:
                refused.setdefault(layer.name.split(".")[-1], []).append(c.tp)
            if refused:
                where_ = "; ".join(f"{k} at TP {', '.join(map(str, v))}" for k, v in refused.items())
                notes.append(f"{model}, {fmt}: refused {where_}")
        rows.append(row)
    return markdown(rows) + "\n\n" + "\n".join(notes)


def served_cells(model: str, fmt) -> dict[str, list[tuple[str, int]]]:
    """The (layer kind, TP) cells vLLM serves, by verdict: legal, padded, switched (adapt_tp_plan) or refused."""
    _, *cfg = MODELS[model]
    heads, kv_heads = cfg[2], cfg[3]
    out: dict[str, list[tuple[str, int]]] = {"legal": [], "padded": [], "switched": [], "expanded": [], "refused": []}
    for name, shape, style in block(*cfg):
        for tp in TP:
            degree = served_degree(name, tp, heads, kv_heads)
            if degree is None or vllm_refuses(fmt, name, shape, style, degree):
                continue
            layer = Layer(name, shape, style, kind_from_name(name))
            cell = plan([layer], fmt, tp=[degree]).rows[0][1][0]
            if cell.legal:
                verdict = "legal"
            elif cell.padding is not None:
                verdict = "padded"
            elif style == "rowwise" and plan([Layer(name, shape, "colwise")], fmt, tp=[degree]).rows[0][1][0].legal:
                verdict = "switched"  # what adapt_tp_plan checks: the column cut at the same degree
            elif fmt.expanded_format() and plan([layer], fmt.expanded_format(), tp=[degree]).rows[0][1][0].legal:
                verdict = "expanded"  # what adapt_tp_plan does next: the same values with expanded scales
            else:
                verdict = "refused"
            out[verdict].append((name.split(".")[-1], tp))
    return out


def served_table() -> tuple[str, int]:
    """Table 2 and the number of refused cells (one block of each model: every block is alike)."""
    rows = [["model", "TP vLLM serves", *(str(f) for f in FORMATS)]]
    notes, refused = [], 0
    for model, cfg in MODELS.items():
        tps = [t for t in TP if served_degree("q_proj", t, cfg[3], cfg[4]) is not None]
        row = [model, ",".join(map(str, tps))]
        for fmt in FORMATS:
            got = served_cells(model, fmt)
            n = sum(len(v) for v in got.values())
            text = f"{len(got['legal'])}/{n}"
            text += "".join(f" +{len(got[k])}{k[0]}" for k in ("padded", "switched", "expanded", "refused") if got[k])
            row.append(text)
            for k in ("padded", "switched", "expanded", "refused"):
                if got[k]:
                    notes.append(f"{model}, {fmt}, {k}: " + ", ".join(f"{name}@TP{tp}" for name, tp in got[k]))
            refused += len(got["refused"])
        rows.append(row)
    legend = (
        "legal/served cells; +Np padded (pad_for_tp, pad_vocab_for_tp), +Ns switched (adapt_tp_plan), "
        "+Ne scales expanded (expand_scales, adapt_tp_plan), +Nr refused"
    )
    return markdown(rows) + "\n\n" + legend + "\n\n" + "\n".join(notes), refused


def markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"1. Legal (layer, TP degree) cells, TP in {TP}, every layer counted; '+N padded': refused cells the")
    print("planner's zero-padding proposal makes legal (exact for per-row/per-group formats, see docs/planning.md)\n")
    print(cells_table())
    print("\n2. The cells vLLM serves (one block and the head per model), by what makes them legal\n")
    text, refused = served_table()
    print(text)
    print(f"\nrefused cells vLLM serves: {refused} (issue 24's target: 0)")
