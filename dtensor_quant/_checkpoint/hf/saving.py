"""``save``: every rank computes the same file layout, rank 0 writes the headers, each rank writes its own slices.

Weights in a format's Hugging Face layout are written as stored; every other
weight is dense, with LoRA adapters merged into their base weights on the way
and the padding of :func:`~dtensor_quant.pad_for_tp` left out.

The save runs in steps, and the ranks agree on the outcome of each before the
next (:func:`~dtensor_quant._parallel.agree.raise_together`): a failure on any rank (a
refused model, an unwritable directory, a full disk) raises on every rank
within one all-gather, never leaving the others in a barrier until the process
group's timeout. New files are written into a staging directory inside the
export directory and moved into place only after every rank's bytes are on
disk, so a failed save leaves the previous export as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..._core.layout import Blocked, Constant, OneToOne, Packed
from ..._core.tensor import QuantizedTensor
from ..._parallel import liveness
from ..._parallel.agree import LOCAL, raise_together
from ..errors import CheckpointSaveError
from ..state_dict import canonical_view, entry_placements, entry_shape, is_quantized
from .adapters import Delta, Wrapper, unwrap
from .io import commit
from .io.commit import STAGING
from .io.safetensors_io import INDEX, NAMES, SINGLE, byte_runs
from .producers.export_ct import QUANTIZATIONS as CT_QUANTIZATIONS
from .producers.export_ct import CompressedTensorsExport
from .producers.native import NATIVE, NATIVE_VERSION, native_groups, native_suffixes
from .tensors import (
    agreement_scope,
    describe,
    first_replica,
    index_lists,
    local_tensor,
    model_tensors,
    refuse_partial,
    regions,
    stored_suffixes,
    unpadded_shapes,
)

QUANTIZATIONS = (*CT_QUANTIZATIONS, NATIVE)


@dataclass
class _Item:
    """One tensor of the export, as this rank sees it."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # in the file (padding left out)
    spans: list  # this rank's boxes to write, as tensors.regions gives them (empty: another rank writes)
    fetch: Callable[[], torch.Tensor]  # this rank's local tensor, in ``dtype`` (called only when ``spans``)
    padding: tuple[int, int, list] | None = None  # (dim, kept length, local indices): the left-out part must be 0


def _export_items(
    model: nn.Module, dtype: torch.dtype, merge_lora: bool, adapters: dict, full: dict, leader: bool, export=None
) -> list[_Item]:
    """Every tensor of the export, checked: no collective, no write, the same verdict on every rank.

    ``adapters`` is filled with the adapter tensors to merge (id -> tensor);
    the merged slices read them from ``full``, filled once they are gathered.
    """
    unpadded, padding_buffers = unpadded_shapes(model)
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    items, refused, unmerged = [], {}, []
    for key, wrapper, t in model_tensors(model):
        if t.device.type == "meta":
            raise ValueError(
                f"{key or names.get(id(t), '?')} is on the meta device: it holds no values to save. Materialize the "
                "model first (to_empty(device=...), then load or initialise its weights)"
            )
        if wrapper is not None and wrapper.refused is not None:
            refused.setdefault(wrapper.refused, []).append(names.get(id(t), "?"))
            continue
        if key is None:  # an adapter's own tensor
            name = names.get(id(t), "?")
            if merge_lora:
                continue
            if wrapper.kind != "dq.lora":
                unmerged.append(name)
                continue
            items.append(_dense_item(name, t, dtype, None, lambda t=t: local_tensor(t), leader))
            continue
        if id(t) in padding_buffers:
            continue  # the export is unpadded: nothing to record
        merging = merge_lora and wrapper is not None and wrapper.deltas and _is_base_weight(wrapper, t)
        if export is not None and is_quantized(t):  # a producer's layout (quantization="compressed-tensors")
            if merging:
                raise ValueError(f"{key}: merging LoRA adapters would change its stored bytes; merge them first "
                                 "(peft: dq.lora.merge_and_unload) or save with merge_lora=False")  # fmt: skip
            if key in unpadded:
                raise ValueError(f"{key}: a weight padded by pad_for_tp is not written as {quantization_name(export)}")
            items += [_Item(*x) for x in export.items(key, t, leader)]
            continue
        suffixes = stored_suffixes(t)
        if suffixes is not None and merging:
            raise ValueError(
                f"{key}: merging LoRA adapters changes this {describe(t)} weight, whose stored bytes are "
                "written as they are; save with merge_lora=False (adapters as their own tensors), or merge "
                "into a dense copy of the model"
            )
        if suffixes is not None:
            items += _stored_items(key, t, suffixes, unpadded.get(key), leader)
            continue
        if merging:
            for d in wrapper.deltas:
                adapters[id(d.a)], adapters[id(d.b)] = d.a, d.b
            fetch = _merged_fetch(t, wrapper.deltas, full)
        else:
            fetch = _plain_fetch(t)
        items.append(_dense_item(key, t, dtype, unpadded.get(key), fetch, leader))
    if refused:
        lines = [f"{why}: {keys[:6]}{' ...' if len(keys) > 6 else ''}" for why, keys in refused.items()]
        raise ValueError(
            "cannot export adapter layers that are not merged into plain weights (from_pretrained would leave "
            "the wrapped weights randomly initialized):\n  " + "\n  ".join(lines) + "\nMerge them yourself "
            "(peft: merge_and_unload()) or save the adapters with their own library"
        )
    if unmerged:
        raise ValueError(
            f"merge_lora=False would write peft's adapter tensors {unmerged[:6]}{' ...' if len(unmerged) > 6 else ''} "
            "under names no Hugging Face model has; save with merge_lora=True (adapters merged into the weights), "
            "or save the adapters with peft's save_pretrained"
        )
    return items


class NativeExport:
    """``quantization="dtensor_quant"``: every quantized weight, any format, as its inner tensors ``{key}.{name}``.

    The stored bytes as they are (no producer's layout to fit), with a
    ``quantization_config`` naming each weight's format, so that
    :func:`~.loading.load` and transformers' ``from_pretrained`` (with
    :class:`dtensor_quant.hf.QuantConfig` registered) read them back as stored.
    """

    def __init__(self):
        self.weights: dict = {}  # key -> format

    def items(self, key: str, t: torch.Tensor, leader: bool) -> list[tuple]:
        fmt = canonical_view(t, key)[0].fmt
        self.weights[key] = fmt
        out = _stored_items(key, t, native_suffixes(fmt), None, leader)
        return [(i.key, i.dtype, i.shape, i.spans, i.fetch) for i in out]

    def config(self, dense_linears: list[str]) -> dict:
        return native_config(self.weights)


def native_config(weights: dict, base: dict | None = None) -> dict:
    """The ``quantization_config`` of a ``dtensor_quant`` checkpoint holding ``weights`` (key -> format) as stored."""
    return {**(base or {}), "quant_method": NATIVE, "version": NATIVE_VERSION, "config_groups": native_groups(weights)}


def _is_base_weight(wrapper: Wrapper, t: torch.Tensor) -> bool:
    return getattr(getattr(wrapper.module, wrapper.base), "weight", None) is t


def _dense_item(key, t, dtype, unpadded, fetch, leader: bool) -> _Item:
    out_dtype = dtype if t.is_floating_point() else t.dtype
    shape = tuple(t.shape)
    mesh, placements = (t.device_mesh, t.placements) if isinstance(t, DTensor) else (None, None)
    refuse_partial(t)
    writes = first_replica(mesh, placements, leader)
    spans = regions(shape, mesh, placements, unpadded) if writes else []
    padding = None
    if unpadded is not None and (writes or mesh is None):  # a model without DTensors: every rank checks its padding
        dim = next(d for d, (n, m) in enumerate(zip(shape, unpadded)) if n != m)
        index = index_lists(shape, mesh, placements) if mesh is not None else [range(n) for n in shape]
        padding = (dim, unpadded[dim], index[dim])

    def cast():
        local = fetch()
        if isinstance(local, QuantizedTensor):
            return local.dequantize(dtype)
        return local.to(out_dtype)

    return _Item(key, out_dtype, tuple(unpadded or shape), spans, cast, padding)


def _stored_items(key, t, suffixes, unpadded, leader: bool) -> list[_Item]:
    """The inner tensors of a weight written as stored, each under its suffix (padding left out whole blocks)."""
    q, inner, to_canonical, shape = canonical_view(t, key)
    keep = shape
    if unpadded is not None:
        keep = tuple(unpadded[d] for d in sorted(range(len(shape)), key=lambda d: to_canonical[d]))
    out = []
    for name, rels in q.fmt.layout_for(shape).items():
        g_shape = entry_shape(rels, shape)
        for d, (n, m) in enumerate(zip(shape, keep)):
            if n != m and not isinstance(rels[d], (OneToOne, Packed, Blocked, Constant)):
                raise ValueError(f"{key}: {q.fmt}'s '{name}' ({rels[d]}) cannot leave out the padding of dim {d}")
        e_keep = entry_shape(rels, keep)
        mesh = t.device_mesh if isinstance(t, DTensor) else None
        placements = entry_placements(t.placements, rels, to_canonical) if mesh is not None else None
        spans = regions(g_shape, mesh, placements, e_keep) if first_replica(mesh, placements, leader) else []
        out.append(_Item(key + suffixes[name], inner[name].dtype, e_keep, spans, lambda x=inner[name]: x))
    return out


