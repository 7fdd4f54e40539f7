"""dtensor_quant: quantized tensors that DTensor, FSDP2 and DCP can shard, gather and save.

A format declares once how each of its inner tensors follows the weight's
logical dims; every op DTensor, FSDP2 and DCP need is derived from that.
"""

import sys as _sys

from . import checkpoint, dist, fsdp, model, ops, optim  # noqa: F401  (ops and dist register their handlers)
from ._compat import install as _install_old_paths
from ._compat import old_attribute as __getattr__  # noqa: F401  (dq.<moved module>, deprecated)
from .checkpoint import hf, state_dict
from .core.dispatch import UnsupportedOpError
from .core.format import QuantFormat
from .core.layout import Blocked, Constant, FlatBlocked, InFlat, LayoutError, OneToOne, Packed, flat_blocked
from .core.tensor import QuantizedTensor
from .dist import custom_ops, wire
from .dist.collectives import check_consistent
from .dist.custom_ops import dequantize
from .dist.fast_redistribute import disable as disable_fast_redistribute
from .dist.fast_redistribute import enable as enable_fast_redistribute
from .dist.placements import check_placements, legal_mesh_sizes
from .dist.quantize import quantize
from .formats import (
    MXFP4,
    NF4,
    BlockFloat8,
    BlockLog4,
    BnbNF4,
    Float8Blockwise,
    Float8Rowwise,
    Float8Tensorwise,
    Int4Groupwise,
    Int4GroupwiseIntZero,
    Int8Rowwise,
    NF4BlockScales,
)
from .fsdp.gather_quantized import GatherQuantized, gather_quantized_
from .model import interop, lora, trainable
from .model.expand_scales import expand_scales
from .model.padding import pad_for_tp
from .model.quantize_like import quantize_like_checkpoint as _quantize_like_checkpoint
from .model.quantize_model import quantize_
from .model.tp_plan import adapt_tp_plan
from .model.vocab_padding import pad_vocab_for_tp

# The public modules that live in a layer folder keep their documented names: ``import
# dtensor_quant.hf``, ``from dtensor_quant.lora import add_lora_`` and ``dq.wire.record()``.
_PUBLIC_MODULES = {
    "hf": hf,
    "state_dict": state_dict,
    "custom_ops": custom_ops,
    "wire": wire,
    "interop": interop,
    "lora": lora,
    "trainable": trainable,
}
for _name, _module in _PUBLIC_MODULES.items():
    _sys.modules[f"{__name__}.{_name}"] = _module
# dq.hf's entry point that quantizes a model (the model layer, above checkpoint/) joins the others there.
hf.quantize_like_checkpoint = _quantize_like_checkpoint
_install_old_paths()

__all__ = [
    "MXFP4",
    "NF4",
    "BlockFloat8",
    "BlockLog4",
    "Blocked",
    "BnbNF4",
    "Constant",
    "FlatBlocked",
    "Float8Blockwise",
    "Float8Rowwise",
    "Float8Tensorwise",
    "GatherQuantized",
    "InFlat",
    "Int4Groupwise",
    "Int4GroupwiseIntZero",
    "Int8Rowwise",
    "LayoutError",
    "NF4BlockScales",
    "OneToOne",
    "Packed",
    "QuantFormat",
    "QuantizedTensor",
    "UnsupportedOpError",
    "adapt_tp_plan",
    "check_consistent",
    "check_placements",
    "checkpoint",
    "custom_ops",
    "dequantize",
    "disable_fast_redistribute",
    "enable_fast_redistribute",
    "expand_scales",
    "flat_blocked",
    "fsdp",
    "gather_quantized_",
    "hf",
    "interop",
    "legal_mesh_sizes",
    "lora",
    "model",
    "optim",
    "pad_for_tp",
    "pad_vocab_for_tp",
    "quantize",
    "quantize_",
    "state_dict",
    "trainable",
    "wire",
]
