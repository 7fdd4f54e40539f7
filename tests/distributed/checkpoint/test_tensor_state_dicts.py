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
