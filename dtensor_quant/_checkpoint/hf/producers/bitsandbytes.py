"""Reading bitsandbytes checkpoints as transformers saves them (unsloth's ``*-bnb-4bit`` models).

A weight is described by its quant type (the ``.quant_state.bitsandbytes__<type>``
tensor's name; LLM.int8's ``.SCB``: ``int8``), the block sizes of its quant
state and whether ``.nested_absmax`` is stored (double quantization); the
format that declares it holds that is read (NF4, double-quantized or not).
The state's own fields are checked against the model's weight on load; the
``quant_map`` tensors against the levels the format declares it computes with.
"""

from __future__ import annotations

from ...._core.producers import BITSANDBYTES
from ..io.fields import NUMBER, POSITIVE, REQUIRED
from ..io.safetensors_io import Checkpoint
from .layout import StoredLayout, held
from .stored import Extra, json_doc


def read_bitsandbytes(qc, ckpt: Checkpoint, key: str, shape, dtype) -> StoredLayout | None:
    """bitsandbytes as transformers saves it (unsloth's ``*-bnb-4bit`` models): NF4, double-quantized or not.

    Described by the quant type (``.quant_state.bitsandbytes__<type>``;
    LLM.int8's ``.SCB``: ``int8``), the block sizes of the quant state and
    whether ``.nested_absmax`` is stored (double quantization); the state's
    ``quant_type``, ``shape`` and ``nested_dtype`` are checked on load.
    """
    if not key.endswith(".weight") or len(shape) != 2:
        return None
    if key + ".SCB" in ckpt.tensors:
        return held(key, BITSANDBYTES, "int8", {}, "bitsandbytes int8 (LLM.int8, load_in_8bit)")
    if key + ".absmax" not in ckpt.tensors:
        return None
    states = sorted(k for k in ckpt.tensors if k.startswith(key + ".quant_state."))
    if len(states) != 1:
        raise ValueError(f"{key}: bitsandbytes with {len(states)} quant_state tensors ({states}); one is expected")
    quant_type = states[0].rpartition("__")[2]
    state = json_doc(ckpt, states[0])
    blocksize = state.field("blocksize", POSITIVE, REQUIRED)
    nested_blocksize = state.field("nested_blocksize", POSITIVE)
    nested = key + ".nested_absmax" in ckpt.tensors
    if nested != (nested_blocksize is not None):
        has = "a .nested_absmax tensor but no" if nested else "no .nested_absmax tensor but a"
        raise ValueError(
            f"{key}: bitsandbytes {quant_type} with {has} nested_blocksize in its quant_state: neither "
            "double-quantized nor plain; the checkpoint is inconsistent"
        )
    if nested:
        state.field("nested_offset", NUMBER, REQUIRED)  # read by the loader: checked before anything is
    described = {"double_quant": nested, "block_size": blocksize}
    if nested:
        described["nested_block_size"] = nested_blocksize

    def state_fits(t, shape):
        js = json_doc(ckpt, states[0])
        want = {"quant_type": quant_type, "shape": list(shape)} | ({"nested_dtype": "float32"} if nested else {})
        bad = {k: js.get(k) for k, v in want.items() if js.get(k) != v}
        return f"{bad} (expected {want})" if bad else None

    scheme = "double quantization" if nested else "no double quantization"
    what = f"bitsandbytes {quant_type} ({scheme}, blocks {blocksize})"
    state_check = Extra(states[0].replace(key, "{key}", 1), state_fits)
    return held(key, BITSANDBYTES, quant_type, described, what, (state_check,))
