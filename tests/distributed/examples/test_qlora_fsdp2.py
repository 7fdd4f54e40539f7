"""examples/qlora_fsdp2.py runs end to end: trains, logs, saves the whole quantized model and reloads it."""

import pytest


@pytest.mark.slow
def test_qlora_example(tmp_path):
    import qlora_fsdp2

    losses = qlora_fsdp2.main(["--steps", "3", "--ranks", "2", "--format", "int8", "--out", str(tmp_path)])
    assert len(losses) == 3
    log = (tmp_path / "loss.csv").read_text().splitlines()
    assert log[0] == "step,loss" and len(log) == 4
    # the whole model (quantized base + adapters), one file per rank; main() asserts the reload is byte-identical
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
