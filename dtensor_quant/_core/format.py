"""The base class a quantized format derives from: layout, math and kernel only.

A format is a frozen dataclass (its parameters are part of its identity and
of every checkpoint) that says three things about a 2-D weight ``[out, in]``:

* ``layout``: for each inner tensor, one :mod:`~dtensor_quant._core.layout`
  relation per logical dim. The library derives every DTensor, FSDP2 and DCP
  op from it. A format whose blocks depend on the weight's shape (NF4's
  blocks of block-scales) overrides ``layout_for(shape)`` instead.
* ``quantize``/``dequantize``: the math, on a (possibly sharded) local
  weight. Statistics that a scale needs from the whole weight go through
  ``reduce``, which is the identity on one process and an all-reduce over the
  mesh dims whose shards share a block when the weight is a sharded DTensor.
* ``unpack`` (optional): ``dequantize`` at memory speed for whole weights,
  which FSDP2's gathers and the backward's input gradient use.
* N-D weights ``[..., out, in]`` (fused mixture-of-experts parameters
  ``[experts, out, in]``) need nothing from the format: :func:`weight_layout`
  prepends a one-to-one relation per leading dim to every inner tensor, and
  the library quantizes and dequantizes each ``[out, in]`` matrix with the
  2-D math, so an expert's bytes are those of quantizing it on its own.
* ``prepare``/``linear`` (optional): a fast ``x @ W.T``. ``prepare`` turns the
  canonical inner tensors into whatever the kernel wants (the library caches
  it per weight); ``linear`` returning ``None`` falls back to dequantize +
  matmul.

What the library asks a format, besides the above, is declared here too
rather than guessed at: ``check_shape`` (can it hold a weight of this shape,
whatever the dtype; the planner asks before any data exists),
``check_weight`` (shape and dtype), ``block_size_params`` (which parameters
are block sizes the planner may shrink), and ``checkpoint_suffixes`` /
``hf_quantization_config`` (how :mod:`dtensor_quant.hf` names its tensors;
None for formats without a Hugging Face form).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import torch

from . import activations
from .layout import Blocked, OneToOne, Relation
from .producers import Holds, ProducerLayout
from .stochastic import Noise


class Reducer:
    """Combines a statistic over the shards that share its blocks; here, one unsharded weight.

    ``full_shape`` is the logical shape of the whole weight (a format whose
    layout depends on it needs it while quantizing a shard).
    """

    def __init__(self, full_shape):
        self.full_shape = tuple(full_shape)

    def __call__(self, stat: torch.Tensor, op: str, like: str) -> torch.Tensor:
        """Combine ``stat`` (laid out like inner ``like``) with the other shards' (``op``: max, min or sum)."""
        return stat


