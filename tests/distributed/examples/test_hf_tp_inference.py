"""examples/hf_tp_inference.py runs end to end: on a tiny Llama written with save_pretrained, on an FP8
block-scale checkpoint and on producers' pre-quantized checkpoints, served at TP 2.

One case runs the example as a user runs it (``python examples/hf_tp_inference.py``: a fresh interpreter that
starts ranks of its own); the others call its ``main`` in this process with its ranks taken from the session's
pool (the ``session_launcher`` fixture), which saves each case a Python start, two rank starts and their
imports (about 10 s on two cores) and checks the same printed report and exit status.
"""

from __future__ import annotations

import json

import pytest

from tests.support import examples
from tests.support import hf_cases as hc
from tests.support.examples import hf_tp_inference

pytest.importorskip("transformers")


def serve(capsys, *argv) -> str:
    """The example's ``main(argv)`` (ranks from the ``session_launcher`` fixture); its output, its exit status 0."""
    status = hf_tp_inference.main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert status == 0, out
    return out


def check_tiny(out: str, fmt: str) -> None:
    # equal, or (on a CPU whose GEMM blocks TP's shorter sums otherwise) a near-tie flipped by that rounding
    assert ("tokens equal to the one-process quantized model on every rank: True" in out) or (
        "a near-tie flipped by rounding" in out
    ), out
    assert out.count("(0.500x the files)") == 2, out  # every tensor is split in two
    switched = "mlp.down_proj: column-parallel on a gathered input"
    assert out.count(switched) == (2 if fmt == "nf4" else 0), out


@pytest.mark.slow
def test_hf_tp_inference_example_as_a_script(tmp_path):
    """``python examples/hf_tp_inference.py DIR --write-tiny llama --world 2 --format int4:128``, as a user runs it."""
    argv = [tmp_path / "tiny", "--write-tiny", "llama", "--world", "2", "--format", "int4:128"]
    out = examples.run("hf_tp_inference", *argv)
    assert out.returncode == 0, out.stdout + out.stderr
    check_tiny(out.stdout, "int4:128")


@pytest.mark.slow
def test_hf_tp_inference_example_switches_what_cannot_be_cut(session_launcher, capsys, tmp_path):
    """nf4: down_proj's column cut is illegal (statistics span the row), so the example serves it column-parallel."""
    out = serve(capsys, tmp_path / "tiny", "--write-tiny", "llama", "--world", "2", "--format", "nf4")
    check_tiny(out, "nf4")


@pytest.mark.slow
def test_hf_tp_inference_example_serves_fp8_block_checkpoint(session_launcher, capsys, tmp_path):
    """An FP8 block-scale checkpoint (the tests' own writer) served TP-2 as stored, tokens equal to one process."""
    dense = hc.read_all(hc.write_dense("llama", tmp_path / "dense", False))
    linears = {k for k in dense if ".layers." in k and k.endswith("proj.weight")}
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    path = hc.write_fp8(dense, tmp_path / "fp8", linears, True, config)
    out = serve(capsys, path, "--world", "2", "--format", "Float8Blockwise")
    assert "14 quantized weights" in out, out
    assert "every rank: True" in out or "a near-tie flipped by rounding" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bnb", "gptq"])
def test_hf_tp_inference_example_serves_a_prequantized_checkpoint(session_launcher, capsys, producer_checkpoints, kind):
    """examples/hf_tp_inference.py on a producer's checkpoint: read as stored at TP 2, tokens equal to one process."""
    out = serve(capsys, producer_checkpoints[kind], "--world", "2")
    assert "14 quantized weights, 14 read as stored" in out, out
    assert "tokens equal to the one-process quantized model on every rank: True" in out, out
