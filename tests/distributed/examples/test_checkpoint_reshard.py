"""examples/checkpoint_reshard.py runs end to end (TP=2 save, FSDP=3 load, single-process generate).

int4 (the example's default) runs as a user runs it: a fresh interpreter starting ranks of its own. int8 runs
the same ``main`` in this process with its rank launcher pointed at the session's pools of 2 and 3 ranks: the
example's code is the same for both formats, and the fresh interpreter and five fresh ranks cost about 15 s.
"""

import sys

import pytest

from tests.support import examples
from tests.support.examples import checkpoint_reshard


def check(stdout: str) -> None:
    assert "bit-identical to the single-process quantization: True" in stdout, stdout
    assert "equal True" in stdout, stdout


@pytest.mark.slow
def test_checkpoint_reshard_example(tmp_path):
    out = examples.run("checkpoint_reshard", "--format", "int4", "--dir", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    check(out.stdout)


@pytest.mark.slow
def test_checkpoint_reshard_example_int8_on_the_session_ranks(session_launcher, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["checkpoint_reshard.py", "--format", "int8", "--dir", str(tmp_path)])
    monkeypatch.setattr(checkpoint_reshard, "run", session_launcher)  # imported by name there
    checkpoint_reshard.main()  # raises SystemExit where a weight or a token differs
    check(capsys.readouterr().out)
