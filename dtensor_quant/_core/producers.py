"""How a checkpoint producer stores a format's inner tensors: plain data a format declares, read by ``_checkpoint``.

A producer (compressed-tensors, GPTQ, AWQ, bitsandbytes) stores a quantized
weight as a few tensors named after it. Which of those a format can be
written as, and how each of its inner tensors maps onto them, is the
format's own knowledge; turning that into file maps and bytes is the
checkpoint layer's. So a format declares, with :meth:`QuantFormat.producer_layout
<dtensor_quant._core.format.QuantFormat.producer_layout>`, a
:class:`ProducerLayout` built from this small vocabulary (plain data: no
I/O, nothing of the layers above), and ``_checkpoint/hf`` turns each
:class:`StoredAs` into its map (``_checkpoint/hf/stored.py``, one class per
``kind``) without naming any format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: The kinds of :class:`StoredAs`, each a map class of ``_checkpoint/hf/stored.py`` of that name:
#: ``same`` (the values as they are, maybe in a narrower dtype), ``flat`` (row-major bytes of a flat
#: tensor), ``words`` (bytes of the last dim as wider words), ``fill`` (not stored: a constant),
#: ``packed_codes`` (4-bit codes packed eight per int32 word, along either dim).
KINDS = ("same", "flat", "words", "fill", "packed_codes")


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
    """

    producer: str
    scheme: str
    args: dict = field(default_factory=dict)
    inner: tuple[tuple[str, StoredAs], ...] = ()
    records: tuple[str, ...] = ()


COMPRESSED_TENSORS = "compressed-tensors"

#: compressed-tensors' ``weights`` arguments every scheme starts from.
CT_BASE_ARGS = {"dynamic": False, "symmetric": True, "group_size": None}


def scales_in_model_dtype(scale_dtype: torch.dtype, dtype: torch.dtype) -> str | None:
    """Why scales in ``scale_dtype`` cannot be written for compressed-tensors in a ``dtype`` model, or None."""
    if scale_dtype == dtype:
        return None
    return (f"its scales are {scale_dtype} in a {dtype} model, and compressed-tensors loads scales in the model's "
            "dtype (they would be rounded); build the model in the scales' dtype")  # fmt: skip
