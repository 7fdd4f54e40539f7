"""QuantizedTensor: a traceable wrapper subclass standing for a dense weight.

The wrapper carries the *logical* shape, dtype and strides of the weight it
stands for, so DTensor's sharding propagation, FSDP2's bookkeeping and DCP's
metadata all see an ordinary ``[out, in]`` tensor of the weight's dtype. The
bytes live in the inner tensors the format declares. Every op on the wrapper
goes through :func:`dtensor_quant._core.dispatch.dispatch`, to the handler that
derives the inner ops from the format's layout; an op without one raises
instead of dequantizing.

The class sits below the modules that implement its behaviour (the op
handlers, FSDP2's hooks, dequantizing). Those register themselves on import
-- the handlers in the dispatch table, FSDP2's two hooks and
:meth:`dequantize` as methods (:func:`dtensor_quant._core.dispatch.implements_method`, slots of
:mod:`dtensor_quant._core.registry`) -- so the tensor never imports the layers above it.
"""

from __future__ import annotations

import hashlib

import torch

from .dispatch import method, torch_dispatch
from .format import QuantFormat
from .layout import Blocked, Constant, FlatBlocked, InFlat, LayoutError, OneToOne, Opaque, Packed, Relation, Stacked
from .notes import Notes, alias, new_bytes

#: What runs once, when the first quantized tensor of the process is made (:func:`on_first_quantized_tensor`).
_FIRST_USE: list = []


def on_first_quantized_tensor(fn) -> None:
    """Run ``fn()`` once, when the first :class:`QuantizedTensor` of the process is made (now, if one was).

    How the layers above scope what only quantized tensors need -- a torch patch whose replacement handles
    this library's tensors (:mod:`dtensor_quant._parallel.compile_key`) -- to the processes that make one:
    ``import dtensor_quant`` itself changes nothing in torch.
    """
    if _MADE[0]:
        fn()
    else:
        _FIRST_USE.append(fn)


_MADE = [False]


def _first_quantized_tensor() -> None:
    _MADE[0] = True
    while _FIRST_USE:
        _FIRST_USE.pop(0)()


class _NoBytesStorage(torch.UntypedStorage):
    """The placeholder storage of a :class:`QuantizedTensor`: ``data_ptr()`` raises, saying why (see its
    ``untyped_storage``)."""

    def data_ptr(self) -> int:
        raise RuntimeError(
            "a QuantizedTensor has no storage of its own, so no data pointer: its stored bytes are its inner tensors "
            "(q.inner: qdata, scale, ...), each with its own storage; compare those. torchtitan's CheckpointManager "
            "compares state-dict storages this way (its ModelWrapper), then hands the tensors to DCP's default "
            "planners, which cannot write a quantized weight: with quantized weights use "
            "dtensor_quant.torchtitan.CheckpointManager (config.checkpoint = "
            "dtensor_quant.torchtitan.CheckpointManager.Config(...); docs/frameworks.md)."
        )


#: The keys under which a tensor keeps, in its ``__dict__``, the decided layout of its own ``t()`` and
#: ``view(-1)`` (:mod:`dtensor_quant._ops.layout_ops`: ``transpose``, ``flatten``): those two views run on every
#: decode step and FSDP2 step, and a recipe kept on the tensor is read in one lookup where the memo table
#: needs its key built and hashed. A tensor's layout never changes in place but through ``.data = other``,
#: which drops them.
VIEW_RECIPES = ("_dq_t_recipe", "_dq_flat_recipe")

