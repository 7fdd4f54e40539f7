"""A pre-quantized weight in the loader: its stored layout found, the model's weight checked against it, a rank's
chunk read.

:func:`find` asks the producers (:func:`~.producers.detect`) how the
checkpoint stores a model tensor, or the format's own Hugging Face form;
:func:`check` says why the checkpoint's tensors do not fit the model's
weight; :func:`read` reads this rank's chunk of every inner tensor through
the layout's maps (no dequantization, no requantization) and
:func:`~dtensor_quant._checkpoint.state_dict.from_entries` places it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from ..._core.format import QuantFormat, weight_layout
from ..._core.tensor import contiguous_strides
from ..state_dict import CheckpointFormatError, canonical_view, entry_placements, entry_shape, from_entries
from .io.safetensors_io import Checkpoint
from .producers import by_suffixes, detect, quantization_config
from .producers.layout import StoredLayout
from .producers.stored import small
from .tensors import box, describe

__all__ = ["check", "find", "quantization_config", "read", "same_format"]


def check(layout: StoredLayout, key: str, t: torch.Tensor, ckpt: Checkpoint) -> list[str]:
    """Why the checkpoint's tensors of ``key`` do not fit ``t`` (the model's weight) in ``layout``, or nothing.

    Reads the layout's extras (small) on every rank.
    """
    q, inner, to_canonical, shape = canonical_view(t, key)
    errors = []
    if layout.transposed != (to_canonical != tuple(range(len(shape)))):
        return [(f"{key}: the model's quantized weight {'is not' if layout.transposed else 'is'} the transposed view "
                 f"of a [..., out, in] weight, and {layout.method} needs it {'' if layout.transposed else 'not '}"
                 "transposed; build the model with dq.hf.quantize_like_checkpoint(model, path)")]  # fmt: skip
    if q.fmt != layout.fmt and not same_format(q.fmt, inner, layout):
        return [(f"{key}: the checkpoint holds it stored quantized ({layout.method}), which {layout.fmt} holds; "
                 f"the model's weight is {q.fmt}. Build the model with "
                 "dq.hf.quantize_like_checkpoint(model, path)")]  # fmt: skip
    for name, rels in weight_layout(q.fmt, shape).items():
        st = layout.stored(name)
        why = st.mismatch(ckpt.tensors.get(st.key(key)), entry_shape(rels, shape))
        if why:
            errors.append(f"{key}: {layout} of shape {list(shape)} needs {st.key(key)} {why}")
    for extra in layout.extras:
        k = extra.key(key)
        why = "missing" if k not in ckpt.tensors else extra.check(small(ckpt, k), shape)
        if why:
            errors.append(f"{key}: {k}: {why}")
    return errors


def same_format(fmt: QuantFormat, inner: dict, layout: StoredLayout) -> bool:
    """Whether ``fmt`` (the model's, holding ``inner``) is ``layout.fmt`` spelled another way.

    ``Int8Rowwise()`` in a bf16 model keeps its scales in bf16, as
    ``Int8Rowwise(scale_dtype=torch.bfloat16)`` does: the same bytes, two
    spellings. A checkpoint names its scales' dtype, so the loader's format
    spells it; a model quantized with the other spelling reads it as stored
    when the formats differ in ``scale_dtype`` alone and its inner tensors
    have the dtypes the checkpoint stores (never a conversion).
    """
    if not all(dataclasses.is_dataclass(f) and hasattr(f, "scale_dtype") for f in (fmt, layout.fmt)):
        return False
    if dataclasses.replace(fmt, scale_dtype=None) != dataclasses.replace(layout.fmt, scale_dtype=None):
        return False
    for name, st in layout.inner:
        if st.dtype.is_floating_point and name in inner and inner[name].dtype != st.dtype:
            return False
    return True


def find(qc: dict | None, ckpt: Checkpoint, key: str, t: torch.Tensor, quantized: bool) -> StoredLayout | str | None:
    """The stored layout to read model tensor ``key`` with, an error message, or None (read it as usual)."""
    try:
        layout = detect(qc, ckpt, key, tuple(t.shape), t.dtype)
    except CheckpointFormatError:
        raise  # a damaged file: at once, not one of the model's mismatches
    except ValueError as e:
        return str(e)
    if layout is None and quantized:
        q = canonical_view(t, key)[0]
        layout = by_suffixes(q.fmt, ckpt, key, tuple(t.shape))
    if layout is None:
        return None
    if not quantized:
        return (f"{key}: the checkpoint stores it quantized ({layout.method}); the model's weight is {describe(t)}. "
                "Call dq.hf.quantize_like_checkpoint(model, path) on the model (on meta) before sharding it; "
                "quantized bytes are never silently dequantized")  # fmt: skip
    return layout


def read(layout: StoredLayout, ckpt: Checkpoint, key: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of every inner tensor of ``key``, read through ``layout`` and placed like ``t``."""
    q, inner, to_canonical, shape = canonical_view(t, key)
    entries = {}
    for name, rels in weight_layout(q.fmt, shape).items():
        st, g_shape, dtype = layout.stored(name), entry_shape(rels, shape), inner[name].dtype
        if isinstance(t, DTensor):
            placements = entry_placements(t.placements, rels, to_canonical)
            l_shape, l_off = box(g_shape, t.device_mesh, placements)
            local = st.read(ckpt, key, l_off, l_shape, g_shape, dtype)
            entries[name] = DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=g_shape,
                                               stride=contiguous_strides(g_shape))  # fmt: skip
        else:
            entries[name] = st.read(ckpt, key, (0,) * len(g_shape), g_shape, g_shape, dtype)
    return from_entries(entries, t, key)
