"""Reading gpt-oss's MXFP4 experts (``quant_method: mxfp4``): each expert's codes and exponents, transposed.

transformers' gpt-oss model holds an MoE layer's experts as one ``[E, in,
out]`` parameter; the file stores each expert ``[out, in]``. The format that
declares it holds gpt-oss's experts gives the maps; the model's parameter is
the transposed view of it (``StoredLayout.transposed``).
"""

from __future__ import annotations

import dataclasses

from ...._core.producers import GPT_OSS_MXFP4
from ..io.safetensors_io import Checkpoint
from .layout import StoredLayout, held


def read_gpt_oss_experts(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``{key}_blocks`` u8 ``[E, out, in/32, 16]``, ``{key}_scales``.

    transformers' model holds the experts as ``[E, in, out]`` (``x @ W[e]``);
    the file stores each expert ``[out, in]`` with its blocks along the
    inputs: the format's codes and exponents as they are, the model's
    parameter the transposed view.
    """
    if len(shape) != 3 or key + "_blocks" not in ckpt.tensors:
        return None
    experts, n_in, n_out = shape
    blocks, scales = ckpt.tensors[key + "_blocks"], ckpt.tensors.get(key + "_scales")
    if tuple(blocks.shape) != (experts, n_out, n_in // 32, 16) or scales is None:
        raise ValueError(f"{key}: {key}_blocks is {list(blocks.shape)}, the model's experts {list(shape)} [E, in, out] "
                         f"need [{experts}, {n_out}, {n_in // 32}, 16] and {key}_scales")  # fmt: skip
    layout = held(key, GPT_OSS_MXFP4, "experts", {}, "mxfp4 (gpt-oss experts)")
    return dataclasses.replace(layout, method="mxfp4 (gpt-oss experts)", transposed=True)
