"""Miners and mined losses: pmlfunc miners (+ losses) vs PML 2.9.0 vs a floor.

One pytest-benchmark group per case (``{case}-b{B}``), as in ``bench_core_losses``:

- ``pair-miner``: ``pair_margin`` mining alone (margins 0.2 / 1.4). The measured call is the
  miner; no gradient. Its ``floor`` is one B×B matmul forward under ``no_grad``.
- ``mined-triplet``: ``pair_margin`` then ``triplet_margin`` loss (margin 0.2) on the mined pairs
  (PML converts them to the triplets that share an anchor).
- ``batch-hard-triplet``: ``batch_hard`` then ``triplet_margin`` loss.
- ``triplet-miner``: ``triplet_margin`` mining (margin 0.2, ``"all"``) then ``triplet_margin``
  loss, four members: ``pmlfunc-unbounded`` (an implicit ``TripletWindow``),
  ``pmlfunc-bounded`` (``tuples_per_anchor=32``: at most 32 random triplets per anchor),
  ``pml`` (``TripletMarginMiner``, unbounded: PML 2.9.0 has no bound) and ``floor``.
- ``separate-{cosine,lp}`` / ``reused-{cosine,lp}``: ``multi_similarity`` mining, then
  ``multi_similarity`` + ``contrastive`` losses on the mined pairs (summed). Separate: each of
  the three calls computes its own matrix. Reused: one matrix (with gradients) is computed
  first and passed to all three as ``mat=``. PML 2.9.0 has no ``mat=``, so ``pml`` appears in
  the separate groups only.

Every other group's ``floor`` is ``(E @ E.T).sum()`` forward+backward, as in
``bench_core_losses``. Each measured call of a loss case is one forward+backward step on a fresh
graph (``benchmarks.cases.make_step``), mining included.

Every body asserts a finite loss and gradient (a finite result for the miner), that what its
miner selects is valid (pairs/triplets of the right labels, never ``(i, i)``, indices in range,
not empty), and parity: pmlfunc and PML mine the same pairs/triplets and their losses agree
(rtol 1e-3); the separate and reused pmlfunc losses are equal. ``pmlfunc-bounded`` is only
checked for a finite loss and its bound: ``B·32`` slots, at most 32 distinct valid triplets per
anchor (exactly ``min(32, that anchor's triplets)``), each inside the miner's margin window.

Configuration: the suite's ``PMLFUNC_BENCH_*`` variables (batch, dim, samples per class,
threads, dtype, device).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners

import pmlfunc as pf
from pmlfunc import miners

from .. import common as C
from . import (
    ATOL,
    BATCH,
    DEVICE,
    DTYPE,
    FLOOR,
    RTOL,
    THREADS,
    Case,
    Fn,
    by_name,
    inputs,
    make_step,
    params,
    plain,
    record,
)
from ._bodies import LOSSES, loss_value

# Hyper-parameters (reference "Development measurements": miner margins 0.2 and 1.4).
PAIR_POS_MARGIN = 0.2
PAIR_NEG_MARGIN = 1.4
MS_EPSILON = 0.1
TUPLES_PER_ANCHOR = 32
# Contrastive margins of the separate/reused cases, the same for both libraries. lp: the
# core margins; cosine (a similarity): PML's documented pair for similarities, so that
# both hinges are active (with PML's defaults 0 / 1 the negative hinge [s - 1]_+ is always 0).
CONTRASTIVE_MARGINS = {
    "lp": (C.CONTRASTIVE_POS_MARGIN, C.CONTRASTIVE_NEG_MARGIN),
    "cosine": (1.0, 0.0),
}

Indices = tuple[torch.Tensor, ...]  # PML-style pairs (a1, p, a2, n) or triplets (a, p, n)


def _mining_floor(e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Floor of a mining-only call: one B×B matmul forward, no graph."""
    del y
    with torch.no_grad():
        return e @ e.T


MINING_FLOOR = plain(lambda: _mining_floor, kind="mine")


# --- pair-margin mining ---------------------------------------------------------------------


def _pf_pair_margin(e, y):
    return miners.pair_margin(e, y, pos_margin=PAIR_POS_MARGIN, neg_margin=PAIR_NEG_MARGIN)


def _pml_pair_margin() -> Fn:
    return pml_miners.PairMarginMiner(pos_margin=PAIR_POS_MARGIN, neg_margin=PAIR_NEG_MARGIN)


def _pf_mined_triplet() -> Fn:
    def loss(e, y):
        pairs = _pf_pair_margin(e, y)
        return pf.losses.triplet_margin(e, y, margin=C.TRIPLET_MARGIN, indices_tuple=pairs)

    return loss


