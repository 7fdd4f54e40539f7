"""Which checkpoint tensor each model tensor is read from, and the checks made before anything is read.

Tied weights, transformers' per-expert keys of a fused expert stack, weights
stored quantized in a format's layout: every rank reaches the same verdict
from the headers and the model alone, with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..._core.format import weight_layout
from ..._ops.layout_ops import canonical_dims
from ..state_dict import CheckpointFormatError, is_quantized
from .io.safetensors_io import Checkpoint, Pieces
from .prequantized import check, find, quantization_config
from .tensors import describe, local_slice, local_tensor, model_tensors, unpadded_shapes


def _tied(model: nn.Module) -> dict[str, str]:
    """Keys a checkpoint may leave out because they are tied to another (transformers' tie_word_embeddings)."""
    fn = getattr(model, "get_expanded_tied_weights_keys", None)
    try:
        return dict(fn()) if fn is not None else {}
    except (AttributeError, TypeError):  # an older transformers, or a model without a config
        return {}


def _converters(model: nn.Module) -> list[tuple[list[str], str, bool]]:
    """transformers' rules that fuse per-expert checkpoint tensors into one model tensor.

    ``(source patterns, target pattern, concatenated)`` for each
    ``WeightConverter`` whose operations are ``MergeModulelist(dim=0)``
    (stack the experts), optionally followed by ``Concatenate(dim=1)`` (join
    the sources along the rows, as gate and up make ``gate_up_proj``); other
    conversions are not read.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    out = []
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(conv, "operations", [])]
        targets = list(getattr(conv, "target_patterns", []))
        if len(targets) == 1 and ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            out.append((list(conv.source_patterns), targets[0], len(ops) == 2))
    return out


def _pieces(key: str, shape, ckpt: Checkpoint, converters) -> Pieces | str | None:
    """The pieces of fused tensor ``key`` in the checkpoint, an error message if they do not fit, or None."""
    for sources, target, concatenated in converters:
        if not key.endswith(target) or len(shape) != 3:
            continue
        prefix = key[: -len(target)]
        parts, row = [], 0
        for pattern in sources:
            first = prefix + pattern.replace("*", "0")
            if first not in ckpt.tensors:
                break
            rows = ckpt.tensors[first].shape[0]
            for e in range(shape[0]):
                parts.append((prefix + pattern.replace("*", str(e)), (e, row, 0)))
            row += rows
        else:
            found = [ckpt.tensors.get(k) for k, _ in parts]
            want = [(shape[1] if not concatenated else ckpt.tensors[k].shape[0], shape[2]) for k, _ in parts]
            dtypes = {f.dtype for f in found if f is not None}
            if (
                None in found
                or len(dtypes) != 1
                or [f.shape for f in found] != [tuple(w) for w in want]
                or (row != shape[1])
            ):
                return (f"{key}: the checkpoint's per-expert tensors {[k for k, _ in parts[:3]]}... do not add up to "
                        f"the model's {list(shape)} (expected {len(parts)} tensors of one dtype)")  # fmt: skip
            return Pieces(tuple(parts), dtypes.pop(), tuple(shape))
    return None


@dataclass(frozen=True)
class Padded:
    """A checkpoint tensor read into a model tensor that pad_for_tp made larger: the rest reads as zeros."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # the model's (padded)
    stored: tuple[int, ...]  # the checkpoint's (the original size)


def plan(model: nn.Module, ckpt: Checkpoint, strict: bool):
    """``(kind, model key, checkpoint key, tensor)`` for every tensor to load, the missing and the unexpected keys.

    Checks only, no collective: every rank reaches the same verdict before anything is read.
    """
    tied, tasks, used, missing, errors = _tied(model), [], set(), [], []
    converters, qc = _converters(model), quantization_config(ckpt.path)
    unpadded, padding_records = unpadded_shapes(model)
    for key, _, t in model_tensors(model):
        if key is None:  # a LoRA adapter: not in any Hugging Face checkpoint, left as initialized
            continue
        if id(t) in padding_records:  # pad_for_tp's or pad_vocab_for_tp's record: the model's own, in no checkpoint
            continue
        stored = find(qc, ckpt, key, t, is_quantized(t)) if t.ndim >= 2 else None
        if isinstance(stored, str):
            errors.append(stored)
            continue
        if stored is not None:  # stored quantized in a layout the model's format holds: read as stored
            try:
                local_slice(t)
                if key in unpadded:
                    errors.append(f"{key}: a weight padded by pad_for_tp or pad_vocab_for_tp is not read as stored "
                                  f"({describe(t)}); load a dense checkpoint into it")  # fmt: skip
                errors.extend(check(stored, key, t, ckpt))
            except CheckpointFormatError:
                raise  # a damaged file: at once, not one of the model's mismatches
            except ValueError as e:
                errors.append(f"{key}: {e}")
            used.update(stored.keys(key))
            tasks.append(("prequantized", key, stored, t))
            continue
        src = key if key in ckpt.tensors else tied.get(key, key)
        if src not in ckpt.tensors:
            src = _pieces(key, tuple(t.shape), ckpt, converters)
            if src is None:
                missing.append(key)
                continue
            if isinstance(src, str):  # the pieces do not add up
                errors.append(src)
                continue
        try:
            local_slice(t)
        except ValueError as e:
            errors.append(f"{key}: {e}")
        info = ckpt.info(src)
        names = [k for k, _ in src.parts] if isinstance(src, Pieces) else [src]
        companions = [
            k + s for k in names for s in ("_scale_inv", "_scale", "_scales", "_blocks") if k + s in ckpt.tensors
        ]
        dense_float = info.dtype.is_floating_point and info.dtype.itemsize >= 2
        if not dense_float and (is_quantized(t) or companions or t.is_floating_point()):
            kind = "error"
            errors.append(f"{key}: the checkpoint holds it stored quantized ({names[0]} is {info.dtype}"
                          f"{', with ' + ', '.join(companions) if companions else ''}), the model's weight is "
                          f"{describe(t)}; build the model with dq.hf.quantize_like_checkpoint(model, path) "
                          "before loading: quantized bytes are never silently dequantized or "
                          "requantized")  # fmt: skip
        else:
            kind = "quantized" if is_quantized(t) else "dense"
            why = _plain_weight(t) if kind == "quantized" else None
            if why:
                errors.append(f"{key}: {why}")
            if info.shape != tuple(t.shape) and info.shape == unpadded.get(key) and isinstance(src, str):
                src = Padded(src, info.dtype, tuple(t.shape), info.shape)  # zeros past the original size
            elif info.shape != tuple(t.shape):
                errors.append(
                    f"{key}: the checkpoint's {names[0]} has shape {list(info.shape)}, the model's is {list(t.shape)}"
                )
        used.update(names)
        tasks.append((kind, key, src, t))
    unexpected = sorted(set(ckpt.tensors) - used)
    if strict and missing:
        errors.append(
            f"tensors of the model missing from the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}"
        )
    if strict and unexpected:
        errors.append(f"tensors of the checkpoint the model does not have: {unexpected[:10]}"
                      f"{' ...' if len(unexpected) > 10 else ''}")  # fmt: skip
    if errors:
        raise ValueError(f"cannot load {ckpt.path} (strict={strict}):\n  " + "\n  ".join(errors))
    return tasks, missing, unexpected


def _plain_weight(t: torch.Tensor) -> str | None:
    """Why quantized ``t`` cannot be loaded in place (a transposed or gathered view), or None."""
    q = local_tensor(t)
    layout = weight_layout(q.fmt, tuple(t.shape))
    if q.dims != canonical_dims(q.ndim) or any(rels != layout[n] for n, rels in zip(q.fmt.inner_names, q.rels)):
        return f"{q!r} is not a plain quantized weight (a transposed or gathered view); load into the parameter"
    return None
