"""Quantized tensors across ranks: placements, the collectives on stored bytes, sharded quantizing.

Importing this package registers the collective handlers (``collectives``)
and the library's custom ops with their sharding strategies (``custom_ops``),
and arranges, once the process makes its first quantized tensor, for
compiled DTensors to be keyed by their quantized local tensor
(``compile_key``) and for every redistribute of a quantized local to check
its target before any collective (``redistribute_check``), and, once the
process declares a per-token activation scheme, for row-parallel matmuls to
reduce its statistic over the mesh (``activation_stats``). Importing it
replaces nothing in torch: the redistribute shortcuts (``fast_redistribute``)
are opt-in.
"""

from . import (  # noqa: F401  (registration)
    activation_stats,
    collectives,
    compile_key,
    custom_ops,
    fast_redistribute,
    redistribute_check,
)
