"""Anchor-batched losses: the full batch beside ``pf.chunked.value_and_grad``, and PML 2.9.0.

Groups ``anchor-batched-ntxent-b{B}`` (``temperature=0.07``) and ``anchor-batched-triplet-b{B}``
(``margin=0.2``), as in the reference protocol (``shared/reference/000_*``), four members each:
``pml`` and ``pmlfunc-full`` (the full-batch loss and backward),
``pmlfunc-anchor-batched`` (``pf.chunked.value_and_grad(loss, chunk_size)``; its forward does
all the work, as in the reference; chunk ``PMLFUNC_BENCH_ANCHOR_BATCH``, 256, or ``benchmarks.run
--anchor-batch-size``) and ``floor``.

The untimed run checks that the losses agree (rtol 1e-3) and that the anchor-batched gradient
equals the full one (``benchmarks.cases._bodies.members_agree``); its ``anchor-batched-ntxent``
group runs at ``PMLFUNC_BENCH_SMOKE_NTXENT_BATCH`` (128), as the core ``ntxent`` group does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

from .. import common as C
from . import FLOOR, Case, Fn, anchor_batched, by_name, call, params, plain
from ._bodies import members_agree

ANCHOR_BATCH = C.env_int("PMLFUNC_BENCH_ANCHOR_BATCH", 256)  # benchmarks.run may set it


def _case(name: str, pml: Callable[[], Fn], loss_fn: Callable[..., Any], **hyper) -> Case:
    """``pml()``, ``loss_fn(emb, labels, **hyper)`` on the full batch and anchor-batched, floor."""
    return Case(
        name,
        {
            "pml": plain(pml),
            "pmlfunc-full": call(loss_fn, **hyper),
            "pmlfunc-anchor-batched": anchor_batched(loss_fn, lambda: ANCHOR_BATCH, **hyper),
            "floor": FLOOR,
        },
        extra={"anchor_batch_size": ANCHOR_BATCH},
        pml_pair_matrix=name == "anchor-batched-ntxent",
    )


CASES = by_name(
    _case(
        "anchor-batched-ntxent",
        lambda: pml_losses.NTXentLoss(temperature=C.NTXENT_TEMPERATURE),
        pf.losses.ntxent,
        temperature=C.NTXENT_TEMPERATURE,
    ),
    _case(
        "anchor-batched-triplet",
        lambda: pml_losses.TripletMarginLoss(margin=C.TRIPLET_MARGIN),
        pf.losses.triplet_margin,
        margin=C.TRIPLET_MARGIN,
    ),
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_anchor_batched(benchmark, request, case: str, impl: str) -> None:
    members_agree(benchmark, request, CASES[case], impl)
