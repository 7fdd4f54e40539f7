"""``python -m dtensor_quant kernels``: which C++ kernels run here, and on which vector path."""

import importlib
import pkgutil

import dtensor_quant._formats
from dtensor_quant.__main__ import KERNELS, main
from dtensor_quant._core import native


def test_every_kernel_is_listed_with_the_level_it_runs(capsys):
    """One line per C++ kernel of dtensor_quant._formats (a new one must be added to KERNELS), with the level its
    own ``kernel()`` reports."""
    with_kernels = {
        info.name
        for info in pkgutil.iter_modules(dtensor_quant._formats.__path__)
        if hasattr(importlib.import_module(f"dtensor_quant._formats.{info.name}"), "KERNEL")
    }
    assert with_kernels == set(KERNELS)
    assert main(["kernels"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()}
    for name, formats in KERNELS.items():
        built = importlib.import_module(f"dtensor_quant._formats.{name}").kernel()
        level = min(built[1], native.MAX_LEVEL) if built else None
        want = f"{native.LEVEL_NAMES[level]} tiles" if built else "none ("
        assert formats in lines[name] and want in lines[name], lines[name]


def test_switched_off(monkeypatch, capsys):
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "0")
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert all(f"{formats:<51}none (DTENSOR_QUANT_NATIVE=0)" in out for formats in KERNELS.values())


def test_a_kernel_that_does_not_build_says_why(monkeypatch, tmp_path, capsys):
    """A kernel that cannot build: the report names the build error (what its warning said), not just "none"."""
    monkeypatch.setenv("DTENSOR_QUANT_NATIVE", "1")  # also where the suite runs with the kernels off
    broken = tmp_path / "broken.cpp"
    broken.write_text("void kernel(int64_t* level) { this is not C++ }\n")
    module = importlib.import_module("dtensor_quant._formats.int8")
    kernel = native.Kernel("int8", broken)
    monkeypatch.setattr(module, "KERNEL", kernel)
    monkeypatch.setattr(module, "kernel", lambda: native.load(kernel))
    assert main(["kernels"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("int8 "))
    assert "none (it did not build: " in line, line
    assert native.why_unavailable(kernel).startswith("it did not build: ")


def test_the_activation_kernels_are_listed_with_the_level_they_run(capsys):
    """W8A8's and FP8 activations' kernels: a line each, with the level their own loader reports, in words."""
    from dtensor_quant.__main__ import ACTIVATION_KERNELS

    declared = {k.name for k in native.DECLARED.values()}
    assert set(ACTIVATION_KERNELS) <= declared
    assert main(["kernels"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()}
    for name, (module, loader, formats, words) in ACTIVATION_KERNELS.items():
        built = getattr(importlib.import_module(f"dtensor_quant._formats.{module}"), loader)()
        if built is None:
            want = "none"
        else:
            level = min(built[1], native.cap())
            want = words.get(level, native.LEVEL_NAMES[level])
        assert formats in lines[name] and want in lines[name], lines[name]
