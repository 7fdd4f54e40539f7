"""_parallel/replicate_to_shard: this rank's piece in one step is what torch's chunk-then-clone gives.

``Shard._replicate_to_shard`` is patched for quantized locals; every case
here runs the patched method and torch's original (``patch("replicate_to_shard").removed()``) on
the same tensor and compares the pieces in full: inner bytes, inner shapes
and strides, relations, orientation, logical shape and strides, the notes
later ops read, and that the piece owns new bytes. Cuts the layout forbids
raise the same error on every rank, whichever piece the rank keeps.
"""

import pytest
import torch
from torch.distributed.tensor import Shard

import dtensor_quant as dq
from dtensor_quant._core import dispatch
from dtensor_quant._core.layout import LayoutError
from dtensor_quant._core.tensor import QuantizedTensor
from dtensor_quant._parallel.fast_redistribute import enabled, patch
from dtensor_quant.testing import FORMATS


@pytest.fixture(autouse=True)
def _shortcuts():
    """The shortcut installed for each test (opt-in: dq.enable_fast_redistribute), and removed after."""
    with enabled():
        yield


class Mesh:
    """What ``_replicate_to_shard`` asks of the mesh: the size of one of its dims."""

    def __init__(self, n):
        self.n = n

    def size(self, mesh_dim=None):
        return self.n


def _torch_piece(placement, q, n, index):
    with patch("replicate_to_shard").removed():
        return placement._replicate_to_shard(q, Mesh(n), 0, index)


def _assert_same_piece(ours, torchs, what):
    assert type(ours) is QuantizedTensor and type(torchs) is QuantizedTensor, what
    assert (ours.fmt, ours.rels, ours.dims, ours.dtype) == (torchs.fmt, torchs.rels, torchs.dims, torchs.dtype), what
    assert ours.shape == torchs.shape and ours.stride() == torchs.stride(), what
    for name in ours.fmt.inner_names:
        a, b = getattr(ours, name), getattr(torchs, name)
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), f"{what}: inner '{name}'"
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if b.dtype.itemsize == 1 else b
        ), f"{what}: inner '{name}' bytes"
    for field in ("shared_outside", "narrowed_from", "from_factory", "pending"):
        assert getattr(ours.notes, field) == getattr(torchs.notes, field), f"{what}: notes.{field}"
    assert ours.notes.bytes is not None and ours.notes.bytes is not torchs.notes.bytes


def _weight(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _cases(q):
    """(dim, n) pairs whose every cut the layout allows, and the pairs it refuses."""
    legal, refused = [], []
    for dim in range(q.ndim):
        for n in (1, 2, 3, 4):
            try:
                torch.chunk(q, n, dim)
            except LayoutError:
                refused.append((dim, n))
            else:
                legal.append((dim, n))
    return legal, refused


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_piece_is_torchs_piece(name):
    fmt = FORMATS[name]
    q = dq.quantize(_weight((256, 512)), fmt)
    legal, _ = _cases(q)
    assert legal, f"{name}: no legal split of a 256x512 weight"
    for view, t in (("weight", q), ("transposed", q.t())):
        legal, refused = _cases(t)
        for dim, n in legal:
            for index in range(n):
                what = f"{name} {view} dim {dim} into {n}, piece {index}"
                _assert_same_piece(
                    Shard(dim)._replicate_to_shard(t, Mesh(n), 0, index), _torch_piece(Shard(dim), t, n, index), what
                )
        for dim, n in refused:
            with patch("replicate_to_shard").removed(), pytest.raises(LayoutError) as theirs:
                torch.chunk(t, n, dim)
            for index in range(n):
                with pytest.raises(LayoutError) as ours:
                    Shard(dim)._replicate_to_shard(t, Mesh(n), 0, index)
                assert str(ours.value) == str(theirs.value)


def test_uneven_short_and_stacked_pieces():
    int8, int4 = FORMATS["int8"], FORMATS["int4g32"]
    cases = [
        (dq.quantize(_weight((10, 64)), int8), 0, 4),  # pieces 3, 3, 3, 1
        (dq.quantize(_weight((5, 64)), int8), 0, 4),  # torch.chunk gives 3 pieces: the 4th is torch's empty one
        (dq.quantize(_weight((96, 64)), int4), 1, 2),
        (dq.quantize(_weight((4, 64, 128)), int4), 0, 3),  # an expert stack by experts
        (dq.quantize(_weight((4, 64, 128)), int4), 1, 2),
    ]
    for q, dim, n in cases:
        for index in range(n):
            what = f"{tuple(q.shape)} dim {dim} into {n}, piece {index}"
            ours = Shard(dim)._replicate_to_shard(q, Mesh(n), 0, index)
            theirs = _torch_piece(Shard(dim), q, n, index)
            if q.shape[dim] == 5 and index == 3:
                assert ours.shape == theirs.shape and ours.shape[dim] == 0, what
                continue
            _assert_same_piece(ours, theirs, what)


def test_one_step_without_dispatch(monkeypatch):
    """The piece is made without entering ``__torch_dispatch__``: no chunk of every rank's piece, no clone op."""
    q = dq.quantize(_weight((256, 256)), FORMATS["int8"])
    Shard(0)._replicate_to_shard(q, Mesh(2), 0, 1)  # the decision made once
    calls = []
    original = dispatch.torch_dispatch
    monkeypatch.setattr(
        QuantizedTensor,
        "__torch_dispatch__",
        classmethod(
            lambda cls, func, types, args=(), kwargs=None: (
                calls.append(func) or original(cls, func, types, args, kwargs)
            )
        ),
    )
    Shard(0)._replicate_to_shard(q, Mesh(2), 0, 1)
    assert calls == []
    with patch("replicate_to_shard").removed():
        Shard(0)._replicate_to_shard(q, Mesh(2), 0, 1)
    assert [str(f) for f in calls] == ["aten.split.Tensor", "aten.clone.default"]


def test_dense_locals_keep_torchs_code():
    dense = _weight((8, 8))
    assert torch.equal(Shard(0)._replicate_to_shard(dense, Mesh(2), 0, 1), dense[4:])


@pytest.mark.parametrize(
    "name,shape,dim,counts",
    [
        ("nf4", (16, 14336), 0, (2, 4)),  # NF4's 16384-weight factor blocks run across rows: 8 rows = 7 blocks
        ("int4g128", (32, 11008), 1, (2, 4)),  # 86 groups: 2 pieces of 43, 4 refused (21.5)
        ("int8", (16, 14336), 1, (3,)),  # uneven: 4779, 4779, 4778
        ("int4g128", (2, 16, 11008), 2, (2,)),  # a 3-D expert stack cut along its columns
        ("nf4", (2, 16, 14336), 0, (2,)),  # ... and by experts
    ],
)
def test_real_widths(name, shape, dim, counts):
    """Widths of real MLPs (14336, 11008) and a 3-D expert stack, where the toy widths above never show
    NF4's flat factor blocks crossing rows or int4 groups refusing a cut."""
    q = dq.quantize(_weight(shape, 7), FORMATS[name])
    for n in counts:
        try:
            torch.chunk(q, n, dim)
        except LayoutError as e:
            for index in range(n):
                with pytest.raises(LayoutError) as ours:
                    Shard(dim)._replicate_to_shard(q, Mesh(n), 0, index)
                assert str(ours.value) == str(e)
            continue
        for index in range(n):
            what = f"{name} {shape} dim {dim} into {n}, piece {index}"
            _assert_same_piece(
                Shard(dim)._replicate_to_shard(q, Mesh(n), 0, index), _torch_piece(Shard(dim), q, n, index), what
            )
