"""Quantized tensors across ranks: placements, the collectives on stored bytes, sharded quantizing.

Importing this package registers the collective handlers (``collectives``)
and the library's custom ops with their sharding strategies (``custom_ops``),
and arranges for compiled DTensors to be keyed by their quantized local
tensor once the process makes one (``compile_key``). It replaces nothing in
torch: the redistribute shortcuts (``fast_redistribute``) are opt-in.
"""

from . import collectives, compile_key, custom_ops, fast_redistribute  # noqa: F401  (registration)
