"""Quantized tensors across ranks: placements, the collectives on stored bytes, sharded quantizing.

Importing this package registers the collective handlers (``collectives``)
and the library's custom ops with their sharding strategies (``custom_ops``),
keys compiled DTensors by their quantized local tensor (``compile_key``), and
cuts a replicated quantized local into this rank's piece in one step
(``replicate_to_shard``), gathers one along any dim in one step
(``gather_dim``), and on a CPU mesh moves it from one sharded dim to another
with one gather and one cut (``shard_to_shard``).
"""

from . import collectives, compile_key, custom_ops, gather_dim, replicate_to_shard, shard_to_shard  # noqa: F401  (registration)
