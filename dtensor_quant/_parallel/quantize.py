"""quantize(): dense tensor or sharded DTensor in, QuantizedTensor (or DTensor of them) out.

For a sharded DTensor each rank quantizes its own shard. A statistic whose
block spans shards (a per-row maximum under column sharding, a per-tensor
maximum under any sharding) is all-reduced over exactly the mesh dims whose
shards share it, so the result is bit-identical to quantizing the full
tensor and then distributing it. A statistic whose blocks all fall inside
one shard needs no collective at all. The per-shard work is
:mod:`dtensor_quant._parallel.shard_quant`; a DTensor goes through the
``dtensor_quant::quantize`` custom op (:mod:`dtensor_quant._parallel.custom_ops`),
whose sharding rule keeps the placements.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .._core.format import QuantFormat, Reducer, check_format
from .._core.tensor import QuantizedTensor
from . import custom_ops
from .placements import check_placements
from .shard_quant import quantize_local


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Quantize a dense weight ``[..., out, in]`` (or a DTensor of one) into ``fmt``.

    Leading dims (the experts of a fused mixture-of-experts parameter) are
    one-to-one: every ``[out, in]`` matrix is quantized with the format's
    2-D math, bit-identical to quantizing it on its own.

    Returns a :class:`QuantizedTensor` with the same logical shape and dtype,
    or, for a DTensor, a DTensor with the same mesh and placements whose local
    tensors are quantized. Raises :class:`~dtensor_quant.LayoutError` on every
    rank, before any collective, when a placement cuts a pack or a group.

    The result has no gradient (quantizing is not differentiable): a leaf
    with ``requires_grad=True`` (an ``nn.Parameter``) is quantized as a frozen
    weight, as :func:`~dtensor_quant.quantize_` freezes the weights it
    quantizes. A tensor that is part of an autograd graph (one with a
    ``grad_fn``, while gradients are enabled) is refused with a
    ``ValueError``: its graph would be cut without a word, and whatever it was
    computed from would get no gradient through the quantized copy. Pass
    ``weight.detach()`` to quantize its values; quantize a model's weights
    trainable with ``quantize_(model, fmt, trainable=True)``.
    """
    check_format(fmt)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"quantize takes a weight tensor [..., out, in] or a DTensor; got {type(weight).__name__}")
    if isinstance(weight, QuantizedTensor) or (
        isinstance(weight, DTensor) and isinstance(weight._local_tensor, QuantizedTensor)
    ):
        raise ValueError(f"the tensor is already quantized; dequantize() it before quantizing into {fmt}")
    if weight.grad_fn is not None and torch.is_grad_enabled():
        raise ValueError(
            f"quantize: the tensor is part of an autograd graph (grad_fn={type(weight.grad_fn).__name__}); "
            f"quantizing into {fmt} has no gradient, so the graph would be cut without a word. Pass "
            "weight.detach() to quantize its values (or quantize under torch.no_grad()); to train quantized "
            "weights, quantize the model's weights with dtensor_quant.quantize_(model, fmt, trainable=True)"
        )
    if isinstance(weight, DTensor):
        return _quantize_dtensor(weight, fmt)
    return quantize_local(fmt, weight, Reducer(weight.shape), weight.shape)


def _quantize_dtensor(weight: DTensor, fmt: QuantFormat) -> DTensor:
    if weight._local_tensor.is_meta:  # no data (a model built on "meta"): only the structure, no collective
        check_placements(tuple(weight.shape), fmt, tuple(weight.device_mesh.shape), list(weight.placements))
        local = quantize_local(fmt, weight._local_tensor, Reducer(weight.shape), weight.shape)
        return DTensor.from_local(
            local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
        )
    # One implementation for both entry points: the custom op, whose sharding
    # strategy keeps the placements and whose kernel reduces the statistics.
    return custom_ops.quantize(weight, fmt)
