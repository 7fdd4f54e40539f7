"""dtensor_quant: quantized tensors that DTensor, FSDP2 and DCP can shard, gather and save.

A format declares once how each of its inner tensors follows the weight's
logical dims; every op DTensor, FSDP2 and DCP need is derived from that.
"""

from . import collectives as _collectives  # noqa: F401  (registers the collective handlers)
from . import matmul as _matmul  # noqa: F401  (registers mm/addmm)
from . import custom_ops, fsdp, interop, lora, wire
from .format import QuantFormat
from .formats import NF4, Float8Rowwise, Float8Tensorwise, Int4Groupwise, Int8Rowwise
from .gather_quantized import GatherQuantized, gather_quantized_
from .layout import Blocked, Constant, LayoutError, OneToOne, Packed
from .nn import quantize_
from .ops import UnsupportedOpError
from .placements import check_placements, legal_mesh_sizes
from .quantize import quantize
from .tensor import QuantizedTensor

__all__ = [
    "Blocked",
    "Constant",
    "Float8Rowwise",
    "Float8Tensorwise",
    "GatherQuantized",
    "Int4Groupwise",
    "Int8Rowwise",
    "LayoutError",
    "NF4",
    "OneToOne",
    "Packed",
    "QuantFormat",
    "QuantizedTensor",
    "UnsupportedOpError",
    "check_placements",
    "custom_ops",
    "fsdp",
    "gather_quantized_",
    "legal_mesh_sizes",
    "lora",
    "quantize",
    "quantize_",
    "wire",
]
