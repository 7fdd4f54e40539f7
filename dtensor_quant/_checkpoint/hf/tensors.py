"""The model side of a checkpoint: the key of each of a model's tensors, and this rank's slice of it."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..._core.layout import partial_refused
from ..._parallel.agree import LOCAL
from ..state_dict import is_quantized
from .adapters import unwrap, wrapper_of

# What pad_for_tp (_model/padding.py) records on an MLP it pads: a buffer [original, padded] beside three
# Linear children (gate, up, down) named one of these ways. Defined here, below the model layer, for both:
# a checkpoint holds the MLP at its original size.
PADDING_BUFFER = "tp_padding"
MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))

# _StridedShard.local_shard_size_and_offset's offset mode that lists every index (torch's _StridedShardOffsetMode.ALL).
_ALL_OFFSETS = 1


def model_tensors(model: nn.Module):
    """``(checkpoint key, wrapper, tensor)`` for every parameter and persistent buffer, shared ones once.

    Inside a LoRA wrapper (:mod:`.adapters`: the library's
    :class:`~dtensor_quant.lora.LoRALinear`, peft's tuner layers) the wrapped
    module answers to the wrapper's own name (``q_proj.base.weight`` and
    ``q_proj.base_layer.weight`` are the checkpoint's ``q_proj.weight``) and
    ``wrapper`` is its :class:`~.adapters.Wrapper`; the adapters' own tensors
    come with key None (no Hugging Face checkpoint holds them). A peft
    ``PeftModel`` is read through the model it wraps.
    """
    model = unwrap(model)
    seen, wrappers = set(), {}
    for prefix, module in model.named_modules():  # parents before children
        at = _enclosing(prefix, wrappers)
        if at is None:
            w = wrapper_of(module)
            if w is not None:
                wrappers[prefix] = w
                at = prefix
        persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for name, t in [*module._parameters.items(), *((n, module._buffers[n]) for n in persistent)]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            full = f"{prefix}.{name}" if prefix else name
            if at is None:
                yield full, None, t
                continue
            w, rest = wrappers[at], full[len(at) + 1 :] if at else full  # ``rest``: the name inside the wrapper
            if w.base and rest.startswith(w.base + "."):
                inner = rest[len(w.base) + 1 :]
                yield (f"{at}.{inner}" if at else inner), w, t
            else:
                yield None, w, t


def _enclosing(prefix: str, wrappers: dict) -> str | None:
    """The name of the wrapper that ``prefix`` is or lies inside, or None."""
    while True:
        if prefix in wrappers:
            return prefix
        if not prefix:
            return None
        prefix = prefix.rpartition(".")[0]


def agreement_scope(model: nn.Module) -> tuple[dict, bool]:
    """Who must agree on a load's or save's outcome (``raise_together``'s keywords), and whether this rank leads.

    The ranks that hold the model: the largest mesh of its DTensors (when it
    covers the others), else every rank. A model without DTensors is this
    process's alone (a rank may load one while the others do something
    else), so there is nothing to agree on. The leader (the mesh's first
    rank; rank 0 for the world or a model without DTensors) creates files and
    writes the tensors that are not DTensors.
    """
    meshes = {}
    for t in [*model.parameters(), *model.buffers()]:
        if isinstance(t, DTensor):
            meshes[id(t.device_mesh)] = t.device_mesh
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not meshes:
        return {"process_group": LOCAL}, rank == 0
    ranks = {id(m): m.mesh.flatten().tolist() for m in meshes.values()}
    widest = max(meshes.values(), key=lambda m: len(ranks[id(m)]))
    if all(set(r) <= set(ranks[id(widest)]) for r in ranks.values()):
        return {"mesh": widest}, rank == ranks[id(widest)][0]
    return {}, rank == 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``t`` (``t`` itself when it is not a DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_slice(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's ``(shape, offset)`` in ``t``'s global tensor: one box, else ``ValueError``."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.ndim
    refuse_partial(t)
    return box(tuple(t.shape), t.device_mesh, t.placements)


def box(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's ``(shape, offset)`` under ``placements``, when its slice is one box of the global tensor.

    A ``_StridedShard`` can give a rank rows that are not one range (torch's
    ``compute_local_shape_and_global_offset`` then reports only the first);
    reading or writing such a slice as a box would move the wrong rows, so
    that raises ``ValueError``.
    """
    spans = regions(shape, mesh, placements)
    if len(spans) > 1:
        raise ValueError(
            f"under placements {list(placements)} on mesh {tuple(mesh.shape)}, this rank's slice of a "
            f"{list(shape)} tensor is {len(spans)} separate boxes, not one; redistribute it first"
        )
    if not spans:  # an empty slice (or a rank outside the mesh)
        local = index_lists(shape, mesh, placements)
        return tuple(len(i) for i in local) if local else (0,) * len(shape), (0,) * len(shape)
    _, offset, lengths = spans[0]
    return lengths, offset


def index_lists(shape, mesh, placements) -> list[range | list[int]] | None:
    """The global index of each local position along each dim, on this rank; None outside the mesh.

    Placements are applied left to right, as DTensor does: ``Shard`` takes
    ``torch.chunk``'s chunk of the indices so far, ``_StridedShard`` the
    indices its own ``local_shard_size_and_offset`` names.
    """
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    index: list = [range(n) for n in shape]
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            _, picked = p.local_shard_size_and_offset(len(index[p.dim]), mesh.size(m), coord[m], _ALL_OFFSETS)
            index[p.dim] = [index[p.dim][i] for i in picked]
        elif isinstance(p, Shard):
            n, start = Shard.local_shard_size_and_offset(len(index[p.dim]), mesh.size(m), coord[m])
            index[p.dim] = index[p.dim][start : start + n]
        elif isinstance(p, Partial):
            raise ValueError(f"a Partial tensor ({list(placements)}) has no slice to read or write; redistribute it")
    return index


Region = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (start in the local tensor, global start, lengths)


def regions(shape, mesh, placements, limits=None) -> list[Region]:
    """This rank's slice as boxes of consecutive global indices (one, unless a ``_StridedShard`` scatters it).

    ``limits`` clips each dim's global indices to ``[0, limit)`` (an export
    that leaves out padding). Empty when the slice is empty or the rank is
    outside the mesh.
    """
    index = index_lists(shape, mesh, placements) if mesh is not None else [range(n) for n in shape]
    if index is None:
        return []
    limits = limits or shape
    per_dim = [_runs(ix, limit) for ix, limit in zip(index, limits)]
    if not per_dim:
        return [((), (), ())]
    return [tuple(zip(*combo)) for combo in itertools.product(*per_dim)]


def _runs(index, limit: int) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of each run of consecutive indices below ``limit``."""
    if isinstance(index, range):
        n = max(0, min(len(index), limit - index.start)) if len(index) else 0
        return [(0, index.start, n)] if n else []
    out: list[list[int]] = []
    for pos, g in enumerate(index):
        if g >= limit:
            continue
        if out and out[-1][0] + out[-1][2] == pos and out[-1][1] + out[-1][2] == g:
            out[-1][2] += 1
        else:
            out.append([pos, g, 1])
    return [tuple(r) for r in out]


def first_replica(mesh, placements, leader: bool) -> bool:
    """Whether this rank holds the first replica of its slice under ``placements``: the one that writes it.

    A plain tensor (``mesh`` None) is written by the ``leader``. On a mesh,
    every dim that does not split the tensor (``Replicate``) must be at
    coordinate 0; ``Shard`` and ``_StridedShard`` dims split it
    (``is_shard()`` is False for ``_StridedShard``), so every coordinate there
    holds its own slice.
    """
    if mesh is None:
        return leader
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, placements) if not isinstance(p, (Shard, _StridedShard)))


def refuse_partial(t: torch.Tensor) -> None:
    """Raise, naming the placements, if ``t`` is a DTensor with a ``Partial`` placement (it has no slice)."""
    if not isinstance(t, DTensor):
        return
    if any(isinstance(p, Partial) for p in t.placements):
        if is_quantized(t):
            raise partial_refused("a quantized weight", "Partial", f" ({t.placements} has no slice to read or write)")
        raise ValueError(f"a Partial tensor ({t.placements}) has no slice to read or write; redistribute it first")


def stored_suffixes(t: torch.Tensor) -> dict[str, str] | None:
    """The checkpoint key suffix of each inner tensor, for a format that has a Hugging Face layout."""
    if not is_quantized(t):
        return None
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.fmt.checkpoint_suffixes


def describe(t: torch.Tensor) -> str:
    """``t``'s format, or ``dense <dtype>``, for error messages."""
    if not is_quantized(t):
        return f"dense {t.dtype}"
    return str((t._local_tensor if isinstance(t, DTensor) else t).fmt)


def unpadded_shapes(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], set[int]]:
    """``{key: shape in a checkpoint}`` for the tensors that pad_for_tp or pad_vocab_for_tp padded, and ids of
    their records.

    A padded MLP's gate and up weights (and biases) have rows, its down
    weight columns, past the recorded original size; a padded output head
    (and its bias) or embedding has rows past the original vocabulary;
    checkpoints hold them at the original size. The ``tp_padding`` buffers
    themselves are the model's own record, in no checkpoint.
    """
    shapes, buffers = {}, set()
    for fqn, module in unwrap(model).named_modules():
        buf = module._buffers.get(PADDING_BUFFER)
        if buf is None:
            continue
        buffers.add(id(buf))
        local = local_tensor(buf)
        if local.is_meta:
            raise ValueError(f"{fqn}.{PADDING_BUFFER} is on the meta device: it must hold [original, padded]")
        original, padded = (int(v) for v in local.tolist())
        if isinstance(module, (nn.Linear, nn.Embedding)):  # pad_vocab_for_tp: an output head's or embedding's rows
            parts = [(fqn, module, 0, isinstance(module, nn.Linear))]
        else:
            trio = next((t for t in MLP_NAMES if all(hasattr(module, n) for n in t)), None)
            if trio is None:
                raise ValueError(
                    f"{fqn} records padding ({PADDING_BUFFER}) but is no Linear or Embedding and has none of the "
                    f"MLP children {MLP_NAMES}"
                )
            prefix = f"{fqn}." if fqn else ""
            parts = [(prefix + n, getattr(module, n), dim, dim == 0) for n, dim in zip(trio, (0, 0, 1))]
        for owner_key, owner, dim, with_bias in parts:
            for key, t in _linear_tensors(owner, with_bias=with_bias):
                name_key = f"{owner_key}.{key}" if owner_key else key
                if t.shape[dim] != padded:
                    raise ValueError(
                        f"{name_key} has {t.shape[dim]} along dim {dim}, the recorded padding says {padded}"
                    )
                shape = list(t.shape)
                shape[dim] = original
                shapes[name_key] = tuple(shape)
    return shapes, buffers


def _linear_tensors(linear: nn.Module, with_bias: bool):
    """``weight`` (and ``bias``) of a Linear, or of the Linear a LoRA wrapper holds."""
    for name in ("base", "base_layer"):
        if isinstance(getattr(linear, name, None), nn.Module):
            linear = getattr(linear, name)
            break
    yield "weight", linear.weight
    if with_bias and getattr(linear, "bias", None) is not None:
        yield "bias", linear.bias
