"""checkpoint/hf/commit: the journal that makes dq.hf.save's move into place all-or-nothing.

A save killed after writing the journal is finished by the next reader; the journal is checked like any
file read from disk: damaged, or naming files outside the directory, it is refused and nothing is moved.
"""

import json

import pytest

from dtensor_quant._checkpoint.hf.io.commit import JOURNAL, STAGING, finish
from dtensor_quant.checkpoint import CheckpointFormatError


def interrupted(tmp_path, moves, removals, staged, present):
    """A directory as a kill right after the commit point leaves it."""
    (tmp_path / STAGING).mkdir()
    for name in staged:
        (tmp_path / STAGING / name).write_text("new " + name)
    for name in present:
        (tmp_path / name).write_text("old " + name)
    (tmp_path / JOURNAL).write_text(json.dumps({"moves": moves, "removals": removals}))
    return tmp_path


def test_finish_completes_the_moves_once(tmp_path):
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"]
    # the kill came after the first move: that file is new already, the others are still staged
    d = interrupted(tmp_path, files, ["stale.safetensors"], files[1:], ["stale.safetensors", "tokenizer.json"])
    (d / files[0]).write_text("new " + files[0])
    assert finish(d)
    assert {p.name for p in d.iterdir()} == {*files, "tokenizer.json"}  # the user's own file stays
    assert all((d / n).read_text() == "new " + n for n in files)
    assert not finish(d)  # nothing left to do


def test_a_listed_file_in_neither_place_is_refused(tmp_path):
    d = interrupted(tmp_path, ["a.safetensors"], [], [], [])
    with pytest.raises(CheckpointFormatError, match=r"neither .* exists"):
        finish(d)


@pytest.mark.parametrize(
    "text",
    ['{"moves": ["a.safetensors"]', '["a"]', '{"moves": "a", "removals": []}', '{"moves": [], "removals": [3]}'],
)
def test_a_damaged_journal_is_refused_naming_it(tmp_path, text):
    (tmp_path / JOURNAL).write_text(text)
    with pytest.raises(CheckpointFormatError, match=JOURNAL):
        finish(tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "..", "sub/a.safetensors"])
def test_a_journal_naming_files_outside_the_directory_touches_nothing(tmp_path, name):
    d = tmp_path / "export"
    d.mkdir()
    (tmp_path / "outside.safetensors").write_text("keep")
    interrupted(d, [], [name], [], [])
    with pytest.raises(CheckpointFormatError, match="not a list of file names"):
        finish(d)
    assert (tmp_path / "outside.safetensors").read_text() == "keep"


def test_a_journal_that_is_not_text_or_not_a_file_is_refused_naming_it(tmp_path):
    """Before: a bare UnicodeDecodeError (no file named) or IsADirectoryError from every dq.hf.load."""
    (tmp_path / JOURNAL).write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointFormatError, match=f"{JOURNAL}: damaged .UnicodeDecodeError"):
        finish(tmp_path)
    (tmp_path / JOURNAL).unlink()
    (tmp_path / JOURNAL).mkdir()
    with pytest.raises(CheckpointFormatError, match=f"{JOURNAL}: damaged .IsADirectoryError"):
        finish(tmp_path)
