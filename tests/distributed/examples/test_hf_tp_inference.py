"""examples/hf_tp_inference.py runs end to end: on a tiny Llama written with save_pretrained, on an FP8
block-scale checkpoint and on producers' pre-quantized checkpoints, served at TP 2 as a user runs it."""

from __future__ import annotations

import json

import pytest

from tests.support import examples
from tests.support import hf_cases as hc

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4:128", "nf4"])  # nf4: down_proj's column cut is illegal, so it is switched
def test_hf_tp_inference_example(tmp_path, fmt):
    out = examples.run("hf_tp_inference", tmp_path / "tiny", "--write-tiny", "llama", "--world", "2", "--format", fmt)
    assert out.returncode == 0, out.stdout + out.stderr
    # equal, or (on a CPU whose GEMM blocks TP's shorter sums otherwise) a near-tie flipped by that rounding
    assert ("tokens equal to the one-process quantized model on every rank: True" in out.stdout) or (
        "a near-tie flipped by rounding" in out.stdout
    ), out.stdout
    assert out.stdout.count("(0.500x the files)") == 2, out.stdout  # every tensor is split in two
    switched = "mlp.down_proj: column-parallel on a gathered input"
    assert out.stdout.count(switched) == (2 if fmt == "nf4" else 0), out.stdout


@pytest.mark.slow
def test_hf_tp_inference_example_serves_fp8_block_checkpoint(tmp_path):
    """An FP8 block-scale checkpoint (the tests' own writer) served TP-2 as stored, tokens equal to one process."""
    dense = hc.read_all(hc.write_dense("llama", tmp_path / "dense", False))
    linears = {k for k in dense if ".layers." in k and k.endswith("proj.weight")}
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    path = hc.write_fp8(dense, tmp_path / "fp8", linears, True, config)
    out = examples.run("hf_tp_inference", path, "--world", "2", "--format", "Float8Blockwise")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "14 quantized weights" in out.stdout, out.stdout
    assert "every rank: True" in out.stdout or "a near-tie flipped by rounding" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bnb", "gptq"])
def test_hf_tp_inference_example_serves_a_prequantized_checkpoint(producer_checkpoints, kind):
    """examples/hf_tp_inference.py on a producer's checkpoint: read as stored at TP 2, tokens equal to one process."""
    out = examples.run("hf_tp_inference", producer_checkpoints[kind], "--world", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "14 quantized weights, 14 read as stored" in out.stdout, out.stdout
    assert "tokens equal to the one-process quantized model on every rank: True" in out.stdout, out.stdout
