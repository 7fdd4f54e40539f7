"""Local ops on quantized tensors, derived from the layout: slicing, views, copies, matmul, dense values.

Importing this package registers the aten handlers in the dispatch table
(``slicing``, ``views``, ``factories``, ``copies``, ``matmul``, ``arithmetic``, ``init``), as DTensor's
``_ops`` register their sharding rules by import. ``layout_ops`` is the
vocabulary they share; ``writes`` the checks every write makes; ``dequant``
and ``unpack`` give dense values.
"""

from . import arithmetic, copies, factories, init, matmul, slicing, views  # noqa: F401  (registration)
