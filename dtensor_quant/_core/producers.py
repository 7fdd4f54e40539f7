"""How a checkpoint producer stores a format's inner tensors: plain data a format declares, read by ``_checkpoint``.

A producer (compressed-tensors, GPTQ, AWQ, bitsandbytes, DeepSeek's FP8,
gpt-oss's MXFP4) stores a quantized weight as a few tensors named after it.
Which of its schemes a format holds as stored, and how each of the format's
inner tensors maps onto the producer's tensors, is the format's own
knowledge; turning that into file maps and bytes is the checkpoint layer's.
So a format class declares, in this small vocabulary (plain data: no I/O,
nothing of the layers above):

* ``producer_holds``: a :class:`Holds` per producer scheme it holds (which
  of the producer's arguments it needs, which of its own fields they give),
  so a reader finds the format of a stored weight with
  :func:`~dtensor_quant._core.format.format_holding`, by the declarations
  alone;
* :meth:`QuantFormat.producer_layout
  <dtensor_quant._core.format.QuantFormat.producer_layout>`: a
  :class:`ProducerLayout` per producer, each inner tensor a
  :class:`StoredAs`, which ``_checkpoint/hf/producers`` turns into its map
  (one class per ``kind``) for the reader and the writer alike.

No module outside ``_formats/`` names a format to read or write a producer's
checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .layout import Constant, OneToOne

#: The kinds of :class:`StoredAs`, each a map class of ``_checkpoint/hf/producers/stored.py`` of that name:
#: ``same`` (the values as they are, maybe in a narrower dtype), ``reshaped`` (the same values with the last
#: dim split in two: ``inner``, the stored last dim), ``transposed`` (a 2-D tensor stored ``[x, out]``),
#: ``flat`` (row-major bytes of a flat tensor), ``words`` (bytes of the last dim as wider words), ``fill``
#: (not stored: a constant), ``packed_codes`` (4-bit codes packed eight per int32 word, along either dim,
#: in either order), ``json_field`` (a constant held as one number of a JSON document stored as uint8).
KINDS = ("same", "reshaped", "transposed", "flat", "words", "fill", "packed_codes", "json_field")


@dataclass(frozen=True)
class StoredAs:
    """One inner tensor as the producer stores it: the map's ``kind``, key template, file dtype and options.

    ``template`` fills ``{key}`` (the parameter's key) and ``{base}`` (it
    without ``.weight``). ``options`` are the map's further fields by name
    (``(("along", 0), ("unpacked", True))``, a fill's ``value``). ``refusal``:
    for a ``fill``, what the weight holds when its inner tensor is not the
    constant (the message says why it cannot be written).
    """

    kind: str
    template: str
    dtype: torch.dtype
    options: tuple[tuple[str, object], ...] = ()
    refusal: str = ""

    def __post_init__(self):
        assert self.kind in KINDS, self.kind


@dataclass(frozen=True)
class ProducerLayout:
    """A format as one producer stores it: the producer's scheme, its arguments and each inner tensor's storage.

    ``scheme``: the producer's name for it (compressed-tensors' ``format``:
    ``"pack-quantized"``). ``args``: the producer's description of the
    weights (compressed-tensors' ``weights``: ``num_bits``, ``strategy``...).
    ``records``: further tensors the producer keeps beside the weight, by
    name (``"weight_shape"``: compressed-tensors' ``{key}_shape``).
    ``constants``: tensors the producer keeps beside the weight that hold a
    constant the format computes with, by key template (bitsandbytes'
    ``{key}.quant_map``: the NF4 levels); a reader checks them equal.
    """

    producer: str
    scheme: str
    args: dict = field(default_factory=dict)
    inner: tuple[tuple[str, StoredAs], ...] = ()
    records: tuple[str, ...] = ()
    constants: tuple[tuple[str, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class Holds:
    """A producer's scheme that a format class holds as stored, and how its fields follow from the description.

    A reader describes a stored weight as ``(producer, scheme, args)``: the
    producer's name, its name of the scheme, and its arguments as plain
    values (compressed-tensors' ``num_bits``, ``type``, ``strategy``...;
    ``scale_dtype``: the stored scales' dtype). A class holds it when
    ``scheme`` is one of ``schemes``, every entry of ``args`` here has that
    value there, and every other argument there is one of ``params``: the
    format's fields, each given the argument of its name (an argument the
    class has no field for, an activation scheme say, is never dropped).
    ``fixed``: further fields, as they are (``levels="bitsandbytes"``).
    """

    producer: str
    schemes: tuple[str, ...]
    args: tuple[tuple[str, object], ...] = ()
    params: tuple[str, ...] = ()
    fixed: tuple[tuple[str, object], ...] = ()

    def matches(self, producer: str, scheme: str, args: Mapping) -> bool:
        if producer != self.producer or scheme not in self.schemes:
            return False
        want = dict(self.args)
        return all(k in args and args[k] == v for k, v in want.items()) and set(args) <= set(want) | set(self.params)

    def fields(self, args: Mapping) -> dict:
        """The format's fields for a description this entry matches."""
        return {p: args[p] for p in self.params if p in args} | dict(self.fixed)

    def __str__(self) -> str:
        said = [f"{k}={v}" for k, v in self.args] + list(self.params)
        return f"{'/'.join(self.schemes)} ({', '.join(said)})"


COMPRESSED_TENSORS = "compressed-tensors"
#: GPTQ v1 (auto-gptq, GPTQModel's ``gptq`` checkpoint format): ``qweight``, ``qzeros``, ``scales``.
GPTQ = "gptq"
#: AWQ GEMM (AutoAWQ): ``qweight``, ``qzeros``, ``scales`` packed along the outputs.
AWQ = "awq"
#: bitsandbytes as transformers saves it: ``weight``, ``.absmax``, ``.quant_map``, ``.quant_state.*``.
BITSANDBYTES = "bitsandbytes"
#: DeepSeek-V3's FP8 (``quant_method: fp8``): ``weight`` e4m3 and ``weight_scale_inv`` per square block.
FP8_BLOCKS = "fp8"
#: gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``{key}_blocks`` and ``{key}_scales``.
GPT_OSS_MXFP4 = "mxfp4"

#: compressed-tensors' ``weights`` arguments every scheme starts from.
CT_BASE_ARGS = {"dynamic": False, "symmetric": True, "group_size": None}

#: The compressed-tensors strategy and the map of ``{key}_scale`` for a format of one code per weight whose
#: ``scale`` relates to the weight as ``layout["scale"]`` says: one per row (``[out, 1]`` stored as it is) or
#: one per tensor (``[1, 1]`` stored as ``[1]``).
_SCALE_STRATEGIES = {(OneToOne(), Constant()): ("channel", "same"), (Constant(), Constant()): ("tensor", "flat")}
#: compressed-tensors' ``type`` -> its scheme names for 8-bit codes with channel or tensor scales.
_CT_8BIT_SCHEMES = {"int": ("int-quantized", "naive-quantized"), "float": ("float-quantized", "naive-quantized")}


def _scale_strategy(layout: Mapping) -> tuple[str, str]:
    strategy = _SCALE_STRATEGIES.get(tuple(layout["scale"]))
    assert strategy is not None, f"scale relations {layout['scale']} are neither per row nor per tensor"
    return strategy


def ct_8bit_holds(layout: Mapping, kind: str) -> tuple[Holds, ...]:
    """``producer_holds`` of an 8-bit format with one code per weight and row or tensor scales (``layout``):
    compressed-tensors' symmetric ``kind`` (``"int"``, ``"float"``) 8-bit scheme of the strategy ``layout["scale"]``
    gives, its scales' dtype and activation scheme the format's fields."""
    args = (("num_bits", 8), ("type", kind), ("strategy", _scale_strategy(layout)[0]), ("symmetric", True))
    return (Holds(COMPRESSED_TENSORS, _CT_8BIT_SCHEMES[kind], args, ("scale_dtype", "activations", "input_scale")),)


def ct_8bit_layout(
    fmt, producer: str, dtype: torch.dtype, codes: torch.dtype, kind: str
) -> ProducerLayout | str | None:
    """``producer_layout`` of such a format: compressed-tensors stores its ``codes`` as ``{key}`` and its scales as
    ``{key}_scale`` in the model's dtype, per row or per tensor as ``fmt.layout["scale"]`` says."""
    if producer != COMPRESSED_TENSORS:
        return None
    strategy, scale_map = _scale_strategy(fmt.layout)
    sd = fmt.scale_dtype or dtype
    args = dict(CT_BASE_ARGS, num_bits=8, type=kind, strategy=strategy)
    inner = (("qdata", StoredAs("same", "{key}", codes)), ("scale", StoredAs(scale_map, "{key}_scale", sd)))
    return scales_in_model_dtype(sd, dtype) or ProducerLayout(producer, _CT_8BIT_SCHEMES[kind][0], args, inner)


def scales_in_model_dtype(scale_dtype: torch.dtype, dtype: torch.dtype) -> str | None:
    """Why scales in ``scale_dtype`` cannot be written for compressed-tensors in a ``dtype`` model, or None."""
    if scale_dtype == dtype:
        return None
    return (f"its scales are {scale_dtype} in a {dtype} model, and compressed-tensors loads scales in the model's "
            "dtype (they would be rounded); build the model in the scales' dtype")  # fmt: skip
