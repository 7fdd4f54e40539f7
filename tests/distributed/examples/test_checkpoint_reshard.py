"""examples/checkpoint_reshard.py runs end to end (TP=2 save, FSDP=3 load, single-process generate)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_checkpoint_reshard_example(tmp_path, fmt):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "checkpoint_reshard.py"), "--format", fmt, "--dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-identical to the single-process quantization: True" in out.stdout
    assert "equal True" in out.stdout
