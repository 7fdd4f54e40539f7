"""How a quantized weight appears in a state dict and in DCP: a tensor in the state dict, entries on disk.

**State dicts hold tensors.** torch's contract is name -> tensor, and code
that reshapes weights in a state-dict hook (torchtitan's fused-QKV split
calling ``.shape`` and ``torch.split``), caches them (torchtitan's
``ModelWrapper``: ``.shape``, ``.dtype``, ``copy_``) or sizes a state dict
(Hugging Face's shard splitter) needs it. So ``model.state_dict()`` and
``get_model_state_dict`` hold each quantized weight as itself: the
:class:`~dtensor_quant.QuantizedTensor` parameter (detached, sharing its
bytes) or its DTensor. ``load_state_dict`` / ``set_model_state_dict`` copy a
quantized value's bytes in place after checking its format, quantize a dense
one, and rebuild entry-form values (below).

**On disk, entries.** DCP records one dtype and one global shape per key, so
a quantized weight cannot be a single key: its inner tensors have their own
dtypes and shapes. Its *entries* are a small dict (DCP flattens it into
``weight.qdata``, ``weight.scale``, ...)::

    {"qdata": <DTensor of uint8>, "scale": <DTensor of bf16>, ..., "__quant__": '{"format": ...}'}

Each inner entry is a plain-tensor DTensor on the parameter's mesh that
*aliases* the parameter's inner tensor (no copy), so ``dcp.save`` writes the
stored bytes and ``dcp.load`` reads into the parameter in place. Its
placements follow from the layout: ``Shard(d)`` of the weight is ``Shard(d)``
of an inner tensor that is one-to-one, packed or blocked along ``d`` (the
chunks coincide whenever the weight's placement is legal, which is checked
here on every rank from shapes alone), and ``Replicate`` of one that is
constant along ``d``. DCP's own resharding then moves whole packs and blocks.
``__quant__`` is a JSON string (format, parameters, logical shape and dtype,
relations): readable without this library and safe under ``weights_only``.
Without a process group the entries are the weight's plain inner tensors.

The entries are made at the planner: ``dtensor_quant.checkpoint.save/load``
and ``dcp.save/load(..., planner=dq.checkpoint.SavePlanner() /
LoadPlanner())`` convert quantized values with :func:`entries_from_state`.
DCP's extension points for tensor subclasses (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) cannot do it under
DCP's default planners: those look every write and read up by the key of
the state dict, so a write item named ``weight.qdata`` is "not found"
(docs/checkpoint.md says what else was tried). A quantized value that
reaches a default planner is refused naming the fix (``dcp_refusal``).

The entry form stays reachable: :func:`entries_from_state` converts a state
dict, and ``tensor_state_dicts(model, enabled=False)`` makes a model's own
``state_dict()`` return entries (for plain DCP with its default planners).
:func:`register` installs the module hooks; :func:`dtensor_quant.quantize_`
calls it. The on-disk format is documented in ``docs/checkpoint.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .._core.dispatch import implements_method
from .._core.format import QuantFormat, weight_layout
from .._core.layout import (
    Blocked,
    Constant,
    FlatBlocked,
    InFlat,
    LayoutError,
    OneToOne,
    Packed,
    inner_slice,
    partial_refused,
)
from .._core.notes import watch
from .._core.tensor import QuantizedTensor, contiguous_strides
from .._ops.layout_ops import canonical_dims, canonical_inner
from .._parallel.quantize import quantize
from .load_guard import LoadGuard

SPEC_KEY = "__quant__"
SPEC_VERSION = 1


class CheckpointFormatError(ValueError):
    """A checkpoint entry that does not fit the model's parameter (format, shape or layout)."""


# -- the format spec: what a reader needs to interpret the entries ----------------


def relation_name(rel) -> str:
    """``one-to-one``, ``packed:2``, ``blocked:128`` or ``constant`` (the on-disk spelling)."""
    if isinstance(rel, OneToOne):
        return "one-to-one"
    if isinstance(rel, Packed):
        return f"packed:{rel.p}"
    if isinstance(rel, Blocked):
        return f"blocked:{rel.b}"
    if isinstance(rel, Constant):
        return "constant"
    if isinstance(rel, FlatBlocked):
        return f"flat-{'packed' if rel.packed else 'blocked'}:{rel.b}:{rel.row}"
    if isinstance(rel, InFlat):
        return f"in-flat:{rel.n}"
    raise LayoutError(f"relation {rel} has no checkpoint form")


