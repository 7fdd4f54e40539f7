"""checkpoint/hf/prequantized: compressed-tensors checkpoints with quantized activations, read with their schemes.

Checkpoints written by compressed-tensors itself (:mod:`tests.support.producers`):
W8A8 int8 (dynamic per token), FP8 dynamic, FP8 static (per-tensor weights and
``input_scale``) and W8A8 int8 with a static input scale.
``dq.hf.quantize_like_checkpoint`` must pick the format that quantizes the
activation as the checkpoint declares, and ``dq.hf.load`` read it as stored.

The reference is compressed-tensors' own forward of each Linear: its scheme
applied to a Linear holding the producer's dequantized weight, frozen as
compressed, so its forward fake-quantizes the input as the scheme says and
multiplies in bf16. Its arithmetic rounds differently (its dynamic int8 scale
is ``absmax / 127.5`` computed in bf16, its quotient ``x / scale`` rounds to
bf16, its weights are the bf16 dequantized values), so the two agree within
the bound those differences allow, computed from the actual operands: the
quantized activations' difference times the weights, the weights' rounding,
and each side's summation bound. For the static schemes, both quantize with the
same stored scale, and each activation value differs by at most one code step
(and compressed-tensors' rounding of its dequantized value to bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtensor_quant as dq
from dtensor_quant._core import activations
from dtensor_quant.testing import assert_within, linear_error_bound
from tests.support import producers as pr

KINDS = {  # kind -> (the format class, its activation scheme)
    "ct_w8a8": (dq.Int8Rowwise, "int8-token"),
    "ct_w8a8_static": (dq.Int8Rowwise, "int8-tensor"),
    "ct_fp8": (dq.Float8Rowwise, "fp8-token"),
    "ct_fp8_static": (dq.Float8Tensorwise, "fp8-tensor"),
}


def _ct_linear(group: dict, weight: torch.Tensor, stored: dict, prefix: str):
    """compressed-tensors' quantized Linear: its scheme, the dequantized weight, its scales, frozen as compressed."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )

    scheme = QuantizationScheme.model_validate(dict(group, targets=["Linear"]))
    model = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype))
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": scheme}), show_progress=False)
    lin = model[0]
    with torch.no_grad():
        lin.weight.copy_(weight)
        for name in ("weight_scale", "input_scale"):
            if hasattr(lin, name) and f"{prefix}.{name}" in stored:
                getattr(lin, name).copy_(stored[f"{prefix}.{name}"].reshape(getattr(lin, name).shape))
    lin.quantization_status = QuantizationStatus.COMPRESSED  # weights as given: only the input is fake-quantized
    return lin


