"""Benchmark session set-up: a settled allocator, so results do not depend on test order, and a
progress line per finished benchmark while a timed run goes."""

from __future__ import annotations

import time

import pytest

from benchmarks import common as C


@pytest.fixture(scope="session", autouse=True)
def settle_allocator():
    """The allocator in a training process's steady state before anything is measured
    (:func:`benchmarks.common.settle_allocator`). In a fresh process a case measured early ran
    up to 1.5x slower than the same case measured after another one (seen here:
    multi_similarity 9.2 ms cold vs 6.3 ms); the floor is unaffected (one matmul output). It
    applies to every implementation alike."""
    C.settle_allocator()
    yield


def _timed(config: pytest.Config) -> bool:
    """pytest-benchmark's rule (``BenchmarkSession.disabled``): timing is on unless disabled
    (the root ``conftest.py`` disables it for a plain ``pytest``) and not re-enabled."""
    option = config.option
    if not hasattr(option, "benchmark_disable"):
        return False
    return not option.benchmark_disable or bool(option.benchmark_enable)


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _clock(s: float) -> str:
    m, s = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


class Progress:
    """One line per finished benchmark in a timed run (``--benchmark-only``, ...): pytest-benchmark
    prints its tables only when the whole session ends, and a timed suite runs for minutes.

    ``[ 3/18 0:00:04] tiled-ntxent-b64 tiled-ntxent-pmlfunc-chunked: median 0.664 ms, 76 rounds``
    (``PMLFUNC_BENCH_BATCH=64``; the
    position among the collected benchmarks, the time since the session started, the group, the
    parameters' id and the pytest-benchmark median), or ``skipped: <reason>`` / ``failed``. The
    file lines of dots are left out, so that the lines stand alone (``-v`` keeps pytest's own
    line per test too). An untimed run (plain ``pytest``) is unchanged.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.start = time.monotonic()
        self.total = 0
        self.done = 0
        self.lines: dict[str, str] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = sum("benchmark" in getattr(i, "fixturenames", ()) for i in session.items)
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None and self.config.option.verbose <= 0:
            terminal.showfspath = False  # the lines name the groups; no file line of dots

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        if "benchmark" not in getattr(item, "fixturenames", ()):
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.lines[report.nodeid] = self._describe(item, report)

    def _describe(self, item: pytest.Item, report: pytest.TestReport) -> str:
        fixture = getattr(item, "funcargs", {}).get("benchmark")
        mark = item.get_closest_marker("benchmark")
        group = getattr(fixture, "group", None) or (mark.kwargs.get("group") if mark else None)
        callspec = getattr(item, "callspec", None)
        name = f"{group or item.name} {callspec.id if callspec else ''}".rstrip()
        if report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            return f"{name}: skipped: {reason.removeprefix('Skipped: ')}"
        if report.failed:
            return f"{name}: failed"
        stats = getattr(getattr(fixture, "stats", None), "stats", None)
        if stats is None:
            return f"{name}: done (not timed)"
        return f"{name}: median {_seconds(stats.median)}, {stats.rounds} rounds"

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport, config: pytest.Config):
        if report.nodeid in self.lines and config.option.verbose <= 0:
            # no dot or "s": the progress line says it (the summary still counts it)
            return report.outcome, "", report.outcome.upper()
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        line = self.lines.pop(report.nodeid, None)
        if line is None:
            return
        self.done += 1
        width = len(str(self.total))
        where = f"[{self.done:>{width}}/{self.total} {_clock(time.monotonic() - self.start)}]"
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.ensure_newline()
            terminal.write_line(f"{where} {line}")


def pytest_configure(config: pytest.Config) -> None:
    if _timed(config):
        config.pluginmanager.register(Progress(config), "pmlfunc-benchmark-progress")
