"""A producer's stored layout of one weight: its format and, per inner tensor, the map to the producer's tensors.

Every producer module answers with a :class:`StoredLayout`; the loader reads
a rank's chunk of each inner tensor through it (``..prequantized``) and the
compressed-tensors writer (:mod:`.export_ct`) writes through the same maps.
:func:`held` finds the format from the formats' declarations alone
(``producer_holds``: :func:`~dtensor_quant._core.format.format_holding`) and
builds its maps from what the format declares (``producer_layout``), so no
producer module names a format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...._core.format import QuantFormat, format_holding, held_schemes
from .stored import Extra, Fill, Stored, from_spec


@dataclass(frozen=True)
class StoredLayout:
    """A format and, for each of its inner tensors, how the producer stores it."""

    fmt: QuantFormat
    method: str  # the producer and scheme, for messages and LoadResult: "compressed-tensors pack-quantized ..."
    inner: tuple[tuple[str, Stored], ...]
    extras: tuple[Extra, ...] = ()
    #: The model holds the weight ``[..., in, out]`` (``x @ W``): quantized as its transpose, ``[..., out, in]``.
    transposed: bool = False

    def stored(self, name: str) -> Stored:
        return dict(self.inner)[name]

    def keys(self, key: str) -> list[str]:
        """Every checkpoint key this weight's layout reads."""
        return [s.key(key) for _, s in self.inner if not isinstance(s, Fill)] + [e.key(key) for e in self.extras]

    def __str__(self) -> str:
        return f"{self.fmt} ({self.method})"


def weight_shape_record() -> Extra:
    """compressed-tensors' ``{key}_shape``: int64 ``[out, in]`` of a packed weight."""

    def check(t, shape):
        if t.ndim != 1 or t.tolist() != list(shape[-2:]):
            return f"weight_shape is {t.tolist()}, the model's weight is {list(shape)}"
        return None

    return Extra("{key}_shape", check, lambda shape: torch.tensor(list(shape[-2:]), dtype=torch.int64))


#: The records a format's producer layout names (``ProducerLayout.records``), by name.
_RECORDS = {"weight_shape": weight_shape_record}


def _constant(template: str, want: torch.Tensor) -> Extra:
    """A tensor the producer keeps beside the weight holding a constant the format computes with: checked equal."""

    def check(t, shape):
        return None if torch.equal(t, want) else "not the values the model's format computes with"

    return Extra(template, check, lambda shape: want)


def declared_layout(fmt: QuantFormat, producer: str, dtype: torch.dtype, method: str = "") -> StoredLayout | str | None:
    """The :class:`StoredLayout` ``fmt`` declares for ``producer`` in a ``dtype`` model (``producer_layout``).

    None: the format declares no layout for it; a string: why this weight
    cannot be stored so. The same maps serve the writer and the reader.
    """
    declared = fmt.producer_layout(producer, dtype)
    if declared is None or isinstance(declared, str):
        return declared
    inner = tuple((name, from_spec(spec)) for name, spec in declared.inner)
    extras = (*(_RECORDS[r]() for r in declared.records), *(_constant(t, v) for t, v in declared.constants))
    return StoredLayout(fmt, method, inner, extras)


def held(key: str, producer: str, scheme: str, args: dict, what: str, extras: tuple[Extra, ...] = ()) -> StoredLayout:
    """The format that declares it holds ``producer``'s ``scheme`` with ``args``, its declared layout + ``extras``.

    Found by the formats' declarations alone (``producer_holds``); ``what``:
    the producer's words for the scheme (the layout's ``method``). Raises
    ``ValueError`` naming weight ``key``, ``what`` it holds and which schemes
    of the producer the formats hold, when none holds this one.
    """
    try:
        fmt = format_holding(producer, scheme, args)
    except ValueError as e:
        raise ValueError(f"{key}: {what}: {e}") from None
    if fmt is None:
        schemes = "; ".join(held_schemes(producer)) or "none"
        raise ValueError(f"{key}: {what} has no format here that holds it as stored (the formats hold {producer}: "
                         f"{schemes})")  # fmt: skip
    # read with the scales' dtype as stored, so a declared "scales in the model's dtype" rule always fits
    layout = declared_layout(fmt, producer, getattr(fmt, "scale_dtype", None) or torch.float32, what)
    assert isinstance(layout, StoredLayout), (fmt, producer, layout)  # a format declares a layout for what it holds
    return dataclasses.replace(layout, extras=(*layout.extras, *extras))
