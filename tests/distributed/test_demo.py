"""The README's demo command: the whole story on 2 ranks, ending in a bit-exact reshard."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))


@pytest.mark.slow
def test_demo_tells_the_story(capsys):
    import demo

    assert demo.main(["--steps", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 -> TP reload, every byte identical" in out and "0.266x" in out
