"""Pointwise arithmetic on trainable quantized weights: the ops every optimizer issues on its parameters.

``torch.optim`` updates a parameter with pointwise in-place ops (``mul_``,
``add_``, ``addcdiv_``, ``lerp_``, or their ``_foreach_`` forms on lists of
parameters) and reads it in out-of-place ones (``grad.add(param,
alpha=weight_decay)``). On a frozen quantized weight every one of them is
refused, as before: its bytes are not numbers. A weight made trainable
(``dtensor_quant.quantize_(..., trainable=True)``) gets one rule for all of
them, whatever the op and the format:

* an in-place op on it dequantizes the local block to float32, applies the
  op itself to that copy (its other tensor operands in float32 too), and
  requantizes the result into the weight's own inner tensors with the
  format's statistics -- reduced over the shards that share them, as
  ``dtensor_quant.quantize`` of a DTensor does -- and stochastic rounding keyed
  by the weight's seed, its requantization count and each element's global
  index (:mod:`dtensor_quant._training.trainable`, :mod:`dtensor_quant._core.stochastic`);
* read as an operand, it is its dense values in its logical dtype: the
  result is a dense tensor, as it would be for a dense parameter.

An in-place op whose scalar arguments make it the identity (``mul_(1)``,
``add_(x, alpha=0)``: what a zero learning rate issues, e.g. in the step
``torch.distributed.checkpoint.state_dict`` runs to create the optimizer's
states) leaves the bytes as they are: every rank decides that from the
arguments alone, so no rank requantizes (and reduces statistics) alone.

This is the one handler of every pointwise op on a quantized tensor,
registered in the op table by kind (``fallback``) on import, as DTensor's
``_ops`` register their rules. So it also serves an in-place
initialisation while it is open (:mod:`dtensor_quant._ops.init`: ``nn.init``'s
pointwise sequence runs on the dense values of the initialisation, frozen
weight or trainable), and hands those ops to that module first. Which weights
are trainable it asks :func:`dtensor_quant._training.trainable.resolve`
directly (the link: ``dense(q)``, its float32 values, and
``requantize_(q, values)``); the layers below ask the slot ``"trainable"``.
"""

from __future__ import annotations

import torch

from .._core.dispatch import KEEPS_INITIAL, fallback, flat_args, refusal
from .._core.tensor import QuantizedTensor
from .._ops.dequant import dequantize
from .._ops.init import continue_open, initial_values
from .trainable import resolve

_HINT = (
    " A weight trained in place is made with dtensor_quant.quantize_(model, fmt, trainable=True): "
    "its optimizer updates requantize it with stochastic rounding."
)


def _is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags or func._schema.name.startswith("aten::_foreach_")


def _writes_first(func) -> bool:
    info = func._schema.arguments[0].alias_info
    return info is not None and info.is_write


@fallback(_is_pointwise)
def _pointwise(func, *args, **kwargs):
    if func._schema.name.startswith("aten::_foreach_"):
        return _foreach(func, args, kwargs)
    if _writes_first(func) and isinstance(args[0], QuantizedTensor):
        opened = initial_values(args[0])
        if opened is not None:  # an initialisation going on (_ops/init.py): on its dense values
            _check_readable(func, args[1:], kwargs)
            return continue_open(func, args[0], opened, args[1:], kwargs, _read)
        return _update(func, args, kwargs)
    _check_readable(func, args, kwargs)
    return func(*_read(args), **_read(kwargs))


KEEPS_INITIAL.add(_pointwise)


def _link(func, q, args, kwargs):
    link = resolve(q)
    if link is None:
        raise refusal(func, args, kwargs, _HINT)
    return link


def _check_readable(func, args, kwargs) -> None:
    """Quantized operands must be trainable weights; a written one must be the op's ``self``."""
    written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    for a in flat_args(args, kwargs):
        if isinstance(a, QuantizedTensor) and initial_values(a) is None:
            _link(func, a, args, kwargs)
    for name in written:
        if isinstance(kwargs.get(name), QuantizedTensor):
            raise refusal(func, args, kwargs, " Only a trainable weight that is the op's own tensor updates in place.")


def _read(obj, dtype: torch.dtype | None = None):
    """Quantized tensors as their dense values (``dtype``, default the logical one); with ``dtype``,
    dense floating tensors cast to it too (ops like ``lerp_`` want one dtype). A tensor being
    initialised reads as the dense values of its initialisation (_ops/init.py)."""
    if isinstance(obj, QuantizedTensor):
        opened = initial_values(obj)
        if opened is not None:
            return opened if dtype is None or opened.dtype == dtype else opened.to(dtype)
        return dequantize(obj, dtype or obj.dtype)
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if dtype is not None and obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_read(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _read(v, dtype) for k, v in obj.items()}
    return obj


