"""What the library's collectives put on the wire (``dq.wire.record()``): bytes per op, quantized or dense."""

from ._parallel.wire import Transfer, WireLog, record

__all__ = ["Transfer", "WireLog", "record"]
