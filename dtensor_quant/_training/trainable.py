"""Trainable quantized weights: stored quantized, updated in place by any optimizer with stochastic rounding.

``dtensor_quant.quantize_(model, fmt, trainable=True)`` makes each Linear
weight a quantized parameter with ``requires_grad=True``. The forward reads
it like a frozen one (the format's kernel; under FSDP2 the stored bytes are
all-gathered and dequantized once per gather), the backward gives it a
dense gradient (``grad_out.T @ x`` does not depend on the weight), and the
optimizer's in-place ops requantize it (:mod:`dtensor_quant._training.pointwise`,
:mod:`dtensor_quant._training.fused`).

A local tensor -- the parameter itself on one process, a DTensor's shard
under FSDP2 or tensor parallelism -- does not know where it sits in its
weight, and a requantization needs that: the shards that share a statistic
(a row scale under a column shard) reduce it over the mesh, and the random
number of stochastic rounding is keyed by the element's *global* index. The
parameter knows: this module keeps, per trainable weight, its
:class:`TrainState` on the module that owns it (modules survive
``fully_shard``, ``parallelize_module`` and ``load_state_dict``; parameters
do not), and :func:`resolve` finds the owning parameter of a local tensor
(the module's current parameter, or its DTensor's local) and derives from it
a :class:`ShardLink`: the global shape, this shard's offsets, the reducer
``dtensor_quant.quantize`` would use for that placement, and the state.

The seed and the step. Element ``i`` of a weight at its ``k``-th
requantization rounds with the noise of (the weight's seed, ``k``, ``i``)
(:mod:`dtensor_quant._core.stochastic`); the weight's seed is derived from the seed
given to ``quantize_`` and its name in the model, so every weight has its
own. ``k`` counts the requantizations (every rank counts the same ones: an
in-place op runs on every shard, empty ones included). An optimizer that
updates trainable weights keeps each one's count in its *live* state,
``optimizer.state[param]["sr_step"]`` (a Python int, written after every
step), and so in every state dict made from it -- ``state_dict()``,
``get_optimizer_state_dict``, a framework's container that copies the live
keys -- and a count loaded into the live state by any route
(``load_state_dict``, ``set_optimizer_state_dict``, a direct assignment) is
adopted before the next step. A run resumed from a checkpoint therefore
rounds as the uninterrupted one would have (:func:`track` installs the hooks
on the optimizer at its first step).
"""

from __future__ import annotations

import weakref
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._core import stochastic
from .._core.format import QuantFormat, Reducer
from .._core.layout import LayoutError
from .._core.reductions import canonical_nans
from .._core.registry import provides
from .._core.tensor import QuantizedTensor
from .._ops import factories, writes  # noqa: F401  (factories declares the slot "trainable" provided here)
from .._ops.dequant import dequantize
from .._ops.layout_ops import block_sizes, canonical_dims, describe
from .._ops.unpack import dense_inner
from .._parallel.shard_quant import MeshReducer

STATE = "_dtensor_quant_trainable"  # on a module: {parameter name: TrainState}
LINK = "_dq_trainable_link"  # on a local QuantizedTensor: its ShardLink (derived once per tensor object)
SR_STEP = "sr_step"  # the optimizer state key of a trainable weight's requantization count


@dataclass
class TrainState:
    """A trainable weight's stochastic-rounding seed and how many times it was requantized.

    ``published``: the count last written into an optimizer's live state; a live value that differs
    from it was loaded there, and is adopted.
    """

    seed: int
    step: int = 0
    published: int | None = None


def supports_training(fmt: QuantFormat) -> bool:
    """Whether ``fmt`` rounds stochastically (``QuantFormat.quantize_stochastic``): trainable weights need it."""
    return type(fmt).quantize_stochastic is not QuantFormat.quantize_stochastic


