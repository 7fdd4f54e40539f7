"""``import dtensor_quant`` changes nothing in torch, and every documented module imports as a normal import.

Each check runs in a fresh interpreter: this test process has long since made
quantized tensors (which install the compile-key patch, scoped to them) and
may have enabled the opt-in redistribute shortcuts.
"""

import json
import subprocess
import sys

# Every torch module whose objects the library patches, or could (its own patches and their neighbours).
TORCH_MODULES = [
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.serialization",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed._functional_collectives",
    "torch.distributed.tensor",
    "torch.distributed.tensor._api",
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._collective_utils",
    "torch.distributed.tensor.placement_types",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor._sharding_prop",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard._fsdp_param",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.planner_helpers",
    "torch.distributed.checkpoint.default_planner",
    "torch.distributed.checkpoint.state_dict",
]

SNAPSHOT = """
import importlib, json, sys
mods = json.loads(sys.argv[1])
def snap():
    out = {}
    for m in mods:
        mod = importlib.import_module(m)
        for k, v in list(vars(mod).items()):
            out[f"{m}.{k}"] = id(v)
            if isinstance(v, type) and v.__module__.startswith("torch"):
                out.update({f"{m}.{k}.{a}": id(b) for a, b in list(vars(v).items())})
    return out
before = snap()
import dtensor_quant  # noqa: F401
after = snap()
print(json.dumps(sorted(k for k, v in before.items() if after.get(k) != v)))
"""


def test_importing_the_library_replaces_no_torch_object():
    out = subprocess.run(
        [sys.executable, "-c", SNAPSHOT, json.dumps(TORCH_MODULES)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_setting_is_in_the_readme_table():
    from pathlib import Path

    import dtensor_quant as dq

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for setting in dq.config.SETTINGS.values():
        default = setting.default or "(empty)"
        assert f"| `{setting.env}` | `{default}` | {setting.doc} |" in readme, setting.env


def test_every_public_module_imports_as_a_normal_import():
    import importlib

    import dtensor_quant as dq

    for name in ("fsdp", "checkpoint", "hf", "optim", "lora", "planner", "training", "testing", "config", "wire"):
        module = importlib.import_module(f"dtensor_quant.{name}")
        assert module.__name__ == f"dtensor_quant.{name}"
        if name != "testing":
            assert getattr(dq, name) is module
        for exported in getattr(module, "__all__", ()):
            assert hasattr(module, exported), f"dtensor_quant.{name}.{exported}"
    assert dq.hf.quantize_like_checkpoint.__module__.startswith("dtensor_quant._")


def test_the_config_command_prints_every_setting_in_force(monkeypatch, capsys):
    import dtensor_quant as dq
    from dtensor_quant.__main__ import main

    monkeypatch.setenv("DTENSOR_QUANT_MEMO", "0")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "DTENSOR_QUANT_MEMO='0'" in out
    assert all(s.env in out for s in dq.config.SETTINGS.values())


def test_a_bad_value_is_a_config_error_naming_the_variable(monkeypatch):
    import pytest

    import dtensor_quant as dq

    monkeypatch.setenv("DTENSOR_QUANT_AGREE_EVERY_CALL", "maybe")
    with pytest.raises(dq.config.ConfigError, match=r"DTENSOR_QUANT_AGREE_EVERY_CALL='maybe'.*1/true/yes/on"):
        dq.config.get("agree_every_call")
    monkeypatch.setenv("DTENSOR_QUANT_MAX_LEVEL", "9")
    with pytest.raises(dq.config.ConfigError, match=r"DTENSOR_QUANT_MAX_LEVEL='9' is not a value it takes") as e:
        dq.config.get("max_level")
    from dtensor_quant._core.config import LEVELS

    message = str(e.value)
    for level, name in LEVELS.items():  # each level and its instructions said once, not twice
        assert message.count(f"{level} {name}") == 1, message
        assert message.count(name) == sum(name in other for other in LEVELS.values()), message


def test_a_setting_follows_the_environment_after_its_value_is_remembered(monkeypatch):
    """config.get remembers each text's parsed value (the kernels ask on every call), but reads the variable on
    every call: a change takes effect at once, back and forth, and a bad value still raises."""
    import pytest

    import dtensor_quant as dq

    for text, expected in (("0", False), ("1", True), ("off", False), ("0", False), ("yes", True)):
        monkeypatch.setenv("DTENSOR_QUANT_NATIVE", text)
        assert dq.config.get("native") is expected
    monkeypatch.setenv("DTENSOR_QUANT_MAX_LEVEL", "2")
    assert dq.config.get("max_level") == 2
    monkeypatch.setenv("DTENSOR_QUANT_MAX_LEVEL", "9")
    with pytest.raises(dq.config.ConfigError, match="DTENSOR_QUANT_MAX_LEVEL='9'"):
        dq.config.get("max_level")
    monkeypatch.delenv("DTENSOR_QUANT_MAX_LEVEL")
    assert dq.config.get("max_level") is None


HANDLER = """
from torch.distributed.tensor import DTensor
import dtensor_quant as dq
from dtensor_quant._parallel import activation_stats
table = DTensor._op_dispatcher._custom_op_handlers
steps = [activation_stats.installed()]
dq.Int8Rowwise(activations="int8-token-per-rank")  # per rank: no statistic to reduce
dq.Int8Rowwise(activations="int8-tensor", input_scale=0.5)  # static: none either
steps.append(activation_stats.installed())
dq.Int8Rowwise(activations="int8-token")
steps.append(activation_stats.installed())
print(steps, sorted(str(op) for op, h in table.items() if getattr(h, "__module__", "") == activation_stats.__name__))
"""


def test_the_token_statistics_handler_is_installed_by_the_first_reduced_scheme_only():
    """DTensor's op table holds the handler only once a reduced dynamic scheme is declared (a fresh interpreter:
    this process has declared one long ago)."""
    out = subprocess.run([sys.executable, "-c", HANDLER], capture_output=True, text=True, check=True)
    steps, ops = out.stdout.strip().splitlines()[-1].split("] ")
    assert steps == "[False, False, True"
    assert ops == "['aten.addmm.default', 'aten.mm.default', 'dtensor_quant.linear.default']"
