"""This library's own form of a quantized checkpoint (``quant_method: dtensor_quant``): every inner tensor as stored.

Written by ``dq.hf.save(quantization="dtensor_quant")`` and by transformers'
``save_pretrained`` of a model loaded with ``dq.hf.QuantConfig``: each
weight's inner tensors under ``{key}.{name}``, and in ``config.json`` one
config group per format (its record: class name and fields) with the keys
of its weights. Any format, built-in or not, round-trips as its bytes.
"""

from __future__ import annotations

import json

import torch

from ...._core.format import QuantFormat
from ...state_dict import format_of_record
from ..io.safetensors_io import Checkpoint
from .layout import StoredLayout
from .stored import Same

#: ``quant_method`` of the library's own checkpoints (dq.hf.save(quantization="dtensor_quant"), and
#: transformers' save_pretrained of a model loaded with dq.hf.QuantConfig).
NATIVE = "dtensor_quant"


NATIVE_VERSION = 1


def native_suffixes(fmt: QuantFormat) -> dict[str, str]:
    """Each inner tensor under ``{key}.{name}`` (``...q_proj.weight.qdata``): any format, as stored."""
    return {name: "." + name for name in fmt.inner_names}


def native_record(fmt: QuantFormat) -> dict:
    """``{"format": class name, "params": {...}}``: what :func:`~..state_dict.format_of_record` rebuilds."""
    import dataclasses

    fields = dataclasses.fields(fmt) if dataclasses.is_dataclass(fmt) else ()
    params = {f.name: getattr(fmt, f.name) for f in fields if getattr(fmt, f.name) is not None}
    return {"format": type(fmt).__name__, "params": json.loads(json.dumps(params, default=_json_name))}


def _json_name(value) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else repr(value)


def native_groups(weights: dict[str, QuantFormat]) -> dict:
    """``config_groups``: one group per format, with the keys of the weights stored in it (``targets``)."""
    by_format: dict[QuantFormat, list[str]] = {}
    for key, fmt in weights.items():
        by_format.setdefault(fmt, []).append(key)
    groups = sorted((json.dumps(native_record(f), sort_keys=True), sorted(k)) for f, k in by_format.items())
    return {f"group_{i}": {"format": json.loads(r), "targets": keys} for i, (r, keys) in enumerate(groups)}


_NATIVE_TARGETS: dict[str, dict[str, QuantFormat]] = {}


def native_targets(qc: dict) -> dict[str, QuantFormat]:
    """Weight key -> format, from a ``dtensor_quant`` quantization_config's ``config_groups`` (cached per config)."""
    text = json.dumps(qc.get("config_groups") or {}, sort_keys=True)
    if text not in _NATIVE_TARGETS:
        out = {}
        for name, group in (qc.get("config_groups") or {}).items():
            if not isinstance(group, dict) or not isinstance(group.get("format"), dict):
                raise ValueError(f"quantization_config.config_groups.{name}: needs a 'format' record and 'targets'")
            fmt = format_of_record(group["format"])
            out.update(dict.fromkeys(group.get("targets") or [], fmt))
        _NATIVE_TARGETS.clear()  # one checkpoint at a time
        _NATIVE_TARGETS[text] = out
    return _NATIVE_TARGETS[text]


def read_native(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """The library's own form: each inner tensor of ``key``'s format (its ``config_groups`` entry) as stored."""
    fmt = native_targets(qc).get(key)
    if fmt is None:
        return None  # not listed: stored dense
    suffixes = native_suffixes(fmt)
    missing = [key + s for s in suffixes.values() if key + s not in ckpt.tensors]
    if missing:
        raise ValueError(f"{key}: the checkpoint's quantization_config lists it as {fmt}, but it lacks {missing}")
    inner = tuple((n, Same("{key}" + suffixes[n], ckpt.tensors[key + suffixes[n]].dtype)) for n in fmt.inner_names)
    return StoredLayout(fmt, f"{NATIVE} {fmt}", inner)
