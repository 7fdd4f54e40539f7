"""Optimizers whose states are quantized tensors of this library: ``dq.optim.AdamW8bit``, ``AdamW4bit``, ``AdamW``.

Their states shard, gather and checkpoint like quantized weights (they are
QuantizedTensors, DTensors of them for DTensor parameters), and they update
trainable quantized weights (``dq.quantize_(..., trainable=True)``) with one
stochastically rounded requantization per step. ``torch.optim``'s own
optimizers update trainable weights too (docs/training.md).
"""

from .._optim import AdamW, AdamW4bit, AdamW8bit, BlockFloat8, BlockLog4

__all__ = ["AdamW", "AdamW4bit", "AdamW8bit", "BlockFloat8", "BlockLog4"]
