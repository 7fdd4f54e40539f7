"""The weights of a model as the planner sees them: each with the style its TP plan gives it.

A TP plan maps module (or parameter) names to styles, as
``parallelize_module`` takes them (torch ``ParallelStyle`` objects) or as
transformers declares them in ``model._tp_plan`` (strings: ``"colwise"``,
``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``,
``"packed_colwise"``, ...). Keys may hold ``*`` (``model.layers.*.mlp.down_proj``),
matched atom by atom as ``parallelize_module`` matches them. A weight no key
names is replicated on the tp dim; so is one whose style moves activations
only (``SequenceParallel``, ``"replicated_with_grad_allreduce"``).

Without a plan every matmul weight is listed both column- and row-parallel
(to explore), as before.

Attention projections carry the model's head counts (:func:`model_heads`,
from a transformers config) and their role, so the planner applies the
runtime's head rule to them. A weight tied between an embedding and the
output head is listed at both: the embedding dense and the head as the head
(``quantize_`` quantizes the head's weight and leaves the embedding's).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from ..._checkpoint.hf.tensors import MLP_NAMES
from ..padding import find_mlps
from ..quantize_model import is_matmul_weight
from ..vocab_padding import output_head
from .cells import STYLES, Layer

# transformers' style names (transformers/distributed/tensor_parallel.py), by what they do to a weight.
_COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise"}
_ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise"}
_PACKED = {"packed_colwise", "packed_rowwise"}
_EMBEDDING = {"embedding_rowwise": "colwise", "embedding_colwise": "rowwise"}  # [vocab, dim]: rows are the vocab
_REPLICATE = {
    "replicate",
    "replicated_with_grad_allreduce",
    "sequence_parallel",
    "local",
    "local_params",
    "all_reduce",
    "gather",
    "isolate",
    "moe_identity_expert",
}
# Styles on a module whose weights have keys of their own (transformers' MoE and MLA hooks): no weight style.
_MODULE_ONLY = {"moe_tp_experts", "mla_kv_a_proj", "ep_router", "grouped_gemm", "ep_dispatch_experts"}
KNOWN_STYLE_NAMES = sorted(_COLWISE | _ROWWISE | _PACKED | set(_EMBEDDING) | _REPLICATE | _MODULE_ONLY)

# Output heads and embeddings by name, for weights given as bare shapes (a model says so itself).
_VOCAB_NAMES = {"lm_head", "output", "embed_tokens", "tok_embeddings", "wte", "embed_out", "word_embeddings"}
_MLP_NAMES = {name for trio in MLP_NAMES for name in trio}
# Attention projections by name (under a module whose name holds "attn" or "attention"), by the heads they hold
# whole: query heads (q, o, MLA's q_b and kv_b, a fused qkv cut with both) or KV heads (k, v).
_Q_NAMES = {"q_proj", "o_proj", "q_b_proj", "kv_b_proj", "wq", "wo", "out_proj", "qkv_proj", "query_key_value",
            "query", "dense"}  # fmt: skip
_KV_NAMES = {"k_proj", "v_proj", "wk", "wv", "key", "value"}
_HEAD_FIELDS = (("num_attention_heads", "num_key_value_heads"), ("n_heads", "n_kv_heads"), ("n_head", "n_kv_head"))


def weight_style(style, module: nn.Module | None, key: str) -> str | None:
    """The planner's style (``colwise``, ``rowwise``, ``packed_*``, ``replicate``) of ``style`` on a weight.

    ``style``: a torch ``ParallelStyle`` or a transformers style name;
    ``module``: the module whose weight it is (an ``nn.Embedding`` shards its
    rows under ``RowwiseParallel``). None: the style names a module hook,
    not a weight's sharding. Raises ``ValueError`` for a style it does not know.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, str):
        if style in _COLWISE:
            return "colwise"
        if style in _ROWWISE:
            return "rowwise"
        if style in _PACKED:
            return style
        if style in _EMBEDDING:
            return _EMBEDDING[style]
        if style in _REPLICATE:
            return "replicate"
        if style in _MODULE_ONLY:
            return None
        raise ValueError(f"{key}: unknown TP style {style!r}; known: {KNOWN_STYLE_NAMES}")
    if isinstance(style, ColwiseParallel):  # torch: an Embedding's ColwiseParallel shards its embedding dim
        return "rowwise" if embedding else "colwise"
    if isinstance(style, RowwiseParallel):
        return "colwise" if embedding else "rowwise"
    if isinstance(style, (SequenceParallel, PrepareModuleInput, PrepareModuleOutput)):
        return "replicate"
    raise ValueError(
        f"{key}: the planner cannot tell how {type(style).__name__} places a weight; give it as "
        "'colwise', 'rowwise' or 'replicate' (plan(..., tp_plan={name: 'rowwise'}))"
    )


def key_matches(key: str, name: str) -> bool:
    """Whether TP-plan ``key`` names module (or parameter) ``name``, as ``parallelize_module`` matches it.

    torch walks the key one dotted atom at a time and ``fnmatch``-es each
    atom against a child's name, so ``*`` (and ``?``, ``[...]``) stays inside
    one atom: ``layers.*.wo`` matches ``layers.3.wo``, not ``layers.3.attn.wo``.
    The one rule of the planner and :func:`~dtensor_quant.adapt_tp_plan`.
    """
    atoms, parts = key.split("."), name.split(".")
    return len(atoms) == len(parts) and all(map(fnmatchcase, parts, atoms))


def is_pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


