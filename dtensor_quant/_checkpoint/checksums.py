"""A CRC32 per stored chunk, written beside each data file and checked before any chunk is read.

DCP and ``torch.load`` do not checksum: flipped bytes in a ``.distcp`` file
load silently. The checksum files are JSON, readable without this library.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch.distributed.checkpoint as dcp

from .errors import CheckpointCorruptError

CHECKSUM_SUFFIX = ".crc32.json"


def crc_of(path: Path, offset: int, length: int) -> int | None:
    """CRC32 of ``length`` bytes at ``offset`` of ``path``; None if the file is shorter."""
    with open(path, "rb") as f:
        f.seek(offset)
        crc, left = 0, length
        while left:
            block = f.read(min(left, 1 << 24))
            if not block:
                return None
            crc, left = zlib.crc32(block, crc), left - len(block)
    return crc


def write_checksums(root: Path, results, sync: bool) -> None:
    """One JSON file per data file: every chunk's offset, length, CRC32 and key (readable without this library)."""
    per_file: dict[str, list] = {}
    for r in results:
        info = r.storage_data
        crc = crc_of(root / info.relative_path, info.offset, info.length)
        chunk = {"key": r.index.fqn, "offset": info.offset, "length": info.length, "crc32": crc}
        per_file.setdefault(info.relative_path, []).append(chunk)
    for name, chunks in per_file.items():
        with open(root / (name + CHECKSUM_SUFFIX), "w") as f:
            json.dump({"file": name, "chunks": chunks}, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())


class VerifyingFileSystemReader(dcp.FileSystemReader):
    """A FileSystemReader that checks the CRC32 of every chunk this rank will read before reading any.

    The check runs in DCP's planning step, whose failures DCP raises on every
    rank before any data is read, so a damaged or truncated file leaves every
    rank's model as it was. A checkpoint without checksum files (a plain
    ``dcp.save``) is read unchecked.
    """

    def prepare_local_plan(self, plan):
        plan = super().prepare_local_plan(plan)
        root, sums, seen = Path(self.path), {}, set()
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            where = (info.relative_path, info.offset, info.length)
            if where in seen:
                continue
            seen.add(where)
            if info.relative_path not in sums:
                sums[info.relative_path] = load_checksums(root, info.relative_path)
            table = sums[info.relative_path]
            if table is None:
                continue
            expected = table.get((info.offset, info.length))
            key = item.storage_index.fqn
            if expected is None:
                raise CheckpointCorruptError(
                    f"{root / info.relative_path}: no checksum for the chunk of {key} at bytes "
                    f"[{info.offset}, {info.offset + info.length}): the checksum file does not match the metadata"
                )
            got = crc_of(root / info.relative_path, info.offset, info.length)
            if got != expected:
                why = "the file is truncated" if got is None else f"CRC32 {got:#010x}, stored {expected:#010x}"
                raise CheckpointCorruptError(
                    f"{root / info.relative_path}: the stored chunk of {key} at bytes [{info.offset}, "
                    f"{info.offset + info.length}) is damaged ({why}). Nothing was loaded; restore the file or "
                    "load another checkpoint."
                )
        return plan


def load_checksums(root: Path, name: str) -> dict | None:
    """``{(offset, length): crc}`` of data file ``name``; None for a checkpoint saved without checksums."""
    path = root / (name + CHECKSUM_SUFFIX)
    if not path.exists():
        if any(root.glob("*" + CHECKSUM_SUFFIX)):
            raise CheckpointCorruptError(f"{path} is missing, though the other data files of {root} have theirs")
        return None
    try:
        chunks = json.loads(path.read_text())["chunks"]
        return {(c["offset"], c["length"]): c["crc32"] for c in chunks}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(f"{path}: the checksum file is damaged ({e})") from None