def weight_seed(seed: int, name: str) -> int:
    """The seed of the weight called ``name`` in a model given ``seed``: the same on every rank and world size."""
    return ((seed & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode())


_OWNERS: weakref.WeakSet = weakref.WeakSet()  # modules that own trainable weights


def make_trainable(module: nn.Module, name: str, seed: int) -> TrainState:
    """Record ``module.<name>`` (a quantized parameter) as trainable with ``seed``."""
    state = TrainState(seed)
    module.__dict__.setdefault(STATE, {})[name] = state
    _OWNERS.add(module)
    _install_step_hook()
    return state


def trainable_names(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s own parameters that are trainable quantized weights."""
    return tuple(module.__dict__.get(STATE, {}))


# -- where a local tensor sits --------------------------------------------------------


class ShardLink:
    """A local tensor of a trainable weight: where it sits, how its statistics reduce, the weight's state."""

    def __init__(self, state: TrainState, global_shape, offsets, reducer: Reducer):
        self.state, self.global_shape, self.offsets, self.reducer = state, tuple(global_shape), tuple(offsets), reducer

    def dense(self, q: QuantizedTensor) -> torch.Tensor:
        """``q``'s values in float32 (the format's ``unpack`` straight from the stored tensors where it can)."""
        out = dense_inner(q.fmt, q.inner, block_sizes(q.rels), tuple(q.shape), torch.float32)
        return out if out is not None else dequantize(q, torch.float32)

    def noise(self, q: QuantizedTensor) -> stochastic.Noise:
        """The stochastic-rounding noise of this shard at the weight's current step."""
        return stochastic.Noise(
            self.state.seed, self.state.step, tuple(q.shape), self.offsets, self.global_shape, q.device
        )

    def requantize_(self, q: QuantizedTensor, dense: torch.Tensor) -> None:
        """Write ``dense`` (float32 values of ``q``'s shape) into ``q``'s inner tensors, stochastically rounded.

        The statistics are the format's, reduced over the shards that share
        them; then the step advances. Every rank holding a shard of the
        weight must call it (the reductions are collectives).
        """
        if q.ndim != 2 or q.dims != canonical_dims(2):
            raise LayoutError(f"{describe(q)}: only a whole [out, in] trainable weight (or its shard) updates in place")
        inner = q.fmt.quantize_stochastic(dense, self.reducer, self.noise(q), q.dtype)
        if inner is None:
            raise ValueError(f"{q.fmt} has no stochastic rounding (QuantFormat.quantize_stochastic): it cannot train")
        pairs = []
        for name in q.fmt.inner_names:
            dst, src = getattr(q, name), canonical_nans(inner[name])
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise LayoutError(
                    f"{describe(q)}: {q.fmt}.quantize_stochastic gave inner '{name}' {tuple(src.shape)}:{src.dtype}, "
                    f"the weight holds {tuple(dst.shape)}:{dst.dtype}"
                )
            pairs.append((dst, src))
        writes.write_inner(q, pairs)
        self.state.step += 1


@provides("trainable")  # asked by the factories (_ops/factories.py); this room calls it directly
def resolve(q: QuantizedTensor) -> ShardLink | None:
    """The link of ``q`` if it is (an alias of) a trainable weight or one of its shards, else None.

    Derived once per tensor object from the owning parameter: the module's
    parameter itself, or its DTensor (shape, mesh, placements).
    """
    link = q.__dict__.get(LINK)
    if link is not None:
        return link
    found = _owner(q)
    if found is None:
        return None
    outer, state = found
    link = q.__dict__[LINK] = _link_for(outer, q, state)
    return link


def _candidates():
    for module in list(_OWNERS):
        for name, state in module.__dict__.get(STATE, {}).items():
            outer = module._parameters.get(name)
            if outer is not None:
                yield outer, state


def _local(outer):
    return outer._local_tensor if isinstance(outer, DTensor) else outer


def _owner(q: QuantizedTensor):
    for outer, state in _candidates():  # the shard itself (what DTensor's ops and the optimizer pass)
        if _local(outer) is q:
            return outer, state
    if q.numel() == 0:  # empty shards share no bytes to recognise them by
        return None
    for outer, state in _candidates():  # an alias of it (``param.detach()``, ``param.data``)
        local = _local(outer)
        if isinstance(local, QuantizedTensor) and _same_bytes(local, q):
            return outer, state
    return None


def _same_bytes(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    if a.fmt != b.fmt or a.shape != b.shape or a.dims != b.dims or a.rels != b.rels:
        return False
    for name in a.fmt.inner_names:
        x, y = getattr(a, name), getattr(b, name)
        if (x.data_ptr(), x.shape, x.stride(), x.dtype) != (y.data_ptr(), y.shape, y.stride(), y.dtype):
            return False
    return True


def _link_for(outer, q: QuantizedTensor, state: TrainState) -> ShardLink:
    if not isinstance(outer, DTensor):
        return ShardLink(state, q.shape, (0,) * q.ndim, Reducer(q.shape))
    mesh, placements = outer.device_mesh, tuple(outer.placements)
    shape, offsets = compute_local_shape_and_global_offset(outer.shape, mesh, placements)
    if tuple(shape) != tuple(q.shape):
        raise LayoutError(
            f"{describe(q)}: the shard of a trainable {tuple(outer.shape)} weight under {list(placements)} "
            f"should be {tuple(shape)}"
        )
    return ShardLink(state, outer.shape, offsets, MeshReducer.for_mesh(q.fmt, outer.shape, mesh, placements))


# -- the requantization count in the optimizer's live state ------------------------------

_TRACKED: weakref.WeakSet = weakref.WeakSet()
_HOOK = []


def _install_step_hook() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(lambda opt, args, kwargs: track(opt)))
        _HOOK.append(register_optimizer_step_post_hook(lambda opt, args, kwargs: publish(opt)))


def _trainable_params(optimizer: torch.optim.Optimizer):
    """``(parameter, its TrainState)`` for every trainable quantized weight the optimizer updates."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = _local(p)
            if isinstance(local, QuantizedTensor):
                link = resolve(local)
                if link is not None:
                    yield p, link.state


def track(optimizer: torch.optim.Optimizer) -> None:
    """Keep the requantization count of the optimizer's trainable weights in its live state (idempotent).

    Called at every optimizer step (a global step pre-hook, installed with the
    first trainable weight) and by :mod:`dtensor_quant.optim`'s optimizers.
    A count found in the live state that this module did not write there (a
    resumed run: ``load_state_dict``, ``set_optimizer_state_dict``, a
    framework that copies live keys) is adopted first.
    """
    if optimizer not in _TRACKED:
        params = [p for p, _ in _trainable_params(optimizer)]
        if not params:
            return
        _refuse_repeated(params)
        _TRACKED.add(optimizer)
        optimizer.register_state_dict_post_hook(_save_steps)
        optimizer.register_load_state_dict_post_hook(_load_steps)
    _load_steps(optimizer)


def _refuse_repeated(params: list) -> None:
    """An optimizer that lists one trainable weight several times would update it that often a step, the others never.

    accelerate (1.16) does this when it prepares FSDP2: it swaps the optimizer's parameters for the sharded ones
    matching them by ``data_ptr()``, which is 0 for every tensor subclass (this library's, DTensor's), so every
    quantized weight maps to one of them. Refused at the first step, before any update.
    """
    seen: dict[int, int] = {}
    for p in params:
        seen[id(p)] = seen.get(id(p), 0) + 1
    repeated = [(p, seen[id(p)]) for p in {id(p): p for p in params}.values() if seen[id(p)] > 1]
    if repeated:
        p, n = repeated[0]
        raise ValueError(
            f"the optimizer lists a trainable quantized weight ({type(_local(p)).__name__} {list(p.shape)}) {n} "
            f"times ({len(params)} entries for {len(seen)} weights): it would update that weight {n} times a step "
            "and the others never. accelerate's FSDP2 preparation does this (it matches the optimizer's parameters to "
            "the sharded ones by data_ptr(), 0 for every tensor subclass); match them by identity instead, as "
            "docs/frameworks.md (transformers.Trainer + FSDP2) shows"
        )


def adopt(optimizer: torch.optim.Optimizer) -> None:
    """Take each trainable weight's count from the optimizer's live state where it was loaded there."""
    for p, state in _trainable_params(optimizer):
        live = optimizer.state.get(p, {}).get(SR_STEP)
        if live is not None and live != state.published:
            state.step = state.published = int(live)


def publish(optimizer: torch.optim.Optimizer) -> None:
    """Write each trainable weight's count into the live state (after a step; a step post-hook).

    Only into a state the optimizer has made, or for a weight it has
    requantized (a stateless optimizer, plain SGD): an optimizer that makes
    its state on a weight's first update (``if not state``) must find none.
    """
    if optimizer not in _TRACKED:
        return
    for p, state in _trainable_params(optimizer):
        live = optimizer.state.get(p)
        if live or state.step:
            optimizer.state[p][SR_STEP] = state.published = state.step


def _save_steps(optimizer, state_dict):
    adopt(optimizer)
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_param = {id(p): s for p, s in _trainable_params(optimizer)}
    for pid, p in zip(ids, params):
        state = by_param.get(id(p))
        if state is not None:  # a copy: state_dict()'s entries are the live state's dicts
            state_dict["state"][pid] = {**state_dict["state"].get(pid, {}), SR_STEP: state.step}
    return state_dict


def _load_steps(optimizer) -> None:
    adopt(optimizer)
    for p, _ in _trainable_params(optimizer):
        saved = optimizer.state.get(p)
        if saved is not None and set(saved) == {SR_STEP}:
            del optimizer.state[p]  # as if never stepped: optimizers initialize an empty state