class PlanKeys:
    """A TP plan's keys, matched against module and parameter names by :func:`key_matches`.

    An exact key wins over a pattern; among patterns, the later key in the
    plan (``parallelize_module`` applies them in order, so it has the last word).
    """

    def __init__(self, plan: dict):
        self.exact = {k: v for k, v in plan.items() if not is_pattern(k)}
        self.patterns = [(k, v) for k, v in plan.items() if is_pattern(k)]

    def get(self, name: str):
        if name in self.exact:
            return self.exact[name]
        found = None
        for key, style in self.patterns:
            if key_matches(key, name):
                found = style
        return found


def model_heads(model: nn.Module) -> tuple[int, int] | None:
    """``(attention heads, KV heads)`` from the model's config (transformers' ``config``), or None if it has none.

    The KV heads default to the attention heads (multi-head attention), as transformers' configs do.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    for heads, kv in _HEAD_FIELDS:
        h = getattr(config, heads, None)
        if isinstance(h, int) and h > 0:
            k = getattr(config, kv, None)
            return h, k if isinstance(k, int) and k > 0 else h
    return None


def attention_role(name: str) -> str:
    """``"q"``, ``"kv"`` or ``""`` for a weight named ``name`` (``model.layers.0.self_attn.k_proj``)."""
    atoms = [a for a in name.split(".") if a not in ("weight", "bias")]
    if len(atoms) < 2 or not any("attn" in a or "attention" in a for a in atoms[:-1]):
        return ""
    return "q" if atoms[-1] in _Q_NAMES else "kv" if atoms[-1] in _KV_NAMES else ""


def layers_of(
    model: nn.Module,
    tp_plan: dict | None = None,
    styles: dict[str, str] | None = None,
    dense: bool = False,
    heads: tuple[int, int] | None = None,
) -> list[Layer]:
    """The matmul weights of ``model`` with their TP style (from ``tp_plan`` or ``styles``; else both styles).

    ``tp_plan``: ``{module or parameter name (``*`` allowed): torch
    ParallelStyle or transformers style name}``; a weight it does not name
    is ``replicate``. ``styles``: ``{exact name: planner style}``, over the
    plan. ``dense``: also list the parameters ``quantize_`` leaves dense
    (embeddings, norms, biases), with ``dense=True``, so a whole model's
    bytes per rank add up. ``heads``: ``(attention heads, KV heads)`` for the
    head rule of attention projections (default: :func:`model_heads`).
    """
    keys = PlanKeys(tp_plan) if tp_plan else None
    styles = dict(styles or {})
    heads = heads or model_heads(model)
    mlp = _mlp_weights(model)
    vocab = _vocab_weights(model)
    out, seen = [], set()
    for fqn, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            quantized = is_matmul_weight(module, name, p)
            # A tied weight (lm_head = embed_tokens) is listed once per role: the dense embedding, and the head
            # that quantize_ quantizes (it replaces the head's parameter, the embedding keeps the dense one).
            if (id(p), quantized) in seen:
                continue
            seen.add((id(p), quantized))
            key = f"{fqn}.{name}" if fqn else name
            shown = fqn if isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight" else key
            kind = "mlp" if id(p) in mlp else "vocab" if id(p) in vocab else ""
            if not quantized and not dense:
                continue
            if shown in styles or key in styles:
                chosen = [styles.get(shown, styles.get(key))]
            elif keys is not None:
                chosen = [_style_in_plan(keys, module, fqn, name, key, p.ndim)]
            elif quantized:
                chosen = list(STYLES)
            else:
                chosen = ["replicate"]
            role = attention_role(shown) if heads else ""
            extra = {"heads": tuple(heads), "role": role} if role else {}
            out += [Layer(shown, tuple(p.shape), s, kind, not quantized, **extra) for s in chosen]
    return out


def _style_in_plan(keys: PlanKeys, module, fqn: str, name: str, key: str, ndim: int) -> str:
    """The style the plan gives parameter ``key``: its own key, else its module's (a weight's or a bias's)."""
    style = keys.get(key)
    if style is not None and weight_style(style, module, key) is not None:
        return weight_style(style, module, key)
    style = keys.get(fqn) if fqn else None
    chosen = weight_style(style, module, fqn) if style is not None else None
    if chosen is None:
        return "replicate"
    if ndim == 1 and name != "weight":  # a bias: follows a column-parallel layer's rows, whole otherwise
        return "colwise" if chosen == "colwise" and isinstance(module, nn.Linear) else "replicate"
    if ndim == 1:  # a norm's weight under SequenceParallel and the like
        return "replicate"
    return chosen


def _mlp_weights(model: nn.Module) -> set[int]:
    """ids of the gate/up/down weights of SwiGLU MLPs (what pad_for_tp pads)."""
    return {id(lin.weight) for _, _, trio in find_mlps(model) for lin in trio}


def _vocab_weights(model: nn.Module) -> set[int]:
    """ids of the output head's and the embeddings' weights (what pad_vocab_for_tp pads)."""
    out = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = output_head(model)
    if head is not None:
        out.add(id(head[1].weight))
    return out


def kind_from_name(name: str) -> str:
    """``"vocab"``, ``"mlp"`` or ``""`` for a weight known only by name (``lm_head``, ``mlp.down_proj``)."""
    atoms = [a for a in name.split(".") if a not in ("weight", "bias")]
    last = atoms[-1] if atoms else ""
    return "vocab" if last in _VOCAB_NAMES else "mlp" if last in _MLP_NAMES else ""
