"""Producers of pre-quantized Hugging Face checkpoints: which one wrote a checkpoint, and its reader.

A producer (compressed-tensors, GPTQ, AWQ, bitsandbytes, DeepSeek's FP8,
gpt-oss's MXFP4, this library's own form) stores each quantized weight as a
few tensors named after the weight, and says so in ``config.json``'s
``quantization_config`` (``quant_method``). One module per producer reads
its description of a weight (:mod:`.compressed_tensors`, :mod:`.gptq_awq`,
:mod:`.bitsandbytes`, :mod:`.fp8_blocks`, :mod:`.gpt_oss`, :mod:`.native`)
and answers with a :class:`~.layout.StoredLayout`: the format whose
declarations say it holds that (:func:`~.layout.held`) and the map of each
of its inner tensors to the producer's tensors (:mod:`.stored`). Writing a
producer's form is :mod:`.export_ct`'s (compressed-tensors).

:func:`detect` picks the reader by ``quant_method``. Every rank reaches the
same verdict from the files alone, with no collective.
"""

from __future__ import annotations

from pathlib import Path

from ...._core.format import QuantFormat
from ...._core.producers import AWQ, BITSANDBYTES, COMPRESSED_TENSORS, FP8_BLOCKS, GPT_OSS_MXFP4, GPTQ
from ..io import fields
from ..io.fields import STRING, Fields
from ..io.safetensors_io import Checkpoint
from .bitsandbytes import read_bitsandbytes
from .compressed_tensors import read_compressed_tensors
from .fp8_blocks import read_fp8_blocks
from .gpt_oss import read_gpt_oss_experts
from .gptq_awq import read_awq, read_gptq
from .layout import StoredLayout
from .native import NATIVE, read_native
from .stored import Same


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
    """``qc`` (a ``quantization_config``) as :class:`~..io.fields.Fields`: the loader's own, or a caller's dict."""
    return None if qc is None else Fields.of(qc, getattr(qc, "file", "quantization_config"))


def _method(qc: Fields | None) -> str | None:
    return None if qc is None else qc.field("quant_method", STRING, "").lower() or None


PRODUCERS = {
    COMPRESSED_TENSORS: read_compressed_tensors,
    FP8_BLOCKS: read_fp8_blocks,
    GPTQ: read_gptq,
    AWQ: read_awq,
    BITSANDBYTES: read_bitsandbytes,
    GPT_OSS_MXFP4: read_gpt_oss_experts,
    NATIVE: read_native,
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
        return read_fp8_blocks(qc, ckpt, key, tuple(shape), dtype)
    return None


def by_suffixes(fmt: QuantFormat, ckpt: Checkpoint, key: str, shape) -> StoredLayout | None:
    """A format's own Hugging Face form (``checkpoint_suffixes``), when the checkpoint has every key of it."""
    suffixes = fmt.checkpoint_suffixes
    if not suffixes or any(key + s not in ckpt.tensors for s in suffixes.values()):
        return None
    inner = tuple((n, Same("{key}" + suffixes[n], ckpt.tensors[key + suffixes[n]].dtype)) for n in fmt.inner_names)
    return StoredLayout(fmt, f"{fmt}'s own layout", inner)
