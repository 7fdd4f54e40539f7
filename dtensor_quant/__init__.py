"""dtensor_quant: quantized tensors that DTensor, FSDP2 and DCP can shard, gather and save.

A format declares once how each of its inner tensors follows the weight's
logical dims; every op DTensor, FSDP2 and DCP need is derived from that.
"""

from . import aten as _aten  # noqa: F401  (registers the layout handlers: slicing, views, factories, copies)
from . import collectives as _collectives  # noqa: F401  (registers the collective handlers)
from . import custom_ops, fsdp, hf, interop, lora, model, state_dict, trainable, wire
from . import fastpath as _fastpath  # noqa: F401  (installs the fast path into dispatch.dispatch)
from . import matmul as _matmul  # noqa: F401  (registers mm/addmm)
from . import torch_fixes as _torch_fixes  # noqa: F401  (compiled DTensors keyed by their quantized local)
from .custom_ops import dequantize
from .dispatch import UnsupportedOpError
from .format import QuantFormat
from .formats import NF4, Float8Blockwise, Float8Rowwise, Float8Tensorwise, Int4Groupwise, Int8Rowwise
from .gather_quantized import GatherQuantized, gather_quantized_
from .layout import Blocked, Constant, FlatBlocked, InFlat, LayoutError, OneToOne, Packed, flat_blocked
from .model import quantize_
from .padding import pad_for_tp
from .placements import check_placements, legal_mesh_sizes
from .quantize import quantize
from .tensor import QuantizedTensor
from .tp_plan import adapt_tp_plan

__all__ = [
    "NF4",
    "Blocked",
    "Constant",
    "FlatBlocked",
    "Float8Blockwise",
    "Float8Rowwise",
    "Float8Tensorwise",
    "GatherQuantized",
    "InFlat",
    "Int4Groupwise",
    "Int8Rowwise",
    "LayoutError",
    "OneToOne",
    "Packed",
    "QuantFormat",
    "QuantizedTensor",
    "UnsupportedOpError",
    "adapt_tp_plan",
    "check_placements",
    "checkpoint",
    "custom_ops",
    "dequantize",
    "flat_blocked",
    "fsdp",
    "gather_quantized_",
    "hf",
    "interop",
    "legal_mesh_sizes",
    "lora",
    "model",
    "pad_for_tp",
    "quantize",
    "quantize_",
    "state_dict",
    "trainable",
    "wire",
]


def __getattr__(name: str):
    # dtensor_quant.checkpoint imports torch.distributed.checkpoint (about a second): only on first use.
    # dtensor_quant.nn is the old name of dtensor_quant.model, kept for old code.
    if name in ("checkpoint", "nn"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dtensor_quant' has no attribute {name!r}")
