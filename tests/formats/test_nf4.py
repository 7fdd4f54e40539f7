"""Single-process checks of each format's math against independent references."""

from dataclasses import dataclass

import pytest
import torch
from test_matmul import assert_kernel_close  # tests/distributed, on sys.path (tests/conftest.py)

import dtensor_quant as dq
from dtensor_quant.core.reductions import block_reduce, expand_blocks
from dtensor_quant.testing import assert_within, linear_error_bound

NF4_LEVELS_REFERENCE = [
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
]  # fmt: skip  (torchao's table: the QLoRA levels rounded to 4 decimals)


def nf4_reference(w: torch.Tensor, block: int, scaler_block: int):
    """The QLoRA / torchao algorithm on the row-major flattened weight, in the weight's dtype."""
    flat = w.flatten()
    blocks = flat.view(-1, block)
    absmax = blocks.abs().max(dim=1).values
    mean = absmax.mean()
    centred = absmax - mean
    groups = centred.view(-1, scaler_block)
    factor = 256 / (2 * groups.abs().max(dim=1).values)
    qscaler = (groups * factor[:, None]).round().clamp(-128, 127).to(torch.int8).flatten()
    levels = torch.tensor(NF4_LEVELS_REFERENCE, dtype=w.dtype)
    normalized = (blocks / absmax[:, None]).flatten()
    codes = (normalized[:, None] - levels).abs().min(dim=-1).indices.to(torch.uint8)
    packed = codes[::2] << 4 | codes[1::2]
    scales = (qscaler.view(-1, scaler_block) / factor[:, None]).flatten().to(w.dtype) + mean
    dense = (levels[codes.long()].view(-1, block) * scales[:, None]).view(w.shape)
    return packed, qscaler, factor, mean, dense


