"""_parallel/shard_quant on one process: a shard quantizes to the whole weight's bytes -- its own statistics where the
layout needs no reduction (NaN bits included), the shards' combined ones where it does -- N-D weights quantize
matrix by matrix, and a format's inner tensors must be what its layout declares.
"""

import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard as TorchShard

import dtensor_quant as dq
from dtensor_quant._core.format import Reducer, weight_layout
from dtensor_quant._core.layout import Constant
from dtensor_quant._parallel.shard_quant import quantize_local
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


# -- quantize_local: a shard, its statistics combined with the other shards' -----------------------


class InProcessMesh:
    """Two shards quantized in two threads, each statistic all-reduced between them at the same call.

    What :class:`~dtensor_quant._parallel.shard_quant.MeshReducer` does over a process group, on one process:
    a statistic laid out like an inner tensor that is Constant along the cut dim is combined with the other
    shard's (max, min or sum); the others stay the shard's own.
    """

    def __init__(self, fmt, full_shape, dim):
        self.layout, self.dim = weight_layout(fmt, full_shape), dim
        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def reducer(self, rank, full_shape):
        mesh = self

        class Shard(Reducer):
            def __call__(self, stat, op, like):
                if not isinstance(mesh.layout[like][mesh.dim], Constant):
                    return stat
                mesh.slots[rank] = stat
                mesh.barrier.wait()
                a, b = mesh.slots
                out = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add}[op](a, b)
                mesh.barrier.wait()  # both read before either writes the next statistic
                return out

        return Shard(full_shape)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_a_shard_with_reduced_statistics_holds_the_whole_weights_bytes(fmt_name, dim):
    """quantize_local of each half, statistics combined as the mesh would, gives the whole weight's halves."""
    fmt, shape = FORMATS[fmt_name], (32, 512)
    try:
        dq.check_placements(shape, fmt, (2,), [TorchShard(dim)])
    except dq.LayoutError:
        pytest.skip(f"{fmt} cannot be cut in two along dim {dim} at {shape}")
    w = weight(shape, seed=5)
    whole = dq.quantize(w, fmt)
    halves, mesh = torch.chunk(w, 2, dim), InProcessMesh(fmt, shape, dim)
    out = [None, None]

    def run(rank):
        out[rank] = quantize_local(fmt, halves[rank].contiguous(), mesh.reducer(rank, shape), shape)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank, piece in enumerate(torch.chunk(whole, 2, dim)):
        assert_same_bits(out[rank], piece, f"{fmt_name} half {rank} along dim {dim}")


@dataclass(frozen=True)
class WronglyDeclaredInt8(dq.QuantFormat):
    """Declares a scale per row but returns one per tensor, or names its inner tensors otherwise."""

    names: tuple = ("qdata", "scale")
    layout = {"qdata": (dq.OneToOne(), dq.OneToOne()), "scale": (dq.OneToOne(), dq.Constant())}

    def quantize(self, weight, reduce):
        scale = (weight.abs().amax() / 127).clamp(min=1e-12).reshape(1, 1)
        codes = (weight / scale).round().clamp(-127, 127).to(torch.int8)
        return dict(zip(self.names, (codes, scale.to(weight.dtype))))

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


def test_inner_tensors_that_break_the_declared_layout_are_refused():
    with pytest.raises(dq.LayoutError, match=r"returned inner 'scale' of shape \(1, 1\).*layout says \(8, 1\)"):
        dq.quantize(weight((8, 64)), WronglyDeclaredInt8())
    with pytest.raises(
        dq.LayoutError, match=r"returned inner tensors \('codes', 'scale'\).*declares \('qdata', 'scale'"
    ):
        dq.quantize(weight((8, 64)), WronglyDeclaredInt8(names=("codes", "scale")))
