"""core/memo on live ranks: memoised gathers and redistributes equal freshly decided ones.

Bytes, layout, wire log and agreement checks.
"""

from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant._core import memo
from dtensor_quant._parallel import agree, wire
from dtensor_quant.testing import assert_same_bits, mesh, pick, weight

FORMATS = list(pick("int8", "int4g32", "nf4b32s4", "f8row", "f8tensor").values())


def _moves(m):
    yield "S0->R", [Shard(0)], lambda d: d.full_tensor()
    yield "S0->S1", [Shard(0)], lambda d: d.redistribute(m, [Shard(1)]).to_local()
    yield "S1->R", [Shard(1)], lambda d: d.full_tensor()
    yield "S1->S0", [Shard(1)], lambda d: d.redistribute(m, [Shard(0)]).to_local()
    yield "R->S1", [Replicate()], lambda d: d.redistribute(m, [Shard(1)]).to_local()


def memoised_equals_fresh():
    m = mesh(2)
    cases = []
    for i, fmt in enumerate(FORMATS):
        for rows in (64, 40):  # 40 rows: uneven Shard(0) pieces stay whole NF4 blocks (40 * 256 / 2 / 32)
            q = dq.quantize(weight((rows, 256), seed=i), fmt)
            for name, placement, move in _moves(m):
                cases.append((f"{fmt} {rows} {name}", distribute_tensor(q, m, placement), move))
    checked = 0
    for _ in range(3):  # decided on the first round, looked up after; layouts interleave
        for what, d, move in cases:
            with memo.disabled(), wire.record() as slow_log:
                want = move(d)
            with wire.record() as fast_log:
                got = move(d)
            assert_same_bits(got, want, what)
            assert got.rels == want.rels and got.dims == want.dims and got.stride() == want.stride(), what
            assert slow_log.transfers == fast_log.transfers, what
            checked += 1
    assert any(k[0] == "all_gather" for k in memo.keys()), "no all-gather decision was kept"
    return checked


def test_memoised_gathers_equal_fresh_ones(ranks):
    assert all(n == 3 * 5 * 2 * 5 for n in ranks(2).run(memoised_equals_fresh, timeout=300))


def agree_every_call():
    """With DTENSOR_QUANT_AGREE_EVERY_CALL semantics each memoised all-gather still exchanges its fingerprint."""
    m = mesh(2)
    d = DTensor.from_local(dq.quantize(weight((32, 256), seed=3), dq.Int8Rowwise()), m, [Shard(0)])
    d.full_tensor()
    d.full_tensor()  # the decision is kept and the layout is agreed
    counts = []
    for every in (False, True):
        agree.EVERY_CALL = every
        try:
            with wire.record() as log:
                for _ in range(3):
                    d.full_tensor()
        finally:
            agree.EVERY_CALL = False
        counts.append(sum(t.op == "dtensor_quant::agree" for t in log.transfers))
    return counts


def test_memoised_gathers_keep_agreeing_every_call(ranks):
    assert ranks(2).run(agree_every_call, timeout=120) == [[0, 3], [0, 3]]