class QuantFormat:
    """Subclass as a ``@dataclass(frozen=True)``; see the module docstring."""

    def __init_subclass__(cls, **kwargs):
        """Every format class is safe for ``torch.load(weights_only=True)``: a pickled weight names it."""
        super().__init_subclass__(**kwargs)
        torch.serialization.add_safe_globals([cls])

    def __setstate__(self, state):
        """Unpickling (a format sent to a rank, a ``torch.load``) declares its activation scheme as building does."""
        for name, value in (state or {}).items():
            object.__setattr__(self, name, value)
        activations.declare(self.activation_scheme)

    @property
    def layout(self) -> dict[str, tuple[Relation, ...]]:
        raise NotImplementedError

    def layout_for(self, shape) -> dict[str, tuple[Relation, ...]]:
        """The relations for a weight of logical ``shape`` (default: ``layout``, shape-independent)."""
        return self.layout

    def check_shape(self, shape: torch.Size) -> None:
        """Raise ``ValueError`` for an ``[out, in]`` shape this format cannot hold, whatever the dtype.

        Override it (calling ``super()``) for shape rules: packs that need an
        even width, blocks over the flat weight that need a multiple of their
        size. The planner, the placement checks and the padding search ask it
        before any weight exists; library code calls :func:`check_shape`,
        which also takes ``[..., out, in]``.
        """
        if len(shape) != 2:
            raise ValueError(f"{self} quantizes 2-D weights [out, in]; got shape {tuple(shape)}")

    def check_weight(self, shape: torch.Size, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` for a weight this format cannot hold: its dtype, then ``check_shape``.

        Override it only for dtype rules; shape rules belong in ``check_shape``.
        """
        if len(shape) != 2:
            raise ValueError(f"{self} quantizes 2-D weights [out, in]; got shape {tuple(shape)}")
        if dtype not in _FLOAT_DTYPES:
            # float64 and the float8 dtypes reach statistics and kernels written for these three (scales capped at
            # float32's range, isinf/nextafter that float8 lacks): refused here, not as a torch error deep inside
            raise ValueError(
                f"{self} quantizes floating-point weights in float32, bfloat16 or float16; got {dtype}"
                + (": convert it first (weight.float())" if dtype.is_floating_point else "")
            )
        self.check_shape(shape)

    @property
    def block_size_params(self) -> tuple[str, ...]:
        """The names of the (int) dataclass fields that are block sizes, e.g. ``("group_size",)``.

        The planner offers the same format with a smaller value of one of
        them when a mesh size cuts through a block. Declare it as a class
        attribute; the default takes the int fields whose value is the size
        of a :class:`~dtensor_quant._core.layout.Blocked` relation of ``layout``
        (none when the layout depends on the weight's shape).
        """
        try:
            sizes = {r.b for rels in self.layout.values() for r in rels if isinstance(r, Blocked)}
        except (NotImplementedError, ValueError):
            return ()
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        values = {f.name: getattr(self, f.name) for f in fields}
        return tuple(n for n, v in values.items() if type(v) is int and v in sizes)

    #: Hugging Face key suffix of each inner tensor (``{"qdata": "", "scale_inv": "_scale_inv"}``),
    #: appended to the weight's key by :mod:`dtensor_quant.hf`; None: the format has no such form.
    checkpoint_suffixes: dict[str, str] | None = None
    #: The ``quantization_config`` a Hugging Face ``config.json`` declares for it, or None.
    hf_quantization_config: dict | None = None

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def quantize_stochastic(
        self, weight: torch.Tensor, reduce: Reducer, noise: Noise, dtype: torch.dtype
    ) -> dict[str, torch.Tensor] | None:
        """``quantize`` with stochastic rounding of the codes; None (the default): the format has none.

        What a trainable weight (``quantize_(..., trainable=True)``) needs to
        be updated in place. ``weight`` holds float32 values of a weight of
        logical dtype ``dtype`` (statistics and scales are computed and stored
        as ``quantize`` does for a ``dtype`` weight). ``noise.uniform()`` is
        float32 of the same shape, uniform in ``[0, 1)`` (a
        :class:`~dtensor_quant._core.stochastic.Noise`: a kernel may draw the same
        numbers itself): a value a fraction ``f`` of the way from one code to
        the next rounds to the farther one with probability ``f``, chosen by its
        noise alone (``floor(x + noise)`` on an integer grid), so the rounding
        is unbiased and a value on a code stays there. Statistics go through
        ``reduce`` as in ``quantize``.
        """
        return None

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Dense values from the inner tensors of a canonical ``[out, in]`` weight or shard.

        The library hands them over broadcastable to the logical shape: a
        blocked inner tensor repeated once per element (partial last block
        cut), a constant one of size 1; packed ones arrive as stored. So the
        math is elementwise and never needs the full weight's shape.
        """
        raise NotImplementedError

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """Optional fast dequantize: write the values into ``out`` and return True, or return False.

        ``inner`` are the *stored* tensors (not broadcast) of a canonical
        ``[out, in]`` weight whose packs and column blocks are whole (a chunk
        of rows of one, cut on its row blocks; the last row block may be
        partial); ``out`` is a preallocated tensor
        of that shape whose dtype is the result's. The bits must equal
        ``dequantize``'s (a table lookup per byte, one broadcast multiply per
        block). :mod:`dtensor_quant._ops.unpack` calls it.
        """
        return False

    #: True: ``prepare``/``linear`` only ever see the inner tensors of a weight laid out as a fresh weight of
    #: its shape (blocks whole, in quantizing order: what ``unpack`` assumes), as for a format whose blocks run
    #: over the flat index; any other shard or slice dequantizes. False: any canonical weight.
    kernel_needs_whole_blocks: bool = False

    def prepare(self, inner: dict[str, torch.Tensor]):
        """The kernel's view of a canonical weight (cached by the library); default: ``inner``."""
        return inner

    def linear(self, x: torch.Tensor, prepared, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x @ W.T + bias`` from ``prepare``'s result, or None to dequantize instead."""
        return None

    @property
    def activation_scheme(self):
        """How ``linear`` quantizes its activation, or None (the default): weight-only, ``x`` multiplied as it comes.

        A format that declares one (an :class:`~dtensor_quant._core.activations.ActivationScheme`, spelled by its
        ``activations`` field: ``Int8Rowwise(activations="int8-token")``) computes ``linear`` as that scheme's
        reference arithmetic (:func:`~dtensor_quant._core.activations.reference_linear`) and never returns None
        from it: a weight-only fallback would change the arithmetic silently. Under tensor parallelism the
        per-token statistic is reduced over the mesh dims that cut the reduction dim
        (:mod:`dtensor_quant._parallel.activation_stats`).
        """
        return None

    #: The producers this format's :meth:`producer_layout` can write it as, each with a note for messages
    #: (``{"compressed-tensors": "Int4Groupwise with zero points 0"}``); :func:`writers` lists them.
    producer_notes: ClassVar[dict[str, str]] = {}

    #: The producers' schemes this format class holds as stored (:class:`~dtensor_quant._core.producers.Holds`):
    #: how a reader of a pre-quantized checkpoint finds the format of a stored weight (:func:`format_holding`).
    #: Each one has a :meth:`producer_layout` for its producer.
    producer_holds: ClassVar[tuple[Holds, ...]] = ()

    def producer_layout(self, producer: str, dtype: torch.dtype) -> ProducerLayout | str | None:
        """How ``producer`` (``"compressed-tensors"``, ``"gptq"``...) stores a weight of this format in a ``dtype``
        model.

        A :class:`~dtensor_quant._core.producers.ProducerLayout` (plain data:
        the producer's scheme and, per inner tensor, how it is stored), a
        string saying why this weight cannot be written so (its scales are in
        another dtype), or None (the default): the producer has no scheme for
        the format. The checkpoint layer turns the declaration into file maps.
        """
        return None

    def expanded_format(self) -> QuantFormat | None:
        """A format that holds exactly this one's values with fewer levels of scale blocks, or None.

        A double-quantized format (NF4's scales of scales) blocks its second-level
        scales over many weights, which can forbid a tensor-parallel cut that its
        first-level blocks allow. Its expanded format stores each first-level
        scale as computed, so every weight dequantizes to the same bits and only
        the first-level blocks constrain a cut. The expanded format declares
        which formats it expands (:func:`expansion_of`);
        :func:`dtensor_quant.expand_scales` converts a tensor, the planner and
        ``adapt_tp_plan`` offer it.
        """
        make = _EXPANSIONS.get(type(self))
        return make(self) if make is not None else None

    def expand_inner(self, inner: dict[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
        """``expanded_format``'s inner tensors for a fresh ``[out, in]`` weight's ``inner`` (the same values)."""
        wider = self.expanded_format()
        if wider is None:
            raise ValueError(f"{self} has no expanded format")
        return wider.inner_expanded_from(self, inner, shape)

    @functools.cached_property
    def inner_names(self) -> tuple[str, ...]:
        """The inner tensors, in the order of every layout (override with ``layout_for``).

        Cached on the (frozen) format: every QuantizedTensor construction checks it.
        """
        return tuple(self.layout)


class FlatBlockedFormat(QuantFormat):
    """A format whose blocks of ``block_size`` run over the row-major *flattened* weight (NF4 and its kin).

    Its layout depends on the weight's shape (a block inside a row, or one
    across rows: :func:`~dtensor_quant._core.layout.flat_blocked`), so it
    implements ``layout_for``; it holds any weight whose element count is a
    multiple of ``block_size``.
    """

    block_size: int

    def check_shape(self, shape):
        super().check_shape(shape)
        numel = shape[0] * shape[1]
        if numel % self.block_size:
            raise ValueError(
                f"{self}: a {tuple(shape)} weight has {numel} elements, not a multiple of block_size "
                f"{self.block_size} (the blocks run over the flattened weight)"
            )

    @property
    def layout(self):
        raise ValueError(f"{self}'s layout depends on the weight's shape: use layout_for(shape)")


_EXPANSIONS: dict[type, Callable[[QuantFormat], QuantFormat]] = {}


def expansion_of(*formats: type):
    """Register ``make(fmt) -> expanded format`` for the format classes given (see ``expanded_format``).

    The expanded format's module declares it, next to its ``inner_expanded_from(fmt, inner, shape)``: the
    formats it expands need not know it.
    """

    def register(make):
        for cls in formats:
            _EXPANSIONS[cls] = make
        return make

    return register


# -- optional parameters shared by formats ---------------------------------------------------------------------

_DTYPE_NAMES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dtype_param(fmt: QuantFormat, name: str, allowed=_FLOAT_DTYPES) -> None:
    """Normalize the dtype field ``name`` of a frozen format in ``__post_init__``: None, a dtype or its name.

    A name (``"float16"``, ``"torch.bfloat16"``) is what a command-line spec
    (``int4:128,float16``) or a checkpoint record gives; the field always holds
    a ``torch.dtype`` (hashable, so part of the format's identity) or None.
    """
    value = getattr(fmt, name)
    if isinstance(value, str):
        value = _DTYPE_NAMES.get(value.removeprefix("torch."), value)
    if value is not None and value not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{type(fmt).__name__}: {name} must be None or one of {names}; got {getattr(fmt, name)!r}")
    object.__setattr__(fmt, name, value)


def compact_repr(fmt: QuantFormat) -> str:
    """``Name(a=1, b=2)`` without the fields that are None: a new optional parameter keeps old formats' reprs.

    The repr is a format's identity (:mod:`~dtensor_quant._core.format_ids` hashes
    it) and the checkpoint record omits None parameters the same way, so a
    format without the option is the one it was before the option existed.
    """
    shown = [f"{f.name}={getattr(fmt, f.name)!r}" for f in dataclasses.fields(fmt) if getattr(fmt, f.name) is not None]
    return f"{type(fmt).__name__}({', '.join(shown)})"


def unpack_through(fmt: QuantFormat, inner: dict[str, torch.Tensor], out: torch.Tensor, dtype: torch.dtype) -> bool:
    """``fmt.unpack`` into a ``dtype`` buffer, then one conversion into ``out``: values rounded to ``dtype`` first.

    What a format whose dequantize rounds to its scale's dtype before the
    output dtype (the producers' arithmetic) needs when ``out`` is another dtype.
    """
    values = torch.empty(out.shape, dtype=dtype, device=out.device)
    if not fmt.unpack(inner, values):
        return False
    out.copy_(values)
    return True


def writers(producer: str) -> list[str]:
    """The notes of every format class that declares it can be written as ``producer``, in definition order."""
    out = []
    for cls in _format_classes():
        note = cls.__dict__.get("producer_notes", {}).get(producer)
        if note is not None and note not in out:
            out.append(note)
    return out


def _format_classes() -> list[type]:
    """Every format class of this process, in definition order (depth first)."""
    out, todo = [], list(QuantFormat.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo[:0] = cls.__subclasses__()
        if cls not in out:
            out.append(cls)
    return out


def format_holding(producer: str, scheme: str, args: dict) -> QuantFormat | None:
    """The format that holds a weight ``producer`` stored in ``scheme`` with ``args`` as stored, or None.

    Looked up in the format classes' declarations (``producer_holds``) alone
    and built with the fields they read from ``args``. Raises ``ValueError``
    when two classes claim it, or when the fields do not build a format (a
    scale dtype the format does not take): the message says why.
    """
    found = [(cls, h) for cls in _format_classes() for h in cls.__dict__.get("producer_holds", ())
             if h.matches(producer, scheme, args)]  # fmt: skip
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(cls.__name__ for cls, _ in found)
        raise ValueError(f"{producer} {scheme} {args}: more than one format declares it holds it ({names})")
    cls, holds = found[0]
    try:
        return cls(**holds.fields(args))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cls.__name__} holds {producer} {scheme}, but not with {args}: {e}") from None


def held_schemes(producer: str) -> list[str]:
    """What the format classes declare they hold of ``producer``, for messages: ``"gptq (num_bits=4, ...) as X"``."""
    return [f"{h} as {cls.__name__}" for cls in _format_classes() for h in cls.__dict__.get("producer_holds", ())
            if h.producer == producer]  # fmt: skip


def weight_layout(fmt: QuantFormat, shape) -> dict[str, tuple[Relation, ...]]:
    """``fmt``'s relations for a weight of logical ``shape`` ``[..., out, in]``.

    A leading (expert) dim is one-to-one for every inner tensor: each matrix
    keeps its own codes and scales, so slicing, sharding and gathering along
    it never cuts a block. Library code asks this, never ``fmt.layout_for``
    directly, so a format only ever sees 2-D shapes.
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{fmt} quantizes weights [..., out, in] of at least 2 dims; got shape {shape}")
    lead = (OneToOne(),) * (len(shape) - 2)
    return {name: lead + tuple(rels) for name, rels in fmt.layout_for(shape[-2:]).items()}


def check_shape(fmt: QuantFormat, shape) -> None:
    """``fmt.check_shape`` for a weight ``[..., out, in]``: the format checks one ``[out, in]`` matrix.

    A format written before ``check_shape`` existed keeps its shape rules in
    ``check_weight``: it is asked with bfloat16, as every shape question was
    before (a format that overrides ``check_weight`` for a dtype rule alone
    and refuses bfloat16 should override ``check_shape`` too).
    """
    check_format(fmt)
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{fmt} quantizes weights [..., out, in] of at least 2 dims; got shape {shape}")
    cls = type(fmt)
    legacy = cls.check_shape is QuantFormat.check_shape and cls.check_weight is not QuantFormat.check_weight
    try:
        if legacy:
            fmt.check_weight(torch.Size(shape[-2:]), torch.bfloat16)
        else:
            fmt.check_shape(torch.Size(shape[-2:]))
    except ValueError as e:
        if len(shape) == 2:
            raise
        raise type(e)(f"each [out, in] matrix {shape[-2:]} of the {shape} weight: {e}") from None


def check_format(fmt) -> None:
    """Raise ``TypeError`` unless ``fmt`` is a format instance (what every entry point taking a format needs)."""
    if isinstance(fmt, QuantFormat):
        return
    if isinstance(fmt, type) and issubclass(fmt, QuantFormat):
        raise TypeError(f"expected a format instance, got the class {fmt.__name__}: call it ({fmt.__name__}())")
    raise TypeError(
        f"expected a format instance such as dtensor_quant.Int8Rowwise() or Int4Groupwise(128), got {fmt!r} "
        f"({type(fmt).__name__}); format strings ('int8', 'int4:64') are for the command line "
        "(dtensor_quant.planner.parse_format reads them)"
    )


def int_params(fmt: QuantFormat, names=None) -> None:
    """In ``__post_init__``: each integer field ``names`` (default: ``block_size_params``) holds an ``int``.

    A float or a string there fails later inside torch (``unflatten`` of a block size of ``128.0``), or in the
    field's own range check with a bare ``TypeError``: refused here, naming the field.
    """
    for name in fmt.block_size_params if names is None else names:
        value = getattr(fmt, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{type(fmt).__name__}: {name} must be an integer; got {value!r} ({type(value).__name__})")


def check_weight(fmt: QuantFormat, shape, dtype: torch.dtype) -> None:
    """``fmt.check_weight`` for a weight ``[..., out, in]``: the format checks one ``[out, in]`` matrix."""
    check_format(fmt)
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{fmt} quantizes weights [..., out, in] of at least 2 dims; got shape {shape}")
    try:
        fmt.check_weight(torch.Size(shape[-2:]), dtype)
    except ValueError as e:
        if len(shape) == 2:
            raise
        raise type(e)(f"each [out, in] matrix {shape[-2:]} of the {shape} weight: {e}") from None
