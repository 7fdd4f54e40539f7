"""Built-in formats. Each file holds one format's layout, math and kernel."""

from . import pickle_names  # noqa: F401  (the private paths earlier pickles name stay loadable)
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

__all__ = [
    "MXFP4",
    "NF4",
    "BlockFloat8",
    "BlockLog4",
    "BnbNF4",
    "Float8Blockwise",
    "Float8Rowwise",
    "Float8Tensorwise",
    "Int4Groupwise",
    "Int4GroupwiseIntZero",
    "Int8Rowwise",
    "NF4BlockScales",
]
