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

from ..._core.format import QuantFormat, weight_layout
from ..._core.producers import COMPRESSED_TENSORS
from ..._core.tensor import contiguous_strides
from ..._formats import (
    MXFP4,
    BnbNF4,
    Float8Blockwise,
    Float8Rowwise,
    Float8Tensorwise,
    Int4Groupwise,
    Int4GroupwiseIntZero,
    Int8Rowwise,
    NF4BlockScales,
)
from ..._formats.bnb_nf4 import NF4_LEVELS_F32, dynamic_map
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
from .stored import (
    Extra,
    Fill,
    Flat,
    JsonField,
    PackedCodes,
    Reshaped,
    Same,
    Stored,
    Transposed,
    from_spec,
    json_doc,
    small,
)
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


def declared_layout(fmt: QuantFormat, producer: str, dtype: torch.dtype, method: str = "") -> StoredLayout | str | None:
    """The :class:`StoredLayout` ``fmt`` declares for ``producer`` in a ``dtype`` model (``producer_layout``).

    None: the format declares no layout for it; a string: why this weight
    cannot be stored so. The same maps serve the writer and the reader.
    """
    declared = fmt.producer_layout(producer, dtype)
    if declared is None or isinstance(declared, str):
        return declared
    inner = tuple((name, from_spec(spec)) for name, spec in declared.inner)
    return StoredLayout(fmt, method, inner, tuple(_RECORDS[r]() for r in declared.records))


def _ct_declared(fmt: QuantFormat, what: str, extras: tuple[Extra, ...] = ()) -> StoredLayout:
    """``fmt``'s declared compressed-tensors layout, read with the scales' dtype as stored, plus ``extras``."""
    layout = declared_layout(fmt, COMPRESSED_TENSORS, getattr(fmt, "scale_dtype", None) or torch.float32, what)
    assert isinstance(layout, StoredLayout), (fmt, layout)  # built with the file's scale dtype: it fits
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
    """compressed-tensors (llm-compressor's, vLLM's): ``{key}_packed`` or ``{key}``, with ``{key}_scale``."""
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
    s_dtype = tensors[scale].dtype
    if fmt_name == "pack-quantized" and kind == "int" and bits == 4 and packed in tensors:
        g = group if strategy == "group" else shape[1] if strategy == "channel" else None
        if g is None:
            raise ValueError(f"{key}: {what} is not read (int4 strategy {strategy!r}; group and channel are)")
        # symmetric: stored q + 8, no zero point: (q - 8) * scale; asymmetric: zero points packed eight per int32
        # down the rows, stored z + 8: the nibble is the zero of the codes
        fmt = Int4Groupwise(g, scale_dtype=s_dtype) if sym else Int4GroupwiseIntZero(g, scale_dtype=s_dtype)
        return _ct_declared(fmt, what)
    if fmt_name in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8 and key in tensors:
        if strategy != "channel" or not sym:
            raise ValueError(f"{key}: {what} is not read (int8 is read per channel, symmetric)")
        acts, extras, said = _ct_activations(scheme, ckpt, key, "int8")
        return _ct_declared(Int8Rowwise(scale_dtype=s_dtype, **acts), what + said, extras)
    if fmt_name in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8 and key in tensors:
        if strategy in ("channel", "tensor"):
            acts, extras, said = _ct_activations(scheme, ckpt, key, "fp8")
            cls = Float8Rowwise if strategy == "channel" else Float8Tensorwise
            return _ct_declared(cls(scale_dtype=s_dtype, **acts), what + said, extras)
        block = args.field("block_structure", list_of(POSITIVE, 2), tensor=key)
        if strategy == "block" and block and block[0] == block[1]:
            what = f"compressed-tensors {fmt_name} (fp8, {block[0]}x{block[1]} blocks)"
            return _ct_declared(Float8Blockwise(block[0], scale_dtype=s_dtype), what)
        raise ValueError(f"{key}: {what} is not read (fp8 is read per channel, per tensor or in square blocks)")
    if fmt_name == "mxfp4-pack-quantized" and kind == "float" and bits == 4 and packed in tensors:
        return _ct_declared(MXFP4(), what)
    raise ValueError(f"{key}: {what} has no format here that holds it as stored")


