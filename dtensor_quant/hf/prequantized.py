"""Pre-quantized checkpoints: which format holds each producer's stored layout, and how to read a rank's chunk.

A producer (compressed-tensors, GPTQ, AWQ, bitsandbytes, gpt-oss's MXFP4,
DeepSeek's FP8) stores each quantized weight as a few tensors named after
the weight. :func:`detect` reads the checkpoint's ``quantization_config``
(``config.json``) and the headers of a weight's tensors and answers with a
:class:`StoredLayout`: the library format whose inner tensors hold exactly
those values, and for each inner tensor the :class:`~.stored.Stored` map
between a chunk of it and the bytes of the file. Loading then reads each
rank's chunk of every inner tensor through that map (no dequantization, no
requantization) and :func:`~dtensor_quant.state_dict.from_entries` places it.

Every rank reaches the same verdict from the files alone, with no collective.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..format import QuantFormat, weight_layout
from ..formats import Float8Blockwise, Float8Rowwise, Int4Groupwise, Int8Rowwise
from ..state_dict import canonical_view, entry_placements, entry_shape, from_entries
from ..tensor import contiguous_strides
from .safetensors_io import Checkpoint
from .stored import Extra, Fill, Same, Stored, Words
from .tensors import describe


@dataclass(frozen=True)
class StoredLayout:
    """A format and, for each of its inner tensors, how the producer stores it."""

    fmt: QuantFormat
    method: str  # the producer and scheme, for messages and LoadResult: "compressed-tensors pack-quantized ..."
    inner: tuple[tuple[str, Stored], ...]
    extras: tuple[Extra, ...] = ()
    scale_dtype: torch.dtype | None = None  # the dtype the model must have when the format keeps scales in it

    def stored(self, name: str) -> Stored:
        return dict(self.inner)[name]

    def keys(self, key: str) -> list[str]:
        """Every checkpoint key this weight's layout reads."""
        return [s.key(key) for _, s in self.inner if not isinstance(s, Fill)] + [e.key(key) for e in self.extras]

    def __str__(self) -> str:
        return f"{self.fmt} ({self.method})"


# -- the checkpoint's quantization_config ------------------------------------------------------


def quantization_config(path) -> dict | None:
    """``config.json``'s ``quantization_config`` in checkpoint directory ``path``, or None."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    qc = json.loads(config.read_text()).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def _method(qc: dict | None) -> str | None:
    return None if qc is None else str(qc.get("quant_method", "")).lower() or None


# -- producers ------------------------------------------------------------------------------------


def _weight_shape(key: str) -> Extra:
    def check(t, shape):
        if t.ndim != 1 or t.tolist() != list(shape[-2:]):
            return f"weight_shape is {t.tolist()}, the model's weight is {list(shape)}"
        return None

    return Extra("{key}_shape", check, lambda shape: torch.tensor(list(shape[-2:]), dtype=torch.int64))


def _ct_target(target: str, name: str) -> bool:
    import re

    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target[:1].isupper() and "." not in target:  # a module class name ("Linear"): the headers decide
        return True
    return name == target or name.endswith("." + target)


def _ct_scheme(qc: dict, module: str) -> dict | None:
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if len(groups) > 1:
        groups = [g for g in groups if any(_ct_target(t, module) for t in g.get("targets", []))] or groups[:1]
    return groups[0] if groups else None


def _compressed_tensors(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """compressed-tensors (llm-compressor's, vLLM's): ``{key}_packed`` or ``{key}``, with ``{key}_scale``."""
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    tensors = ckpt.tensors
    packed, scale = key + "_packed", key + "_scale"
    if scale not in tensors:
        return None  # left dense (the scheme's ignore list, lm_head)
    scheme = _ct_scheme(qc, key[: -len(".weight")])
    args = (scheme or {}).get("weights") or {}
    fmt_name = (scheme or {}).get("format") or qc.get("format")
    bits, kind = args.get("num_bits"), args.get("type", "int")
    strategy, group, sym = args.get("strategy"), args.get("group_size"), args.get("symmetric", True)
    what = f"compressed-tensors {fmt_name} ({kind}{bits}, {strategy}{f' {group}' if group else ''}"
    what += f"{'' if sym else ', asymmetric'})"
    s_dtype = tensors[scale].dtype
    if fmt_name == "pack-quantized" and kind == "int" and bits == 4 and packed in tensors:
        g = group if strategy == "group" else shape[1] if strategy == "channel" else None
        if g is None:
            raise ValueError(f"{key}: {what} is not read (int4 strategy {strategy!r}; group and channel are)")
        if not sym:
            raise ValueError(f"{key}: {what}: integer zero points need the asymmetric int4 format")
        inner = (("qdata", Words("{key}_packed", torch.int32)), ("scale", Same("{key}_scale", s_dtype)),
                 ("zero", Fill("", s_dtype, 0.0)))  # fmt: skip
        return StoredLayout(Int4Groupwise(g), what, inner, (_weight_shape(key),), scale_dtype=s_dtype)
    if fmt_name in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8 and key in tensors:
        if strategy != "channel" or not sym:
            raise ValueError(f"{key}: {what} is not read (int8 is read per channel, symmetric)")
        inner = (("qdata", Same("{key}", torch.int8)), ("scale", Same("{key}_scale", s_dtype)))
        return StoredLayout(Int8Rowwise(), what, inner, scale_dtype=s_dtype)
    if fmt_name in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8 and key in tensors:
        if strategy == "channel":
            inner = (("qdata", Same("{key}", torch.float8_e4m3fn)), ("scale", Same("{key}_scale", s_dtype)))
            return StoredLayout(Float8Rowwise(), what, inner, scale_dtype=s_dtype)
        block = args.get("block_structure")
        if strategy == "block" and block and block[0] == block[1]:
            what = f"compressed-tensors {fmt_name} (fp8, {block[0]}x{block[1]} blocks)"
            inner = (("qdata", Same("{key}", torch.float8_e4m3fn)), ("scale_inv", Same("{key}_scale", s_dtype)))
            return StoredLayout(Float8Blockwise(block[0]), what, inner)
        raise ValueError(f"{key}: {what} is not read (fp8 is read per channel or in square blocks)")
    raise ValueError(f"{key}: {what} has no format here that holds it as stored")


def _fp8_blocks(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """DeepSeek-V3 / Qwen3-FP8: ``weight`` e4m3 + ``weight_scale_inv`` fp32 per block."""
    if key + "_scale_inv" not in ckpt.tensors or len(shape) != 2:
        return None
    b = (qc or {}).get("weight_block_size") or [128, 128]
    if b[0] != b[1]:
        raise ValueError(f"{key}: FP8 blocks {b} are not square; Float8Blockwise holds square blocks")
    fmt = Float8Blockwise(b[0])
    inner = (("qdata", Same("{key}", torch.float8_e4m3fn)), ("scale_inv", Same("{key}_scale_inv", torch.float32)))
    return StoredLayout(fmt, f"fp8 ({b[0]}x{b[1]} block scales)", inner)


PRODUCERS = {"compressed-tensors": _compressed_tensors, "fp8": _fp8_blocks}


def register_producer(quant_method: str, detect_fn) -> None:
    """Read checkpoints whose ``quantization_config`` says ``quant_method`` with ``detect_fn``.

    ``detect_fn(quantization_config, checkpoint, key, logical shape, dtype)``
    returns a :class:`StoredLayout`, None (the weight is stored dense), or
    raises ``ValueError`` (stored quantized in a way no format holds).
    """
    PRODUCERS[quant_method] = detect_fn


def detect(qc: dict | None, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """How the checkpoint stores weight ``key`` (logical ``shape``): a :class:`StoredLayout`, or None (dense).

    Raises ``ValueError`` for a weight stored quantized in a layout no format holds.
    """
    method = _method(qc)
    if method in PRODUCERS:
        return PRODUCERS[method](qc, ckpt, key, tuple(shape), dtype)
    if method is None:
        return _fp8_blocks(qc, ckpt, key, tuple(shape), dtype)
    return None


def by_suffixes(fmt: QuantFormat, ckpt: Checkpoint, key: str, shape) -> StoredLayout | None:
    """A format's own Hugging Face form (``checkpoint_suffixes``), when the checkpoint has every key of it."""
    suffixes = fmt.checkpoint_suffixes
    if not suffixes or any(key + s not in ckpt.tensors for s in suffixes.values()):
        return None
    inner = tuple((n, Same("{key}" + suffixes[n], ckpt.tensors[key + suffixes[n]].dtype)) for n in fmt.inner_names)
    return StoredLayout(fmt, f"{fmt}'s own layout", inner)


