"""Trainable high-precision weights that FSDP2 all-gathers quantized (any format).

Like ZeRO++'s quantized weights or torchao's float8 all-gather, but for any
:class:`~dtensor_quant.QuantFormat`: the optimizer updates a high-precision
master shard, and FSDP2 moves only quantized bytes. Before each all-gather,
every rank quantizes its own shard; a statistic whose block spans shards (a
per-tensor scale, say) is all-reduced over the FSDP2 mesh first
(:class:`~dtensor_quant._parallel.shard_quant.MeshReducer`), so the gathered weight is
bit-identical to quantizing the whole master. The rest is the frozen path
(:mod:`dtensor_quant.fsdp`): the gathered weight is a QuantizedTensor that the
forward uses through the format's kernel.

The gradient is straight-through: autograd's gradient for the gathered
weight is dense (``grad_out.T @ x``, it does not depend on the weight), FSDP2
reduce-scatters it and the optimizer applies it to the master.

Outside FSDP2 the wrapper behaves the same way on one process: a matmul with
it quantizes the whole master first. So a model trained with FSDP2 and the
same model on one process compute the same thing, which is what the tests
compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import Shard

from .._core import notes as rules
from .._core.dispatch import flat_args
from .._core.format import QuantFormat, Reducer
from .._core.tensor import QuantizedTensor
from .._parallel.shard_quant import MeshReducer, agree_before_reducing, quantize_local
from .all_gather import hook_for, post_all_gather

aten = torch.ops.aten

# Ops whose result is still this weight (or a piece of it): FSDP2's sharding,
# padding and copies, the views autograd and DTensor take.
_KEEP = {
    "aten::detach",
    "aten::alias",
    "aten::view",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::slice",
    "aten::split",
    "aten::split_with_sizes",
    "aten::new_zeros",
    "aten::new_empty",
    "aten::empty_like",
    "aten::clone",
    "aten::_to_copy",
    "aten::_pin_memory",
}


# Results that are this very shard (an alias or a device copy): they keep its padded rows.
_ALIASES = {"aten::detach", "aten::alias", "aten::view", "aten::as_strided", "aten::_to_copy", "aten::_pin_memory"}


class GatherQuantized(torch.Tensor):
    """A dense master weight ``[out, in]`` whose FSDP2 all-gather (and matmul) is quantized in ``fmt``.

    ``quant_dtype``: the dtype the master is cast to before quantizing (the
    dtype of the scales on the wire); default the master's own. Set it to the
    mixed-precision ``param_dtype`` to keep scales as small as the weight.
    ``full_shape`` is the whole weight's (a shard's layout may depend on it,
    and a short FSDP2 shard cannot infer it); default ``data``'s.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, fmt: QuantFormat, quant_dtype=None, transposed=False, full_shape=None, tp_axes=()
    ):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data, fmt, quant_dtype=None, transposed=False, full_shape=None, tp_axes=()):
        self._data, self.fmt, self.quant_dtype, self.transposed = data, fmt, quant_dtype, transposed
        self.full_shape = tuple(full_shape) if full_shape is not None else tuple(data.shape)
        # (logical dim, process group name) per tensor-parallel mesh dim sharding this weight, set by
        # dtensor_quant.fsdp.fully_shard: statistics are all-reduced over those groups too.
        self.tp_axes = tuple(tp_axes)
        # FSDP2's padded rows, as a quantized shard records them (dtensor_quant._core.notes).
        self.notes = rules.Notes(None)

    def __repr__(self, *, tensor_contents=None):
        return f"GatherQuantized({self.fmt}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self.fmt, self.quant_dtype, self.transposed, self.full_shape, self.tp_axes)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return GatherQuantized(inner["_data"], *ctx)

    def like(self, data: torch.Tensor, transposed: bool | None = None) -> GatherQuantized:
        transposed = self.transposed if transposed is None else transposed
        return GatherQuantized(data, self.fmt, self.quant_dtype, transposed, self.full_shape, self.tp_axes)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in ("aten::mm", "aten::addmm"):
            # One process: the forward uses the quantized weight, as under FSDP2.
            args = [a.quantized() if isinstance(a, GatherQuantized) else a for a in args]
            return func(*args, **kwargs)
        if name in ("aten::t", "aten::transpose"):
            w = args[0]
            return w.like(func(w._data, *args[1:], **kwargs), transposed=not w.transposed)
        raw = func(*_unwrap(args), **_unwrap(kwargs))
        if name.endswith("_") and args and isinstance(args[0], GatherQuantized):
            return args[0]  # in place (copy_, the optimizer's ops): the master changed
        if name not in _KEEP:
            return raw
        w = next(a for a in flat_args(args, kwargs) if isinstance(a, GatherQuantized))
        out = _rewrap(w, raw)
        if name == "aten::slice":  # FSDP2 narrows its padded shard: the same rules as a quantized slice
            dim, start, stop = _narrow_of(w, *args[1:], **kwargs)
            out.notes = rules.sliced(w.notes, (), w.shape[dim], dim, start, stop)
        elif name in _ALIASES and isinstance(out, GatherQuantized):
            out.notes = rules.alias(w.notes) if out.shape == w.shape else rules.Notes(None)
        return out

    # -- quantizing ----------------------------------------------------------
    def quantized(self, reduce: Reducer | None = None) -> QuantizedTensor:
        """The master (this shard of it, with ``reduce`` over the shards) quantized in ``fmt``."""
        w = self._data.t() if self.transposed else self._data
        w = w.detach().to(self.quant_dtype or w.dtype)
        q = quantize_local(self.fmt, w, reduce or Reducer(self.full_shape), self.full_shape)
        return q.t() if self.transposed else q

    # -- FSDP2 ----------------------------------------------------------------
    @property
    def fsdp_pre_all_gather(self):
        return hook_for(self, self._quantized_shard, dense=False)

    def _quantized_shard(self, mesh) -> QuantizedTensor:
        if mesh.size() > 1:
            group = mesh.get_group(mesh.ndim - 1).group_name
            agree_before_reducing(self.fmt, self._data, [0], [group], list(self.full_shape))
        reduce = MeshReducer.for_mesh(self.fmt, self.full_shape, mesh, [Shard(0)])
        reduce.axes += list(self.tp_axes)  # a tensor-parallel shard: its statistics span the TP group too
        q = self.quantized(reduce)
        q.notes = rules.stands_for(self.notes, q.notes)
        return q

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return post_all_gather(outputs, metadata, param_dtype, out=out)


