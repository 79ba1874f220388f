"""The documentation cannot drift from the code (issue 64 item 5).

- The site (``mkdocs.yml``, ``docs/``) builds with ``mkdocs build --strict``: a broken link, a
  missing anchor, a page left out of the nav or an API name that no longer resolves fails it.
- The API reference (``docs/api.md``) documents exactly ``hpcfl.__all__``, each name where it is
  defined.
- Every fenced ``python`` block of the README and the guides runs as written, in a fresh process
  with ``$HPCFL_DATA`` set, unless an HTML comment ``<!-- notest: why -->`` stands right above it
  (a fragment of a file, shown and checked elsewhere).
- Every fenced ``yaml`` block is a config (or a fragment of one) that validates.
- Every ``hpcfl ...`` command the README and the guides show parses with the real command line
  (argument parsing only, nothing runs); a synopsis with placeholders (``hpcfl run CONFIG.yaml
  [--set k=v ...]``) names a real sub-command and only its real options; a config path it names
  exists.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, repo_env

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOTEST = re.compile(r"<!--\s*notest\b[^>]*-->\s*$")
_SPAN = re.compile(r"`([^`]+)`")
_SHELL_SEPARATORS = re.compile(r"&&|;|\|\|")
_LAUNCHERS = ("mpiexec", "mpirun", "srun")


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: its language, text and where it starts (for the test id)."""

    page: Path
    line: int
    lang: str
    text: str
    notest: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n")
        line = text.count("\n", 0, match.start()) + 1
        lang = match.group(1).strip().split(" ")[0]
        out.append(Block(page, line, lang, match.group(2), bool(_NOTEST.search(before))))
    return out


def _prose(page: Path) -> str:
    """A page without its fenced blocks (where inline code spans live)."""
    return _FENCE.sub("", page.read_text(encoding="utf-8"))


PYTHON_BLOCKS = [b for page in PAGES for b in _blocks(page) if b.lang == "python" and not b.notest]


def _hpcfl_argv(command: str) -> list[str] | None:
    """The arguments after ``hpcfl`` in one shell command (``mpiexec -n 2 hpcfl run ...``,
    ``X=1 .venv/bin/hpcfl compare``), or None when the command does not run hpcfl."""
    tokens = shlex.split(command, comments=True)
    for i, token in enumerate(tokens):
        if token == "hpcfl" or token.endswith("/hpcfl"):
            return tokens[i + 1 :]
        # before hpcfl only environment settings and a launcher with its options
        if not (i == 0 and token in _LAUNCHERS or "=" in token or i > 0 and tokens[0] in _LAUNCHERS):
            return None
    return None


def _shell_commands(block: Block) -> list[str]:
    """The commands of a shell block: continuations joined, ``&&``/``;`` chains split."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [c for line in joined.splitlines() for c in _SHELL_SEPARATORS.split(line) if c.strip()]


def _unbracket(span: str) -> str:
    """A synopsis's words without its brackets and choice bars (``[--resume\\|--overwrite]``)."""
    return re.sub(r"\\?\||\[|\]", " ", span)


def _commands() -> list[tuple[str, str, bool]]:
    """(where, command, is_synopsis) for every hpcfl command the pages show: a shell block's lines
    are commands, an inline code span in the text is a synopsis (it may name an option alone:
    "``hpcfl sweep --search`` chooses ...")."""
    found = []
    for page in PAGES:
        for block in _blocks(page):
            if block.lang in ("", "bash", "sh", "console", "shell"):
                found += [(block.where, c.strip(), False) for c in _shell_commands(block)]
        for span in _SPAN.findall(_prose(page)):
            span = " ".join(span.split())
            if re.match(r"(?:mpiexec|srun)\b.*\bhpcfl |hpcfl [a-z]", span):
                found.append((str(page.relative_to(REPO)), _unbracket(span), True))
    return [(w, c, s) for w, c, s in found if _hpcfl_argv(c) is not None]


COMMANDS = _commands()


