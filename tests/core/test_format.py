"""core/format: what the format protocol declares instead of callers guessing: block sizes, shape checks, HF names."""

from dataclasses import dataclass

import pytest
import torch
from torch.distributed.tensor import Replicate

import dtensor_quant as dq
from dtensor_quant._core.format import check_shape, check_weight
from dtensor_quant._core.reductions import block_reduce, expand_blocks
from dtensor_quant._model.planner.plan import plan
from dtensor_quant.testing import weight


def _codes(weight, scale):
    return torch.round(weight.float() / scale.float()).clamp(-127, 127).to(torch.int8)


@dataclass(frozen=True)
class _RowBlocks(dq.QuantFormat):
    """One scale per ``rows`` rows; its block size is a field not named ``*size``, declared."""

    rows: int = 8
    block_size_params = ("rows",)

    @property
    def layout(self):
        return {"qdata": (dq.OneToOne(), dq.OneToOne()), "scale": (dq.Blocked(self.rows), dq.Constant())}

    def quantize(self, weight, reduce):  # the planner sizes its cells by quantizing on the meta device
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, self.rows, "max")
        scale = reduce(amax, "max", "scale").clamp(min=1e-12).div(127).to(weight.dtype)
        return {"qdata": _codes(weight, expand_blocks(scale, 0, self.rows, weight.shape[0])), "scale": scale}

    def dequantize(self, inner, dtype):
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


@dataclass(frozen=True)
class _FixedBlocks(_RowBlocks):
    """The same blocks, declared not to be shrunk (say a kernel fixes them): no smaller-block advice."""

    block_size_params = ()


@dataclass(frozen=True)
class _Undeclared(dq.QuantFormat):
    """No declaration: the default names the int fields that size a Blocked relation."""

    rows: int = 8
    other: int = 3
    flag: bool = True

    @property
    def layout(self):
        return {"qdata": (dq.OneToOne(), dq.Packed(1)), "scale": (dq.Blocked(self.rows), dq.Blocked(1))}


def test_builtin_formats_name_their_block_sizes():
    assert dq.Int4Groupwise(64).block_size_params == ("group_size",)
    assert dq.NF4().block_size_params == ("block_size", "scaler_block_size")
    assert dq.Float8Blockwise().block_size_params == ("block_size",)
    for fmt in (dq.Int8Rowwise(), dq.Float8Rowwise(), dq.Float8Tensorwise()):
        assert fmt.block_size_params == ()


def test_default_block_size_params_come_from_the_layout():
    assert _Undeclared(rows=8, other=3).block_size_params == ("rows",)
    assert _Undeclared(rows=3, other=3).block_size_params == ("rows", "other")  # same value: either could be
    assert _Undeclared(rows=1, other=3).block_size_params == ("rows",)  # Blocked(1) matches rows, never the bool
    assert dq.NF4.block_size_params != dq.QuantFormat.block_size_params  # declared, since its layout needs a shape


def test_planner_shrinks_only_the_declared_block_sizes():
    # 48 rows over tp 4: chunks of 12 cut a block of 8, but not one of 4.
    ((_, (cell,)),) = plan([("w", (48, 64), "colwise")], _RowBlocks(8), tp=[4]).rows
    assert not cell.legal and "_RowBlocks(rows=4) would be legal here" in cell.alternatives
    ((_, (cell,)),) = plan([("w", (48, 64), "colwise")], _FixedBlocks(8), tp=[4]).rows
    assert not cell.legal and "would be legal here" not in cell.alternatives


