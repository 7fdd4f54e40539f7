"""Writing quantized weights in a producer's layout: compressed-tensors, which vLLM and transformers read.

``dq.hf.save(model, dir, quantization="compressed-tensors")`` writes each
quantized weight whose format compressed-tensors can express as that
format's stored bytes, rearranged into compressed-tensors' tensors by the
same :class:`~.stored.Stored` maps the loader reads them with (so a save
then a load is the identity on the bytes), and ``config.json``'s
``quantization_config`` with one config group per scheme, targeting the
modules by name, and the dense Linears in ``ignore``.

Each format declares its compressed-tensors form (``QuantFormat.producer_layout``,
plain data of ``_core/producers.py``); this module turns it into the file maps of
:mod:`.stored` and names no format. What the built-in formats declare:

=====================================  ==========================================================
format                                 compressed-tensors scheme (``format``)
=====================================  ==========================================================
``Int8Rowwise``                        int8, channel, symmetric (``int-quantized``)
``Float8Rowwise``                      fp8 e4m3, channel (``float-quantized``)
``Float8Tensorwise``                   fp8 e4m3, tensor (``float-quantized``)
``Float8Blockwise(b)``                 fp8 e4m3, ``b x b`` blocks (``float-quantized``)
``Int4Groupwise(g)`` with zero = 0     int4, group ``g``, symmetric (``pack-quantized``)
``Int4GroupwiseIntZero(g)``            int4, group ``g``, asymmetric (``pack-quantized``)
``MXFP4``                              mxfp4 (``mxfp4-pack-quantized``)
=====================================  ==========================================================

compressed-tensors loads scales in the model's dtype, so a weight whose
scales are in another dtype is refused (it would be rounded on the way in),
as is an ``Int4Groupwise`` weight with a nonzero float zero point and every
other format (NF4, BnbNF4): the message says so, by name.

A format's activation scheme (``activations``) is written as its group's
``input_activations``: ``*-token`` as symmetric 8-bit dynamic per token,
``*-tensor`` as static per tensor with ``{module}.input_scale`` (the format's
``input_scale``, in the model's dtype, refused where it does not fit it
exactly). The ``-per-rank`` schemes have no compressed-tensors form (it
declares no tensor-parallel statistics) and are refused.
"""

from __future__ import annotations

import json

import torch
from torch.distributed.tensor import DTensor

from ...._core.format import weight_layout
from ...._core.format import writers as format_writers
from ...._core.producers import COMPRESSED_TENSORS
from ...state_dict import canonical_view, entry_placements, entry_shape
from ..tensors import first_replica, regions
from .layout import StoredLayout, declared_layout
from .stored import Extra, Fill

QUANTIZATIONS = ("compressed-tensors",)


def _scheme(fmt, dtype: torch.dtype) -> tuple[str, dict, StoredLayout, dict[str, str]] | str:
    """``(format name, weights args, layout, refusals)`` for ``fmt`` in compressed-tensors, or why it cannot be written.

    The format declares its compressed-tensors form (``producer_layout``);
    ``refusals``: per inner tensor the producer leaves out, what a weight
    holds when it is not the constant.
    """
    declared = fmt.producer_layout(COMPRESSED_TENSORS, dtype)
    if declared is None:
        *some, last = format_writers(COMPRESSED_TENSORS)
        writers = f"{', '.join(some)} and {last}"
        return f"compressed-tensors has no scheme for {fmt} (it writes {writers}); save it dense (quantization=None)"
    if isinstance(declared, str):
        return declared
    layout = declared_layout(fmt, COMPRESSED_TENSORS, dtype)
    refusals = {name: spec.refusal for name, spec in declared.inner if spec.refusal}
    return declared.scheme, dict(declared.args), layout, refusals


