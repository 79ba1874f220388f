"""``hpcfl list``: the registered names, and ``hpcfl list --schema ALGORITHM``: every config key
with its default.

The names come from :mod:`hpcfl.registry` without importing any algorithm, model or dataset: the
built-ins, the names of installed plugins' entry points (with their distribution) and those
registered in this process (``--imports MODULE``: a plugin registered by a module, as a config's
``imports:`` names it). The schema is :class:`hpcfl.config.Config`'s defaults with ``params``
those of the algorithm, printed as YAML a config file can start from (each key's comment is the one
beside its field in ``hpcfl/config.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from collections.abc import Sequence
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``list`` sub-command."""
    p = sub.add_parser(
        "list",
        help="the registered algorithms, models and datasets; --schema ALGO: the config keys and defaults",
        description=(
            "List the algorithms, models and datasets a config may name: built in, from an installed "
            "plugin (entry points; its distribution is shown) or registered in this process. With "
            "--schema ALGORITHM: every config key with its default, params those of ALGORITHM, as YAML "
            "a config file can start from."
        ),
        epilog="examples: hpcfl list; hpcfl list --schema fedprox > my_run.yaml",
    )
    p.add_argument("--schema", metavar="ALGORITHM", help="print the config keys and defaults for ALGORITHM")
    p.add_argument(
        "--imports",
        nargs="+",
        metavar="MODULE",
        default=[],
        help="import these modules first, as a config's imports: does (plugins they register are listed)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the names, or the schema of one algorithm's config (after the ``--imports``)."""
    from hpcfl.registry import import_modules

    import_modules(args.imports, key="--imports")
    print(schema_yaml(args.schema, args.imports) if args.schema is not None else names_text(), end="")
    return 0


def names_text() -> str:
    """One block per kind: each name with where it comes from."""
    from hpcfl.registry import ALGORITHMS, DATASET_SPECS, MODEL_SPECS

    blocks = []
    for title, registry in (("algorithms", ALGORITHMS), ("models", MODEL_SPECS), ("datasets", DATASET_SPECS)):
        builtins, plugins = set(registry.builtin_names()), registry.plugins()
        lines = [f"{title}:"]
        for name in registry:
            if name in builtins:
                origin = "built in"
            elif name in plugins:
                dist = getattr(plugins[name], "dist", None)
                origin = f"plugin, distribution {dist.name if dist is not None else '?'}"
            else:
                origin = "registered in this process"
            lines.append(f"  {name:<16} {origin}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks) + "\n"


def schema_yaml(algorithm: str, imports: Sequence[str] = ()) -> str:
    """The default config of a run of ``algorithm``, as commented YAML (a one-line error for an
    unknown name); ``imports``: the modules imported to register it, kept in the config's
    ``imports:`` so that the printed file runs as it is."""
    import yaml

    from hpcfl.config import Config
    from hpcfl.errors import ConfigError, unknown
    from hpcfl.registry import ALGORITHMS

    if algorithm not in ALGORITHMS:
        err = unknown("algorithm", algorithm, ALGORITHMS)
        if imports:
            raise err
        raise ConfigError(f"{err} (a plugin registered by a module: --imports MODULE)") from None
    values = Config(algorithm=algorithm, imports=list(imports)).to_dict()
    comments = _field_comments(Config)
    lines = [f"# hpcfl config keys with their defaults; params: those of {algorithm}"]
    for key, value in values.items():
        text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False).rstrip("\n")
        first, *rest = text.splitlines()
        if key in comments:
            first = f"{first:<40} # {comments[key]}"
        lines += [first, *rest]
    return "\n".join(lines) + "\n"


def _field_comments(cls: type) -> dict[str, str]:
    """``{field: the comment on its line}`` of a dataclass's source (the fields without one omitted)."""
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, Any] = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+): [^#]*#\s*(.+)$", line)
        if match and match.group(1) in names:
            found[match.group(1)] = match.group(2).strip()
    return found
