"""``load``: read each model tensor's slice from the checkpoint and quantize it, or place its stored inner tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ...core.format import Reducer, weight_layout
from ...core.layout import Blocked, OneToOne, Packed, inner_slice
from ...core.tensor import contiguous_strides
from ...dist.quantize import quantize
from ...dist.shard_quant import MeshReducer, quantize_local
from ...ops.writes import note_write
from ..state_dict import canonical_view, entry_placements, entry_shape, from_entries
from .match import plan
from .safetensors_io import Checkpoint
from .tensors import local_slice, local_tensor


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
    with Checkpoint(path) as ckpt:
        tasks, missing, unexpected = plan(model, ckpt, strict)
        result = LoadResult(0, ckpt.header_bytes, ckpt.file_bytes, missing=missing, unexpected=unexpected)
        with torch.no_grad():
            for kind, key, src, t in tasks:
                if kind == "prequantized":
                    t.copy_(_read_prequantized(ckpt, key, src, t))
                    result.prequantized.append(key)
                elif kind == "quantized":
                    _load_quantized(ckpt, key, src, t, chunk_bytes)
                    result.quantized.append(key)
                else:
                    _load_dense(ckpt, src, t, chunk_bytes)
                    result.dense.append(key)
        result.bytes_read = ckpt.bytes_read
    return result


def _row_runs(rows: int, row_bytes: int, align: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[r0, r1)`` runs of about ``chunk_bytes`` covering ``rows``, each starting at a multiple of ``align``."""
    step = max(align, chunk_bytes // max(row_bytes, 1) // align * align)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _load_dense(ckpt: Checkpoint, src: str, t: torch.Tensor, chunk_bytes: int) -> None:
    shape, offset = local_slice(t)
    local = local_tensor(t)
    if local.ndim == 0:
        local.copy_(ckpt.read(src, offset, shape))
        return
    row_bytes = math.prod(shape[1:]) * ckpt.info(src).dtype.itemsize
    for r0, r1 in _row_runs(shape[0], row_bytes, 1, chunk_bytes):
        local[r0:r1].copy_(ckpt.read(src, (offset[0] + r0, *offset[1:]), (r1 - r0, *shape[1:])))


def _load_quantized(ckpt: Checkpoint, key: str, src: str, t: torch.Tensor, chunk_bytes: int) -> None:
    """Quantize this rank's slice of ``src`` into ``t``: in runs of dim-0 indices, or whole.

    Runs along dim 0 (rows of a matrix, experts of a fused ``[E, out, in]``
    stack) are exactly as independent as Shard(0) pieces when the layout says
    so: every inner tensor is one-to-one, packed or blocked along dim 0 (never
    constant: no statistic spans them), and a run starts on a multiple of
    every dim-0 block. Statistics shared across shards of the other dims are
    all-reduced by the reducer the quantize op uses; the ranks of such a group
    hold the same dim-0 range, so they run the same collectives. Otherwise the
    slice is quantized whole, placed like ``t``, by :func:`~dtensor_quant.quantize`
    (the path :func:`~dtensor_quant.state_dict.quantize_like` takes).
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
        note_write()  # written around copy_: views of the weight made earlier must not keep stale kernel inputs


def _read_prequantized(ckpt: Checkpoint, key: str, src: str, t: torch.Tensor) -> torch.Tensor:
    """The stored inner tensors of ``src``, this rank's chunks, placed like ``t`` (no dequantization)."""
    q, _, to_canonical, shape = canonical_view(t, key)
    suffixes, entries = q.fmt.checkpoint_suffixes, {}
    for name, rels in q.fmt.layout_for(shape).items():
        k, g_shape = src + suffixes[name], entry_shape(rels, shape)
        if isinstance(t, DTensor):
            placements = entry_placements(t.placements, rels, to_canonical)
            mesh = t.device_mesh
            l_shape, l_off = compute_local_shape_and_global_offset(g_shape, mesh, placements)
            entries[name] = _dtensor_like(ckpt.read(k, l_off, l_shape), t, placements, g_shape)
        else:
            entries[name] = ckpt.read(k)
    return from_entries(entries, t, key)


def _dtensor_like(local: torch.Tensor, like: DTensor, placements=None, shape=None) -> DTensor:
    shape = tuple(like.shape) if shape is None else tuple(shape)
    return DTensor.from_local(
        local, like.device_mesh, placements or like.placements, run_check=False, shape=shape,
        stride=contiguous_strides(shape),
    )  # fmt: skip