def _parser() -> argparse.ArgumentParser:
    from hpcfl.cli.main import build_parser

    return build_parser()


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub-)sub-command parser ``argv`` selects and the arguments left for it."""
    while argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or argv[0] not in subs[0].choices:
            break
        parser, argv = subs[0].choices[argv[0]], argv[1:]
    return parser, argv


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs tools are not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs tools are not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=REPO,
        env=repo_env(NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # every guide is a page, the API reference holds the docstrings, the figures come along
    for page in DOCS.glob("*.md"):
        stem = page.stem
        assert (site / ("index.html" if stem == "index" else f"{stem}/index.html")).is_file(), stem
    api = (site / "api/index.html").read_text(encoding="utf-8")
    from hpcfl.runner.experiment import run_experiment

    first_line = run_experiment.__doc__.strip().splitlines()[0]
    assert "run_experiment" in api and first_line.split("`")[0].strip()[:40] in api
    for figure in re.findall(
        r"\]\(\.\./(benchmarks/results/[^)]+\.png)\)", (DOCS / "figures.md").read_text()
    ):
        assert (site / figure).read_bytes() == (REPO / figure).read_bytes(), figure
    assert (site / "benchmarks/index.html").is_file()  # benchmarks/README.md, published as it is


def test_the_api_reference_documents_exactly_the_public_names() -> None:
    import importlib

    import hpcfl

    idents = re.findall(r"^::: ([\w.]+)$", (DOCS / "api.md").read_text(), flags=re.MULTILINE)
    documented = {}
    for ident in idents:
        module, _, name = ident.rpartition(".")
        try:
            documented[name] = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError:  # a class's method or a module's attribute one level down
            owner, _, attr = module.rpartition(".")
            documented[name] = getattr(getattr(importlib.import_module(owner), attr), name)
    assert sorted(documented) == sorted(n for n in hpcfl.__all__ if n != "__version__")
    for name, obj in documented.items():
        assert obj is getattr(hpcfl, name), name


def test_the_pages_show_runnable_examples() -> None:
    """The collection below is not empty by accident (a changed fence syntax would skip them all)."""
    assert {b.page.name for b in PYTHON_BLOCKS} >= {"README.md", "runs.md", "plugins.md"}
    assert len(COMMANDS) >= 20 and any(not synopsis for _, _, synopsis in COMMANDS)
    assert {b.page.name for b in YAML_BLOCKS} >= {"runs.md", "privacy.md", "async.md", "heterogeneity.md"}


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_block_runs(block: Block, tmp_path: Path, data_root: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.text, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=repo_env(HPCFL_DATA=str(data_root)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{block.where}:\n{proc.stderr[-3000:]}"


# a small federation under each YAML example: the example's keys replace these
_CONFIG_BASE = {
    "dataset": "synthetic",
    "num_clients": 200,
    "model": "mlp",
    "algorithm": "fedavg",
    "rounds": 1,
}
YAML_BLOCKS = [b for page in PAGES for b in _blocks(page) if b.lang == "yaml" and not b.notest]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=lambda b: b.where)
def test_yaml_block_is_a_valid_config(block: Block) -> None:
    """Every config example validates (keys, sections, values) over a small base: a renamed or
    removed key in a guide fails here."""
    import yaml

    from hpcfl.config import config_from_dict

    keys = yaml.safe_load(block.text)
    assert isinstance(keys, dict) and keys, block.where
    cfg = config_from_dict({**_CONFIG_BASE, **keys})
    for key, value in keys.items():
        if not isinstance(value, dict):
            assert getattr(cfg, key) == value or value is None, f"{block.where}: {key}"


@pytest.mark.parametrize(("where", "command", "synopsis"), COMMANDS, ids=lambda v: str(v)[:60])
def test_hpcfl_command_parses(where: str, command: str, synopsis: bool) -> None:
    parser = _parser()
    if synopsis:
        argv = _hpcfl_argv(command)
        assert argv is not None
        sub, rest = _subparser(parser, argv)
        assert sub is not parser, f"{where}: {command!r} names no hpcfl sub-command"
        known = set(sub._option_string_actions)
        for token in rest:
            option = token.split("=", 1)[0]
            if option.startswith("-") and option not in ("-", "--"):
                assert option in known, f"{where}: {command!r}: hpcfl {sub.prog.split()[-1]} has no {option}"
        _check_config_paths(where, command, rest)
        return
    argv = _hpcfl_argv(command)
    assert argv is not None
    sub, rest = _subparser(parser, argv)
    if sub is not parser and not rest:  # a bare sub-command named in the text ("hpcfl report")
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: {command!r} does not parse (exit {exc.code}): {err.getvalue().strip()}")
    assert getattr(args, "func", None) is not None, f"{where}: {command!r} selects no command"
    _check_config_paths(where, command, argv)


def _check_config_paths(where: str, command: str, argv: list[str]) -> None:
    """A config path a command names (``configs/x.yaml``) exists in the repository."""
    for token in argv:
        if token.startswith("configs/") and token.endswith(".yaml"):
            assert (REPO / token).is_file(), f"{where}: {command!r}: {token} does not exist"
