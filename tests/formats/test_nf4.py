"""formats/nf4: NF4 against the QLoRA / torchao algorithm and torchao itself at real widths, its layout at each
width, and its extremes."""

import math

import pytest
import torch
from torch.distributed.tensor import Shard

import dtensor_quant as dq
from dtensor_quant.testing import weight

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


WIDTHS = [768, 3584, 5632, 11008, 14336, 18944, 29568]


def rows_per_cut(cols: int) -> int:
    return 16384 // math.gcd(16384, cols)


@pytest.mark.parametrize("cols", WIDTHS)
def test_matches_torchao_at_real_widths(cols):
    """Codes, scalers, factors, mean and dequantized values: byte for byte torchao's to_nf4 (bf16 and fp16)."""
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    for dtype in (torch.bfloat16, torch.float16):
        w = weight((rows_per_cut(cols), cols), seed=cols, dtype=dtype)
        ours, theirs = dq.quantize(w, dq.NF4()), nf4_tensor.to_nf4(w)
        assert torch.equal(ours.qdata.flatten(), theirs.quantized_data.flatten())
        assert torch.equal(ours.scaler.flatten(), theirs.quantized_scalers.flatten())
        assert torch.equal(ours.factor.flatten(), theirs.quantization_factor.flatten())
        assert torch.equal(ours.mean.flatten(), theirs.scaler_mean.reshape(1))
        assert torch.equal(ours.dequantize(), theirs.get_original_weight())


def test_fp32_differs_only_by_torchs_float32_mean():
    """fp32: torch's mean accumulates in float32, ours is the exactly rounded one; given the same mean, all agree."""
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    w = weight((64, 11008), seed=3, dtype=torch.float32)
    ours, theirs = dq.quantize(w, dq.NF4()), nf4_tensor.to_nf4(w)
    absmax = w.reshape(-1, 64).abs().amax(1)
    assert ours.mean.item() == (absmax.double().sum() / absmax.numel()).float().item()
    assert abs(ours.mean.item() - theirs.scaler_mean.item()) <= 2 * torch.finfo(torch.float32).eps * ours.mean.item()
    assert torch.equal(ours.qdata.flatten(), theirs.quantized_data.flatten())  # codes do not use the mean


def test_column_cut_refused_with_legal_alternatives():
    q = dq.quantize(weight((8, 14336)), dq.NF4())
    with pytest.raises(
        dq.LayoutError, match=r"'factor' is blocked over the flattened weight.*cannot be sharded at all"
    ):
        torch.chunk(q, 2, dim=1)
    with pytest.raises(dq.LayoutError, match=r"multiple of 8.*n = 1, 2, 4"):
        torch.split(dq.quantize(weight((32, 14336)), dq.NF4()), 11)
    with pytest.raises(dq.LayoutError, match=r"mesh dim 0 .* legal with size 1, 2, 4"):
        dq.check_placements((32, 14336), dq.NF4(), (3,), [Shard(0)])
    # where the blocks fit the rows, column shards (row-parallel TP) stay legal
    dq.check_placements((8, 32768), dq.NF4(), (2,), [Shard(1)])
