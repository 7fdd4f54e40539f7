"""examples/checkpoint_reshard.py runs end to end (TP=2 save, FSDP=3 load, single-process generate)."""

import pytest

from tests.support import examples


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_checkpoint_reshard_example(tmp_path, fmt):
    out = examples.run("checkpoint_reshard", "--format", fmt, "--dir", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-identical to the single-process quantization: True" in out.stdout
    assert "equal True" in out.stdout
