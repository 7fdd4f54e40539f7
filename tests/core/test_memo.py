"""core/memo: memoised decisions give what deciding on every call gives.

Bit for bit and note for note.

Decisions are keyed by layout; these tests interleave many layouts, shapes,
strides and notes of the same ops (so a stale or shared decision would show)
and compare every result with the same op run with the memo off: inner
bytes, inner views (storage, offset, strides), relations, orientation,
logical shape and strides, and the notes later ops read.
"""

import random

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core import memo
from dtensor_quant._core.layout import LayoutError, Opaque, Stacked
from dtensor_quant._core.tensor import QuantizedTensor
from dtensor_quant.testing import pick

FORMATS = list(pick("int8", "int4g32", "int4g64", "nf4b32s4", "f8row", "f8tensor").values())


def _weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _inputs():
    """Quantized tensors of one op's many layouts: orientations, slices (annotated), stacks, copies."""
    out = []
    for i, fmt in enumerate(FORMATS):
        for shape in ((64, 256), (48, 128)):
            q = dq.quantize(_weight(shape, i), fmt)
            out += [q, q.t(), q.t().t(), q[:32], q[16:48], q.detach(), q.clone(), q[:, :64] if q.shape[1] > 64 else q]
            pad = q.new_zeros((shape[0] + 16, shape[1]))
            out.append(pad[: shape[0]])  # a factory's leading narrow: padded rows, FSDP2's uneven shard
        stack = dq.quantize(_weight((2, 32, 128), i), fmt)
        out += [stack, stack.transpose(-2, -1), stack[1]]
    return out


def _rels(q):
    # Opaque (after a flatten that does not follow the flat index) has no equality of its own.
    return tuple(tuple("opaque" if isinstance(r, Opaque) else r for r in row) for row in q.rels)


def _same_tensor(a, b, what, same_objects=True):
    assert type(a) is type(b), what
    if not isinstance(a, torch.Tensor):
        assert a == b, what
        return
    if isinstance(a, QuantizedTensor):
        assert a.fmt == b.fmt and _rels(a) == _rels(b) and a.dims == b.dims, what
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, what
        assert a.device == b.device and a.requires_grad == b.requires_grad, what
        for name in a.fmt.inner_names:
            _same_tensor(getattr(a, name), getattr(b, name), f"{what}.{name}", same_objects)
        na, nb = a.notes, b.notes
        assert na.shared_outside == nb.shared_outside, f"{what}: notes.shared_outside"
        assert (na.narrowed_from, na.from_factory) == (nb.narrowed_from, nb.from_factory), f"{what}: notes"
        if same_objects:  # results of the same input: views of the same bytes, made from the same weight
            assert (na.bytes is nb.bytes) or (na.bytes is not None and nb.bytes is not None), f"{what}: bytes"
            assert na.weight is nb.weight, f"{what}: notes.weight"
        else:
            assert (na.weight is None) == (nb.weight is None), f"{what}: notes.weight"
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    assert a.data_ptr() == b.data_ptr() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), what
    if a.data_ptr() != b.data_ptr():  # copies (clone of a constant scale): same bytes
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), what
    else:
        assert a.storage_offset() == b.storage_offset(), what


