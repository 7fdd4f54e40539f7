"""The build step of the C++ kernels: one source, one compiler call, one cached extension module per CPU level.

A kernel's source (``_formats/nf4.cpp``, its headers inlined by
:func:`dtensor_quant._core.native.source`) defines ``void kernel(...)``. This
module reads that signature (:func:`parameters`: the one place it is
declared), appends a Python binding generated from it (pointer parameters
take tensors, through their public ``data_ptr()``; ``int64_t`` ones take
ints) and compiles the whole into an extension module with the C++ compiler
(``$CXX``, else ``c++``). The binding needs ``Python.h`` only, not torch's
headers, so a kernel builds in the time its own code takes.

Why not ``torch.utils.cpp_extension.load``: it needs ninja, and its bindings
(pybind11 over ``torch/extension.h``) compile torch's headers, several times
the compile time of a kernel, for a call that only needs a pointer.

**Portability.** The vector code sits in functions with ``target``
attributes, chosen at run time. What the compiler may use everywhere else is
the build's *level*: the highest of :data:`LEVEL_FEATURES` whose CPU flags
this CPU has (``/proc/cpuinfo``; none known: plain x86-64), compiled with
that level's ``-m`` flags -- never
``-march=native``, which would let the compiler use whatever the building CPU
has. The level is part of the cache path and written next to the binary
(``<module>.json``); a binary whose record names a CPU flag this CPU lacks is
rebuilt, never loaded. The floating-point flags are those inductor builds
its CPU kernels with (``-ffp-contract=off``: no fused multiply-add the source
does not write), so the level never changes a result's bits.

**The cache**: ``$DTENSOR_QUANT_CACHE``, else
``$XDG_CACHE_HOME/dtensor_quant/kernels`` (``~/.cache/dtensor_quant/kernels``),
a folder per torch version, Python and level
(``torch-2.13.0-cpython-311-amx``), a module per kernel and hash of its
source, binding and flags (``nf4-<hash>.so``). A machine builds each kernel
once; later processes load it in milliseconds. Deleting the folder is
always safe. Builds write a temporary file and rename it, so processes that
build the same kernel at once (ranks) each load a whole binary.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from . import config

#: Each vector level (dtensor_quant._core.native.LEVEL_NAMES) and the CPU flags (as /proc/cpuinfo names them) it
#: adds to the one below; a build at a level may use all of them outside the run-time dispatched code.
LEVEL_FEATURES = {
    1: ("avx2", "fma"),
    2: ("avx512f", "avx512bw", "avx512vl"),
    3: ("avx512dq", "avx512_bf16"),
    4: ("amx_tile", "amx_bf16"),
}
# The compiler flags of the same features.
_LEVEL_FLAGS = {
    1: ("-mavx2", "-mfma"),
    2: ("-mavx512f", "-mavx512bw", "-mavx512vl"),
    3: ("-mavx512dq", "-mavx512bf16"),
    4: ("-mamx-tile", "-mamx-bf16"),
}
#: The name of each build level in the cache path.
LEVEL_TAGS = {0: "x86-64", 1: "avx2", 2: "avx512", 3: "avx512bf16", 4: "amx"}
# The optimization and floating-point flags inductor compiles its CPU kernels with (torch 2.13), in its order:
# the later -fno-unsafe-math-optimizations and -fmath-errno undo most of the earlier ones (signed zeros and
# trapping math kept), -ffp-contract=off keeps every rounding the source writes.
_FLAGS = (
    "-O3", "-DNDEBUG", "-fno-trapping-math", "-funsafe-math-optimizations", "-ffinite-math-only",
    "-fno-signed-zeros", "-fno-finite-math-only", "-fno-unsafe-math-optimizations", "-fmath-errno",
    "-ffp-contract=off", "-fexcess-precision=fast", "-fno-tree-loop-vectorize", "-fPIC", "-std=c++20",
    "-fopenmp", "-Wall", "-Wno-unused-variable", "-Wno-unknown-pragmas",
)  # fmt: skip


def cache_root() -> Path:
    """Where built kernels live: ``$DTENSOR_QUANT_CACHE``, else ``$XDG_CACHE_HOME/dtensor_quant/kernels``
    (``~/.cache/dtensor_quant/kernels``)."""
    if config.get("cache"):
        return Path(config.get("cache"))
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dtensor_quant" / "kernels"


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's flags as ``/proc/cpuinfo`` names them (empty where there is none: builds take plain x86-64)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def required_features(level: int) -> tuple[str, ...]:
    """The CPU flags a build at ``level`` may use."""
    return tuple(f for k in sorted(LEVEL_FEATURES) if k <= level for f in LEVEL_FEATURES[k])


def cpu_level() -> int:
    """The level builds take on this CPU: the highest whose flags (with those of the levels below) it has."""
    have = cpu_features()
    level = _LEVEL_OF.get(have)  # every kernel call asks: the flags' level, once per set of flags
    if level is None:
        level = 0
        while level + 1 in LEVEL_FEATURES and set(LEVEL_FEATURES[level + 1]) <= have:
            level += 1
        _LEVEL_OF[have] = level
    return level


_LEVEL_OF: dict[frozenset[str], int] = {}


_SIGNATURE = re.compile(r'^(?:extern "C"\s+)?void\s+kernel\s*\(([^)]*)\)\s*\{', re.MULTILINE)
_PARAMETER = re.compile(r"^((?:const\s+)?(?:u?int(?:8|16|32|64)_t|float|double|void)\s*\*|int64_t)\s*(\w+)$")


def parameters(text: str) -> list[tuple[str, str]]:
    """``[(C type, name)]`` of the ``void kernel(...)`` that ``text`` defines: a pointer (a tensor) or ``int64_t``,
    the last ``int64_t*`` (the level the kernel ran); a ValueError says what else it found."""
    found = _SIGNATURE.findall(text)
    if len(found) != 1:
        raise ValueError(f"a kernel source defines one `void kernel(...) {{`, found {len(found)}")
    params = []
    for part in found[0].split(","):
        match = _PARAMETER.match(" ".join(part.split()))
        if match is None:
            raise ValueError(f"kernel parameter {part.strip()!r}: expected a pointer (a tensor) or int64_t")
        params.append((re.sub(r"\s*\*", "*", match.group(1)), match.group(2)))
    if not params or params[-1][0] != "int64_t*":
        raise ValueError("a kernel's last parameter is `int64_t* level`, the vector level it ran")
    return params


def binding(module: str, params: list[tuple[str, str]]) -> str:
    """The C++ that makes ``kernel`` the function ``kernel`` of the extension module ``module`` (fast calls,
    arguments checked for count and type; a tensor's data pointer read through its ``data_ptr()``)."""
    args = []
    for i, (ctype, _) in enumerate(params):
        if ctype == "int64_t":
            args.append(f"    const int64_t dq_{i} = PyLong_AsLongLong(dq_args[{i}]);")
            args.append(f"    if (dq_{i} == -1 && PyErr_Occurred()) return nullptr;")
        else:
            args.append(f"    {ctype} dq_{i} = static_cast<{ctype}>(dq_data_ptr(dq_args[{i}]));")
            args.append(f"    if (!dq_{i} && PyErr_Occurred()) return nullptr;")
    names, call = ", ".join(name for _, name in params), ", ".join(f"dq_{i}" for i in range(len(params)))
    body = "\n".join(args)
    return f"""
// The Python binding, generated by dtensor_quant/_core/native_build.py from kernel's signature.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* dq_data_ptr_name;
static void* dq_data_ptr(PyObject* tensor) {{
    PyObject* p = PyObject_CallMethodNoArgs(tensor, dq_data_ptr_name);
    if (!p) return nullptr;
    void* v = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return v;
}}
static PyObject* dq_call(PyObject*, PyObject* const* dq_args, Py_ssize_t dq_n) {{
    if (dq_n != {len(params)}) {{
        PyErr_Format(PyExc_TypeError, "kernel({names}) takes {len(params)} arguments, got %zd", dq_n);
        return nullptr;
    }}
{body}
    kernel({call});
    Py_RETURN_NONE;
}}
static PyMethodDef dq_methods[] = {{{{"kernel", (PyCFunction)(void (*)(void))dq_call, METH_FASTCALL, ""}},
                                   {{nullptr, nullptr, 0, nullptr}}}};
static PyModuleDef dq_module = {{PyModuleDef_HEAD_INIT, "{module}", nullptr, -1, dq_methods}};
PyMODINIT_FUNC PyInit_{module}(void) {{
    dq_data_ptr_name = PyUnicode_InternFromString("data_ptr");
    return dq_data_ptr_name ? PyModule_Create(&dq_module) : nullptr;
}}
"""


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def command(src: Path, out: Path, level: int) -> list[str]:
    """The compiler call that builds ``src`` at ``level`` into the extension module ``out``."""
    include = sysconfig.get_paths()["include"]
    flags = [f for k in sorted(_LEVEL_FLAGS) if k <= level for f in _LEVEL_FLAGS[k]]
    return [compiler(), str(src), *_FLAGS, *flags, "-shared", f"-I{include}", "-o", str(out)]


def folder(level: int) -> Path:
    """The cache folder of builds at ``level`` for this torch and Python."""
    return cache_root() / f"torch-{torch.__version__}-{sys.implementation.cache_tag}-{LEVEL_TAGS[level]}"


def load(name: str, text: str, level: int, say=None):
    """The function ``kernel`` of ``text`` (a kernel's inlined source) built at ``level``: loaded from the cache,
    or built into it first (``say(line)`` told so). Raises a ValueError for a bad signature, a RuntimeError with
    the compiler's output for a failed build."""
    params = parameters(text)
    keyed = [text, binding("", params), compiler(), *command(Path(), Path(), level)]
    key = hashlib.sha256("\0".join(keyed).encode()).hexdigest()[:16]
    module = f"dq_{re.sub(r'[^0-9A-Za-z_]', '_', name)}_{key}"
    where = folder(level)
    so, record = where / f"{name}-{key}.so", where / f"{name}-{key}.json"
    if not _loadable(so, record, level):
        if say is not None:
            say(f"building {name} for {LEVEL_TAGS[level]}")
        _build(text + binding(module, params), so, record, level, name)
    loader = importlib.machinery.ExtensionFileLoader(module, str(so))
    spec = importlib.util.spec_from_file_location(module, so, loader=loader)
    return importlib.util.module_from_spec(spec).kernel, so


def _loadable(so: Path, record: Path, level: int) -> bool:
    """A binary is loaded only where its record says it was built at ``level`` with flags this CPU has."""
    try:
        built = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return so.is_file() and built.get("level") == level and set(built.get("features", ())) <= cpu_features()


def _build(text: str, so: Path, record: Path, level: int, name: str) -> None:
    so.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=so.parent, prefix=f".{name}-") as tmp:
        src, out = Path(tmp) / f"{name}.cpp", Path(tmp) / f"{name}.so"
        src.write_text(text)
        if shutil.which(compiler()) is None:
            raise RuntimeError(f"no C++ compiler: {compiler()!r} not found (set CXX)")
        done = subprocess.run(command(src, out, level), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler()} exited with {done.returncode}. Output:\n{done.stderr}{done.stdout}")
        facts = {
            "kernel": name,
            "level": level,
            "features": list(required_features(level)),
            "command": command(Path(f"{name}.cpp"), Path(so.name), level),
            "torch": torch.__version__,
            "python": sys.implementation.cache_tag,
        }
        (Path(tmp) / "record.json").write_text(json.dumps(facts, indent=1))
        os.replace(Path(tmp) / "record.json", record)  # the record first: a binary found always has its record
        os.replace(out, so)
