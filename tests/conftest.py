"""Shared fixtures for the pmlfunc test suite."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Let test modules import sibling helpers (e.g. ``import reference``) however pytest is invoked.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator: every test draws the same data on every run."""
    return torch.Generator().manual_seed(0)
