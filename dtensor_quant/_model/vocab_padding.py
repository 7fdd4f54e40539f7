"""Zero-padding of the vocabulary, so that every rank's slice of the output head is legal at a TP degree.

The output head ``[vocab, hidden]`` is column-parallel: each rank holds
``vocab / tp`` of its rows. A format whose blocks span several rows refuses
cuts between them: NF4 at hidden 1536 needs multiples of 32 rows, so
Qwen2.5-1.5B's 151936 rows (18992 per rank at TP 8) are refused, and at
hidden 3072 multiples of 16, so Phi-3-mini's 32064 (4008 per rank) are.
Padding the vocabulary to 152064 (19008 = 594 x 32 per rank) and 32128
makes them legal.

The padded rows are zeros and their logits are never seen: a forward hook
on the head slices its output back to the original vocabulary
(``logits[..., :vocab]``). Under ``parallelize_module`` the hook (registered
first) sees the DTensor output before the style's own output hook, slices
it as DTensor slices (a sharded vocabulary is gathered for the slice), and
the style then lays out the original vocabulary: gathered
(``colwise_gather_output``) or sharded again. A rank that sees a plain
tensor holding only its slice of the logits sets the padded ones to
``-inf``, so a softmax, an argmax or a cross-entropy never picks them. The
real logits are those of the unpadded head: each is the same row times the
same input.

The default length is the smallest one at which every rank holds the same
number of rows and the format accepts each cut. vLLM pads the vocabulary to
a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``) and then needs equal shards;
that alignment is for its GPU kernels, and is not what a block size asks
for (Phi-3-mini's 32064 is a multiple of 64 and still refused by NF4 at TP 8),
so it is an option here (``multiple=64``), not the default.

A tied embedding (the head's weight is the embedding's) is padded with it
and stays tied; its padded rows are never looked up (token ids stay below
the original vocabulary). An untied embedding is left alone: it stays dense
(``quantize_`` quantizes Linear weights), and DTensor shards a dense
weight unevenly.

Exactness of the weights is :mod:`.padding`'s: a dense head is padded with
zero rows; a quantized head whose statistics are per row or per block
(int8, int4, float8) gets whole new blocks of zeros and keeps its bytes; a
format with a statistic over the whole weight (NF4's mean, a per-tensor
scale) is refused once quantized -- pad the dense model first, and its
quantized head is then the padded dense head quantized.

The padding is recorded as the persistent buffer ``tp_padding = [original,
padded]`` on the head (and the tied embedding), as :func:`~.padding.pad_for_tp`
records an MLP's, so ``dq.hf.save`` writes the original vocabulary and
``dq.hf.load`` fills a padded model from an unpadded checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._checkpoint.hf.tensors import PADDING_BUFFER
from .._core.format import QuantFormat, check_shape
from .._core.tensor import QuantizedTensor
from .._parallel.placements import first_bad_cut
from .padding import SEARCH_STEPS, legal_length, original_size, zero_padded

# Names of an output head when a model does not say (gpt-fast/torchtitan call it ``output``).
HEAD_NAMES = ("lm_head", "output")
#: The attribute holding ``(original, padded)`` on a padded head, read by its output hook.
VOCAB_ATTR = "dq_vocab_padding"


def output_head(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """``(fqn, module)`` of the Linear that maps hidden states to logits, or None.

    transformers models say which (``get_output_embeddings``); otherwise a
    Linear named ``lm_head`` or ``output`` with as many outputs as an
    embedding has rows.
    """
    names = {id(m): fqn for fqn, m in model.named_modules()}
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Linear) and id(head) in names:
            return names[id(head)], head
    vocabs = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for fqn, m in model.named_modules():
        if isinstance(m, nn.Linear) and fqn.rsplit(".", 1)[-1] in HEAD_NAMES and m.out_features in vocabs:
            return fqn, m
    return None


def vocab_length(vocab: int, hidden: int, fmt: QuantFormat | None, tp: int, multiple: int = 1) -> int | None:
    """The smallest vocabulary ``>= vocab`` whose ``tp`` row shards of a ``[vocab, hidden]`` head ``fmt`` holds.

    Equal shards (as :func:`~.padding.legal_length` gives), also a multiple
    of ``multiple``; ``vocab`` itself when it is legal and ``multiple`` is 1.
    ``fmt`` None: a dense head, legal at any length. None if nothing within
    ``SEARCH_STEPS`` steps is legal.
    """
    if fmt is not None and multiple == 1:
        return legal_length((vocab, hidden), 0, fmt, (tp,), (Shard(0),))
    if multiple == 1:
        return vocab
    step = math.lcm(tp, multiple)
    start = -(-vocab // step) * step
    for n in range(start, start + SEARCH_STEPS * step + 1, step):
        if fmt is None or _fits((n, hidden), fmt, tp):
            return n
    return None


def _fits(shape, fmt: QuantFormat, tp: int) -> bool:
    try:
        check_shape(fmt, shape)
    except ValueError:
        return False
    return first_bad_cut(shape, fmt, (tp,), (Shard(0),)) is None


def pad_vocab_for_tp(
    model: nn.Module, tp_degree: int, fmt: QuantFormat | None = None, multiple: int = 1
) -> dict[str, tuple[int, int]]:
    """Zero-pad the output head's rows (and a tied embedding's) so every rank's slice is legal at ``tp_degree``.

    ``fmt``: the format a dense head will be quantized to (a quantized head
    gives its own); None for a head that stays dense. ``multiple``: also
    round the vocabulary up to a multiple of it (vLLM's 64). In place, on a
    model not yet distributed; returns ``{fqn: (original, padded)}`` for what
    it padded (empty if the vocabulary is already legal). The padded logits
    are sliced away or set to ``-inf`` by a forward hook on the head (module
    docstring). Raises ``ValueError`` before changing anything when the head
    cannot be found or padded exactly.
    """
    if tp_degree < 1 or multiple < 1:
        raise ValueError(f"tp_degree and multiple must be >= 1, got {tp_degree} and {multiple}")
    found = output_head(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no output head to pad: no get_output_embeddings() Linear and no Linear "
            f"named {' or '.join(HEAD_NAMES)} with as many outputs as an embedding has rows"
        )
    fqn, head = found
    weight = head.weight
    if isinstance(weight, DTensor):
        raise ValueError(f"{fqn}: pad the vocabulary before distributing the model (its weight is already a DTensor)")
    wfmt = weight.fmt if isinstance(weight, QuantizedTensor) else fmt
    vocab, hidden = head.out_features, head.in_features
    padded = vocab_length(vocab, hidden, wfmt, tp_degree, multiple)
    if padded is None:
        raise ValueError(
            f"{fqn}: no vocabulary size up to {vocab + SEARCH_STEPS * math.lcm(tp_degree, multiple)} makes {wfmt} "
            f"legal for its rows at TP {tp_degree} (check_placements on the padded shape says why)"
        )
    if padded == vocab:
        return {}
    tied = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m.weight is weight]
    new = nn.Parameter(zero_padded(weight, 0, padded, fqn), requires_grad=weight.requires_grad)  # may refuse
    bias = None
    if head.bias is not None:
        bias = nn.Parameter(F.pad(head.bias.detach(), (0, padded - vocab)), requires_grad=head.bias.requires_grad)
    owners = [(fqn, head), *tied]
    originals = {name: original_size(module, vocab, name) for name, module in owners}  # may refuse, too
    done = {}
    head.weight, head.out_features = new, padded
    if bias is not None:
        head.bias = bias
    for name, module in owners:
        if isinstance(module, nn.Embedding):
            module.weight, module.num_embeddings = new, padded
        original = originals[name]
        # A real (CPU) buffer even in a model built on meta, as pad_for_tp records an MLP's.
        module.register_buffer(PADDING_BUFFER, torch.tensor([original, padded], dtype=torch.int64, device="cpu"))
        done[name] = (original, padded)
    setattr(head, VOCAB_ATTR, (done[fqn][0], padded))
    if not getattr(head, "_dq_vocab_hooked", False):
        head.register_forward_hook(mask_padded_logits)
        head._dq_vocab_hooked = True
    return done


def mask_padded_logits(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The head's forward hook: the logits of the original vocabulary, or a rank's slice with ``-inf`` padding."""
    original, padded = getattr(module, VOCAB_ATTR)
    if isinstance(output, DTensor) or output.shape[-1] == padded:
        # A DTensor (the hook runs before a ParallelStyle's output hook): sliced as DTensor slices, so the
        # style then lays out the original vocabulary (gathered, or sharded again over its ranks).
        return output[..., :original]
    weight = module.weight
    if isinstance(weight, DTensor):  # this rank's columns of the logits: its rows of the head
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return _masked(output, offset[0], original)
    raise RuntimeError(f"the padded head's output has {output.shape[-1]} logits, neither {padded} nor a rank's slice")


def _masked(local: torch.Tensor, start: int, original: int) -> torch.Tensor:
    """``local`` (global columns ``start..``) with the columns at or past ``original`` set to ``-inf``."""
    keep = max(0, min(local.shape[-1], original - start))
    if keep == local.shape[-1]:
        return local
    index = torch.arange(local.shape[-1], device=local.device)
    return local.masked_fill(index >= keep, float("-inf"))