@pytest.mark.parametrize("kind", list(KINDS))
def test_activation_scheme_read_and_computed_as_the_producer(producer_checkpoints, kind):
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from safetensors.torch import load_file

    path = producer_checkpoints[kind]
    model, chosen = pr.build("single", path)
    result = dq.hf.load(model, path)
    assert not result.unexpected and sorted(result.prequantized) == sorted(chosen)
    cls, scheme = KINDS[kind]
    assert {type(layout.fmt) for layout in chosen.values()} == {cls}
    assert {layout.fmt.activations for layout in chosen.values()} == {scheme}
    stored = load_file(str(Path(path) / "model.safetensors"))
    group = json.loads((Path(path) / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    ref = pr.reference(path)
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 1.5
    x[1, 7] = 9.0  # an outlier: saturates the static schemes, sets its token's dynamic scale
    for key in sorted(chosen)[:7]:  # one layer's seven Linears
        prefix = key[: -len(".weight")]
        q = model.get_parameter(key)
        fmt = q.fmt
        assert fmt.activations == scheme
        if not fmt.activation_scheme.dynamic:
            assert fmt.input_scale == float(stored[f"{prefix}.input_scale"].reshape(-1)[0])
        xi = x[:, : q.shape[1]]
        ct = _ct_linear(group, ref[key], stored, prefix)
        with torch.no_grad():
            want = ct(xi)
            x_ct = forward_quantize(ct, xi, "input", ct.quantization_scheme.input_activations).double()
        got = F.linear(xi, q)
        codes, x_scale = activations.quantize_activation(xi, fmt.activation_scheme, fmt.input_scale)
        x_ours = codes.double() * x_scale.double()
        w_exact = q.qdata.double() * q.scale.double()
        w_deq = ref[key].double()
        bound = (
            (x_ours - x_ct).abs() @ w_deq.abs().t()
            + x_ours.abs() @ (w_exact - w_deq).abs().t()
            + linear_error_bound(x_ours, w_exact, out_dtype=torch.bfloat16)
            + linear_error_bound(x_ct, w_deq, out_dtype=torch.bfloat16)
        )
        assert_within(got, want, bound, f"{kind} {key}: against compressed-tensors' forward")
        if not fmt.activation_scheme.dynamic:
            # one code step, plus compressed-tensors' rounding of its dequantized activation to bf16
            if fmt.activation_scheme.codes == "int8":
                step = fmt.input_scale + 2**-8 * x_ct.abs()
            else:  # e4m3: codes 2**-3 apart relative to the value, 2**-9 of the scale apart below the normals
                step = 2**-3 * torch.maximum(x_ours.abs(), x_ct.abs()) + fmt.input_scale * 2**-9 + 2**-8 * x_ct.abs()
            assert bool(((x_ours - x_ct).abs() <= step).all()), (kind, key)


def test_unread_activation_schemes_are_refused(producer_checkpoints, tmp_path):
    """An activation scheme the formats do not compute is refused by name, never served weight-only."""
    import shutil

    path = Path(shutil.copytree(producer_checkpoints["ct_w8a8"], tmp_path / "ckpt"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["strategy"] = "group"
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["group_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    import transformers

    with dq.hf.init_empty():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**pr.hc.CONFIG))
    with pytest.raises(ValueError, match=r"input activations .* are not read"):
        dq.hf.quantize_like_checkpoint(model, path)


@pytest.mark.parametrize("kind", list(KINDS))
def test_saved_back_with_its_activation_scheme(producer_checkpoints, kind, tmp_path):
    """``dq.hf.save(quantization="compressed-tensors")`` writes the scheme and the bytes back as the producer did."""
    from safetensors.torch import load_file

    path = producer_checkpoints[kind]
    model, chosen = pr.build("single", path)
    dq.hf.load(model, path)
    out = tmp_path / "saved"
    dq.hf.save(model, out, quantization="compressed-tensors")
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    original = json.loads((Path(path) / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    (group,) = groups.values()
    keep = ("num_bits", "type", "strategy", "dynamic", "symmetric")
    assert {k: group["input_activations"][k] for k in keep} == {k: original["input_activations"][k] for k in keep}
    assert {k: group["weights"][k] for k in keep} == {k: original["weights"][k] for k in keep}
    before, after = load_file(str(Path(path) / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for k, v in before.items():
        assert v.dtype == after[k].dtype and torch.equal(v.view(torch.uint8), after[k].view(torch.uint8)), k
    _, chosen_again = pr.build("single", out)
    assert {k: v.fmt for k, v in chosen_again.items()} == {k: v.fmt for k, v in chosen.items()}


def test_per_rank_scheme_is_not_exported(tmp_path):
    model = pr.tiny_llama()
    dq.quantize_(model, dq.Int8Rowwise(activations="int8-token-per-rank"), filter_fn=lambda m, fqn: "q_proj" in fqn)
    with pytest.raises(ValueError, match="per-rank statistics"):
        dq.hf.save(model, tmp_path / "x", quantization="compressed-tensors")


def test_activations_beside_weights_no_scheme_computes_are_served_weight_only_with_a_warning(producer_checkpoints):
    """FP8_BLOCK's dynamic per-group inputs: no format computes them with block weights; said, never silent."""
    import transformers

    path = producer_checkpoints["ct_fp8_block"]
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["input_activations"] is not None
    with dq.hf.init_empty():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**pr.hc.CONFIG))
    with pytest.warns(UserWarning, match=r"input activations \(float8 group dynamic\) are not computed"):
        layouts = dq.hf.quantize_like_checkpoint(model, path)
    assert layouts and all("not computed (weight-only)" in str(layout) for layout in layouts.values()), layouts
