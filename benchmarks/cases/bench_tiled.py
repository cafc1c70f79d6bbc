"""The tiled engine beside the dense path: ``chunk_size=`` on NT-Xent, CLIP and SigLIP.

Groups ``tiled-ntxent-b{B}`` (``temperature=0.07``), ``tiled-clip-b{B}`` and
``tiled-siglip-b{B}``, three members each: ``pmlfunc-full`` (the dense loss and backward),
``pmlfunc-tiled`` (the same call with ``chunk_size``, ``PMLFUNC_BENCH_TILE``, 256: the tiled
engine, a plain backward) and ``floor``. PML has neither CLIP nor SigLIP, and its NT-Xent is
timed in ``bench_core_losses``.

``clip`` and ``siglip`` take the suite's embeddings as their first set and a second seeded set
of the same shape as the paired set, with their ``*_init()`` parameters; the backward
differentiates both sets and both parameters. The untimed run checks that the two paths agree
on the loss (rtol 1e-3) and on the embeddings' gradient (``_bodies.members_agree``).

The issue-14 target is tiled time <= 1.3x dense at 4,096 rows::

    PMLFUNC_BENCH_BATCH=4096 pytest benchmarks/cases/bench_tiled.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,rounds

(memory: ``python -m benchmarks.memory_report --losses ntxent,clip,siglip``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pmlfunc as pf

from .. import common as C
from . import FLOOR, Case, Member, by_name, call, params
from ._bodies import members_agree

TILE = C.env_int("PMLFUNC_BENCH_TILE", 256)


def paired(loss_fn: Callable[..., torch.Tensor], init: Callable[[], dict], **kw) -> Member:
    """``loss_fn(emb, other, params, **kw)``: ``other`` a seeded set shaped like ``emb``; the
    backward differentiates ``other`` and ``params`` too."""

    def make(emb, labels):
        other = C.make_paired(emb).requires_grad_()
        p = {k: v.to(emb.device).requires_grad_() for k, v in init().items()}
        return (lambda e, y: loss_fn(e, other, p, **kw)), [other, *p.values()]

    return Member(make)


def _case(name: str, full: Member, tiled: Member) -> Case:
    return Case(
        name,
        {"pmlfunc-full": full, "pmlfunc-tiled": tiled, "floor": FLOOR},
        extra={"chunk_size": TILE},
    )


CASES = by_name(
    _case(
        "tiled-ntxent",
        call(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE),
        call(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE, chunk_size=TILE),
    ),
    *(
        _case(f"tiled-{name}", paired(fn, init), paired(fn, init, chunk_size=TILE))
        for name, fn, init in (
            ("clip", pf.losses.clip, pf.losses.clip_init),
            ("siglip", pf.losses.siglip, pf.losses.siglip_init),
        )
    ),
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_tiled(benchmark, request, case: str, impl: str) -> None:
    members_agree(benchmark, request, CASES[case], impl)