def quant_record(fmt: QuantFormat, shape, dtype: torch.dtype, inner_dtypes: Mapping[str, torch.dtype]) -> dict:
    """The ``__quant__`` record of a weight of ``shape``/``dtype`` in ``fmt`` (JSON-able).

    Formerly ``format_spec``, a name it shared with the module
    :mod:`dtensor_quant._model.format_spec` (format names from command-line
    strings); the old name stays as an alias.
    """
    return {
        "version": SPEC_VERSION,
        "format": type(fmt).__name__,
        "params": record_params(fmt),
        "description": str(fmt),
        "shape": [int(n) for n in shape],
        "dtype": str(dtype).removeprefix("torch."),
        "inner": {
            name: {"dtype": str(inner_dtypes[name]).removeprefix("torch."), "layout": [relation_name(r) for r in rels]}
            for name, rels in weight_layout(fmt, shape).items()
        },
    }


def record_params(fmt: QuantFormat) -> dict:
    """A format's parameters as its ``__quant__`` record holds them (JSON values; a dtype as ``"torch.float32"``).

    A parameter that is None is left out: a format without an optional
    parameter added later (a scale dtype, say) keeps the record, and so the
    checkpoints, it had before the parameter existed.
    """
    fields = dataclasses.fields(fmt) if dataclasses.is_dataclass(fmt) else ()
    params = {f.name: getattr(fmt, f.name) for f in fields if getattr(fmt, f.name) is not None}
    return json.loads(json.dumps(params, default=repr))


format_spec = quant_record  # the old name


def _format_classes(cls=QuantFormat) -> dict[str, type]:
    out = {}
    for sub in cls.__subclasses__():
        out.setdefault(sub.__name__, sub)
        out.update({k: v for k, v in _format_classes(sub).items() if k not in out})
    return out


def format_of_record(record: Mapping) -> QuantFormat:
    """The format a record names: ``{"format": "NF4", "params": {"block_size": 64, ...}}`` (as :func:`quant_record`
    writes it) -> ``NF4(block_size=64, ...)``.

    Dtype parameters come back from their names (formats accept them). A name
    no format of this process has, or parameters it does not take, raise
    :class:`CheckpointFormatError` naming the record.
    """
    name, params = record.get("format"), record.get("params") or {}
    classes = _format_classes()
    if name not in classes:
        raise CheckpointFormatError(
            f"the checkpoint names format {name!r}, which no format of this process is called; known: "
            f"{sorted(n for n in classes if not n.startswith('_'))} (a custom format must be imported first)"
        )
    try:
        return classes[name](**params)
    except (TypeError, ValueError) as e:
        raise CheckpointFormatError(f"the checkpoint's format {name}{params} cannot be built: {e}") from None


def parse_spec(value, key: str) -> dict:
    if isinstance(value, dict):
        return value
    try:
        spec = json.loads(value)
    except (TypeError, ValueError):
        raise CheckpointFormatError(f"{key}.{SPEC_KEY}: not a dtensor_quant format record: {value!r:.200}") from None
    if not isinstance(spec, dict) or "format" not in spec:
        raise CheckpointFormatError(f"{key}.{SPEC_KEY}: not a dtensor_quant format record: {value!r:.200}")
    if not isinstance(spec.get("shape"), list) or not isinstance(spec.get("dtype"), str):
        raise CheckpointFormatError(
            f"{key}.{SPEC_KEY}: the format record's 'shape' ({spec.get('shape')!r:.60}) or 'dtype' "
            f"({spec.get('dtype')!r:.60}) is damaged: expected a list of sizes and a dtype name"
        )
    return spec


