"""Check dtensor_quant's import structure: the layer table below is the architecture, enforced.

The package is a stack of layers, each a folder (``LAYERS``, bottom first).
A module may import modules of its own layer or of the layers below it,
never above. Fails (exit 1, one line per problem) on:

* an import, at module level or inside a function, that climbs the table
  (unless it is listed in ``LATE_BINDINGS`` with its reason: today none is);
* an import circle, through module-level and function-level imports alike;
* a module of the package that the table does not place;
* a private name (``_x``) imported from, or read off, another module of the package;
* a module outside ``_formats/`` (and the public front, which re-exports them) that names a format class
  (docs/architecture.md: a format declares what others need of it), unless ``FORMAT_NAMING`` lists it with
  its reason;
* a write into another module of the package (``m.NAME = ...``, ``setattr(m, ...)``): code a lower
  layer needs from above is a slot of ``_core/registry.py``, provided on import;
* a private name of the package imported or read by the code that uses it from
  outside (``OUTSIDE``: tests, benches, examples): ``from dtensor_quant.m import _x``,
  ``import dtensor_quant._m``, ``dq._x``, ``dq.m._x`` or ``m._x`` for a module
  ``m`` of the package. They use the public API, as users do; what they need
  of the internals is made public where it lives, with a docstring.

``python tools/check_imports.py --diagram`` prints the layer diagram that
docs/architecture.md shows (a test keeps the two equal). No torch import: a
fraction of a second.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dtensor_quant"
# Folders of code that uses the package from outside: no private name (``_x``) of the package in them.
OUTSIDE = ("tests", "bench", "examples")
# Of those, the ones that may import the private modules themselves (``dtensor_quant._core.layout``): the tests
# and the benches look inside; the examples use only the public front, as users do.
INSIDE_VIEW = ("tests", "bench")
#: The public front besides the root module: packages (``__init__`` files over private modules) and modules.
PUBLIC = (
    "fsdp",
    "checkpoint",
    "hf",
    "optim",
    "lora",
    "planner",
    "training",
    "torchtitan",
    "config",
    "wire",
    "interop",
    "ops",
)

#: The layers, bottom first: (folder or root module of the package, what it holds). A module imports only
#: modules of its own layer or of lower ones. The package root (``__init__``, ``__main__``, ``_compat``) is
#: the public API over everything; ``testing`` (the conformance kit and the rank pool) sits on top of it.
LAYERS = [
    ("_core", "the data model: relations, the format protocol, QuantizedTensor and its op table, the settings"),
    ("_formats", "the built-in formats: each one's layout, math and kernel"),
    ("_ops", "local ops derived from the layout: slicing, views, copies and writes, matmul, dense values"),
    ("_parallel", "across ranks: placements, collectives on stored bytes, sharded quantize, custom ops"),
    ("_training", "trainable quantized weights: the link (seed, step, shard), pointwise and fused optimizer rules"),
    ("_fsdp", "FSDP2: all-gather hooks, fully_shard checks, GatherQuantized, the post-forward reshard"),
    ("_checkpoint", "DCP entries and save/load; Hugging Face directories"),
    ("_model", "whole models: quantize_, LoRA, TP plans and padding, the mesh planner (planner/)"),
    ("_optim", "optimizers whose states are quantized tensors (AdamW8bit, AdamW4bit)"),
    ("_frameworks", "training frameworks' extension points (torchtitan): converters, optimizers, checkpoints"),
    ("", "the public front: __init__, __main__ (the CLI), " + ", ".join(sorted(PUBLIC))),
    ("testing", "the conformance kit and the rank pool"),
]

# (importer, imported): imports that climb the table on purpose, each with its reason. Implementations
# that the tensor needs from above register themselves instead (core.dispatch.implements_method).
LATE_BINDINGS: dict[tuple[str, str], str] = {}


def layer_of(mod: str) -> int | None:
    """The index in ``LAYERS`` of a module of the package (None if the table does not place it)."""
    rest = mod.removeprefix(PACKAGE).lstrip(".")
    head = rest.split(".")[0] if rest else ""
    names = [name for name, _ in LAYERS]
    if head in names:
        return names.index(head)
    return names.index("") if head in ("", "__main__", *PUBLIC) else None


def diagram() -> str:
    """The layer diagram of docs/architecture.md, top first, made from ``LAYERS``."""
    width = max(len(f"{PACKAGE}/{name}/" if name else f"{PACKAGE}/") for name, _ in LAYERS)
    lines = []
    for i, (name, what) in enumerate(reversed(LAYERS)):
        label = f"{PACKAGE}/{name}/" if name else f"{PACKAGE}/ (root)"
        lines.append(f"{label:<{width + 7}} {what}")
        if i < len(LAYERS) - 1:
            lines.append(f"{'':<4}│ imports only what is below")
    return "\n".join(["```", *lines, "```"])


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
        inside = folder in INSIDE_VIEW
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root)
            tree = ast.parse(path.read_text(), str(path))
            bound: dict[str, str] = {}  # local name -> package module it is bound to
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] != PACKAGE:
                            continue
                        if not inside and any(_private(p) for p in a.name.split(".")):
                            problems.append(f"{where}:{node.lineno}: imports private module {a.name}")
                        if a.asname:
                            bound[a.asname] = a.name
                        else:
                            bound[PACKAGE] = PACKAGE  # "import dtensor_quant.m" binds dtensor_quant
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.split(".")[0] != PACKAGE:
                        continue
                    if not inside and any(_private(p) for p in node.module.split(".")):
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
                full = ".".join([bound[chain[0]], *chain[1:]]) if chain and chain[0] in bound else None
                if inside and full and f"{full}.{node.attr}" in mods:  # a private module, read as an attribute
                    continue
                if full and full in mods:
                    problems.append(f"{where}:{node.lineno}: reads private {'.'.join(chain)}.{node.attr}")
    return problems


def _assignments_into(tree: ast.Module, aliases: dict[str, str], mod: str, where: Path) -> list[str]:
    """Writes into another module's globals (``arithmetic.TRAINABLE = f``, ``setattr(m, ...)``): a module
    reaches code above it through ``_core/registry.py`` (``declare`` below, ``@provides`` above) instead."""
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                target = aliases.get(t.value.id)
                if target is not None and target != mod:
                    out.append(
                        f"{where}:{node.lineno}: writes {t.value.id}.{t.attr} into module {target}; declare a slot "
                        "there and provide it (dtensor_quant/_core/registry.py)"
                    )
    return out


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


#: Modules outside ``_formats/`` that name format classes, each with its reason. The public front (the root and
#: its facades) re-exports them and is not listed. Every other module asks a format what it declares.
FORMAT_NAMING: dict[str, str] = {
    "dtensor_quant._model.interop": "torchao interop: maps torchao's configs and tensors to the formats holding them",
    "dtensor_quant._optim": "re-exports AdamW8bit/AdamW4bit, whose moments' formats (BlockFloat8, BlockLog4) are "
    "the optimizers' own choice",
    "dtensor_quant._optim.adamw": "AdamW8bit and AdamW4bit keep their moments in BlockFloat8 and BlockLog4, by design",
    "dtensor_quant.testing.registry": "the conformance kit's cases: every built-in format, by name",
}
#: Bases that make a class of ``_formats/`` a format (with the format classes found, and their mixins).
_FORMAT_BASES = {"QuantFormat", "FlatBlockedFormat"}


def format_classes(mods: dict[str, Path]) -> set[str]:
    """The public names of the classes in ``_formats/`` that derive from a format base, however indirectly."""
    defs = []
    for mod, path in mods.items():
        if mod == f"{PACKAGE}._formats" or mod.startswith(f"{PACKAGE}._formats."):
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef):
                    defs.append((node.name, {d[-1] for d in map(_dotted, node.bases) if d}))
    found, bases = set(), set(_FORMAT_BASES)
    while True:
        new = {name for name, b in defs if b & bases and name not in found}
        if not new:
            return {name for name in found if not _private(name)}
        found |= new
        bases |= new


def format_naming_problems(mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    """A module outside ``_formats/`` and the public front that names a format class, or a stale exception."""
    names, problems = format_classes(mods), []
    for mod, path in mods.items():
        layer = layer_of(mod)
        if layer is None or LAYERS[layer][0] in ("", "_formats"):
            continue
        hits = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            found += [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) else []
            for name in found:
                if name in names:
                    hits.setdefault(name, node.lineno)
        if hits and mod not in FORMAT_NAMING:
            first = min(hits, key=hits.get)
            problems.append(
                f"{path.relative_to(root)}:{hits[first]}: names format {', '.join(sorted(hits))} outside _formats/; "
                "let the format declare what this module needs of it (e.g. producer_layout), or list the module "
                "in FORMAT_NAMING (tools/check_imports.py) with its reason"
            )
        elif not hits and mod in FORMAT_NAMING:
            problems.append(f"FORMAT_NAMING lists {mod}, which names no format any more: remove it")
    return problems


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
    every: dict[str, set[str]] = {m: set() for m in mods}
    for mod in mods:
        if layer_of(mod) is None:
            problems.append(
                f"{mods[mod].relative_to(root)}: module {mod} is in no layer of LAYERS (tools/check_imports.py)"
            )
    for mod, target, names, level, line in imports(mods):
        for name in names:
            if name.startswith("_") and not name.startswith("__") and target != mod:
                problems.append(f"{mods[mod].relative_to(root)}:{line}: imports private {name} from {target}")
        if target == mod or target == PACKAGE or target not in mods:
            continue
        if (mod, target) in LATE_BINDINGS:
            continue
        every[mod].add(target)
        here, there = layer_of(mod), layer_of(target)
        if here is not None and there is not None and there > here:
            kind = "module-level" if level else "function-level"
            problems.append(
                f"{mods[mod].relative_to(root)}:{line}: {kind} import of {target} climbs from layer "
                f"'{LAYERS[here][0] or 'root'}' to '{LAYERS[there][0] or 'root'}' (tools/check_imports.py LAYERS); "
                "move the shared code down, or let the upper layer register it"
            )
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
        problems += _assignments_into(tree, aliases, mod, path.relative_to(root))
    # A package's __init__ that imports its own submodules is no circle: the submodule's import of the
    # package runs first. Every other pair of modules that import each other, directly or not, is one.
    graph = {
        m: {t for t in ts if not (mods[m].name == "__init__.py" and t.startswith(m + "."))} for m, ts in every.items()
    }
    graph = {
        m: {t for t in ts if not (mods[t].name == "__init__.py" and m.startswith(t + "."))} for m, ts in graph.items()
    }
    cycle = _cycle(graph)
    if cycle:
        problems.append("import circle (module- and function-level imports): " + " -> ".join(cycle))
    unused = [k for k in LATE_BINDINGS if not any(k == (m, t) for m, t, *_ in imports(mods))]
    problems += [f"LATE_BINDINGS lists {a} -> {b}, which no longer imports it" for a, b in unused]
    problems += format_naming_problems(mods, root)
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
    if "--diagram" in sys.argv:
        print(diagram())
        sys.exit(0)
    if "--layers" in sys.argv:
        for i, names in enumerate(layers()):
            print(f"{i:2d}  {' '.join(names)}")
    found = check()
    for p in found:
        print(p)
    print(f"check_imports: {len(found)} problem(s)")
    sys.exit(1 if found else 0)
