"""The quick subset, ``python -m pytest -m "not slow"``: the root conftest.py marks what is slow."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

import pmlfunc.testing as pf_testing

ROOT = Path(__file__).resolve().parents[1]


def _collected(marks: str) -> list[str]:
    """The node ids ``pytest -m marks`` would run (collected, not run)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*cmd, "-m", marks], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]  # 5: none selected
    return [line for line in out.stdout.splitlines() if "::" in line]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    return root_conftest


@pytest.mark.slow  # two collections of the whole suite, ~4 s each
def test_every_slow_pattern_names_a_test_and_no_compiling_test_is_quick():
    """A renamed test must not drop out of the list silently, and every test that compiles
    (``@pytest.mark.compile`` or "compile" in its name) is left out of the quick subset."""
    root_conftest = _root_conftest()
    slow = _collected("slow")
    unmatched = [p for p in root_conftest.SLOW_TESTS if not any(fnmatchcase(i, p) for i in slow)]
    assert unmatched == [], unmatched
    quick = _collected("not slow")
    assert quick and not set(quick) & set(slow)
    compiling = [i for i in quick if "compile" in i.split("::")[-1].split("[")[0]]
    assert compiling == [], compiling
    assert _collected("compile and not slow") == []


def test_a_test_whose_body_spawns_ranks_is_slow():
    """A test that calls ``spawn_ranks(`` or ``check_distributed(`` itself is slow (gloo
    process groups); naming them in a string or a docstring is not a call."""
    spawns = _root_conftest()._spawns_ranks

    def spawning():
        return pf_testing.spawn_ranks(print, world_size=2)

    def checking():
        return pf_testing.check_distributed(print, world_size=2)

    def naming():
        """Unlike spawn_ranks or check_distributed, this spawns nothing."""
        return "spawn_ranks"

    assert spawns(spawning) and spawns(checking) and not spawns(naming)