@pytest.mark.parametrize(
    "shape,block,scaler_block",
    [
        ((64, 4096), 64, 256),
        ((32, 512), 64, 256),
        ((8, 8192), 32, 64),
        ((8, 14336), 64, 256),
        ((24, 96), 64, 4),
        ((128, 33), 64, 2),
        ((8, 4), 16, 1),
    ],  # odd width: codes packed across rows; blocks of whole rows
)
def test_nf4_matches_reference_algorithm(shape, block, scaler_block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed, qscaler, factor, mean, dense = nf4_reference(w, block, scaler_block)
    q = dq.quantize(w, dq.NF4(block, scaler_block))
    assert torch.equal(q.qdata.flatten(), packed)
    assert torch.equal(q.scaler.flatten(), qscaler)
    assert torch.equal(q.factor.flatten(), factor)
    assert torch.equal(q.mean.flatten(), mean.reshape(1))
    assert torch.equal(q.dequantize(), dense)
    rel = ((q.dequantize().float() - w.float()).norm() / w.float().norm()).item()
    assert rel < 0.12  # NF4's usual error on Gaussian weights


def test_nf4_layout_follows_weight_width():
    fmt = dq.NF4(64, 256)
    assert fmt.layout_for((64, 4096))["factor"] == (dq.Blocked(4), dq.Constant())  # 64 blocks/row, 4 rows/block
    assert fmt.layout_for((8, 32768))["factor"] == (dq.OneToOne(), dq.Blocked(64 * 256))  # 2 scaler blocks/row
    # 224 blocks per row: a factor's 256 blocks run across rows; 8 rows hold exactly 7 factors.
    flat = fmt.layout_for((16, 14336))["factor"]
    assert flat == (dq.FlatBlocked(64 * 256, 14336), dq.InFlat(14336)) and flat[0].factor == 8
    assert fmt.layout_for((16, 14336))["scaler"] == (dq.OneToOne(), dq.Blocked(64))
    assert fmt.layout_for((24, 96))["qdata"] == (dq.OneToOne(), dq.Packed(2))
    assert fmt.layout_for((2, 96))["scaler"] == (dq.FlatBlocked(64, 96), dq.InFlat(96))
    with pytest.raises(ValueError, match="multiple of block_size"):
        fmt.layout_for((8, 100))


def round_up(x: torch.Tensor, dtype) -> torch.Tensor:
    """The smallest ``dtype`` value >= ``x``: scales round up so that no code is clipped."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


@pytest.mark.parametrize("fmt", [dq.Float8Rowwise(), dq.Float8Tensorwise()])
def test_float8_matches_reference(fmt):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = dq.quantize(w, fmt)
    amax = w.float().abs().amax(dim=1, keepdim=True) if isinstance(fmt, dq.Float8Rowwise) else w.float().abs().max()
    scale = round_up(amax / 448, torch.bfloat16).float()
    expected = ((w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)
    assert q.qdata.dtype == torch.float8_e4m3fn and q.scale.numel() == (16 if isinstance(fmt, dq.Float8Rowwise) else 1)
    assert torch.equal(q.dequantize(), expected)


def test_float8_blockwise_matches_reference_with_partial_blocks():
    """One fp32 scale per 128x128 block (DeepSeek-V3's layout); the last blocks of each dim are partial."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = dq.quantize(w, dq.Float8Blockwise(128))
    assert q.qdata.dtype == torch.float8_e4m3fn and q.scale_inv.dtype == torch.float32
    assert q.scale_inv.shape == (2, 3)
    expected = torch.empty(200, 300, dtype=torch.bfloat16)
    for i in range(2):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s = block.abs().max() / 448
            assert q.scale_inv[i, j] == s
            codes = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (codes.float() * s).to(torch.bfloat16)
    assert torch.equal(q.dequantize(), expected)


def test_int8_and_int4_match_reference():
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q8 = dq.quantize(w, dq.Int8Rowwise())
    scale = round_up(w.float().abs().amax(1, keepdim=True) / 127, torch.bfloat16).float()
    assert torch.equal(q8.dequantize(), ((w.float() / scale).round().clamp(-127, 127) * scale).to(torch.bfloat16))
    q4 = dq.quantize(w, dq.Int4Groupwise(64))
    g = w.float().view(8, 4, 64)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16).float()
    z = (lo + s * 8).to(torch.bfloat16).float()
    codes = ((g - (z - 8 * s)) / s).round().clamp(0, 15)
    assert torch.equal(q4.dequantize(), ((codes - 8) * s + z).view(8, 256).to(torch.bfloat16))


@pytest.mark.parametrize(
    "fmt",
    [
        dq.Int8Rowwise(),
        dq.Int4Groupwise(32),
        dq.NF4(32, 4),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(16),
    ],
    ids=str,
)
def test_quantized_linear_matches_dequantized(fmt):
    """F.linear on a quantized weight (kernel or fallback) agrees with the dequantized weight."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = torch.randn(4, 7, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).requires_grad_()
    q = dq.quantize(w, fmt)
    out = torch.nn.functional.linear(x, q)
    # bf16 kernels sum (and may scale) in orders of their own: within the summation's bound, elementwise
    assert_kernel_close(out, x, q)
    out.float().sum().backward()
    ones, dense = torch.ones(4, 7, 32, dtype=torch.bfloat16), q.dequantize()
    exact = ones.double() @ dense.double()  # grad @ W: 32-term sums, rounded to bf16
    assert_within(x.grad, exact, linear_error_bound(ones, dense.t(), out_dtype=torch.bfloat16), "input gradient")


def test_unsupported_op_names_op_and_format():
    q = dq.quantize(torch.randn(16, 64), dq.NF4(32, 4))
    with pytest.raises(dq.UnsupportedOpError, match=r"aten\.mul.*NF4\(block_size=32"):
        q * 2
    with pytest.raises(dq.LayoutError, match="requantize"):
        q.copy_(torch.randn(16, 64))


@pytest.mark.slow  # two fresh interpreters
def test_compile_cache_key_is_stable_and_discriminating():
    """torch.compile's AOT cache keys a QuantizedTensor by metadata: equal across processes, never across formats."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, dtensor_quant as dq;"
        "print(dq.quantize(torch.randn(64, 256), dq.Int4Groupwise(32))._stable_hash_for_caching())"
    )
    seeds = [
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": s},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for s in ("1", "2")
    ]
    w = torch.randn(64, 256)
    assert seeds[0] == seeds[1] == dq.quantize(w, dq.Int4Groupwise(32))._stable_hash_for_caching()
    others = {dq.quantize(w, f)._stable_hash_for_caching() for f in (dq.Int4Groupwise(64), dq.Int8Rowwise())}
    others.add(dq.quantize(w, dq.Int4Groupwise(32)).t()._stable_hash_for_caching())
    assert seeds[0] not in others and len(others) == 3


