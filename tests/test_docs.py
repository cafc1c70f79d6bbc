"""The documentation site builds offline with ``mkdocs build --strict`` (every warning fails it:
broken links and anchors, docstrings griffe cannot parse, API objects that cannot be found)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip(
        "mkdocstrings_handlers.python",
        reason="mkdocstrings[python] is not installed (pip install -e '.[docs]')",
    )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    assert (tmp_path / "site" / "api" / "losses" / "index.html").is_file()


def test_readme_lists_exactly_the_chunkable_losses():
    """The README's list of chunkable losses is the registry's (the docs page generates its
    table from the same specs, ``docs/_hooks/generated_tables.py``)."""
    import pmlfunc as pf

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `pf.chunked`"))
    listed = row.split("`pf.chunked.chunkable()`:", 1)[1].split(";", 1)[0]
    names = tuple(re.findall(r"`(\w+)`", listed))
    assert names == pf.chunked.chunkable()
