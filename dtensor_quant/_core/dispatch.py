"""The op table every QuantizedTensor op goes through: ``implements`` registers, ``dispatch`` looks up.

``QuantizedTensor.__torch_dispatch__`` calls :func:`dispatch` for every aten
and c10d op. Handlers register by schema name (``"aten::slice"``) from the
modules that define them -- :mod:`dtensor_quant._ops` (layout ops by kind),
:mod:`dtensor_quant._parallel.collectives`, :mod:`dtensor_quant._ops.matmul`,
:mod:`dtensor_quant._parallel.custom_ops` -- which the package imports for exactly that.
Keying by name matches ops torch registers lazily (such as
``_c10d_functional::_wrap_tensor_autograd``) when they first arrive, not at
import. An op with no handler raises :class:`UnsupportedOpError`: nothing is
dequantized behind the caller's back.

This module is the bottom of the op stack: it imports no other module of the
package but :mod:`dtensor_quant._core.registry`, so the tensor class can import it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .registry import Slot, declare, provides

HANDLERS: dict[str, Callable] = {}


class UnsupportedOpError(NotImplementedError):
    """An op the quantized layout cannot express without dequantizing."""


def implements(*names: str):
    def register(fn):
        for name in names:
            HANDLERS[name] = fn
        _BY_OP.clear()
        _OPS.clear()
        return fn

    return register


# id(OpOverload) -> handler, filled on first use (schema names cost a lookup). Keyed by id, not by the op:
# OpOverload hashes in Python (``OpOverload.__hash__``, a frame of its own on every op). _OPS holds every op
# keyed, so no id is reused while its entry lives.
_BY_OP: dict = {}
_OPS: list = []

# (predicate, handler) pairs for ops that have no handler of their own, asked in order: a handler
# for a whole kind of op (every pointwise op, say) registers with ``fallback``.
FALLBACKS: list[tuple[Callable, Callable]] = []


def fallback(predicate: Callable):
    """Register a handler for every op without one of its own for which ``predicate(op)`` is true."""

    def register(fn):
        FALLBACKS.append((predicate, fn))
        _BY_OP.clear()
        _OPS.clear()
        return fn

    return register


#: Handlers that leave an in-place initialisation open (:mod:`dtensor_quant._ops.init`): the init ops,
#: pointwise ops, copies and ``empty_like``. Any other op on a quantized tensor ends every open one:
#: ``EPOCH[0]`` counts those ops, and an initialisation's dense values are kept for its epoch only.
KEEPS_INITIAL: set = set()
EPOCH = [0]


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """``QuantizedTensor.__torch_dispatch__`` itself: a handler already found for ``func`` is called from here,
    one Python call less per op than through :func:`dispatch` (every view pays it); the rest goes there."""
    handler = _BY_OP.get(id(func))
    if handler is None:  # not looked up yet, or none (a composite op, a refusal)
        return dispatch(func, args, kwargs or {})
    if handler not in KEEPS_INITIAL:
        EPOCH[0] += 1
    return handler(func, *args, **kwargs) if kwargs else handler(func, *args)


def dispatch(func, args, kwargs):
    handler = _BY_OP.get(id(func))
    if handler is None:
        handler = HANDLERS.get(func._schema.name)
        if handler is None:
            handler = next((fn for pred, fn in FALLBACKS if pred(func)), None)
        if id(func) not in _BY_OP:
            _OPS.append(func)
        _BY_OP[id(func)] = handler
    if handler is None and _composite(func):
        # Composite ops (chunk, linear, matmul, ...) normally decompose above us, but reach us
        # under inference mode or from inside another subclass's dispatch (a redistribute
        # DTensor runs while dispatching an op): decompose them into the ops defined here.
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if handler is None:
        raise refusal(func, args, kwargs)
    if handler not in KEEPS_INITIAL:
        EPOCH[0] += 1
    return handler(func, *args, **kwargs)


def refusal(func, args, kwargs, hint: str = "") -> UnsupportedOpError:
    """The error for an op the quantized layout does not define, naming the op, the format and the fix.

    The fix is the one that applies where the op came from: a context hint
    (:func:`context_hint`: PEFT's in-place merge, say) when one recognises its
    caller, else the caller's ``hint`` after the generic advice.
    """
    # The quantized argument (the only kind of tensor dispatched here that has a format).
    q = next(a for a in flat_args(args, kwargs) if isinstance(a, torch.Tensor) and hasattr(a, "fmt"))
    context = next((text for predicate, text in CONTEXT_HINTS if predicate(func)), None)
    fix = context if context is not None else f" Call .dequantize() first to work on a dense copy.{hint}"
    return UnsupportedOpError(
        f"dtensor_quant: {func} is not defined on {q.fmt} quantized tensors: it would need dense values.{fix}"
    )


#: ``(predicate(func), hint)`` pairs, asked in order by :func:`refusal`: the fix that applies in the
#: context a refused op comes from (registered by the layers that know that context, like the handlers).
CONTEXT_HINTS: list[tuple[Callable, str]] = []


def context_hint(hint: str):
    """Register ``predicate(func) -> bool`` (decorated): a refused op for which it holds gets ``hint`` as its fix."""

    def register(predicate):
        CONTEXT_HINTS.append((predicate, hint))
        return predicate

    return register


# -- methods of the tensor implemented above it --------------------------------

#: ``QuantizedTensor`` methods whose code lives in the layers above the tensor, each a slot of
#: :mod:`dtensor_quant._core.registry` (``dequantize`` in :mod:`dtensor_quant._ops.dequant`, FSDP2's hooks in
#: :mod:`dtensor_quant._fsdp.all_gather`, DCP's in :mod:`dtensor_quant._checkpoint.state_dict`). Those modules
#: provide them on import, as the op handlers register: the tensor never imports upwards.
METHODS: dict[str, Slot] = {
    name: declare(f"QuantizedTensor.{name}", doc)
    for name, doc in {
        "dequantize": "(q, dtype) -> the dense tensor q stands for",
        "fsdp_pre_all_gather": "(q) -> FSDP2's pre-all-gather hook of q",
        "fsdp_post_all_gather": "(q, outputs, metadata, param_dtype, out=None) -> FSDP2's gathered weight",
        "dcp_write_items": "(q, fqn, obj) -> DCP's write items of q",
        "dcp_chunk_list": "(q) -> DCP's chunks of q",
        "dcp_tensor_shard": "(q, index) -> DCP's tensor for one chunk of q",
    }.items()
}


def implements_method(name: str):
    """Provide ``QuantizedTensor.<name>`` (called with the tensor first): a slot of :data:`METHODS`."""
    if name not in METHODS:
        raise RuntimeError(f"dtensor_quant: QuantizedTensor has no method slot {name!r}; slots: {sorted(METHODS)}")
    return provides(f"QuantizedTensor.{name}")


def method(name: str) -> Slot:
    """The slot of ``QuantizedTensor.<name>`` (calling it before the package provides it raises)."""
    return METHODS[name]


def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def flat_args(args, kwargs):
    """Every argument of an op, with one level of lists and tuples (``cat``'s tensors) unpacked."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
