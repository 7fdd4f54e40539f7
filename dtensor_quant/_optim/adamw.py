"""AdamW with its moments kept quantized, in any format, for dense and trainable quantized parameters.

``exp_avg`` and ``exp_avg_sq`` are this library's QuantizedTensors (a
format of the user's choice; :class:`AdamW8bit` and :class:`AdamW4bit`
choose :class:`~dtensor_quant.BlockFloat8` / :class:`~dtensor_quant.BlockLog4`),
and, for a DTensor parameter, DTensors with the parameter's mesh and
placements. So everything the layout gives a weight, a state gets too:
``full_tensor()`` and ``redistribute`` of any placement, and DCP entries that
save in one layout and load in any other, bit for bit.

Which states are quantized is decided from the parameter's *global* shape
(at least 2-D, at least ``min_quantized_numel`` elements, a shape the format
holds) -- never from a rank's shard, so every rank and every world size
agree, and a checkpoint's states fit any layout. A placement the state's
format cannot cut (a column shard that splits a block) raises
:class:`~dtensor_quant.LayoutError` on every rank when the optimizer is made.

A step reads each state's local block as float32, runs AdamW's update there
and requantizes the block into the state's own bytes (rounding to nearest;
statistics shared across shards reduced over them, as ``dq.quantize`` of a
DTensor does). A trainable quantized parameter (``quantize_(...,
trainable=True)``) takes the whole update -- decay and step -- in one
stochastically rounded requantization; a dense one is updated in place in its
own dtype. Eager code throughout: nothing depends on ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .. import _formats as formats
from .._checkpoint.state_dict import (
    SPEC_KEY,
    CheckpointFormatError,
    from_entries,
    parse_spec,
    quantize_like,
    record_params,
    to_entries,
)
from .._core.format import QuantFormat, Reducer, check_shape
from .._core.layout import LayoutError
from .._core.reductions import canonical_nans
from .._core.stochastic import Noise
from .._core.tensor import QuantizedTensor
from .._formats.block_states import BlockFloat8, BlockLog4
from .._ops import writes
from .._ops.dequant import dequantize
from .._ops.layout_ops import block_sizes
from .._ops.unpack import dense_inner
from .._parallel.placements import check_placements, first_bad_cut
from .._parallel.shard_quant import MeshReducer, quantize_local
from .._training import trainable

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay) with ``exp_avg``/``exp_avg_sq`` stored in ``state_formats``.

    ``state_formats``: the formats of the first and second moment (the
    second one sees ``v``, never negative; ``None``: dense, in the parameter's
    dtype); ``min_quantized_numel``: smaller
    parameters (and 1-D ones: norms, biases) keep dense states in their own
    dtype, as ``torch.optim.AdamW`` does. ``seed`` keys the stochastic
    rounding of the moments (each parameter's and moment's own, from its
    position in ``param_groups``, the step and each element's global index).
    Not supported: ``amsgrad``, ``maximize``, ``fused``/``capturable``/``differentiable``
    (refused, also in a param group), sparse gradients; ``foreach`` selects nothing here.

    Per-group options: a param group may give its own ``lr``, ``betas``,
    ``eps``, ``weight_decay`` and ``state_formats`` (:class:`AdamW8bit` and
    :class:`AdamW4bit`: ``block_size``); any other key of a group is refused
    when the group is added (a learning-rate scheduler's keys, added later,
    are left alone).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_formats: tuple[QuantFormat | None, QuantFormat | None] = (
            BlockFloat8(256),
            BlockFloat8(256, nonnegative=True),
        ),
        min_quantized_numel: int = 4096,
        seed: int = 0,
    ):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if isinstance(min_quantized_numel, bool) or not isinstance(min_quantized_numel, int) or min_quantized_numel < 0:
            raise ValueError(f"AdamW: min_quantized_numel must be an integer >= 0, got {min_quantized_numel!r}")
        self.state_formats = _two_formats(state_formats)
        self.min_quantized_numel = min_quantized_numel
        self.seed = seed
        self._reducers: dict = {}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **self._format_defaults())
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(_states_to_entries)
        self.register_load_state_dict_pre_hook(_entries_to_states)
        trainable.track(self)

    # -- per-group options -----------------------------------------------------------

    _REFUSED = ("amsgrad", "maximize", "fused", "capturable", "differentiable")

    def _format_defaults(self) -> dict:
        """The group keys that choose the state formats, with this optimizer's values."""
        return {"state_formats": self.state_formats}

    def group_formats(self, group: dict) -> tuple[QuantFormat | None, QuantFormat | None]:
        """The moments' formats of the parameters of ``group`` (its own options, else the optimizer's)."""
        return _two_formats(group.get("state_formats", self.state_formats))

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, refusing options this optimizer would otherwise ignore silently."""
        known = {"params", "param_names", "lr", "betas", "eps", "weight_decay", "foreach", *self._format_defaults()}
        for key in self._REFUSED:
            if param_group.get(key):
                raise ValueError(f"{type(self).__name__}: {key}=True is not supported (in a param group)")
        unknown = sorted(k for k in param_group if k not in known and k not in self._REFUSED)
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: param group options {unknown} are not options of this optimizer; "
                f"a group may set {sorted(known - {'params', 'param_names', 'foreach'})}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.pop("foreach", None)
        for p in group["params"]:
            self._check(p, self.group_formats(group))

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("AdamW: the parameter is not in any of this optimizer's param groups")

    # -- which states are quantized (the global shape decides) ---------------------

    def quantizes(self, p: torch.Tensor, fmt: QuantFormat | None) -> bool:
        """Whether ``p``'s state in ``fmt`` is quantized: from ``p``'s global shape only (never for ``None``)."""
        if fmt is None or p.ndim < 2 or p.numel() < self.min_quantized_numel or not p.dtype.is_floating_point:
            return False
        try:
            check_shape(fmt, tuple(p.shape))
        except ValueError:
            return False
        return True

    def _check(self, p: torch.Tensor, formats) -> None:
        if p.is_complex():
            # the step reads gradients as float32 (.float() drops the imaginary part): refused, not silently wrong
            raise ValueError(
                f"AdamW: complex parameters ({p.dtype}, {tuple(p.shape)}) are not supported; optimize "
                "torch.view_as_real(p) as a real parameter, or use torch.optim.AdamW"
            )
        local = _local(p)
        if isinstance(local, QuantizedTensor) and trainable.resolve(local) is None:
            raise ValueError(
                f"AdamW: a frozen quantized parameter ({local.fmt}, {tuple(p.shape)}) cannot be updated; make it "
                "trainable with dtensor_quant.quantize_(..., trainable=True), or leave it out of the optimizer"
            )
        if isinstance(p, DTensor):
            for fmt in formats:
                if self.quantizes(p, fmt):
                    try:
                        check_placements(tuple(p.shape), fmt, tuple(p.device_mesh.shape), list(p.placements))
                    except LayoutError as e:
                        raise LayoutError(f"{e}{_block_size_hint(p, fmt)}") from None

    # -- states ----------------------------------------------------------------------

    def _new_state(self, p: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
        if not self.quantizes(p, fmt):
            return torch.zeros_like(p, memory_format=torch.preserve_format)  # dense, also for a quantized p
        local = _local(p)
        zeros = torch.zeros(local.shape, dtype=p.dtype, device=local.device)
        q = quantize_local(fmt, zeros, Reducer(p.shape), tuple(p.shape))  # zeros: nothing to reduce
        if not isinstance(p, DTensor):
            return q
        return DTensor.from_local(q, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def _init_state(self, p: torch.Tensor, group: dict | None = None) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key, fmt in zip(_MOMENTS, self.group_formats(group or self._group_of(p))):
                state[key] = self._new_state(p, fmt)
        return state

    def _place(self, state: torch.Tensor, fmt: QuantFormat) -> tuple[Reducer, tuple[int, ...]]:
        """``(the reducer quantize would use for this state's placement, its local block's global offsets)``."""
        if not isinstance(state, DTensor):
            return Reducer(state.shape), (0,) * state.ndim
        key = (id(state), fmt)
        cached = self._reducers.get(key)
        if cached is None or cached[0] is not state:
            mesh, placements = state.device_mesh, tuple(state.placements)
            _, offsets = compute_local_shape_and_global_offset(state.shape, mesh, placements)
            reducer = MeshReducer.for_mesh(fmt, state.shape, mesh, placements)
            cached = self._reducers[key] = (state, (reducer, tuple(offsets)))
        return cached[1]

    @staticmethod
    def _read(state: torch.Tensor) -> torch.Tensor:
        local = _local(state)
        if isinstance(local, QuantizedTensor):
            out = dense_inner(local.fmt, local.inner, block_sizes(local.rels), tuple(local.shape), torch.float32)
            return out if out is not None else dequantize(local, torch.float32)
        return local.float()

    def _write(self, state: torch.Tensor, fmt: QuantFormat, values: torch.Tensor, seed: int, step: int) -> None:
        """Requantize float32 ``values`` into the state's own bytes, with the format's statistics.

        Stochastically rounded where the format can (keyed by ``seed``, the
        step and each element's index in the whole state, so any sharding gives
        the same bytes): a moving average whose every step is smaller than half
        a code would otherwise stop moving, or drift.
        """
        local = _local(state)
        if not isinstance(local, QuantizedTensor):
            local.copy_(values)
            return
        reduce, offsets = self._place(state, fmt)
        if values.ndim == 2:
            inner = None
            if trainable.supports_training(fmt):
                noise = Noise(seed, step, tuple(values.shape), offsets, tuple(state.shape), values.device)
                inner = fmt.quantize_stochastic(values, reduce, noise, local.dtype)
            inner = inner if inner is not None else fmt.quantize(values, reduce)
            pairs = [(getattr(local, n), canonical_nans(inner[n])) for n in local.fmt.inner_names]
        else:  # a stack of matrices (experts): the library's per-matrix math
            fresh = quantize_local(fmt, values, reduce, tuple(state.shape))
            pairs = [(getattr(local, n), getattr(fresh, n)) for n in local.fmt.inner_names]
        writes.write_inner(local, pairs)

    def moment_seeds(self, index: int) -> tuple[int, int]:
        """The stochastic-rounding seeds of the two moments of the ``index``-th parameter (in param_groups order)."""
        return tuple(trainable.weight_seed(self.seed, f"adamw.{index}.{key}") for key in _MOMENTS)

    # -- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            formats = self.group_formats(group)
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AdamW: sparse gradients are not supported")
                state = self._init_state(p, group)
                state["step"] += 1
                t = state["step"].item()
                grad = p.grad
                if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                    grad = grad.redistribute(p.device_mesh, p.placements)
                g = _local(grad).float()
                m, v = self._read(state["exp_avg"]), self._read(state["exp_avg_sq"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                seeds = self.moment_seeds(index)
                self._write(state["exp_avg"], formats[0], m, seeds[0], int(t))
                self._write(state["exp_avg_sq"], formats[1], v, seeds[1], int(t))
                if lr == 0:
                    continue  # the update is zero: the parameter's bytes stay as they are
                denom = v.sqrt_().div_(math.sqrt(1 - beta2**t)).add_(eps)
                self._update(p, m, denom, lr, decay, lr / (1 - beta1**t))
        return loss

    @staticmethod
    def _update(p, m, denom, lr, decay, step_size) -> None:
        local = _local(p)
        if isinstance(local, QuantizedTensor):  # one stochastically rounded requantization per step
            link = trainable.resolve(local)
            dense = link.dense(local)
            dense.mul_(1 - lr * decay).addcdiv_(m, denom, value=-step_size)
            link.requantize_(local, dense)
        elif local.dtype == torch.float32:
            local.mul_(1 - lr * decay).addcdiv_(m, denom, value=-step_size)
        else:  # bf16/fp16: in float32, rounded once (a mixed-dtype in-place op is a slow path of its own)
            local.copy_(local.float().mul_(1 - lr * decay).addcdiv_(m, denom, value=-step_size))


class _BlockStates(AdamW):
    """AdamW whose two moments are one block format (``FORMAT``) of ``block_size`` values per scale;
    a param group may give its own ``block_size``."""

    FORMAT: type = BlockFloat8

    def __init__(self, params, lr, betas, eps, weight_decay, *, block_size, min_quantized_numel, seed):
        self.block_size = block_size
        super().__init__(params, lr, betas, eps, weight_decay, state_formats=self._formats(block_size),
                         min_quantized_numel=min_quantized_numel, seed=seed)  # fmt: skip

    def _formats(self, block_size: int) -> tuple[QuantFormat, QuantFormat]:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"{type(self).__name__}: block_size must be a positive int, got {block_size!r}")
        return self.FORMAT(block_size), self.FORMAT(block_size, nonnegative=True)

    def _format_defaults(self) -> dict:
        return {"block_size": self.block_size}

    def group_formats(self, group: dict) -> tuple[QuantFormat, QuantFormat]:
        return self._formats(group.get("block_size", self.block_size))


class AdamW8bit(_BlockStates):
    """:class:`AdamW` with both moments in :class:`~dtensor_quant.BlockFloat8`: 8-bit codes, a float32 scale per
    ``block_size`` values of a row (e4m3 for the first moment, e5m2 for the second)."""

    FORMAT = BlockFloat8

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, block_size=256,
                 min_quantized_numel=4096, seed=0):  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, block_size=block_size,
                         min_quantized_numel=min_quantized_numel, seed=seed)  # fmt: skip


class AdamW4bit(_BlockStates):
    """:class:`AdamW` with both moments in :class:`~dtensor_quant.BlockLog4`: 4-bit codes on a power-of-two grid,
    a float32 scale per ``block_size`` values of a row."""

    FORMAT = BlockLog4

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, block_size=128,
                 min_quantized_numel=4096, seed=0):  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, block_size=block_size,
                         min_quantized_numel=min_quantized_numel, seed=seed)  # fmt: skip


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's checks (each a number in range), with one message naming the bad ones."""

    def at_least_zero(x) -> bool:
        number = isinstance(x, (int, float)) and not isinstance(x, bool)
        return (number or (isinstance(x, torch.Tensor) and x.numel() == 1)) and 0.0 <= x

    bad = [f"{name}={value!r}" for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay))
           if not at_least_zero(value)]  # fmt: skip
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(at_least_zero(b) and b < 1 for b in betas)):
        bad.append(f"betas={betas!r}")
    if bad:
        raise ValueError(
            f"AdamW: invalid {', '.join(bad)}: lr, eps and weight_decay are numbers >= 0, betas two numbers in [0, 1)"
        )


