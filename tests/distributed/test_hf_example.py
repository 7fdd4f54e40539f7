"""examples/hf_tp_inference.py runs end to end on a tiny Llama written with save_pretrained."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


@pytest.mark.slow
def test_hf_tp_inference_example(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_tp_inference.py"), str(tmp_path / "tiny"), "--write-tiny",
         "llama", "--world", "2", "--format", "int4:128"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens equal to the one-process quantized model on every rank: True" in out.stdout
    assert out.stdout.count("(0.500x the files)") == 2, out.stdout  # every tensor is split in two