def _pml_mined(miner: Callable[[], Fn]) -> Callable[[], Fn]:
    """PML ``miner`` then ``TripletMarginLoss(margin=0.2)`` on its indices."""

    def factory() -> Fn:
        mine, loss_fn = miner(), pml_losses.TripletMarginLoss(margin=C.TRIPLET_MARGIN)
        return lambda e, y: loss_fn(e, y, mine(e, y))

    return factory


# --- batch hard -----------------------------------------------------------------------------


def _pf_batch_hard_triplet() -> Fn:
    def loss(e, y):
        mined = miners.batch_hard(e, y)
        return pf.losses.triplet_margin(e, y, margin=C.TRIPLET_MARGIN, indices_tuple=mined)

    return loss


# --- triplet-margin mining, unbounded and bounded ---------------------------------------------


def _pf_triplet_miner(e, y, **bound):
    return miners.triplet_margin(e, y, margin=C.TRIPLET_MARGIN, type_of_triplets="all", **bound)


def _pf_triplet_loss(bounded: bool) -> Callable[[], Fn]:
    def factory() -> Fn:
        # A fresh subset every step, as in training: a seed tensor advanced in place (the form
        # that also works under torch.compile and in CUDA graphs).
        seed = torch.zeros((), dtype=torch.int64)
        bound = {"tuples_per_anchor": TUPLES_PER_ANCHOR, "generator": seed} if bounded else {}

        def loss(e, y):
            if bounded:
                seed.add_(1)
            mined = _pf_triplet_miner(e, y, **bound)
            return pf.losses.triplet_margin(e, y, margin=C.TRIPLET_MARGIN, indices_tuple=mined)

        return loss

    return factory


def _pf_bounded_triplets(e, y):
    gen = torch.Generator().manual_seed(0)
    return _pf_triplet_miner(e, y, tuples_per_anchor=TUPLES_PER_ANCHOR, generator=gen)


def _check_bound(e: torch.Tensor, y: torch.Tensor) -> None:
    """The bounded miner's result: ``B·k`` slots, at most ``k`` distinct valid triplets per
    anchor (exactly ``min(k, that anchor's triplets)``), each inside the margin window."""
    k = TUPLES_PER_ANCHOR
    mined = _pf_bounded_triplets(e, y)
    window = _pf_triplet_miner(e, y)
    b = e.shape[0]
    assert mined.anchors.shape == (b * k,), f"bounded: {mined.anchors.shape} slots, not {b * k}"
    a, p, n = mined.to_indices()
    per_anchor = torch.bincount(a, minlength=b)
    available = window.search().count.sum(-1)
    assert int(per_anchor.max()) <= k, f"bounded: {int(per_anchor.max())} > {k} for one anchor"
    assert torch.equal(per_anchor, available.clamp_max(k)), "bounded: not min(k, available)"
    m = window.e.shape[1]
    keys = (a * m + p) * m + n
    assert keys.unique().numel() == keys.numel(), "bounded: a triplet drawn twice"
    ea = window.e[a]
    rows = torch.arange(a.numel(), device=a.device)
    assert bool((ea[rows, n] <= ea[rows, p] + C.TRIPLET_MARGIN).all()), "bounded: outside margin"


# --- multi-similarity mining + MS loss + contrastive, separate and reused -----------------------

PF_DISTANCES = {"cosine": pf.distances.cosine, "lp": pf.distances.lp}
PML_DISTANCES = {"cosine": pml_distances.CosineSimilarity, "lp": pml_distances.LpDistance}


def _pf_ms_pair(dist: str, reused: bool) -> Callable[[], Fn]:
    pos_margin, neg_margin = CONTRASTIVE_MARGINS[dist]

    def factory() -> Fn:
        d = PF_DISTANCES[dist]()

        def loss(e, y):
            kw: dict[str, Any] = {"distance": d}
            if reused:
                kw["mat"] = d.matrix(e)  # with gradients: the losses differentiate through it
            pairs = miners.multi_similarity(e, y, epsilon=MS_EPSILON, **kw)
            ms = pf.losses.multi_similarity(
                e, y, alpha=C.MS_ALPHA, beta=C.MS_BETA, base=C.MS_BASE, indices_tuple=pairs, **kw
            )
            con = pf.losses.contrastive(
                e, y, pos_margin=pos_margin, neg_margin=neg_margin, indices_tuple=pairs, **kw
            )
            return ms + con

        return loss

    return factory


def _pml_ms_pair(dist: str) -> Callable[[], Fn]:
    pos_margin, neg_margin = CONTRASTIVE_MARGINS[dist]

    def factory() -> Fn:
        d = PML_DISTANCES[dist]()
        mine = pml_miners.MultiSimilarityMiner(epsilon=MS_EPSILON, distance=d)
        ms = pml_losses.MultiSimilarityLoss(
            alpha=C.MS_ALPHA, beta=C.MS_BETA, base=C.MS_BASE, distance=d
        )
        con = pml_losses.ContrastiveLoss(pos_margin=pos_margin, neg_margin=neg_margin, distance=d)

        def loss(e, y):
            pairs = mine(e, y)
            return ms(e, y, pairs) + con(e, y, pairs)

        return loss

    return factory


