"""Every docstring example of the public modules runs (``>>>`` lines, with ``torch`` and ``pf``
in scope). Modules whose examples need a process group or a trained encoder (``distributed``,
``chunked``) are shown, not run."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

import pmlfunc as pf

MODULES = [
    "pmlfunc.reducers",
    "pmlfunc.tuples",
    "pmlfunc.miners",
    "pmlfunc.regularizers",
    "pmlfunc.wrappers",
    "pmlfunc.distances",
    "pmlfunc.labels",
    "pmlfunc.losses.pairs",
    "pmlfunc.losses.pair_weighting",
    "pmlfunc.losses.triplets",
    "pmlfunc.losses.softmax",
    "pmlfunc.losses.self_supervised",
    "pmlfunc.losses.proxies",
    "pmlfunc.losses.neighbors",
    "pmlfunc.losses.ranking",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        extraglobs={"torch": torch, "pf": pf},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=False,
    )
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
