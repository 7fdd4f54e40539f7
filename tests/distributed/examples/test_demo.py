"""The README's demo command: the whole story on 2 ranks, ending in a bit-exact reshard."""

import pytest


@pytest.mark.slow
def test_demo_tells_the_story(capsys):
    import demo

    assert demo.main(["--steps", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 -> TP reload, every byte identical" in out and "0.266x" in out