def _ops(q):
    nd = q.ndim
    yield "t", lambda x: x.t()
    yield "transpose", lambda x: x.transpose(-2, -1) if nd >= 2 else x.transpose(0, 0)
    yield "detach", lambda x: x.detach()
    yield "alias", lambda x: torch.ops.aten.alias(x)
    yield "view same", lambda x: x.view(tuple(x.shape))
    yield "view(-1)", lambda x: x.view(-1)
    yield "wait", lambda x: torch.ops._c10d_functional.wait_tensor(x)
    if nd == 2:
        act = _weight((3, q.shape[1]), 7)
        yield "linear", lambda x: torch.nn.functional.linear(act, x)  # t, then mm on the weight's inner tensors
        bias = _weight((q.shape[0],), 8)
        yield "linear+bias", lambda x: torch.nn.functional.linear(act, x, bias)  # t, then addmm
        if q.shape[0] == 32:
            yield "linear fp32", lambda x: torch.nn.functional.linear(act.float(), x)  # no kernel: dequantizes
    for dim in range(nd):
        for size in (8, 32, 100):
            yield f"split({size}, {dim})", lambda x, s=size, d=dim: x.split(s, d)
        n = q.shape[dim]
        yield f"split_with_sizes({dim})", lambda x, d=dim, n=n: x.split([n // 2, n - n // 2], d)
        yield f"cat halves({dim})", lambda x, d=dim, n=n: torch.cat(x.split([n // 2, n - n // 2], d), d)
        yield f"cat twice({dim})", lambda x, d=dim: torch.cat([x, x], d)
        yield f"cat with a clone({dim})", lambda x, d=dim: torch.cat([x, x.clone()], d)


def _outcome(fn, q):
    try:
        return fn(q), None
    except (LayoutError, NotImplementedError) as e:
        return None, f"{type(e).__name__}: {e}"


def _real_width_inputs():
    """Widths of real MLPs (14336, 29568) and a 3-D expert stack (11008): NF4's flat factor blocks
    (16384 values) cross rows there, which the toy widths above never show; int4's groups of 128 fit."""
    out = []
    for i, fmt in enumerate((dq.NF4(), dq.Int4Groupwise(128))):
        for shape in ((16, 14336), (16, 29568)):
            q = dq.quantize(_weight(shape, i), fmt)
            out += [q, q.t(), q.detach()]
            if shape[1] == 14336:  # 8 rows = 7 factor blocks: a legal row cut (at 29568 it takes 128 rows)
                out += [q[:8], q[8:]]
        stack = dq.quantize(_weight((2, 16, 11008), i), fmt)
        out += [stack, stack[1], stack.transpose(-2, -1)]
    return out


def test_memoised_decisions_equal_fresh_ones_across_interleaved_layouts():
    _check_interleaved(_inputs())


@pytest.mark.slow
def test_memoised_decisions_equal_fresh_ones_at_real_widths():
    _check_interleaved(_real_width_inputs())


def _check_interleaved(inputs):
    memo.clear()
    cases = [(q, name, fn) for q in inputs for name, fn in _ops(q)]
    random.Random(0).shuffle(cases)
    assert memo.ENABLED
    decided = None
    for rnd in range(3):  # the first round decides, the later ones look the decisions up
        for q, name, fn in cases:
            with memo.disabled():
                want, want_err = _outcome(fn, q)
            got, got_err = _outcome(fn, q)
            what = f"round {rnd}, {name} of {q!r}"
            assert got_err == want_err, what
            if want_err is None:
                if isinstance(want, (list, tuple)):
                    assert len(got) == len(want), what
                    for j, (g, w) in enumerate(zip(got, want)):
                        _same_tensor(g, w, f"{what} [{j}]")
                else:
                    _same_tensor(got, want, what)
        if rnd == 0:
            decided = len(memo.keys())
    assert decided and len(memo.keys()) == decided  # the later rounds decided nothing anew


def test_memoised_results_chain_like_fresh_ones():
    """Results fed to further ops (t of a t, split of an alias, mm after t) stay exact."""
    memo.clear()
    x = _weight((3, 256), 9)
    for fmt in FORMATS:
        q = dq.quantize(_weight((64, 256), 1), fmt)
        for _ in range(3):
            with memo.disabled():
                want = [q.t().t().detach(), q.detach().split(16, 0)[1].t(), torch.nn.functional.linear(x, q)]
            got = [q.t().t().detach(), q.detach().split(16, 0)[1].t(), torch.nn.functional.linear(x, q)]
            _same_tensor(got[0], want[0], f"{fmt} t.t.detach", same_objects=False)
            _same_tensor(got[1], want[1], f"{fmt} split.t", same_objects=False)
            assert torch.equal(got[2], want[2]), f"{fmt} linear"


def test_in_place_writes_reach_views_and_kernels():
    """A copy_ into a weight changes what its views and linear see (no result is memoised, only decisions)."""
    x = _weight((2, 256), 3)
    for fmt in (dq.Int8Rowwise(), dq.Int4Groupwise(32)):
        a, b = dq.quantize(_weight((64, 256), 4), fmt), dq.quantize(_weight((64, 256), 5), fmt)
        before = torch.nn.functional.linear(x, a)
        va = a.t()
        a.copy_(b)
        assert torch.equal(va.t().dequantize(), b.dequantize()), fmt
        assert torch.equal(torch.nn.functional.linear(x, a), torch.nn.functional.linear(x, b)), fmt
        assert not torch.equal(before, torch.nn.functional.linear(x, a)), fmt


def test_flattened_views_stay_distinct_grids():
    """Two view(-1) results whose flatten does not follow the flat index never compare as one grid.

    Each result gets an Opaque of its own, memoised or not.
    """
    q = dq.quantize(_weight((64, 256), 6), dq.NF4(32, 4))[:, :64]  # its factors then do not follow the flat index
    for _ in range(3):
        a, b = q.view(-1), q.view(-1)
        opaque = [i for i, row in enumerate(a.rels) if isinstance(row[0], Opaque)]
        assert opaque and all(a.rels[i][0] is not b.rels[i][0] for i in opaque)
        with memo.disabled(), pytest.raises(LayoutError) as fresh:
            a.copy_(b)
        with pytest.raises(LayoutError) as memoised:
            a.copy_(b)
        assert str(memoised.value) == str(fresh.value)


def test_switch_off():
    q = dq.quantize(_weight((16, 64), 0), dq.Int8Rowwise())
    memo.clear()
    with memo.disabled():
        assert not memo.ENABLED
        q.t()
        assert memo.keys() == []
    assert memo.ENABLED
    q.t()
    assert [k[0] for k in memo.keys()] == ["transpose"]


@pytest.mark.parametrize("fmt", [dq.Int4Groupwise(64), dq.NF4(64, 4)])
def test_misaligned_split_raises_on_every_call(fmt):
    q = dq.quantize(_weight((64, 256), 2), fmt)
    for _ in range(3):
        with pytest.raises(LayoutError):
            q.split(100, 1)


def test_deferred_transposes_are_the_same_views_wherever_first_read():
    """``t()`` makes its inner transposes on first read (``Notes.pending``): read after the weight's
    bytes change, under a dispatch mode or with grad on, they are still the views made at once.
    Not deferred where an inner name is also a Tensor attribute (NF4's ``mean``): it would read as
    the method."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _weight((2, 256), 3)
    for fmt in FORMATS:
        q, other = dq.quantize(_weight((64, 256), 1), fmt), dq.quantize(_weight((64, 256), 2), fmt)
        deferred = not any(hasattr(torch.Tensor, n) for n in fmt.inner_names)
        want = q.t()
        want.inner  # noqa: B018  (made now)
        torch.nn.functional.linear(x, q)
        views = [q.t() for _ in range(3)]
        assert all((v.notes.pending is not None) == deferred for v in views), fmt
        with FakeTensorMode():
            first = getattr(views[0], fmt.inner_names[-1])
        with torch.enable_grad():
            second = getattr(views[1], fmt.inner_names[-1])
        assert type(first) is torch.Tensor and type(second) is torch.Tensor, fmt
        assert not any(v.notes.pending is not None for v in views[:2]), fmt
        for v in views:
            _same_tensor(v, want, f"{fmt} deferred t()")
            assert all(getattr(v, n)._base is None for n in fmt.inner_names), fmt  # as made inside dispatch
        late = q.t()
        q.copy_(other)
        assert torch.equal(late.dequantize(), other.dequantize().t()), fmt


def test_deferred_transpose_read_from_several_threads():
    """Threads reading one pending ``t()`` at once all see its inner tensors: a reader that arrives while
    another makes them must not find them neither pending nor set (an AttributeError, 'no attribute inner')."""
    import threading

    q = dq.quantize(_weight((64, 256), 1), dq.Int8Rowwise())
    want = q.dequantize().t()
    errors, wrong = [], []

    def read(v, start):
        start.wait()
        try:
            wrong.append(not torch.equal(v.dequantize(), want))
        except Exception as e:
            errors.append(repr(e))

    for _ in range(30):
        v, start = q.t(), threading.Barrier(4)
        threads = [threading.Thread(target=read, args=(v, start)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and not any(wrong), errors[:1]


def test_concatenations_whose_constants_agree_or_not():
    """A concatenation's layout depends on whether the pieces' constant inner tensors agree (read from the
    data on every call): interleaved, memoised and fresh results stay equal for both outcomes."""
    memo.clear()
    w = _weight((64, 128), 3)
    cases = []
    for fmt in (dq.Int8Rowwise(), dq.Float8Tensorwise(), dq.Int4Groupwise(32)):
        a, b, c = dq.quantize(w, fmt), dq.quantize(w * 2, fmt), dq.quantize(w, fmt)
        for dim in (0, 1):
            cases += [(f"{fmt} differ {dim}", [a, b], dim), (f"{fmt} agree {dim}", [a, c], dim)]
    random.Random(1).shuffle(cases)
    stacked = set()
    for rnd in range(3):
        for what, pieces, dim in cases:
            with memo.disabled():
                want, want_err = _outcome(lambda ps, d=dim: torch.cat(ps, d), pieces)
            got, got_err = _outcome(lambda ps, d=dim: torch.cat(ps, d), pieces)
            assert got_err == want_err, what
            if want_err is None:
                _same_tensor(got, want, f"round {rnd}, {what}", same_objects=False)
                if any(isinstance(r, Stacked) for row in got.rels for r in row):
                    stacked.add(what)
    assert stacked and all("differ" in what for what in stacked)  # both outcomes were taken


def test_view_recipes_follow_data_assignment():
    """``t()`` and ``view(-1)`` keep their decided layout on the tensor (``VIEW_RECIPES``, read in one lookup);
    ``.data = other`` swaps the layout and drops them, and the next views are what deciding afresh gives."""
    from dtensor_quant._core.tensor import VIEW_RECIPES

    a = dq.quantize(_weight((64, 256), 1), dq.Int8Rowwise())
    b = dq.quantize(_weight((32, 128), 2), dq.Int4Groupwise(32))
    for _ in range(2):
        a.t(), a.view(-1)
    assert all(key in a.__dict__ for key in VIEW_RECIPES)
    a.data = b
    assert not any(key in a.__dict__ for key in VIEW_RECIPES)
    for rnd in range(3):  # decided, then read off the tensor
        with memo.disabled():
            want = [a.t(), a.view(-1)]
        got = [a.t(), a.view(-1)]
        for g, w, what in zip(got, want, ["t", "view(-1)"]):
            _same_tensor(g, w, f"round {rnd}, {what} after .data =")
        assert torch.equal(got[0].dequantize(), b.dequantize().t())
        assert torch.equal(got[1].view(32, 128).dequantize(), b.dequantize())  # (a flat view does not dequantize)
