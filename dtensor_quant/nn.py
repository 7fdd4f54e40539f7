"""The old name of :mod:`dtensor_quant.model` (which holds no ``nn.Module``): kept so old imports work."""

from .model import is_matmul_weight, quantize_, quantized_fqns, weight_bytes

__all__ = ["is_matmul_weight", "quantize_", "quantized_fqns", "weight_bytes"]
