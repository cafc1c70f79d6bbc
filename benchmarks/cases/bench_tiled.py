"""The tiled engine beside the dense path: ``chunk_size=`` on NT-Xent, CLIP and SigLIP.

Groups ``tiled-ntxent-b{B}`` (``temperature=0.07``), ``tiled-supcon-b{B}`` (``0.1``),
``tiled-clip-b{B}`` and ``tiled-siglip-b{B}``, three members each: ``pmlfunc-full`` (the call
without ``chunk_size``: the engine's dense tiles, :func:`pmlfunc.losses._tiled.dense_rows`),
``pmlfunc-tiled`` (the same call with ``chunk_size``, ``PMLFUNC_BENCH_TILE``, 256, a plain
backward) and ``floor``; ``tiled-ntxent`` has a fourth, ``pmlfunc-chunked``
(``pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size=PMLFUNC_BENCH_TILE)``), so that the
two bounded-memory paths are timed beside the dense step in the same rounds. PML has neither
CLIP nor SigLIP, and its NT-Xent is timed in ``bench_core_losses``.

``clip`` and ``siglip`` take the suite's embeddings as their first set and a second seeded set
of the same shape as the paired set, with their ``*_init()`` parameters; the backward
differentiates both sets and both parameters. The untimed run checks that the two paths agree
on the loss (rtol 1e-3) and on the embeddings' gradient (``_bodies.members_agree``).

The issue-14 target is tiled time <= 1.3x dense at 4,096 rows::

    PMLFUNC_BENCH_BATCH=4096 pytest benchmarks/cases/bench_tiled.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,rounds

Issue 29's is chunked time <= 1.5x dense (eager) at 512 and 2,048 rows, chunk 128; members
timed in interleaved rounds (``benchmarks.run``), one batch a command::

    PMLFUNC_BENCH_TILE=128 python -m benchmarks.run --case tiled-ntxent --batch-size 512 \
        --repeats 30 --warmup 5 --output /tmp/chunked-512.json

(memory: ``python -m benchmarks.memory_report --losses ntxent,clip,siglip``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pmlfunc as pf

from .. import common as C
from . import FLOOR, Case, Member, anchor_batched, by_name, call, params
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


def _case(name: str, full: Member, tiled: Member, **more: Member) -> Case:
    return Case(
        name,
        {"pmlfunc-full": full, "pmlfunc-tiled": tiled, **more, "floor": FLOOR},
        extra={"chunk_size": TILE},
    )


CASES = by_name(
    _case(
        "tiled-ntxent",
        call(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE),
        call(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE, chunk_size=TILE),
        **{
            "pmlfunc-chunked": anchor_batched(
                pf.losses.ntxent, lambda: TILE, temperature=C.NTXENT_TEMPERATURE
            )
        },
    ),
    _case(
        "tiled-supcon",
        call(pf.losses.supcon, temperature=C.SUPCON_TEMPERATURE),
        call(pf.losses.supcon, temperature=C.SUPCON_TEMPERATURE, chunk_size=TILE),
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
