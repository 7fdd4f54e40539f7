"""The weights of a pre-quantized checkpoint as the planner sees them: each in the format that holds it as stored.

``python -m dtensor_quant plan --checkpoint DIR`` plans a downloaded
checkpoint as its files are: the model is built from its ``config.json`` on
the meta device, and every matmul weight gets the format
:func:`~dtensor_quant.hf.quantize_like_checkpoint` would choose for it
(:func:`~dtensor_quant._checkpoint.hf.producers.detect`, from ``quantization_config``
and the safetensors headers; no weight is read, only a producer's small
JSON records such as bitsandbytes' ``quant_state``). What the producer left
dense (``lm_head``, an ignore list) is planned dense. Such a layer is
``stored``: its block size is the files', so the planner proposes degrees,
``adapt_tp_plan`` and padding (only where the quantized bytes pad exactly),
never another block size.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..._checkpoint.hf.io.safetensors_io import Checkpoint
from ..._checkpoint.hf.producers import detect, quantization_config
from .cells import Layer


def stored_layers(model: nn.Module, path, layers: list[Layer]) -> tuple[list[Layer], dict[str, int]]:
    """``layers`` (of ``model``, from :func:`~.layers.layers_of`) with each quantized weight in its stored format.

    Returns the layers and ``{stored layout's description: weights}``. Raises
    ``ValueError`` naming every weight stored in a layout no format holds,
    and for a directory with no ``quantization_config`` and no stored layout.
    """
    qc = quantization_config(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    out, errors, methods = [], [], {}
    with Checkpoint(path) as ckpt:
        for layer in layers:
            if layer.dense:
                out.append(layer)
                continue
            key = layer.name if layer.name in params else f"{layer.name}.weight"
            p = params[key]
            try:
                layout = detect(qc, ckpt, key, tuple(p.shape), p.dtype)
            except ValueError as e:
                errors.append(str(e))
                continue
            if layout is None:  # the producer left it dense
                out.append(dataclasses.replace(layer, dense=True))
                continue
            shape = tuple(layer.shape)
            if layout.transposed:  # held [..., in, out] by the model, quantized as [..., out, in]
                shape = shape[:-2] + shape[-2:][::-1]
            out.append(dataclasses.replace(layer, shape=shape, fmt=layout.fmt, stored=True))
            methods[layout.method] = methods.get(layout.method, 0) + 1
    if errors:
        raise ValueError(f"{path}: {errors[0]}" + (f" (and {len(errors) - 1} more weights)" if len(errors) > 1 else ""))
    if not methods:
        raise ValueError(
            f"{path}: no weight is stored quantized (quantization_config: "
            f"{(qc or {}).get('quant_method', 'none')}); plan a dense model with --config {path} --format FORMAT"
        )
    return out, methods
