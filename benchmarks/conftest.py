"""Benchmark session set-up: a settled allocator, so results do not depend on test order."""

from __future__ import annotations

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
