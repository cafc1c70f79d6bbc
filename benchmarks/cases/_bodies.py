"""The measured bodies that several case files share, and the loss values their checks reuse.

- :func:`loss_vs_pml` (``bench_core_losses``, ``bench_other_losses``): a pmlfunc loss, its PML
  2.9.0 class and the floor (:func:`twins`, :func:`same_settings`); each pmlfunc or PML body checks its loss against
  the other library's, computing that one when no body has yet.
- :func:`members_agree` (``bench_proxy_losses``, ``bench_anchor_batched``): every member that
  has run so far computes the same loss, and the anchor-batched gradient equals the full one.

Both assert a finite scalar loss and a finite gradient of the embeddings' shape, so the untimed
run (``--benchmark-disable``, one call per body) doubles as a regression check.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest
import torch

from .. import common as C
from . import (
    ATOL,
    DEVICE,
    FLOOR,
    RTOL,
    SMOKE_PAIR_MATRIX_BATCH,
    THREADS,
    Case,
    Fn,
    Member,
    call,
    case_batch,
    inputs,
    library,
    make_step,
    plain,
    pml_over_budget,
    record,
)

# Loss values per (case, impl, batch), filled by the bodies that measured them and by
# loss_value, so that each parity check reuses a value another body already computed.
LOSSES: dict[tuple[str, str, int], float] = {}


def loss_value(case: Case, impl: str, batch: int, *, float64: bool = False) -> float:
    """``impl``'s loss on the suite's inputs at ``batch``, computed without gradients once
    (``float64``: on the inputs cast to float64, the arbiter when the two libraries differ)."""
    key = (case.name, impl + ("/float64" if float64 else ""), batch)
    if key not in LOSSES:
        emb, labels = inputs(batch)
        if float64:
            emb = emb.double()
        fn, _ = case.members[impl].make(emb, labels)
        with torch.no_grad():
            LOSSES[key] = float(fn(emb, labels))
    return LOSSES[key]


def _agree(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)


def twins(name: str, pmlfunc: Member, pml: Callable[[], Fn], **case) -> Case:
    """A case of :func:`loss_vs_pml`: ``pml`` (a factory of the PML module), ``pmlfunc``, the
    floor; PML first, so that its timed step also serves as the reference."""
    return Case(name, {"pml": plain(pml), "pmlfunc": pmlfunc, "floor": FLOOR}, **case)


def same_settings(
    rows: Iterable[tuple[str, Callable[..., Any], Callable[..., Fn], dict[str, Any]]],
    pml_pair_matrix: Collection[str] = (),
) -> list[Case]:
    """One :func:`twins` case per ``(name, pmlfunc loss, PML loss class, hyper-parameters)``,
    both libraries given the same keyword arguments; ``pml_pair_matrix``: the names of the cases
    for which PML builds its (positive pairs) × (negative pairs) matrix."""
    return [
        twins(
            name,
            call(pf_loss, **hyper),
            functools.partial(pml_loss, **hyper),
            pml_pair_matrix=name in pml_pair_matrix,
        )
        for name, pf_loss, pml_loss, hyper in rows
    ]


def loss_vs_pml(benchmark, request, case: Case, impl: str) -> None:
    """Measure one member of a :func:`twins` case; pmlfunc and PML agree (rtol 1e-3), or,
    where they do not, pmlfunc agrees with PML evaluated in float64. Where a timed run skips
    PML's member for its pair matrix (:func:`~benchmarks.cases.pml_over_budget`), the two are
    compared at the smoke batch instead."""
    batch = case_batch(case, benchmark.disabled)
    over = None if benchmark.disabled else pml_over_budget(case, batch)
    if impl == "pml" and over:
        pytest.skip(over)
    emb, labels = inputs(batch)
    base_step = make_step(case.members[impl], emb, labels)
    step = C.synced(base_step, DEVICE)

    def keep(out) -> None:  # the first call's loss: a later parity check reuses it
        LOSSES[(case.name, impl, batch)] = float(out)

    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        loss = C.measure(benchmark, request, step, DEVICE, first=keep)
        grad = base_step.last_grad  # type: ignore[attr-defined]
        record(benchmark, emb, case, impl, loss)

        name = case.name
        assert loss.ndim == 0, f"{name}/{impl}: loss is not a scalar: shape {tuple(loss.shape)}"
        assert torch.isfinite(loss), f"{name}/{impl}: non-finite loss {loss}"
        assert torch.isfinite(grad).all(), f"{name}/{impl}: non-finite gradient"
        assert grad.shape == emb.shape

        value = float(loss)
        LOSSES[(name, impl, batch)] = value
        if impl in ("pmlfunc", "pml"):
            check = min(batch, SMOKE_PAIR_MATRIX_BATCH) if over else batch
            value = value if check == batch else loss_value(case, impl, check)
            other = "pml" if impl == "pmlfunc" else "pmlfunc"
            ref = loss_value(case, other, check)
            if not _agree(value, ref):
                # Where they differ, PML's own loss in float64 decides: pmlfunc must be as close
                # to it as the tolerance (PML's float32 sums drift at large batches).
                ours = value if impl == "pmlfunc" else ref
                exact = loss_value(case, "pml", check, float64=True)
                assert _agree(ours, exact), (
                    f"{name} at batch {check}: pmlfunc and PML disagree: {impl}={value!r}, "
                    f"{other}={ref!r}, and pmlfunc is not within rtol={RTOL} of PML in "
                    f"float64 ({exact!r})"
                )


# (loss, embedding gradient) per (case, impl) of the members_agree bodies that have run.
_RESULTS: dict[tuple[str, str], tuple[float, torch.Tensor]] = {}


def members_agree(benchmark, request, case: Case, impl: str) -> None:
    """Measure one member; its loss equals every other non-floor member's that has run (rtol
    1e-3), and the embeddings' gradients of any two pmlfunc members are equal (the full batch
    beside its anchor-batched or tiled path). A timed run skips PML's member before it runs
    when its pair matrix is over budget (:func:`~benchmarks.cases.pml_over_budget`)."""
    batch = case_batch(case, benchmark.disabled)
    over = None if benchmark.disabled else pml_over_budget(case, batch)
    if library(impl) == "pml" and over:
        pytest.skip(over)
    emb, labels = inputs(batch)
    step = make_step(case.members[impl], emb, labels)
    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        out = C.measure(benchmark, request, step, DEVICE)
        record(benchmark, emb, case, impl, out)
    grad = step.last_grad  # type: ignore[attr-defined]
    name = case.name
    assert out.ndim == 0 and torch.isfinite(out), f"{name}/{impl}: loss {out}"
    assert torch.isfinite(grad).all() and grad.shape == emb.shape, f"{name}/{impl}: gradient"
    if impl == "floor":
        return
    _RESULTS[(name, impl)] = (float(out), grad.detach())
    others = [(k, v) for k, v in _RESULTS.items() if k[0] == name and k[1] != impl]
    for (_, other), (value, other_grad) in others:
        assert math.isclose(float(out), value, rel_tol=RTOL, abs_tol=ATOL), (
            f"{name}: {impl}={float(out)!r} vs {other}={value!r}"
        )
        if library(impl) == library(other) == "pmlfunc":
            torch.testing.assert_close(grad, other_grad, rtol=1e-4, atol=1e-6)
