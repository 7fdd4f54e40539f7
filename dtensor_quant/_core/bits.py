"""Two questions about a tensor's data that many modules ask: same bits? any data at all?

A leaf module (torch only), so the layout operations, the collectives'
agreement check and the copy checks can all ask them without importing each other.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included; works for float8, which has no torch.equal on CPU)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        a, b = a.contiguous().view(_INT_OF_SIZE[a.element_size()]), b.contiguous().view(_INT_OF_SIZE[b.element_size()])
    return torch.equal(a, b)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake, meta or functional tensor of a trace (no data to look at)."""
    if type(t) is torch.Tensor:  # the common eager case, without is_fake's cost
        return t.is_meta
    return is_fake(t) or t.device.type == "meta" or isinstance(t, torch.fx.Proxy)
