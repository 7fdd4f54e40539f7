"""Hugging Face checkpoints in and out of quantized, sharded models: each rank reads and writes only its slices.

::

    with dq.hf.init_empty():                        # parameters on "meta", buffers (RoPE tables) real
        model = LlamaForCausalLM(config)
    dq.quantize_(model, dq.Int4Groupwise(128))      # meta: no memory, no data; or, for a pre-quantized
                                                    # checkpoint, dq.hf.quantize_like_checkpoint(model, dir)
    parallelize_module(model, mesh, plan)           # or fully_shard, or nothing
    dq.hf.materialize(model, "cpu")                 # allocates this rank's shards only
    dq.hf.load(model, "Llama-3-8B/")                # model.safetensors or model.safetensors.index.json
    dq.hf.save(model, "out/")                       # dense bf16 (FP8 block-scale weights as they are)

**Loading.** Keys are the checkpoint's own (transformers' state-dict names).
Every rank reads the safetensors headers itself, then, for each tensor of the
model in turn, only the byte ranges of its own slice (``os.preadv`` at the
offsets the header gives: whole rows are one read, a column slice one read per
row). A dense weight that the model holds quantized is then quantized as a
dense DCP checkpoint is (:func:`~dtensor_quant._checkpoint.quantize_like`: the
slice placed like the parameter, through the quantize op): statistics that
span shards are all-reduced, so the bytes equal quantizing the full tensor and
then sharding it. Where no statistic spans rows (the layout says so) the slice
is read and quantized in runs of rows, so a rank holds its shards plus one
run at a time. A weight stored quantized in a layout a format declares
(``QuantFormat.checkpoint_suffixes``: FP8 block scales) is read as its inner
tensors and placed by :func:`~dtensor_quant._checkpoint.state_dict.from_entries`, without
dequantizing.

Why not torch's ``HuggingFaceStorageReader``: ``dcp.load`` plans one read of
the whole state dict, so every dense placeholder (the dense model's shards)
would exist at once before anything is quantized, and its reads go through
``safe_open``'s memory map, which cannot count what a rank reads. Reading one
tensor at a time needs no collective to plan (each rank knows its slice from
its DTensor), so nothing is gained from DCP's planning here.

**Saving.** Every rank computes the same file layout from the model's shapes
(no collective); rank 0 writes the headers into a staging directory, then
each rank writes the bytes of its own slices at their offsets (one replica of
each slice writes), and rank 0 moves the files into place once every rank
has written. The ranks agree on the outcome of each step, so a failure
anywhere raises on every rank and leaves the previous export.

torch's ``HuggingFaceStorageWriter`` with consolidation was not used: it writes
every rank's shards to files of their own and then, on the coordinator alone,
reads them all back and writes the consolidated files (the model is written
twice, the second time by one process), and its consolidation sizes elements
with ``torch.finfo``, which fails for integer tensors. Here every byte is
written once, in parallel, at its final place.

``dq.hf.quantize_like_checkpoint`` lives in :mod:`dtensor_quant._model.quantize_like`
(it quantizes a model, a layer above this one); the package attaches it here.
"""

# The file format's names (DTYPES, TensorInfo, ...) stay reachable as dq.hf.<name>, as before the split.
from .io.safetensors_io import DTYPES, INDEX, NAMES, SINGLE, Checkpoint, Pieces, TensorInfo  # noqa: F401
from .loading import LoadResult, load
from .prepare import init_empty, materialize, tp_plan
from .saving import save

__all__ = [
    "Checkpoint",
    "LoadResult",
    "init_empty",
    "load",
    "materialize",
    "save",
    "tp_plan",
]
