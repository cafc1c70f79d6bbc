"""``multiple_negatives_ranking`` with ``k`` hard negatives, dense and tiled, beside its floor.

Groups ``retrieval-k{k}-b{N}`` for ``k`` = 0, 1, 7: the suite's embeddings are the ``N``
queries, a second seeded set the positives, and ``k`` further seeded sets the hard negatives
(``(N, k, D)``); the backward differentiates all three. Members:

- ``pmlfunc-full``: the call without ``chunk_size`` (the engine's dense tiles of ``2²²``
  entries);
- ``pmlfunc-tiled``: ``chunk_size=PMLFUNC_BENCH_TILE`` (256);
- ``floor``: the same product ``Q Dᵀ`` (``N × N(1 + k)``, ``D`` the positives and negatives)
  summed, and its backward: the three matmuls no implementation of the loss avoids.

The untimed run checks that the two pmlfunc members agree (loss and every gradient). Issue 31's
targets, with the memory of ``benchmarks.memory_report --losses retrieval,clip``::

    PMLFUNC_BENCH_BATCH=4096 python -m benchmarks.run --case retrieval-k7 --repeats 5
"""

from __future__ import annotations

import pytest
import torch

import pmlfunc as pf

from .. import common as C
from . import Case, Member, by_name, params
from ._bodies import members_agree
from .bench_tiled import TILE

NEGATIVES = (0, 1, 7)


def _documents(emb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positives ``(N, D)`` and ``k`` hard negatives ``(N, k, D)`` of the queries ``emb``:
    seeded sets of their shape, differentiated."""
    n, d = emb.shape
    docs = C.make_embeddings(n * (1 + k), d, dtype=emb.dtype, device=emb.device, seed=C.SEED + 1)
    pos, neg = docs[:n], docs[n:].reshape(n, k, d)
    return pos.requires_grad_(), neg.requires_grad_()


def mnrl(k: int, **kw) -> Member:
    """``multiple_negatives_ranking(emb, positives, negatives, **kw)``."""

    def make(emb, labels):
        pos, neg = _documents(emb, k)
        fn = pf.losses.multiple_negatives_ranking
        return (lambda e, y: fn(e, pos, neg if k else None, **kw)), [pos, neg] if k else [pos]

    return Member(make)


def floor(k: int) -> Member:
    """The loss's product ``Q Dᵀ`` over every document, summed (forward and backward)."""

    def make(emb, labels):
        pos, neg = _documents(emb, k)

        def step(e, y):
            docs = torch.cat([pos, neg.reshape(-1, neg.shape[-1])])
            return (e @ docs.T).sum()

        return step, [pos, neg] if k else [pos]

    return Member(make)


CASES = by_name(
    *(
        Case(
            f"retrieval-k{k}",
            {
                "pmlfunc-full": mnrl(k),
                "pmlfunc-tiled": mnrl(k, chunk_size=TILE),
                "floor": floor(k),
            },
            extra={"chunk_size": TILE, "negatives": k},
        )
        for k in NEGATIVES
    )
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_retrieval(benchmark, request, case: str, impl: str) -> None:
    members_agree(benchmark, request, CASES[case], impl)