def _two_formats(formats) -> tuple:
    if isinstance(formats, (str, dict)) or not hasattr(formats, "__iter__"):
        raise ValueError(
            f"AdamW: state_formats is a pair (format or None for exp_avg, for exp_avg_sq), e.g. "
            f"(dtensor_quant.BlockFloat8(256), None); got {formats!r}"
        )
    formats = tuple(formats)
    if len(formats) != 2:
        raise ValueError(f"AdamW: state_formats holds one format per moment (2), got {len(formats)}")
    for fmt in formats:
        if fmt is not None and not isinstance(fmt, QuantFormat):
            raise ValueError(f"AdamW: state_formats holds a format instance or None per moment, got {fmt!r}")
    return formats


def _block_size_hint(p: DTensor, fmt: QuantFormat) -> str:
    """`` Use block_size=b ...``: the largest smaller block size of ``fmt`` this placement can cut, if any."""
    size = getattr(fmt, "block_size", None)
    if not isinstance(size, int) or not dataclasses.is_dataclass(fmt):
        return ""
    shape, mesh_shape, placements = tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements)
    for b in range(size - 1, 0, -1):
        smaller = dataclasses.replace(fmt, block_size=b)
        try:
            check_shape(smaller, shape)
        except ValueError:
            continue
        if first_bad_cut(shape, smaller, mesh_shape, placements) is None:
            return (
                f" The optimizer's moments of this {shape} parameter need a block size its shards can cut: "
                f"block_size={b} works (the optimizer's block_size=..., or a param group's 'block_size')."
            )
    return ""


