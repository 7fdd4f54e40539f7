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

from ...core.tensor import contiguous_strides

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
