"""The aten ops DTensor, FSDP2 and DCP issue on a QuantizedTensor, grouped by kind.

Each handler is a thin wrapper that parses the op's arguments and calls a
layout operation of :mod:`dtensor_quant.layout_ops`; importing these modules
registers the handlers in :mod:`dtensor_quant.dispatch` (the package
``__init__`` does). A new aten op goes into the module of its kind.
"""

from . import arithmetic, copies, factories, slicing, views  # noqa: F401  (registration)
