"""Whole models: ``quantize_``, LoRA adapters, tensor-parallel plans and padding, the mesh planner.

The public entry points are re-exported by the package root
(``dq.quantize_``, ``dq.adapt_tp_plan``, ``dq.pad_for_tp``); the model-level
helpers stay importable from here (``dq.model.weight_bytes``).
"""

from .quantize_model import is_matmul_weight, quantize_, quantized_fqns, weight_bytes

__all__ = ["is_matmul_weight", "quantize_", "quantized_fqns", "weight_bytes"]
