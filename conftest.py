"""Repository-wide pytest set-up: benchmark bodies run untimed unless timing is asked for."""

from __future__ import annotations

import pytest

# the pytest-benchmark options that ask for timed runs
_TIMED = (
    "benchmark_only",
    "benchmark_enable",
    "benchmark_json",
    "benchmark_save",
    "benchmark_autosave",
)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A plain ``pytest`` runs every benchmark body once, untimed (its parity check), and
    ``pytest --benchmark-only`` (or ``--benchmark-enable``, ``--benchmark-json``, ...) times
    them, as pytest-benchmark documents. ``--benchmark-disable`` in ``addopts`` would do the
    first but make ``--benchmark-only`` an error ("Can't have both"), so the default is set
    here, before pytest-benchmark reads it."""
    option = config.option
    if hasattr(option, "benchmark_disable") and not any(getattr(option, k, None) for k in _TIMED):
        option.benchmark_disable = True
