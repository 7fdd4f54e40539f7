"""The built-in format instances the tests run, by short name: one registry, filtered per test.

A test that needs fewer formats takes them from here by name (:func:`pick`) or
by a property (:func:`where`); one that adds its own formats merges them in
(``FORMATS | {"mine": MyFormat()}``). Names are stable, so they make readable
test ids and can be sent to the ranks instead of the instances.
"""

from __future__ import annotations

from collections.abc import Callable

from .._core.format import QuantFormat
from .._formats import (
    MXFP4,
    NF4,
    BnbNF4,
    Float8Blockwise,
    Float8Rowwise,
    Float8Tensorwise,
    Int4Groupwise,
    Int4GroupwiseIntZero,
    Int8Rowwise,
    NF4BlockScales,
)

FORMATS: dict[str, QuantFormat] = {
    "int8": Int8Rowwise(),
    "int4g32": Int4Groupwise(32),
    "int4g64": Int4Groupwise(64),
    "int4g128": Int4Groupwise(128),
    "int4z128": Int4GroupwiseIntZero(128),  # integer zero points: AWQ, GPTQ, compressed-tensors asymmetric
    "nf4": NF4(),  # QLoRA's blocks: 64 values, 256 block scales per scaler factor
    "nf4b64s8": NF4(64, 8),  # on 512 columns: one scaler factor per row
    "nf4b32s16": NF4(32, 16),  # on 256 columns: a scaler factor spans 2 rows
    "nf4b32s4": NF4(32, 4),  # on 256 columns: 2 scaler factors per row
    "bnbnf4": BnbNF4(),  # bitsandbytes' NF4 arithmetic on the same blocks (8-bit dynamic absmax codes)
    "nf4bs": NF4BlockScales(),  # NF4 without double quantization: a float32 scale per 64 (bitsandbytes')
    "f8row": Float8Rowwise(),
    "f8tensor": Float8Tensorwise(),
    "f8block32": Float8Blockwise(32),
    "f8block128": Float8Blockwise(128),
    "mxfp4": MXFP4(),  # OCP microscaling: e2m1 codes, an e8m0 scale per 32 (compressed-tensors, gpt-oss)
}


def pick(*names: str, formats: dict[str, QuantFormat] = FORMATS) -> dict[str, QuantFormat]:
    """The entries of ``formats`` named, in that order."""
    unknown = [n for n in names if n not in formats]
    if unknown:
        raise KeyError(f"no format named {unknown}; the registry has {sorted(formats)}")
    return {n: formats[n] for n in names}


def where(
    predicate: Callable[[QuantFormat], bool], formats: dict[str, QuantFormat] = FORMATS
) -> dict[str, QuantFormat]:
    """The entries of ``formats`` for which ``predicate(fmt)`` holds, in registry order."""
    return {n: f for n, f in formats.items() if predicate(f)}


def is_default(fmt: QuantFormat) -> bool:
    """Whether ``fmt`` has its class's default parameters (the format as a user first meets it)."""
    try:
        return fmt == type(fmt)()
    except TypeError:  # a format without defaults
        return False


def has_kernel(fmt: QuantFormat) -> bool:
    """Whether the format brings a matmul kernel of its own (else linear is dequantize + mm)."""
    return type(fmt).linear is not QuantFormat.linear


__all__ = ["FORMATS", "has_kernel", "is_default", "pick", "where"]
