"""Check dtensor_quant's import structure: the layers in docs/architecture.md stay layers.

Fails (exit 1, one line per problem) on:

* a cycle among module-level imports inside the package;
* a function-level import that closes a cycle with the module-level graph
  (it climbs a layer), unless it is one of the documented late bindings in
  ``LATE_BINDINGS`` below;
* a private name (``_x``) imported from, or read off, another module of the package;
* a private name of the package imported or read by the code that uses it from
  outside (``OUTSIDE``: tests, benches, examples): ``from dtensor_quant.m import _x``,
  ``import dtensor_quant._m``, ``dq._x``, ``dq.m._x`` or ``m._x`` for a module
  ``m`` of the package. They use the public API, as users do; what they need
  of the internals is made public where it lives, with a docstring.

Run: ``python tools/check_imports.py`` (no torch import, a fraction of a second).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dtensor_quant"
# Folders of code that uses the package from outside: no private name of the package in them.
OUTSIDE = ("tests", "bench", "examples")

# (importer, imported): function-level imports that go up a layer on purpose, each with its reason.
# QuantizedTensor sits below the modules that implement its hooks; its methods bind them late.
LATE_BINDINGS = {
    ("dtensor_quant.tensor", "dtensor_quant.fsdp"): "the FSDP2 hooks FSDP2 looks up on the local tensor",
    ("dtensor_quant.tensor", "dtensor_quant.dequant"): "QuantizedTensor.dequantize(), the user-facing method",
    ("dtensor_quant.gather_quantized", "dtensor_quant.fsdp"): "the FSDP2 hooks of GatherQuantized",
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict[str, Path]):
    """Yield ``(importer, imported module, names, module_level, lineno)`` for every import in the package."""
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            level = id(node) in top
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(PACKAGE):
                        yield mod, a.name, [], level, node.lineno
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                if not target.startswith(PACKAGE):
                    continue
                plain = []
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:  # "from . import wire": the submodule itself
                        yield mod, sub, [], level, node.lineno
                    else:
                        plain.append(a.name)
                if plain:
                    yield mod, target, plain, level, node.lineno


def _module_aliases(tree: ast.Module, mod: str, is_pkg: bool, mods) -> dict[str, str]:
    """Local names bound to package modules (``from . import wire`` -> {"wire": "dtensor_quant.wire"})."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, is_pkg, node)
            for a in node.names:
                if f"{target}.{a.name}" in mods:
                    out[a.asname or a.name] = f"{target}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods and a.asname:
                    out[a.asname] = a.name
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None if the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def outside_problems(root: Path = ROOT) -> list[str]:
    """Private names of the package used by the files under ``OUTSIDE``."""
    mods = modules(root)
    problems = []
    for folder in OUTSIDE:
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root)
            tree = ast.parse(path.read_text(), str(path))
            bound: dict[str, str] = {}  # local name -> package module it is bound to
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] != PACKAGE:
                            continue
                        if any(_private(p) for p in a.name.split(".")):
                            problems.append(f"{where}:{node.lineno}: imports private module {a.name}")
                        if a.asname:
                            bound[a.asname] = a.name
                        else:
                            bound[PACKAGE] = PACKAGE  # "import dtensor_quant.m" binds dtensor_quant
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.split(".")[0] != PACKAGE:
                        continue
                    if any(_private(p) for p in node.module.split(".")):
                        problems.append(f"{where}:{node.lineno}: imports from private module {node.module}")
                    for a in node.names:
                        if _private(a.name):
                            problems.append(f"{where}:{node.lineno}: imports private {a.name} from {node.module}")
                        elif f"{node.module}.{a.name}" in mods:
                            bound[a.asname or a.name] = f"{node.module}.{a.name}"
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                    continue
                chain = _dotted(node.value)
                if chain and chain[0] in bound and ".".join([bound[chain[0]], *chain[1:]]) in mods:
                    problems.append(f"{where}:{node.lineno}: reads private {'.'.join(chain)}.{node.attr}")
    return problems


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _reaches(graph, src, dst) -> bool:
    seen, todo = set(), [src]
    while todo:
        n = todo.pop()
        if n == dst:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(graph.get(n, ()))
    return False


def check(root: Path = ROOT) -> list[str]:
    mods = modules(root)
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    late = []
    for mod, target, names, level, line in imports(mods):
        for name in names:
            if name.startswith("_") and not name.startswith("__") and target != mod:
                problems.append(f"{mods[mod].relative_to(root)}:{line}: imports private {name} from {target}")
        if target == mod or target == PACKAGE or target not in mods:
            continue
        if level:
            graph[mod].add(target)
        else:
            late.append((mod, target, line))
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = _module_aliases(tree, mod, path.name == "__init__.py", mods)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != mod
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                problems.append(f"{path.relative_to(root)}:{node.lineno}: reads private {node.value.id}.{node.attr}")
    cycle = _cycle(graph)
    if cycle:
        problems.append("module-level import cycle: " + " -> ".join(cycle))
    # Function-level imports count as edges too: two of them in opposite directions are a cycle as well.
    every = {m: set(ts) for m, ts in graph.items()}
    for mod, target, _ in late:
        if (mod, target) not in LATE_BINDINGS:
            every[mod].add(target)
    for mod, target, line in late:
        if (mod, target) not in LATE_BINDINGS and _reaches(every, target, mod):
            problems.append(
                f"{mods[mod].relative_to(root)}:{line}: function-level import of {target} climbs a layer "
                f"({target} imports {mod}, directly or not); move the shared code down or list it in LATE_BINDINGS"
            )
    unused = [k for k in LATE_BINDINGS if not any((m, t) == k for m, t, _ in late)]
    problems += [f"LATE_BINDINGS lists {a} -> {b}, which no longer imports late" for a, b in unused]
    return problems + outside_problems(root)


def layers(root: Path = ROOT) -> list[list[str]]:
    """The package's modules by layer: each imports (at module level) only modules of lower layers."""
    mods = modules(root)
    graph = {m: set() for m in mods}
    for mod, target, _, level, _ in imports(mods):
        if level and target in mods and target not in (mod, PACKAGE):
            graph[mod].add(target)
    depth: dict[str, int] = {}

    def d(m):
        if m not in depth:
            depth[m] = 0
            depth[m] = 1 + max((d(t) for t in graph[m]), default=-1)
        return depth[m]

    for m in mods:
        d(m)
    out: list[list[str]] = [[] for _ in range(max(depth.values()) + 1)]
    for m, k in depth.items():
        out[k].append(m.removeprefix(PACKAGE + ".") or PACKAGE)
    return [sorted(x) for x in out]


if __name__ == "__main__":
    if "--layers" in sys.argv:
        for i, names in enumerate(layers()):
            print(f"{i:2d}  {' '.join(names)}")
    found = check()
    for p in found:
        print(p)
    print(f"check_imports: {len(found)} problem(s)")
    sys.exit(1 if found else 0)
