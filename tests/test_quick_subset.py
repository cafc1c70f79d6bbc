"""The root conftest.py: what the quick subset, ``python -m pytest -m "not slow"``, leaves out
(the tests it marks slow), and the whole suite spread over the cores."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from fnmatch import fnmatchcase
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import fresh_pytest_env

import pmlfunc.testing as pf_testing

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _collected() -> dict[str, tuple[bool, bool]]:
    """Every test ``python -m pytest`` collects (not runs), with whether it is marked ``slow``
    and whether ``compile``: one collection of the whole suite (tests/_collected_marks.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "marks.tsv"
        env = fresh_pytest_env(PMLFUNC_MARKS_OUT=str(listing))
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


def _host(monkeypatch, cores: int = 4):
    """The root conftest, on a machine of ``cores`` cores, outside any xdist worker (this test
    may run in one)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    return _root_conftest()


def _config(source: str = "TESTPATHS", **option) -> SimpleNamespace:
    """What the root conftest's hooks read of a ``pytest.Config``: a plain ``python -m pytest``
    in the repository root unless told otherwise."""
    plain = {"numprocesses": None, "collectonly": False, "usepdb": False, "dist": "no"}
    return SimpleNamespace(
        option=SimpleNamespace(**{**plain, **option}),
        args_source=getattr(pytest.Config.ArgsSource, source),
    )


@pytest.mark.parametrize("cores, workers", [(1, 0), (2, 2), (4, 4), (64, 8)])
def test_the_whole_suite_runs_in_a_worker_a_core_with_work_stealing(monkeypatch, cores, workers):
    root_conftest = _host(monkeypatch, cores)
    config = _config()
    root_conftest.pytest_cmdline_main(config)
    assert config.option.numprocesses == (workers or None)  # one core: left to run in-process
    assert config.option.dist == ("worksteal" if workers else "no")


@pytest.mark.parametrize(
    "source, option",
    [
        ("ARGS", {}),  # files or node ids named
        ("INVOCATION_DIR", {}),  # run outside the root: no testpaths
        ("TESTPATHS", {"collectonly": True}),
        ("TESTPATHS", {"usepdb": True}),
        ("TESTPATHS", {"benchmark_only": True}),
        ("TESTPATHS", {"benchmark_json": "run.json"}),
        ("TESTPATHS", {"numprocesses": 0}),  # -n 0
        ("TESTPATHS", {"numprocesses": 3}),  # -n 3: xdist's own
    ],
    ids=["named", "outside", "collect-only", "pdb", "benchmark-only", "benchmark-json", "n0", "n3"],
)
def test_a_run_that_names_tests_collects_debugs_times_or_says_n_is_left_as_told(
    monkeypatch, source, option
):
    root_conftest = _host(monkeypatch)
    config = _config(source, **option)
    before = vars(config.option).copy()
    root_conftest.pytest_cmdline_main(config)
    assert vars(config.option) == before


def test_a_worker_runs_the_tests_it_is_sent_and_starts_no_workers(monkeypatch):
    """xdist runs ``pytest_cmdline_main`` in each worker too: a worker that took the whole
    suite's settings would start workers of its own, and they theirs."""
    root_conftest = _host(monkeypatch)
    config = _config()
    config.workerinput = {"workerid": "gw0"}  # what xdist sets on a worker's config
    root_conftest.pytest_cmdline_main(config)
    assert config.option.numprocesses is None and config.option.dist == "no"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # and in a worker's environment
    assert root_conftest._whole_suite_workers(_config()) == 0


def test_without_the_xdist_plugin_the_suite_runs_in_process(monkeypatch):
    root_conftest = _host(monkeypatch)
    config = _config()
    del config.option.numprocesses  # -p no:xdist: the option does not exist
    assert root_conftest._whole_suite_workers(config) == 0


def test_a_worker_takes_its_share_of_the_cores_threads(monkeypatch):
    """Two workers on four cores: two threads each, for torch and for the processes it starts."""
    import torch

    root_conftest = _host(monkeypatch)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        root_conftest._share_the_cores()
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(threads)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    root_conftest._share_the_cores()  # not a worker: nothing changes
    assert torch.get_num_threads() == threads and os.environ["OMP_NUM_THREADS"] == "5"
