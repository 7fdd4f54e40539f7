"""dist/shard_quant on one process: a shard quantizes to the whole weight's bytes where the layout needs no
reduction, NaN bits included, and N-D weights quantize matrix by matrix.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtensor_quant as dq
from dtensor_quant.testing import FORMATS, assert_same_bits, pick, weight
from tests.support.extra_formats import EXTRA_FORMATS


def poisoned(shape, dtype, seed, kinds):
    """A weight with NaN/+-Inf at a few seeded positions (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).to(dtype)
    values = {"nan": float("nan"), "-nan": -float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    for kind in kinds:
        r = int(torch.randint(shape[0], (1,), generator=g))
        c = int(torch.randint(shape[1], (1,), generator=g))
        w[r, c] = values[kind]
    return w


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    fmt_name=st.sampled_from(["int8", "int4g32", "f8row"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    kinds=st.lists(st.sampled_from(["nan", "-nan", "inf", "-inf"]), min_size=1, max_size=8),
    seed=st.integers(0, 10_000),
    cut=st.integers(1, 16),
)
def test_row_pieces_quantize_to_the_same_bits_as_the_whole(fmt_name, dtype, kinds, seed, cut):
    """Row-blocked formats need no reduction under Shard(0): a piece's bytes must be the whole's, NaN bits included.

    (Vectorized and scalar loops leave different NaN payloads; the library canonicalizes them.)
    """
    fmt = FORMATS[fmt_name]
    w = poisoned((17, 96), dtype, seed, kinds)
    whole = dq.quantize(w, fmt)
    for a, b in ((0, cut), (cut, 17)):
        piece = dq.quantize(w[a:b], fmt)
        for name in fmt.inner_names:
            x, y = getattr(piece, name).contiguous(), getattr(whole, name)[a:b].contiguous()
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (name, a, b)


# every relation at (3, 64, 512): the built-ins at blocks that fit, and the test-only user formats
EXPERT_FORMATS = [*pick("int8", "f8row", "f8tensor", "f8block32", "int4g64", "nf4").values(), *EXTRA_FORMATS.values()]


@pytest.mark.parametrize("fmt", EXPERT_FORMATS, ids=str)
def test_experts_quantize_like_each_expert_alone(fmt):
    w = weight((3, 64, 512))
    q = dq.quantize(w, fmt)
    assert q.shape == w.shape and q.dtype == w.dtype
    for e in range(3):
        alone = dq.quantize(w[e].clone(), fmt)
        assert_same_bits(q[e], alone, f"expert {e}")  # select of one expert: the same bytes as quantizing it alone
        assert torch.equal(q[e].dequantize(), alone.dequantize())
    assert torch.equal(q.dequantize(), torch.stack([dq.quantize(w[e], fmt).dequantize() for e in range(3)]))
    # 4-D: two leading dims
    q4 = dq.quantize(w.reshape(3, 1, 64, 512), fmt)
    assert_same_bits(q4[2][0], dq.quantize(w[2], fmt), "4-D [2][0]")


def test_empty_expert_stack():
    w = weight((0, 64, 512))
    for fmt in (dq.Int8Rowwise(), dq.NF4(64, 256), dq.Int4Groupwise(64)):
        q = dq.quantize(w, fmt)
        assert q.shape == (0, 64, 512) and q.dequantize().shape == (0, 64, 512)
        full = dq.quantize(weight((2, 64, 512)), fmt)
        assert torch.equal(torch.cat([full, q]).dequantize(), full.dequantize())
