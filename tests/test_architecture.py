"""The package's import structure stays layered (docs/architecture.md): tools/check_imports.py finds nothing."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "tools" / "check_imports.py"
_spec = importlib.util.spec_from_file_location("check_imports", _PATH)
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def test_no_import_cycle_and_no_private_import():
    assert check_imports.check() == []


def test_architecture_doc_shows_the_enforced_layer_table():
    doc = (_PATH.parent.parent / "docs" / "architecture.md").read_text()
    assert check_imports.diagram() in doc, "regenerate it: python tools/check_imports.py --diagram"


def test_checker_refuses_an_import_that_climbs_the_layer_table(tmp_path):
    pkg = tmp_path / "dtensor_quant"
    for folder in ("_core", "_ops", "misc"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_core" / "tensor.py").write_text("def method():\n    from .._ops.handlers import run\n    return run\n")
    (pkg / "_ops" / "handlers.py").write_text("def run():\n    return 1\n")
    (pkg / "misc" / "thing.py").write_text("")
    problems = check_imports.check(tmp_path)
    assert any("function-level import of dtensor_quant._ops.handlers climbs" in p for p in problems), problems
    assert any("module dtensor_quant.misc.thing is in no layer" in p for p in problems), problems


def test_checker_catches_a_cycle_and_a_private_import(tmp_path):
    pkg = tmp_path / "dtensor_quant"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def helper():\n    from .high import _thing\n    return _thing\n")
    (pkg / "high.py").write_text("from .low import helper\n\n_thing = 1\n")
    problems = check_imports.check(tmp_path)
    assert any("imports private _thing" in p for p in problems), problems
    assert any("import circle" in p for p in problems), problems
    (pkg / "low.py").write_text("from .high import helper2\n\ndef helper():\n    return 1\n")
    (pkg / "high.py").write_text("from .low import helper\n\ndef helper2():\n    return 2\n")
    assert any("import circle" in p for p in check_imports.check(tmp_path))


def test_checker_catches_private_names_used_from_tests_benches_and_examples(tmp_path):
    pkg = tmp_path / "dtensor_quant"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .low import Thing\n")
    (pkg / "low.py").write_text("class Thing:\n    _slot = 1\n\n_cache = {}\n")
    for folder in ("tests", "bench", "examples"):
        (tmp_path / folder).mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from dtensor_quant.low import _cache\n")
    (tmp_path / "bench" / "b.py").write_text("import dtensor_quant as dq\n\nx = dq.low._cache\ny = dq.Thing._slot\n")
    (tmp_path / "examples" / "e.py").write_text("from dtensor_quant import low\n\nx = low._cache\n")
    problems = check_imports.check(tmp_path)
    assert any(p.startswith("tests/test_x.py:1: imports private _cache") for p in problems), problems
    assert any(p.startswith("bench/b.py:3: reads private dq.low._cache") for p in problems), problems
    assert any(p.startswith("examples/e.py:3: reads private low._cache") for p in problems), problems
    # an attribute of a class (dq.Thing._slot) is not a module's private name
    assert len(check_imports.outside_problems(tmp_path)) == 3, problems


def test_checker_refuses_a_write_into_another_module(tmp_path):
    pkg = tmp_path / "dtensor_quant"
    (pkg / "_ops").mkdir(parents=True)
    (pkg / "_model").mkdir()
    for folder in (pkg, pkg / "_ops", pkg / "_model"):
        (folder / "__init__.py").write_text("")
    (pkg / "_ops" / "arithmetic.py").write_text("TRAINABLE = None\n")
    (pkg / "_model" / "trainable.py").write_text(
        "from .._ops import arithmetic\n\n\ndef resolve(q):\n    return None\n\n\n"
        "arithmetic.TRAINABLE = resolve\nsetattr(arithmetic, 'TRAINABLE', resolve)\n"
    )
    problems = check_imports.check(tmp_path)
    writes = [p for p in problems if "writes arithmetic." in p]
    assert len(writes) == 2 and "into module dtensor_quant._ops.arithmetic" in writes[0], problems
    (pkg / "_model" / "trainable.py").write_text("from .._ops import arithmetic\n\nTRAINABLE = arithmetic\n")
    assert check_imports.check(tmp_path) == []


def test_checker_refuses_a_format_named_outside_formats(tmp_path):
    pkg = tmp_path / "dtensor_quant"
    for folder in ("_core", "_formats", "_checkpoint"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from ._formats.int8 import Int8Rowwise\n")  # the public front re-exports
    (pkg / "_core" / "format.py").write_text("class QuantFormat:\n    pass\n")
    (pkg / "_formats" / "int8.py").write_text(
        "from .._core.format import QuantFormat\n\n\nclass Int8Rowwise(QuantFormat):\n    pass\n\n\n"
        "class Int8Wide(Int8Rowwise):\n    pass\n"
    )
    (pkg / "_checkpoint" / "export.py").write_text(
        "from .. import _formats\n\n\ndef scheme(fmt):\n    return isinstance(fmt, _formats.int8.Int8Wide)\n"
    )
    problems = check_imports.check(tmp_path)
    assert check_imports.format_classes(check_imports.modules(tmp_path)) == {"Int8Rowwise", "Int8Wide"}
    assert (
        [p for p in problems if "names format" in p]
        == [p for p in problems if p.startswith("dtensor_quant/_checkpoint/export.py:5: names format Int8Wide outside")]
        != []
    ), problems
    (pkg / "_checkpoint" / "export.py").write_text("def scheme(fmt):\n    return fmt.producer_layout('x', None)\n")
    assert check_imports.check(tmp_path) == []


def test_every_listed_exception_to_the_format_naming_rule_is_a_module():
    mods = check_imports.modules()
    assert set(check_imports.FORMAT_NAMING) <= set(mods), set(check_imports.FORMAT_NAMING) - set(mods)
