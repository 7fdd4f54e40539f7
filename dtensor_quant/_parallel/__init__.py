"""Quantized tensors across ranks: placements, the collectives on stored bytes, sharded quantizing.

Importing this package registers the collective handlers (``collectives``)
and the library's custom ops with their sharding strategies (``custom_ops``),
and arranges, once the process makes its first quantized tensor, for
compiled DTensors to be keyed by their quantized local tensor
(``compile_key``) and for every redistribute of a quantized local to check
its target before any collective (``redistribute_check``). Importing it
replaces nothing in torch: the redistribute shortcuts (``fast_redistribute``)
are opt-in.
"""

from . import collectives, compile_key, custom_ops, fast_redistribute, redistribute_check  # noqa: F401  (registration)
