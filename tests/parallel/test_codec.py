"""_parallel/codec: the byte buffer every quantized collective sends, and which inner tensors travel.

The reference is the buffer written out by hand: each tensor's bytes, then
zeros up to the next multiple of ``ALIGN``. ``unpack`` must give back every
tensor bit for bit (NaN payloads of float8 and bf16 included: the reason the
wire carries ``uint8``) as views of the received buffer, each starting on an
aligned offset so that it can be viewed as its dtype.
"""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._parallel.codec import ALIGN, pack, packed_size, unpack, varies
from dtensor_quant.testing import FORMATS, weight


def by_hand(tensors):
    parts = []
    for t in tensors:
        b = t.contiguous().view(-1).view(torch.uint8)
        parts += [b, torch.zeros(-b.numel() % ALIGN, dtype=torch.uint8)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def odd_tensors():
    """Every dtype the formats store, at sizes that are not multiples of ALIGN, with hostile bit patterns."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (3, 5), generator=g, dtype=torch.uint8)
    # a quiet NaN with a payload, a negative one, +Inf and the smallest subnormal
    nan_bf16 = torch.tensor([0x7FC1, 0xFF81 - 0x10000, 0x7F80, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    f8 = torch.tensor([0x7F, 0xFF, 0x01, 0x80, 0x42], dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN, -NaN, ...
    return [
        codes,
        torch.randn(7, generator=g).to(torch.bfloat16),
        nan_bf16,
        f8,
        torch.randint(-8, 8, (2, 3), generator=g, dtype=torch.int8),
        torch.randn(3, generator=g),  # float32: 12 bytes
        torch.randint(-(2**31), 2**31 - 1, (3,), generator=g, dtype=torch.int32),
        torch.empty(0, dtype=torch.float16),
        torch.tensor([1.5], dtype=torch.float64),
    ]


def test_pack_is_the_bytes_end_to_end_each_padded_to_align():
    tensors = odd_tensors()
    buf = pack(tensors)
    assert buf.dtype == torch.uint8 and buf.ndim == 1
    assert torch.equal(buf, by_hand(tensors))
    assert buf.numel() == packed_size(tensors) and packed_size(tensors) % ALIGN == 0


def test_unpack_gives_back_every_tensor_bit_for_bit_as_aligned_views():
    tensors = odd_tensors()
    buf = pack(tensors)
    back = unpack(buf, tensors)
    for t, u in zip(tensors, back):
        assert u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))  # NaN payloads too
        if u.numel():
            offset = u.data_ptr() - buf.data_ptr()
            assert u.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, not a copy
            assert 0 <= offset < buf.numel() and offset % ALIGN == 0


def test_a_transposed_tensor_travels_as_its_values():
    t = weight((6, 10), seed=1).t()  # not contiguous
    (back,) = unpack(pack([t]), [t])
    assert torch.equal(back, t)


def test_one_aligned_tensor_is_sent_without_a_copy():
    t = torch.arange(16, dtype=torch.uint8)
    assert pack([t]).data_ptr() == t.data_ptr()
    assert pack([]).numel() == 0 and packed_size([]) == 0


def test_a_received_buffer_unpacks_into_the_stored_bytes_of_a_weight():
    """What a gather does with one piece: pack a quantized weight's inner tensors, unpack them on the other side."""
    for fmt in FORMATS.values():
        q = dq.quantize(weight((16, 256), seed=2), fmt)
        inner = [getattr(q, n) for n in fmt.inner_names]
        received = pack(inner).clone()  # another rank's copy of the bytes
        for name, t, u in zip(fmt.inner_names, inner, unpack(received, inner)):
            assert torch.equal(u.view(torch.uint8), t.contiguous().view(torch.uint8)), (fmt, name)


@pytest.mark.parametrize(
    "fmt,expected",
    [
        # per inner tensor: varies along dim 0 (rows), dim 1 (columns), any dim
        (dq.Int8Rowwise(), {"qdata": (True, True, True), "scale": (True, False, True)}),
        (dq.Float8Tensorwise(), {"qdata": (True, True, True), "scale": (False, False, False)}),
        (dq.Int4Groupwise(64), {"qdata": (True, True, True), "scale": (True, True, True), "zero": (True, True, True)}),
    ],
    ids=str,
)
def test_varies_is_not_constant_along_the_joined_dims(fmt, expected):
    """A gather sends an inner tensor unless it is Constant along every joined dim: each piece already holds it."""
    q = dq.quantize(weight((16, 256), seed=3), fmt)
    for name, (rows, cols, anywhere) in expected.items():
        assert (varies(q, name, [0]), varies(q, name, [1]), varies(q, name)) == (rows, cols, anywhere), name
        rels = q.rel(name)
        assert varies(q, name, [0, 1]) == (not all(isinstance(r, dq.Constant) for r in rels))
    t = q.t()  # a transposed view: the row scale is constant along its dim 0 now
    assert varies(t, "qdata", [0]) and varies(t, "qdata", [1])
    if isinstance(fmt, dq.Int8Rowwise):
        assert not varies(t, "scale", [0]) and varies(t, "scale", [1])
