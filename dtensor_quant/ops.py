"""The library's ops as ``torch.library`` custom ops (``dtensor_quant::quantize/dequantize/linear``).

Each has a fake implementation and DTensor sharding strategies, so on a DTensor it runs shard by shard and
returns a DTensor in the input's placements, and ``torch.compile`` traces it as one op
(docs/tensor_parallel.md, "The library's ops as custom ops"). ``dq.quantize`` and ``F.linear`` on a quantized
weight are what most code calls; these are for code that wants the op itself in its graph.
"""

from ._parallel.custom_ops import dequantize, linear, quantize

__all__ = ["dequantize", "linear", "quantize"]