def check_spec(found: dict, expected: dict, key: str) -> None:
    """Raise, naming both, unless a checkpoint's record fits the model's parameter."""
    if (found["format"], found.get("params")) != (expected["format"], expected["params"]):
        raise CheckpointFormatError(
            f"{key}: the checkpoint holds {found.get('description', found['format'])}, but the model's "
            f"parameter is {expected['description']}. Quantize the model with "
            f"{found.get('description', found['format'])} before loading this checkpoint "
            "(quantized bytes are never silently requantized)."
        )
    if list(found["shape"]) != list(expected["shape"]) or found["dtype"] != expected["dtype"]:
        raise CheckpointFormatError(
            f"{key}: the checkpoint holds a {found['dtype']} weight of shape {tuple(found['shape'])}, the model's "
            f"parameter is {expected['dtype']} of shape {tuple(expected['shape'])} ({expected['description']})."
        )


# -- placements of the entries ----------------------------------------------------


def _quantized_local(value) -> QuantizedTensor | None:
    local = value._local_tensor if isinstance(value, DTensor) else value
    return local if isinstance(local, QuantizedTensor) else None


def is_quantized(value) -> bool:
    return _quantized_local(value) is not None


def canonical_view(
    value, key: str
) -> tuple[QuantizedTensor, dict[str, torch.Tensor], tuple[int, ...], tuple[int, ...]]:
    """The local weight, its canonical inner tensors, and the logical->canonical dim map and canonical shape."""
    q = _quantized_local(value)
    inner = canonical_inner(q) if q.ndim >= 2 else None
    if inner is not None:
        to_canonical = tuple(d[0] for d in q.dims)
        shape = [0] * q.ndim
        for d, c in enumerate(to_canonical):
            shape[c] = value.shape[d]
        layout = weight_layout(q.fmt, shape)
    if inner is None or any(rels != layout[n] for n, rels in zip(q.fmt.inner_names, _canonical_rels(q))):
        raise CheckpointFormatError(
            f"{key}: a {q!r} is not a plain quantized weight (it was flattened, or gathered from "
            "shards with different scales), so it has no checkpoint form. Checkpoint the parameter, not a view."
        )
    return q, inner, to_canonical, tuple(shape)


def _canonical_rels(q: QuantizedTensor):
    order = [d[0] for d in q.dims]
    for rels in q.rels:
        out = [None] * len(rels)
        for d, c in enumerate(order):
            out[c] = rels[d]
        yield tuple(out)


def entry_placements(placements, rels, to_canonical) -> tuple:
    """An inner tensor's placements: a logical shard follows it unless the inner is constant there."""
    out = []
    for p in placements:
        if isinstance(p, Partial):
            raise partial_refused("a quantized weight", p, " (it has no checkpoint form)")
        if isinstance(p, (Shard, _StridedShard)):
            c = to_canonical[p.dim]
            if isinstance(rels[c], Constant):
                out.append(Replicate())
            elif isinstance(p, _StridedShard):
                out.append(_StridedShard(c, split_factor=p.split_factor))
            else:
                out.append(Shard(c))
        else:
            out.append(Replicate())
    return tuple(out)


def entry_shape(rels, shape) -> tuple[int, ...]:
    return tuple(r.inner_len(n) for r, n in zip(rels, shape))


@functools.lru_cache(maxsize=1024)
def check_entry_chunks(fmt: QuantFormat, shape: tuple, mesh_shape: tuple, placements: tuple) -> None:
    """Verify, for every rank of the mesh, that DCP's chunk of each inner entry is its logical chunk.

    ``shape`` and ``placements`` are canonical. Pure arithmetic on shapes, so
    every rank reaches the same verdict before any collective.
    """
    sharding = [n if isinstance(p, (Shard, _StridedShard)) else 1 for n, p in zip(mesh_shape, placements)]
    for coord in itertools.product(*(range(n) for n in sharding)):  # replicated mesh dims change nothing
        l_shape, l_off = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        for name, rels in weight_layout(fmt, shape).items():
            e_place = entry_placements(placements, rels, tuple(range(len(shape))))
            g_shape = entry_shape(rels, shape)
            e_shape, e_off = _compute_local_shape_and_global_offset(g_shape, mesh_shape, list(coord), e_place)
            for dim, rel in enumerate(rels):
                got = (e_shape[dim], e_off[dim])
                if isinstance(rel, Constant):
                    ok = got == (1, 0)
                elif l_shape[dim] == 0:
                    ok = e_shape[dim] == 0
                else:
                    lo, hi = l_off[dim], l_off[dim] + l_shape[dim]
                    try:
                        i0, i1, _ = inner_slice(rel, lo, hi, shape[dim])
                        ok = got == (i1 - i0, i0)
                    except LayoutError:
                        ok = False
                if not ok:
                    raise LayoutError(
                        f"{fmt}: under placements {list(placements)} on mesh {mesh_shape}, the rank at {coord} "
                        f"holds [{l_off[dim]}, {l_off[dim] + l_shape[dim]}) of dim {dim} of a {shape} weight, "
                        f"which inner '{name}' ({rel}) cannot follow as one DTensor chunk, so this placement "
                        "cannot be checkpointed. dtensor_quant.check_placements() lists legal ones."
                    )


