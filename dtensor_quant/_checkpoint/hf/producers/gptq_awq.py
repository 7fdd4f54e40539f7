"""Reading GPTQ v1 (auto-gptq, GPTQModel's ``gptq`` format) and AWQ GEMM (AutoAWQ) checkpoints.

Both store a weight as ``qweight``, ``qzeros`` and ``scales`` (eight 4-bit
codes per int32, ``[in, out]`` orientation) and describe it in the same
``quantization_config`` fields (bits, group size), so one reader serves
both; the format that declares it holds ``gptq``'s or ``awq``'s scheme
gives the maps. A GPTQ ``g_idx`` is checked to be plain groups (an act-order
checkpoint's groups are no blocks of the inputs).
"""

from __future__ import annotations

import functools

import torch

from ...._core.producers import AWQ, GPTQ
from ..io.fields import BOOL, INT, POSITIVE, STRING, either, exactly
from ..io.safetensors_io import Checkpoint
from .layout import StoredLayout, held
from .stored import Extra


def _g_idx(group: int, desc_act) -> Extra:
    def check(t, shape):
        if t.tolist() == [i // group for i in range(shape[-1])]:
            return None
        return (f"g_idx is not i // {group}: the checkpoint was quantized with act-order (desc_act={desc_act}), "
                "whose groups are no blocks of the inputs; quantize it with desc_act=False, or convert it to "
                "another layout first")  # fmt: skip

    return Extra("{base}.g_idx", check, lambda shape: torch.arange(shape[-1], dtype=torch.int32) // group)


def read_gptq_awq(producer: str, qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """GPTQ v1 (auto-gptq, GPTQModel's ``gptq`` format) and AWQ GEMM (AutoAWQ): ``qweight``, ``qzeros``, ``scales``.

    Described by the bits, the group size (-1: one group per row), the
    version (GPTQ's ``checkpoint_format``, AWQ's ``version``) and AWQ's
    ``zero_point``; a GPTQ ``g_idx`` is checked to be plain groups (no
    act-order).
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    base = key[: -len(".weight")]
    if base + ".qweight" not in ckpt.tensors:
        return None
    gptq = producer == GPTQ
    bits = qc.field("bits", INT, tensor=key) if "bits" in qc else qc.field("w_bit", INT, tensor=key)
    groups = either(POSITIVE, exactly(-1))
    group = (
        qc.field("group_size", groups, tensor=key)
        if "group_size" in qc
        else qc.field("q_group_size", groups, tensor=key)
    )
    group = shape[1] if group in (None, -1) else group
    name = "GPTQ" if gptq else "AWQ"
    if gptq:
        version = qc.field("checkpoint_format", STRING, "gptq", tensor=key)
    else:
        version = qc.field("version", STRING, "gemm", tensor=key).lower()
    desc_act = qc.field("desc_act", BOOL, False, tensor=key)
    what = f"{name} ({version}, int{bits}, group {group}{', desc_act' if desc_act else ''})"
    described = {"num_bits": bits, "group_size": group, "scale_dtype": ckpt.tensors[base + ".scales"].dtype}
    if not gptq:
        described["zero_point"] = qc.field("zero_point", BOOL, True, tensor=key)
    extras = (_g_idx(group, desc_act),) if gptq and base + ".g_idx" in ckpt.tensors else ()
    return held(key, producer, version, described, what, extras)


#: The readers of ``quant_method: gptq`` and ``quant_method: awq``.
read_gptq = functools.partial(read_gptq_awq, GPTQ)
read_awq = functools.partial(read_gptq_awq, AWQ)
