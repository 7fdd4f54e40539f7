"""Stable integer ids for formats, so custom ops can take a format as an ``int`` argument.

A ``torch.library`` op cannot take a ``QuantFormat`` object, and DTensor's
``register_sharding`` keys its propagation cache only on the op's arguments
from the first ``int`` on: a format passed any other way (a string, say)
would let a cached Int8Rowwise decision be reused for Int4Groupwise. An id
is a hash of the format's class and parameters, so it is the same in every
process (a compiled graph cached on disk by one process names the same format
in the next) and needs no coordination between ranks.
"""

from __future__ import annotations

import hashlib

from .format import QuantFormat

_FORMATS: dict[int, QuantFormat] = {}


def format_id(fmt: QuantFormat) -> int:
    """The id of ``fmt`` (registering it, so that :func:`format_from_id` can find it)."""
    key = f"{type(fmt).__module__}.{type(fmt).__qualname__}:{fmt!r}"
    fid = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")
    known = _FORMATS.setdefault(fid, fmt)
    if known != fmt:
        raise RuntimeError(f"format id collision between {known!r} and {fmt!r}; rename one of the formats")
    return fid


# A format is a constant of a compiled graph, so its id is too. This is what
# torch.compiler.assume_constant_result does; calling it would import all of
# torch._dynamo (2 s) with the library. tests/core/test_format_ids.py checks the two agree.
format_id._dynamo_marked_constant = True


def format_from_id(fid: int) -> QuantFormat:
    """The format registered under ``fid`` by :func:`format_id` in this process."""
    try:
        return _FORMATS[fid]
    except KeyError:
        raise ValueError(
            f"dtensor_quant: unknown format id {fid}. Ids are registered by "
            "dtensor_quant._core.format_ids.format_id(fmt) (every quantize and every op on a quantized tensor "
            "calls it); register the format first."
        ) from None
