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
A format says how a producer stores it (``save(quantization="compressed-tensors")``)
with ``QuantFormat.producer_layout``, built from ``ProducerLayout`` and ``StoredAs``,
and which producers' schemes it holds as stored (what ``load`` and
``quantize_like_checkpoint`` read) with ``producer_holds``, of ``Holds``
(docs/custom_format.md).

``QuantConfig`` is transformers' ``quantization_config`` for this library
(``quant_method: "dtensor_quant"``)::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=dq.hf.QuantConfig("nf4"))

It is made on first use (it imports transformers; ImportError naming
``pip install 'dtensor_quant[hf]'`` without it). Importing this package
imports no transformers: the method is registered with transformers' registry
when transformers loads its quantizers (or at once if it already has), so a
directory ``save_pretrained`` wrote loads with plain ``from_pretrained``.
"""

from .._checkpoint.hf import Checkpoint, LoadResult, TensorInfo, init_empty, load, materialize, save, tp_plan
from .._core.producers import CT_BASE_ARGS, Holds, ProducerLayout, StoredAs
from .._model.quantize_like import quantize_like_checkpoint
from .._model.transformers_hook import install, quant_config_class

install()


def __getattr__(name: str):
    if name == "QuantConfig":  # made on first use: it subclasses transformers' QuantizationConfigMixin
        return quant_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CT_BASE_ARGS",
    "Checkpoint",
    "Holds",
    "LoadResult",
    "ProducerLayout",
    "StoredAs",
    "TensorInfo",
    "init_empty",
    "load",
    "materialize",
    "quantize_like_checkpoint",
    "save",
    "tp_plan",
]
