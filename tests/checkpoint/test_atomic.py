"""checkpoint/atomic on one process: what a save's commit may replace at its path."""

import pytest
import torch

from dtensor_quant import checkpoint as ckpt
from tests.support import ckpt_cases as cc
from tests.support.ckpt_cases import SEED

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_file_or_a_directory_of_other_files_at_the_path_is_not_replaced(tmp_path):
    """The commit swaps the new checkpoint with whatever is at the path, then deletes that. Before: a file there
    was swapped out (to <path>.partial, which the next save deletes) and the save raised saying the path "still
    holds the previous checkpoint" -- holding this save's; a directory of other files was deleted whole."""
    net = cc.reference(SEED, "int8")
    a_file = tmp_path / "weights.pt"
    a_file.write_bytes(b"the user's file")
    with pytest.raises(FileExistsError, match="is a file, not a checkpoint directory"):
        ckpt.save(net, str(a_file))
    assert a_file.read_bytes() == b"the user's file"
    assert not (tmp_path / "weights.pt.partial").exists()
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"holds files but no checkpoint \(no .metadata\)"):
        ckpt.save(net, str(home))
    assert (home / "notes.txt").read_text() == "keep"
    # an empty directory, and a checkpoint, are replaced
    (tmp_path / "empty").mkdir()
    ckpt.save(net, str(tmp_path / "empty"))
    ckpt.save(cc.reference(SEED + 1, "int8"), str(tmp_path / "empty"))
    back = cc.reference(SEED, "int8")
    ckpt.load(back, str(tmp_path / "empty"))
    assert torch.equal(back.a.weight.qdata, cc.reference(SEED + 1, "int8").a.weight.qdata)
