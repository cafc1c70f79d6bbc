"""A pytest plugin for ``tests/test_quick_subset.py``: after collection (and after the root
conftest has marked what is slow) it writes one line per collected test, ``node id``, then
``slow`` and ``compile`` as 1 or 0, tab-separated, to the file named by ``PMLFUNC_MARKS_OUT``."""

from __future__ import annotations

import os

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    with open(os.environ["PMLFUNC_MARKS_OUT"], "w", encoding="utf-8") as out:
        for item in session.items:
            marks = (item.get_closest_marker(m) is not None for m in ("slow", "compile"))
            out.write("\t".join([item.nodeid, *(str(int(m)) for m in marks)]) + "\n")
