"""Fused optimizer steps on trainable quantized weights: torch.optim's ``fused=True`` (transformers' Trainer's
and torchtitan's default).

A fused step (``aten::_fused_adamw_``, ...) takes every parameter of a group
in one op. The dense ones take the kernel as they are; for the trainable
quantized ones the kernel runs on their float32 values and each weight is
requantized with stochastic rounding: the rule of
:mod:`dtensor_quant._training.pointwise`, per weight. Registered in the op
table by name on import.
"""

from __future__ import annotations

import torch

from .._core.dispatch import flat_args, implements, refusal
from .._core.tensor import QuantizedTensor
from .trainable import resolve

_FUSED_FROZEN = (
    " A fused optimizer step ({op}) reached a frozen quantized weight: it has no optimizer update. Give the "
    "optimizer only the parameters that require grad, or make the weight trainable "
    "(dtensor_quant.quantize_(model, fmt, trainable=True)): fused, foreach=True and for-loop steps all update those."
)


@implements("aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_", "aten::_fused_adagrad_")
def _fused_step(func, *args, **kwargs):
    """A fused optimizer step whose parameters include trainable quantized weights: the one rule, per weight.

    The dense parameters take the fused kernel as they are. For the quantized
    ones the kernel runs on their float32 values (and float32 copies of their
    gradients and states, written back into the states afterwards: one
    rounding to the states' dtype, as the kernel rounds its own), then each
    weight is requantized with stochastic rounding -- the rule every other
    in-place op on a trainable weight follows. A zero learning rate leaves
    the weights' bytes as they are (the states still update).
    """
    params = args[0]
    mine = [i for i, t in enumerate(params) if isinstance(t, QuantizedTensor)]
    for i in mine:
        if resolve(params[i]) is None:
            raise refusal(func, args, kwargs, _FUSED_FROZEN.format(op=func._schema.name.removeprefix("aten::")))
    n, schema = len(params), func._schema.arguments
    listed = [isinstance(a.type, torch.ListType) for a in schema]

    def pick(positions):
        def take(value, j):
            return [value[i] for i in positions] if listed[j] and isinstance(value, list) and len(value) == n else value

        names = [a.name for a in schema]
        return [take(v, j) for j, v in enumerate(args)], {k: take(v, names.index(k)) for k, v in kwargs.items()}

    others = [i for i in range(n) if i not in set(mine)]
    if others:
        a, k = pick(others)
        _refuse_quantized_states(func, a, k)
        func(*a, **k)
    a, k = pick(mine)
    _refuse_quantized_states(func, [[], *a[1:]], k)
    links = [resolve(q) for q in a[0]]
    with torch.no_grad():
        dense = [link.dense(q) for link, q in zip(links, a[0])]
        writes = []  # (state, its float32 copy)

        def f32(value, j):
            if not (listed[j] and schema[j].alias_info is not None and schema[j].alias_info.is_write):
                return value
            out = []
            for t in value:
                c = t if t.dtype == torch.float32 else t.float()
                writes.append((t, c))
                out.append(c)
            return out

        names = [x.name for x in schema]
        a32 = [dense, *(f32(v, j) for j, v in enumerate(a[1:], start=1))]
        func(*a32, **{key: f32(v, names.index(key)) for key, v in k.items()})
        for t, c in writes:
            if c is not t:
                t.copy_(c)
        lr = kwargs.get("lr")
        if not (isinstance(lr, (int, float)) and lr == 0):
            for link, q, d in zip(links, a[0], dense):
                link.requantize_(q, d)


def _refuse_quantized_states(func, args, kwargs) -> None:
    """Gradients and states are dense numbers; a quantized one (a weight passed as a state) is refused."""
    if any(isinstance(t, QuantizedTensor) for t in flat_args(args[1:], kwargs)):
        raise refusal(func, args, kwargs, " Optimizer states and gradients of quantized weights are dense tensors.")
