"""The quick subset, ``python -m pytest -m "not slow"``: the root conftest.py marks what is slow."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

import pmlfunc.testing as pf_testing

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _collected() -> dict[str, tuple[bool, bool]]:
    """Every test ``python -m pytest`` collects (not runs), with whether it is marked ``slow``
    and whether ``compile``: one collection of the whole suite (tests/_collected_marks.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "marks.tsv"
        env = {**os.environ, "PMLFUNC_MARKS_OUT": str(listing)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        out = subprocess.run(
            [*cmd, "-p", "_collected_marks"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        rows = [line.split("\t") for line in listing.read_text(encoding="utf-8").splitlines()]
    return {node: (slow == "1", compiles == "1") for node, slow, compiles in rows}


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    return root_conftest


@pytest.mark.slow  # a collection of the whole suite, ~20 s on 2 cores
def test_every_slow_pattern_names_a_test_and_no_compiling_test_is_quick():
    """A renamed test must not drop out of the list silently, and every test that compiles
    (``@pytest.mark.compile`` or "compile" in its name) is left out of the quick subset."""
    root_conftest = _root_conftest()
    marks = _collected()
    slow = [node for node, (is_slow, _) in marks.items() if is_slow]
    unmatched = [p for p in root_conftest.SLOW_TESTS if not any(fnmatchcase(i, p) for i in slow)]
    assert unmatched == [], unmatched
    quick = [node for node, (is_slow, _) in marks.items() if not is_slow]
    assert quick and slow
    compiling = [i for i in quick if "compile" in i.split("::")[-1].split("[")[0]]
    assert compiling == [], compiling
    assert [node for node in quick if marks[node][1]] == []


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
