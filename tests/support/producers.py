"""Pre-quantized checkpoints written by the producer libraries themselves, and each producer's dequantization.

A tiny Llama (hidden 256, MLP width 768, 2 layers) is quantized and saved by:

- compressed-tensors 0.20 (``ct_*``): ``apply_quantization_config``, the
  scales and zero points from compressed-tensors' own ``calculate_qparams``
  over each group/channel/block's min and max (what llm-compressor's min-max
  observer feeds it: a data-free, round-to-nearest scheme), then
  ``ModelCompressor.compress_model`` (its packing), ``save_pretrained`` and
  ``update_config``: the files llm-compressor writes.

- auto-gptq 0.7.1 (``gptq``, ``gptq_actorder``; installed ``--no-deps``, its
  package ``__init__`` not run: it imports the whole library and packages a
  CPU machine lacks): GPTQ's own ``fasterquant`` (``auto_gptq.quantization``,
  with random calibration activations per Linear, ``torch.cuda.synchronize``
  made a no-op on this CPU-only torch) and its ``QuantLinear.pack``
  (``qlinear_cuda``, the v1 ``gptq`` checkpoint format); fp16 model.
- AutoAWQ 0.2.9 (``awq``; ``--no-deps``, ``__init__`` not run): the codes,
  scales and zero points of AWQ's round-to-nearest quantization (its
  ``pseudo_quantize_tensor`` formula, written out here: the activation-aware
  scale search needs calibration data and AWQ's quantizer module imports
  ``datasets``), packed by AutoAWQ's ``WQLinear_GEMM.from_linear``; fp16.

- bitsandbytes 0.50 through transformers (``bnb``): ``from_pretrained`` of
  the dense tiny Llama with ``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` on CPU, then
  ``save_pretrained``: exactly the files unsloth's ``*-bnb-4bit`` models hold.

GPTQ and AWQ checkpoints are written as their libraries' ``save_quantized``
does: the model's state dict with each Linear replaced by the packed module
(``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``), and ``config.json``
with transformers' ``GPTQConfig``/``AwqConfig`` as ``quantization_config``.

Each kind's reference (:func:`reference`) is the producer's own
dequantization: compressed-tensors': transformers' ``from_pretrained`` with
``CompressedTensorsConfig(dequantize=True)`` (compressed-tensors
decompresses); GPTQ's: ``QuantLinear.forward``'s CPU path (applied to the
identity, which returns its dequantized weight exactly); AWQ's:
``awq.utils.packing_utils.dequantize_gemm``; bitsandbytes':
``bitsandbytes.functional.dequantize_4bit`` of each ``Linear4bit`` that
transformers' ``from_pretrained`` reads back from the saved files.
References are cached beside the checkpoint (``<dir>.reference.safetensors``).

Test-only: nothing here is a dependency of the library.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant.fsdp import fully_shard
from dtensor_quant.testing import mesh
from tests.support import hf_cases as hc

# kind -> (compressed-tensors preset, format, weight strategy override)
CT = {
    "ct_int4": ("W4A16", "pack-quantized", None),
    "ct_int4_asym": ("W4A16_ASYM", "pack-quantized", None),
    "ct_int8": ("W8A16", "int-quantized", "channel"),
    "ct_fp8": ("FP8_DYNAMIC", "float-quantized", None),
    "ct_fp8_block": ("FP8_BLOCK", "float-quantized", None),
    "ct_mxfp4": ("MXFP4A16", "mxfp4-pack-quantized", None),
    # quantized activations (issue 35): W8A8 int8 dynamic per token, FP8 static (per-tensor weights and inputs),
    # and W8A8 int8 with a static per-tensor input scale
    "ct_w8a8": ("W8A8", "int-quantized", None),
    "ct_fp8_static": ("FP8", "float-quantized", None),
    "ct_w8a8_static": ("W8A8", "int-quantized", None),
}
# kinds whose input activations are made static per tensor, and the input scale each Linear gets: data-free,
# |x| up to 4 (the tiny Llama's normed hidden states and MLP inputs stay near unit scale)
STATIC_INPUTS = {"ct_w8a8_static": 4.0 / 127, "ct_fp8_static": 4.0 / 448}
KINDS = (*CT, "gptq", "gptq_actorder", "awq", "bnb", "bnb_single", "gptoss")
# A tiny gpt-oss: 4 experts of width 256 (gate_up [E, 256, 512], down [E, 256, 256] as transformers holds them).
GPTOSS = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 4,
          "num_experts_per_tok": 2, "layer_types": ["full_attention"] * 2}  # fmt: skip
GROUP = 128


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
    if kind in STATIC_INPUTS:
        scheme.input_activations.strategy, scheme.input_activations.dynamic = "tensor", False
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
            if kind in STATIC_INPUTS:
                module.input_scale.fill_(STATIC_INPUTS[kind])
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


def producer_module(package: str, module: str):
    """Import ``package.module`` without running the package's ``__init__`` (it imports the whole library).

    Each parent package is a bare namespace pointing at its folder; only the
    producer's own module (and what it imports) runs.
    """
    import importlib
    import importlib.util
    import os
    import sys
    import types

    top = sys.modules.get(package)
    root = top.__path__[0] if top is not None else importlib.util.find_spec(package).submodule_search_locations[0]
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join([package, *parts[:i]])
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(root, *parts[:i])]
            sys.modules[name] = stub
    return importlib.import_module(f"{package}.{module}")


def _linears(model):
    """``(parent, attribute, Linear, fqn)`` of every decoder Linear (``lm_head`` stays dense, as producers leave it)."""
    for fqn, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and fqn != "lm_head":
            parent, _, attr = fqn.rpartition(".")
            yield model.get_submodule(parent), attr, module, fqn


def _save(model, path, quantization_config: dict) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    model.config.quantization_config = quantization_config
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(path)


def _config_dict(config) -> dict:
    import json

    return json.loads(config.to_json_string())


def write_gptq(path, actorder: bool) -> dict[str, torch.Tensor]:
    """GPTQ v1 (auto-gptq), 4-bit, group 128, symmetric; returns the producer's dequantization."""
    import transformers

    gptq = producer_module("auto_gptq", "quantization")
    qlinear = producer_module("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    model, ref = tiny_llama(torch.float16), {}
    eye = {}
    sync, torch.cuda.synchronize = torch.cuda.synchronize, lambda *a, **k: None  # fasterquant syncs CUDA always
    try:
        for i, (parent, attr, lin, fqn) in enumerate(_linears(model)):
            g = gptq.GPTQ(lin)
            g.quantizer.configure(4, perchannel=True, sym=True, mse=False)
            x = torch.randn(64, lin.in_features, dtype=torch.float16, generator=torch.Generator().manual_seed(i))
            g.add_batch(x, lin(x))
            scale, zero, g_idx = g.fasterquant(blocksize=128, percdamp=0.01, group_size=GROUP, actorder=actorder)
            q = qlinear.QuantLinear(4, GROUP, lin.in_features, lin.out_features, False, weight_dtype=torch.float16)
            q.pack(lin, scale, zero, g_idx)
            n = lin.in_features
            eye.setdefault(n, torch.eye(n, dtype=torch.float16))
            with torch.no_grad():
                ref[fqn + ".weight"] = q(eye[n]).t().contiguous()  # the CPU forward: scales[g_idx] * (q - z)
            setattr(parent, attr, q)
    finally:
        torch.cuda.synchronize = sync
    config = transformers.GPTQConfig(bits=4, group_size=GROUP, desc_act=actorder, sym=True)
    _save(model, path, _config_dict(config))
    return ref


def write_awq(path) -> dict[str, torch.Tensor]:
    """AWQ GEMM (AutoAWQ), 4-bit, group 128, with zero points; returns the producer's dequantization."""
    import transformers

    gemm = producer_module("awq", "modules.linear.gemm")
    packing = producer_module("awq", "utils.packing_utils")
    model, ref = tiny_llama(torch.float16), {}
    for parent, attr, lin, fqn in _linears(model):
        # AWQ's pseudo_quantize_tensor (zero_point=True), per group of 128 inputs
        w = lin.weight.detach().float().reshape(-1, GROUP)
        hi, lo = w.amax(1, keepdim=True), w.amin(1, keepdim=True)
        scales = (hi - lo).clamp(min=1e-5) / 15
        zeros = (-torch.round(lo / scales)).clamp(0, 15)
        w = (torch.clamp(torch.round(w / scales) + zeros, 0, 15) - zeros) * scales
        lin.weight.data = w.reshape(lin.weight.shape).half()
        scales = scales.view(lin.out_features, -1).half().t().contiguous()
        zeros = zeros.view(lin.out_features, -1).t().contiguous()
        q = gemm.WQLinear_GEMM.from_linear(lin, 4, GROUP, scales=scales, zeros=zeros)
        ref[fqn + ".weight"] = packing.dequantize_gemm(q.qweight, q.qzeros, q.scales, 4, GROUP).t().contiguous()
        setattr(parent, attr, q)
    config = transformers.AwqConfig(bits=4, group_size=GROUP, zero_point=True, version="gemm")
    _save(model, path, _config_dict(config))
    return ref


def write_bnb(path, double_quant: bool = True) -> dict[str, torch.Tensor]:
    """bitsandbytes NF4 (with double quantization unless told), as transformers quantizes and saves it on CPU."""
    import tempfile

    import bitsandbytes as bnb
    import transformers

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    with tempfile.TemporaryDirectory() as dense:
        tiny_llama().save_pretrained(dense)
        model = transformers.LlamaForCausalLM.from_pretrained(dense, quantization_config=config,
                                                              dtype=torch.bfloat16, device_map="cpu")  # fmt: skip
    model.save_pretrained(path)
    back = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    ref = {}
    for fqn, module in back.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            ref[fqn + ".weight"] = bnb.functional.dequantize_4bit(w.data, w.quant_state).contiguous()
    for name, t in back.state_dict().items():
        if name.endswith(".weight") and name not in ref and t.is_floating_point():
            ref[name] = t.detach().contiguous()
    for name, t in back.named_parameters():
        if name not in ref and t.is_floating_point():
            ref[name] = t.detach().contiguous()
    return ref


def tiny_gptoss(dtype=torch.bfloat16, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPTOSS)).to(dtype)