def _update(func, args, kwargs):
    """``func`` in place on trainable ``q = args[0]``: on its float32 values, then requantized into it."""
    q = args[0]
    link = _link(func, q, args, kwargs)
    for a in flat_args(args[1:], kwargs):
        if isinstance(a, QuantizedTensor):
            _link(func, a, args, kwargs)
    if _identity(func, args, kwargs):
        return q
    with torch.no_grad():
        dense = link.dense(q)
        func(dense, *_read(args[1:], torch.float32), **_read(kwargs, torch.float32))
        link.requantize_(q, dense)
    return q


# -- the identity: scalar arguments that make an update change nothing ------------------

# op (schema name) -> (argument, value that makes it the identity): a zero learning rate's ops.
_NEUTRAL = {
    "aten::mul_": ("other", 1),
    "aten::div_": ("other", 1),
    "aten::add_": ("alpha", 0),
    "aten::sub_": ("alpha", 0),
    "aten::addcdiv_": ("value", 0),
    "aten::addcmul_": ("value", 0),
    "aten::lerp_": ("weight", 0),
    "aten::_foreach_mul_": ("scalar", 1),
    "aten::_foreach_div_": ("scalar", 1),
    "aten::_foreach_add_": ("alpha", 0),
    "aten::_foreach_sub_": ("alpha", 0),
    "aten::_foreach_addcdiv_": ("value", 0),
    "aten::_foreach_addcmul_": ("value", 0),
    "aten::_foreach_lerp_": ("weight", 0),
}


_NEUTRAL_ARG: dict = {}  # op -> (argument name, its position, its default, the neutral value) or None


def _neutral_arg(func):
    if func not in _NEUTRAL_ARG:
        entry, found = _NEUTRAL.get(func._schema.name), None
        if entry is not None:
            arg, neutral = entry
            names = [a.name for a in func._schema.arguments]
            for name in (arg, {"scalar": "scalars", "value": "scalars"}.get(arg)):
                if name is not None and name in names:
                    i = names.index(name)
                    found = (name, i, func._schema.arguments[i].default_value, neutral)
                    break
        _NEUTRAL_ARG[func] = found
    return _NEUTRAL_ARG[func]


def _identity(func, args, kwargs) -> bool:
    found = _neutral_arg(func)
    if found is None:
        return False
    name, i, default, neutral = found
    value = kwargs.get(name, args[i] if i < len(args) else default)
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(not isinstance(v, torch.Tensor) and v == neutral for v in value)
    return value == neutral


# -- _foreach_ ops: lists of parameters, some quantized ----------------------------------


def _per_tensor(func) -> list[bool]:
    """Which arguments hold one entry per tensor of the list: ``Tensor[]``, ``Scalar[]`` and ``Tensor scalars``."""
    return [
        isinstance(a.type, torch.ListType) or (a.name == "scalars" and isinstance(a.type, torch.TensorType))
        for a in func._schema.arguments
    ]


def _pick(func, args, kwargs, positions: list[int]):
    """The op's arguments for the list entries at ``positions`` only."""
    names, per = [a.name for a in func._schema.arguments], _per_tensor(func)

    def take(value, per_tensor):
        if not per_tensor or value is None:
            return value
        if isinstance(value, torch.Tensor):
            return value[positions]
        return [value[i] for i in positions]

    out_args = [take(v, per[i]) for i, v in enumerate(args)]
    out_kwargs = {k: take(v, per[names.index(k)]) for k, v in kwargs.items()}
    return out_args, out_kwargs


def _foreach(func, args, kwargs):
    selfs = args[0]
    mine = [i for i, t in enumerate(selfs) if isinstance(t, QuantizedTensor)]
    if not (_writes_first(func) and mine):
        _check_readable(func, args, kwargs)
        return func(*_read(args), **_read(kwargs))
    for i in mine:
        _link(func, selfs[i], args, kwargs)
    others = [i for i in range(len(selfs)) if i not in set(mine)]
    if others:
        a, k = _pick(func, args, kwargs, others)
        _check_readable(func, a, k)
        func(*_read(a), **_read(k))
    for i in mine:
        a, k = _pick(func, args, kwargs, [i])
        q = a[0][0]
        if _identity(func, a, k):
            continue
        for t in flat_args(a[1:], k):
            if isinstance(t, QuantizedTensor):
                _link(func, t, a, k)
        link = resolve(q)
        with torch.no_grad():
            dense = link.dense(q)
            func([dense], *_read(a[1:], torch.float32), **_read(k, torch.float32))
            link.requantize_(q, dense)
    return None
