"""Pre-quantized checkpoints: which format holds each producer's stored layout, and how to read a rank's chunk.

A producer (compressed-tensors, GPTQ, AWQ, bitsandbytes, gpt-oss's MXFP4,
DeepSeek's FP8) stores each quantized weight as a few tensors named after
the weight. :func:`detect` reads the checkpoint's ``quantization_config``
(``config.json``) and the headers of a weight's tensors and answers with a
:class:`StoredLayout`: the library format whose inner tensors hold exactly
those values, and for each inner tensor the :class:`~.stored.Stored` map
between a chunk of it and the bytes of the file. Loading then reads each
rank's chunk of every inner tensor through that map (no dequantization, no
requantization) and :func:`~dtensor_quant._checkpoint.state_dict.from_entries` places it.

Every rank reaches the same verdict from the files alone, with no collective.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ..._core.format import QuantFormat, format_holding, held_schemes, weight_layout
from ..._core.producers import AWQ, BITSANDBYTES, COMPRESSED_TENSORS, FP8_BLOCKS, GPT_OSS_MXFP4, GPTQ
from ..._core.tensor import contiguous_strides
from ..state_dict import (
    CheckpointFormatError,
    canonical_view,
    entry_placements,
    entry_shape,
    format_of_record,
    from_entries,
)
from . import fields
from .fields import BOOL, INT, NUMBER, POSITIVE, REQUIRED, STRING, Fields, either, exactly, list_of
from .safetensors_io import Checkpoint
from .stored import Extra, Fill, Same, Stored, from_spec, json_doc, small
from .tensors import box, describe


@dataclass(frozen=True)
class StoredLayout:
    """A format and, for each of its inner tensors, how the producer stores it."""

    fmt: QuantFormat
    method: str  # the producer and scheme, for messages and LoadResult: "compressed-tensors pack-quantized ..."
    inner: tuple[tuple[str, Stored], ...]
    extras: tuple[Extra, ...] = ()
    #: The model holds the weight ``[..., in, out]`` (``x @ W``): quantized as its transpose, ``[..., out, in]``.
    transposed: bool = False

    def stored(self, name: str) -> Stored:
        return dict(self.inner)[name]

    def keys(self, key: str) -> list[str]:
        """Every checkpoint key this weight's layout reads."""
        return [s.key(key) for _, s in self.inner if not isinstance(s, Fill)] + [e.key(key) for e in self.extras]

    def __str__(self) -> str:
        return f"{self.fmt} ({self.method})"


# -- the checkpoint's quantization_config ------------------------------------------------------


def quantization_config(path) -> Fields | None:
    """``config.json``'s ``quantization_config`` in checkpoint directory ``path`` (a dict), or None.

    A ``config.json`` that is not a JSON object, or whose
    ``quantization_config`` is not one, is refused naming the file.
    """
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return fields.load(config).sub("quantization_config")


def _fields(qc) -> Fields | None:
    """``qc`` (a ``quantization_config``) as :class:`~.fields.Fields`: the loader's own, or a caller's dict."""
    return None if qc is None else Fields.of(qc, getattr(qc, "file", "quantization_config"))


def _method(qc: Fields | None) -> str | None:
    return None if qc is None else qc.field("quant_method", STRING, "").lower() or None


# -- producers ------------------------------------------------------------------------------------


def weight_shape_record() -> Extra:
    """compressed-tensors' ``{key}_shape``: int64 ``[out, in]`` of a packed weight."""

    def check(t, shape):
        if t.ndim != 1 or t.tolist() != list(shape[-2:]):
            return f"weight_shape is {t.tolist()}, the model's weight is {list(shape)}"
        return None

    return Extra("{key}_shape", check, lambda shape: torch.tensor(list(shape[-2:]), dtype=torch.int64))


#: The records a format's producer layout names (``ProducerLayout.records``), by name.
_RECORDS = {"weight_shape": weight_shape_record}


def _constant(template: str, want: torch.Tensor) -> Extra:
    """A tensor the producer keeps beside the weight holding a constant the format computes with: checked equal."""

    def check(t, shape):
        return None if torch.equal(t, want) else "not the values the model's format computes with"

    return Extra(template, check, lambda shape: want)


def declared_layout(fmt: QuantFormat, producer: str, dtype: torch.dtype, method: str = "") -> StoredLayout | str | None:
    """The :class:`StoredLayout` ``fmt`` declares for ``producer`` in a ``dtype`` model (``producer_layout``).

    None: the format declares no layout for it; a string: why this weight
    cannot be stored so. The same maps serve the writer and the reader.
    """
    declared = fmt.producer_layout(producer, dtype)
    if declared is None or isinstance(declared, str):
        return declared
    inner = tuple((name, from_spec(spec)) for name, spec in declared.inner)
    extras = (*(_RECORDS[r]() for r in declared.records), *(_constant(t, v) for t, v in declared.constants))
    return StoredLayout(fmt, method, inner, extras)