def _unwrap(obj):
    if isinstance(obj, GatherQuantized):
        return obj._data
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v) for k, v in obj.items()}
    return obj


def _rewrap(w: GatherQuantized, raw):
    if isinstance(raw, torch.Tensor):
        return w.like(raw)
    if isinstance(raw, (list, tuple)):
        return type(raw)(_rewrap(w, r) for r in raw)
    return raw


def _narrow_of(w: GatherQuantized, dim=0, start=None, end=None, step=1) -> tuple[int, int, int]:
    """``(dim, start, stop)`` of an ``aten::slice`` of ``w``, resolved as ``w[start:end]`` would."""
    dim %= w.ndim
    length = w.shape[dim]

    def resolve(i, default):
        i = default if i is None else i
        return min(max(i + length if i < 0 else i, 0), length)

    start = resolve(start, 0)
    return dim, start, max(resolve(end, length), start)


def gather_quantized_(
    model: nn.Module,
    fmt: QuantFormat,
    quant_dtype: torch.dtype | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Wrap every ``nn.Linear`` weight (``filter_fn(module, fqn)`` picks) so FSDP2 gathers it quantized.

    Call before ``fully_shard``. The weights stay trainable in their own
    dtype; raises ``ValueError`` naming the module if ``fmt`` cannot hold one.
    """
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or (filter_fn is not None and not filter_fn(module, fqn)):
            continue
        w = module.weight
        try:
            fmt.check_weight(w.shape, quant_dtype or w.dtype)
        except ValueError as e:
            raise type(e)(f"{fqn}.weight: {e}") from None
        module.weight = nn.Parameter(GatherQuantized(w.detach(), fmt, quant_dtype), requires_grad=w.requires_grad)
    return model
