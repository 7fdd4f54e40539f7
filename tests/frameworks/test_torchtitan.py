"""dq.torchtitan on one process: what the converter swaps, what it refuses, the optimizer names it adds."""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is a test extra")

import dtensor_quant as dq
import dtensor_quant.torchtitan as dqt

pytestmark = pytest.mark.filterwarnings("ignore")


def test_a_format_without_stochastic_rounding_is_refused_naming_those_that_have_it():
    with pytest.raises(ValueError, match=r"NF4.*no stochastic rounding.*int8"):
        dqt.QuantizedLinearConverter.Config(format="nf4").build()


def test_the_converter_swaps_linear_configs_and_leaves_the_fused_qkv_dense():
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    linears = [fqn for fqn, *_ in config.traverse(Linear.Config)]
    converter = dqt.QuantizedLinearConverter.Config(format="int8", filter_fqns=["lm_head"]).build()
    config = converter.convert(config)
    swapped = [fqn for fqn, cfg, *_ in config.traverse(Linear.Config) if hasattr(cfg, "quant_format")]
    dense = [fqn for fqn, _ in converter.left_dense]
    assert sorted(swapped + dense) == sorted(linears)
    assert "lm_head" in dense and all("wqkv" in f for f in dense if f != "lm_head")
    seeds = {cfg.quant_seed for _, cfg, *_ in config.traverse(Linear.Config) if hasattr(cfg, "quant_seed")}
    assert len(seeds) == len(swapped)  # each weight rounds with its own seed


def test_a_converted_linear_is_built_quantized_and_trainable_on_meta():
    from torchtitan.models.common.linear import Linear

    cls = dqt.quantized_linear_class(Linear)
    with torch.device("meta"):
        module = cls.Config(in_features=64, out_features=32, quant_format="int8").build()
    assert isinstance(module, Linear) and isinstance(module.weight, dq.QuantizedTensor)
    assert module.weight.requires_grad and module.weight.device.type == "meta"


def test_the_optimizer_container_resolves_the_librarys_names():
    assert dqt.OptimizersContainer._resolve_optimizer_factory("AdamW") is torch.optim.AdamW
    linear = torch.nn.Linear(64, 64)
    opt = dqt.OptimizersContainer._resolve_optimizer_factory("AdamW8bit")(
        [{"params": list(linear.parameters()), "fused": True, "foreach": False, "lr": 1e-3}]
    )
    assert isinstance(opt, dq.optim.AdamW8bit)


def test_spmd_types_replicate_to_varying_cuts_a_quantized_weight_by_its_layout():
    """spmd_types' R -> V conversion: this rank's chunk, the bytes of slicing the weight; a cut through a group
    is refused."""
    import spmd_types  # noqa: F401  (registers its ops)

    weight = torch.randn(8, 128)
    q = dq.quantize(weight, dq.Int8Rowwise())
    for rank in range(2):
        piece = torch.ops.spmd_types.replicate_to_varying(q, 2, 0, rank, False)
        expected = dq.quantize(weight[rank * 4 : (rank + 1) * 4], dq.Int8Rowwise())
        dq.testing.assert_same_bits(piece, expected, f"rank {rank}")
        assert piece.qdata.data_ptr() != q.qdata.data_ptr()  # never aliases, as spmd_types' own op
    groups = dq.quantize(weight, dq.Int4Groupwise(64))
    with pytest.raises((dq.LayoutError, dq.UnsupportedOpError)):
        torch.ops.spmd_types.replicate_to_varying(groups, 4, 1, 1, False)  # 32 columns: half a group


def test_torchtitans_own_model_wrapper_takes_neither_form_of_a_quantized_state_dict():
    """Why torchtitan's stock CheckpointManager cannot be kept (docs/frameworks.md): its ModelWrapper compares
    storage pointers of tensor values (refused, naming the library's manager) and reads ``.shape`` of entry
    dicts."""
    from torchtitan.components.checkpointer.base import ModelWrapper

    model = dq.quantize_(torch.nn.Sequential(torch.nn.Linear(128, 64)), dq.Int8Rowwise())
    stock = ModelWrapper(model)
    with pytest.raises(RuntimeError, match=r"dtensor_quant\.torchtitan\.CheckpointManager"):
        stock.state_dict()
    dq.checkpoint.tensor_state_dicts(model, enabled=False)
    with pytest.raises(AttributeError, match="shape"):
        ModelWrapper(model).state_dict()