# -- weight -> entries -------------------------------------------------------------


class Entries(dict):
    """One quantized weight's entries (what :func:`to_entries` returns): a dict that checks the format record a
    plain ``dcp.load`` reads into it before any byte of the load reaches the model.

    The entries alias the parameter's inner tensors, so ``dcp.load`` writes
    the checkpoint's bytes straight into the parameter; DCP reads the
    ``__quant__`` record in the same pass, and ``load_state_dict`` checked it
    only after the bytes were written. DCP calls nothing of a state dict's
    between reading its metadata and writing, except this: its load planner
    assigns every value back into its dict (``_init_state_dict``) as it sets
    up the load, which a save never does. That assignment of the record
    arms a :class:`~.load_guard.LoadGuard` over the state dict this dict came
    from (``siblings``: the dict ``model.state_dict()`` built, its dense
    tensors too) or joins the one ``dq.checkpoint.LoadPlanner`` made: until
    every record the load reads is checked, each chunk DCP reads goes into a
    scratch copy, not into the model. The record is each dict's first entry,
    so DCP usually reads it before the weight's chunks; a dense tensor or a
    chunk read before the last record is staged. Records that fit commit the
    staged chunks; one that does not raises :class:`CheckpointFormatError`
    with the model untouched.

    Pickles, and deep-copies, as an ``OrderedDict`` (``weights_only`` loads stay safe).
    """

    def __init__(self, key: str, record: str, siblings: Mapping | None = None):
        super().__init__()
        dict.__setitem__(self, SPEC_KEY, record)
        self._key, self._record, self._siblings = key, record, siblings
        self.guard: LoadGuard | None = None  # the load this dict is in, while it is armed

    def __setitem__(self, name, value) -> None:
        if name == SPEC_KEY and value is dict.get(self, SPEC_KEY):
            self._arm()  # DCP's load planner, setting up a load
        elif name == SPEC_KEY and self.guard is not None:
            self.guard.check(self, value)  # the checkpoint's record, read by the load
        dict.__setitem__(self, name, value)

    def __reduce__(self):  # as an OrderedDict (a state dict's own type), which weights_only loads accept
        return collections.OrderedDict, (), None, None, iter(self.items())

    def staged(self) -> bool:
        """Whether a load read chunks into scratch copies that no record committed (a record never read)."""
        return self.guard is not None and self.guard.holds(self)

    def disarm(self) -> None:
        """Drop what the load staged (nothing of it is written) and disarm."""
        if self.guard is not None:
            self.guard.abort()

    def check_record(self, value) -> None:
        """Raise :class:`CheckpointFormatError` unless ``value`` is a record this weight can load."""
        try:
            check_spec(parse_spec(value, self._key), parse_spec(self._record, self._key), self._key)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(
                f"{e} Nothing was written into the parameter, nor anything else of this load: the load checks every "
                "record before the bytes it read reach the model."
            ) from None

    def _arm(self) -> None:
        if self.guard is not None and self.guard.set_up(self):
            return  # a guard of this set-up pass already holds this dict
        if self.guard is not None:
            self.guard.abort()  # a load that ended before reading
        guard_state_dict(self._siblings if self._siblings is not None else {self._key: self}, self).set_up(self)