def _pf_ms_mined(dist: str, reused: bool) -> Fn:
    def mined(e, y):
        d = PF_DISTANCES[dist]()
        mat = d.matrix(e.detach()) if reused else None
        return miners.multi_similarity(e, y, epsilon=MS_EPSILON, distance=d, mat=mat)

    return mined


def _pml_ms_mined(dist: str) -> Fn:
    return lambda e, y: pml_miners.MultiSimilarityMiner(
        epsilon=MS_EPSILON, distance=PML_DISTANCES[dist]()
    )(e, y)


def _ms_cases(dist: str) -> tuple[Case, Case]:
    separate = Case(
        f"separate-{dist}",
        {
            "pml": plain(_pml_ms_pair(dist), mined=_pml_ms_mined(dist)),
            "pmlfunc": plain(
                _pf_ms_pair(dist, reused=False), mined=_pf_ms_mined(dist, reused=False)
            ),
            "floor": FLOOR,
        },
        extra={"distance": dist},
    )
    reused = Case(
        f"reused-{dist}",
        {
            "pmlfunc": plain(_pf_ms_pair(dist, reused=True), mined=_pf_ms_mined(dist, reused=True)),
            "floor": FLOOR,
        },
        extra={"distance": dist},
    )
    return separate, reused


# pml first in every group: its timed step also serves as the reference.
CASES = by_name(
    Case(
        "pair-miner",
        {
            "pml": plain(
                _pml_pair_margin, kind="mine", mined=lambda e, y: _pml_pair_margin()(e, y)
            ),
            "pmlfunc": plain(lambda: _pf_pair_margin, kind="mine", mined=_pf_pair_margin),
            "floor": MINING_FLOOR,
        },
    ),
    Case(
        "mined-triplet",
        {
            "pml": plain(_pml_mined(_pml_pair_margin), mined=lambda e, y: _pml_pair_margin()(e, y)),
            "pmlfunc": plain(_pf_mined_triplet, mined=_pf_pair_margin),
            "floor": FLOOR,
        },
    ),
    Case(
        "batch-hard-triplet",
        {
            "pml": plain(
                _pml_mined(pml_miners.BatchHardMiner),
                mined=lambda e, y: pml_miners.BatchHardMiner()(e, y),
            ),
            "pmlfunc": plain(_pf_batch_hard_triplet, mined=miners.batch_hard),
            "floor": FLOOR,
        },
    ),
    Case(
        "triplet-miner",
        {
            "pml": plain(
                _pml_mined(lambda: pml_miners.TripletMarginMiner(margin=C.TRIPLET_MARGIN)),
                mined=lambda e, y: pml_miners.TripletMarginMiner(margin=C.TRIPLET_MARGIN)(e, y),
            ),
            "pmlfunc-unbounded": plain(_pf_triplet_loss(bounded=False), mined=_pf_triplet_miner),
            "pmlfunc-bounded": plain(
                _pf_triplet_loss(bounded=True), mined=_pf_bounded_triplets, check=_check_bound
            ),
            "floor": FLOOR,
        },
        extra={"tuples_per_anchor": TUPLES_PER_ANCHOR},
    ),
    *_ms_cases("cosine"),
    *_ms_cases("lp"),
)

# Results that must agree: ((case, impl), (case, impl), rtol of the losses). Mined indices of
# both sides must be the same set. rtol 0: equal.
EXACT = 0.0 if DTYPE in (torch.float32, torch.float64) else RTOL
PARITY: tuple[tuple[tuple[str, str], tuple[str, str], float], ...] = (
    (("pair-miner", "pmlfunc"), ("pair-miner", "pml"), RTOL),
    (("mined-triplet", "pmlfunc"), ("mined-triplet", "pml"), RTOL),
    (("batch-hard-triplet", "pmlfunc"), ("batch-hard-triplet", "pml"), RTOL),
    (("triplet-miner", "pmlfunc-unbounded"), ("triplet-miner", "pml"), RTOL),
    (("separate-cosine", "pmlfunc"), ("separate-cosine", "pml"), RTOL),
    (("separate-lp", "pmlfunc"), ("separate-lp", "pml"), RTOL),
    (("reused-cosine", "pmlfunc"), ("separate-cosine", "pmlfunc"), EXACT),
    (("reused-lp", "pmlfunc"), ("separate-lp", "pmlfunc"), EXACT),
)


# Mined index keys per (case, impl), shared between bodies so that each parity check reuses
# what another body already mined.
_MINED_CACHE: dict[tuple[str, str], tuple[torch.Tensor, ...]] = {}


