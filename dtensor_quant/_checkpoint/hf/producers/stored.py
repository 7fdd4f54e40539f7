"""How one inner tensor of a format is stored by a checkpoint producer, as a map between slices.

A pre-quantized checkpoint stores a format's inner tensors in the producer's
own layout: the same bytes under another name, the same values in a narrower
dtype, 4-bit codes packed eight to an int32 word (along either dim, in
either nibble order, transposed), or not at all (a zero point a symmetric
scheme leaves out). Each :class:`Stored` maps a chunk of the inner tensor
(``offset``, ``shape`` in the inner tensor's own coordinates: what one rank
holds) to the slice of the stored tensor that holds it, so a rank reads only
those bytes, and converts the bytes it read into the chunk, losslessly. The
inverse (``to_stored``) writes a chunk back in the producer's layout.

Every conversion here is exact: the values are the stored ones, rearranged.
A conversion that would lose bits (a narrower dtype that cannot hold a
value) raises ``ValueError`` instead.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass

import torch

from ...._core.producers import StoredAs
from ...state_dict import CheckpointFormatError
from ..io.fields import NUMBER, REQUIRED, Fields, parse
from ..io.safetensors_io import Checkpoint

_SMALL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def small(ckpt: Checkpoint, key: str) -> torch.Tensor:
    """A small checkpoint tensor (a record, a map, a JSON state), read whole once per checkpoint and process."""
    ckpt = getattr(ckpt, "ckpt", ckpt)  # the loader's error-tolerant reader wraps the checkpoint
    cache = _SMALL.setdefault(ckpt, {})
    if key not in cache:
        cache[key] = ckpt.read(key)
    return cache[key]


def _key(template: str, key: str) -> str:
    """``template`` with ``{key}`` (the parameter's key) and ``{base}`` (it without ``.weight``) filled in."""
    base = key[: -len(".weight")] if key.endswith(".weight") else key
    return template.format(key=key, base=base)


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor holding one inner tensor; subclasses say how."""

    template: str  # the checkpoint key, from the parameter's key: "{key}_scale", "{base}.qweight"
    dtype: torch.dtype  # its dtype in the file

    def key(self, key: str) -> str:
        return _key(self.template, key)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored tensor's global shape for an inner tensor of global ``shape``."""
        return tuple(shape)

    def read(self, ckpt: Checkpoint, key: str, offset, shape, full_shape, dtype: torch.dtype) -> torch.Tensor:
        """Chunk ``[offset, offset + shape)`` of the inner tensor (global ``full_shape``), as ``dtype``."""
        raise NotImplementedError

    def to_stored(self, chunk: torch.Tensor, offset, full_shape) -> tuple[tuple[int, ...], torch.Tensor]:
        """``(offset in the stored tensor, stored chunk)`` for an inner chunk at ``offset``."""
        raise NotImplementedError

    def write_alignment(self, ndim: int) -> tuple[int, ...]:
        """Per inner dim, the multiple a chunk's boundary must be on to be written without touching a neighbour's."""
        return (1,) * ndim

    def mismatch(self, info, shape) -> str | None:
        """Why the checkpoint's tensor (``info``: dtype and shape, or None) cannot hold an inner tensor of ``shape``."""
        try:
            want = (self.dtype, self.stored_shape(tuple(shape)))
        except ValueError as e:
            return str(e)
        got = None if info is None else (info.dtype, tuple(info.shape))
        if got == want:
            return None
        return f"as {want[0]} {list(want[1])}, the checkpoint has " + (
            "nothing" if got is None else f"{got[0]} {list(got[1])}"
        )


@dataclass(frozen=True)
class Same(Stored):
    """The inner tensor's values as they are; the file's dtype may be narrower (a bf16 scale held in fp32)."""

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        part = ckpt.read(self.key(key), offset, shape)
        return part if part.dtype == dtype else part.to(dtype)

    def to_stored(self, chunk, offset, full_shape):
        out = chunk.to(self.dtype)
        if out.dtype != chunk.dtype and not torch.equal(out.to(chunk.dtype).view(-1), chunk.reshape(-1)):
            raise ValueError(
                f"{self.template}: the values do not fit the checkpoint's {self.dtype} exactly; "
                "writing them would change them"
            )
        return tuple(offset), out


@dataclass(frozen=True)
class Reshaped(Same):
    """The same values with the last inner dim split in two (gpt-oss ``*_blocks`` ``[..., n/32, 16]``)."""

    inner: int = 16  # the stored last dim

    def stored_shape(self, shape):
        return (*shape[:-1], shape[-1] // self.inner, self.inner)

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        lo, hi = offset[-1] // self.inner, -(-(offset[-1] + shape[-1]) // self.inner)
        part = ckpt.read(self.key(key), (*offset[:-1], lo, 0), (*shape[:-1], hi - lo, self.inner))
        part = part.reshape(*shape[:-1], -1)[..., offset[-1] - lo * self.inner :][..., : shape[-1]]
        return part.to(dtype).contiguous()

    def to_stored(self, chunk, offset, full_shape):
        return (*offset[:-1], offset[-1] // self.inner, 0), chunk.reshape(*chunk.shape[:-1], -1, self.inner)

    def write_alignment(self, ndim):
        return (*(1,) * (ndim - 1), self.inner)


@dataclass(frozen=True)
class Words(Stored):
    """Bytes of the inner tensor's last dim stored as wider words (compressed-tensors' int4 ``weight_packed``).

    ``int32 [out, in/8]`` whose word ``j`` holds values ``8j .. 8j+7`` at bits
    ``4i`` is, read as little-endian bytes, ``uint8 [out, in/2]`` with the even
    value in each low nibble: the inner tensor's exact bytes.
    """

    def _ratio(self, dtype):
        return self.dtype.itemsize // dtype.itemsize

    def stored_shape(self, shape):
        r = self._ratio(torch.uint8)
        if shape[-1] % r:
            raise ValueError(f"{self.template}: a last dim of {shape[-1]} bytes is no whole number of {self.dtype}")
        return (*shape[:-1], shape[-1] // r)

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
            raise ValueError("reading packed words as bytes needs a little-endian machine")
        r = self._ratio(dtype)
        lo, hi = offset[-1] // r, -(-(offset[-1] + shape[-1]) // r)
        words = ckpt.read(self.key(key), (*offset[:-1], lo), (*shape[:-1], hi - lo))
        out = words.view(dtype)[..., offset[-1] - lo * r :][..., : shape[-1]]
        return out.contiguous()

    def to_stored(self, chunk, offset, full_shape):
        r = self._ratio(chunk.dtype)
        return (*offset[:-1], offset[-1] // r), chunk.contiguous().view(self.dtype)

    def write_alignment(self, ndim):
        return (*(1,) * (ndim - 1), self._ratio(torch.uint8))


@dataclass(frozen=True)
class Fill(Stored):
    """An inner tensor the producer does not store because it is constant (a symmetric scheme's zero point)."""

    value: float = 0.0

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        return torch.full(tuple(shape), self.value, dtype=dtype)

    def to_stored(self, chunk, offset, full_shape):
        return tuple(offset), None

    def mismatch(self, info, shape):
        return None

    def holds(self, chunk: torch.Tensor) -> bool:
        """Whether ``chunk`` is exactly the constant (a model whose values changed cannot be written this way)."""
        return bool((chunk == self.value).all())


@dataclass(frozen=True)
class Transposed(Stored):
    """A 2-D inner tensor ``[out, x]`` stored transposed ``[x, out]`` (GPTQ's and AWQ's ``scales``)."""

    def stored_shape(self, shape):
        return (shape[1], shape[0])

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        part = ckpt.read(self.key(key), (offset[1], offset[0]), (shape[1], shape[0]))
        return part.t().contiguous().to(dtype)

    def to_stored(self, chunk, offset, full_shape):
        out = chunk.t().contiguous().to(self.dtype)
        if not torch.equal(out.t().to(chunk.dtype), chunk):
            raise ValueError(f"{self.template}: the values do not fit the checkpoint's {self.dtype} exactly")
        return (offset[1], offset[0]), out


def nibbles(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 words ``[..., n]`` -> 4-bit codes ``[..., 8n]`` (uint8); code ``order[i]`` of a word sits at bits 4i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)
    inverse = [0] * 8
    for i, o in enumerate(order):
        inverse[o] = i
    return codes[..., inverse].flatten(-2)


def words_of(codes: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`nibbles`: codes ``[..., 8n]`` (0..15) -> int32 words ``[..., n]``."""
    c = codes.to(torch.int64).unflatten(-1, (-1, 8))[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = (c << shifts).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


@dataclass(frozen=True)
class PackedCodes(Stored):
    """4-bit codes packed eight per int32 (GPTQ's ``qweight``/``qzeros``, AWQ's), mapped to an inner tensor.

    ``along``: the stored dim the words pack (0 or 1). ``transposed``: the
    stored tensor is ``[x, out]`` for an inner ``[out, x]``. ``order``: which
    code sits at bits ``4i`` of a word (GPTQ 0..7; AWQ 0,2,4,6,1,3,5,7).
    ``add``: added to the stored code to get the inner value (GPTQ v1
    stores zero points minus one; only for ``unpacked``). The inner tensor holds codes either one per
    element (``unpacked``: an integer dtype) or two per byte, even index in the
    low nibble (uint8 ``[out, x/2]``).
    """

    along: int = 0
    transposed: bool = False
    order: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
    add: int = 0
    unpacked: bool = False

    def _values(self, shape):  # the logical codes' [out, x] shape for an inner shape
        return tuple(shape) if self.unpacked else (shape[0], shape[1] * 2)

    def stored_shape(self, shape):
        out, x = self._values(shape)
        s = [x, out] if self.transposed else [out, x]
        if s[self.along] % 8:
            raise ValueError(f"{self.template}: {s[self.along]} codes along dim {self.along} are no whole int32 words")
        s[self.along] //= 8
        return tuple(s)

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        (o0, o1), (n0, n1) = offset, self._values(shape)
        if not self.unpacked:
            o1 *= 2
        off, n = ([o1, o0], [n1, n0]) if self.transposed else ([o0, o1], [n0, n1])
        a = self.along
        lo, hi = off[a] // 8, -(-(off[a] + n[a]) // 8)
        r_off, r_n = list(off), list(n)
        r_off[a], r_n[a] = lo, hi - lo
        words = ckpt.read(self.key(key), r_off, r_n)
        codes = nibbles(words if a == 1 else words.t(), self.order)  # codes along the last dim
        codes = codes[..., off[a] - lo * 8 :][..., : n[a]]
        if a == 0:
            codes = codes.t()
        if self.transposed:
            codes = codes.t()
        codes = codes.contiguous()
        if self.unpacked:  # one code per element: room for GPTQ's zero point + 1 (up to 16)
            return (codes.to(torch.int16) + self.add).to(dtype)
        codes = codes.to(torch.uint8)
        return (codes[:, ::2] | (codes[:, 1::2] << 4)).contiguous()

    def to_stored(self, chunk, offset, full_shape):
        codes = chunk if self.unpacked else torch.stack([chunk & 0xF, chunk >> 4], -1).flatten(-2)
        codes = codes.to(torch.int16) - self.add
        if bool(((codes < 0) | (codes > 15)).any()):
            raise ValueError(f"{self.template}: values outside {self.add}..{15 + self.add} do not fit 4-bit codes")
        o0, o1 = offset
        if not self.unpacked:
            o1 *= 2
        if self.transposed:
            codes, (o0, o1) = codes.t(), (o1, o0)
        if self.along == 0:
            words, o0 = words_of(codes.t().contiguous(), self.order).t().contiguous(), o0 // 8
        else:
            words, o1 = words_of(codes.contiguous(), self.order), o1 // 8
        return (o0, o1), words

    def write_alignment(self, ndim):
        a = self.along if not self.transposed else 1 - self.along
        align = [1, 1]
        align[a] = 8 if (self.unpacked or a == 0) else 4
        return tuple(align)


def _flat_runs(offset, shape, full_shape):
    """``[a, b)`` runs of the row-major flat index that chunk ``[offset, offset + shape)`` of ``full_shape`` covers."""
    if len(full_shape) == 1:
        return [(offset[0], offset[0] + shape[0])] if shape[0] else []
    (o0, o1), (n0, n1), (_, cols) = offset[-2:], shape[-2:], full_shape[-2:]
    if n1 == cols:
        return [(o0 * cols, (o0 + n0) * cols)] if n0 else []
    return [((o0 + i) * cols + o1, (o0 + i) * cols + o1 + n1) for i in range(n0)] if n1 else []


@dataclass(frozen=True)
class Flat(Stored):
    """An inner tensor whose row-major bytes a flat tensor stores (bitsandbytes' ``weight`` ``[n/2, 1]``, ``absmax``).

    ``trailing``: the stored tensor's dims after the flat one (``(1,)`` for ``[n, 1]``).
    """

    trailing: tuple[int, ...] = ()

    def stored_shape(self, shape):
        return (math.prod(shape), *self.trailing)

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        pad = (0,) * len(self.trailing)
        parts = [ckpt.read(self.key(key), (a, *pad), (b - a, *self.trailing)).reshape(-1)
                 for a, b in _flat_runs(offset, shape, full_shape)]  # fmt: skip
        out = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)
        return out.reshape(tuple(shape)).to(dtype)

    def to_stored(self, chunk, offset, full_shape):
        runs = _flat_runs(offset, tuple(chunk.shape), full_shape)
        if len(runs) > 1:
            raise ValueError(f"{self.template}: a column shard of a flat tensor is no single run of it")
        start = runs[0][0] if runs else 0
        return (start, *(0,) * len(self.trailing)), chunk.reshape(-1, *self.trailing).to(self.dtype)


@dataclass(frozen=True)
class JsonField(Stored):
    """A constant inner tensor held as one number of a JSON document stored as uint8 (bitsandbytes' quant_state)."""

    field: str = ""

    def read(self, ckpt, key, offset, shape, full_shape, dtype):
        value = json_doc(ckpt, self.key(key)).field(self.field, NUMBER, REQUIRED)
        return torch.full(tuple(shape), float(value), dtype=dtype)

    def to_stored(self, chunk, offset, full_shape):
        return tuple(offset), None

    def mismatch(self, info, shape):
        return None if info is not None and info.dtype == torch.uint8 and len(info.shape) == 1 else "missing"


def json_doc(ckpt: Checkpoint, key: str) -> Fields:
    """The JSON object uint8 tensor ``key`` holds (bitsandbytes' ``quant_state.bitsandbytes__nf4``), its fields
    checked as they are read; refused naming the file and the tensor if it is not one."""
    info = getattr(ckpt, "ckpt", ckpt).tensors[key]
    if info.dtype != torch.uint8 or len(info.shape) != 1:
        raise CheckpointFormatError(
            f"{info.file}, tensor {key}: {info.dtype} {list(info.shape)}, expected 1-D uint8 (the bytes of a JSON "
            "object); the file is damaged"
        )
    file = info.file
    return parse(bytes(small(ckpt, key).reshape(-1).tolist()), file, tensor=key)


@dataclass(frozen=True)
class Extra:
    """A checkpoint tensor a layout needs that is not an inner tensor (``weight_shape``, ``g_idx``).

    ``check(tensor, shape)`` returns why it does not fit the weight of
    logical ``shape``, or None. Every rank reads it whole (it is small).
    ``value(shape)`` makes it for an export, or None when it cannot be written.
    """

    template: str
    check: object  # (tensor, shape) -> str | None
    value: object = None  # (shape) -> tensor

    def key(self, key: str) -> str:
        return _key(self.template, key)


_MAPS = {"same": Same, "reshaped": Reshaped, "transposed": Transposed, "flat": Flat, "words": Words, "fill": Fill,
         "packed_codes": PackedCodes, "json_field": JsonField}  # fmt: skip


def from_spec(spec: StoredAs) -> Stored:
    """The map a format's declaration (:class:`~dtensor_quant._core.producers.StoredAs`, plain data) names."""
    return _MAPS[spec.kind](spec.template, spec.dtype, **dict(spec.options))


def byte_count(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize
