"""Hugging Face checkpoints in and out of quantized, sharded models: each rank reads and writes only its slices.

::

    with dq.hf.init_empty():                        # parameters on "meta", buffers (RoPE tables) real
        model = LlamaForCausalLM(config)
    dq.quantize_(model, dq.Int4Groupwise(128))      # meta: no memory, no data
    parallelize_module(model, mesh, plan)           # or fully_shard, or nothing
    dq.hf.materialize(model, "cpu")                 # allocates this rank's shards only
    dq.hf.load(model, "Llama-3-8B/")                # model.safetensors or model.safetensors.index.json
    dq.hf.save(model, "out/")                       # dense bf16 (FP8 block-scale weights as they are)

**Loading.** Keys are the checkpoint's own (transformers' state-dict names).
Every rank reads the safetensors headers itself, then, for each tensor of the
model in turn, only the byte ranges of its own slice (``os.preadv`` at the
offsets the header gives: whole rows are one read, a column slice one read per
row). A dense weight that the model holds quantized is then quantized as a
dense DCP checkpoint is (:func:`~dtensor_quant.state_dict.quantize_like`: the
slice placed like the parameter, through the quantize op): statistics that
span shards are all-reduced, so the bytes equal quantizing the full tensor and
then sharding it. Where no statistic spans rows (the layout says so) the slice
is read and quantized in runs of rows, so a rank holds its shards plus one
run at a time. A weight stored quantized in a layout a format declares
(``QuantFormat.checkpoint_suffixes``: FP8 block scales) is read as its inner
tensors and placed by :func:`~dtensor_quant.state_dict.from_entries`, without
dequantizing.

Why not torch's ``HuggingFaceStorageReader``: ``dcp.load`` plans one read of
the whole state dict, so every dense placeholder (the dense model's shards)
would exist at once before anything is quantized, and its reads go through
``safe_open``'s memory map, which cannot count what a rank reads. Reading one
tensor at a time needs no collective to plan (each rank knows its slice from
its DTensor), so nothing is gained from DCP's planning here.

**Saving.** Every rank computes the same file layout from the model's shapes
(no collective); rank 0 writes the headers and the index, then each rank
writes the bytes of its own slices at their offsets (one replica of each
slice writes). torch's ``HuggingFaceStorageWriter`` with consolidation was not
used: it writes every rank's shards to files of their own and then, on the
coordinator alone, reads them all back and writes the consolidated files (the
model is written twice, the second time by one process), and its
consolidation sizes elements with ``torch.finfo``, which fails for integer
tensors. Here every byte is written once, in parallel, at its final place.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .format import Reducer, weight_layout
from .layout import Blocked, OneToOne, Packed, inner_slice, partial_refused
from .layout_ops import canonical_dims
from .quantize import quantize
from .shard_quant import MeshReducer, quantize_local
from .state_dict import canonical_view, entry_placements, entry_shape, from_entries, is_quantized
from .tensor import QuantizedTensor, contiguous_strides

__all__ = ["Checkpoint", "LoadResult", "init_empty", "load", "materialize", "save", "tp_plan"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
NAMES = {v: k for k, v in DTYPES.items()}


# -- reading safetensors files ------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's data in ``file``


@dataclass(frozen=True)
class Pieces:
    """A model tensor that a checkpoint stores in pieces (transformers' per-expert keys of a fused expert stack).

    ``parts`` holds ``(checkpoint key, offset in the assembled tensor)``; a
    piece with fewer dims than the whole fills its leading dims with 1.
    """

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype
    shape: tuple[int, ...]


class Checkpoint:
    """The tensors of a Hugging Face checkpoint directory, read slice by slice.

    ``bytes_read`` counts the tensor bytes this process has read so far,
    ``header_bytes`` the headers; ``file_bytes`` is the size of the files.
    """

    def __init__(self, path):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.path / SINGLE).is_file():
            files = [SINGLE]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{self.path}: no {INDEX}, {SINGLE} or *.safetensors: not a Hugging Face checkpoint"
            )
        self.tensors: dict[str, TensorInfo] = {}
        self.header_bytes = self.bytes_read = self.file_bytes = 0
        self._fds: dict[Path, int] = {}
        for name in files:
            self._read_header(self.path / name)

    def _read_header(self, file: Path) -> None:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        size = file.stat().st_size
        self.header_bytes += 8 + n
        self.file_bytes += size
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"{file}: tensor {key} has dtype {entry['dtype']}, which torch cannot hold")
            dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
                raise ValueError(f"{file}: tensor {key} ({entry['dtype']} {list(shape)}) has a corrupt byte range")
            if key in self.tensors:
                raise ValueError(f"{self.path}: tensor {key} is in both {self.tensors[key].file.name} and {file.name}")
            self.tensors[key] = TensorInfo(file, dtype, shape, 8 + n + begin)

    def info(self, src) -> TensorInfo | Pieces:
        return src if isinstance(src, Pieces) else self.tensors[src]

    def read(self, key, offsets=None, lengths=None) -> torch.Tensor:
        """The slice ``[offsets, offsets + lengths)`` of tensor ``key`` (default: all of it).

        ``key`` is a checkpoint key or :class:`Pieces` (a tensor assembled from several).
        """
        if isinstance(key, Pieces):
            return self._read_pieces(key, offsets, lengths)
        info = self.tensors[key]
        shape = info.shape
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        lengths = tuple(lengths) if lengths is not None else shape
        out = torch.empty(lengths, dtype=info.dtype)
        if out.numel() == 0:
            return out
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        fd = self._fd(info.file)
        for pos, start, n in _runs(shape, offsets, lengths, info.dtype.itemsize):
            self._pread(fd, buf[pos : pos + n], info.start + start, key)
        return out

    def _read_pieces(self, pieces: Pieces, offsets, lengths) -> torch.Tensor:
        """Read the part of every piece that falls in the slice, straight into its place."""
        offsets = tuple(offsets) if offsets is not None else (0,) * len(pieces.shape)
        lengths = tuple(lengths) if lengths is not None else pieces.shape
        out = torch.empty(lengths, dtype=pieces.dtype)
        for key, at in pieces.parts:
            shape = (1,) * (len(at) - len(self.tensors[key].shape)) + self.tensors[key].shape
            lo = [max(a, o) for a, o in zip(at, offsets)]
            hi = [min(a + n, o + m) for a, n, o, m in zip(at, shape, offsets, lengths)]
            if any(h <= lo_i for lo_i, h in zip(lo, hi)):
                continue
            k = len(at) - len(self.tensors[key].shape)  # leading dims the piece adds (its expert index)
            part = self.read(
                key, [lo_i - a for lo_i, a in zip(lo[k:], at[k:])], [h - lo_i for lo_i, h in zip(lo[k:], hi[k:])]
            )
            out[tuple(slice(lo_i - o, h - o) for lo_i, h, o in zip(lo, hi, offsets))] = part.reshape(
                [h - lo_i for lo_i, h in zip(lo, hi)]
            )
        return out

    def _pread(self, fd: int, buf: memoryview, offset: int, key: str) -> None:
        while len(buf):
            n = os.preadv(fd, [buf], offset)
            if n <= 0:
                raise ValueError(f"{self.path}: tensor {key} is cut short (the file ends early)")
            self.bytes_read += n
            buf, offset = buf[n:], offset + n

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _runs(shape, offsets, lengths, itemsize: int):
    """``(buffer position, byte offset in the tensor, length)`` of each contiguous run of a slice."""
    k = len(shape)  # dims k.. are read whole
    while k > 0 and offsets[k - 1] == 0 and lengths[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        yield 0, 0, math.prod(shape) * itemsize
        return
    strides = contiguous_strides(shape)
    run = lengths[k - 1] * strides[k - 1] * itemsize
    outer = [range(o, o + n) for o, n in zip(offsets[: k - 1], lengths[: k - 1])]
    for i, idx in enumerate(itertools.product(*outer)):
        elem = sum(a * s for a, s in zip(idx, strides)) + offsets[k - 1] * strides[k - 1]
        yield i * run, elem * itemsize, run


# -- the model side -----------------------------------------------------------------


def _tensors(model: nn.Module):
    """``(checkpoint key, lora, tensor)`` for every parameter and persistent buffer, shared ones once.

    Inside a :class:`~dtensor_quant.lora.LoRALinear` the frozen ``base`` linear
    answers to the wrapper's own name (``q_proj.base.weight`` is the
    checkpoint's ``q_proj.weight``) and ``lora`` is the wrapper; its adapters
    come with key None (no Hugging Face checkpoint holds them).
    """
    from .lora import LoRALinear

    seen, modules = set(), dict(model.named_modules())
    for prefix, module in modules.items():
        parent, _, child = prefix.rpartition(".")
        lora = modules.get(parent) if child in ("base", "lora_a", "lora_b") else None
        lora = lora if isinstance(lora, LoRALinear) else None
        persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for name, t in [*module._parameters.items(), *((n, module._buffers[n]) for n in persistent)]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if lora is None:
                yield (f"{prefix}.{name}" if prefix else name), None, t
            elif child == "base":
                yield (f"{parent}.{name}" if parent else name), lora, t
            else:
                yield None, lora, t


def _tied(model: nn.Module) -> dict[str, str]:
    """Keys a checkpoint may leave out because they are tied to another (transformers' tie_word_embeddings)."""
    fn = getattr(model, "get_expanded_tied_weights_keys", None)
    try:
        return dict(fn()) if fn is not None else {}
    except (AttributeError, TypeError):  # an older transformers, or a model without a config
        return {}


def _converters(model: nn.Module) -> list[tuple[list[str], str, bool]]:
    """transformers' rules that fuse per-expert checkpoint tensors into one model tensor.

    ``(source patterns, target pattern, concatenated)`` for each
    ``WeightConverter`` whose operations are ``MergeModulelist(dim=0)``
    (stack the experts), optionally followed by ``Concatenate(dim=1)`` (join
    the sources along the rows, as gate and up make ``gate_up_proj``); other
    conversions are not read.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    out = []
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(conv, "operations", [])]
        targets = list(getattr(conv, "target_patterns", []))
        if len(targets) == 1 and ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            out.append((list(conv.source_patterns), targets[0], len(ops) == 2))
    return out


def _pieces(key: str, shape, ckpt: Checkpoint, converters) -> Pieces | str | None:
    """The pieces of fused tensor ``key`` in the checkpoint, an error message if they do not fit, or None."""
    for sources, target, concatenated in converters:
        if not key.endswith(target) or len(shape) != 3:
            continue
        prefix = key[: -len(target)]
        parts, row = [], 0
        for pattern in sources:
            first = prefix + pattern.replace("*", "0")
            if first not in ckpt.tensors:
                break
            rows = ckpt.tensors[first].shape[0]
            for e in range(shape[0]):
                parts.append((prefix + pattern.replace("*", str(e)), (e, row, 0)))
            row += rows
        else:
            found = [ckpt.tensors.get(k) for k, _ in parts]
            want = [(shape[1] if not concatenated else ckpt.tensors[k].shape[0], shape[2]) for k, _ in parts]
            dtypes = {f.dtype for f in found if f is not None}
            if (
                None in found
                or len(dtypes) != 1
                or [f.shape for f in found] != [tuple(w) for w in want]
                or (row != shape[1])
            ):
                return (f"{key}: the checkpoint's per-expert tensors {[k for k, _ in parts[:3]]}... do not add up to "
                        f"the model's {list(shape)} (expected {len(parts)} tensors of one dtype)")  # fmt: skip
            return Pieces(tuple(parts), dtypes.pop(), tuple(shape))
    return None


def _local_slice(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's ``(shape, offset)`` in ``t``'s global tensor (the same arithmetic DCP uses)."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.ndim
    if any(isinstance(p, Partial) for p in t.placements):
        if is_quantized(t):
            raise partial_refused("a quantized weight", "Partial", f" ({t.placements} has no slice to read or write)")
        raise ValueError(f"a Partial tensor ({t.placements}) has no slice to read or write; redistribute it first")
    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)


def _dtensor_like(local: torch.Tensor, like: DTensor, placements=None, shape=None) -> DTensor:
    shape = tuple(like.shape) if shape is None else tuple(shape)
    return DTensor.from_local(
        local, like.device_mesh, placements or like.placements, run_check=False, shape=shape,
        stride=contiguous_strides(shape),
    )  # fmt: skip


def _suffixes(t: torch.Tensor) -> dict[str, str] | None:
    """The checkpoint key suffix of each inner tensor, for a format that has a Hugging Face layout."""
    if not is_quantized(t):
        return None
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.fmt.checkpoint_suffixes


@dataclass
class LoadResult:
    """What :func:`load` did on this rank."""

    bytes_read: int  # tensor bytes read by this rank
    header_bytes: int
    file_bytes: int  # size of the checkpoint's files
    quantized: list[str] = field(default_factory=list)  # dense in the file, quantized on load
    prequantized: list[str] = field(default_factory=list)  # read as stored (no dequantization)
    dense: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # model tensors the checkpoint lacks (strict=False only)
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors the model lacks (strict=False only)


def _plan(model: nn.Module, ckpt: Checkpoint, strict: bool):
    """``(kind, model key, checkpoint key, tensor)`` for every tensor to load, the missing and the unexpected keys.

    Checks only, no collective: every rank reaches the same verdict before anything is read.
    """
    tied, tasks, used, missing, errors = _tied(model), [], set(), [], []
    converters = _converters(model)
    for key, _, t in _tensors(model):
        if key is None:  # a LoRA adapter: not in any Hugging Face checkpoint, left as initialized
            continue
        src = key if key in ckpt.tensors else tied.get(key, key)
        if src not in ckpt.tensors:
            src = _pieces(key, tuple(t.shape), ckpt, converters)
            if src is None:
                missing.append(key)
                continue
            if isinstance(src, str):  # the pieces do not add up
                errors.append(src)
                continue
        try:
            _local_slice(t)
        except ValueError as e:
            errors.append(f"{key}: {e}")
        info, suffixes = ckpt.info(src), _suffixes(t)
        names = [k for k, _ in src.parts] if isinstance(src, Pieces) else [src]
        companions = [
            k + s for k in names for s in ("_scale_inv", "_scale", "_scales", "_blocks") if k + s in ckpt.tensors
        ]
        if isinstance(src, Pieces):
            suffixes = None  # stored layouts are read from 2-D tensors only
        dense_float = info.dtype.is_floating_point and info.dtype.itemsize >= 2
        if suffixes is not None and not dense_float:
            kind = "prequantized"
            errors += _check_prequantized(key, t, src, ckpt, suffixes)
            used.update(src + s for s in suffixes.values())
        elif (is_quantized(t) and not dense_float) or (companions and not dense_float):
            kind = "error"
            errors.append(f"{key}: the checkpoint holds it stored quantized ({names[0]} is {info.dtype}"
                          f"{', with ' + ', '.join(companions) if companions else ''}), the model's weight is "
                          f"{_describe(t)}; quantize the model's weight in the checkpoint's format (FP8 block "
                          "scales: dq.Float8Blockwise(128)) before loading: quantized bytes are never silently "
                          "dequantized or requantized")  # fmt: skip
        else:
            kind = "quantized" if is_quantized(t) else "dense"
            why = _plain_weight(t) if kind == "quantized" else None
            if why:
                errors.append(f"{key}: {why}")
            if info.shape != tuple(t.shape):
                errors.append(
                    f"{key}: the checkpoint's {names[0]} has shape {list(info.shape)}, the model's is {list(t.shape)}"
                )
        used.update(names)
        tasks.append((kind, key, src, t))
    unexpected = sorted(set(ckpt.tensors) - used)
    if strict and missing:
        errors.append(
            f"tensors of the model missing from the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}"
        )
    if strict and unexpected:
        errors.append(f"tensors of the checkpoint the model does not have: {unexpected[:10]}"
                      f"{' ...' if len(unexpected) > 10 else ''}")  # fmt: skip
    if errors:
        raise ValueError(f"cannot load {ckpt.path} (strict={strict}):\n  " + "\n  ".join(errors))
    return tasks, missing, unexpected


def _describe(t: torch.Tensor) -> str:
    if not is_quantized(t):
        return f"dense {t.dtype}"
    return str((t._local_tensor if isinstance(t, DTensor) else t).fmt)


def _check_prequantized(key, t, src, ckpt, suffixes) -> list[str]:
    if t.ndim != 2:
        return [(f"{key}: {_describe(t)} weights are read as stored only as 2-D [out, in] tensors; this one is "
                 f"{list(t.shape)}")]  # fmt: skip
    q, inner, _, shape = canonical_view(t, key)
    out = []
    for name, rels in q.fmt.layout_for(shape).items():
        k = src + suffixes[name]
        want = (inner[name].dtype, entry_shape(rels, shape))
        got = (ckpt.tensors[k].dtype, ckpt.tensors[k].shape) if k in ckpt.tensors else None
        if got != want:
            out.append(f"{key}: {q.fmt} of shape {list(shape)} needs {k} as {want[0]} {list(want[1])}, "
                       f"the checkpoint has {'nothing' if got is None else f'{got[0]} {list(got[1])}'}")  # fmt: skip
    return out


def load(model: nn.Module, path, *, strict: bool = True, chunk_bytes: int = 4 << 20) -> LoadResult:
    """Load the Hugging Face checkpoint directory ``path`` into ``model``, each rank reading its own slices.

    Every rank calls it, with the model in any layout the library supports
    (tensor parallel, FSDP2, both, one process). Dense weights that the model
    holds quantized are quantized with the statistics of the full tensor
    (bit-identical to quantize-then-shard); weights stored quantized in a
    format's layout are read as they are. A missing or unexpected tensor
    (``strict``), a shape or a format that does not fit raises ``ValueError``
    on every rank before anything is read. Tied weights a checkpoint leaves out
    (transformers' ``tie_word_embeddings``) are read from their source.

    A slice is read and quantized in runs of rows of about ``chunk_bytes``
    when the format's statistics never span rows (its layout is not constant
    along dim 0); so a rank holds its shards plus one such run at a time.
    """
    with Checkpoint(path) as ckpt:
        tasks, missing, unexpected = _plan(model, ckpt, strict)
        result = LoadResult(0, ckpt.header_bytes, ckpt.file_bytes, missing=missing, unexpected=unexpected)
        with torch.no_grad():
            for kind, key, src, t in tasks:
                if kind == "prequantized":
                    t.copy_(_read_prequantized(ckpt, key, src, t))
                    result.prequantized.append(key)
                elif kind == "quantized":
                    _load_quantized(ckpt, key, src, t, chunk_bytes)
                    result.quantized.append(key)
                else:
                    _load_dense(ckpt, src, t, chunk_bytes)
                    result.dense.append(key)
        result.bytes_read = ckpt.bytes_read
    return result


def _row_runs(rows: int, row_bytes: int, align: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[r0, r1)`` runs of about ``chunk_bytes`` covering ``rows``, each starting at a multiple of ``align``."""
    step = max(align, chunk_bytes // max(row_bytes, 1) // align * align)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _load_dense(ckpt: Checkpoint, src: str, t: torch.Tensor, chunk_bytes: int) -> None:
    shape, offset = _local_slice(t)
    local = _local(t)
    if local.ndim == 0:
        local.copy_(ckpt.read(src, offset, shape))
        return
    row_bytes = math.prod(shape[1:]) * ckpt.info(src).dtype.itemsize
    for r0, r1 in _row_runs(shape[0], row_bytes, 1, chunk_bytes):
        local[r0:r1].copy_(ckpt.read(src, (offset[0] + r0, *offset[1:]), (r1 - r0, *shape[1:])))


def _load_quantized(ckpt: Checkpoint, key: str, src: str, t: torch.Tensor, chunk_bytes: int) -> None:
    """Quantize this rank's slice of ``src`` into ``t``: in runs of dim-0 indices, or whole.

    Runs along dim 0 (rows of a matrix, experts of a fused ``[E, out, in]``
    stack) are exactly as independent as Shard(0) pieces when the layout says
    so: every inner tensor is one-to-one, packed or blocked along dim 0 (never
    constant: no statistic spans them), and a run starts on a multiple of
    every dim-0 block. Statistics shared across shards of the other dims are
    all-reduced by the reducer the quantize op uses; the ranks of such a group
    hold the same dim-0 range, so they run the same collectives. Otherwise the
    slice is quantized whole, placed like ``t``, by :func:`~dtensor_quant.quantize`
    (the path :func:`~dtensor_quant.state_dict.quantize_like` takes).
    """
    shape, offset = _local_slice(t)
    q = _local(t)
    full = tuple(t.shape)
    layout = weight_layout(q.fmt, full)
    if not all(isinstance(rels[0], (OneToOne, Packed, Blocked)) for rels in layout.values()):
        dense = ckpt.read(src, offset, shape).to(t.dtype)
        t.copy_(quantize(_dtensor_like(dense, t) if isinstance(t, DTensor) else dense, q.fmt))
        return
    if isinstance(t, DTensor):
        reducer = MeshReducer.for_mesh(q.fmt, full, t.device_mesh, t.placements)
    else:
        reducer = Reducer(full)
    align = math.lcm(*(rels[0].factor for rels in layout.values()))
    row_bytes = math.prod(shape[1:]) * ckpt.info(src).dtype.itemsize
    for r0, r1 in _row_runs(shape[0], row_bytes, align, chunk_bytes):
        run = ckpt.read(src, (offset[0] + r0, *offset[1:]), (r1 - r0, *shape[1:])).to(t.dtype)
        part = quantize_local(q.fmt, run, reducer, full)
        for name, rels in layout.items():
            i0, i1, _ = inner_slice(rels[0], r0, r1, shape[0])
            q.inner[name][i0:i1].copy_(part.inner[name])


def _plain_weight(t: torch.Tensor) -> str | None:
    """Why quantized ``t`` cannot be loaded in place (a transposed or gathered view), or None."""
    q = _local(t)
    layout = weight_layout(q.fmt, tuple(t.shape))
    if q.dims != canonical_dims(q.ndim) or any(rels != layout[n] for n, rels in zip(q.fmt.inner_names, q.rels)):
        return f"{q!r} is not a plain quantized weight (a transposed or gathered view); load into the parameter"
    return None


def _read_prequantized(ckpt: Checkpoint, key: str, src: str, t: torch.Tensor) -> torch.Tensor:
    """The stored inner tensors of ``src``, this rank's chunks, placed like ``t`` (no dequantization)."""
    q, _, to_canonical, shape = canonical_view(t, key)
    suffixes, entries = q.fmt.checkpoint_suffixes, {}
    for name, rels in q.fmt.layout_for(shape).items():
        k, g_shape = src + suffixes[name], entry_shape(rels, shape)
        if isinstance(t, DTensor):
            placements = entry_placements(t.placements, rels, to_canonical)
            mesh = t.device_mesh
            l_shape, l_off = compute_local_shape_and_global_offset(g_shape, mesh, placements)
            entries[name] = _dtensor_like(ckpt.read(k, l_off, l_shape), t, placements, g_shape)
        else:
            entries[name] = ckpt.read(k)
    return from_entries(entries, t, key)


# -- tensor parallelism from transformers' plan ------------------------------------


def tp_plan(model: nn.Module) -> dict:
    """torch ParallelStyles for a transformers model's own TP plan (``model._tp_plan``: colwise, rowwise, ...).

    Only the styles that are plain column/row sharding are mapped; any other
    style raises ``ValueError`` naming it (use your own plan then).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan (_tp_plan); write one")
    unknown = {s for s in plan.values() if s not in styles}
    if unknown:
        raise ValueError(f"{type(model).__name__}'s TP plan uses styles {sorted(unknown)}; known: {sorted(styles)}")
    return {k: styles[s]() for k, s in plan.items()}


# -- building a model without memory ------------------------------------------------


@contextlib.contextmanager
def init_empty():
    """Create modules' parameters on the meta device, keeping buffers (e.g. RoPE tables) real.

    Under ``torch.device("meta")`` a transformers model's non-persistent
    buffers (``inv_freq``) would be meta too, and no checkpoint holds them.
    """
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device="cpu") -> nn.Module:
    """``model.to_empty(device)`` for the tensors still on the meta device only; real buffers keep their values."""
    return model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


# -- saving -------------------------------------------------------------------------


def _export_tensors(model: nn.Module, dtype: torch.dtype, merge_lora: bool):
    """``(key, dtype, global shape, offset, writes, fetch)`` for every tensor of the export.

    ``fetch()`` makes this rank's slice (dequantized, merged) only when it is
    written, so a rank holds one dense slice at a time.
    """
    for key, lora, t in _tensors(model):
        writes = _owns(t)
        if key is None:  # an adapter
            if not merge_lora:
                name = next(n for n, p in lora.named_parameters() if p is t)
                yield from _dense_item(_lora_key(model, lora) + name, t, dtype, writes, lambda t=t: _local(t))
            continue
        suffixes = _suffixes(t)
        if suffixes is not None and lora is not None and merge_lora:
            raise ValueError(
                f"{key}: merging LoRA adapters changes this {_describe(t)} weight, whose stored bytes are "
                "written as they are; save with merge_lora=False (adapters as their own tensors), or merge "
                "into a dense copy of the model"
            )
        if suffixes is not None:  # the stored layout, as it is
            q, inner, to_canonical, shape = canonical_view(t, key)
            for name, rels in q.fmt.layout_for(shape).items():
                g_shape = entry_shape(rels, shape)
                offset, writes_e = (0,) * len(g_shape), writes
                if isinstance(t, DTensor):
                    placements = entry_placements(t.placements, rels, to_canonical)
                    _, offset = compute_local_shape_and_global_offset(g_shape, t.device_mesh, placements)
                    coord = t.device_mesh.get_coordinate()
                    writes_e = writes and all(c == 0 for c, p in zip(coord, placements) if not p.is_shard())
                yield key + suffixes[name], inner[name].dtype, g_shape, offset, writes_e, lambda x=inner[name]: x
            continue
        if lora is not None and merge_lora and t is lora.base.weight:
            fetch = functools.partial(_merged, t, lora, dtype)
        else:
            fetch = functools.partial(_local, t)
        yield from _dense_item(key, t, dtype, writes, fetch)


def _dense_item(key, t, dtype, writes, fetch):
    out_dtype = dtype if t.is_floating_point() else t.dtype

    def cast():
        local = fetch()
        if isinstance(local, QuantizedTensor):
            return local.dequantize(dtype)
        return local.to(out_dtype)

    yield key, out_dtype, tuple(t.shape), _local_slice(t)[1], writes, cast


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _lora_key(model: nn.Module, lora: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is lora) + "."


def _merged(weight: torch.Tensor, lora, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of ``W + scaling * B @ A`` in fp32 (adapters are small: DTensor's mm moves them)."""
    a, b = lora.lora_a.weight.detach(), lora.lora_b.weight.detach()
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        raise ValueError("LoRA adapters of one layer must both be DTensors or both plain tensors to merge")
    delta = torch.mm(b.float(), a.float()) * lora.scaling
    if isinstance(weight, DTensor):
        if not isinstance(delta, DTensor):
            delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
        elif delta.device_mesh != weight.device_mesh:
            raise ValueError("the LoRA adapters live on another mesh than their base weight; cannot merge")
        delta = delta.redistribute(weight.device_mesh, weight.placements)._local_tensor
    base = _local(weight)
    base = base.dequantize(torch.float32) if isinstance(base, QuantizedTensor) else base.float()
    return (base + delta).to(dtype)


def _owns(t: torch.Tensor) -> bool:
    """Whether this rank writes ``t``'s slice: the first replica of it (a plain tensor: rank 0)."""
    if not isinstance(t, DTensor):
        return not dist.is_initialized() or dist.get_rank() == 0
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements) if not p.is_shard())


def save(
    model: nn.Module,
    path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    merge_lora: bool = True,
    max_shard_bytes: int = 5 << 30,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``from_pretrained`` reads.

    Every rank calls it; each writes the bytes of its own slices. Weights in a
    format with a Hugging Face layout (``checkpoint_suffixes``, e.g. FP8 block
    scales) are written as stored, with the format's ``quantization_config``;
    every other weight is dense ``dtype``. LoRA adapters (:mod:`dtensor_quant.lora`)
    are merged into their weights (``merge_lora``; otherwise written as
    ``<layer>.lora_a.weight``/``lora_b.weight`` beside the base weight).
    ``model.config`` (transformers) is saved alongside. Files over
    ``max_shard_bytes`` are split with an index.
    """
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    items = list(_export_tensors(model, dtype, merge_lora))
    files = _layout(items, max_shard_bytes)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        # A previous export's files would otherwise stay, and a stale index would point readers at them.
        for stale in [*path.glob("*.safetensors"), path / INDEX]:
            stale.unlink(missing_ok=True)
        for name, (header, size) in files.items():
            with open(path / name, "wb") as f:
                f.write(header)
                f.truncate(size)
        if len(files) > 1:
            weight_map = {k: name for name, (h, _) in files.items() for k in _keys(h)}
            total = sum(size - len(h) for h, size in files.values())
            (path / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        _save_config(model, path)
    if dist.is_initialized():
        dist.barrier()
    where = {k: (name, len(h) + e["data_offsets"][0]) for name, (h, _) in files.items() for k, e in _keys(h).items()}
    fds = {}
    try:
        for key, g_dtype, g_shape, offset, writes, fetch in items:
            local = fetch()  # on every rank: merging adapters may need a collective
            if not writes or local.numel() == 0:
                continue
            name, start = where[key]
            fd = fds.get(name) or fds.setdefault(name, os.open(path / name, os.O_WRONLY))
            data = local.contiguous().reshape(-1).view(torch.uint8).numpy()
            for pos, at, n in _runs(g_shape, offset, tuple(local.shape), g_dtype.itemsize):
                os.pwrite(fd, memoryview(data)[pos : pos + n], start + at)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()


def _keys(header: bytes) -> dict:
    return {k: v for k, v in json.loads(header[8:]).items() if k != "__metadata__"}


def _layout(items, max_shard_bytes: int) -> dict[str, tuple[bytes, int]]:
    """File name -> (header bytes, file size), the same on every rank."""
    groups, size = [[]], 0
    for key, g_dtype, g_shape, *_ in items:
        n = math.prod(g_shape) * g_dtype.itemsize
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, g_dtype, g_shape, n))
        size += n
    out = {}
    for i, group in enumerate(groups, 1):
        name = SINGLE if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for key, g_dtype, g_shape, n in group:
            header[key] = {"dtype": NAMES[g_dtype], "shape": list(g_shape), "data_offsets": [at, at + n]}
            at += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        out[name] = (struct.pack("<Q", len(text)) + text, 8 + len(text) + at)
    return out


def _save_config(model: nn.Module, path: Path) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    quant = {}
    for _, _, t in _tensors(model):
        if _suffixes(t) is not None:
            local = t._local_tensor if isinstance(t, DTensor) else t
            quant = local.fmt.hf_quantization_config or quant
    previous = getattr(config, "quantization_config", None)
    if quant:
        config.quantization_config = quant
    try:
        config.save_pretrained(path)
    finally:
        if quant:
            config.quantization_config = previous
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(path)
