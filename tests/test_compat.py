"""The package root: public modules keep their names after the move into layer folders; old paths warn
and still work (dtensor_quant/_compat.py).
"""

import pytest

import dtensor_quant as dq


def test_public_api_edges():
    """Public modules keep their names after the move into layer folders; old paths warn and still work."""
    import importlib

    assert {"state_dict", "model", "hf", "wire", "lora", "interop", "custom_ops"} <= set(dq.__all__)
    assert dq.state_dict.register is importlib.import_module("dtensor_quant.state_dict").register
    assert dq.model.quantize_ is dq.quantize_
    from dtensor_quant.model import is_matmul_weight, quantized_fqns, weight_bytes

    assert (is_matmul_weight, quantized_fqns, weight_bytes) == (
        dq.model.is_matmul_weight,
        dq.model.quantized_fqns,
        dq.model.weight_bytes,
    )
    assert dq.state_dict.format_spec is dq.state_dict.quant_record
    for name in ("hf", "wire", "lora", "interop", "custom_ops"):
        assert importlib.import_module(f"dtensor_quant.{name}") is getattr(dq, name)
    with pytest.warns(DeprecationWarning, match=r"format_spec moved to dtensor_quant\.model\.format_spec"):
        old = importlib.import_module("dtensor_quant.format_spec")
    assert old.parse_format("int4:64") == dq.Int4Groupwise(64)
    with pytest.warns(DeprecationWarning, match="dtensor_quant.planner moved"):
        assert dq.planner is importlib.import_module("dtensor_quant.model.planner")
    with pytest.raises(ImportError):
        importlib.import_module("dtensor_quant.nn")  # the old name of dtensor_quant.model is gone