def test_format_id_is_marked_constant_the_way_torch_compiler_marks_it():
    from dtensor_quant.core.format_ids import format_id

    def probe():
        pass

    marked = torch.compiler.assume_constant_result(probe)
    added = {k: v for k, v in vars(marked).items()}
    assert added and all(getattr(format_id, k, None) == v for k, v in added.items()), added


def _int8_codes(weight, scale):
    return (weight.float() / scale.float()).round().clamp(-127, 127).to(torch.int8)


@dataclass(frozen=True)
class _ScaleFirstRowBlockInt8(dq.QuantFormat):
    """One int8 scale per 4 rows, listed first: the first inner tensor has 1/4 of the weight's rows."""

    layout = {"scale": (dq.Blocked(4), dq.Constant()), "qdata": (dq.OneToOne(), dq.OneToOne())}

    def quantize(self, weight, reduce):
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, 4, "max")
        scale = (reduce(amax, "max", "scale") / 127).clamp(min=1e-12).to(weight.dtype)
        return {"scale": scale, "qdata": _int8_codes(weight, expand_blocks(scale, 0, 4, weight.shape[0]))}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


@dataclass(frozen=True)
class _ColumnInt8(dq.QuantFormat):
    """One int8 scale per input column: a flat view of it does not follow the flat index."""

    layout = {"qdata": (dq.OneToOne(), dq.OneToOne()), "scale": (dq.Constant(), dq.OneToOne())}

    def quantize(self, weight, reduce):
        scale = (reduce(weight.abs().amax(dim=0, keepdim=True), "max", "scale") / 127).clamp(min=1e-12)
        return {"qdata": _int8_codes(weight, scale), "scale": scale.to(weight.dtype)}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


def test_linear_fallback_takes_its_width_from_the_weight_not_the_first_inner_tensor():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(6))
    q = dq.quantize(w, _ScaleFirstRowBlockInt8())
    # the fallback's matmul against the test's: within the fp32 summation bound (another order may apply)
    assert_within(torch.nn.functional.linear(x, q), x @ q.dequantize().t(), 2 * linear_error_bound(x, q.dequantize()))


def test_slicing_a_flattened_view_that_does_not_follow_the_flat_index_is_a_layout_error():
    flat = dq.quantize(torch.randn(8, 16), _ColumnInt8()).view(-1)  # a per-column scale cannot flatten
    with pytest.raises(dq.LayoutError, match=r"cannot take \[0:16\] of dim 0.*not sliceable after view\(-1\)"):
        flat[0:16]
    with pytest.raises(dq.LayoutError, match=r"cannot split dim 0 into pieces of \[64, 64\]"):
        torch.split(flat, 64)


def test_constructor_refuses_inner_tensors_the_format_does_not_declare():
    q = dq.quantize(torch.randn(8, 16), dq.Int8Rowwise())
    with pytest.raises(dq.LayoutError, match=r"inner tensors \('scale',\).*declares \('qdata', 'scale'\)"):
        dq.QuantizedTensor({"scale": q.scale}, q.fmt, q.rels, q.dims, q.shape, q.dtype)


