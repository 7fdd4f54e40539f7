"""dtensor_quant: quantized tensors that DTensor, FSDP2 and DCP can shard, gather and save.

A format declares once how each of its inner tensors follows the weight's
logical dims; every op DTensor, FSDP2 and DCP need is derived from that.

The supported API is what this module and the public packages export:
:mod:`dtensor_quant.fsdp`, :mod:`~dtensor_quant.checkpoint`,
:mod:`~dtensor_quant.hf`, :mod:`~dtensor_quant.optim`,
:mod:`~dtensor_quant.lora`, :mod:`~dtensor_quant.planner`,
:mod:`~dtensor_quant.training`, :mod:`~dtensor_quant.testing`,
:mod:`~dtensor_quant.config`, :mod:`~dtensor_quant.wire` and
:mod:`~dtensor_quant.interop`. Modules whose names start with ``_`` are the
implementation. Importing the package registers the op handlers with the
library's own tensor class and replaces nothing in torch.
"""

from . import _ops, _parallel, checkpoint, config, fsdp, hf, interop, lora, ops, optim, planner, training, wire  # noqa: F401  (the op handlers and collectives register themselves)
from ._core.dispatch import UnsupportedOpError
from ._core.format import QuantFormat, Reducer, check_shape, check_weight, weight_layout
from ._core.layout import (
    Blocked,
    Constant,
    FlatBlocked,
    InFlat,
    LayoutError,
    OneToOne,
    Opaque,
    Packed,
    Stacked,
    flat_blocked,
)
from ._core.reductions import block_reduce, expand_to, reduce_to
from ._core.tensor import QuantizedTensor
from ._formats import (
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
from ._fsdp.gather_quantized import GatherQuantized, gather_quantized_
from ._model.expand_scales import expand_scales
from ._model.format_spec import parse_format
from ._model.padding import pad_for_tp
from ._model.quantize_model import is_matmul_weight, quantize_, quantized_fqns, weight_bytes
from ._model.tp_plan import adapt_tp_plan
from ._model.vocab_padding import pad_vocab_for_tp
from ._parallel.collectives import check_consistent
from ._parallel.custom_ops import dequantize
from ._parallel.fast_redistribute import disable as disable_fast_redistribute
from ._parallel.fast_redistribute import enable as enable_fast_redistribute
from ._parallel.liveness import lost_ranks
from ._parallel.placements import check_placements, legal_mesh_sizes
from ._parallel.quantize import quantize

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
    "Opaque",
    "Packed",
    "QuantFormat",
    "QuantizedTensor",
    "Reducer",
    "Stacked",
    "UnsupportedOpError",
    "adapt_tp_plan",
    "block_reduce",
    "check_consistent",
    "check_placements",
    "check_shape",
    "check_weight",
    "checkpoint",
    "config",
    "dequantize",
    "disable_fast_redistribute",
    "enable_fast_redistribute",
    "expand_scales",
    "expand_to",
    "flat_blocked",
    "fsdp",
    "gather_quantized_",
    "hf",
    "interop",
    "is_matmul_weight",
    "legal_mesh_sizes",
    "lora",
    "lost_ranks",
    "ops",
    "optim",
    "pad_for_tp",
    "pad_vocab_for_tp",
    "parse_format",
    "planner",
    "quantize",
    "quantize_",
    "quantized_fqns",
    "reduce_to",
    "training",
    "weight_bytes",
    "weight_layout",
    "wire",
]

# What torch.save writes for a quantized tensor names these public paths (dtensor_quant.Int8Rowwise), not
# the private modules that define them, so that moving a private module breaks no saved file: the name
# torch itself gives DTensor (torch.distributed.tensor). _formats/pickle_names.py keeps earlier files' paths.
for _pickled in (
    QuantizedTensor,
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
    Blocked,
    Constant,
    FlatBlocked,
    InFlat,
    OneToOne,
    Opaque,
    Packed,
    Stacked,
):
    _pickled.__module__ = __name__
del _pickled
