"""Hugging Face checkpoints in and out of quantized, sharded models (``dq.hf``).

::

    with dq.hf.init_empty():                        # parameters on "meta", buffers (RoPE tables) real
        model = LlamaForCausalLM(config)
    dq.quantize_(model, dq.Int4Groupwise(128))      # or, for a pre-quantized checkpoint,
                                                    # dq.hf.quantize_like_checkpoint(model, dir)
    parallelize_module(model, mesh, plan)           # or fully_shard, or nothing
    dq.hf.materialize(model, "cpu")                 # allocates this rank's shards only
    dq.hf.load(model, "Llama-3-8B/")                # model.safetensors or model.safetensors.index.json
    dq.hf.save(model, "out/")                       # dense bf16 (FP8 block-scale weights as they are)

Each rank reads and writes only its own slices; docs/huggingface.md says how.
The implementation lives in the private ``dtensor_quant._checkpoint.hf``.
"""

from .._checkpoint.hf import Checkpoint, LoadResult, TensorInfo, init_empty, load, materialize, save, tp_plan
from .._model.quantize_like import quantize_like_checkpoint

__all__ = [
    "Checkpoint",
    "LoadResult",
    "TensorInfo",
    "init_empty",
    "load",
    "materialize",
    "quantize_like_checkpoint",
    "save",
    "tp_plan",
]
