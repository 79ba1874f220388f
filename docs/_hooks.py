"""MkDocs hooks: the site shows repository files that live outside ``docs/`` without copying them.

A page links a repository file by its path from ``docs/`` (``![...](../benchmarks/results/x.png)``,
``[...](../benchmarks/README.md)``), which is also what GitHub resolves when it renders the page.
MkDocs only serves files under ``docs/``, so these hooks add the pages named in ``REPO_PAGES`` and
every image that a page (one of those included) embeds to the site at their repository paths, and
point the ``../`` links there. A link to a file that is not added stays as written and fails the
strict build, so a guide cannot link a file that has moved.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

# repository Markdown files published as pages of the site (at their repository paths)
REPO_PAGES = ("benchmarks/README.md",)

_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s#]+\.(?:png|svg|jpg))\)")
_UP_LINK = re.compile(r"(\]\()\.\./([^)\s#]+)")
# '#word' at a line start is a heading to Python-Markdown but text to GitHub ('#C = 1 ...')
_HASH_TEXT = re.compile(r"^#(?=[^#\s])", re.MULTILINE)


def _root(config) -> Path:
    return Path(config["docs_dir"]).resolve().parent


def _images(markdown: str, page_dir: str) -> set[str]:
    """Repository paths of the images a page embeds, from the page's directory (repo-relative)."""
    out = set()
    for target in _IMAGE.findall(markdown):
        path = Path(page_dir, target).as_posix()
        parts: list[str] = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part not in ("", "."):
                parts.append(part)
        out.add("/".join(parts))
    return out


def on_files(files: Files, config) -> Files:
    """Add ``REPO_PAGES`` and every repository image a page embeds to the site."""
    root = _root(config)
    wanted: set[str] = set()
    for page in Path(config["docs_dir"]).glob("*.md"):
        wanted |= _images(page.read_text(encoding="utf-8"), "docs")
    for rel in REPO_PAGES:
        files.append(File.generated(config, rel, abs_src_path=str(root / rel)))
        wanted |= _images((root / rel).read_text(encoding="utf-8"), str(Path(rel).parent))
    for rel in sorted(wanted):
        if not rel.startswith("docs/") and (root / rel).is_file():
            files.append(File.generated(config, rel, abs_src_path=str(root / rel)))
    return files


def _outside_fences(markdown: str, edit) -> str:
    """Apply ``edit`` to the text outside fenced code blocks."""
    pieces = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$)", markdown, flags=re.MULTILINE | re.DOTALL)
    return "".join(p if i % 2 else edit(p) for i, p in enumerate(pieces))


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point ``../`` links of the guides at the added repository files; keep '#word' lines text."""
    if page.file.src_uri in REPO_PAGES:
        return _outside_fences(markdown, lambda text: _HASH_TEXT.sub(r"\\#", text))

    def repoint(match: re.Match[str]) -> str:
        rel = match.group(2)
        return f"{match.group(1)}{rel}" if files.get_file_from_path(rel) is not None else match.group(0)

    return _UP_LINK.sub(repoint, markdown)