def _ct_activations(scheme: Fields | None, ckpt: Checkpoint, key: str, codes: str) -> tuple[dict, tuple, str]:
    """compressed-tensors' ``input_activations`` as the format's activation fields: ``(fields, extras, words)``.

    Read: symmetric 8-bit ``int``/``float`` (``codes``) activations, dynamic per ``token`` (``int8-token``,
    ``fp8-token``) or static per ``tensor`` with ``{base}.input_scale`` (``int8-tensor``/``fp8-tensor``, the
    scale a format parameter: read here, checked again at load). None: weight-only. Anything else is refused
    by name: serving it weight-only would compute another model than the producer's.
    """
    acts = scheme.sub("input_activations", None, tensor=key) if scheme is not None else None
    if acts is None:
        return {}, (), ""
    kind, bits = acts.field("type", STRING, "int", tensor=key), acts.field("num_bits", POSITIVE, 8, tensor=key)
    strategy = acts.field("strategy", STRING, tensor=key)
    dynamic = acts.field("dynamic", either(BOOL, STRING), False, tensor=key)
    sym = acts.field("symmetric", BOOL, True, tensor=key)
    want = "int" if codes == "int8" else "float"
    said = f"; input activations {kind}{bits} {strategy}{' dynamic' if dynamic is True else ''}"
    said += "" if sym else ", asymmetric"
    if kind == want and bits == 8 and sym and strategy == "token" and dynamic is True:
        return {"activations": f"{codes}-token"}, (), said
    if kind == want and bits == 8 and sym and strategy == "tensor" and dynamic is False:
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
        f"8-bit {want} activations dynamic per token or static per tensor, with {codes} weights"
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


