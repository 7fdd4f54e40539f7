"""``quantize_like_checkpoint``: quantize a model (on meta) the way a pre-quantized checkpoint stores it.

The model is built on the meta device, as for any sharded load; this reads
only ``config.json`` and the safetensors headers, picks for every matmul
weight the format that holds the producer's stored layout
(:func:`~dtensor_quant._checkpoint.hf.producers.detect`), and quantizes it with
:func:`~dtensor_quant.quantize_` (on meta: no memory, no data). What the
producer left dense (its ignore list, ``lm_head``) stays dense. Then the
usual flow applies: shard, ``dq.hf.materialize``, ``dq.hf.load``, which reads
every such weight as stored.
"""

from __future__ import annotations

from torch import nn

from .._checkpoint.hf.io.safetensors_io import Checkpoint
from .._checkpoint.hf.producers import detect, quantization_config
from .._checkpoint.hf.producers.layout import StoredLayout
from .._checkpoint.state_dict import CheckpointFormatError
from .quantize_model import is_matmul_weight, quantize_


def quantize_like_checkpoint(model: nn.Module, path) -> dict[str, StoredLayout]:
    """Quantize each weight of ``model`` that checkpoint ``path`` stores quantized, in the format holding its layout.

    Returns ``{parameter name: StoredLayout}`` (``str()`` of one names the
    format and the producer's scheme): exactly the weights
    :func:`~dtensor_quant.hf.load` will read as stored. Raises ``ValueError``
    on every rank, before anything is quantized, for a weight stored in a
    layout no format holds (naming it and the scheme). Scales keep the
    checkpoint's dtype (the formats' ``scale_dtype``), so a model of any
    dtype reads them as stored and dequantizes as the producer does.
    """
    qc = quantization_config(path)
    chosen: dict[str, StoredLayout] = {}
    by_module: dict[str, set] = {}
    dense, errors = set(), []
    with Checkpoint(path) as ckpt:
        for fqn, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if not is_matmul_weight(module, name, p):
                    continue
                key = f"{fqn}.{name}" if fqn else name
                try:
                    layout = detect(qc, ckpt, key, tuple(p.shape), p.dtype)
                except CheckpointFormatError:
                    raise  # a damaged file: at once, naming it
                except ValueError as e:
                    errors.append(str(e))
                    continue
                if layout is None:
                    dense.add(fqn)
                    continue
                chosen[key] = layout
                by_module.setdefault(fqn, set()).add(layout.fmt)
    mixed = [fqn for fqn, fmts in by_module.items() if len(fmts) > 1 or fqn in dense]
    if mixed:
        errors.append(f"modules whose weights the checkpoint stores in different formats (or some dense): {mixed[:5]}")
    if errors:
        raise ValueError(f"quantize_like_checkpoint({path}):\n  " + "\n  ".join(errors))
    flipped = {key for key, layout in chosen.items() if layout.transposed}  # [E, in, out] experts (gpt-oss)
    for fmt in {next(iter(fmts)) for fmts in by_module.values()}:
        picked = {fqn for fqn, fmts in by_module.items() if fmt in fmts}
        quantize_(model, fmt, filter_fn=lambda m, fqn, picked=picked: fqn in picked, transposed=flipped.__contains__)
    return chosen
