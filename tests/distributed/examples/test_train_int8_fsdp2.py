"""examples/train_int8_fsdp2.py runs end to end: trains on 2 ranks, saves, resumes on 3 with every byte the same."""

import pytest


@pytest.mark.slow
def test_train_int8_example(session_launcher, tmp_path):
    from tests.support.examples import train_int8_fsdp2

    result = train_int8_fsdp2.main(["--steps", "4", "--resume-steps", "2", "--out", str(tmp_path)])
    assert result["identical"] and len(result["losses"]) == 4 and len(result["resumed"]) == 2
    assert result["resumed"][-1] < result["losses"][0]
    log = (tmp_path / "loss.csv").read_text().splitlines()
    assert log[0] == "step,loss" and len(log) == 5
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
