"""Reading DeepSeek-V3's FP8 checkpoints (and Qwen3-FP8's): ``weight`` e4m3, ``weight_scale_inv`` per square block.

Also the form a checkpoint without a ``quantization_config`` may hold (a
``{key}_scale_inv`` beside the weight). The block size is
``weight_block_size`` (128 x 128 when absent); the scales' dtype is the
file's.
"""

from __future__ import annotations

from ...._core.producers import FP8_BLOCKS
from ..io.fields import POSITIVE, list_of
from ..io.safetensors_io import Checkpoint
from .layout import StoredLayout, held


def read_fp8_blocks(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """DeepSeek-V3 / Qwen3-FP8: ``weight`` e4m3 + ``weight_scale_inv`` per block (fp32 there).

    ``weight_scale_inv`` is read in the dtype the file holds it in, as the
    format's ``scale_dtype``: ``dq.hf.save`` writes bf16 block scales as
    they are, and reads them back as they are.
    """
    if key + "_scale_inv" not in ckpt.tensors or len(shape) != 2:
        return None
    b = (qc.field("weight_block_size", list_of(POSITIVE, 2), tensor=key) if qc is not None else None) or [128, 128]
    s_dtype = ckpt.tensors[key + "_scale_inv"].dtype
    what = f"fp8 ({b[0]}x{b[1]} block scales, {str(s_dtype).removeprefix('torch.')})"
    described = {"block_size": b[0], "scale_dtype": s_dtype} if b[0] == b[1] else {"block_structure": b}
    return held(key, FP8_BLOCKS, "block", described, what)
