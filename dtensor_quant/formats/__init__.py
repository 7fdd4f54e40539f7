"""Built-in formats. Each file holds one format's layout, math and kernel."""

from .block_states import BlockFloat8, BlockLog4
from .float8 import Float8Rowwise, Float8Tensorwise
from .float8_block import Float8Blockwise
from .int4 import Int4Groupwise
from .int8 import Int8Rowwise
from .nf4 import NF4

__all__ = [
    "NF4",
    "BlockFloat8",
    "BlockLog4",
    "Float8Blockwise",
    "Float8Rowwise",
    "Float8Tensorwise",
    "Int4Groupwise",
    "Int8Rowwise",
]
