"""Pre-quantized checkpoints written by the producer libraries themselves, and each producer's dequantization.

A tiny Llama (hidden 256, MLP width 768, 2 layers) is quantized and saved by:

- compressed-tensors 0.20 (``ct_*``): ``apply_quantization_config``, the
  scales and zero points from compressed-tensors' own ``calculate_qparams``
  over each group/channel/block's min and max (what llm-compressor's min-max
  observer feeds it: a data-free, round-to-nearest scheme), then
  ``ModelCompressor.compress_model`` (its packing), ``save_pretrained`` and
  ``update_config``: the files llm-compressor writes.

Each kind's reference (:func:`reference`) is the producer's own
dequantization; compressed-tensors': transformers' ``from_pretrained`` with
``CompressedTensorsConfig(dequantize=True)`` (compressed-tensors decompresses).
References are cached beside the checkpoint (``<dir>.reference.safetensors``).

Test-only: nothing here is a dependency of the library.
"""

from __future__ import annotations

import math
from pathlib import Path

import hf_cases as hc
import torch

# kind -> (compressed-tensors preset, format, weight strategy override)
CT = {
    "ct_int4": ("W4A16", "pack-quantized", None),
    "ct_int4_asym": ("W4A16_ASYM", "pack-quantized", None),
    "ct_int8": ("W8A16", "int-quantized", "channel"),
    "ct_fp8": ("FP8_DYNAMIC", "float-quantized", None),
    "ct_fp8_block": ("FP8_BLOCK", "float-quantized", None),
    "ct_mxfp4": ("MXFP4A16", "mxfp4-pack-quantized", None),
}
KINDS = tuple(CT)


def tiny_llama(dtype=torch.bfloat16, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**hc.CONFIG)).to(dtype)


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics llm-compressor's min-max observer hands compressed-tensors, per the scheme's strategy."""
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "block":
        b0, b1 = args.block_structure
        g = w.unflatten(0, (-1, b0)).unflatten(-1, (-1, b1))
        return g.amin((1, 3)), g.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def write_ct(kind: str, path) -> str:
    """A compressed-tensors checkpoint of the tiny Llama, ``lm_head`` left dense (llm-compressor's default)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    preset, fmt, strategy = CT[kind]
    model = tiny_llama()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if strategy is not None:
        scheme.weights.strategy, scheme.weights.group_size = strategy, None
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)  # fmt: skip
    with torch.no_grad():
        for module in model.modules():
            qs = getattr(module, "quantization_scheme", None)
            if qs is None:
                continue
            scale, zero = calculate_qparams(*_minmax(module.weight, qs.weights), qs.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return str(path)


def _ct_reference(path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def write(kind: str, path) -> str:
    """Write checkpoint ``kind`` to ``path`` and its producer's dequantization beside it."""
    from safetensors.torch import save_file

    if kind in CT:
        write_ct(kind, path)
        ref = _ct_reference(path)
    else:
        raise KeyError(kind)
    save_file(ref, str(path) + ".reference.safetensors")
    return str(path)


def reference(path) -> dict[str, torch.Tensor]:
    """The producer's dequantized weights (and the dense tensors) of checkpoint ``path``."""
    from safetensors.torch import load_file

    return load_file(str(path) + ".reference.safetensors")


def file_bytes(kind: str, local_shape, full_shape) -> int:
    """Bytes of the file that hold a rank's ``local_shape`` slice of a quantized weight, counted from the layout.

    Written out per producer (not from the library): codes, then scales (and
    zero points, shape records) of the groups/rows/blocks the slice covers.
    """
    r, c = local_shape
    if kind == "ct_int8":
        return r * c + r * 2
    if kind == "ct_fp8":
        return r * c + r * 2
    if kind == "ct_fp8_block":
        return r * c + math.ceil(r / 128) * math.ceil(c / 128) * 2
    if kind == "ct_int4":
        return r * c // 2 + r * math.ceil(c / 128) * 2 + 16
    raise KeyError(kind)


def build_all(root: Path, kinds) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    return {k: write(k, root / k) for k in kinds}
