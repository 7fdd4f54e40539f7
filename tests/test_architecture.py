"""The package's import structure stays layered (docs/architecture.md): tools/check_imports.py finds nothing."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "tools" / "check_imports.py"
_spec = importlib.util.spec_from_file_location("check_imports", _PATH)
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def test_no_import_cycle_and_no_private_import():
    assert check_imports.check() == []


def test_checker_catches_a_cycle_and_a_private_import(tmp_path):
    pkg = tmp_path / "dtensor_quant"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def helper():\n    from .high import _thing\n    return _thing\n")
    (pkg / "high.py").write_text("from .low import helper\n\n_thing = 1\n")
    problems = check_imports.check(tmp_path)
    assert any("imports private _thing" in p for p in problems), problems
    assert any("climbs a layer" in p for p in problems), problems
    (pkg / "low.py").write_text("from .high import helper2\n\ndef helper():\n    return 1\n")
    (pkg / "high.py").write_text("from .low import helper\n\ndef helper2():\n    return 2\n")
    assert any("module-level import cycle" in p for p in check_imports.check(tmp_path))
