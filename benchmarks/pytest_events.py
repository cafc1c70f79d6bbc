"""pytest plugin: one JSON line per test report, appended as each test ends, so that a run that is
cut off still says what it did (``benchmarks.gpu_check`` reads it).

    PMLFUNC_PYTEST_EVENTS=/tmp/events.jsonl python -m pytest -p benchmarks.pytest_events ...

Each line: ``nodeid``, ``when`` (``collect``, ``setup``, ``call``, ``teardown``), ``outcome``
(``passed``, ``failed``, ``skipped``), ``duration`` in seconds and, unless it passed,
``message`` (the reason or the last lines of the failure). Collection, setup and teardown
reports are written only when they did not pass. Without ``PMLFUNC_PYTEST_EVENTS`` the plugin
does nothing.
"""

from __future__ import annotations

import json
import os

ENV = "PMLFUNC_PYTEST_EVENTS"
MESSAGE_CHARS = 2000


def _message(report) -> str | None:
    if report.passed:
        return None
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (path, line, reason)
    return str(report.longrepr)[-MESSAGE_CHARS:]


def _write(report, when: str) -> None:
    path = os.environ.get(ENV)
    if not path or (when != "call" and report.passed):
        return
    line = {
        "nodeid": report.nodeid,
        "when": when,
        "outcome": report.outcome,
        "duration": round(getattr(report, "duration", 0.0) or 0.0, 4),
        "message": _message(report),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_runtest_logreport(report) -> None:
    _write(report, report.when)


def pytest_collectreport(report) -> None:
    _write(report, "collect")