# -- checks and reads --------------------------------------------------------------------------


def check(layout: StoredLayout, key: str, t: torch.Tensor, ckpt: Checkpoint) -> list[str]:
    """Why the checkpoint's tensors of ``key`` do not fit ``t`` (the model's weight) in ``layout``, or nothing.

    Reads the layout's extras (small) on every rank.
    """
    q, _, _, shape = canonical_view(t, key)
    errors = []
    if q.fmt != layout.fmt:
        return [(f"{key}: the checkpoint holds it stored quantized ({layout.method}), which {layout.fmt} holds; "
                 f"the model's weight is {q.fmt}. Build the model with "
                 "dq.hf.quantize_like_checkpoint(model, path)")]  # fmt: skip
    if layout.scale_dtype is not None and layout.scale_dtype != t.dtype:
        errors.append(f"{key}: the checkpoint's scales are {layout.scale_dtype} and {layout.fmt} keeps its scales in "
                      f"the model's dtype ({t.dtype}); build the model in {layout.scale_dtype} to read them as "
                      "stored")  # fmt: skip
    for name, rels in weight_layout(q.fmt, shape).items():
        st = layout.stored(name)
        if isinstance(st, Fill):
            continue
        k = st.key(key)
        try:
            want = (st.dtype, st.stored_shape(entry_shape(rels, shape)))
        except ValueError as e:
            errors.append(f"{key}: {e}")
            continue
        got = (ckpt.tensors[k].dtype, ckpt.tensors[k].shape) if k in ckpt.tensors else None
        if got != want:
            errors.append(f"{key}: {layout} of shape {list(shape)} needs {k} as {want[0]} {list(want[1])}, "
                          f"the checkpoint has {'nothing' if got is None else f'{got[0]} {list(got[1])}'}")  # fmt: skip
    for extra in layout.extras:
        k = extra.key(key)
        why = "missing" if k not in ckpt.tensors else extra.check(ckpt.read(k), shape)
        if why:
            errors.append(f"{key}: {k}: {why}")
    return errors


def find(qc: dict | None, ckpt: Checkpoint, key: str, t: torch.Tensor, quantized: bool) -> StoredLayout | str | None:
    """The stored layout to read model tensor ``key`` with, an error message, or None (read it as usual)."""
    try:
        layout = detect(qc, ckpt, key, tuple(t.shape), t.dtype)
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
            l_shape, l_off = compute_local_shape_and_global_offset(g_shape, t.device_mesh, placements)
            local = st.read(ckpt, key, l_off, l_shape, g_shape, dtype)
            entries[name] = DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=g_shape,
                                               stride=contiguous_strides(g_shape))  # fmt: skip
        else:
            entries[name] = st.read(ckpt, key, (0,) * len(g_shape), g_shape, g_shape, dtype)
    return from_entries(entries, t, key)