def quantization_name(export) -> str:
    return NATIVE if isinstance(export, NativeExport) else "compressed-tensors"


def _plain_fetch(t):
    return lambda: local_tensor(t)


def _merged_fetch(weight: torch.Tensor, deltas: list[Delta], full: dict):
    """This rank's slice of ``W + sum(scaling * B @ A)`` in fp32, then ``dtype``.

    Each delta is computed for this rank's rows and columns only, from the
    adapters gathered whole (they are small): any placement of the weight
    and of the adapters works, and no rank holds more than its own slice.
    """

    def fetch():
        base = local_tensor(weight)
        base = base.dequantize(torch.float32) if isinstance(base, QuantizedTensor) else base.float()
        if isinstance(weight, DTensor):
            rows, cols = index_lists(tuple(weight.shape), weight.device_mesh, weight.placements)
        else:
            rows, cols = range(weight.shape[0]), range(weight.shape[1])
        out = base
        for d in deltas:
            a, b = full[id(d.a)], full[id(d.b)]
            r, c = (cols, rows) if d.transposed else (rows, cols)
            part = torch.mm(b[_take(r)], a[:, _take(c)]) * d.scaling
            out = out + (part.t() if d.transposed else part)
        return out

    return fetch


def _take(index) -> slice | list:
    return slice(index.start, index.stop) if isinstance(index, range) else list(index)


def _gather_adapters(adapters: dict, full: dict) -> None:
    """Every adapter tensor whole, in fp32, on every rank (in the same order everywhere: a collective each)."""
    for k, t in adapters.items():
        t = t.detach()
        full[k] = (t.full_tensor() if isinstance(t, DTensor) else t).float()


DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def save(
    model: nn.Module,
    path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    merge_lora: bool = True,
    max_shard_bytes: int = 5 << 30,
    quantization: str | None = None,
    process_group=None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``from_pretrained`` reads.

    Every rank calls it; each writes the bytes of its own slices, whatever the
    placements (tensor parallel, FSDP2, both (``_StridedShard``), HSDP, expert
    stacks). Weights in a format with a Hugging Face layout
    (``checkpoint_suffixes``, e.g. FP8 block scales) are written as stored,
    with the format's ``quantization_config``; every other weight is dense
    ``dtype``. LoRA adapters (:mod:`dtensor_quant.lora`, and peft's LoRA
    layers) are merged into their weights (``merge_lora``; with False, the
    library's own are written as ``<layer>.lora_a.weight``/``lora_b.weight``
    beside the base weight and peft's are refused); adapters that cannot be
    merged (DoRA, other peft tuners) are refused, naming them. MLPs padded by
    :func:`~dtensor_quant.pad_for_tp` are written at their original size
    (the padding must be zero). ``model.config`` (transformers) is saved
    alongside. Files over ``max_shard_bytes`` are split with an index.

    ``quantization="dtensor_quant"``: every quantized weight, in any format,
    is written as its stored inner tensors (``{key}.{name}``) with a
    ``quantization_config`` naming each weight's format; :func:`load` reads it
    back as stored, and so does transformers' ``from_pretrained`` once
    :mod:`dtensor_quant.hf` is imported (:class:`dtensor_quant.hf.QuantConfig`).

    ``quantization="compressed-tensors"``: every quantized weight is written
    in compressed-tensors' layout instead (the formats it can express, as
    their stored bytes: :mod:`~dtensor_quant._checkpoint.hf.export_ct`), with
    its ``quantization_config``, for vLLM and transformers; a weight it cannot
    express raises ``ValueError`` on every rank before any file is written.

    A failure on any rank raises on every rank, and the previous contents of
    ``path`` stay as they were until every rank's bytes are written. A model
    without DTensors is each process's own: rank 0 writes it, with or
    without the others calling ``save`` too. Another rank that calls it
    makes every check that does not need rank 0's writes (the arguments, the
    model: adapters, the export's formats, the padding, tensors on the meta
    device; the path, by creating the directory and a file in it), raising
    what rank 0 raises, and returns without waiting for rank 0: a failure of
    rank 0's own writes (a full disk, an I/O error, the config's
    ``save_pretrained``) is raised on rank 0 alone. Pass the group of the
    ranks that call ``save`` together as ``process_group``
    (``torch.distributed.group.WORLD``) to have every one of them raise
    every failure, as for a distributed model (one small all-gather per
    step; the group's first rank writes). ``process_group`` is ignored for a
    model with DTensors: the ranks of its mesh agree.
    """
    path = Path(path)
    if not isinstance(model, nn.Module):
        raise TypeError(f"dq.hf.save takes a model (nn.Module), got {type(model).__name__}")
    if dtype not in DENSE_DTYPES:
        raise ValueError(
            f"save(dtype={dtype!r}): the dtype dense tensors are written in, one of "
            f"{', '.join(map(str, DENSE_DTYPES))} (float8 weights: quantize the model with a Float8 format, whose "
            "stored bytes and scales are written)"
        )
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"save(max_shard_bytes={max_shard_bytes!r}): the largest file's size, a positive integer")
    model = unwrap(model)
    what = f"dq.hf.save to {path}"
    adapters, full = {}, {}
    scope, leader = agreement_scope(model)
    if process_group is not None and scope.get("process_group") is LOCAL and dist.is_initialized():
        scope, leader = {"process_group": process_group}, dist.get_rank() == dist.get_global_rank(process_group, 0)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"save(quantization={quantization!r}): known are {QUANTIZATIONS}, or None (as stored)")
    export = {"compressed-tensors": CompressedTensorsExport, NATIVE: NativeExport}.get(quantization, lambda: None)()
    quant = {}

    def plan():
        items = _export_items(model, dtype, merge_lora, adapters, full, leader, export)
        if export is not None:
            dense = [f for f, m in model.named_modules() if isinstance(m, nn.Linear) and not is_quantized(m.weight)]
            quant.update(export.config(dense))
        return items, _layout(items, max_shard_bytes)

    staging, committed = path / STAGING, []
    try:
        items, files = raise_together(plan, what=what, **scope)
        _gather_adapters(adapters, full)  # the only collectives besides the agreements: before any write
        try:
            prepare = _create_files if leader else _probe if scope.get("process_group") is LOCAL else None
            raise_together(lambda: prepare and prepare(path, staging, files, items), what=what, **scope)
            raise_together(lambda: _write_slices(staging, items, files), what=what, **scope)
            step = lambda: _commit(model, path, staging, files, quant, committed) if leader else None  # noqa: E731
            raise_together(step, what=what, **scope)
        except Exception:
            if leader and not (path / commit.JOURNAL).exists():  # past the commit point the staged files are it
                shutil.rmtree(staging, ignore_errors=True)
            raise
    except Exception as e:
        if scope.get("process_group") is LOCAL or not liveness.is_collective_failure(e):
            raise
        raise _lost(path, e, scope, committed) from e


def _lost(path: Path, e: Exception, scope: dict, committed: list) -> CheckpointSaveError:
    """A collective of the save failed: name the ranks that stopped answering (a roll call over the mesh)."""
    mesh = scope.get("mesh")
    groups = [mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else [scope.get("process_group")]
    lost, how = liveness.roll_call(groups)
    leader = mesh.mesh.flatten().tolist()[0] if mesh is not None else 0
    if committed:
        held = f"{path} holds this export, complete (its files were moved into place)"
    elif leader in lost:
        held = (
            f"{path} holds the previous export, or this one if rank {leader} died after committing it (then "
            f"the next dq.hf.load or dq.hf.save finishes moving its files into place, as {commit.JOURNAL} lists)"
        )
    else:
        held = f"{path} holds the previous export as it was"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CheckpointSaveError(
        f"dq.hf.save to {path} did not complete: {liveness.describe(lost, how)}; {type(e).__name__}: "
        f"{first[:300]}. {held}.",
        lost,
    )


def _create_files(path: Path, staging: Path, files: dict, items=()) -> None:
    """Rank 0: the staging directory with every file at its final size, headers written."""
    path.mkdir(parents=True, exist_ok=True)
    commit.finish(path)  # a save killed after its commit point: its export first becomes whole
    shutil.rmtree(staging, ignore_errors=True)  # a save that died before its commit point
    staging.mkdir()
    for name, (header, size) in files.items():
        with open(staging / name, "wb") as f:
            f.write(header)
            f.truncate(size)


def _probe(path: Path, staging: Path, files: dict, items: list[_Item]) -> None:
    """Another rank's save of a model without DTensors (rank 0 writes it): the checks rank 0's writes make first.

    Such a model is each process's own (rank 0 may save it while the others
    do something else), so the ranks share no collective to agree through;
    without this a rank that calls ``save`` with the others returned as if it
    had saved while rank 0 raised. Creating the directory and a file in it
    raises here what rank 0 raises for a path that cannot be written, and
    the padding ``pad_for_tp`` added is checked as rank 0 checks it.
    """
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass
    for item in items:
        if item.padding is not None:
            _check_padding_is_zero(item, item.fetch())


def _write_slices(staging: Path, items: list[_Item], files: dict) -> None:
    """This rank's slices at their offsets (no collective: a failure here is agreed on afterwards)."""
    where = {k: (name, len(h) + e["data_offsets"][0]) for name, (h, _) in files.items() for k, e in _keys(h).items()}
    fds: dict[str, int] = {}
    try:
        for item in items:
            if not item.spans:
                continue
            local = item.fetch()
            if item.padding is not None:
                _check_padding_is_zero(item, local)
            name, start = where[item.key]
            fd = fds.get(name) or fds.setdefault(name, os.open(staging / name, os.O_WRONLY))
            for l_start, g_start, lengths in item.spans:
                part = local[tuple(slice(s, s + n) for s, n in zip(l_start, lengths))]
                data = part.contiguous().reshape(-1).view(torch.uint8).numpy()
                for pos, at, n in byte_runs(item.shape, g_start, lengths, item.dtype.itemsize):
                    os.pwrite(fd, memoryview(data)[pos : pos + n], start + at)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _check_padding_is_zero(item: _Item, local: torch.Tensor) -> None:
    dim, kept, index = item.padding
    dropped = [pos for pos, g in enumerate(index) if g >= kept]
    if dropped and local.index_select(dim, torch.tensor(dropped)).count_nonzero():
        raise ValueError(
            f"{item.key}: the padding pad_for_tp added (indices >= {kept} of dim {dim}) holds non-zero values, "
            "so the padded model computes something the unpadded export would not; nothing was written"
        )