def guard_state_dict(state_dict: Mapping, required=None) -> LoadGuard:
    """A :class:`~.load_guard.LoadGuard` over every weight's entries and every dense tensor of ``state_dict``
    (nested), for one load; ``required`` (entries) is guarded even where ``state_dict`` does not hold it."""
    groups, dense = [], []

    def walk(d):
        for v in d.values():
            if isinstance(v, Entries):
                groups.append(v)
            elif isinstance(v, Mapping):
                walk(v)
            elif isinstance(v, torch.Tensor) and not is_quantized(v):
                dense.append(v)

    walk(state_dict)
    if required is not None and all(g is not required for g in groups):
        groups.append(required)
    for g in groups:
        if g.guard is not None:
            g.guard.abort()
    return LoadGuard(groups, dense)


# -- weight -> entries -------------------------------------------------------------


def to_entries(value, key: str = "weight", siblings: Mapping | None = None) -> dict:
    """The state-dict form of a quantized weight (entries alias its inner tensors).

    A checkpoint loader writes into the entries with plain ``copy_``: the
    weight's bytes record watches them, so kernels prepared from the old
    bytes are rebuilt (:func:`dtensor_quant._core.notes.watch`).
    """
    q, inner, to_canonical, shape = canonical_view(value, key)
    watch(q.notes, inner.values())
    spec = quant_record(q.fmt, shape, value.dtype, {n: t.dtype for n, t in inner.items()})
    out = Entries(key, json.dumps(spec, sort_keys=True), siblings)  # the record first: DCP reads it first, if it can
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        canon = entry_placements(value.placements, (OneToOne(),) * len(shape), to_canonical)
        check_entry_chunks(q.fmt, shape, tuple(mesh.shape), canon)
        layout = weight_layout(q.fmt, shape)
        for name, t in inner.items():
            rels = layout[name]
            placements = entry_placements(value.placements, rels, to_canonical)
            g_shape = entry_shape(rels, shape)
            out[name] = DTensor.from_local(
                t, mesh, placements, run_check=False, shape=g_shape, stride=contiguous_strides(g_shape)
            )
    else:
        out.update({n: t.detach() for n, t in inner.items()})  # aliases of its own (DCP's hook goes on them)
    return out


def entries_from_state(state_dict: dict, _root: dict | None = None) -> dict:
    """A shallow copy of ``state_dict`` (nested) with every quantized value in its entry form.

    The entries know the copy they are in (``siblings``): a plain ``dcp.load`` into it holds back every chunk
    it reads, dense tensors included, until every format record of the load is checked."""
    out = {}
    root = out if _root is None else _root
    for k, v in state_dict.items():
        if isinstance(v, dict) and SPEC_KEY not in v:
            out[k] = entries_from_state(v, root)
        elif isinstance(v, torch.Tensor) and is_quantized(v):
            out[k] = to_entries(v, str(k), siblings=root)
        else:
            out[k] = v
    return out


# -- entries -> weight -------------------------------------------------------------


def from_entries(entries: Mapping, like, key: str = "weight") -> torch.Tensor:
    """A quantized weight placed like parameter ``like``, built from its entries.

    Entries may be DTensors in ``like``'s entry placements (what ``dcp.load``
    fills: no copy), other DTensors, or full plain tensors (a full state dict);
    the result always holds this rank's chunk. Raises
    :class:`CheckpointFormatError` naming both formats if they differ.
    """
    q, inner, to_canonical, shape = canonical_view(like, key)
    expected = quant_record(q.fmt, shape, like.dtype, {n: t.dtype for n, t in inner.items()})
    if SPEC_KEY in entries:
        check_spec(parse_spec(entries[SPEC_KEY], key), expected, key)
    missing = [n for n in q.fmt.inner_names if n not in entries]
    if missing:
        raise CheckpointFormatError(
            f"{key}: entries {missing} of {expected['description']} are missing (found {sorted(entries)})"
        )
    local, layout = {}, weight_layout(q.fmt, shape)
    for name in q.fmt.inner_names:
        e = entries[name]
        rels = layout[name]
        g_shape = entry_shape(rels, shape)
        if tuple(e.shape) != g_shape or e.dtype != inner[name].dtype:
            raise CheckpointFormatError(
                f"{key}.{name}: the entry is {tuple(e.shape)}:{e.dtype}, {expected['description']} "
                f"of shape {tuple(shape)} needs {g_shape}:{inner[name].dtype}"
            )
        local[name] = _local_chunk(e, like, rels, to_canonical) if isinstance(like, DTensor) else _full(e)
    rels = tuple(layout.values())
    rebuilt = QuantizedTensor(
        local, q.fmt, rels, canonical_dims(len(shape)), _local_shape(like, to_canonical), like.dtype
    )
    if to_canonical != tuple(range(len(shape))):
        rebuilt = rebuilt.transpose(-2, -1)
    if not isinstance(like, DTensor):
        return rebuilt
    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(rebuilt, mesh, placements, run_check=False, shape=like.shape, stride=like.stride())


