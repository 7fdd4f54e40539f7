"""pytest and ruff, with their default settings, see every module of the package and every test file.

A folder named like a build output (``dist``, ``build``, ``venv``) is skipped by
pytest's default ``norecursedirs``, ruff's default excludes and the common
Python ``.gitignore``; the package and tests have none, and pyproject.toml
overrides neither tool's defaults.
"""

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# pytest's default norecursedirs and the folder names ruff excludes by default (both documented lists).
SKIPPED_BY_DEFAULT = ("*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}")
SKIPPED_BY_DEFAULT += ("__pypackages__", "_build", "buck-out", "site-packages")


def _folders(top: Path):
    return [p for p in top.rglob("*") if p.is_dir() and p.name != "__pycache__"]


def test_no_folder_has_a_name_the_tools_skip():
    for top in ("dtensor_quant", "tests", "bench", "examples", "tools"):
        for folder in _folders(ROOT / top):
            bad = [g for g in SKIPPED_BY_DEFAULT if fnmatch.fnmatch(folder.name, g)]
            assert not bad, f"{folder.relative_to(ROOT)} matches {bad}, which pytest or ruff skip by default"


def test_pyproject_keeps_the_tools_defaults():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert "norecursedirs" not in config["pytest"]["ini_options"]
    assert not {"exclude", "extend-exclude", "include"} & set(config["ruff"])


def test_ruff_checks_every_python_file():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True
    )
    seen = {Path(line.strip()).resolve() for line in out.stdout.splitlines() if line.strip().endswith(".py")}
    expected = {
        p.resolve()
        for top in ("dtensor_quant", "tests", "bench", "examples", "tools")
        for p in (ROOT / top).rglob("*.py")
    }
    assert expected - seen == set()


def test_pytest_collects_every_test_file():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    # a file that skips itself when an optional package is missing (pytest.importorskip) was seen, not collected
    skipped = set(re.findall(r"^SKIPPED \[\d+\] (tests/\S+\.py):", out.stdout, flags=re.M))
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert expected - collected - skipped == set(), re.sub(r"\s+", " ", out.stdout[-2000:])
