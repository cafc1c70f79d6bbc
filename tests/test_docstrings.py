"""Every docstring example of the package runs, from this one place: each module of ``pmlfunc``
(``pkgutil.walk_packages``) through ``doctest.testmod`` with ``torch`` and ``pf`` in scope. A
public module (no leading underscore in its last name part) must have examples; a private one
runs those it has. That each public loss and miner has an example of its own is checked in
test_conformance.py."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import pmlfunc as pf

MODULES = [pf.__name__] + [m.name for m in pkgutil.walk_packages(pf.__path__, f"{pf.__name__}.")]


def _is_public(name: str) -> bool:
    return not name.rsplit(".", 1)[-1].startswith("_")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        extraglobs={"torch": torch, "pf": pf},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=False,
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    if _is_public(name):
        assert result.attempted > 0, f"{name} has no examples"


def test_every_module_is_walked():
    """The walk finds the package's modules at every depth (a check of the walk itself)."""
    assert {"pmlfunc", "pmlfunc.losses", "pmlfunc.losses.pairs", "pmlfunc.miners"} <= set(MODULES)
    assert all(importlib.import_module(n).__name__ == n for n in MODULES)
