"""``load``: read each model tensor's slice from the checkpoint and quantize it, or place its stored inner tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..._core.format import Reducer, weight_layout
from ..._core.layout import Blocked, OneToOne, Packed, inner_slice
from ..._core.notes import wrote
from ..._core.tensor import contiguous_strides
from ..._parallel.agree import raise_together
from ..._parallel.quantize import quantize
from ..._parallel.shard_quant import MeshReducer, quantize_local
from .io.safetensors_io import Checkpoint
from .match import Padded, plan
from .prequantized import read as read_stored
from .tensors import agreement_scope, local_slice, local_tensor


@dataclass
class LoadResult:
    """What :func:`load` did on this rank."""

    bytes_read: int  # tensor bytes read by this rank
    header_bytes: int
    file_bytes: int  # size of the checkpoint's files
    quantized: list[str] = field(default_factory=list)  # dense in the file, quantized on load
    prequantized: list[str] = field(default_factory=list)  # read as stored (no dequantization)
    dense: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # model tensors the checkpoint lacks (strict=False only)
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors the model lacks (strict=False only)


def load(model: nn.Module, path, *, strict: bool = True, chunk_bytes: int = 4 << 20) -> LoadResult:
    """Load the Hugging Face checkpoint directory ``path`` into ``model``, each rank reading its own slices.

    Every rank calls it, with the model in any layout the library supports
    (tensor parallel, FSDP2, both, one process). Dense weights that the model
    holds quantized are quantized with the statistics of the full tensor
    (bit-identical to quantize-then-shard); weights stored quantized in a
    format's layout are read as they are. A missing or unexpected tensor
    (``strict``), a shape or a format that does not fit raises ``ValueError``
    on every rank before anything is read. Tied weights a checkpoint leaves out
    (transformers' ``tie_word_embeddings``) are read from their source.

    A slice is read and quantized in runs of rows of about ``chunk_bytes``
    when the format's statistics never span rows (its layout is not constant
    along dim 0); so a rank holds its shards plus one such run at a time.
    """
    what = f"dq.hf.load from {path}"
    # Every check runs before the first write, and the ranks agree on its outcome: a checkpoint or a model
    # that one rank finds wrong raises on every rank, and no rank waits in a collective of the load.
    scope, _ = agreement_scope(model)  # the ranks that hold the model
    ckpt = raise_together(lambda: Checkpoint(path), what=what, **scope)
    with ckpt:
        tasks, missing, unexpected = raise_together(lambda: plan(model, ckpt, strict), what=what, **scope)
        result = LoadResult(0, ckpt.header_bytes, ckpt.file_bytes, missing=missing, unexpected=unexpected)
        reader = _Reader(ckpt)
        with torch.no_grad():
            for kind, key, src, t in tasks:
                if kind == "prequantized":  # src: the StoredLayout
                    t.copy_(read_stored(src, reader, key, t))
                    result.prequantized.append(key)
                elif kind == "quantized":
                    _load_quantized(reader, key, src, t, chunk_bytes)
                    result.quantized.append(key)
                else:
                    _load_dense(reader, src, t, chunk_bytes)
                    result.dense.append(key)
        raise_together(reader.raise_first, what=what, **scope)
        result.bytes_read = ckpt.bytes_read
    return result


class _Reader:
    """``Checkpoint``'s reads, where a failed read (a file changed after its headers were checked) gives zeros.

    The loop above runs collectives (statistics shared by shards): a rank
    that stopped at its first failed read would leave the others waiting in
    them. It goes on with zeros instead, and every rank raises the first
    error at the end. The headers were checked up front, so this takes a file
    that is cut short or replaced while the load runs.
    """

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.error = ckpt, None

    def info(self, src):
        return src if isinstance(src, Padded) else self.ckpt.info(src)

    def read(self, key, offsets=None, lengths=None) -> torch.Tensor:
        try:
            if isinstance(key, Padded):
                return self._read_padded(key, offsets, lengths)
            return self.ckpt.read(key, offsets, lengths)
        except (OSError, ValueError) as e:
            self.error = self.error or e
            info = self.info(key)
            return torch.zeros(tuple(lengths) if lengths is not None else info.shape, dtype=info.dtype)

    def _read_padded(self, src: Padded, offsets, lengths) -> torch.Tensor:
        """The slice of the padded tensor: the checkpoint's part of it, zeros past the original size."""
        offsets = tuple(offsets) if offsets is not None else (0,) * len(src.shape)
        lengths = tuple(lengths) if lengths is not None else src.shape
        out = torch.zeros(lengths, dtype=src.dtype)
        inside = [max(0, min(o + n, s) - o) for o, n, s in zip(offsets, lengths, src.stored)]
        if all(inside):
            out[tuple(slice(0, n) for n in inside)] = self.ckpt.read(src.key, offsets, inside)
        return out

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error