_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _gptq_awq(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """GPTQ v1 (auto-gptq, GPTQModel's ``gptq`` format) and AWQ GEMM (AutoAWQ): ``qweight``, ``qzeros``, ``scales``.

    Both pack eight 4-bit codes per int32 and keep ``[in, out]`` orientation:
    GPTQ's ``qweight`` ``[in/8, out]`` (along the inputs, code i at bits 4i),
    AWQ's ``[in, out/8]`` (along the outputs, AWQ's interleaved order); zero
    points ``[in/g, out/8]`` along the outputs (GPTQ stores z - 1); fp16
    ``scales`` ``[in/g, out]``. Unpacked and transposed into
    :class:`~dtensor_quant.Int4GroupwiseIntZero`'s ``[out, in]`` rows on the
    read, losslessly.
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    base = key[: -len(".weight")]
    if base + ".qweight" not in ckpt.tensors:
        return None
    gptq = _method(qc) == "gptq"
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
    what = f"{name} ({version}, int{bits}, group {group}{', desc_act' if desc_act else ''})"
    if bits != 4:
        raise ValueError(f"{key}: {what}: only 4-bit GPTQ/AWQ is read")
    if version not in ("gptq", "gemm"):
        raise ValueError(f"{key}: {what}: only GPTQ v1 ('gptq') and AWQ GEMM checkpoints are read")
    if not gptq and qc.field("zero_point", BOOL, True, tensor=key) is False:
        raise ValueError(f"{key}: {what}: AWQ without zero points is not read")
    s_dtype = ckpt.tensors[base + ".scales"].dtype
    order = (0, 1, 2, 3, 4, 5, 6, 7) if gptq else _AWQ_ORDER
    codes = PackedCodes("{base}.qweight", torch.int32, along=0 if gptq else 1, transposed=True, order=order)
    zero = PackedCodes("{base}.qzeros", torch.int32, along=1, transposed=True, order=order, add=1 if gptq else 0,
                       unpacked=True)  # fmt: skip
    inner = (("qdata", codes), ("scale", Transposed("{base}.scales", s_dtype)), ("zero", zero))
    extras = (_g_idx(group, desc_act),) if gptq and base + ".g_idx" in ckpt.tensors else ()
    return StoredLayout(Int4GroupwiseIntZero(group, scale_dtype=s_dtype), what, inner, extras)


def _fp8_blocks(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """DeepSeek-V3 / Qwen3-FP8: ``weight`` e4m3 + ``weight_scale_inv`` per block (fp32 there).

    ``weight_scale_inv`` is read in the dtype the file holds it in, as
    :class:`~dtensor_quant.Float8Blockwise`'s ``scale_dtype``: ``dq.hf.save``
    writes a ``Float8Blockwise(b, scale_dtype=torch.bfloat16)`` weight's
    bf16 scales as they are, and reads them back as they are.
    """
    if key + "_scale_inv" not in ckpt.tensors or len(shape) != 2:
        return None
    b = (qc.field("weight_block_size", list_of(POSITIVE, 2), tensor=key) if qc is not None else None) or [128, 128]
    if b[0] != b[1]:
        raise ValueError(f"{key}: FP8 blocks {b} are not square; Float8Blockwise holds square blocks")
    s_dtype = ckpt.tensors[key + "_scale_inv"].dtype
    if s_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{key}: FP8 block scales ({key}_scale_inv) are {s_dtype}; Float8Blockwise holds "
                         "float32, bfloat16 or float16 ones")  # fmt: skip
    fmt = Float8Blockwise(b[0], scale_dtype=s_dtype)
    inner = (("qdata", Same("{key}", torch.float8_e4m3fn)), ("scale_inv", Same("{key}_scale_inv", s_dtype)))
    return StoredLayout(fmt, f"fp8 ({b[0]}x{b[1]} block scales, {str(s_dtype).removeprefix('torch.')})", inner)


def _bitsandbytes(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """bitsandbytes NF4 as transformers saves it (unsloth's ``*-bnb-4bit`` models), double-quantized or not.

    ``weight`` uint8 ``[n/2, 1]`` (codes over the flat weight, first in the
    high nibble) and ``.absmax``. Double quantization
    (``bnb_4bit_use_double_quant=True``): ``.absmax`` uint8 (dynamic-map
    codes, one per 64 values), ``.nested_absmax`` float32 (one per 256
    blocks), the offset in the ``.quant_state.bitsandbytes__nf4`` JSON:
    :class:`~dtensor_quant.BnbNF4`'s inner tensors. Without it: ``.absmax``
    float32, one per 64 values: :class:`~dtensor_quant.NF4BlockScales`'.
    Row-major, as they are. ``quant_map`` (and ``nested_quant_map``) must be
    bitsandbytes' (they are checked, not stored).
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    if key + ".SCB" in ckpt.tensors:
        raise ValueError(f"{key}: bitsandbytes 8-bit (LLM.int8, load_in_8bit) is not read as stored; only NF4 is")
    if key + ".absmax" not in ckpt.tensors:
        return None
    states = sorted(k for k in ckpt.tensors if k.startswith(key + ".quant_state."))
    if states != [key + ".quant_state.bitsandbytes__nf4"]:
        kind = states[0].rpartition("__")[2] if states else "no quant_state"
        raise ValueError(f"{key}: bitsandbytes {kind}: only NF4 (bnb_4bit_quant_type='nf4') is read as stored")
    state = json_doc(ckpt, states[0])
    blocksize = state.field("blocksize", POSITIVE, REQUIRED)
    nested_blocksize = state.field("nested_blocksize", POSITIVE)
    nested = key + ".nested_absmax" in ckpt.tensors
    if nested != (nested_blocksize is not None):
        has = "a .nested_absmax tensor but no" if nested else "no .nested_absmax tensor but a"
        raise ValueError(
            f"{key}: bitsandbytes NF4 with {has} nested_blocksize in its quant_state: neither double-quantized "
            "(BnbNF4) nor plain (NF4BlockScales); the checkpoint is inconsistent"
        )
    if nested:
        state.field("nested_offset", NUMBER, REQUIRED)  # read by the loader: checked before anything is
        fmt = BnbNF4(blocksize, nested_blocksize)
        offset = JsonField("{key}.quant_state.bitsandbytes__nf4", torch.uint8, "nested_offset")
        inner = (("qdata", Flat("{key}", torch.uint8, (1,))), ("absmax", Flat("{key}.absmax", torch.uint8)),
                 ("nested_absmax", Flat("{key}.nested_absmax", torch.float32)), ("offset", offset))  # fmt: skip
    else:
        fmt = NF4BlockScales(blocksize, levels="bitsandbytes")
        inner = (("qdata", Flat("{key}", torch.uint8, (1,))), ("scale", Flat("{key}.absmax", torch.float32)))

    def same(want):
        return lambda t, shape: None if torch.equal(t, want) else f"not bitsandbytes' map; {fmt} computes with that"

    def state_fits(t, shape):
        js = json_doc(ckpt, states[0])
        want = {"quant_type": "nf4", "shape": list(shape)} | ({"nested_dtype": "float32"} if nested else {})
        bad = {k: js.get(k) for k, v in want.items() if js.get(k) != v}
        return f"{bad} (expected {want})" if bad else None

    maps = [Extra("{key}.quant_map", same(torch.tensor(NF4_LEVELS_F32, dtype=torch.float32)))]
    if nested:
        maps.append(Extra("{key}.nested_quant_map", same(dynamic_map())))
    extras = (*maps, Extra("{key}.quant_state.bitsandbytes__nf4", state_fits))
    scheme = "double quantization" if nested else "no double quantization"
    return StoredLayout(fmt, f"bitsandbytes nf4 ({scheme}, blocks {fmt.block_size})", inner, extras)


def _mxfp4_experts(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``{key}_blocks`` u8 ``[E, out, in/32, 16]``, ``{key}_scales``.

    transformers' model holds the experts as ``[E, in, out]`` (``x @ W[e]``);
    the file stores each expert ``[out, in]`` with its blocks along the
    inputs: :class:`~dtensor_quant.MXFP4`'s codes and exponents as they are,
    the model's parameter the transposed view.
    """
    if len(shape) != 3 or key + "_blocks" not in ckpt.tensors:
        return None
    experts, n_in, n_out = shape
    blocks, scales = ckpt.tensors[key + "_blocks"], ckpt.tensors.get(key + "_scales")
    if tuple(blocks.shape) != (experts, n_out, n_in // 32, 16) or scales is None:
        raise ValueError(f"{key}: {key}_blocks is {list(blocks.shape)}, the model's experts {list(shape)} [E, in, out] "
                         f"need [{experts}, {n_out}, {n_in // 32}, 16] and {key}_scales")  # fmt: skip
    inner = (("qdata", Reshaped("{key}_blocks", torch.uint8, 16)), ("scale", Same("{key}_scales", torch.uint8)))
    return StoredLayout(MXFP4(), "mxfp4 (gpt-oss experts)", inner, transposed=True)


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