# Per logical dim, the canonical dims of the format's weight it holds:
# ((0,), (1,)) as quantized, ((1,), (0,)) after .t(), ((0, 1),) after view(-1).
Dims = tuple[tuple[int, ...], ...]


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class QuantizedTensor(torch.Tensor):
    """A quantized weight: inner tensors plus the relations that tie them to logical dims.

    Build one with :func:`dtensor_quant.quantize`; read it back with
    :meth:`dequantize`. ``fmt`` is the format, ``rels[i]`` the current
    relation of inner ``fmt.inner_names[i]`` to each logical dim, ``dims`` the
    orientation relative to the format's canonical ``[out, in]``, ``notes``
    what later ops need to know beyond the layout (:mod:`dtensor_quant._core.notes`).
    """

    fmt: QuantFormat
    rels: tuple[tuple[Relation, ...], ...]
    dims: Dims
    notes: Notes
    #: ``(shape, stride, dtype, device)`` as the tensor was made: the same values as ``q.shape``,
    #: ``q.stride()``, ``q.dtype`` and ``q.device``, read without their getters, each of which costs a
    #: subclass several times a dense tensor's (the hot views and collectives read them on every call).
    #: Set wherever a QuantizedTensor is made (``__init__``, :meth:`make`, the ``data`` setter); no handler
    #: changes a tensor's metadata in place (``t_``, ``resize_``, ``set_`` are refused), so it never goes stale.
    props: tuple

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner, fmt, rels, dims, shape, dtype, stride=None, requires_grad=False, notes=None):
        if not isinstance(fmt, QuantFormat) or not isinstance(inner, dict) or not inner:
            raise LayoutError(
                f"not a QuantizedTensor's parts: format {type(fmt).__name__}, inner {type(inner).__name__} "
                "(a dict of the format's inner tensors); build quantized tensors with dtensor_quant.quantize()"
            )
        device = next(iter(inner.values())).device
        return torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=stride if stride is not None else contiguous_strides(shape),
            dtype=dtype,
            device=device,
            requires_grad=requires_grad,
        )

    def __init__(self, inner, fmt, rels, dims, shape, dtype, stride=None, requires_grad=False, notes=None):
        if tuple(inner) != fmt.inner_names or len(rels) != len(inner) or any(len(r) != len(shape) for r in rels):
            raise LayoutError(
                f"QuantizedTensor of {fmt}: inner tensors {tuple(inner)} with {len(rels)} relation rows for a "
                f"{len(shape)}-D shape; the format declares {fmt.inner_names}, one row of {len(shape)} per inner "
                "tensor. Build quantized tensors with dtensor_quant.quantize()."
            )
        self.fmt = fmt
        self.props = (
            torch.Size(shape),
            tuple(stride) if stride is not None else contiguous_strides(shape),
            dtype,
            next(iter(inner.values())).device,
        )
        self.rels = tuple(tuple(r) for r in rels)
        self.dims = tuple(tuple(d) for d in dims)
        for name, t in inner.items():
            setattr(self, name, t)
        self.notes = notes if notes is not None else new_bytes(list(inner.values()))
        if not _MADE[0]:
            _first_quantized_tensor()

    def __getattr__(self, name: str):
        # Only reached for a name that is not set: inner tensors still pending (Notes.pending, a fast t()).
        # Made first, the mark dropped after: another thread reading meanwhile makes the same views
        # itself instead of finding them neither pending nor set; a fill that raises stays pending.
        d = self.__dict__
        notes = d.get("notes")
        pending = notes.pending if notes is not None else None
        if pending is not None:
            pending[0](self, *pending[1:])
            d["notes"] = notes._replace(pending=None)
        elif name in d:  # set by another thread since this lookup missed it
            return d[name]
        else:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(self, name)

    # ``param.data = other``: torch's setter swaps only the C++ metadata (shape, strides, dtype), so
    # the inner tensors -- the values -- would silently stay the old ones. Take ``other``'s state too.
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, other) -> None:
        if not isinstance(other, QuantizedTensor):
            raise ValueError(
                f"cannot assign a {type(other).__name__} to .data of a quantized tensor ({self.fmt}): its "
                "values live in its inner tensors, which a dense tensor cannot replace. Quantize it first "
                "(dtensor_quant.quantize(t, fmt)), or replace the parameter itself "
                "(module.weight = nn.Parameter(t, requires_grad=False))."
            )
        torch._C.TensorBase.data.__set__(self, other)
        for name in (*self.fmt.inner_names, *VIEW_RECIPES):
            self.__dict__.pop(name, None)  # the old format's inner tensors, and views decided for the old layout
        for name, t in other.inner.items():
            setattr(self, name, t)
        self.fmt, self.rels, self.dims, self.notes = other.fmt, other.rels, other.dims, alias(other.notes)
        self.props = other.props

    @classmethod
    def make(cls, inner, fmt, rels, dims, shape, stride, dtype, notes: Notes, device: torch.device) -> QuantizedTensor:
        """A result of an op whose layout is already decided: no validation, nothing derived again.

        ``inner`` in the format's order (a sequence, or nothing when ``notes.pending`` makes them).
        The op handlers build their results this way; :class:`QuantizedTensor` itself checks its
        arguments, for everything else.
        """
        out = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device)
        if type(shape) is not torch.Size:
            shape = torch.Size(shape)
        out.fmt, out.rels, out.dims, out.notes = fmt, rels, dims, notes
        out.props = (shape, stride if type(stride) is tuple else tuple(stride), dtype, device)
        for name, t in zip(fmt.inner_names, inner):
            setattr(out, name, t)
        if not _MADE[0]:
            _first_quantized_tensor()
        return out

    @classmethod
    def make_view(cls, fmt, rels, dims, props: tuple, notes: Notes, inner=()) -> QuantizedTensor:
        """:meth:`make` for a view of an existing quantized tensor, its ``props`` (``(shape as a torch.Size,
        strides as a tuple, dtype, device)``) already decided and kept with the decision: the views every
        decode step issues (``t()``, ``view(-1)``, aliases) build their result with this, in half the steps."""
        out = torch.Tensor._make_wrapper_subclass(cls, props[0], strides=props[1], dtype=props[2], device=props[3])
        out.fmt, out.rels, out.dims, out.notes, out.props = fmt, rels, dims, notes, props
        if inner:  # else notes.pending makes them
            for name, t in zip(fmt.inner_names, inner):
                setattr(out, name, t)
        return out

    @property
    def inner(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.fmt.inner_names}

    def rel(self, name: str) -> tuple[Relation, ...]:
        return self.rels[self.fmt.inner_names.index(name)]

    # -- traceability (torch.compile, FSDP2, DCP) --------------------------
    def __tensor_flatten__(self):
        ctx = (self.fmt, self.rels, self.dims, self.dtype, tuple(self.stride()))
        return list(self.fmt.inner_names), ctx

    def _stable_hash_for_caching(self) -> str:
        """A process-independent key for torch.compile's AOT autograd cache.

        Dataclass reprs of the format and relations are deterministic, unlike
        ``hash()``; inner tensors contribute their metadata, not their values.
        """
        inner = [(n, t.dtype, tuple(t.shape), t.stride(), t.device.type) for n, t in self.inner.items()]
        key = (
            type(self.fmt).__module__,
            repr(self.fmt),
            self.rels,
            self.dims,
            self.dtype,
            tuple(self.shape),
            self.stride(),
            self.requires_grad,
            inner,
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    # -- storage: a quantized tensor has none of its own ------------------------
    def untyped_storage(self) -> torch.UntypedStorage:
        """torch's storage object of the wrapper (sizes as torch reports them), whose ``data_ptr()`` says why not.

        A wrapper subclass has no bytes of its own: its storage is a
        placeholder whose ``data_ptr()`` raises torch's "invalid python
        storage". Code that compares storages by pointer (torchtitan's
        ``ModelWrapper``, deduplicating savers) reaches that first; the same
        RuntimeError now says where the bytes are and, for torchtitan, which
        checkpoint manager takes quantized weights. Nothing else changes.
        """
        storage = super().untyped_storage()
        if type(storage) is torch.UntypedStorage:
            try:
                storage.data_ptr()
            except RuntimeError:
                storage.__class__ = _NoBytesStorage
        return storage

    # -- torch.save / torch.load (weights_only=True) --------------------------
    def __reduce_ex__(self, protocol):
        """Pickled as a call of the class on its inner tensors, format, relations, orientation, shape, dtype,
        strides and requires_grad.

        Not the notes: which views share these bytes and what kernels prepared
        from them belong to this process (the loaded tensor starts its own).
        The file names only public paths (``dtensor_quant.QuantizedTensor``,
        ``dtensor_quant.Int8Rowwise``, ``dtensor_quant.OneToOne``: the package
        root gives them that name), never the private modules that define them,
        so moving one breaks no saved file; each is a safe global for
        ``torch.load``'s default ``weights_only=True``.
        """
        args = (self.inner, self.fmt, self.rels, self.dims, tuple(self.shape), self.dtype, tuple(self.stride()))
        return QuantizedTensor, (*args, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        fmt, rels, dims, dtype, stride = ctx
        inner = {name: inner[name] for name in fmt.inner_names}
        return QuantizedTensor(inner, fmt, rels, dims, outer_size, dtype, outer_stride or stride)

    __torch_dispatch__ = classmethod(torch_dispatch)  # every op: dispatch.torch_dispatch -> its handler

    # -- FSDP2 all-gather extension (derived from the layout: dtensor_quant.fsdp) --
    @property
    def fsdp_pre_all_gather(self):
        """``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``.

        A property because FSDP2 picks the hook's form by its signature: an
        uneven (short) shard presents the 1-argument form, see dtensor_quant.fsdp.
        """
        return method("fsdp_pre_all_gather")(self)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return method("fsdp_post_all_gather")(self, outputs, metadata, param_dtype, out=out)

    # -- DCP's extension points for tensor subclasses (dtensor_quant.checkpoint) --
    # DCP's default planners keep one tensor per key; a quantized tensor's inner tensors each need a key of their
    # own, so a quantized value that reaches them unconverted is refused there, naming what converts it.
    def __create_write_items__(self, fqn, obj):
        return method("dcp_write_items")(self, fqn, obj)

    def __create_chunk_list__(self):
        return method("dcp_chunk_list")(self)

    def __get_tensor_shard__(self, index):
        return method("dcp_tensor_shard")(self, index)

    # -- user API ----------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense tensor this stands for (in ``dtype``, default the logical dtype: a floating-point dtype)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            # an integer dtype would truncate every value without a word; a name fails deep inside torch
            raise ValueError(f"dequantize(dtype) takes a floating-point torch.dtype (bfloat16, ...), got {dtype!r}")
        return method("dequantize")(self, dtype or self.dtype)

    @property
    def nbytes_stored(self) -> int:
        """Bytes held by the inner tensors (what a collective of the whole tensor moves)."""
        return sum(t.numel() * t.element_size() for t in self.inner.values())

    def __repr__(self, *, tensor_contents=None) -> str:
        inner = ", ".join(f"{n}={tuple(t.shape)}:{t.dtype}" for n, t in self.inner.items())
        orient = "" if self.dims == tuple((i,) for i in range(len(self.dims))) else f", dims={self.dims}"
        return f"QuantizedTensor({self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}{orient}, {inner})"


def rebuild(inner, fmt, rels, dims, shape, dtype, stride, requires_grad) -> QuantizedTensor:
    """A QuantizedTensor pickled before pickles named public paths (``dtensor_quant._core.tensor.rebuild``).

    Kept, and registered under that path, so that those files still load;
    new files call :class:`QuantizedTensor` itself.
    """
    if not isinstance(fmt, QuantFormat) or not isinstance(inner, dict):
        raise LayoutError(f"not a pickled QuantizedTensor: format {type(fmt).__name__}, inner {type(inner).__name__}")
    return QuantizedTensor(inner, fmt, rels, dims, torch.Size(shape), dtype, stride, requires_grad=requires_grad)


#: What a pickled QuantizedTensor names besides torch's own: safe for ``torch.load(weights_only=True)``
#: (torch's public allow-list; the format classes register themselves, ``QuantFormat.__init_subclass__``;
#: the private paths earlier files name: :mod:`dtensor_quant._formats.pickle_names`).
SAFE_GLOBALS = [QuantizedTensor, OneToOne, Packed, Blocked, Constant, Stacked, FlatBlocked, InFlat, Opaque]
torch.serialization.add_safe_globals(SAFE_GLOBALS)