def _full(e: torch.Tensor) -> torch.Tensor:
    return e.full_tensor() if isinstance(e, DTensor) else e


def _local_shape(like, to_canonical) -> tuple[int, ...]:
    local = like._local_tensor if isinstance(like, DTensor) else like
    shape = [0] * local.ndim
    for d, c in enumerate(to_canonical):
        shape[c] = local.shape[d]
    return tuple(shape)


def _local_chunk(e: torch.Tensor, like: DTensor, rels, to_canonical) -> torch.Tensor:
    mesh = like.device_mesh
    placements = entry_placements(like.placements, rels, to_canonical)
    if isinstance(e, DTensor) and e.device_mesh == mesh:
        if tuple(e.placements) != placements:
            e = e.redistribute(mesh, placements)
        return e._local_tensor
    full = _full(e)
    return distribute_tensor(full, mesh, placements, src_data_rank=None)._local_tensor


def quantize_like(dense: torch.Tensor, like, key: str = "weight") -> torch.Tensor:
    """Quantize a dense weight (full tensor or DTensor) into ``like``'s format and placement.

    A sharded target is quantized shard by shard with the scale reductions its
    layout needs, so the scales are those of the full tensor, never per chunk.
    """
    q = _quantized_local(like)
    dense = dense.detach()  # a value to load (a parameter of another model, say), never a graph to extend
    if q.dims != canonical_dims(q.ndim):
        raise CheckpointFormatError(f"{key}: cannot quantize a dense checkpoint into a transposed quantized view")
    if tuple(dense.shape) != tuple(like.shape):
        raise CheckpointFormatError(
            f"{key}: the checkpoint holds a dense weight of shape {tuple(dense.shape)}, the model's "
            f"parameter is {q.fmt} of shape {tuple(like.shape)}"
        )
    if not isinstance(like, DTensor):
        return quantize(_full(dense).to(like.dtype), q.fmt)
    mesh, placements = like.device_mesh, tuple(like.placements)
    if isinstance(dense, DTensor) and dense.device_mesh == mesh:
        dense = dense if tuple(dense.placements) == placements else dense.redistribute(mesh, placements)
    else:
        dense = distribute_tensor(_full(dense), mesh, placements, src_data_rank=None)
    return quantize(dense.to(like.dtype), q.fmt)


# -- DCP's default planners meet a quantized value --------------------------------------


def dcp_refusal(what: str) -> CheckpointFormatError:
    """The error for a quantized value that reached one of DCP's default planners unconverted."""
    return CheckpointFormatError(
        f"{what}: a quantized weight reached DCP's default planner, which gives each state-dict value one key; "
        "its inner tensors need one key each. Save and load with dtensor_quant.checkpoint.save/load, pass "
        "planner=dtensor_quant.checkpoint.SavePlanner() (LoadPlanner() to load) to dcp.save/dcp.load, or convert "
        "the state dict first with dtensor_quant.checkpoint.entries_from_state(state_dict) (or make the model's own "
        "state dicts entries: dtensor_quant.checkpoint.tensor_state_dicts(model, enabled=False))."
    )


@implements_method("dcp_write_items")
def _dcp_write_items(q, fqn, obj):
    raise dcp_refusal(f"dcp.save of '{fqn}'")


@implements_method("dcp_chunk_list")
def _dcp_chunk_list(q):
    raise dcp_refusal(f"dcp.load into a {q.fmt} weight of shape {tuple(q.shape)}")


@implements_method("dcp_tensor_shard")
def _dcp_tensor_shard(q, index):
    raise dcp_refusal(f"DCP's lookup of '{index.fqn}'")


