"""Reading compressed-tensors checkpoints (llm-compressor's, vLLM's): a weight's scheme, its activations.

A weight's config group (``config_groups``, matched by its module's name),
the group's ``weights`` arguments (compressed-tensors' defaults for what it
leaves out), the stored scales' dtype and, for 8-bit channel and tensor
schemes, the ``input_activations`` describe it (other schemes' activations
are served weight-only, with a warning); the format that declares it holds
that description is read (:func:`~.layout.held`). Writing is
:mod:`.export_ct`'s.
"""

from __future__ import annotations

import warnings

import torch

from ...._core.producers import COMPRESSED_TENSORS
from ..io.fields import BOOL, POSITIVE, REQUIRED, STRING, Fields, either, list_of
from ..io.safetensors_io import Checkpoint
from .layout import StoredLayout, held
from .stored import Extra, small


def _ct_target(target: str, name: str) -> bool:
    """compressed-tensors' matching of a target: ``re:`` a regex, else the exact module name or a class name."""
    import re

    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target[:1].isupper() and "." not in target:  # a module class name ("Linear"): the headers decide
        return True
    return name == target


def _ct_scheme(qc: Fields, module: str, key: str) -> Fields | None:
    config_groups = qc.sub("config_groups", Fields({}, qc.file), tensor=key)
    groups = [config_groups.sub(name, REQUIRED, tensor=key) for name in config_groups]
    if len(groups) > 1:
        targets = [g.field("targets", list_of(STRING), [], tensor=key) for g in groups]
        groups = [g for g, ts in zip(groups, targets) if any(_ct_target(t, module) for t in ts)] or groups[:1]
    return groups[0] if groups else None


