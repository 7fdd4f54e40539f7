"""Local ops on quantized tensors, derived from the layout: slicing, views, copies, matmul, dense values.

Importing this package registers the aten handlers in the dispatch table
(``slicing``, ``views``, ``factories``, ``copies``, ``matmul``, ``init``), as DTensor's
``_ops`` register their sharding rules by import. The pointwise ops (and the fused
optimizer steps) register from :mod:`dtensor_quant._training`. ``layout_ops`` is the
vocabulary they share; ``writes`` the checks every write makes; ``dequant``
and ``unpack`` give dense values.
"""

from . import copies, factories, init, matmul, slicing, views  # noqa: F401  (registration)
