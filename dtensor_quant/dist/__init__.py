"""Quantized tensors across ranks: placements, the collectives on stored bytes, sharded quantizing.

Importing this package registers the collective handlers (``collectives``)
and the library's custom ops with their sharding strategies (``custom_ops``),
and keys compiled DTensors by their quantized local tensor (``compile_key``).
"""

from . import collectives, compile_key, custom_ops  # noqa: F401  (registration)
