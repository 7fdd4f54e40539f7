"""The formats pre-quantized checkpoints need, against their producers' own dequantization, bit for bit.

Each test writes stored bytes the way the producer lays them out (random
codes, scales that span the dtype's range, extremes), puts them into the
format's inner tensors as a loader would (no requantization), and compares
``dequantize`` and the fast ``unpack`` with what the producer library
computes from the same bytes. A producer package that is missing skips its
tests with the reason; CI installs them (pyproject's ``test`` extra, ``.ci/run``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.testing import same_bits

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def stored(fmt, shape, dtype=torch.bfloat16, **inner):
    """A quantized weight of ``fmt`` whose inner tensors are the given stored bytes (as a loader writes them)."""
    q = dq.quantize(torch.zeros(shape, dtype=dtype), fmt)
    for name, value in inner.items():
        target = getattr(q, name)
        assert target.dtype == value.dtype and target.shape == value.shape, (name, target.shape, value.shape)
        target.copy_(value)
    return q


def random_scales(shape, dtype, seed, extremes=True):
    """Positive scales over the dtype's whole range (log-uniform), with its smallest subnormal and largest value."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = torch.tensor(info.smallest_normal * info.eps).log2().item(), torch.tensor(info.max).log2().item() - 4
    s = torch.exp2(torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if extremes:
        flat = s.view(-1)
        flat[0], flat[1], flat[2] = info.smallest_normal * info.eps, info.max / 16, info.smallest_normal
    return s


def assert_dequantizes_like(q, reference, dtypes=OUT_DTYPES):
    """``q.dequantize(dtype)`` and the fast path equal ``reference(dtype)`` bit for bit in each dtype."""
    from dtensor_quant.ops import unpack

    for dtype in dtypes:
        expected = reference(dtype)
        assert same_bits(q.dequantize(dtype), expected), dtype
        fast = unpack.dense(q, dtype)
        assert fast is None or same_bits(fast, expected), f"unpack differs from the producer in {dtype}"


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two unsigned 4-bit codes per byte along the last dim, the even one in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., ::2] | (codes[..., 1::2] << 4)


# -- compressed-tensors ---------------------------------------------------------------------------------


def _ct():
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is missing: pip install '.[test]'")


