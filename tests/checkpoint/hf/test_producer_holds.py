"""The formats' producer declarations: a stored weight's format is found from them alone, and each one it is found
by declares the layout the reader then uses (``producer_holds`` and ``producer_layout`` agree)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core.format import format_holding
from dtensor_quant._core.producers import AWQ, BITSANDBYTES, COMPRESSED_TENSORS, GPTQ, ProducerLayout
from dtensor_quant.testing import FORMATS

CT_INT = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "scale_dtype": torch.bfloat16}
CT_FP8 = dict(CT_INT, type="float")

CASES = {
    "ct int8 channel": ((COMPRESSED_TENSORS, "int-quantized", CT_INT), dq.Int8Rowwise(scale_dtype=torch.bfloat16)),
    "ct int8 naive": ((COMPRESSED_TENSORS, "naive-quantized", CT_INT), dq.Int8Rowwise(scale_dtype=torch.bfloat16)),
    "ct w8a8": (
        (COMPRESSED_TENSORS, "int-quantized", dict(CT_INT, activations="int8-token")),
        dq.Int8Rowwise(scale_dtype=torch.bfloat16, activations="int8-token"),
    ),
    "ct fp8 channel": ((COMPRESSED_TENSORS, "float-quantized", CT_FP8), dq.Float8Rowwise(scale_dtype=torch.bfloat16)),
    "ct fp8 tensor": (
        (COMPRESSED_TENSORS, "float-quantized", dict(CT_FP8, strategy="tensor")),
        dq.Float8Tensorwise(scale_dtype=torch.bfloat16),
    ),
    "ct int4 group": (
        (COMPRESSED_TENSORS, "pack-quantized", dict(CT_INT, num_bits=4, strategy="group", group_size=32)),
        dq.Int4Groupwise(32, scale_dtype=torch.bfloat16),
    ),
    "ct int4 asym": (
        (
            COMPRESSED_TENSORS,
            "pack-quantized",
            dict(CT_INT, num_bits=4, strategy="group", group_size=32, symmetric=False),
        ),
        dq.Int4GroupwiseIntZero(32, scale_dtype=torch.bfloat16),
    ),
    "gptq": (
        (GPTQ, "gptq", {"num_bits": 4, "group_size": 64, "scale_dtype": torch.float16}),
        dq.Int4GroupwiseIntZero(64, scale_dtype=torch.float16),
    ),
    "awq": (
        (AWQ, "gemm", {"num_bits": 4, "group_size": 64, "scale_dtype": torch.float16, "zero_point": True}),
        dq.Int4GroupwiseIntZero(64, scale_dtype=torch.float16),
    ),
    "bnb nf4 double": (
        (BITSANDBYTES, "nf4", {"double_quant": True, "block_size": 64, "nested_block_size": 256}),
        dq.BnbNF4(64, 256),
    ),
    "bnb nf4": ((BITSANDBYTES, "nf4", {"double_quant": False, "block_size": 64}), dq.NF4BlockScales(64)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_format_of_a_stored_weight_is_found_from_the_declarations(case):
    (producer, scheme, args), want = CASES[case]
    fmt = format_holding(producer, scheme, args)
    assert fmt == want
    declared = fmt.producer_layout(producer, args.get("scale_dtype", torch.float32))
    assert isinstance(declared, ProducerLayout)
    assert {name for name, _ in declared.inner} == set(fmt.inner_names)


@pytest.mark.parametrize(
    "producer, scheme, args",
    [
        (
            COMPRESSED_TENSORS,
            "pack-quantized",
            dict(CT_INT, num_bits=4, strategy="group", group_size=32, activations="int8-token"),
        ),
        (GPTQ, "gptq", {"num_bits": 3, "group_size": 64, "scale_dtype": torch.float16}),
        (AWQ, "gemm", {"num_bits": 4, "group_size": 64, "scale_dtype": torch.float16, "zero_point": False}),
        (BITSANDBYTES, "int8", {}),
        (BITSANDBYTES, "fp4", {"double_quant": False, "block_size": 64}),
    ],
)
def test_a_scheme_no_format_declares_finds_none(producer, scheme, args):
    """An argument no format takes (an activation scheme of int4 weights) is never dropped to find one."""
    assert format_holding(producer, scheme, args) is None


@pytest.mark.parametrize("name", FORMATS)
def test_every_declared_scheme_has_the_producers_layout(name):
    """A format found for a producer's scheme declares its layout for that producer, under a scheme of that name."""
    fmt = FORMATS[name]
    for holds in type(fmt).__dict__.get("producer_holds", ()):
        fields = {p: getattr(fmt, p) for p in holds.params if getattr(fmt, p, None) is not None}
        fmt2 = dataclasses.replace(fmt, **fields, **dict(holds.fixed))
        declared = fmt2.producer_layout(holds.producer, getattr(fmt2, "scale_dtype", None) or torch.float32)
        assert isinstance(declared, ProducerLayout), (name, holds)
        assert declared.scheme in holds.schemes, (name, holds, declared.scheme)


@pytest.mark.parametrize("fmt, strategy, scale_kind", [
    (dq.Int8Rowwise(), "channel", "same"), (dq.Float8Rowwise(), "channel", "same"),
    (dq.Float8Tensorwise(), "tensor", "flat"),
])  # fmt: skip
def test_8bit_strategy_and_scale_map_follow_from_the_scale_layout(fmt, strategy, scale_kind):
    declared = fmt.producer_layout(COMPRESSED_TENSORS, torch.bfloat16)
    assert declared.args["strategy"] == strategy and dict(declared.inner)["scale"].kind == scale_kind
    assert dict(type(fmt).producer_holds[0].args)["strategy"] == strategy
