"""Moving a finished Hugging Face export into place, safe against a kill half-way: a journal, rolled forward.

``dq.hf.save`` stages its new files in ``<path>/.dq_hf_save.partial`` and,
once every rank's bytes are on disk, moves them into ``<path>`` one by one:
the directory may hold files of the user's (a tokenizer, a README), so it is
not swapped whole. A process killed between two of those moves would leave
new shards beside old ones under the old index -- a checkpoint that is
neither. So rank 0 first writes ``<path>/.dq_hf_save.commit``, listing every
move and removal (written to a temporary name and renamed: it exists whole or
not at all). That rename is the commit point:

* killed before it, the previous export is untouched (the staging directory
  is removed by the next save);
* killed after it, the new export is the checkpoint, and whoever opens the
  directory next with this library -- ``dq.hf.load`` or anything else that
  reads through :class:`~.safetensors_io.Checkpoint`, or the next
  ``dq.hf.save`` -- finishes the listed moves first (:func:`finish`). Each
  step is idempotent, so several ranks doing it at once, or a kill during
  it, do no harm.

Readers that do not know the journal (``from_pretrained``) can see the mix
only between a kill after the commit point and the next time this library
opens the directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...atomic import fsync_dir
from ...state_dict import CheckpointFormatError

STAGING = ".dq_hf_save.partial"  # inside the export directory: the new files until every rank has written
JOURNAL = ".dq_hf_save.commit"


def commit(path: Path, moves: list[str], removals: list[str]) -> None:
    """Move ``moves`` from the staging directory into ``path`` and delete ``removals`` there, all or nothing."""
    staging = path / STAGING
    fsync_dir(staging)
    text = json.dumps({"moves": moves, "removals": removals})
    tmp = path / (JOURNAL + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / JOURNAL)  # the commit point
    fsync_dir(path)
    finish(path)


def finish(path) -> bool:
    """Complete the moves of an interrupted commit into ``path``, if its journal is there; True if it was."""
    path = Path(path)
    journal = path / JOURNAL
    try:
        text = journal.read_bytes().decode()
    except FileNotFoundError:
        return False  # no interrupted save (or another rank finished it just now)
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise CheckpointFormatError(f"{journal}: damaged ({type(e).__name__}: {e}); remove it to read") from None
    moves, removals = _parse(journal, text)
    staging = path / STAGING
    try:
        for name in moves:
            try:
                os.replace(staging / name, path / name)
            except FileNotFoundError:
                if not (path / name).exists():
                    raise CheckpointFormatError(
                        f"{journal}: an interrupted dq.hf.save lists {name} to move into place, but neither "
                        f"{staging / name} nor {path / name} exists; the export is incomplete. Save it again."
                    ) from None
        for name in removals:
            (path / name).unlink(missing_ok=True)
        fsync_dir(path)
        journal.unlink(missing_ok=True)
    except OSError as e:
        raise OSError(
            f"{path}: a dq.hf.save was interrupted after its new files were complete, and finishing it (moving "
            f"them from {staging} into place, as {journal} lists) failed: {e}. The directory mixes old and new "
            "files until that is done: open it with write access (dq.hf.load, dq.hf.save finish it)."
        ) from e
    shutil.rmtree(staging, ignore_errors=True)
    return True


def _parse(journal: Path, text: str) -> tuple[list[str], list[str]]:
    """The journal's lists, each a plain file name of the directory (nothing outside it is touched)."""
    try:
        data = json.loads(text)
        moves, removals = data["moves"], data["removals"]
        names = [*moves, *removals]
        bad = [n for n in names if not isinstance(n, str) or n in ("", ".", "..") or Path(n).name != n]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{journal}: damaged ({type(e).__name__}: {e}); remove it to read") from None
    if not isinstance(moves, list) or not isinstance(removals, list) or bad:
        raise CheckpointFormatError(f"{journal}: not a list of file names of the directory ({bad[:3]})")
    return moves, removals
