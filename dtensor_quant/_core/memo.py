"""Decisions that depend only on a layout, made once per layout and then looked up.

An op on a quantized tensor first decides its result's layout -- relations,
orientation, logical shape and strides, which inner tensors to cut where,
which to send -- from the input's layout alone, then runs the inner tensors'
own ops. Deciding is most of the time of a small op (deriving a quantized
layout costs many times a dense ``.t()``; docs/performance.md), and decode and
small layers issue the same few ops on the same few layouts over and over.
So a handler computes its decision through :func:`memo`: once per key, then
a dictionary lookup. Only decisions are kept, never results or bytes.

A key names the layout objects by identity (:func:`layout_key`: a weight's
relation rows, orientation and format are the same objects from call to
call, and a memoised decision hands out the same objects again), plus
whatever else the decision reads (dtype, shape, strides, arguments). The
entry keeps those objects alive, so an id is never reused while its entry
lives; an equal layout in another object only costs one more decision. A
decision that raises is not kept: the error comes every time.

``DTENSOR_QUANT_MEMO=0`` or ``with memo.disabled():`` decides on every call
(the tests compare both bit for bit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import config

ENABLED = config.get("memo")
MAX_ENTRIES = 4096  # a long run that keeps making new layouts starts over instead of growing
#: key -> ``(decision, pins)``. The handlers of the views every decode step issues read it inline
#: (``TABLE.get(key)`` while :data:`ENABLED`) instead of calling :func:`lookup`: the call costs more than the read.
TABLE: dict = {}


def layout_key(q) -> tuple:
    """The identity of ``q``'s layout as a memo key: its relation, orientation and format objects, dtype,
    shape and strides (pin ``q.rels, q.dims, q.fmt`` with the entry)."""
    shape, stride, dtype, _ = q.props  # not q.shape, q.stride(), q.dtype: a subclass's getters cost more
    return (id(q.rels), id(q.dims), id(q.fmt), dtype, shape, stride)


def memo(key: tuple, decide: Callable[[], Any], *pins) -> Any:
    """``decide()``, computed once per ``key`` while enabled; ``pins`` are the objects whose ids the key holds."""
    if not ENABLED:
        return decide()
    hit = TABLE.get(key)
    if hit is not None:
        return hit[0]
    return remember(key, decide(), *pins)


def lookup(key: tuple) -> Any:
    """The decision kept for ``key``, or None (always None while disabled).

    For a decision read off the first call's own result (:func:`remember` it then).
    """
    if not ENABLED:
        return None
    hit = TABLE.get(key)
    return None if hit is None else hit[0]


def remember(key: tuple, value: Any, *pins) -> Any:
    """Keep ``value`` (not None) as the decision for ``key``; returns it."""
    if ENABLED:
        if len(TABLE) >= MAX_ENTRIES:
            TABLE.clear()
        TABLE[key] = (value, pins)
    return value


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Decide on every call inside the block (the reference the memoised decisions are tested against)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def keys() -> list[tuple]:
    """The keys decided so far (tests read them to see a decision made once, then looked up)."""
    return list(TABLE)


def clear() -> None:
    """Forget every decision (never needed for correctness: keys name everything a decision reads)."""
    TABLE.clear()
