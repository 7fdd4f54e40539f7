"""FSDP2's all-gather of quantized weights, derived from the same layout rules as DTensor's.

``fully_shard`` shards every parameter along dim 0. For a local tensor that
defines ``fsdp_pre_all_gather``/``fsdp_post_all_gather``, FSDP2 all-gathers
whatever the pre hook returns and lets the post hook build the unsharded
parameter from the gathered buffers. For a :class:`QuantizedTensor` the pre
hook returns the stored inner tensors as ``uint8`` views (gloo has no float8,
and bytes cannot have their NaN payloads rewritten on the wire); the post hook
concatenates them with the layout's rule (:func:`dtensor_quant._ops.layout_ops.cat_dim`,
the rule DTensor's all-gather uses) without copying, and gives the result the
logical dtype ``mp_policy.param_dtype``. As in DTensor's gather, an inner
tensor constant along every dim (a per-tensor scale) is the same on every rank
and is not sent; one constant along dim 0 only (a per-column scale) is sent
and kept once if all copies agree. (A rank past the last row gets FSDP2's
``new_zeros`` shard, whose shared constants the factory copies from the full
weight.) No format writes hook code.

Uneven shards. FSDP2 keeps a short shard as a leading-rows narrow of a
zero-padded buffer of ``ceil(rows / world)`` rows, and every rank must send
the same number of bytes, so a short rank pads its inner tensors to that many
rows itself. It cannot tell the padded length from its own shape: the
narrow FSDP2 takes of the padded buffer records it in the shard's notes
(``Notes.narrowed_from``, :mod:`dtensor_quant._core.notes`). With the 5-argument hook, torch 2.13 asserts -- on
the short rank only, so the others hang -- that every all-gather input has the
padded *logical* shard shape, which compact quantized bytes never have; torch
skips that assertion for the 1-argument form ``fsdp_pre_all_gather(mesh)``.
So a short shard presents the 1-argument form and a full one the 5-argument
form; both compute the same inputs from the same facts, and the only check
that uses ``outer_size`` (dim-0 sharding) can fail only where torch makes every
shard full. See docs/fsdp.md.

An integer ``reshard_after_forward=k`` keeps, after the forward, this rank's
1/k of the gathered bytes (still quantized) for the backward's all-gather over
k ranks: torch's FSDP2 cannot do that for parameters with all-gather hooks, and
:func:`fully_shard` installs the fix
(:func:`dtensor_quant.fsdp.install_fsdp_post_forward_reshard`). The post
hook then leaves FSDP2's buffers for the reshard to cut and free
(``GatherMeta.keep``) instead of freeing them once dequantized.

What FSDP2 cannot do with a compact all-gather is refused before any
collective, on every rank: ``shard_placement_fn`` other than ``Shard(0)``
(FSDP2 regroups other dims assuming dense bytes), an integer
``reshard_after_forward`` with a DTensor (tensor-parallel) parameter (torch
cannot reshard those to a smaller mesh, dense or not), and
dim-0 shards that cut a pack or a block. :func:`fully_shard` checks all of
them when sharding; the hooks check what they can see.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._core.dispatch import implements_method
from .._core.layout import LayoutError, dim_factor
from .._core.notes import padded_rows, refilled
from .._core.tensor import QuantizedTensor
from .._ops.layout_ops import canonical_dims, cat_dim, describe, pad_end, slice_dim
from .._ops.matmul import invalidate
from .._ops.unpack import unpack_into
from .._parallel import agree
from .._parallel.codec import pack, unpack, varies

KEEPING_OUTPUTS: ContextVar[bool] = ContextVar("dtensor_quant_fsdp_keeping_outputs", default=False)


def fsdp_keeps_all_gather_outputs() -> bool:
    """Whether the FSDP2 all-gather being prepared must leave its outputs allocated until the reshard.

    True while FSDP2 calls ``fsdp_pre_all_gather`` for a parameter that reshards to a smaller mesh
    after the forward: its post-forward shard is cut from the all-gather outputs, so a post hook
    that frees them early (dtensor_quant's dequantizing one does) must not.
    """
    return KEEPING_OUTPUTS.get()


@dataclass(frozen=True)
class GatherMeta:
    """What the post hook needs to rebuild the weight from the gathered bytes."""

    fmt: object
    rels: tuple  # of one rank's padded shard
    shape: torch.Size  # of one rank's padded shard
    world: int
    sent: tuple[str, ...]  # the inner tensors on the wire, in order
    kept: dict[str, torch.Tensor]  # the others: constant along every dim, the same on every rank
    dtypes: tuple[torch.dtype, ...]  # per sent inner tensor
    shapes: tuple[torch.Size, ...]  # per sent inner tensor, as each rank sends it
    dense: bool  # the unsharded parameter is the dequantized weight (frozen weights), not a QuantizedTensor
    keep: bool = False  # FSDP2 cuts a post-forward shard from the gathered bytes: the post hook must not free them


@implements_method("fsdp_pre_all_gather")
def quantized_pre_hook(q: QuantizedTensor):
    """``QuantizedTensor.fsdp_pre_all_gather``: the shard's own bytes, gathered and kept quantized.

    The gathered weight is dequantized once for the forward and backward, unless its format quantizes its
    activations (``fmt.activation_scheme``): its forward must run the format's own arithmetic, so the weight
    stays quantized (the backward's ``grad @ W`` dequantizes it, as for any quantized weight).
    """
    return hook_for(q, lambda mesh: q, dense=q.fmt.activation_scheme is None)


@implements_method("fsdp_post_all_gather")
def quantized_post_hook(q: QuantizedTensor, outputs, metadata, param_dtype, *, out=None):
    """``QuantizedTensor.fsdp_post_all_gather``."""
    return post_all_gather(outputs, metadata, param_dtype, out=out)


def hook_for(t: torch.Tensor, quantized: Callable[[object], QuantizedTensor], dense: bool):
    """The ``fsdp_pre_all_gather`` FSDP2 sees on shard ``t``: 5 arguments if full, 1 if short.

    ``quantized(mesh)`` gives this rank's shard as a QuantizedTensor; ``dense``
    whether the post hook dequantizes the gathered weight (see :func:`post_all_gather`).
    """

    def five(mesh, outer_size, outer_stride, module, mp_policy):
        return _agreed(pre_all_gather(quantized(mesh), mesh, outer_size, dense=dense), mesh)

    def one(mesh):
        return _agreed(pre_all_gather(quantized(mesh), mesh, dense=dense), mesh)

    return one if t.shape[0] < padded_rows(t) else five


def _agreed(result, mesh):
    """Every rank must send its bytes in the same layout: a clear error on all of them if not."""
    inputs, meta = result
    if meta.world > 1:
        key = ("fsdp", meta.fmt, tuple(meta.rels), tuple(meta.shape), meta.sent, meta.dtypes, meta.shapes)
        group = mesh.get_group(mesh.ndim - 1).group_name
        agree.check_same(
            group, key, inputs[0], f"FSDP2 all-gather of a {meta.fmt} shard of {tuple(meta.shape)}", _describe_key
        )
    return result


def _describe_key(key) -> str:
    _, fmt, _rels, shape, sent, dtypes, shapes = key
    parts = ", ".join(f"{n}={tuple(s)}:{str(d).removeprefix('torch.')}" for n, d, s in zip(sent, dtypes, shapes))
    return f"{fmt!r} shard of {shape} sending {parts}"


def pre_all_gather(q: QuantizedTensor, mesh, outer_size=None, dense: bool = True):
    """``(all-gather inputs, metadata)`` for this rank's shard ``q``: its inner tensors as bytes.

    Raises (identically on every rank, before FSDP2's collective) when the
    shard is not a dim-0 shard or its padded length cuts a pack or a block.
    """
    world = mesh.size()
    if q.ndim < 2 or q.dims != canonical_dims(q.ndim) or not q.is_contiguous():
        raise LayoutError(f"FSDP2 all-gathers whole [..., out, in] weights; got a view {q!r}")
    if outer_size is not None and tuple(outer_size)[1:] != tuple(q.shape)[1:]:
        raise LayoutError(
            f"FSDP2 sharded a {describe(q)} along dim 1 (full shape {tuple(outer_size)}): dtensor_quant's "
            "all-gather supports Shard(0) only, because FSDP2 regroups other dims as if the bytes were "
            "dense. Drop shard_placement_fn for quantized weights (or return Shard(0))."
        )
    # A full shard knows FSDP2's padded length from outer_size; a short one from its narrow.
    rows = -(-outer_size[0] // world) if outer_size is not None else padded_rows(q)
    assert q.shape[0] <= rows, (tuple(q.shape), rows)
    piece = q if q.shape[0] == rows else pad_end(q, 0, rows - q.shape[0])
    factor = dim_factor([rels[0] for rels in piece.rels])
    if world > 1 and rows % factor:
        raise LayoutError(
            f"{describe(q)}: FSDP2's padded shards of {rows} rows cut its layout, which needs multiples "
            f"of {factor} along dim 0; dtensor_quant.fsdp.fully_shard lists the legal FSDP2 sizes."
        )
    sent = tuple(n for n in q.fmt.inner_names if varies(piece, n))
    inner = [getattr(piece, n).contiguous() for n in sent]
    kept = {n: t for n, t in piece.inner.items() if n not in sent}
    dtypes, shapes = tuple(t.dtype for t in inner), tuple(t.shape for t in inner)
    keep = fsdp_keeps_all_gather_outputs()
    meta = GatherMeta(q.fmt, piece.rels, piece.shape, world, sent, kept, dtypes, shapes, dense, keep)
    if world == 1:
        # torch 2.13's one-rank path copies only the first all-gather input
        return (pack(inner),), meta
    return tuple(_as_bytes(t) for t in inner), meta


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 rows ``[rows, bytes per row]`` (a view); the row length is spelled out, not ``-1``,
    which a shard of no rows (a weight with fewer rows than ranks, or none) cannot infer."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def post_all_gather(outputs, meta: GatherMeta, param_dtype: torch.dtype, *, out=None):
    """Rebuild the unsharded weight (logical dtype ``param_dtype``) from FSDP2's gathered buffers.

    Returns ``(weight, buffers to free at reshard)`` the first time; with
    ``out`` (later gathers, FSDP2 having re-allocated the storages) it refills
    ``out`` in place.

    A frozen weight (``meta.dense``) is dequantized here, once per all-gather,
    into a dense ``param_dtype`` parameter that the forward and the backward
    both use: the memory a bf16 FSDP2 unit holds anyway, and the matmuls run
    at dense speed with no second dequantize in the backward. The gathered
    bytes are freed at once. Otherwise (trainable weights gathered quantized,
    :mod:`dtensor_quant._fsdp.gather_quantized`) the weight is a QuantizedTensor whose
    inner tensors view FSDP2's buffers; anything that does not (the unsent
    constants) is copied into ``out``.
    """
    world, names, buffers = meta.world, meta.fmt.inner_names, list(outputs)
    if world == 1:
        like = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in zip(meta.shapes, meta.dtypes)]
        outputs = unpack(buffers[0].view(-1), like) if meta.sent else []
    joined = {  # [world * rows, ...] in each inner tensor's own trailing shape (N-D expert stacks)
        n: buf.view(dtype).view(-1, *shape[1:])
        for n, dtype, buf, shape in zip(meta.sent, meta.dtypes, outputs, meta.shapes)
    }
    rows = {n: shape[0] for n, shape in zip(meta.sent, meta.shapes)}
    pieces = []
    for r in range(world):
        inner = {n: joined[n].narrow(0, r * rows[n], rows[n]) if n in joined else meta.kept[n] for n in names}
        dims = canonical_dims(len(meta.shape))
        pieces.append(QuantizedTensor(inner, meta.fmt, meta.rels, dims, meta.shape, param_dtype, notes=refilled()))
    full = cat_dim(pieces, 0, joined=joined)  # DTensor's rule, on views of FSDP2's buffers
    full.notes = refilled()  # FSDP2 frees and refills the buffers: no kernel may cache a copy
    if meta.dense:
        return _dequantize_gathered(full, [] if meta.keep else buffers, out)
    if out is None:
        return full, buffers
    target = out._local_tensor if isinstance(out, DTensor) else out
    fresh = slice_dim(full, 0, 0, target.shape[0])
    for name in names:
        dst, src = getattr(target, name), getattr(fresh, name)
        assert dst.shape == src.shape and dst.dtype == src.dtype, (name, dst.shape, src.shape)
        if not _same_memory(dst, src):
            with torch.no_grad():
                dst.copy_(src)
    invalidate(target)


# The storages of the dense unsharded weights the post hook made, by StorageImpl (stable across
# FSDP2's free and re-allocate), so checks that look for quantized parameters -- a trainable one is
# refused before its backward (dtensor_quant._model) -- still find them under plain fully_shard.
_DEQUANTIZED: dict[int, object] = {}


def dequantized_from(t: torch.Tensor):
    """The format ``t``'s values were dequantized from by an FSDP2 gather (its unsharded weight), else None."""
    if not _DEQUANTIZED:
        return None
    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local) is not torch.Tensor and not isinstance(local, nn.Parameter):
        return None
    return _DEQUANTIZED.get(local.untyped_storage()._cdata)


@torch.no_grad()
def _dequantize_gathered(full: QuantizedTensor, buffers, out):
    """Write ``full``'s dense values into a new tensor (first gather) or ``out``'s storage; free ``buffers``.

    ``full`` holds FSDP2's padded rows; the parameter is FSDP2's ``as_strided``
    view of its leading rows, so ``out``'s storage holds all of them.
    """
    if out is None:
        dense = torch.empty(full.shape, dtype=full.dtype, device=full.device)
    else:
        target = out._local_tensor if isinstance(out, DTensor) else out
        storage = target.untyped_storage()
        assert target.storage_offset() == 0 and storage.nbytes() == full.numel() * target.element_size(), (
            "FSDP2 re-allocated the unsharded weight with another size"
        )
        dense = torch.empty(0, dtype=target.dtype, device=target.device).set_(storage, 0, full.shape)
    if not unpack_into(full, dense):
        dense.copy_(full.dequantize())
    for buf in buffers:  # the quantized bytes are spent; FSDP2 re-allocates them before the next gather
        buf.untyped_storage().resize_(0)
    if out is not None:
        return None
    key = dense.untyped_storage()._cdata
    _DEQUANTIZED[key] = full.fmt
    weakref.finalize(dense, _DEQUANTIZED.pop, key, None)
    return dense, [dense]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )
