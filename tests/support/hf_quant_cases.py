"""transformers' from_pretrained with dq.hf.QuantConfig: the checks, importable by the ranks of a pool.

References are built by the routes the library already has: ``from_pretrained``
dense then ``dq.quantize_`` (one process), and a meta model quantized, placed
by the TP plan, materialized and filled by ``dq.hf.load`` (each rank's slice).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import dtensor_quant as dq
from dtensor_quant.testing import FORMATS, assert_same_bits
from tests.support import hf_cases as hc

PROMPT = [[1, 2, 3, 4, 5]]
NEW_TOKENS = 6


def from_pretrained(path, dtype=torch.bfloat16, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)


def tokens(model) -> list:
    with torch.no_grad():
        return model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()


def _local(p):
    return p._local_tensor if isinstance(p, DTensor) else p


def assert_same_model(model, ref) -> int:
    """Same parameters (names, placements, requires_grad) with the same bytes; returns how many are quantized."""
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert params.keys() == ref_params.keys(), params.keys() ^ ref_params.keys()
    quantized = 0
    for name, p in params.items():
        r = ref_params[name]
        assert type(p) is type(r) and p.requires_grad == r.requires_grad, (name, type(p), type(r), p.requires_grad)
        if isinstance(p, DTensor):
            assert p.placements == r.placements and tuple(p.shape) == tuple(r.shape), (name, p.placements, r.placements)
        a, b = _local(p), _local(r)
        if isinstance(b, dq.QuantizedTensor):
            assert_same_bits(a, b, name)
            quantized += 1
        else:
            assert not isinstance(a, dq.QuantizedTensor), name
            assert a.dtype == b.dtype and torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8)), name
    return quantized


def quantization_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())["quantization_config"]


def tp_round_trip(path, fmt_name: str, out) -> dict:
    """On every rank: from_pretrained(tp_plan="auto") vs dq.hf.load into the same TP layout (bf16, as hc.build makes
    it); then in float32 (a row-parallel all-reduce regroups the sums: in bf16 a near-tie of the tiny random model's
    logits can flip a greedy token) generate, save at TP 2, reload at TP 2. Returns what the test compares."""
    fmt = FORMATS[fmt_name]
    model = from_pretrained(path, quantization_config=dq.hf.QuantConfig(fmt), tp_plan="auto")
    ref = hc.build("llama", "tp2", fmt_name)
    dq.hf.load(ref, path)
    quantized = assert_same_model(model, ref)
    sharded = sum(isinstance(p, DTensor) and _local(p).shape != p.shape for p in model.parameters())
    model = from_pretrained(path, torch.float32, quantization_config=dq.hf.QuantConfig(fmt), tp_plan="auto")
    got = tokens(model)
    model.save_pretrained(out)
    torch.distributed.barrier()
    again = from_pretrained(out, torch.float32, tp_plan="auto")
    assert_same_model(again, model)
    return {"quantized": quantized, "sharded": sharded, "tokens": got, "tokens_again": tokens(again)}


# NF4's double-quantized 'factor' is blocked over the flattened weight: a row-parallel (Shard(1)) cut cannot hold it,
# so those layers stay dense, as a user names them.
ROW_PARALLEL = ["o_proj", "down_proj"]


def nf4_config():
    return dq.hf.QuantConfig("nf4", modules_to_not_convert=ROW_PARALLEL)


def tp_nf4_round_trip(path, out) -> dict:
    """On every rank: NF4 with tp_plan="auto" (row-parallel layers dense) against the one-process model's bytes
    sharded by each parameter's placements; generate; save_pretrained at TP 2; reload at TP 2 (same bytes)."""
    from torch.distributed.tensor import distribute_tensor

    model = from_pretrained(path, torch.float32, quantization_config=nf4_config(), tp_plan="auto")
    one = from_pretrained(path, torch.float32, quantization_config=nf4_config())
    quantized = 0
    for name, p in model.named_parameters():
        want = one.get_parameter(name).detach()
        if isinstance(p, DTensor):
            want = distribute_tensor(want, p.device_mesh, p.placements, src_data_rank=None)._local_tensor
        got = _local(p)
        if isinstance(want, dq.QuantizedTensor):
            assert_same_bits(got, want, name)
            quantized += 1
        else:
            assert not isinstance(got, dq.QuantizedTensor), name
            assert torch.equal(got.detach().view(torch.uint8), want.view(torch.uint8)), name
    got = tokens(model)
    model.save_pretrained(out)
    torch.distributed.barrier()
    again = from_pretrained(out, torch.float32, tp_plan="auto")
    assert_same_model(again, model)
    return {"quantized": quantized, "tokens": got, "tokens_again": tokens(again)}