# -- state dicts: quantized states as DCP entries --------------------------------------------


def _param_ids(optimizer, state_dict) -> list[tuple[object, torch.Tensor]]:
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return list(zip(ids, params))


def _states_to_entries(optimizer: AdamW, state_dict: dict) -> dict:
    """Each quantized moment as its entries (one tensor per inner tensor plus ``__quant__``), aliasing it."""
    states = dict(state_dict["state"])
    for pid, _ in _param_ids(optimizer, state_dict):
        per = states.get(pid)
        if per is None or not any(_is_quantized(per.get(k)) for k in _MOMENTS):
            continue
        states[pid] = {k: to_entries(v, k) if k in _MOMENTS and _is_quantized(v) else v for k, v in per.items()}
    state_dict["state"] = states
    return state_dict


def _entries_to_states(optimizer: AdamW, state_dict: dict) -> dict:
    """Moments back into this optimizer's own state formats (any placement), whatever form they were saved in.

    Saved in this optimizer's format: the stored bytes, bit for bit. Saved in
    another one (another ``state_formats``, or a ``min_quantized_numel`` that
    kept the moment dense there and quantizes it here, or the reverse): the
    saved values are read exactly and stored in this optimizer's format --
    what every step does to a moment anyway (read it as float32, write it
    back in its format), so resuming under other settings loses no more than
    a step does. A moment that cannot be read (an unknown format, another
    shape) is refused naming the parameter. The loading optimizer's own format
    options (``state_formats``, ``block_size``) stay in its param groups:
    torch's ``load_state_dict`` would otherwise take the saved groups' values,
    and the next step would write moments in formats they are no longer in.
    """
    keys = tuple(optimizer._format_defaults())
    groups = [
        {**saved, **{k: mine[k] for k in keys if k in mine}}
        for saved, mine in zip(state_dict["param_groups"], optimizer.param_groups)
    ]
    states = dict(state_dict["state"])
    for pid, p in _param_ids(optimizer, state_dict):
        per = states.get(pid)
        if per is None:
            continue
        per = dict(per)
        for key, fmt in zip(_MOMENTS, optimizer.group_formats(optimizer._group_of(p))):
            saved = per.get(key)
            plain = isinstance(saved, torch.Tensor) and not _is_quantized(saved)
            if saved is None or (plain and not optimizer.quantizes(p, fmt)):
                continue  # dense into dense: torch's own load_state_dict casts and places it
            name = f"the optimizer state {key!r} of parameter {pid!r} (shape {tuple(p.shape)})"
            per[key] = _moment_into(saved, optimizer._init_state(p)[key], name)
        states[pid] = per
    state_dict = dict(state_dict)
    state_dict["state"] = states
    if len(groups) == len(state_dict["param_groups"]):  # else torch's load_state_dict refuses the mismatch
        state_dict["param_groups"] = groups
    return state_dict