def _as_indices(mined: Any) -> Indices:
    """PML-style indices of a pmlfunc result (``to_indices``) or of a PML miner's tuple."""
    return mined.to_indices() if hasattr(mined, "to_indices") else tuple(mined)


def mined_keys(case: str, impl: str, result: Any = None) -> tuple[torch.Tensor, ...]:
    """Sorted flat keys of each part (pairs: positive, negative; triplets: one) of what the
    impl's miner selects (``result``, else mined now), after checking that it is valid."""
    if (case, impl) not in _MINED_CACHE:
        emb, labels = inputs()
        if result is None:
            result = CASES[case].members[impl].mined(emb, labels)
        indices = _as_indices(result)
        _MINED_CACHE[(case, impl)] = check_indices(indices, labels, f"{case}/{impl}")
    return _MINED_CACHE[(case, impl)]


def check_indices(indices: Indices, labels: torch.Tensor, what: str) -> tuple[torch.Tensor, ...]:
    """Assert PML-style pairs or triplets are valid for ``labels``; return their sorted keys."""
    b = labels.shape[0]
    indices = tuple(i.long().cpu() for i in indices)
    y = labels.cpu()
    for i in indices:
        assert i.ndim == 1 and (i.numel() == 0 or (0 <= int(i.min()) and int(i.max()) < b)), (
            f"{what}: indices out of range"
        )
    if len(indices) == 4:
        a1, p, a2, n = indices
        assert a1.numel() == p.numel() and a2.numel() == n.numel()
        assert a1.numel() > 0 and a2.numel() > 0, f"{what}: no positive or no negative pairs"
        assert bool((y[a1] == y[p]).all() and (a1 != p).all()), f"{what}: invalid positive pair"
        assert bool((y[a2] != y[n]).all()), f"{what}: invalid negative pair"
        return (a1 * b + p).sort().values, (a2 * b + n).sort().values
    assert len(indices) == 3, f"{what}: expected pairs or triplets, got {len(indices)} tensors"
    a, p, n = indices
    assert a.numel() == p.numel() == n.numel() > 0, f"{what}: no triplets"
    assert bool((y[a] == y[p]).all() and (a != p).all()), f"{what}: invalid positive"
    assert bool((y[a] != y[n]).all()), f"{what}: invalid negative"
    return (((a * b + p) * b + n).sort().values,)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_miner(benchmark, request, case: str, impl: str) -> None:
    spec = CASES[case]
    member = spec.members[impl]
    grad = member.kind == "loss"  # else the miner call alone
    emb, labels = inputs()
    base_step = make_step(member, emb, labels)
    step = C.synced(base_step, DEVICE)

    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        out = C.measure(benchmark, request, step, DEVICE)
        record(benchmark, emb, spec, impl, out if grad else None)

        if grad:
            grad_emb = base_step.last_grad  # type: ignore[attr-defined]
            assert out.ndim == 0, f"{case}/{impl}: loss is not a scalar: {tuple(out.shape)}"
            assert torch.isfinite(out), f"{case}/{impl}: non-finite loss {out}"
            assert torch.isfinite(grad_emb).all(), f"{case}/{impl}: non-finite gradient"
            assert grad_emb.shape == emb.shape
            LOSSES[(case, impl, BATCH)] = float(out)
        elif member.mined is None:  # the mining floor
            assert torch.isfinite(out).all(), f"{case}/{impl}: non-finite result"

        if member.mined is not None:
            # a mining-only step's result is what the miner selected: check that one
            keys = mined_keys(case, impl, None if grad else out)
            benchmark.extra_info["mined"] = [int(k.numel()) for k in keys]
        if member.check is not None:
            member.check(emb.detach(), labels)

        for (case_a, impl_a), (case_b, impl_b), rtol in PARITY:
            if (case, impl) not in ((case_a, impl_a), (case_b, impl_b)):
                continue
            ours, theirs = mined_keys(case_a, impl_a), mined_keys(case_b, impl_b)
            assert len(ours) == len(theirs) and all(
                torch.equal(u, v) for u, v in zip(ours, theirs, strict=True)
            ), (
                f"{case_a}/{impl_a} and {case_b}/{impl_b} mine different tuples: "
                f"{[k.numel() for k in ours]} vs {[k.numel() for k in theirs]}"
            )
            if grad:
                value_a = loss_value(CASES[case_a], impl_a, BATCH)
                value_b = loss_value(CASES[case_b], impl_b, BATCH)
                assert math.isclose(value_a, value_b, rel_tol=rtol, abs_tol=ATOL if rtol else 0), (
                    f"{case_a}/{impl_a}={value_a!r} and {case_b}/{impl_b}={value_b!r} disagree "
                    f"(rtol={rtol}) at batch {BATCH}"
                )