def held(producer: str, scheme: str, args: dict, what: str, extras: tuple[Extra, ...] = ()) -> StoredLayout:
    """The format that declares it holds ``producer``'s ``scheme`` with ``args``, and its declared layout + ``extras``.

    Found by the formats' declarations alone (``producer_holds``); raises ``ValueError`` saying ``what`` the
    checkpoint holds and which schemes of the producer the formats hold, when none holds this one.
    """
    fmt = format_holding(producer, scheme, args)
    if fmt is None:
        schemes = "; ".join(held_schemes(producer)) or "none"
        raise ValueError(f"{what} has no format here that holds it as stored (the formats hold {producer}: {schemes})")
    # read with the scales' dtype as stored, so a declared "scales in the model's dtype" rule always fits
    layout = declared_layout(fmt, producer, getattr(fmt, "scale_dtype", None) or torch.float32, what)
    assert isinstance(layout, StoredLayout), (fmt, producer, layout)  # a format declares a layout for what it holds
    return dataclasses.replace(layout, extras=(*layout.extras, *extras))


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


def _compressed_tensors(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
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
    what = f"{key}: compressed-tensors {fmt_name} ({kind}{bits}, {strategy}{f' {group}' if group else ''}"
    what += f"{'' if sym else ', asymmetric'})"
    if (packed if "pack" in fmt_name else key) not in tensors:
        raise ValueError(f"{what}: the checkpoint lacks {packed if 'pack' in fmt_name else key}")
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
            what = f"{key}: compressed-tensors {fmt_name} ({kind}{bits}, {block[0]}x{block[1]} blocks)"
        else:
            described["block_structure"] = block  # no format holds non-square blocks
    # the input activations of 8-bit channel and tensor schemes (the others' are not read: their weights are)
    acts, extras, said = (
        _ct_activations(scheme, ckpt, key, kind) if bits == 8 and strategy in ("channel", "tensor") else ({}, (), "")
    )
    return held(COMPRESSED_TENSORS, fmt_name, described | acts, what + said, extras)


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


def _input_scale(value: float, dtype: torch.dtype) -> Extra:
    """``{base}.input_scale``: the static scale the format holds as ``input_scale`` (one value, checked on load)."""

    def check(t, shape):
        if t.numel() != 1 or float(t.reshape(-1)[0]) != value:
            return f"holds {t.reshape(-1).tolist()}, the model's format has input_scale={value!r}"
        return None

    return Extra("{base}.input_scale", check, lambda shape: torch.tensor([value], dtype=dtype))


def _g_idx(group: int, desc_act) -> Extra:
    def check(t, shape):
        if t.tolist() == [i // group for i in range(shape[-1])]:
            return None
        return (f"g_idx is not i // {group}: the checkpoint was quantized with act-order (desc_act={desc_act}), "
                "whose groups are no blocks of the inputs; quantize it with desc_act=False, or convert it to "
                "another layout first")  # fmt: skip

    return Extra("{base}.g_idx", check, lambda shape: torch.arange(shape[-1], dtype=torch.int32) // group)


def _gptq_awq(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """GPTQ v1 (auto-gptq, GPTQModel's ``gptq`` format) and AWQ GEMM (AutoAWQ): ``qweight``, ``qzeros``, ``scales``.

    Described by the bits, the group size (-1: one group per row), the
    version (GPTQ's ``checkpoint_format``, AWQ's ``version``) and AWQ's
    ``zero_point``; a GPTQ ``g_idx`` is checked to be plain groups (no
    act-order).
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    base = key[: -len(".weight")]
    if base + ".qweight" not in ckpt.tensors:
        return None
    gptq = _method(qc) == GPTQ
    bits = qc.field("bits", INT, tensor=key) if "bits" in qc else qc.field("w_bit", INT, tensor=key)
    groups = either(POSITIVE, exactly(-1))
    group = (
        qc.field("group_size", groups, tensor=key)
        if "group_size" in qc
        else qc.field("q_group_size", groups, tensor=key)
    )
    group = shape[1] if group in (None, -1) else group
    name = "GPTQ" if gptq else "AWQ"
    if gptq:
        version = qc.field("checkpoint_format", STRING, "gptq", tensor=key)
    else:
        version = qc.field("version", STRING, "gemm", tensor=key).lower()
    desc_act = qc.field("desc_act", BOOL, False, tensor=key)
    what = f"{key}: {name} ({version}, int{bits}, group {group}{', desc_act' if desc_act else ''})"
    described = {"num_bits": bits, "group_size": group, "scale_dtype": ckpt.tensors[base + ".scales"].dtype}
    if not gptq:
        described["zero_point"] = qc.field("zero_point", BOOL, True, tensor=key)
    extras = (_g_idx(group, desc_act),) if gptq and base + ".g_idx" in ckpt.tensors else ()
    return held(GPTQ if gptq else AWQ, version, described, what, extras)


def _fp8_blocks(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """DeepSeek-V3 / Qwen3-FP8: ``weight`` e4m3 + ``weight_scale_inv`` per block (fp32 there).

    ``weight_scale_inv`` is read in the dtype the file holds it in, as the
    format's ``scale_dtype``: ``dq.hf.save`` writes bf16 block scales as
    they are, and reads them back as they are.
    """
    if key + "_scale_inv" not in ckpt.tensors or len(shape) != 2:
        return None
    b = (qc.field("weight_block_size", list_of(POSITIVE, 2), tensor=key) if qc is not None else None) or [128, 128]
    s_dtype = ckpt.tensors[key + "_scale_inv"].dtype
    what = f"{key}: fp8 ({b[0]}x{b[1]} block scales, {str(s_dtype).removeprefix('torch.')})"
    described = {"block_size": b[0], "scale_dtype": s_dtype} if b[0] == b[1] else {"block_structure": b}
    return held(FP8_BLOCKS, "block", described, what)


def _bitsandbytes(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """bitsandbytes as transformers saves it (unsloth's ``*-bnb-4bit`` models): NF4, double-quantized or not.

    Described by the quant type (``.quant_state.bitsandbytes__<type>``;
    LLM.int8's ``.SCB``: ``int8``), the block sizes of the quant state and
    whether ``.nested_absmax`` is stored (double quantization); the state's
    ``quant_type``, ``shape`` and ``nested_dtype`` are checked on load.
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    if key + ".SCB" in ckpt.tensors:
        return held(BITSANDBYTES, "int8", {}, f"{key}: bitsandbytes int8 (LLM.int8, load_in_8bit)")
    if key + ".absmax" not in ckpt.tensors:
        return None
    states = sorted(k for k in ckpt.tensors if k.startswith(key + ".quant_state."))
    if len(states) != 1:
        raise ValueError(f"{key}: bitsandbytes with {len(states)} quant_state tensors ({states}); one is expected")
    quant_type = states[0].rpartition("__")[2]
    state = json_doc(ckpt, states[0])
    blocksize = state.field("blocksize", POSITIVE, REQUIRED)
    nested_blocksize = state.field("nested_blocksize", POSITIVE)
    nested = key + ".nested_absmax" in ckpt.tensors
    if nested != (nested_blocksize is not None):
        has = "a .nested_absmax tensor but no" if nested else "no .nested_absmax tensor but a"
        raise ValueError(
            f"{key}: bitsandbytes {quant_type} with {has} nested_blocksize in its quant_state: neither "
            "double-quantized nor plain; the checkpoint is inconsistent"
        )
    if nested:
        state.field("nested_offset", NUMBER, REQUIRED)  # read by the loader: checked before anything is
    described = {"double_quant": nested, "block_size": blocksize}
    if nested:
        described["nested_block_size"] = nested_blocksize

    def state_fits(t, shape):
        js = json_doc(ckpt, states[0])
        want = {"quant_type": quant_type, "shape": list(shape)} | ({"nested_dtype": "float32"} if nested else {})
        bad = {k: js.get(k) for k, v in want.items() if js.get(k) != v}
        return f"{bad} (expected {want})" if bad else None

    scheme = "double quantization" if nested else "no double quantization"
    what = f"{key}: bitsandbytes {quant_type} ({scheme}, blocks {blocksize})"
    return held(BITSANDBYTES, quant_type, described, what, (Extra(states[0].replace(key, "{key}", 1), state_fits),))


def _mxfp4_experts(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``{key}_blocks`` u8 ``[E, out, in/32, 16]``, ``{key}_scales``.

    transformers' model holds the experts as ``[E, in, out]`` (``x @ W[e]``);
    the file stores each expert ``[out, in]`` with its blocks along the
    inputs: the format's codes and exponents as they are, the model's
    parameter the transposed view.
    """
    if len(shape) != 3 or key + "_blocks" not in ckpt.tensors:
        return None
    experts, n_in, n_out = shape
    blocks, scales = ckpt.tensors[key + "_blocks"], ckpt.tensors.get(key + "_scales")
    if tuple(blocks.shape) != (experts, n_out, n_in // 32, 16) or scales is None:
        raise ValueError(f"{key}: {key}_blocks is {list(blocks.shape)}, the model's experts {list(shape)} [E, in, out] "
                         f"need [{experts}, {n_out}, {n_in // 32}, 16] and {key}_scales")  # fmt: skip
    layout = held(GPT_OSS_MXFP4, "experts", {}, f"{key}: mxfp4 (gpt-oss experts)")
    return dataclasses.replace(layout, method="mxfp4 (gpt-oss experts)", transposed=True)


# -- this library's own form ----------------------------------------------------------------------

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


def _native(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
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


PRODUCERS = {
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8_blocks,
    "gptq": _gptq_awq,
    "awq": _gptq_awq,
    "bitsandbytes": _bitsandbytes,
    "mxfp4": _mxfp4_experts,
    NATIVE: _native,
}


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
    qc = _fields(qc)
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
