"""Tensor factories without ``device=``, read from the source (no module is imported).

DESIGN.md ("Devices"): every tensor takes its device from the data it works with (``*_like``,
``new_*``, ``device=x.device``); deliberate host work (seeded generators, index and accountant
bookkeeping, data loading) says so where it is made. A call of a factory below (``torch.zeros(...)``,
``torch.tensor(...)``, ``torch.randperm(...)``, ...) with no ``device=`` keyword makes a CPU tensor
whatever device the run uses, so it must carry a marker comment ``# host: <why>`` on one of the
lines of its statement (or of the call itself), or on a comment line right above the statement. ``*_like`` and ``new_*`` inherit the device and are
not checked. Used by ``tests/test_device_discipline.py``; ``python tests/device_discipline.py``
lists the offenders.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: torch functions that make a tensor on the default device (the CPU) unless given ``device=``
FACTORIES = frozenset(
    {
        "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange",
        "linspace", "logspace", "eye", "tensor", "as_tensor", "asarray", "empty_strided",
        "scalar_tensor", "from_numpy", "frombuffer", "tril_indices", "triu_indices", "normal",
        "sparse_coo_tensor",
    }
)  # fmt: skip
#: ``torch.normal(mean, std)`` / ``torch.as_tensor(t)`` / ``torch.asarray(t)`` with a tensor take its
#: device; only a call whose first argument is a literal or a list makes a new CPU tensor
_MAYBE_FROM_TENSOR = frozenset({"normal", "as_tensor", "asarray"})
#: the marker: ``# host: <reason>`` (a reason is required)
MARKER = re.compile(r"#\s*host:\s*\S")


def _is_torch_factory(call: ast.Call, torch_names: set[str], imported: dict[str, str]) -> str | None:
    """The factory's name when ``call`` is ``torch.NAME(...)`` (or an imported ``NAME(...)``)."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in torch_names:
        return f.attr if f.attr in FACTORIES else None
    if isinstance(f, ast.Name) and f.id in imported:
        return imported[f.id]
    return None


def _literal_first_arg(call: ast.Call) -> bool:
    if not call.args:
        return False
    first = call.args[0]
    return isinstance(first, ast.Constant | ast.List | ast.Tuple | ast.ListComp)


def offenders(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """``(line, code)`` of every unmarked factory call without ``device=`` in one file."""
    text = source if source is not None else path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    torch_names = {"torch"}
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname for a in node.names if a.name == "torch" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            imported |= {a.asname or a.name: a.name for a in node.names if a.name in FACTORIES}
    statements = {}  # id(call) -> (first line, last line) of the innermost enclosing statement
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt):
            span = (stmt.lineno, stmt.end_lineno or stmt.lineno)
            # a compound statement (def, for, with, if) spans its body: only its header counts
            body = getattr(stmt, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                span = (stmt.lineno, body[0].lineno - 1)
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call):
                    statements[id(node)] = span  # inner statements come later in ast.walk: they win
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _is_torch_factory(node, torch_names, imported)
        if name is None or any(k.arg == "device" for k in node.keywords):
            continue
        if any(k.arg is None for k in node.keywords):  # **kwargs may carry device=
            continue
        if name in _MAYBE_FROM_TENSOR and not _literal_first_arg(node):
            continue
        first, last = statements.get(id(node), (node.lineno, node.end_lineno or node.lineno))
        first, last = min(first, node.lineno), max(last, node.end_lineno or node.lineno)
        if any(MARKER.search(lines[i - 1]) for i in range(first, last + 1)):
            continue
        above = lines[first - 2].strip() if first >= 2 else ""
        if above.startswith("#") and MARKER.search(above):  # a comment line right above the statement
            continue
        found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


@functools.lru_cache(maxsize=4)
def package_offenders(root: Path = REPO) -> tuple[str, ...]:
    """``path:line: code`` for every offender under ``root/hpcfl``."""
    out = []
    for path in sorted((root / "hpcfl").rglob("*.py")):
        for line, code in offenders(path):
            out.append(f"{path.relative_to(root)}:{line}: {code}")
    return tuple(out)


if __name__ == "__main__":  # python tests/device_discipline.py [REPO_ROOT]
    found = package_offenders(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    print("\n".join(found))
    print(f"{len(found)} factory calls without device= and without a '# host: why' marker")
