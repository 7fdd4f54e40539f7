"""The private paths that files pickled before pickles named public ones hold, kept loadable.

``torch.save`` of a :class:`~dtensor_quant.QuantizedTensor` names a global
for the class of every object in it. Files written now name public paths
only (``dtensor_quant.QuantizedTensor``, ``dtensor_quant.Int8Rowwise``,
``dtensor_quant.OneToOne``: the package root gives its classes that name, as
torch gives ``DTensor`` its public ``torch.distributed.tensor``), so a later
move of a private module breaks none of them. Files written before name the
private modules that defined those classes then; this table, written down
once and never derived from where the classes live today, registers each of
those paths as a safe global for ``torch.load(weights_only=True)``, which
looks a global up by its path alone.
"""

from __future__ import annotations

import torch

from .._core import layout, tensor
from .block_states import BlockFloat8, BlockLog4
from .bnb_nf4 import BnbNF4
from .float8 import Float8Rowwise, Float8Tensorwise
from .float8_block import Float8Blockwise
from .int4 import Int4Groupwise
from .int4_zero import Int4GroupwiseIntZero
from .int8 import Int8Rowwise
from .mxfp4 import MXFP4
from .nf4 import NF4
from .nf4_block_scales import NF4BlockScales

#: path -> object, as the files of dtensor_quant's private-module layout name them (before public pickles).
LEGACY = {
    "dtensor_quant._core.tensor.rebuild": tensor.rebuild,
    "dtensor_quant._core.tensor.QuantizedTensor": tensor.QuantizedTensor,
    **{
        f"dtensor_quant._core.layout.{cls.__name__}": cls
        for cls in (
            layout.OneToOne,
            layout.Packed,
            layout.Blocked,
            layout.Constant,
            layout.Stacked,
            layout.FlatBlocked,
            layout.InFlat,
            layout.Opaque,
        )
    },
    "dtensor_quant._formats.block_states.BlockFloat8": BlockFloat8,
    "dtensor_quant._formats.block_states.BlockLog4": BlockLog4,
    "dtensor_quant._formats.bnb_nf4.BnbNF4": BnbNF4,
    "dtensor_quant._formats.float8.Float8Rowwise": Float8Rowwise,
    "dtensor_quant._formats.float8.Float8Tensorwise": Float8Tensorwise,
    "dtensor_quant._formats.float8_block.Float8Blockwise": Float8Blockwise,
    "dtensor_quant._formats.int4.Int4Groupwise": Int4Groupwise,
    "dtensor_quant._formats.int4_zero.Int4GroupwiseIntZero": Int4GroupwiseIntZero,
    "dtensor_quant._formats.int8.Int8Rowwise": Int8Rowwise,
    "dtensor_quant._formats.mxfp4.MXFP4": MXFP4,
    "dtensor_quant._formats.nf4.NF4": NF4,
    "dtensor_quant._formats.nf4_block_scales.NF4BlockScales": NF4BlockScales,
}
torch.serialization.add_safe_globals([(obj, path) for path, obj in LEGACY.items()])