# -- module hooks ---------------------------------------------------------------------

TENSORS = "_dtensor_quant_tensor_state"  # on a module: False if its state dicts hold entries (the opt-out)


def tensor_state_dicts(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Choose the form of quantized weights in ``model.state_dict()``: tensors (the default) or entries.

    Tensors (``enabled=True``, what every quantized model does unless told
    otherwise): each quantized weight is itself, or its DTensor;
    ``get_model_state_dict``, ``load_state_dict`` (bytes copied in place) and
    ``set_model_state_dict`` follow, and DCP needs the planners that make the
    entries (module docstring). ``enabled=False`` opts the model out: its
    state dicts hold the entry dicts, which plain DCP with its default
    planners saves and loads (but which are not tensors: code that calls
    ``.shape`` on state-dict values fails on them).
    """
    register(model)
    for module in model.modules():
        module.__dict__[TENSORS] = enabled
    return model


def _state_dict_hook(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    if module.__dict__.get(TENSORS, True):
        return
    for name, param in module._parameters.items():
        key = prefix + name
        if param is not None and is_quantized(param) and key in state_dict:
            state_dict[key] = to_entries(state_dict[key], key, siblings=state_dict)


def _load_hook(module: nn.Module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    for name, param in module._parameters.items():
        if param is None or not is_quantized(param):
            continue
        key = prefix + name
        flat = {k[len(key) + 1 :]: k for k in state_dict if k.startswith(key + ".")}
        value = state_dict.get(key)
        if flat and value is None:
            value = {short: state_dict.pop(full) for short, full in flat.items()}
        if isinstance(value, Entries) and value.staged():
            value.disarm()
            raise CheckpointFormatError(
                f"{key}: the load read this weight's entries without their {SPEC_KEY} format record (the "
                "checkpoint has none), so nothing the load read was written into the model: a record is what says "
                "the bytes are in the parameter's format. Load a checkpoint saved with its records."
            )
        if isinstance(value, Mapping):
            try:
                state_dict[key] = from_entries(value, param, key)
            except CheckpointFormatError as e:
                if not _aliases(value, param):
                    raise
                raise CheckpointFormatError(
                    f"{e} These entries are the parameter's own inner tensors (model.state_dict()), so a dcp.load "
                    "into them has already written the checkpoint's bytes into the parameter: rebuild or reload the "
                    "model. dtensor_quant.checkpoint.load checks every format record before reading any tensor."
                ) from None
        elif isinstance(value, torch.Tensor) and not is_quantized(value):
            state_dict[key] = quantize_like(value, param, key)
        elif value is not None and is_quantized(value):
            found, want = _quantized_local(value).fmt, _quantized_local(param).fmt
            if found != want:
                raise CheckpointFormatError(f"{key}: the state dict holds {found}, the model's parameter is {want}")


def _aliases(entries: Mapping, param) -> bool:
    """Whether any entry shares memory with ``param``'s inner tensors (a ``state_dict()`` entry, not a copy)."""
    q = _quantized_local(param)
    ours = {t.untyped_storage().data_ptr() for t in q.inner.values() if t.untyped_storage().nbytes()}
    for e in entries.values():
        if isinstance(e, torch.Tensor):
            local = e._local_tensor if isinstance(e, DTensor) else e
            if local.untyped_storage().nbytes() and local.untyped_storage().data_ptr() in ours:
                return True
    return False


def register(model: nn.Module) -> nn.Module:
    """Install the state-dict hooks of ``model``'s quantized weights (idempotent).

    On every module that owns a quantized parameter: a load pre-hook (a
    quantized value's format checked, a dense value quantized, entries
    rebuilt) and a state-dict post-hook that gives entries to a module opted
    out of tensors (:func:`tensor_state_dicts`). Deep copies keep them.
    """
    for module in model.modules():
        if getattr(module, "_dtensor_quant_hooks", False):
            continue
        if any(p is not None and is_quantized(p) for p in module._parameters.values()):
            module.register_state_dict_post_hook(_state_dict_hook)
            module.register_load_state_dict_pre_hook(_load_hook)
            module._dtensor_quant_hooks = True
    return model
