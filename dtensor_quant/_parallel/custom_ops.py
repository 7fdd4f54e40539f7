"""quantize, dequantize and linear as ``torch.library`` custom ops that DTensor can shard.

Each op takes the format as an ``int`` id (:mod:`~dtensor_quant._core.format_ids`)
and has three parts:

* a fake implementation (shapes and dtypes only), used by DTensor's sharding
  propagation and by ``torch.compile``;
* a local implementation: ``quantize`` runs the format's math on a dense
  (local) tensor; ``dequantize`` and ``linear`` receive a QuantizedTensor and
  are handled by the same dispatch table as every other op on it
  (``@implements("dtensor_quant::linear")`` below), so there is one place
  where local ops are defined;
* a sharding strategy registered with ``register_sharding``, so that on a
  DTensor the op runs shard by shard and returns a DTensor, never gathering
  the weight.

``quantize`` of a sharded weight needs statistics of whole blocks (a row's
maximum under column sharding). Its strategy keeps the input's placements and
the local kernel all-reduces exactly those statistics over the process groups
named in its arguments, which the strategy checks against the input's mesh.

The trap: ``register_sharding`` hashes an op's non-tensor arguments into its
propagation cache only from the first ``int`` argument on. So every op here
puts ``fmt_id`` first among them: the format, ``dequantize``'s dtype and
``quantize``'s groups all change the decision and all are hashed.

Python entry points, :func:`quantize`, :func:`linear` and :func:`dequantize`
here, reached publicly as ``dq.quantize(dtensor_weight, fmt)``,
``F.linear(x, w, bias)`` and ``dq.dequantize(w, torch.float32)`` (these also
check placements before any collective, so a bad placement raises
``LayoutError`` on every rank rather than the ``RuntimeError`` DTensor wraps
strategy errors in).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from .._core.dispatch import implements
from .._core.format import QuantFormat, Reducer, check_weight
from .._core.format_ids import format_from_id, format_id
from .._core.layout import LayoutError
from .._core.tensor import QuantizedTensor
from .._ops import matmul
from .._ops.dequant import dequantize as dequantize_local
from .._ops.layout_ops import describe
from .placements import check_placements, shard_like
from .shard_quant import MeshReducer, agree_before_reducing, quantize_local

# -- quantize -------------------------------------------------------------------


@torch.library.custom_op(
    "dtensor_quant::quantize",
    mutates_args=(),
    schema="(Tensor weight, int fmt_id, int[] shard_dims, str[] groups, int[] full_shape) -> Tensor",
)
def _quantize(
    weight: torch.Tensor, fmt_id: int, shard_dims: list[int], groups: list[str], full_shape: list[int]
) -> torch.Tensor:
    """Quantize a dense (local) weight; all-reduce block statistics over ``groups`` where shards share them.

    ``shard_dims[i]`` is the logical dim mesh dim ``i`` shards (-1: none),
    ``groups[i]`` that mesh dim's process group name and ``full_shape`` the
    whole weight's shape (a layout may depend on it).
    """
    fmt = format_from_id(fmt_id)
    agree_before_reducing(fmt, weight, shard_dims, groups, full_shape)
    reduce = MeshReducer(fmt, full_shape, [(d, g) for d, g in zip(shard_dims, groups) if d >= 0])
    return quantize_local(fmt, weight, reduce, full_shape)


@_quantize.register_fake
def _quantize_fake(weight, fmt_id, shard_dims, groups, full_shape):
    return torch.empty_like(weight)


def _shard_dims(placements, ndim: int) -> list[int]:
    return [p.dim % ndim if shard_like(p) else -1 for p in placements]


@register_sharding(torch.ops.dtensor_quant.quantize.default)
def _quantize_sharding(weight, fmt_id, shard_dims, groups, full_shape):
    """The output keeps the input's placements; legal ones only, with the reduction groups they need."""
    fmt, mesh, placements = format_from_id(fmt_id), weight.mesh, weight.placements
    check_placements(weight.shape, fmt, mesh.shape, placements)
    expected = _shard_dims(placements, len(weight.shape))
    if list(shard_dims) != expected or list(groups) != _groups(mesh, expected):
        raise ValueError(
            f"dtensor_quant::quantize on a DTensor with placements {list(placements)} needs shard_dims={expected} "
            f"and the mesh's group names; call dtensor_quant.quantize(dtensor, fmt), which passes them"
        )
    keep = [Replicate()] + [p for p in placements if shard_like(p)]
    return [([p], [p, None, None, None, None]) for p in dict.fromkeys(keep)]