def test_nf4_extreme_and_non_finite_input():
    """fp16 near its max stays finite; one NaN poisons only its factor's 16384 weights; zero blocks are 0."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 4096, generator=g) * 20000).clamp(-65504, 65504).to(torch.float16)
    w[3, :64] = 65504
    d = dq.quantize(w, dq.NF4()).dequantize()
    assert d.isfinite().all() and ((d.float() - w.float()).norm() / w.float().norm()) < 0.12

    w = torch.randn(32, 14336, generator=g).to(torch.bfloat16)
    w[9, 5000] = float("nan")  # flat index 134024: factor 8 covers [131072, 147456)
    d = dq.quantize(w, dq.NF4()).dequantize().flatten()
    bad = (~d.isfinite()).nonzero().flatten()
    assert bad.numel() == 16384 and bad.min() == 8 * 16384 and bad.max() == 9 * 16384 - 1

    w = torch.randn(8, 14336, generator=g).to(torch.bfloat16)
    w[2, 64:128] = 0
    assert (dq.quantize(w, dq.NF4()).dequantize()[2, 64:128] == 0).all()

    w = (torch.randn(8, 14336, generator=g) * 1e-3).to(torch.float16)  # spread < 0.002: the factor would be Inf
    q = dq.quantize(w, dq.NF4())
    assert q.factor.isfinite().all()
    assert ((q.dequantize().float() - w.float()).norm() / w.float().norm()) < 0.12


@pytest.mark.parametrize(
    "fmt",
    [
        dq.NF4(),
        dq.NF4(64, 4),
        dq.BnbNF4(),
        dq.MXFP4(),
        dq.Int4GroupwiseIntZero(32, scale_dtype=torch.float16),
        dq.Int4Groupwise(32),
        dq.Int8Rowwise(),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(32),
    ],
    ids=str,
)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 512), (46, 1024), (32, 96)], ids=str)  # (32, 96): NF4 blocks across rows
def test_unpack_gives_dequantize_bits_in_every_dtype_and_chunking(fmt, wdtype, shape, monkeypatch):
    """The fast whole-weight path (table lookup, block-grid scales, row chunks) is bit-exact."""
    from dtensor_quant.ops import unpack
    from dtensor_quant.testing import reference_dequantize, same_bits

    q = dq.quantize(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(wdtype) * 0.05, fmt)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        expected = reference_dequantize(q, dtype)
        for chunk in (1 << 20, 1024):  # one piece; row chunks cut on the layout's row blocks
            monkeypatch.setattr(unpack, "CHUNK_ELEMENTS", chunk)
            got = unpack.dense(q, dtype)
            assert got is not None and same_bits(got, expected), (dtype, chunk)
        assert same_bits(q.t().dequantize(dtype), expected.t())


def test_unpack_refuses_a_slice_whose_blocks_are_not_a_fresh_weights():
    """A column slice of NF4 keeps a factor per row cut short: the flat fast path must not read it in flat order."""
    from dtensor_quant.ops import unpack
    from dtensor_quant.testing import reference_dequantize, same_bits

    q = dq.quantize(torch.randn(64, 2048, generator=torch.Generator().manual_seed(0)), dq.NF4())
    for piece in (q[:, :1024], q[:, 1024:], q[:32]):
        expected = reference_dequantize(piece, torch.float32)
        assert same_bits(piece.dequantize(), expected)
        x = torch.randn(3, piece.shape[1], generator=torch.Generator().manual_seed(1))
        # q[:32] is laid out as a fresh weight: NF4's kernel runs and sums in its own order
        assert_within(torch.nn.functional.linear(x, piece), x @ expected.t(), 2 * linear_error_bound(x, expected))
    assert unpack.dense(q[:, :1024], torch.float32) is None  # per-row factors cut short: not a fresh layout
    assert unpack.dense(q[:32], torch.float32) is not None  # whole row blocks: the fast path


def _hostile_weights():
    g = torch.Generator().manual_seed(0)
    near_max = (torch.randn(64, 4096, generator=g) * 20000).clamp(-65504, 65504).to(torch.float16)
    near_max[3, :64] = 65504
    mixed = torch.randn(8, 14336, generator=g).to(torch.bfloat16)
    mixed[1, 7], mixed[2, 9], mixed[3] = float("-inf"), float("nan"), 0
    small = (torch.randn(8, 14336, generator=g) * 1e-3).to(torch.float16)
    return {"fp16 near max": near_max, "nan, inf and a zero row": mixed, "fp16 small": small}


@pytest.mark.parametrize("name", list(_hostile_weights()))
@pytest.mark.parametrize(
    "fmt",
    [
        dq.NF4(),
        dq.BnbNF4(),
        dq.MXFP4(),
        dq.Int4Groupwise(128),
        dq.Int4Groupwise(128, scale_dtype=torch.float16),
        dq.Int4GroupwiseIntZero(128),
        dq.Int4GroupwiseIntZero(128, scale_dtype=torch.float16),
        dq.Int8Rowwise(),
        dq.Int8Rowwise(scale_dtype=torch.bfloat16),
        dq.Float8Rowwise(),
        dq.Float8Tensorwise(),
        dq.Float8Blockwise(32),
        dq.Float8Blockwise(32, scale_dtype=torch.bfloat16),
    ],
    ids=str,
)
def test_unpack_matches_dequantize_on_hostile_input(fmt, name):
    """FSDP2's fast path (unpack) and dequantize agree bit for bit where values are extreme or non-finite.

    Every value that is not NaN bit for bit, and the NaNs in the same places; not a NaN's payload, which
    depends on which of torch's conversion kernels the CPU runs (float8 NaN to fp32 keeps its mantissa
    bits in ATen's scalar kernel, ATEN_CPU_CAPABILITY=default, and not in its vectorized ones).
    """
    from dtensor_quant.ops import unpack
    from dtensor_quant.testing import reference_dequantize, same_bits

    def same_values(a, b):
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and same_bits(a.masked_fill(nan, 0), b.masked_fill(nan, 0))

    w = _hostile_weights()[name]
    q = dq.quantize(w, fmt)
    for dtype in (torch.bfloat16, torch.float32, w.dtype):
        got = unpack.dense(q, dtype)
        assert got is not None and same_values(got, reference_dequantize(q, dtype)), dtype


def test_top_level_dequantize_is_the_inverse_of_quantize():
    """``dq.dequantize`` sits beside ``dq.quantize`` and refuses a dense tensor by type."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q = dq.quantize(w, dq.Int4Groupwise(128))
    assert torch.equal(dq.dequantize(q), q.dequantize())
    assert dq.dequantize(q, torch.float32).dtype == torch.float32
    with pytest.raises(TypeError, match="expects a quantized tensor"):
        dq.dequantize(w)
    assert "interop" in dq.__all__ and "dequantize" in dq.__all__


@pytest.mark.parametrize("fmt_b", [dq.Int8Rowwise(), dq.NF4(), dq.Float8Rowwise()], ids=str)
def test_assigning_data_takes_the_new_weights_values_and_keeps_the_parameters_tags(fmt_b):
    # torch's .data setter swaps only the C++ metadata: the old inner tensors (the values) used to stay.
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    a = dq.quantize(torch.randn(64, 256, dtype=torch.bfloat16), dq.Int4Groupwise(128))
    b = dq.quantize(torch.randn(32, 256, dtype=torch.bfloat16), fmt_b)
    lin = torch.nn.Linear(256, 64, bias=False)
    lin.weight = torch.nn.Parameter(a, requires_grad=False)
    lin(x), lin.weight.t()  # caches a linear plan and kernel inputs on the old weight
    lin.weight.tag = "kept"
    lin.weight.data = b
    assert lin.weight.fmt == fmt_b and lin.weight.shape == b.shape and lin.weight.tag == "kept"
    assert torch.equal(lin.weight.dequantize(), b.dequantize())
    assert torch.equal(lin(x), torch.nn.functional.linear(x, b))
    with pytest.raises(ValueError, match="Quantize it first"):
        lin.weight.data = torch.randn(32, 256)
