"""The safetensors files of a Hugging Face checkpoint directory: headers, dtypes, and reads of a tensor's slice.

A slice is read with ``os.preadv`` at the offsets the header gives, in the
contiguous byte runs of the slice (:func:`byte_runs`): whole rows are one
read, a column slice one read per row.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ...._core.tensor import contiguous_strides
from ...state_dict import CheckpointFormatError
from .commit import finish as finish_interrupted_save

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
NAMES = {v: k for k, v in DTYPES.items()}


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


# The safetensors package refuses headers over 100 MB; no real header comes near (a few MB for thousands of tensors).
MAX_HEADER_BYTES = 100_000_000


class Checkpoint:
    """The tensors of a Hugging Face checkpoint directory, read slice by slice.

    ``bytes_read`` counts the tensor bytes this process has read so far,
    ``header_bytes`` the headers; ``file_bytes`` is the size of the files.

    Everything a file or index claims is checked before any tensor is read,
    as a parser of files from the internet must: an index that names files
    outside the directory, missing files or keys its files do not hold; a
    header length past the end of the file; a header that is not a JSON object
    of well-formed entries; unknown dtypes; byte ranges that are negative,
    out of the data area, overlapping, leave gaps, or do not match
    dtype x shape. Each refusal is a :class:`CheckpointFormatError` (a
    ``ValueError``) naming the file and what is wrong with it.
    """

    def __init__(self, path):
        self.path = Path(path)
        if self.path.is_file():
            raise NotADirectoryError(
                f"{self.path} is a file: a Hugging Face checkpoint is the directory that holds it"
                + (f" ({self.path.parent})" if self.path.suffix in (".safetensors", ".json") else "")
            )
        finish_interrupted_save(self.path)  # a dq.hf.save killed after its commit point: its export is the one
        index = self.path / INDEX
        weight_map = None
        if index.is_file():
            weight_map = _read_index(index)
            files = sorted(set(weight_map.values()))
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
        if weight_map is not None:
            wrong = [(k, f) for k, f in weight_map.items() if k not in self.tensors or self.tensors[k].file.name != f]
            if wrong:
                k, f = wrong[0]
                held = f"it is in {self.tensors[k].file.name}" if k in self.tensors else "no file holds it"
                raise CheckpointFormatError(
                    f"{index}: maps {len(wrong)} tensor(s) to files that do not hold them, e.g. {k} to {f} ({held})"
                )

    def _read_header(self, file: Path) -> None:
        entries, n, size = read_header(file)
        self.header_bytes += 8 + n
        self.file_bytes += size
        for key, (dtype, shape, begin) in entries.items():
            if key in self.tensors:
                raise CheckpointFormatError(
                    f"{self.path}: tensor {key} is in both {self.tensors[key].file.name} and {file.name}"
                )
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
        for pos, start, n in byte_runs(shape, offsets, lengths, info.dtype.itemsize):
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
                raise CheckpointFormatError(
                    f"{self.path}: tensor {key} is cut short (the file ends early; it changed after its header "
                    "was checked)"
                )
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


def byte_runs(shape, offsets, lengths, itemsize: int):
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


def _read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of an index file, checked: a JSON object whose map sends names to files in the directory."""
    try:
        data = json.loads(index.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{index}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        got = type(data).__name__ if not isinstance(data, dict) else f"keys {sorted(data)[:5]}"
        raise CheckpointFormatError(f"{index}: expected a JSON object with a 'weight_map' object, found {got}")
    weight_map = data["weight_map"]
    bad = [(k, f) for k, f in weight_map.items() if not isinstance(f, str) or not _plain_file_name(f)]
    if bad:
        raise CheckpointFormatError(
            f"{index}: weight_map sends {bad[0][0]!r} to {bad[0][1]!r}, which is not the name of a file in "
            "the checkpoint directory (no paths, no '..')"
        )
    if not weight_map:
        raise CheckpointFormatError(f"{index}: weight_map is empty")
    missing = sorted({f for f in weight_map.values() if not (index.parent / f).is_file()})
    if missing:
        raise CheckpointFormatError(f"{index}: names files that do not exist: {missing[:5]}")
    return weight_map


def _plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def read_header(file: Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int]], int, int]:
    """``({key: (dtype, shape, data offset)}, header length, file size)`` of a safetensors file, checked.

    The file is: an 8-byte little-endian header length ``n``; ``n`` bytes of
    JSON, an object with one entry per tensor (``dtype``, ``shape``,
    ``data_offsets = [begin, end]`` relative to the data area) and an optional
    ``__metadata__`` object of strings; then the data area, which the tensors
    must cover exactly, in any order, without overlaps or gaps (as the
    safetensors package requires). A header length that is one byte off
    shifts every tensor by a byte; the gap or overrun it leaves is refused.
    """

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{file}: {what}")

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, too short for a safetensors file (8-byte header length, then the header)")
        (n,) = struct.unpack("<Q", head)
        if n == 0:
            raise bad("the header length is 0: not a safetensors file, or its first 8 bytes are damaged")
        if n > MAX_HEADER_BYTES:
            raise bad(f"the header length is {n} bytes, over the {MAX_HEADER_BYTES} a safetensors header may have")
        if 8 + n > size:
            raise bad(f"the header length is {n} bytes, past the end of the {size}-byte file (truncated?)")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the header is not valid UTF-8 JSON ({e}); the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ must be an object of strings")
    data = size - 8 - n
    entries, ranges = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - set(entry):
            raise bad(f"tensor {key}: expected an object with dtype, shape and data_offsets, found {entry!r:.120}")
        name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if name not in DTYPES:
            raise bad(f"tensor {key} has dtype {name!r:.40}; known: {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {key}: shape {shape!r:.120} is not a list of non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise bad(f"tensor {key}: data_offsets {offsets!r:.120} is not two non-negative integers")
        begin, end = offsets
        want = math.prod(shape) * DTYPES[name].itemsize
        if end - begin != want:
            raise bad(f"tensor {key} ({name} {shape}) needs {want} bytes, its data_offsets [{begin}, {end}) hold "
                      f"{end - begin}")  # fmt: skip
        if end > data:
            raise bad(f"tensor {key}: data_offsets [{begin}, {end}) run past the {data}-byte data area (truncated?)")
        entries[key] = (DTYPES[name], tuple(shape), begin)
        ranges.append((begin, end, key))
    at, last = 0, None
    for begin, end, key in sorted(ranges):
        if begin < at:
            raise bad(f"tensors {last} and {key} overlap (bytes [{begin}, {at}) of the data area)")
        if begin > at:
            raise bad(f"bytes [{at}, {begin}) of the data area belong to no tensor (before {key}): a damaged header")
        at, last = end, key
    if at != data:
        raise bad(f"the tensors cover {at} bytes of the {data}-byte data area: the header length ({n}) or the "
                  "offsets are wrong, or the file was cut or appended to")  # fmt: skip
    return entries, n, size


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the key {dup!r} appears twice")
    return dict(pairs)
