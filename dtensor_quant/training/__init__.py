"""Trainable quantized weights (``dq.training``): what ``dq.quantize_(model, fmt, trainable=True)`` sets up.

A trainable weight stays quantized; any ``torch.optim`` optimizer updates it
in place, requantized with stochastic rounding keyed by (seed, step, global
index), so 1, 2 or 3 ranks and a resume give the same bytes. ``resolve``
tells where a local shard of a trainable weight sits and its requantization
count; ``supports_training`` which formats can be trained.
"""

from .._training.trainable import SR_STEP, resolve, supports_training, trainable_names

__all__ = ["SR_STEP", "resolve", "supports_training", "trainable_names"]
