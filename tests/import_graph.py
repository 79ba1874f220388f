"""The import graph of the ``hpcfl`` package, read from the source (no module is imported).

Every ``import`` and ``from ... import`` counts, at module level or inside a function, except those
under ``if TYPE_CHECKING:`` (never executed, annotation-only). An edge goes to the module named, or
to the submodule when ``from package import name`` names one, and to every package above the target
that the importer is not inside (importing ``hpcfl.algorithms.base`` runs
``hpcfl/algorithms/__init__.py``). Modules named by string count too: a ``"package.module:function"``
hook, a string that is a module's full name (``lazy_exports`` tables) and an f-string whose fixed
start is ``"hpcfl.<package>."`` (an edge to that package); a logger's name is not a module. The registry's built-in tables are the one
place meant to name modules by string, loaded when a name is looked up, never on import:
:func:`registry_edges` lists them apart, and :func:`graph` leaves them out. Counted as edges they
close one loop (the registry names the algorithms, models and stage code, which import the
registry); :func:`registry_loop` measures it, so that it cannot grow unseen.

Used by ``tests/test_layers.py`` and to measure the layers (``python tests/import_graph.py``).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: the layers of DESIGN.md ("Layers"), top first; a module's layer is that of its longest prefix
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hpcfl.cli", "hpcfl.__main__", "hpcfl"),
    ("hpcfl.sweep", "hpcfl.launch", "hpcfl.report", "hpcfl.bench"),
    ("hpcfl.runner",),
    ("hpcfl.tct", "hpcfl.ntk.stage"),  # stage code
    ("hpcfl.privacy",),  # wraps an algorithm and the trainer (its config section sits at the bottom)
    ("hpcfl.config",),
    ("hpcfl.algorithms",),
    (
        "hpcfl.metrics",
        "hpcfl.entk",
        "hpcfl.features",
        "hpcfl.training",
        "hpcfl.data",
        "hpcfl.models",
        "hpcfl.comm",
        "hpcfl.ntk",  # the kernel evolution and memory model NTK-FL computes with
    ),
    (
        "hpcfl.registry",
        "hpcfl.files",
        "hpcfl.errors",
        "hpcfl.units",
        "hpcfl.cpuinfo",
        "hpcfl.privacy.section",
    ),
)

#: the one module whose string-named modules are late-bound lookups, not imports (see the docstring)
REGISTRY = "hpcfl.registry"

#: stage code: it depends on the contract (hpcfl.algorithms.stage_types), never on the runner
STAGE_CODE = ("hpcfl.tct", "hpcfl.ntk")


def modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name → source file, for every module of the package."""
    out = {}
    for path in sorted((root / "hpcfl").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(x) for stmt in node.body for x in ast.walk(stmt)}
    return skip


_HOOK = re.compile(r"(hpcfl(?:\.\w+)+):(\w+)")


def _string_targets(tree: ast.AST, mods: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module, attribute or None) for each module the source names by string (docstrings aside)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    not_modules = {  # logging.getLogger("hpcfl.runner") names a logger, not a module
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("getLogger") and node.args
    }
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):  # a loader call ("module", "attribute", ...) names the attribute too
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            module, attr = node.args[0], node.args[1]
            if isinstance(module, ast.Constant) and module.value in mods and isinstance(attr, ast.Constant):
                found.append((str(module.value), str(attr.value)))
                not_modules.add(id(module))
    for node in ast.walk(tree):
        if id(node) in docstrings | not_modules:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            hook = _HOOK.fullmatch(node.value)
            if hook and hook.group(1) in mods:
                found.append((hook.group(1), hook.group(2)))
            elif node.value in mods and node.value != "hpcfl":
                found.append((node.value, None))
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
            if head.startswith("hpcfl.") and head.endswith(".") and head[:-1] in mods:
                found.append((head[:-1], None))
    return found