def _groups(mesh, shard_dims: list[int]) -> list[str]:
    return [mesh.get_group(i).group_name if d >= 0 else "" for i, d in enumerate(shard_dims)]


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """``dtensor_quant::quantize``: a QuantizedTensor, or a DTensor of them with the input's placements."""
    fid = format_id(fmt)
    weight = weight.detach()
    if not isinstance(weight, DTensor):
        return torch.ops.dtensor_quant.quantize(weight, fid, [], [], list(weight.shape))
    mesh, placements = weight.device_mesh, weight.placements
    check_weight(fmt, weight.shape, weight.dtype)
    check_placements(weight.shape, fmt, mesh.shape, placements)
    if weight._local_tensor.is_meta:
        # Meta init (build, quantize_, shard, to_empty, load): no values, so nothing to reduce, and the
        # op's Meta kernel is its dense fake; quantize the meta shard itself to get the layout.
        local = quantize_local(fmt, weight._local_tensor, Reducer(weight.shape), weight.shape)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride())
    dims = _shard_dims(placements, weight.ndim)
    if _fewer_than_shards(weight.shape, mesh.shape, dims):
        # DTensor's propagation calls a dim shorter than its shard count unshardable and would
        # replicate the input (gathering the dense weight) before the op: run the kernel on the
        # local shard directly, with the same reductions (3 experts over 4 ranks, say).
        agree_before_reducing(fmt, weight.to_local(), dims, _groups(mesh, dims), list(weight.shape))
        reduce = MeshReducer.for_mesh(fmt, weight.shape, mesh, placements)
        local = quantize_local(fmt, weight.to_local(), reduce, weight.shape)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride())
    return torch.ops.dtensor_quant.quantize(weight, fid, dims, _groups(mesh, dims), list(weight.shape))


def _fewer_than_shards(shape, mesh_shape, shard_dims: list[int]) -> bool:
    """Whether some logical dim is shorter than the number of shards it is cut into."""
    for dim in set(shard_dims) - {-1}:
        shards = 1
        for n, d in zip(mesh_shape, shard_dims):
            shards *= n if d == dim else 1
        if shape[dim] < shards:
            return True
    return False


# -- dequantize -----------------------------------------------------------------


@torch.library.custom_op("dtensor_quant::dequantize", mutates_args=())
def _dequantize(weight: torch.Tensor, fmt_id: int, dtype: torch.dtype) -> torch.Tensor:
    raise TypeError(f"dtensor_quant::dequantize expects a quantized tensor, got a dense {weight.dtype} tensor")


