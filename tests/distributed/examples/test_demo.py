"""examples/demo.py, the README's demo command: the whole story on 2 ranks, ending in a bit-exact reshard.

Run as a script, as the README runs it: the demo imports the examples beside it by their names.
"""

import pytest

from tests.support import examples


@pytest.mark.slow
def test_demo_tells_the_story():
    out = examples.run("demo", "--steps", "2", "--tokens", "4", timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FSDP2 -> TP reload, every byte identical" in out.stdout and "0.266x" in out.stdout, out.stdout
