"""Training quantized weights in place, private: the feature's own room (the public front is ``dq.training``).

A weight made with ``dq.quantize_(model, fmt, trainable=True)`` stays
quantized; every optimizer update requantizes it with stochastic rounding.
What that needs besides a format (``QuantFormat.quantize_stochastic``, the
noise of :mod:`dtensor_quant._core.stochastic`) and an optimizer
(:mod:`dtensor_quant._optim`) lives here:

* ``trainable``: a weight's seed and requantization count, where a local
  shard sits (``resolve``, the link), the requantization, the count in
  optimizers' state dicts;
* ``pointwise``: the rule of every pointwise and ``_foreach_`` op (an update
  requantizes, a read is dense, a frozen weight refuses);
* ``fused``: torch.optim's fused steps (``fused=True``), the same rule per
  weight.

Importing this package registers the last two in the op table, by kind and
by name, as DTensor's ``_ops`` register their rules; ``import dtensor_quant``
imports it (every layer above and ``dq.training`` do). The room sits above
``_parallel`` (a requantization reduces its statistics over the mesh) and
below ``_fsdp``, ``_model`` and ``_optim``, which import it; the layers below
ask through the slot ``"trainable"`` (:mod:`dtensor_quant._core.registry`,
declared by ``_ops/factories.py``), which ``trainable.resolve`` provides.
"""

from . import fused, pointwise, trainable  # noqa: F401  (registration, and the slot "trainable" provided)