def _row_runs(rows: int, row_bytes: int, align: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[r0, r1)`` runs of about ``chunk_bytes`` covering ``rows``, each starting at a multiple of ``align``."""
    step = max(align, chunk_bytes // max(row_bytes, 1) // align * align)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _load_dense(ckpt: _Reader, src: str, t: torch.Tensor, chunk_bytes: int) -> None:
    shape, offset = local_slice(t)
    local = local_tensor(t)
    if local.ndim == 0:
        local.copy_(ckpt.read(src, offset, shape))
        return
    row_bytes = math.prod(shape[1:]) * ckpt.info(src).dtype.itemsize
    for r0, r1 in _row_runs(shape[0], row_bytes, 1, chunk_bytes):
        local[r0:r1].copy_(ckpt.read(src, (offset[0] + r0, *offset[1:]), (r1 - r0, *shape[1:])))


def _load_quantized(ckpt: _Reader, key: str, src: str, t: torch.Tensor, chunk_bytes: int) -> None:
    """Quantize this rank's slice of ``src`` into ``t``: in runs of dim-0 indices, or whole.

    Runs along dim 0 (rows of a matrix, experts of a fused ``[E, out, in]``
    stack) are exactly as independent as Shard(0) pieces when the layout says
    so: every inner tensor is one-to-one, packed or blocked along dim 0 (never
    constant: no statistic spans them), and a run starts on a multiple of
    every dim-0 block. Statistics shared across shards of the other dims are
    all-reduced by the reducer the quantize op uses; the ranks of such a group
    hold the same dim-0 range, so they run the same collectives. Otherwise the
    slice is quantized whole, placed like ``t``, by :func:`~dtensor_quant.quantize`
    (the path :func:`~dtensor_quant._checkpoint.quantize_like` takes).
    """
    shape, offset = local_slice(t)
    q = local_tensor(t)
    full = tuple(t.shape)
    layout = weight_layout(q.fmt, full)
    if not all(isinstance(rels[0], (OneToOne, Packed, Blocked)) for rels in layout.values()):
        dense = ckpt.read(src, offset, shape).to(t.dtype)
        t.copy_(quantize(_dtensor_like(dense, t) if isinstance(t, DTensor) else dense, q.fmt))
        return
    if isinstance(t, DTensor):
        reducer = MeshReducer.for_mesh(q.fmt, full, t.device_mesh, t.placements)
    else:
        reducer = Reducer(full)
    align = math.lcm(*(rels[0].factor for rels in layout.values()))
    row_bytes = math.prod(shape[1:]) * ckpt.info(src).dtype.itemsize
    for r0, r1 in _row_runs(shape[0], row_bytes, align, chunk_bytes):
        run = ckpt.read(src, (offset[0] + r0, *offset[1:]), (r1 - r0, *shape[1:])).to(t.dtype)
        part = quantize_local(q.fmt, run, reducer, full)
        for name, rels in layout.items():
            i0, i1, _ = inner_slice(rels[0], r0, r1, shape[0])
            q.inner[name][i0:i1].copy_(part.inner[name])
        wrote(q.notes)  # written around copy_: views of the weight made earlier must not keep stale kernel inputs


def _dtensor_like(local: torch.Tensor, like: DTensor, placements=None, shape=None) -> DTensor:
    shape = tuple(like.shape) if shape is None else tuple(shape)
    return DTensor.from_local(
        local, like.device_mesh, placements or like.placements, run_check=False, shape=shape,
        stride=contiguous_strides(shape),
    )  # fmt: skip