def write_gptoss(path) -> dict[str, torch.Tensor]:
    """gpt-oss's layout: each fused expert stack as ``{key}_blocks`` u8 ``[E, out, in/32, 16]`` and ``{key}_scales``.

    OpenAI's own quantizer is not public and transformers' needs a GPU
    (triton kernels), so each expert's ``[out, in]`` matrix is quantized by
    compressed-tensors' MXFP4 (``calculate_qparams`` and
    ``MXFP4PackedCompressor.compress``: the same e2m1 codes, low nibble
    first, and e8m0 exponents) and laid out as gpt-oss stores it. The
    reference is transformers' gpt-oss dequantizer, ``convert_moe_packed_tensors``.
    """
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, scheme = tiny_gptoss(), preset_name_to_scheme("MXFP4A16", ["Linear"])
    state, ref = {k: v.contiguous() for k, v in model.state_dict().items()}, {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stack = state.pop(key)  # [E, in, out]
        blocks, scales = [], []
        for w in stack.transpose(-2, -1):  # each expert [out, in]
            g = w.unflatten(-1, (-1, 32))
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
            packed = MXFP4PackedCompressor.compress({"weight": w.contiguous(), "weight_scale": scale}, scheme)
            blocks.append(packed["weight_packed"].reshape(w.shape[0], -1, 16))
            scales.append(packed["weight_scale"])
        state[key + "_blocks"], state[key + "_scales"] = torch.stack(blocks), torch.stack(scales)
        ref[key] = convert_moe_packed_tensors(state[key + "_blocks"], state[key + "_scales"], dtype=torch.bfloat16)
        assert ref[key].shape == stack.shape, (ref[key].shape, stack.shape)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                        "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    ref.update({k: v for k, v in state.items() if not k.endswith(("_blocks", "_scales"))})
    return ref


def _dense_of(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors other than the packed ones (embeddings, norms, lm_head)."""
    from safetensors.torch import load_file

    packed = (".qweight", ".qzeros", ".scales", ".g_idx")
    return {k: v for k, v in load_file(str(Path(path) / "model.safetensors")).items() if not k.endswith(packed)}


def write(kind: str, path) -> str:
    """Write checkpoint ``kind`` to ``path`` and its producer's dequantization beside it."""
    from safetensors.torch import save_file

    if kind in CT:
        write_ct(kind, path)
        ref = _ct_reference(path)
    elif kind in ("gptq", "gptq_actorder"):
        ref = write_gptq(path, kind == "gptq_actorder")
        ref.update(_dense_of(path))
    elif kind == "awq":
        ref = write_awq(path)
        ref.update(_dense_of(path))
    elif kind in ("bnb", "bnb_single"):
        ref = write_bnb(path, double_quant=kind == "bnb")
    elif kind == "gptoss":
        ref = write_gptoss(path)
    else:
        raise KeyError(kind)
    save_file(ref, str(path) + ".reference.safetensors")
    return str(path)


def reference(path) -> dict[str, torch.Tensor]:
    """The producer's dequantized weights (and the dense tensors) of checkpoint ``path``."""
    from safetensors.torch import load_file

    return load_file(str(path) + ".reference.safetensors")


def _blocks_touched(offset, local_shape, full_shape, block: int) -> int:
    """How many blocks of ``block`` consecutive row-major elements the slice touches."""
    (r0, c0), (r, c), cols = offset, local_shape, full_shape[1]
    flat = (torch.arange(r0, r0 + r)[:, None] * cols + torch.arange(c0, c0 + c)[None, :]).reshape(-1)
    return int(torch.unique(flat // block).numel())


def file_bytes(kind: str, offset, local_shape, full_shape) -> int:
    """Bytes of the file that hold a rank's slice (``offset``, ``local_shape``) of a quantized weight.

    Written out per producer (not from the library): codes, then scales (and
    zero points, shape records) of the groups/rows/blocks the slice covers.
    """
    if kind == "gptoss":  # a local [E, in, out] stack: codes and one exponent per 32 inputs of each expert
        return math.prod(local_shape) // 2 + math.prod(local_shape) // 32
    r, c = local_shape
    full_shape = tuple(full_shape)
    if kind == "bnb_single":  # codes, one fp32 absmax per 64 flat values; map and state read once
        return r * c // 2 + 4 * _blocks_touched(offset, local_shape, full_shape, 64)
    if kind == "bnb":  # codes, one absmax code per 64 flat values, one fp32 per 16384; maps and state read once
        return (
            r * c // 2
            + _blocks_touched(offset, local_shape, full_shape, 64)
            + 4 * _blocks_touched(offset, local_shape, full_shape, 64 * 256)
        )
    if kind == "ct_int8":
        return r * c + r * 2
    if kind == "ct_fp8":
        return r * c + r * 2
    if kind == "ct_fp8_block":
        return r * c + math.ceil(r / 128) * math.ceil(c / 128) * 2
    if kind == "ct_int4":
        return r * c // 2 + r * math.ceil(c / 128) * 2 + 16
    if kind == "ct_int4_asym":  # + zero points, 8 rows per int32
        return r * c // 2 + r * math.ceil(c / 128) * 2 + r // 8 * math.ceil(c / 128) * 4 + 16
    if kind == "ct_mxfp4":
        return r * c // 2 + r * c // 32
    if kind in ("gptq", "awq"):  # codes, fp16 scales [in/g, out], zeros [in/g, out/8] (+ GPTQ's whole g_idx)
        groups = math.ceil(c / GROUP)
        return r * c // 2 + groups * r * 2 + groups * r // 8 * 4 + (full_shape[1] * 4 if kind == "gptq" else 0)
    raise KeyError(kind)


def metadata_bytes(kind: str, path) -> int:
    """Bytes of the per-weight records every rank reads whole once: bitsandbytes' maps and quant_state JSON."""
    if not kind.startswith("bnb"):
        return 0  # compressed-tensors' weight_shape and GPTQ's g_idx are counted per weight in file_bytes
    from safetensors import safe_open

    ends = (".quant_map", ".nested_quant_map", ".quant_state.bitsandbytes__nf4")
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return sum(f.get_slice(k).get_shape()[0] * (4 if "map" in k else 1) for k in f.keys() if k.endswith(ends))


def build_all(root: Path, kinds) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    return {k: write(k, root / k) for k in kinds}


# The producer each kind needs (a test extra; auto-gptq and autoawq installed --no-deps, their __init__ never run).
PRODUCER = {
    "ct": "compressed_tensors",
    "gptq": "auto_gptq",
    "awq": "awq",
    "bnb": "bitsandbytes",
    "gptoss": "compressed_tensors",
}


def _needs(kind: str) -> None:
    import importlib.util
    import sys

    package = PRODUCER[kind.split("_")[0]]
    if package not in sys.modules and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} (a test extra: pip install '.[test]', see pyproject.toml) writes {kind} checkpoints")


class Checkpoints:
    """Each producer's checkpoint, written once per session on first use."""

    def __init__(self, root):
        self.root, self.paths = root, {}

    def __getitem__(self, kind: str) -> str:
        if kind == "dense":
            if kind not in self.paths:
                tiny_llama().save_pretrained(self.root / kind)
                self.paths[kind] = str(self.root / kind)
            return self.paths[kind]
        _needs(kind)
        if kind not in self.paths:
            self.paths[kind] = write(kind, self.root / kind)
        return self.paths[kind]


@pytest.fixture(scope="session")
def producer_checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("producers"))


def build(layout: str, path, dtype=torch.bfloat16):
    """The tiny Llama on meta, quantized like the checkpoint, placed by ``layout``, materialized."""
    import transformers

    with dq.hf.init_empty():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hc.CONFIG))
    model.to(dtype)
    chosen = dq.hf.quantize_like_checkpoint(model, path)
    if layout == "tp2":
        # transformers' plan; a row-parallel layer whose columns the format cannot cut (BnbNF4's flat blocks at
        # width 768) runs column-parallel on the gathered input instead, as the planner says
        plan, _ = dq.adapt_tp_plan(model, dq.hf.tp_plan(model), 2)
        parallelize_module(model, mesh(2), plan)
    elif layout == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh(2))
        fully_shard(model, mesh=mesh(2))
    elif layout == "2d":  # FSDP2 over TP on a 2 x 2 mesh
        m = mesh(2, 2)
        plan, _ = dq.adapt_tp_plan(model, dq.hf.tp_plan(model), m["tp"])
        parallelize_module(model, m["tp"], plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=m["dp"])
        fully_shard(model, mesh=m["dp"])
    return dq.hf.materialize(model, "cpu"), chosen