def test_check_shape_asks_no_dtype():
    fmt = dq.Int4Groupwise(32)
    with pytest.raises(ValueError, match="even"):
        fmt.check_shape(torch.Size((4, 33)))
    fmt.check_shape(torch.Size((4, 32)))
    with pytest.raises(ValueError, match="floating-point"):  # the dtype, which check_shape never sees
        fmt.check_weight(torch.Size((4, 32)), torch.int32)
    with pytest.raises(ValueError, match="even"):  # check_weight runs check_shape after the dtype
        fmt.check_weight(torch.Size((4, 33)), torch.float32)
    with pytest.raises(ValueError, match="not a multiple of block_size 64"):
        check_shape(dq.NF4(), (3, 7))
    with pytest.raises(ValueError, match=r"each \[out, in\] matrix \(4, 33\) of the \(2, 4, 33\) weight"):
        check_shape(fmt, (2, 4, 33))
    with pytest.raises(ValueError, match="at least 2 dims"):
        check_shape(fmt, (32,))
    check_shape(fmt, (2, 4, 32))
    check_weight(fmt, (2, 4, 32), torch.bfloat16)


@dataclass(frozen=True)
class _LegacyShapeRule(dq.QuantFormat):
    """A format written before check_shape: its shape rule lives in check_weight."""

    @property
    def layout(self):
        return {"qdata": (dq.OneToOne(), dq.Packed(4)), "scale": (dq.OneToOne(), dq.Constant())}

    def check_weight(self, shape, dtype):
        super().check_weight(shape, dtype)
        if shape[1] % 4:
            raise ValueError("in_features must be a multiple of 4")


def test_a_shape_rule_in_check_weight_still_counts():
    with pytest.raises(ValueError, match="multiple of 4"):
        check_shape(_LegacyShapeRule(), (8, 6))
    with pytest.raises(ValueError, match="multiple of 4"):
        dq.check_placements((8, 6), _LegacyShapeRule(), (1,), [Replicate()])
    check_shape(_LegacyShapeRule(), (8, 12))


def test_hugging_face_names_are_part_of_the_protocol():
    assert dq.Int8Rowwise().checkpoint_suffixes is None and dq.NF4().hf_quantization_config is None
    fp8 = dq.Float8Blockwise()
    assert fp8.checkpoint_suffixes == {"qdata": "", "scale_inv": "_scale_inv"}
    assert fp8.hf_quantization_config["weight_block_size"] == [128, 128]


def test_bad_expert_shape_names_the_matrix():
    with pytest.raises(ValueError, match=r"each \[out, in\] matrix"):
        dq.quantize(weight((2, 8, 100)), dq.NF4(64, 256))
    with pytest.raises(ValueError, match="at least 2 dims"):
        dq.quantize(weight((64,)), dq.Int8Rowwise())


def test_formats_and_weights_that_cannot_be_quantized_are_refused_by_name():
    """Before: a format string or class raised AttributeError/TypeError deep inside; a float64 or float8 weight
    raised torch errors inside the statistics ('value cannot be converted to type float without overflow',
    '"isinf" not implemented for Float8_e4m3fn', KeyError 16) or, for some formats, quantized; a block size of
    128.0 or '128' failed in torch's unflatten or in the range check's comparison."""
    w = weight((8, 256))
    with pytest.raises(TypeError, match=r"format instance such as dtensor_quant.Int8Rowwise\(\).*got 'int8'"):
        dq.quantize(w, "int8")
    with pytest.raises(TypeError, match=r"got the class Int8Rowwise: call it \(Int8Rowwise\(\)\)"):
        dq.quantize(w, dq.Int8Rowwise)
    with pytest.raises(TypeError, match="got None"):
        check_shape(None, (8, 256))
    for fmt in dq.testing.FORMATS.values():
        for dtype in (torch.float64, torch.float8_e4m3fn, torch.int32):
            with pytest.raises(ValueError, match=f"float32, bfloat16 or float16; got {dtype}"):
                dq.quantize(w.to(dtype), fmt)
    with pytest.raises(ValueError, match=r"Int4Groupwise: group_size must be an integer; got 128.0 \(float\)"):
        dq.Int4Groupwise(128.0)
    with pytest.raises(ValueError, match="NF4: scaler_block_size must be an integer; got '256'"):
        dq.NF4(scaler_block_size="256")
    with pytest.raises(ValueError, match="Float8Blockwise: block_size must be an integer; got True"):
        dq.Float8Blockwise(True)
