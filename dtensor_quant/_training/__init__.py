"""Training quantized weights in place, private: the feature's own room (the public front is ``dq.training``).

A weight made with ``dq.quantize_(model, fmt, trainable=True)`` stays
quantized; every optimizer update requantizes it with stochastic rounding.
What that needs besides a format (``QuantFormat.quantize_stochastic``, the
noise of :mod:`dtensor_quant._core.stochastic`) and an optimizer
(:mod:`dtensor_quant._optim`) lives here: ``trainable`` (a weight's seed and
requantization count, where a local shard sits, the requantization, the
count in optimizers' state dicts).

The room sits above ``_parallel`` (a requantization reduces its statistics
over the mesh) and below ``_fsdp``, ``_model`` and ``_optim``, which import
it; the layers below it ask through the slot ``"trainable"``
(:mod:`dtensor_quant._core.registry`), which ``trainable.resolve`` provides.
"""
