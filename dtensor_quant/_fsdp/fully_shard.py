"""``fully_shard`` with the checks FSDP2 cannot make for quantized weights, made before any collective.

Everything here reads shapes, layouts and arguments only, so every rank
raises the same error before the first collective: ``shard_placement_fn``
other than ``Shard(0)``, an integer ``reshard_after_forward`` that the
post-forward shard cannot hold or that meets a tensor-parallel parameter,
and dim-0 shards that cut a pack or a block. It also tells tensor-parallel
``GatherQuantized`` weights which TP groups share their statistics.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .._core.format import weight_layout
from .._core.layout import MAX_LISTED_MESH_SIZE, LayoutError, dim_factor, legal_chunk, legal_chunk_counts
from .._core.tensor import QuantizedTensor
from .._parallel.placements import shard_like
from .._training.trainable import resolve
from .gather_quantized import GatherQuantized
from .reshard_after_forward import install_fsdp_post_forward_reshard

# -- fully_shard with the checks FSDP2 cannot make for quantized weights ------


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None, **kwargs):
    """``torch.distributed.fsdp.fully_shard`` after refusing what quantized weights cannot do.

    The checks use only shapes and arguments, so every rank raises the same
    error before any collective. Plain ``fully_shard`` works on quantized
    models too; this adds the early, clear errors.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    record_tensor_parallel(module)
    check_fully_shard(module, mesh, reshard_after_forward, shard_placement_fn, kwargs)
    if _is_group_size(reshard_after_forward):
        install_fsdp_post_forward_reshard()  # FSDP2's post-forward reshard of parameters with all-gather hooks
    return torch_fully_shard(
        module, mesh=mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=shard_placement_fn, **kwargs
    )


def record_tensor_parallel(module) -> None:
    """Tell each tensor-parallel trainable weight gathered quantized which TP groups share its statistics.

    A ``GatherQuantized`` weight that ``parallelize_module`` sharded is a
    DTensor over the TP mesh; FSDP2's pre hook only sees the local shard and
    the FSDP2 mesh. Recording the TP mesh dims here lets the hook all-reduce a
    statistic that spans TP shards (a per-row scale of a row-parallel weight)
    over the TP group as well, so the gathered weight is bit-identical to
    quantizing the whole master, as on one process. Raises ``LayoutError``
    (every rank, before any collective) if a TP shard cuts a block or a pack.
    """

    for fqn, param, local, fmt in quantized_params(module):
        if not isinstance(local, GatherQuantized) or not isinstance(param, DTensor):
            continue
        layout, axes = weight_layout(fmt, local.full_shape), []
        for i, placement in enumerate(param.placements):
            if not shard_like(placement):
                continue
            dim, size = placement.dim % 2, param.device_mesh.size(i)
            factor = dim_factor([rels[dim] for rels in layout.values()])
            if not legal_chunk(local.full_shape[dim], size, factor):
                raise LayoutError(
                    f"{fqn} ({fmt}): tensor parallelism over {size} ranks cuts dim {dim} (size "
                    f"{local.full_shape[dim]}) off its layout, which needs multiples of {factor}; legal sizes: "
                    f"{', '.join(map(str, legal_chunk_counts(local.full_shape[dim], factor)))}."
                )
            axes.append((dim, param.device_mesh.get_group(i).group_name))
        local.tp_axes = tuple(axes)


def check_fully_shard(module, mesh, reshard_after_forward, shard_placement_fn, kwargs=None) -> None:
    """Raise ``ValueError`` if ``fully_shard(module, ...)`` cannot gather its quantized weights compactly."""
    world = _shard_size(mesh, kwargs or {})
    if _is_group_size(reshard_after_forward):
        _check_reshard_group_size(module, reshard_after_forward, world)
    for fqn, param, local, fmt in quantized_params(module):
        where = f"{fqn or 'parameter'} ({type(local).__name__} {fmt})"
        if shard_placement_fn is not None:
            placement = shard_placement_fn(param)
            placement = getattr(placement, "placement", placement)
            if placement is not None and not (isinstance(placement, Shard) and placement.dim % local.ndim == 0):
                raise ValueError(
                    f"{where}: shard_placement_fn gives {placement}; quantized weights are all-gathered "
                    "along dim 0 only (FSDP2 views the gathered bytes of another dim with the dense "
                    "shape to regroup them). Return None or Shard(0) for them; an expert stack with "
                    "fewer experts than ranks shards unevenly along dim 0 (some ranks hold no expert)."
                )
        if not local.is_contiguous():
            raise ValueError(f"{where}: FSDP2 needs contiguous parameters; this is a transposed view")
        if param.requires_grad and isinstance(local, QuantizedTensor) and resolve(local) is None:
            raise ValueError(
                f"{where} has requires_grad=True: FSDP2 would compute and reduce a dense gradient that no "
                "optimizer can apply to quantized bytes. Freeze it (requires_grad_(False)) and train adapters "
                "(dtensor_quant.lora), or make it trainable: dtensor_quant.quantize_(..., trainable=True) (updated in "
                "place with stochastic rounding) or dtensor_quant.gather_quantized_ (dense master weights)."
            )
        if world is not None and world > 1:
            factor = _row_factor(local)
            if not padded_legal(local.shape[0], world, factor):
                legal = [n for n in range(1, MAX_LISTED_MESH_SIZE + 1) if padded_legal(local.shape[0], n, factor)]
                raise LayoutError(
                    f"{where}: FSDP2 over {world} ranks cuts its {local.shape[0]} rows into shards of "
                    f"{-(-local.shape[0] // world)} rows (the short ones padded), but its layout needs multiples "
                    f"of {factor} along dim 0. Legal FSDP2 sizes: {', '.join(map(str, legal))}."
                )