def _scheme(**weights):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("group", [128, 32])
def test_compressed_tensors_int4_pack_quantized(symmetric, group):
    """``pack-quantized`` int4: ``weight_packed``'s bytes are qdata as stored; scales bf16; zero points unpacked."""
    _ct()
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, n_in = 48, 4 * group
    g = torch.Generator().manual_seed(group + symmetric)
    codes = torch.randint(-8, 8, (out, n_in), generator=g, dtype=torch.int8)
    scale = random_scales((out, n_in // group), torch.bfloat16, seed=1)
    scheme = _scheme(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    state = {"weight_packed": pack_to_int32(codes, 4), "weight_scale": scale, "weight_shape": torch.tensor([out, n_in])}
    if symmetric:
        fmt = dq.Int4Groupwise(group, scale_dtype=torch.bfloat16)
        zero = torch.zeros_like(scale)
    else:
        zero_ct = torch.randint(-8, 8, (out, n_in // group), generator=g, dtype=torch.int8)
        zero_ct[0, :2] = torch.tensor([-8, 7])
        state["weight_zero_point"] = pack_to_int32(zero_ct, 4, packed_dim=0)
        fmt = dq.Int4GroupwiseIntZero(group, scale_dtype=torch.bfloat16)
        zero = (zero_ct + 8).to(torch.uint8)
    qdata = state["weight_packed"].contiguous().view(torch.uint8)  # little-endian int32 words: element i at bits 4i
    assert torch.equal(qdata, pack_nibbles((codes + 8).to(torch.uint8))), "the bytes are not qdata as stored"
    q = stored(fmt, (out, n_in), qdata=qdata, scale=scale, zero=zero)
    reference = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert reference.dtype == torch.bfloat16
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


def test_compressed_tensors_int8_per_channel():
    _ct()
    from compressed_tensors.compressors import IntQuantizationCompressor

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (40, 256), generator=g, dtype=torch.int8)
    scale = random_scales((40, 1), torch.bfloat16, seed=4)
    scheme = _scheme(num_bits=8, type="int", symmetric=True, strategy="channel")
    reference = IntQuantizationCompressor.decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"]
    q = stored(dq.Int8Rowwise(scale_dtype=torch.bfloat16), (40, 256), qdata=codes, scale=scale)
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


def _e4m3_codes(shape, seed):
    """Every e4m3fn bit pattern but NaN, in random order (so every code, subnormals and +-448 included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    bits = torch.where((bits & 0x7F) == 0x7F, bits ^ 1, bits)
    return bits.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("strategy", ["channel", "block", "tensor"])
def test_compressed_tensors_float8(strategy, scale_dtype):
    """``float-quantized`` FP8: per channel (Float8Rowwise), per tensor (Float8Tensorwise) or 128x128 blocks
    with partial ones (Float8Blockwise), the scale in bf16 or fp32, in a bf16 model."""
    _ct()
    from compressed_tensors.compressors import FloatQuantizationCompressor

    out, n_in = (200, 384) if strategy == "block" else (40, 256)
    codes = _e4m3_codes((out, n_in), seed=5)
    blocks = {"block_structure": [128, 128]} if strategy == "block" else {}
    scheme = _scheme(num_bits=8, type="float", symmetric=True, strategy=strategy, **blocks)
    if strategy == "block":
        scale = random_scales((2, 3), scale_dtype, seed=6)
        fmt = dq.Float8Blockwise(128, scale_dtype=scale_dtype)
        q = stored(fmt, (out, n_in), qdata=codes, scale_inv=scale)
    else:
        scale = random_scales((out, 1) if strategy == "channel" else (1, 1), scale_dtype, seed=6, extremes=False)
        fmt = (dq.Float8Rowwise if strategy == "channel" else dq.Float8Tensorwise)(scale_dtype=scale_dtype)
        q = stored(fmt, (out, n_in), qdata=codes, scale=scale)
    reference = FloatQuantizationCompressor.decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"]
    assert reference.dtype == scale_dtype
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


# -- AutoAWQ and GPTQ (fp16 scales, integer zero points) ---------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble k of a word holds column 8j + AWQ_ORDER[k]


def _awq_packing():
    """AutoAWQ's packing_utils (torch only), loaded from the installed package without its heavy __init__."""
    # tests/distributed/producers.py may already have put a bare namespace for "awq" in sys.modules
    # (its __spec__ is None, which find_spec refuses): its __path__ names the same folder.
    top = sys.modules.get("awq")
    if top is not None and getattr(top, "__path__", None):
        folder = Path(next(iter(top.__path__)))
    else:
        spec = importlib.util.find_spec("awq")
        folder = Path(spec.origin).parent if spec and spec.origin else None
    path = folder / "utils" / "packing_utils.py" if folder is not None else None
    if path is None or not path.exists():
        pytest.skip("autoawq is not installed (pip install --no-deps autoawq==0.2.9; only packing_utils is used)")
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values -> AWQ GEMM int32 [rows, cols/8], nibble k of word j = column 8j + AWQ_ORDER[k]."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    words = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("group", [128, 64])
def test_awq_gemm(group):
    """AWQ GEMM (qweight int32 [in, out/8], qzeros [in/g, out/8], fp16 scales [in/g, out]) vs dequantize_gemm."""
    packing = _awq_packing()
    out, n_in = 64, 4 * group
    g = torch.Generator().manual_seed(group)
    codes = torch.randint(0, 16, (out, n_in), generator=g)
    zero = torch.randint(0, 16, (out, n_in // group), generator=g)
    zero[0, :2] = torch.tensor([0, 15])
    scale = random_scales((out, n_in // group), torch.float16, seed=7)
    reference = packing.dequantize_gemm(awq_pack(codes.t()), awq_pack(zero.t()), scale.t().contiguous(), 4, group)
    assert reference.dtype == torch.float16 and reference.shape == (n_in, out)
    fmt = dq.Int4GroupwiseIntZero(group, scale_dtype=torch.float16)
    q = stored(fmt, (out, n_in), qdata=pack_nibbles(codes), scale=scale, zero=zero.to(torch.uint8))
    assert_dequantizes_like(q, lambda dtype: reference.t().to(dtype))


def test_gptq_v1_zero_point_sixteen():
    """GPTQ v1 stores z - 1 in four bits: a zero point of 0 reads back as 16, and dequantizes as GPTQ does.

    GPTQ's reference dequantization (auto-gptq's and gptqmodel's torch path): ``scales * (weight - zeros)``
    with int8 codes, ``zeros = stored + 1``, fp16 scales.
    """
    g = torch.Generator().manual_seed(8)
    out, n_in, group = 32, 256, 128
    codes = torch.randint(0, 16, (out, n_in), generator=g, dtype=torch.int8)
    stored_zero = torch.randint(0, 16, (out, n_in // group), generator=g, dtype=torch.int8)
    stored_zero[0] = 15  # (0 - 1) & 15
    zeros = stored_zero + 1
    scale = random_scales((out, n_in // group), torch.float16, seed=9)
    reference = scale.repeat_interleave(group, 1) * (codes - zeros.repeat_interleave(group, 1))
    fmt = dq.Int4GroupwiseIntZero(group, scale_dtype=torch.float16)
    q = stored(fmt, (out, n_in), qdata=pack_nibbles(codes), scale=scale, zero=zeros.to(torch.uint8))
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))


def test_symmetric_gptq_in_int4groupwise_rounds_in_fp16_first():
    """Symmetric GPTQ (z = 8) repacked into Int4Groupwise(scale_dtype=fp16): (q - 8) * s in fp16, then bf16.

    Rounding straight from float32 to bf16 would differ from GPTQ's fp16 result converted to bf16
    (double rounding) on some values; scale_dtype makes the format round where GPTQ does.
    """
    g = torch.Generator().manual_seed(10)
    codes = torch.randint(0, 16, (64, 1024), generator=g, dtype=torch.int8)
    scale = random_scales((64, 8), torch.float16, seed=11, extremes=False)
    reference = scale.repeat_interleave(128, 1) * (codes - 8)
    fmt = dq.Int4Groupwise(128, scale_dtype=torch.float16)
    q = stored(fmt, (64, 1024), qdata=pack_nibbles(codes), scale=scale, zero=torch.zeros_like(scale))
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))
    direct = ((codes.float() - 8) * scale.float().repeat_interleave(128, 1)).to(torch.bfloat16)
    assert not same_bits(direct, reference.to(torch.bfloat16)), "no double-rounding case in this sample"


# -- the options themselves -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        dq.Int4Groupwise(128, scale_dtype=torch.float16),
        dq.Int4GroupwiseIntZero(64, scale_dtype=torch.bfloat16),
        dq.Int4GroupwiseIntZero(128),
        dq.Int8Rowwise(scale_dtype=torch.bfloat16),
        dq.Float8Rowwise(scale_dtype=torch.bfloat16),
        dq.Float8Tensorwise(scale_dtype=torch.float32),
        dq.Float8Blockwise(128, scale_dtype=torch.bfloat16),
    ],
    ids=str,
)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_scale_dtype_stores_that_dtype_and_quantizes_well(fmt, wdtype):
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)).to(wdtype)
    q = dq.quantize(w, fmt)
    scale = q.scale_inv if isinstance(fmt, dq.Float8Blockwise) else q.scale
    assert scale.dtype == (fmt.scale_dtype or wdtype)
    err = ((q.dequantize().float() - w.float()).norm() / w.float().norm()).item()
    assert err < (0.12 if "Int4" in type(fmt).__name__ else 0.04), err
    assert_dequantizes_like(q, lambda dtype: q.dequantize(dtype))  # the fast path, every output dtype


def test_scale_dtype_is_part_of_the_identity_and_parses():
    from dtensor_quant.model.format_spec import parse_format

    assert repr(dq.Int4Groupwise(128)) == "Int4Groupwise(group_size=128)"  # unchanged: ids and checkpoints
    assert dq.Int4Groupwise(128, "float16") == dq.Int4Groupwise(128, torch.float16) != dq.Int4Groupwise(128)
    assert len({dq.Int8Rowwise(), dq.Int8Rowwise(torch.bfloat16), dq.Int8Rowwise(torch.float16)}) == 3
    assert dq.Float8Blockwise(128, torch.float32) == dq.Float8Blockwise(128)  # float32 is its default
    assert parse_format("int4:64,float16") == dq.Int4Groupwise(64, torch.float16)
    assert parse_format("int4") == dq.Int4Groupwise()  # not ambiguous with Int4GroupwiseIntZero
    assert parse_format("int4groupwiseintzero:128,bfloat16") == dq.Int4GroupwiseIntZero(128, torch.bfloat16)
    with pytest.raises(ValueError, match="scale_dtype must be None or one of"):
        dq.Int8Rowwise(torch.int8)
    inner_dtypes = {"qdata": torch.uint8, "scale": torch.bfloat16, "zero": torch.bfloat16}
    record = dq.state_dict.quant_record(dq.Int4Groupwise(128), (8, 256), torch.bfloat16, inner_dtypes)
    assert record["params"] == {"group_size": 128}  # as before the option existed


@pytest.mark.parametrize("scale_dtype", [None, torch.float16], ids=["weight dtype", "fp16 scales"])
def test_int_zero_extreme_and_non_finite_input(scale_dtype):
    """Finite groups stay finite (fp16 near its max); NaN/Inf poison only their own group; zeros stay zeros."""
    fmt = dq.Int4GroupwiseIntZero(128, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(16, 512, generator=g) * 20000).clamp(-65504, 65504).to(torch.float16)
    w[3, :128] = 65504
    w[4, :128] = -65504
    d = dq.quantize(w, fmt).dequantize()
    assert d.isfinite().all() and ((d.float() - w.float()).norm() / w.float().norm()) < 0.12

    w = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    w[1, 7], w[2, 300], w[3] = float("-inf"), float("nan"), 0
    d = dq.quantize(w, fmt).dequantize()
    bad = ~d.isfinite()
    assert bad[1, :128].all() and bad[2, 256:384].all() and int(bad.sum()) == 256
    assert (d[3] == 0).all()


# -- MXFP4 ------------------------------------------------------------------------------------------------


def _mx_bytes(shape, seed):
    """Random e2m1 code bytes and e8m0 exponents for a weight ``[..., out, in]``: every code, exponents 0-254."""
    g = torch.Generator().manual_seed(seed)
    *lead, out, n_in = shape
    qdata = torch.randint(0, 256, (*lead, out, n_in // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(100, 150, (*lead, out, n_in // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    flat = scale.view(-1)
    flat[:4] = torch.tensor([0, 1, 254, 127], dtype=torch.uint8)  # 2**-127 (subnormal), 2**127: the extremes
    return qdata, scale


def test_mxfp4_compressed_tensors():
    """``mxfp4-pack-quantized``: ``weight_packed`` and ``weight_scale`` are qdata and scale as stored."""
    _ct()
    from compressed_tensors.compressors import MXFP4PackedCompressor

    qdata, scale = _mx_bytes((48, 512), seed=12)
    scheme = _scheme(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8)
    reference = MXFP4PackedCompressor.decompress({"weight_packed": qdata, "weight_scale": scale}, scheme)["weight"]
    q = stored(dq.MXFP4(), (48, 512), qdata=qdata, scale=scale)
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype), dtypes=(torch.bfloat16,))
    assert_dequantizes_like(q, lambda dtype: q.dequantize(torch.float32).to(dtype))  # exact in fp32: one rounding


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_mxfp4_gpt_oss_expert_stacks_like_transformers(dtype):
    """gpt-oss's ``*_blocks`` [E, out, in/32, 16] and ``*_scales`` [E, out, in/32] into a 3-D stack [E, out, in].

    transformers' ``convert_moe_packed_tensors`` dequantizes them (``ldexp`` in the model's dtype) and
    transposes to its [E, in, out] parameter layout.
    """
    pytest.importorskip("transformers", reason="transformers is missing: pip install '.[test]'")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    qdata, scale = _mx_bytes((3, 40, 256), seed=13)
    blocks = qdata.view(3, 40, 256 // 32, 16)
    reference = convert_moe_packed_tensors(blocks, scale, dtype=dtype)
    assert reference.shape == (3, 256, 40)
    q = stored(dq.MXFP4(), (3, 40, 256), qdata=qdata, scale=scale)
    assert same_bits(q.dequantize(dtype), reference.transpose(1, 2))
    assert same_bits(q[1].dequantize(dtype), reference[1].t())  # one expert, as the eager forward selects it


def test_mxfp4_quantize_matches_the_reference_quantizer():
    """Scales as compressed-tensors' generate_mx_scales (vLLM's reference), values rounded to nearest even e2m1."""
    _ct()
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    g = torch.Generator().manual_seed(14)
    magnitudes = torch.exp2(torch.randint(-20, 20, (32, 1), generator=g).float())
    w = (torch.randn(32, 512, generator=g) * magnitudes).to(torch.bfloat16)
    w[0, :32] = torch.linspace(-7, 7, 32)  # ties and the saturation edge at 6
    w[1, :32] = 1.75 * 2.0**3  # a block maximum that rounds up to the next power of two
    q = dq.quantize(w, dq.MXFP4())
    amax = w.view(32, -1, 32).abs().amax(-1)
    assert torch.equal(q.scale, generate_mx_scales(amax).to(torch.uint8))
    args = _scheme(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32).weights
    scale_float = torch.exp2(q.scale.double() - 127).to(torch.bfloat16)
    reference = fake_quantize(w, scale_float, None, args)
    assert same_bits(q.dequantize(torch.bfloat16), reference.to(torch.bfloat16))


def test_mxfp4_shapes_and_extremes():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        dq.quantize(torch.randn(8, 48), dq.MXFP4())
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[1, 3], w[2, 40], w[3, :32] = float("nan"), float("inf"), 0
    q = dq.quantize(w, dq.MXFP4())
    d = q.dequantize()
    assert (~d[1, :32].isfinite()).all() and (~d[2, 32:].isfinite()).all() and (d[3, :32] == 0).all()
    assert d[0].isfinite().all() and d[1, 32:].isfinite().all() and d[2, :32].isfinite().all()
    big = torch.full((2, 32), torch.finfo(torch.float32).max)
    assert dq.quantize(big, dq.MXFP4()).dequantize().isfinite().all()  # one exponent smaller: values saturate
    near = torch.full((2, 32), 60000.0, dtype=torch.float16)  # the reference rounds it to 4 * 2**14 = 65536: Inf
    assert dq.quantize(near, dq.MXFP4()).dequantize().isfinite().all()


# -- bitsandbytes NF4 ---------------------------------------------------------------------------------------


def _bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is missing: pip install '.[test]'")


def _bnb_state(shape, dtype, absmax, nested, offset):
    """A bitsandbytes QuantState for stored NF4 bytes (double quantization), as a checkpoint's quant_state reads."""
    functional = _bnb()
    nested_state = functional.QuantState(
        absmax=nested, code=functional.create_dynamic_map(), blocksize=256, dtype=torch.float32
    )
    return functional.QuantState(
        absmax=absmax,
        shape=torch.Size(shape),
        dtype=dtype,
        blocksize=64,
        code=functional.get_4bit_type("nf4", device="cpu"),
        quant_type="nf4",
        offset=torch.tensor(offset, dtype=torch.float32),
        state2=nested_state,
    )


def _into_bnb_nf4(shape, dtype, packed, absmax, nested, offset):
    """The stored bnb tensors (flat) in BnbNF4's inner tensors: the same bytes, reshaped to the layout."""
    q = dq.quantize(torch.zeros(shape, dtype=dtype), dq.BnbNF4())
    q.qdata.copy_(packed.reshape(q.qdata.shape))
    q.absmax.copy_(absmax.reshape(q.absmax.shape))
    q.nested_absmax.copy_(nested.reshape(q.nested_absmax.shape))
    q.offset.fill_(offset)
    return q


@pytest.mark.parametrize("shape", [(64, 1024), (40, 14336), (33, 64), (6, 96)], ids=str)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_bnb_nf4_dequantizes_stored_bytes_like_bitsandbytes(shape, dtype):
    """Random stored bytes (every code, absmax code and sign; nested scales over a wide range) vs dequantize_4bit.

    (40, 14336): a nested block of 16384 values runs across rows; (6, 96): so does every 64-value block.
    """
    functional = _bnb()
    numel, g = shape[0] * shape[1], torch.Generator().manual_seed(sum(shape))
    packed = torch.randint(0, 256, (numel // 2, 1), generator=g, dtype=torch.int32).to(torch.uint8)
    absmax = torch.randint(0, 256, (numel // 64,), generator=g, dtype=torch.int32).to(torch.uint8)
    nested = random_scales((-(-numel // 64 // 256),), torch.float32, seed=15, extremes=False) * 1e-30
    offset = 0.0517
    reference = functional.dequantize_4bit(packed, _bnb_state(shape, dtype, absmax, nested, offset))
    q = _into_bnb_nf4(shape, dtype, packed, absmax, nested, offset)
    assert same_bits(q.dequantize(), reference)
    for other in OUT_DTYPES:  # bnb's output dtype is the state's: the same bytes in every dtype
        expected = functional.dequantize_4bit(packed, _bnb_state(shape, other, absmax, nested, offset))
        assert_dequantizes_like(q, lambda d, expected=expected: expected, dtypes=(other,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bnb_nf4_quantize_like_bitsandbytes(dtype):
    """quantize_4bit(nf4, compress_statistics=True): the 4-bit codes always equal bitsandbytes', the rest measured."""
    functional = _bnb()
    agree = total = 0
    for seed, shape in enumerate([(64, 1024), (256, 2048), (40, 14336), (3, 12288)]):
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)
        w[0, :64] = 0  # an all-zero block
        w[1, :64] *= 50  # a block far above the others: its absmax normalizes to +1
        packed, state = functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        q = dq.quantize(w, dq.BnbNF4())
        assert torch.equal(q.qdata.reshape(-1), packed.reshape(-1)), "4-bit codes"
        if q.offset.item() == state.offset.item():  # torch's float32 mean rounded as our float64 sum did
            assert torch.equal(q.nested_absmax.reshape(-1), state.state2.absmax)
        agree += int((q.absmax.reshape(-1) == state.absmax).sum())
        total += state.absmax.numel()
        stored = _into_bnb_nf4(shape, dtype, packed, state.absmax, state.state2.absmax, state.offset.item())
        assert same_bits(stored.dequantize(), functional.dequantize_4bit(packed, state))
        err = ((q.dequantize().float() - w.float()).norm() / w.float().norm()).item()
        assert err < 0.12, err
    # bitsandbytes' CPU search picks the second-nearest of two nearly equidistant map entries now and then
    assert agree / total > 0.99, f"{agree}/{total} absmax codes equal bitsandbytes'"


def test_bnb_nf4_maps_and_layout():
    functional = _bnb()
    from dtensor_quant.formats.bnb_nf4 import NF4_LEVELS_F32, dynamic_map

    assert torch.equal(dynamic_map(), functional.create_dynamic_map())
    assert torch.equal(torch.tensor(NF4_LEVELS_F32), functional.get_4bit_type("nf4", device="cpu"))
    layout = dq.BnbNF4().layout_for((16, 14336))
    assert layout["nested_absmax"] == (dq.FlatBlocked(16384, 14336), dq.InFlat(14336))
    assert layout["absmax"] == (dq.OneToOne(), dq.Blocked(64))
    with pytest.raises(ValueError, match="multiple of block_size"):
        dq.quantize(torch.randn(3, 20), dq.BnbNF4())


def test_bnb_nf4_non_finite_input_poisons_only_its_nested_block():
    w = torch.randn(32, 14336, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[9, 5000] = float("nan")  # flat index 134024: nested block 8 covers [131072, 147456)
    w[20, :64] = 0
    d = dq.quantize(w, dq.BnbNF4()).dequantize().flatten()
    bad = (~d.isfinite()).nonzero().flatten()
    assert bad.numel() == 16384 and bad.min() == 8 * 16384 and bad.max() == 9 * 16384 - 1
    assert (d[20 * 14336 : 20 * 14336 + 64] == 0).all()