def _moment_into(saved, mine: torch.Tensor, name: str):
    """``saved`` (entries, a dense tensor or a quantized one) as a value in ``mine``'s format and placement."""
    ours = _local(mine).fmt if _is_quantized(mine) else None
    if isinstance(saved, Mapping):
        if SPEC_KEY not in saved:
            raise CheckpointFormatError(
                f"{name}: the saved moment is a dict without a {SPEC_KEY} record: {sorted(saved)}"
            )
        record = parse_spec(saved[SPEC_KEY], name)
        if (
            ours is not None
            and record.get("format") == type(ours).__name__
            and record.get("params") == record_params(ours)
        ):
            return from_entries(saved, mine, name)  # the stored bytes
        dense = _dense_of_entries(saved, record, name)
    elif _is_quantized(saved):
        if ours is not None and _local(saved).fmt == ours and _is_dtensor(saved) == _is_dtensor(mine):
            return saved
        dense = saved.full_tensor() if isinstance(saved, DTensor) else saved
        dense = dequantize(dense, torch.float32)
    elif isinstance(saved, torch.Tensor):
        if ours is None:
            return saved
        dense = saved.full_tensor() if isinstance(saved, DTensor) else saved
    else:
        raise CheckpointFormatError(f"{name}: a moment is a tensor or its entries, got {type(saved).__name__}")
    if tuple(dense.shape) != tuple(mine.shape):
        raise CheckpointFormatError(
            f"{name}: the saved moment has shape {tuple(dense.shape)}, the parameter {tuple(mine.shape)}"
        )
    if ours is not None:
        return quantize_like(dense, mine, name)
    dense = dense.to(mine.dtype)
    if isinstance(mine, DTensor):
        return distribute_tensor(dense, mine.device_mesh, mine.placements, src_data_rank=None)
    return dense


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def _dense_of_entries(entries: Mapping, record: dict, name: str) -> torch.Tensor:
    """The float32 values of a moment saved as entries of any built-in format (exact: a dequantization)."""
    fmt = _format_of(record, name)
    try:
        shape, dtype = tuple(int(n) for n in record["shape"]), getattr(torch, str(record["dtype"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointFormatError(
            f"{name}: the {SPEC_KEY} record's shape/dtype are damaged: {record.get('shape')!r}, {record.get('dtype')!r}"
        ) from None
    like = quantize_local(fmt, torch.zeros(shape, dtype=dtype), Reducer(shape), shape)
    return dequantize(from_entries(entries, like, name), torch.float32)


def _format_of(record: dict, name: str) -> QuantFormat:
    """The built-in format a ``__quant__`` record names, rebuilt from its parameters (exactly, or refused)."""
    cls = getattr(formats, str(record.get("format")), None)
    params = record.get("params")
    if cls is None or not isinstance(params, dict):
        raise CheckpointFormatError(
            f"{name}: the saved moment's format {record.get('format')!r} ({record.get('description')!r}) is "
            f"not one this optimizer can read; built-in ones: {', '.join(formats.__all__)}"
        )
    args = {k: getattr(torch, v.removeprefix("torch.")) if isinstance(v, str) and v.startswith("torch.") else v
            for k, v in params.items()}  # fmt: skip
    try:
        fmt = cls(**args)
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointFormatError(
            f"{name}: cannot rebuild {record.get('description')!r} from its record ({e})"
        ) from None
    if record_params(fmt) != params:
        raise CheckpointFormatError(f"{name}: {fmt} does not reproduce the record's parameters {params}")
    return fmt


def _is_quantized(value) -> bool:
    return isinstance(value, torch.Tensor) and isinstance(_local(value), QuantizedTensor)