def padded_legal(rows: int, world: int, factor: int) -> bool:
    """Whether FSDP2's shards of ``rows`` over ``world`` ranks -- each padded to ``ceil(rows / world)`` rows,
    all of them all-gathered -- cut only on multiples of ``factor``. ``torch.chunk``'s rule
    (:func:`~dtensor_quant._core.layout.legal_chunk`) but for one row: torch.chunk leaves it whole, FSDP2 pads
    every other rank with a row of its own, a cut inside a block of more rows. The planner
    (:mod:`dtensor_quant._model.planner.cells`) asks this same rule for the dp dim, so its verdicts are this check's."""
    return world == 1 or factor == 1 or (-(-rows // world)) % factor == 0


def _is_group_size(reshard_after_forward) -> bool:
    return isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool)


def _check_reshard_group_size(module, size: int, world: int | None) -> None:
    """An integer ``reshard_after_forward``: what torch's FSDP2 would refuse, refused up front.

    Torch checks the factor itself (before any collective) but refuses a DTensor
    (tensor-parallel) parameter only at the first post-forward reshard, after the
    forward's all-gathers; with quantized parameters the fix in
    :func:`dtensor_quant.fsdp.install_fsdp_post_forward_reshard` does the rest.
    """
    if world is not None and (size < 1 or world % size):
        raise ValueError(
            f"reshard_after_forward={size}: an integer is the size of the group FSDP2 reshards to after the "
            f"forward and must divide the {world} ranks it shards over; use one of "
            f"{', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}, or True/False."
        )
    if world is not None and size in (1, world):
        return  # torch treats these as False and True
    for fqn, param in _managed_params(module):
        if isinstance(param, DTensor):
            raise ValueError(
                f"{fqn}: reshard_after_forward={size} with a DTensor (tensor-parallel) parameter: torch 2.13's "
                "FSDP2 cannot reshard DTensor parameters to a smaller mesh after the forward "
                "(FSDPParam.to_sharded_post_forward raises NotImplementedError for them, after the forward). "
                "Use True or False with tensor parallelism."
            )


def _managed_params(module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(fqn, param)`` of the parameters FSDP2 would manage: submodules already sharded are skipped, as FSDP2 does."""
    from torch.distributed.fsdp import FSDPModule

    roots = module if isinstance(module, (list, tuple)) else [module]

    def walk(m, prefix, is_root):
        if not is_root and isinstance(m, FSDPModule):
            return
        for name, p in m.named_parameters(recurse=False):
            yield prefix + name, p
        for name, child in m.named_children():
            yield from walk(child, f"{prefix}{name}.", False)

    for root in roots:
        yield from walk(root, "", True)


def quantized_params(module) -> Iterator[tuple[str, nn.Parameter, torch.Tensor, object]]:
    """``(fqn, param, local tensor, format)`` of the quantized parameters FSDP2 would manage."""
    for fqn, p in _managed_params(module):
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, (QuantizedTensor, GatherQuantized)):
            yield fqn, p, local, local.fmt


def _row_factor(local) -> int:
    if isinstance(local, QuantizedTensor):
        return dim_factor([rels[0] for rels in local.rels])
    return dim_factor([rels[0] for rels in weight_layout(local.fmt, local.full_shape).values()])


def _shard_size(mesh, kwargs) -> int | None:
    import torch.distributed as dist

    if kwargs.get("dp_mesh_dims") is not None:
        return None  # torch's own split check still applies
    if mesh is None:
        return dist.get_world_size() if dist.is_initialized() else None
    return mesh.size(mesh.ndim - 1)