def _import_targets(node: ast.AST, name: str, package: list[str], mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return []


def _with_packages(name: str, target: str, mods: dict[str, Path]) -> set[str]:
    """``target`` and the packages above it that importing it runs and ``name`` is not inside."""
    parts = target.split(".")
    above = {".".join(parts[:i]) for i in range(2, len(parts))}
    return {target} | {p for p in above if p in mods and not (name == p or name.startswith(p + "."))}


def _edges(root: Path) -> tuple[dict[str, set[str]], dict[str, set[tuple[str, str | None]]]]:
    """(imports, string-named modules) of every module: fresh copies of :func:`_read`'s."""
    edges, named = _read(root)
    return {m: set(t) for m, t in edges.items()}, {m: set(t) for m, t in named.items()}


@functools.lru_cache(maxsize=4)  # every test of tests/test_layers.py reads the same tree: parse it once
def _read(root: Path) -> tuple[dict[str, set[str]], dict[str, set[tuple[str, str | None]]]]:
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    named: dict[str, set[tuple[str, str | None]]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for target in _import_targets(node, name, package, mods):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name] |= _with_packages(name, target, mods)
        named[name] = {(m, a) for m, a in _string_targets(tree, mods) if m != name}
        if name != REGISTRY:
            for target, _ in named[name]:
                edges[name] |= _with_packages(name, target, mods)
    return edges, named


def graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module → the package modules it imports (anywhere in its body, by ``import`` or by a string
    naming the module), the registry's late-bound tables aside."""
    return _edges(root)[0]


def string_named(root: Path = REPO) -> dict[str, set[tuple[str, str | None]]]:
    """Module → the (module, attribute or None) it names by string, the registry's included."""
    return _edges(root)[1]


def registry_edges(root: Path = REPO) -> set[tuple[str, str | None]]:
    """The (module, attribute) the registry's built-in tables name, loaded on lookup."""
    return string_named(root)[REGISTRY]


def registry_loop(root: Path = REPO) -> list[str]:
    """The modules (sorted) of the import loop through the registry when its late-bound lookups
    count as edges (with the packages a lookup's import runs); empty when there is none."""
    mods = modules(root)
    edges, named = _edges(root)
    for target, _ in named[REGISTRY]:
        edges[REGISTRY] |= _with_packages(REGISTRY, target, mods)
    return next((c for c in cycles(edges) if REGISTRY in c), [])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def layer(module: str) -> int:
    """0 for the top layer (cli), larger further down; the longest matching prefix decides, and a
    module no layer names (a new top-level helper such as ``hpcfl.chunks``) is in the bottom one."""
    best, depth = -1, len(LAYERS) - 1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            below = module.startswith(prefix + ".") and prefix != "hpcfl"  # the package itself: only itself
            if (module == prefix or below) and len(prefix) > best:
                best, depth = len(prefix), i
    return depth


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one (against DESIGN.md's arrows). A package that
    imports nothing (``hpcfl/privacy/__init__.py``, a docstring) carries nothing up, so reaching
    it on the way to a lower submodule (``hpcfl.privacy.section``) is not one."""
    return sorted(
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if layer(b) < layer(a) and (edges.get(b) or not _is_package(b, edges))
    )


def _is_package(module: str, edges: dict[str, set[str]]) -> bool:
    return any(other.startswith(module + ".") for other in edges)


if __name__ == "__main__":  # python tests/import_graph.py [REPO_ROOT]
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    g = graph(root)
    up = upward(g)
    late = registry_edges(root)
    loop = registry_loop(root)
    print(
        f"modules {len(g)}, imports {sum(map(len, g.values()))}, cycles {len(cycles(g))}, upward {len(up)}, "
        f"registry lookups {len(late)}, registry loop {len(loop)} modules"
    )
    for component in cycles(g):
        print("cycle:", " ".join(component))
    for a, b in up:
        print(f"upward: {a} -> {b}")
    print("registry loop:", " ".join(loop))
