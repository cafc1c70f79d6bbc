"""mkdocs hook: include files from outside docs/ without moving them.

A line ``<!-- include: benchmarks/README.md -->`` in a page is replaced by that file (a path
relative to the repository root), with its relative Markdown links re-targeted so that links into
``docs/`` resolve from the including page (mkdocs --strict rejects links that leave docs/).
Offline and dependency-free: only the standard library.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

_INCLUDE = re.compile(r"^<!--\s*include:\s*(\S+)\s*-->\s*$", re.MULTILINE)
_LINK = re.compile(r"\]\((?!https?://|#|/)([^)\s]+)\)")


def _retarget(text: str, src: str, page: str) -> str:
    """Rewrite ``](rel)`` links written relative to ``src`` (repo path) to be relative to
    ``page`` (a path inside docs/)."""
    src_dir = posixpath.dirname(src)
    page_dir = posixpath.dirname(page)

    def sub(m: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(src_dir, m.group(1)))
        if target.startswith("docs/"):
            return f"]({posixpath.relpath(target[len('docs/') :], page_dir or '.')})"
        return m.group(0)

    return _LINK.sub(sub, text)


def on_page_markdown(markdown, page, config, files):
    root = Path(config["config_file_path"]).parent

    def sub(m: re.Match) -> str:
        src = m.group(1)
        text = (root / src).read_text(encoding="utf-8")
        return _retarget(text, src, page.file.src_uri).rstrip("\n")

    return _INCLUDE.sub(sub, markdown)
