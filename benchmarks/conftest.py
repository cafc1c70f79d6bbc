"""Benchmark session set-up: a warmed allocator, so results do not depend on test order."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def warm_allocator():
    """Allocate and free one 16 MiB buffer before anything is measured.

    glibc serves a fresh process's large allocations (>128 KiB: every 512 x 512 matrix) with
    mmap and returns them on free, so each one pays its page faults again. Freeing a large
    mmapped block raises glibc's dynamic mmap/trim thresholds, after which such buffers are
    reused from the heap, as in any training process that has already held a large tensor.
    Without this, a case measured early in a fresh process runs up to 1.5x slower than the
    same case measured after another one (seen here: multi_similarity 9.2 ms cold vs 6.3 ms);
    the floor is unaffected (one matmul output). It applies to every implementation alike.
    """
    buf = torch.empty(16 * 2**20 // 4).fill_(0.0)
    del buf
    yield