def read_compressed_tensors(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """compressed-tensors (llm-compressor's, vLLM's): ``{key}_packed`` or ``{key}``, with ``{key}_scale``.

    The scheme's ``weights`` arguments (compressed-tensors' defaults for what it leaves out), the stored
    scales' dtype and the activation scheme describe the weight; the format declaring it holds that is read.
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    tensors = ckpt.tensors
    packed, scale = key + "_packed", key + "_scale"
    if scale not in tensors:
        return None  # left dense (the scheme's ignore list, lm_head)
    scheme = _ct_scheme(qc, key[: -len(".weight")], key)
    args = (scheme.sub("weights", None, tensor=key) if scheme is not None else None) or Fields({}, qc.file, key)
    fmt_name = (scheme.field("format", STRING, tensor=key) if scheme is not None else None) or qc.field(
        "format", STRING, tensor=key
    )
    # compressed-tensors' own defaults (QuantizationArgs) for what a scheme leaves out
    bits, kind = args.field("num_bits", POSITIVE, 8, tensor=key), args.field("type", STRING, "int", tensor=key)
    strategy, group = args.field("strategy", STRING, tensor=key), args.field("group_size", POSITIVE, tensor=key)
    sym = args.field("symmetric", BOOL, True, tensor=key)
    what = f"compressed-tensors {fmt_name} ({kind}{bits}, {strategy}{f' {group}' if group else ''}"
    what += f"{'' if sym else ', asymmetric'})"
    if (packed if "pack" in fmt_name else key) not in tensors:
        raise ValueError(f"{key}: {what}: the checkpoint lacks {packed if 'pack' in fmt_name else key}")
    described = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": sym,
                 "scale_dtype": tensors[scale].dtype}  # fmt: skip
    if group is not None:
        described["group_size"] = group
    if strategy == "channel" and bits == 4:  # one group per row: int4 groups as wide as the inputs
        described |= {"strategy": "group", "group_size": shape[1]}
    if strategy == "block":
        block = args.field("block_structure", list_of(POSITIVE, 2), tensor=key)
        if block and block[0] == block[1]:
            described["block_size"] = block[0]
            what = f"compressed-tensors {fmt_name} (fp8, {block[0]}x{block[1]} blocks)"
        else:
            described["block_structure"] = block  # no format holds non-square blocks
    # the input activations of 8-bit channel and tensor schemes (the others' are not read: their weights are)
    if bits == 8 and strategy in ("channel", "tensor"):
        acts, extras, said = _ct_activations(scheme, ckpt, key, kind)
    else:
        acts, extras, said = {}, (), _weight_only(scheme, key, what)
    return held(key, COMPRESSED_TENSORS, fmt_name, described | acts, what + said, extras)


def _ct_activations(scheme: Fields | None, ckpt: Checkpoint, key: str, kind: str) -> tuple[dict, tuple, str]:
    """compressed-tensors' ``input_activations`` as the format's activation fields: ``(fields, extras, words)``.

    Read: symmetric 8-bit activations of the weights' ``kind`` (``int``: ``int8``, ``float``: ``fp8``), dynamic
    per ``token`` (``int8-token``, ``fp8-token``) or static per ``tensor`` with ``{base}.input_scale``
    (``int8-tensor``/``fp8-tensor``, the scale a format parameter: read here, checked again at load). None:
    weight-only. Anything else is refused by name: serving it weight-only would compute another model than the
    producer's; so is a scheme whose format holds no activations (the lookup finds none).
    """
    acts = scheme.sub("input_activations", None, tensor=key) if scheme is not None else None
    if acts is None:
        return {}, (), ""
    a_kind, bits = acts.field("type", STRING, "int", tensor=key), acts.field("num_bits", POSITIVE, 8, tensor=key)
    strategy = acts.field("strategy", STRING, tensor=key)
    dynamic = acts.field("dynamic", either(BOOL, STRING), False, tensor=key)
    sym = acts.field("symmetric", BOOL, True, tensor=key)
    codes = "int8" if kind == "int" else "fp8"
    said = f"; input activations {a_kind}{bits} {strategy}{' dynamic' if dynamic is True else ''}"
    said += "" if sym else ", asymmetric"
    if a_kind == kind and bits == 8 and sym and strategy == "token" and dynamic is True:
        return {"activations": f"{codes}-token"}, (), said
    if a_kind == kind and bits == 8 and sym and strategy == "tensor" and dynamic is False:
        scale_key = key[: -len(".weight")] + ".input_scale"
        if scale_key not in ckpt.tensors:
            raise ValueError(f"{key}: static input activations need {scale_key}, which the checkpoint lacks")
        stored = small(ckpt, scale_key)
        if stored.numel() != 1:
            raise ValueError(f"{key}: {scale_key} holds {stored.numel()} values; a per-tensor scale is one")
        value = float(stored.reshape(-1)[0])
        return {"activations": f"{codes}-tensor", "input_scale": value}, (_input_scale(value, stored.dtype),), said
    raise ValueError(
        f"{key}: compressed-tensors input activations ({said[2:]}) are not read: this library computes symmetric "
        f"8-bit {kind} activations dynamic per token or static per tensor, with 8-bit {kind} weights"
    )


def _weight_only(scheme: Fields | None, key: str, what: str) -> str:
    """Words for ``input_activations`` beside weights no activation scheme here goes with, and a warning.

    No format computes quantized activations with these weights (groups,
    blocks, 4 bits), so such a layer runs weight-only: its activations stay in
    the model's dtype, which differs from the producer's arithmetic by the
    activations' rounding. Serving these weight-only is what servers do on
    hardware without the producer's kernels (vLLM warns too); it is said, not
    silent: a ``UserWarning`` (once per scheme) and the layout's description.
    """
    acts = scheme.sub("input_activations", None, tensor=key) if scheme is not None else None
    if acts is None:
        return ""
    a_kind, bits = acts.field("type", STRING, "int", tensor=key), acts.field("num_bits", POSITIVE, 8, tensor=key)
    strategy = acts.field("strategy", STRING, tensor=key)
    dynamic = " dynamic" if acts.field("dynamic", either(BOOL, STRING), False, tensor=key) is True else ""
    said = f"{a_kind}{bits} {strategy}{dynamic}"
    warnings.warn(
        f"{what}: the checkpoint's input activations ({said}) are not computed with these weights here; such "
        "layers run weight-only (activations in the model's dtype), so their outputs differ from the producer's "
        "by the activations' rounding",
        UserWarning,
        stacklevel=2,
    )
    return f"; input activations {said} not computed (weight-only)"


def _input_scale(value: float, dtype: torch.dtype) -> Extra:
    """``{base}.input_scale``: the static scale the format holds as ``input_scale`` (one value, checked on load)."""

    def check(t, shape):
        if t.numel() != 1 or float(t.reshape(-1)[0]) != value:
            return f"holds {t.reshape(-1).tolist()}, the model's format has input_scale={value!r}"
        return None

    return Extra("{base}.input_scale", check, lambda shape: torch.tensor([value], dtype=dtype))
