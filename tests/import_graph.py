"""The import graph of the ``hpcfl`` package, read from the source (no module is imported).

Every ``import`` and ``from ... import`` counts, at module level or inside a function, except those
under ``if TYPE_CHECKING:`` (never executed). An edge goes to the module named, or to the
submodule when ``from package import name`` names one. Used by ``tests/test_layers.py`` and to
measure the layers (``python tests/import_graph.py``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: the layers of DESIGN.md ("Layers"), top first; a module's layer is that of its longest prefix
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hpcfl.cli", "hpcfl.__main__", "hpcfl"),
    ("hpcfl.sweep", "hpcfl.launch", "hpcfl.report", "hpcfl.bench"),
    ("hpcfl.runner",),
    ("hpcfl.tct", "hpcfl.ntk.stage"),  # stage code
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
    ("hpcfl.registry", "hpcfl.files", "hpcfl.errors", "hpcfl.units"),
)


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


def graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module → the package modules it imports (anywhere in its body)."""
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


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
    """Imports from a lower layer to a higher one (against DESIGN.md's arrows)."""
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer(b) < layer(a))


if __name__ == "__main__":  # python tests/import_graph.py [REPO_ROOT]
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    g = graph(root)
    up = upward(g)
    print(f"modules {len(g)}, imports {sum(map(len, g.values()))}, cycles {len(cycles(g))}, upward {len(up)}")
    for component in cycles(g):
        print("cycle:", " ".join(component))
    for a, b in up:
        print(f"upward: {a} -> {b}")