def _commit(model: nn.Module, path: Path, staging: Path, files: dict, quant: dict | None, committed: list) -> None:
    """Rank 0: the index (if any) and the config into the staging directory, then all of it into place at once
    (:func:`.commit.commit`: a journal first, so a kill half-way is finished by the next reader)."""
    if len(files) > 1:
        weight_map = {k: name for name, (h, _) in files.items() for k in _keys(h)}
        total = sum(size - len(h) for h, size in files.values())
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        (staging / INDEX).write_text(text)
    _save_config(model, staging, quant or None)
    moves = [*files, *sorted(p.name for p in staging.iterdir() if p.name not in files)]  # weights, index, config
    stale = {p.name for p in path.glob("*.safetensors")} - set(files)
    if len(files) == 1:
        stale.add(INDEX)  # readers prefer an index: a stale one must go
    commit.commit(path, moves, sorted(stale))
    committed.append(True)


def _keys(header: bytes) -> dict:
    return {k: v for k, v in json.loads(header[8:]).items() if k != "__metadata__"}


def _layout(items: list[_Item], max_shard_bytes: int) -> dict[str, tuple[bytes, int]]:
    """File name -> (header bytes, file size), the same on every rank."""
    groups, size = [[]], 0
    for item in items:
        n = math.prod(item.shape) * item.dtype.itemsize
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((item.key, item.dtype, item.shape, n))
        size += n
    out = {}
    for i, group in enumerate(groups, 1):
        name = SINGLE if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for key, g_dtype, g_shape, n in group:
            if key in header:
                raise ValueError(f"two tensors of the export are named {key}")
            header[key] = {"dtype": NAMES[g_dtype], "shape": list(g_shape), "data_offsets": [at, at + n]}
            at += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        out[name] = (struct.pack("<Q", len(text)) + text, 8 + len(text) + at)
    return out


def _save_config(model: nn.Module, path: Path, quant: dict | None = None) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    if quant is None:
        quant = {}
        for _, _, t in model_tensors(model):
            if stored_suffixes(t) is not None:
                local = t._local_tensor if isinstance(t, DTensor) else t
                quant = local.fmt.hf_quantization_config or quant
    # The source checkpoint's quantization_config (a config read from a GPTQ directory) describes other files.
    had = "quantization_config" in config.__dict__
    previous = config.__dict__.pop("quantization_config", None)
    if quant:
        config.quantization_config = quant
    try:
        config.save_pretrained(path)
    finally:
        config.__dict__.pop("quantization_config", None)
        if had:
            config.quantization_config = previous
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(path)
