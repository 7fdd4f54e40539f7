"""dq.hf.QuantConfig with tp_plan="auto" on 2 live gloo ranks (the environment torchrun sets).

from_pretrained shards the model by transformers' own TP plan and quantizes
each rank's slice as read: its bytes are compared with dq.hf.load's into the
same layout (quantize the whole weight, then shard: statistics all-reduced
where a row spans ranks); in float32, its generate with one process's, and
a save_pretrained at TP 2 is reloaded at TP 2 (same bytes, same tokens) and
on one process (the one-process model's bytes).
"""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support import hf_quant_cases as qc
from tests.support.hf_cases import CONFIG

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


# int8: per-row scales of the row-parallel (Shard(1)) weights are all-reduced; int4g128: groups within a rank.
@pytest.mark.parametrize("fmt_name", ["int8", pytest.param("int4g128", marks=pytest.mark.slow)])
def test_tp_plan_auto_round_trip(ranks, checkpoints, tmp_path, fmt_name):
    path = checkpoints["llama", False]
    results = ranks(2).run(qc.tp_round_trip, path, fmt_name, str(tmp_path / "tp"))
    one = qc.from_pretrained(path, torch.float32, quantization_config=dq.hf.QuantConfig(dq.testing.FORMATS[fmt_name]))
    want = qc.tokens(one)
    linears = 7 * CONFIG["num_hidden_layers"] + 1  # q, k, v, o, gate, up, down a layer; lm_head
    for r in results:
        assert r["quantized"] == linears and r["sharded"] == linears + 1, r  # the embedding is sharded too, dense
        assert r["tokens"] == want and r["tokens_again"] == want, (r, want)
    saved = qc.from_pretrained(tmp_path / "tp", torch.float32)  # written at TP 2, read by one process: the same bytes
    qc.assert_same_model(saved, one)


def test_tp_plan_auto_nf4_round_trip(ranks, checkpoints, tmp_path):
    """NF4 under tp_plan="auto" (o_proj, down_proj left dense: NF4 cannot be cut along their inputs): each rank's
    bytes are the one-process model's, sharded; generate gives its tokens; save_pretrained at TP 2 reloads at TP 2
    and on one process with the same bytes."""
    path = checkpoints["llama", False]
    results = ranks(2).run(qc.tp_nf4_round_trip, path, str(tmp_path / "tp"))
    one = qc.from_pretrained(path, torch.float32, quantization_config=qc.nf4_config())
    want = qc.tokens(one)
    quantized = 5 * CONFIG["num_hidden_layers"] + 1  # q, k, v, gate, up a layer; lm_head
    for r in results:
        assert r["quantized"] == quantized, r
        assert r["tokens"] == want and r["tokens_again"] == want, (r, want)
    saved = qc.from_pretrained(tmp_path / "tp", torch.float32)
    assert qc.assert_same_model(saved, one) == quantized
