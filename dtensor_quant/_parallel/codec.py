"""The byte codec every quantized collective uses, and the rule for which inner tensors travel.

Quantized tensors travel as bytes: gloo has no float8, mixed dtypes cannot
share one collective otherwise, and reinterpreting packed bits as a float
dtype on the wire lets NaN patterns be rewritten. DTensor's scatter,
broadcast and all-to-all (:mod:`dtensor_quant._parallel.collectives`) and FSDP2's
all-gather (:mod:`dtensor_quant.fsdp`) send a quantized tensor as one ``uint8`` buffer: :func:`pack` lays the inner
tensors' bytes end to end, each padded to :data:`ALIGN` bytes so that its
slice of a received buffer can be viewed as its dtype again
(:func:`unpack`). DTensor's gathers send each inner tensor as a ``uint8``
view of itself in one coalesced all-gather, which needs no packing
(``collectives.gather``).

Which inner tensors are sent is one rule, :func:`varies`: a gather sends an
inner tensor unless it is ``Constant`` along every dim that can differ
between the pieces being joined (a per-tensor scale is the same on every
shard, so the receiver keeps its own copy). ``scatter_`` and ``broadcast_``
(``distribute_tensor``) send every inner tensor: their receivers hold no
copy of anything yet.
"""

from __future__ import annotations

import torch

from .._core.layout import Constant

ALIGN = 8  # bytes; keeps every inner tensor's slice of the buffer viewable as its dtype


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end in one ``uint8`` buffer, each padded to :data:`ALIGN` bytes."""
    parts = []
    for t in tensors:
        b = t.contiguous().view(-1)
        if b.dtype != torch.uint8:
            b = b.view(torch.uint8)
        parts.append(b)
        if b.numel() % ALIGN:
            parts.append(b.new_zeros(ALIGN - b.numel() % ALIGN))
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def packed_size(tensors: list[torch.Tensor]) -> int:
    """Bytes :func:`pack` makes of ``tensors`` (to allocate a receive buffer)."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)


def unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buf`` (a :func:`pack` of tensors shaped like ``like``) as those tensors, in order."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf.narrow(0, offset, n).view(t.dtype).view(t.shape))
        offset += -(-n // ALIGN) * ALIGN
    return out


def varies(q, name: str, dims=None) -> bool:
    """Whether inner ``name`` of ``q`` can differ between shards along ``dims`` (default: any dim).

    A gather sends exactly the inner tensors for which this holds; the others
    are ``Constant`` along those dims and every piece already has them.
    """
    rels = q.rel(name)
    along = rels if dims is None else [rels[d] for d in dims]
    return not all(isinstance(r, Constant) for r in along)
