"""core/native_build: kernels built per CPU level into one cache, never loaded on a CPU that lacks their flags.

The kernels here are tiny sources (a second to build); the CPU is faked by
replacing :func:`native_build.cpu_features`, so the tests run on any x86
machine with a C++ compiler.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.__main__ import build_kernels
from dtensor_quant._core import native, native_build

# A kernel that reports 7 and writes its integer argument, if not 0, into its tensor.
SOURCE = """#include <cstdint>
void kernel(int64_t* out, int64_t value, int64_t* level) {
    if (value) out[0] = value;  // the probe passes 0 and no memory
    *level = 7;
}
"""
# Two levels this CPU can run (what a build at the better one may use, it has), the better one faked below.
WORSE = min(native_build.cpu_level(), 2) - 1
BETTER, LESS = WORSE + 1, frozenset(native_build.required_features(WORSE))
MORE = frozenset(native_build.required_features(BETTER))
pytestmark = pytest.mark.skipif(WORSE < 0, reason="this CPU has no vector level to fake a lower one under")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A declared-alike kernel of :data:`SOURCE` and an empty cache of its own."""
    monkeypatch.setenv("DTENSOR_QUANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "1")
    path = tmp_path / "tiny.cpp"
    path.write_text(SOURCE)
    return native.Kernel(f"tiny_{tmp_path.name}", path)


def fake_cpu(monkeypatch, features):
    monkeypatch.setattr(native_build, "cpu_features", lambda: features)


def records(root: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in root.rglob("*.json")}


def test_a_build_for_a_better_cpu_is_never_loaded(tiny, monkeypatch):
    """A cache filled on a CPU with AVX-512 (here: with AVX2), then used on one without (a shared home, an image):
    the second builds its own binary, in its own folder, with the flags of its level only."""
    root = native_build.cache_root()
    fake_cpu(monkeypatch, MORE)
    built = native.load(tiny)
    assert built is not None and built[1] == 7
    fake_cpu(monkeypatch, LESS)
    said = []
    run, _ = native.load(tiny, said.append)
    assert said, "the better CPU's build was loaded on the lesser one"
    out = torch.zeros(1, dtype=torch.int64)
    run(out, 5, native.level_out())
    assert int(out) == 5
    by_folder = records(root)
    assert sorted(r["level"] for r in by_folder.values()) == [WORSE, BETTER], by_folder
    for folder, record in by_folder.items():
        assert folder.endswith("-" + native_build.LEVEL_TAGS[record["level"]])
        assert set(record["features"]) == set(native_build.required_features(record["level"]))
        assert "-march=native" not in record["command"]
        assert ("-mavx2" in record["command"]) == (record["level"] >= 1), record["command"]
        assert ("-mavx512f" in record["command"]) == (record["level"] >= 2), record["command"]


def test_a_binary_whose_record_names_missing_flags_is_rebuilt(tiny, monkeypatch):
    """A binary copied into this CPU's folder from a CPU with more (its record says so), or one with no record:
    rebuilt, not loaded."""
    text = native.source(tiny.source)
    fake_cpu(monkeypatch, MORE)
    _, better = native_build.load(tiny.name, text, BETTER)
    fake_cpu(monkeypatch, LESS)
    said = []
    _, ours = native_build.load(tiny.name, text, WORSE, said.append)
    assert said and ours.parent != better.parent
    shutil.copy(better, ours.with_suffix(".copy"))  # a new file: this process has the old one mapped
    os.replace(ours.with_suffix(".copy"), ours)
    record = json.loads(better.with_suffix(".json").read_text())
    ours.with_suffix(".json").write_text(json.dumps({**record, "level": WORSE}))  # the level right, the flags not
    said.clear()
    native_build.load(tiny.name, text, WORSE, said.append)
    assert said, "a binary whose record names flags this CPU lacks was loaded"
    assert set(json.loads(ours.with_suffix(".json").read_text())["features"]) == LESS
    ours.with_suffix(".json").unlink()
    said.clear()
    native_build.load(tiny.name, text, WORSE, said.append)
    assert said, "a binary without its record was loaded"


def test_the_cache_location(monkeypatch, tmp_path):
    """``$DTENSOR_QUANT_CACHE``, else ``$XDG_CACHE_HOME/dtensor_quant/kernels``; a folder per torch, Python and
    level."""
    monkeypatch.setenv("DTENSOR_QUANT_CACHE", str(tmp_path / "here"))
    assert native_build.cache_root() == tmp_path / "here"
    monkeypatch.delenv("DTENSOR_QUANT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_build.cache_root() == tmp_path / "xdg" / "dtensor_quant" / "kernels"
    folder = native_build.folder(3).name
    assert torch.__version__ in folder and folder.endswith("-avx512bf16")


def test_every_kernel_is_declared_once_and_its_signature_read_from_its_source():
    """Each .cpp of the package is one declared kernel; its parameters come from its ``void kernel(...)``, and
    its probe names only parameters it has."""
    import dtensor_quant._core.stochastic  # noqa: F401  (declares the noise kernel)

    sources = sorted(Path(dq.__file__).parent.rglob("*.cpp"))
    declared = {k.source.resolve(): k for k in native.DECLARED.values()}
    assert set(declared) == {p.resolve() for p in sources}
    for path in sources:
        params = native_build.parameters(native.source(path))
        assert params[-1][0] == "int64_t*"
        names = {name for ctype, name in params if ctype == "int64_t"}
        assert set(declared[path.resolve()].probe) <= names, path.name


@pytest.mark.parametrize(
    "signature, says",
    [("void kernel(float x, int64_t* level) {", "float x"), ("void kernel(int64_t* out, int64_t n) {", "last")],
)
def test_a_signature_the_binding_cannot_take_is_refused(signature, says):
    with pytest.raises(ValueError, match=says):
        native_build.parameters(signature + " }")


def test_the_binding_checks_its_arguments(tiny):
    run, _ = native.load(tiny)
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        run(torch.zeros(1, dtype=torch.int64), 1)
    with pytest.raises(TypeError):
        run(torch.zeros(1, dtype=torch.int64), "one", native.level_out())
    with pytest.raises(AttributeError, match="data_ptr"):
        run(None, 1, native.level_out())


def test_build_everything_says_each_kernel(tiny, monkeypatch, tmp_path):
    """``kernels --build`` builds every declared kernel, a line as each starts and ends; a process that loads
    the same source later finds it in the cache."""
    monkeypatch.setattr(native, "DECLARED", {tiny.name: tiny})
    said = []
    assert build_kernels(said.append) == 0
    assert any(line.startswith(f"[1/1] building {tiny.name}") for line in said), said
    assert any(line.startswith(f"[1/1] {tiny.name}: ready, level 7") for line in said), said
    again = tmp_path / "again" / tiny.source.name  # the same text elsewhere: not the in-process table's entry
    again.parent.mkdir()
    shutil.copy(tiny.source, again)
    monkeypatch.setattr(native, "DECLARED", {tiny.name: native.Kernel(tiny.name, again)})
    said.clear()
    assert build_kernels(said.append) == 0
    assert not any("building" in line for line in said) and "ready" in said[-1], said
