"""Built-in formats. Each file holds one format's layout, math and kernel."""

from .int4 import Int4Groupwise
from .int8 import Int8Rowwise

__all__ = ["Int4Groupwise", "Int8Rowwise"]
