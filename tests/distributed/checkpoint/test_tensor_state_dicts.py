"""Tensors-only state dicts on live ranks: DTensors of quantized weights as values, plain DCP with the planners.

``get_model_state_dict`` of a model whose state dicts hold tensors, saved by
``dcp.save(..., planner=dq.checkpoint.SavePlanner())`` in one layout and
loaded by ``dcp.load(..., planner=LoadPlanner())`` + ``set_model_state_dict``
in another: every local byte equals the single-process quantization's shard
(``tests.support.ckpt_cases.check_against``), and the checkpoint loads with
``dq.checkpoint.load`` too (the same files).
"""

import pytest

from tests.support.ckpt_cases import load_model, on, save_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PAIRS = [("tp2", "single"), ("s1_2", "tp2"), ("single", "s0_2")]


@pytest.mark.parametrize("fmt_name", ["int8", "int4g32"])
@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_reshard_bit_exact_through_the_planners(ranks, tmp_path, fmt_name, src, dst):
    on(ranks, src, save_model, fmt_name, src, str(tmp_path), "tensors")
    on(ranks, dst, load_model, fmt_name, dst, str(tmp_path), "tensors")
    on(ranks, dst, load_model, fmt_name, dst, str(tmp_path), "dq")


def default_planner_save(fmt_name, layout, path):
    """Plain dcp.save of the default (tensors-only) state dict: what each rank raises, and the files left."""
    import os

    import torch.distributed.checkpoint as dcp

    from dtensor_quant.checkpoint import CheckpointFormatError
    from tests.support.ckpt_cases import placed

    try:
        dcp.save(placed(0, fmt_name, layout).state_dict(), checkpoint_id=path)
        return "saved", [], sorted(os.listdir(path))
    except BaseException as e:  # DCP's CheckpointException (a BaseException) holds each rank's error
        failures = getattr(e, "failures", {}) or {}
        errors = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        ours = [type(x).__name__ for x in errors if isinstance(x, CheckpointFormatError) and "SavePlanner" in str(x)]
        return type(e).__name__, ours, sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_default_planner_is_refused_on_every_rank_before_any_write(ranks, tmp_path):
    """A quantized tensor reaching DCP's default save planner: every rank raises, each rank's error a
    CheckpointFormatError naming the planners, in the planning step (before any file is written)."""
    path = str(tmp_path / "ckpt")
    for kind, ours, files in ranks(2).run(default_planner_save, "int8", "tp2", path):
        assert kind == "CheckpointException" and ours == ["CheckpointFormatError"] * 2, (kind, ours)
        assert not [f for f in files if f.endswith(".distcp") or f == ".metadata"], files