@_dequantize.register_fake
def _dequantize_fake(weight, fmt_id, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


@implements("dtensor_quant::dequantize")
def _dequantize_local(func, q, fmt_id, dtype):
    _check_format(q, fmt_id)
    return dequantize_local(q, dtype)


@register_sharding(torch.ops.dtensor_quant.dequantize.default)
def _dequantize_sharding(weight, fmt_id, dtype):
    """Every shard of a quantized tensor dequantizes on its own: the output keeps the placements."""
    keep = [Replicate()] + [p for p in weight.placements if shard_like(p)]
    return [([p], [p, None, None]) for p in dict.fromkeys(keep)]


def dequantize(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dtensor_quant::dequantize``: the dense tensor (a DTensor with the same placements for a DTensor)."""
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    if not isinstance(local, QuantizedTensor):
        raise TypeError(f"dequantize expects a quantized tensor (or a DTensor of one), got {type(local).__name__}")
    if isinstance(weight, DTensor):
        mesh, placements = weight.device_mesh, weight.placements
        if _fewer_than_shards(weight.shape, mesh.shape, _shard_dims(placements, weight.ndim)):
            # As in quantize(): DTensor would replicate (gather) a dim shorter than its shard count.
            dense = dequantize_local(local, dtype or weight.dtype)
            return DTensor.from_local(
                dense, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride()
            )
    return torch.ops.dtensor_quant.dequantize(weight, format_id(local.fmt), dtype or weight.dtype)


# -- linear -----------------------------------------------------------------------


@torch.library.custom_op("dtensor_quant::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt_id: int) -> torch.Tensor:
    raise TypeError("dtensor_quant::linear expects a quantized weight; use torch.nn.functional.linear for dense ones")


@_linear.register_fake
def _linear_fake(x, weight, bias, fmt_id):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@implements("dtensor_quant::linear")
def _linear_local(func, x, weight, bias, fmt_id):
    if isinstance(x, QuantizedTensor) or isinstance(bias, QuantizedTensor) or not isinstance(weight, QuantizedTensor):
        raise TypeError("dtensor_quant::linear takes a dense input and bias and a quantized weight")
    _check_format(weight, fmt_id)
    return matmul.linear(x, weight.t(), bias)


def _setup_linear(ctx, inputs, output):
    _x, weight, bias, _fmt_id = inputs
    ctx.weight, ctx.has_bias = weight, bias is not None


def _linear_backward(ctx, grad):
    """Quantized weights are frozen: gradients flow to the input (``grad @ W``) and the bias only."""
    grad_x = grad @ ctx.weight
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return grad_x, None, grad_bias, None


_linear.register_autograd(_linear_backward, setup_context=_setup_linear)


@register_sharding(torch.ops.dtensor_quant.linear.default)
def _linear_sharding(x, weight, bias, fmt_id):
    """``F.linear``'s strategies, keeping only weight shardings the format's layout can hold.

    Column-parallel (weight Shard(0)) gives an output sharded on its last dim;
    row-parallel (weight Shard(1), input sharded on its last dim) gives
    partial sums; a replicated weight keeps any batch sharding of the input.
    """
    fmt, nd = format_from_id(fmt_id), len(x.shape)

    def with_bias(p):
        return p if bias is not None else None

    strategies = [([Replicate()], [Replicate(), Replicate(), with_bias(Replicate()), None])]
    strategies += [([Shard(d)], [Shard(d), Replicate(), with_bias(Replicate()), None]) for d in range(nd - 1)]
    if _holds(weight, fmt, Shard(0)):
        strategies.append(([Shard(nd - 1)], [Replicate(), Shard(0), with_bias(Shard(0)), None]))
    if _holds(weight, fmt, Shard(1)):
        strategies.append(([Partial()], [Shard(nd - 1), Shard(1), with_bias(Partial()), None]))
    return strategies


def _holds(weight, fmt: QuantFormat, placement) -> bool:
    """Whether the weight already has ``placement``, or the layout holds it on every mesh dim's size."""
    if placement in weight.placements:
        return True
    try:
        for n in weight.mesh.shape:
            check_placements(weight.shape, fmt, (n,), [placement])
    except LayoutError:
        return False
    return True


def linear_op():
    """The ``dtensor_quant::linear`` op overload (for the activation-statistics handler's table)."""
    return torch.ops.dtensor_quant.linear.default


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``dtensor_quant::linear``: ``x @ weight.T + bias`` for a quantized weight (or a DTensor of one)."""
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    if not isinstance(local, QuantizedTensor):
        raise TypeError(f"linear expects a quantized weight (or a DTensor of one), got {type(local).__name__}")
    if weight.requires_grad:
        raise ValueError("quantized weights are frozen: create them with requires_grad=False")
    return torch.ops.dtensor_quant.linear(x, weight, bias, format_id(local.fmt))


def _check_format(q: QuantizedTensor, fmt_id: int) -> None:
    if format_id(q.fmt) != fmt_id:
        raise ValueError(f"{describe(q)} passed with the id of {format_from_id(fmt_id)}")