def _activations(fmt, dtype: torch.dtype) -> tuple[dict | None, tuple[Extra, ...]] | str:
    """``(input_activations args or None, extras)`` for ``fmt``'s activation scheme, or why it cannot be written."""
    scheme = fmt.activation_scheme
    if scheme is None:
        return None, ()
    if scheme.per_rank:
        return (f"activations={scheme.spelling!r} (per-rank statistics) has no compressed-tensors form; "
                f"'{scheme.codes}-token' does")  # fmt: skip
    kind, strategy = "int" if scheme.codes == "int8" else "float", "token" if scheme.dynamic else "tensor"
    args = {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": scheme.dynamic}  # fmt: skip
    if scheme.dynamic:
        return args, ()
    value = torch.tensor([fmt.input_scale], dtype=dtype)
    if float(value) != fmt.input_scale:
        return (f"its input_scale {fmt.input_scale!r} is not a {dtype} value, and compressed-tensors loads it in the "
                "model's dtype (it would be rounded)")  # fmt: skip
    return args, (Extra("{base}.input_scale", None, lambda shape, v=value: v),)


class CompressedTensorsExport:
    """The compressed-tensors form of a model's quantized weights; :func:`~.saving.save` asks it per weight."""

    def __init__(self):
        self.groups: dict[tuple, list[str]] = {}  # (format name, args as JSON) -> module names

    def items(self, key: str, t: torch.Tensor, leader: bool) -> list[tuple]:
        """``(key, dtype, global shape, spans, fetch)`` of every tensor holding quantized weight ``key``.

        ``spans`` are this rank's boxes to write, as :func:`~.tensors.regions`
        gives them (empty: another replica writes). Raises ``ValueError`` when
        the weight cannot be written as compressed-tensors stores it (the save
        agrees on it across ranks).
        """
        q, inner, to_canonical, shape = canonical_view(t, key)
        why = "its key does not end in .weight" if not key.endswith(".weight") or len(shape) != 2 else None
        scheme = why or _scheme(q.fmt, t.dtype)
        acts = _activations(q.fmt, t.dtype) if not isinstance(scheme, str) else None
        if isinstance(acts, str):
            scheme = acts
        if isinstance(scheme, str):
            raise ValueError(f"{key}: {q.fmt} cannot be written as compressed-tensors: {scheme}")
        fmt_name, args, layout, refusals = scheme
        input_args, act_extras = acts
        mesh = t.device_mesh if isinstance(t, DTensor) else None
        out = []
        for name, rels in weight_layout(q.fmt, shape).items():
            st, g_shape = layout.stored(name), entry_shape(rels, shape)
            placements = entry_placements(t.placements, rels, to_canonical) if mesh is not None else None
            boxes = regions(g_shape, mesh, placements)
            chunk = inner[name]
            if len(boxes) > 1:
                raise ValueError(f"{key}: this rank's '{name}' is no single box of the weight (a strided shard)")
            offset = boxes[0][1] if boxes else (0,) * len(g_shape)
            if isinstance(st, Fill):
                if not st.holds(chunk):
                    raise ValueError(f"{key}: {q.fmt} {refusals[name]}")
                continue
            align = st.write_alignment(len(g_shape))
            if not all(o % a == 0 and (n % a == 0 or o + n == g) for o, n, g, a in
                       zip(offset, chunk.shape, g_shape, align)):  # fmt: skip
                raise ValueError(f"{key}: a shard boundary of '{name}' cuts a packed int32 word (8 values)")
            s_offset, s_chunk = st.to_stored(chunk, offset, g_shape)
            writes = boxes and first_replica(mesh, placements, leader)
            spans = [((0,) * s_chunk.ndim, tuple(s_offset), tuple(s_chunk.shape))] if writes else []
            out.append((st.key(key), st.dtype, st.stored_shape(g_shape), spans, lambda c=s_chunk: c))
        for extra in (*layout.extras, *act_extras):
            value = extra.value(shape)
            spans = [((0,), (0,), tuple(value.shape))] if leader else []
            out.append((extra.key(key), value.dtype, tuple(value.shape), spans, lambda v=value: v))
        module = key[: -len(".weight")]
        group = (fmt_name, json.dumps(args, sort_keys=True), json.dumps(input_args, sort_keys=True))
        self.groups.setdefault(group, []).append(module)
        return out

    def config(self, dense_linears: list[str]) -> dict:
        """``quantization_config`` for ``config.json``: one group per scheme, by module name; dense Linears ignored."""
        from importlib.metadata import PackageNotFoundError, version

        groups = {}
        for i, ((fmt_name, args, input_args), modules) in enumerate(sorted(self.groups.items())):
            groups[f"group_{i}"] = {"targets": sorted(modules), "weights": json.loads(args), "format": fmt_name,
                                    "input_activations": json.loads(input_args),
                                    "output_activations": None}  # fmt: skip
        formats = {g["format"] for g in groups.values()}
        try:  # the version of the package that reads it, where installed (not a dependency of this library)
            ct_version = {"version": version("compressed-tensors")}
        except PackageNotFoundError:
            ct_version = {}
        return {
            "quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": sorted(dense_linears),
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "transform_config": {},
            "global_compression_ratio": None,
            **ct_version,
        }
