"""core/tensor on live ranks: torch.save / torch.load (weights_only=True) of a DTensor of a quantized tensor."""

from __future__ import annotations

import io

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant.testing import assert_same_bits, mesh, pick, weight

FORMATS = list(pick("int8", "int4g32", "nf4", "bnbnf4", "f8block128", "mxfp4").values())


def save_and_load_dtensors():
    m = mesh(2)
    checked = 0
    for i, fmt in enumerate(FORMATS):
        q = dq.quantize(weight((256, 512), seed=i), fmt)
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            d = distribute_tensor(q, m, placements)
            buf = io.BytesIO()
            torch.save(d, buf)
            buf.seek(0)
            loaded = torch.load(buf)  # weights_only=True
            what = f"{fmt} {placements}"
            assert isinstance(loaded, DTensor) and loaded.placements == d.placements, what
            assert loaded.device_mesh == m and loaded.shape == d.shape, what
            assert_same_bits(loaded.to_local(), d.to_local(), what)
            assert_same_bits(loaded.full_tensor(), q, what)  # and it still gathers
            checked += 1
    return checked


def test_a_dtensor_of_a_quantized_tensor_round_trips_on_each_rank(ranks):
    assert ranks(2).run(save_and_load_dtensors, timeout=300) == [len(FORMATS) * 3] * 2
