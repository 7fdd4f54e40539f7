"""examples/qlora_fsdp2.py runs end to end: trains, logs, saves the whole quantized model and reloads it;
from a Hugging Face checkpoint too."""

import pytest


@pytest.mark.slow
def test_qlora_example(session_launcher, tmp_path):
    from tests.support.examples import qlora_fsdp2

    losses = qlora_fsdp2.main(["--steps", "3", "--ranks", "2", "--format", "int8", "--out", str(tmp_path)])
    assert len(losses) == 3
    log = (tmp_path / "loss.csv").read_text().splitlines()
    assert log[0] == "step,loss" and len(log) == 4
    # the whole model (quantized base + adapters), one file per rank; main() asserts the reload is byte-identical
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


@pytest.mark.slow
def test_qlora_example_from_hf(session_launcher, tmp_path):
    """--hf: the same QLoRA run on a transformers checkpoint, saved back as one."""
    transformers = pytest.importorskip("transformers")

    from tests.support.examples import hf_tp_inference, qlora_fsdp2

    hf_tp_inference.write_tiny(tmp_path / "tiny", "qwen2")
    out = tmp_path / "out"
    losses = qlora_fsdp2.main(["--steps", "3", "--ranks", "2", "--format", "int8", "--out", str(out), "--hf",
                               str(tmp_path / "tiny")])  # fmt: skip
    assert len(losses) == 3
    back = transformers.Qwen2ForCausalLM.from_pretrained(out / "hf")
    assert back.model.layers[0].mlp.down_proj.weight.shape == (256, 768)
