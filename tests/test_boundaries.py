"""Values exactly on a threshold, and indices exactly on a range's ends (issue 36, items 1 and 5).

Part 1, thresholds: every comparison of a miner, a loss or a reducer against a hyper-parameter is
one row of :data:`TABLE` (the function, the hyper-parameter, pmlfunc's comparison, PML 2.9.0's
comparison where PML has the function). Each row's check builds exact inputs with entries
exactly on the boundary, so that ``d == margin`` holds in floating point: cosine similarities of
``±1`` vectors are multiples of ``1/4`` (8 dimensions) or ``1/8`` (16), a distance ``1 − s`` too,
and hand-written matrices hold dyadic numbers. The check then compares with PML on the very
same matrix (a PML distance whose ``compute_mat`` returns it, so the losses' gradients reach
it), and with the rule itself: whether the entries on the boundary were selected (miners) or
counted (a reducer's window). :data:`EXEMPT` lists the hyper-parameters that enter no
comparison (a shift of a logit, a scale, a count), each with the reason;
``test_every_threshold_hyper_parameter_has_a_row_or_a_reason`` fails for a public miner, loss or
reducer whose hyper-parameter is in neither.

Part 2, indices: every function that takes indices (PML tuples read by the losses, the labels'
masks and the sample weights; a miner's ``MinedTriplets`` read by a loss; manifold's
meta-classes; class labels of the learnable losses; evaluation's neighbour indices, relevant ids
and text-to-image ids; the samplers' dataset indices and hierarchy columns; the cross-batch
memory's state) is a row of :data:`INDEX_ROWS`, tested one step outside each end of its range
(``-size - 1`` and ``size`` where negative indices wrap, ``low - 1`` and ``high`` otherwise: the
exception's exact type, and the argument named at the start of its message) and at both ends
(``-size`` and ``size - 1``: accepted, with the wrapped index's result).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

import pmlfunc as pf
from pmlfunc import _ops
from pmlfunc.losses import neighbors as _neighbors
from pmlfunc.losses import triplets as _triplets

F64 = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-14}  # exact inputs: the two libraries differ by roundings

# ----------------------------------------------------------------------------------------------
# Exact inputs


def _signs(seed: int, rows: int, dim: int) -> torch.Tensor:
    """``(rows, dim)`` random ``±1`` entries: their cosines ``x·y / dim`` are exact multiples
    of ``2/dim`` (``x·y`` is an even integer)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (rows, dim), generator=g) * 2 - 1).to(F64)


LABELS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
X8 = _signs(0, 10, 8)
SIM = X8 @ X8.T / 8  # cosine similarities, multiples of 1/4, many ties
DIST = 1.0 - SIM  # an exact "distance": 0 on the diagonal, multiples of 1/4 in [0, 2]
EMB = torch.zeros(10, 1, dtype=F64)  # the rows whose matrix `mat=` is (neither library reads it)


def _masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Self mode's positive (same label, not the diagonal) and negative pair masks."""
    same = labels.unsqueeze(1) == labels.unsqueeze(0)
    return same & ~torch.eye(len(labels), dtype=torch.bool), ~same


POS, NEG = _masks(LABELS)

# orientation -> (matrix, pmlfunc distance, PML distance class): mat= is read as this distance
ORIENTATIONS = {
    "distance": (DIST, pf.distances.lp, pml_distances.LpDistance),
    "similarity": (SIM, pf.distances.cosine, pml_distances.CosineSimilarity),
}


def given(mat: torch.Tensor, base: type = pml_distances.LpDistance):
    """A PML distance of class ``base`` whose matrix is a copy of ``mat`` (gradients reach
    ``mat``; PML's miners write into their matrix)."""

    class Given(base):
        def compute_mat(self, query_emb, ref_emb):
            return mat.clone()

    return Given()


def _median(mat: torch.Tensor, mask: torch.Tensor) -> float:
    """A value that occurs among the masked entries, with entries strictly on both sides."""
    values = mat[mask].unique()
    assert values.numel() >= 3, "the data needs three distinct values to put one on a boundary"
    return float(values[values.numel() // 2])


def _on(x: torch.Tensor, bound: float, mask: torch.Tensor) -> torch.Tensor:
    """The masked entries exactly equal to ``bound`` (asserting that there are some)."""
    on = mask & (x == bound)
    assert on.any(), f"no entry exactly on the boundary {bound}: the case would prove nothing"
    return on


def _grid(shape: tuple[int, ...], *index: torch.Tensor) -> torch.Tensor:
    """Multiplicities of the index tuples ``index`` over a grid of ``shape``."""
    out = torch.zeros(shape, dtype=F64)
    return out.index_put_(
        tuple(i.long() for i in index), torch.ones((), dtype=F64), accumulate=True
    )


def _same_pairs(mined: pf.tuples.MinedPairs, pml: tuple, shape=(10, 10)) -> None:
    """A pmlfunc pair result equals PML's ``(a1, p, a2, n)`` as multiplicities."""
    a1, p, a2, n = pml
    torch.testing.assert_close(mined.pos.to(F64), _grid(shape, a1, p), rtol=0, atol=0)
    torch.testing.assert_close(mined.neg.to(F64), _grid(shape, a2, n), rtol=0, atol=0)


def _spy(module, name: str):
    """Patch ``module.name`` with a wrapper that records its calls (to assert a path ran)."""
    return mock.patch.object(module, name, wraps=getattr(module, name))


def _leaf(mat: torch.Tensor) -> torch.Tensor:
    return mat.detach().clone().requires_grad_(True)


def _value_and_grad(out: torch.Tensor, *leaves: torch.Tensor) -> tuple[torch.Tensor, list]:
    """``out`` and its gradients (zeros where it does not depend on a leaf: PML's zero loss)."""
    if not out.requires_grad:
        return out.detach(), [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    return out.detach(), [
        torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)
    ]


def _same_loss(ours: Callable, theirs: Callable, mat: torch.Tensor, **tol) -> torch.Tensor:
    """``ours(m)`` and ``theirs(m)`` on leaf copies of ``mat``: equal values and gradients."""
    m1, m2 = _leaf(mat), _leaf(mat)
    a = _value_and_grad(ours(m1), m1)
    assert_same(a, _value_and_grad(theirs(m2), m2), **(tol or EXACT))
    return a[0]


# ----------------------------------------------------------------------------------------------
# Miners


def _pair_margin(side: str) -> None:
    """Margins at the median of the positive (negative) pairs' values: PML's pairs, and none
    of the pairs exactly on the margin (both comparisons are strict), either orientation."""
    for mat, ours_d, pml_d in ORIENTATIONS.values():
        pm, nm = _median(mat, POS), _median(mat, NEG)
        mined = pf.miners.pair_margin(
            EMB, LABELS, pos_margin=pm, neg_margin=nm, distance=ours_d(), mat=mat
        )
        pml = pml_miners.PairMarginMiner(pos_margin=pm, neg_margin=nm, distance=given(mat, pml_d))
        _same_pairs(mined, pml(EMB, LABELS))
        kept, on = (
            (mined.pos, _on(mat, pm, POS)) if side == "pos" else (mined.neg, _on(mat, nm, NEG))
        )
        assert (kept[on] == 0).all(), "a pair exactly on the margin was mined (the rule is strict)"


def _multi_similarity(side: str) -> None:
    """An epsilon that puts pairs exactly at ``hardest ± ε``: PML's pairs, none of those."""
    for name, (mat, ours_d, pml_d) in ORIENTATIONS.items():
        sign = 1.0 if name == "similarity" else -1.0  # s = sign · mat
        s = sign * mat
        hardest_neg = torch.where(NEG, s, -torch.inf).amax(-1, keepdim=True)
        hardest_pos = torch.where(POS, s, torch.inf).amin(-1, keepdim=True)
        found = False
        for eps in (0.25, 0.5, 0.75):  # the first epsilon that puts a pair on its boundary
            on = (
                (POS & (s - eps == hardest_neg))
                if side == "pos"
                else (NEG & (s + eps == hardest_pos))
            )
            if on.any():
                found = True
                break
        assert found, "no epsilon puts a pair exactly on the boundary"
        mined = pf.miners.multi_similarity(EMB, LABELS, epsilon=eps, distance=ours_d(), mat=mat)
        pml = pml_miners.MultiSimilarityMiner(epsilon=eps, distance=given(mat, pml_d))
        _same_pairs(mined, pml(EMB, LABELS))
        kept = mined.pos if side == "pos" else mined.neg
        assert (kept[on] == 0).all(), "a pair exactly on the epsilon boundary was mined"


def _triplet_cube(kind: str, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, valid)`` over the ``(B, M, M)`` cube: ``t = e_an − e_ap`` and the label triplets."""
    e = mat if kind == "distance" else -mat
    t = e.unsqueeze(-2) - e.unsqueeze(-1)
    return t, POS.unsqueeze(-1) & NEG.unsqueeze(-2)


# type_of_triplets -> (bounds on t that are inclusive, bounds that are exclusive), margin m
_WINDOWS = {
    "all": ((0.25,), ()),
    "hard": ((0.0,), ()),
    "semihard": ((0.25,), (0.0,)),
    "easy": ((), (0.25,)),
}


def _triplet_margin_miner(type_of_triplets: str) -> None:
    """``m = 1/4`` with many triplets at ``t = m`` and ``t = 0``, read four ways: triplet by
    triplet, by the window's search, sampled with ``tuples_per_anchor``, and by the triplet
    loss's sorted path; each is PML's, and the bounds' inclusion is :data:`_WINDOWS`'."""
    margin = 0.25
    for kind, (mat, ours_d, pml_d) in ORIENTATIONS.items():
        leaf = _leaf(mat)
        window = pf.miners.triplet_margin(
            EMB,
            LABELS,
            margin=margin,
            type_of_triplets=type_of_triplets,
            distance=ours_d(),
            mat=leaf,
        )
        pml = pml_miners.TripletMarginMiner(
            margin=margin, type_of_triplets=type_of_triplets, distance=given(mat, pml_d)
        )
        a, p, n = pml(EMB, LABELS)
        want = _grid((10, 10, 10), a, p, n)
        # 1. the window compared triplet by triplet (to_indices, and losses off the fast path)
        torch.testing.assert_close(_grid((10, 10, 10), *window.to_indices()), want, rtol=0, atol=0)
        # 2. the window searched (pair multiplicities: PML's convert_to_pairs of the triplets)
        pos, neg = window.pair_masks(None, F64)
        torch.testing.assert_close(pos, _grid((10, 10), a, p), rtol=0, atol=0)
        torch.testing.assert_close(neg, _grid((10, 10), a, n), rtol=0, atol=0)
        # 3. a random subset of at most k per anchor, with k above every count: all of them
        sampled = pf.miners.triplet_margin(
            EMB,
            LABELS,
            margin=margin,
            type_of_triplets=type_of_triplets,
            distance=ours_d(),
            mat=mat,
            tuples_per_anchor=100,
            generator=torch.Generator().manual_seed(0),
        )
        torch.testing.assert_close(_grid((10, 10, 10), *sampled.to_indices()), want, rtol=0, atol=0)
        # 4. the triplet loss (same margin) on the window of its own matrix: the sorted path,
        # with the hinges of the triplets at t == margin exactly 0 (not counted)
        _same_window_loss(window, leaf, margin, (a, p, n), ours_d, pml_d)
        # the rule itself, on the entries exactly on each bound
        t, valid = _triplet_cube(kind, mat)
        inclusive, exclusive = _WINDOWS[type_of_triplets]
        for bound in inclusive:
            assert (want[_on(t, bound, valid)] == 1).all(), f"t == {bound} must be mined"
        for bound in exclusive:
            assert (want[_on(t, bound, valid)] == 0).all(), f"t == {bound} must not be mined"


def _same_window_loss(window, leaf, margin, pml_triplets, ours_d, pml_d) -> None:
    """The triplet loss on a window of its own ``mat`` (the sorted path) equals PML's loss on
    PML's triplets, value and gradient."""
    with _spy(_triplets, "_window_hinge_stats") as fast:
        ours = pf.losses.triplet_margin(
            EMB, LABELS, margin=margin, distance=ours_d(), mat=leaf, indices_tuple=window
        )
    assert fast.called, "the loss did not take the window's sorted path"
    m2 = _leaf(leaf)
    theirs = pml_losses.TripletMarginLoss(margin=margin, distance=given(m2, pml_d))(
        EMB, LABELS, indices_tuple=pml_triplets
    )
    assert_same(_value_and_grad(ours, leaf), _value_and_grad(theirs, m2), **EXACT)


def _batch_easy_hard(parameter: str) -> None:
    """``"semihard"`` keeps a pair strictly on the near side of the other side's choice;
    ``allowed_*_range=(low, high)`` keeps ``low ≤ d ≤ high``."""
    cases = {
        "pos_strategy": [("semihard", "hard", None, None), ("semihard", "easy", None, None)],
        "neg_strategy": [("hard", "semihard", None, None), ("easy", "semihard", None, None)],
        "allowed_pos_range": [
            ("hard", "hard", (0.75, 1.25), None),
            ("all", "easy", (0.75, 1.25), None),
        ],
        "allowed_neg_range": [
            ("easy", "hard", None, (0.75, 1.25)),
            ("easy", "all", None, (0.75, 1.25)),
        ],
    }[parameter]
    boundary_hits = 0
    for kind, (mat, ours_d, pml_d) in ORIENTATIONS.items():
        for pos_s, neg_s, pos_r, neg_r in cases:
            if kind == "similarity" and (pos_r or neg_r):
                pos_r = pos_r and (1 - pos_r[1], 1 - pos_r[0])  # the same pairs as similarities
                neg_r = neg_r and (1 - neg_r[1], 1 - neg_r[0])
            kw = {"pos_strategy": pos_s, "neg_strategy": neg_s}
            kw |= {"allowed_pos_range": pos_r, "allowed_neg_range": neg_r}
            mined = pf.miners.batch_easy_hard(EMB, LABELS, distance=ours_d(), mat=mat, **kw)
            pml = pml_miners.BatchEasyHardMiner(distance=given(mat, pml_d), **kw)
            _same_pairs(mined, pml(EMB, LABELS))
            boundary_hits += _easy_hard_boundary(parameter, kind, mat, mined, kw)
    assert boundary_hits, "no pair exactly on the boundary in any case: the test proves nothing"


def _easy_hard_boundary(parameter, kind, mat, mined, kw) -> int:
    """Check the rule on the pairs exactly on the boundary; return how many decided it."""
    e = mat if kind == "distance" else -mat  # smaller = closer
    if parameter.endswith("range"):
        side = "pos" if parameter == "allowed_pos_range" else "neg"
        low, high = kw[parameter]
        got = mined.pos if side == "pos" else mined.neg
        on = (POS if side == "pos" else NEG) & ((mat == low) | (mat == high))
        if kw[f"{side}_strategy"] == "all":
            assert (got[on] == 1).all(), "a pair on an end of the allowed range was dropped"
        return int(got[on].sum())  # the ends are allowed: pairs on them get chosen
    # semihard: strictly nearer (positives) or farther (negatives) than the other side's choice,
    # which is the row's nearest / farthest pair of that side, whatever this side holds
    other, this = (NEG, POS) if parameter == "pos_strategy" else (POS, NEG)
    strategy = kw["neg_strategy" if parameter == "pos_strategy" else "pos_strategy"]
    far = (strategy == "easy") if parameter == "pos_strategy" else (strategy == "hard")
    fill = -torch.inf if far else torch.inf
    picked = torch.where(other, e, fill)
    thr = picked.amax(-1, keepdim=True) if far else picked.amin(-1, keepdim=True)
    on = this & (e == thr)
    got = mined.pos if parameter == "pos_strategy" else mined.neg
    assert (got[on] == 0).all(), "a pair exactly as near as the other side's choice was kept"
    return int(on.sum())


def _angular() -> None:
    """``atan(‖a − p‖ / 2‖n − c‖) > angle``: anchor and positive 2e11 apart with the negative at
    their centre give an angle that rounds to exactly π/2 = radians(90) in float64 (in both
    libraries' arithmetic), so ``angle=90`` puts it on the boundary."""
    big = 1e11
    emb = torch.tensor([[big, 0.0], [-big, 0.0], [0.0, 0.0], [0.5, 0.25]], dtype=F64)
    labels = torch.tensor([0, 0, 1, 2])
    a, p, n = emb[0:1], emb[1:2], emb[2:3]
    angle = torch.atan(F.pairwise_distance(a, p) / (2 * F.pairwise_distance(n, (a + p) / 2)))
    assert float(angle) == math.radians(90), "the construction no longer lands on π/2"
    for degrees, expect_selected in ((90.0, False), (89.99, True)):
        mask = pf.miners.angular(emb, labels, angle=degrees).mask
        want = _grid((4, 4, 4), *pml_miners.AngularMiner(angle=degrees)(emb, labels))
        torch.testing.assert_close(mask.to(F64), want, rtol=0, atol=0)
        assert bool(mask[0, 1, 2]) is expect_selected and bool(mask[1, 0, 2]) is expect_selected


# a hand-written batch for distance_weighted: anchor rows 0-3 (classes 0, 0, 1, 1), 8 dimensions
_DW = torch.tensor(
    [
        [0.0, 0.5, 1.0, 1.0],  # row 0: both negatives exactly at 1.0
        [0.5, 0.0, 1.0, 0.75],  # row 1: one negative at 1.0, one below
        [1.0, 1.0, 0.0, 0.5],  # row 2: both at 1.0
        [1.0, 0.75, 0.5, 0.0],  # row 3: one below
    ],
    dtype=F64,
)


def _distance_weighted(parameter: str) -> None:
    """``max(d, cutoff) < nonzero_loss_cutoff``: a negative exactly at the cut-off (or clamped
    up to it) has weight 0. Rows whose negatives all have weight 0 get no triplet; the others
    always draw their one allowed negative, so the result is deterministic."""
    labels = torch.tensor([0, 0, 1, 1])
    emb = torch.zeros(4, 8, dtype=F64)
    if parameter == "nonzero_loss_cutoff":
        cutoff, nlc, allowed = 0.5, 1.0, {1: 3, 3: 1}  # anchor -> its one negative below 1.0
    else:  # cutoff == nonzero_loss_cutoff: every distance is clamped up to the cut-off
        cutoff, nlc, allowed = 1.0, 1.0, {}
    for seed in range(3):
        t = pf.miners.distance_weighted(
            emb, labels, cutoff=cutoff, nonzero_loss_cutoff=nlc, mat=_DW,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        keep = t.valid > 0
        got = set(zip(t.anchors[keep].tolist(), t.negatives[keep].tolist(), strict=True))
        assert got == set(allowed.items()), f"negatives drawn: {sorted(got)}"
        pml = pml_miners.DistanceWeightedMiner(
            cutoff=cutoff, nonzero_loss_cutoff=nlc, distance=given(_DW)
        )
        with torch.random.fork_rng():  # PML draws from the global generator
            torch.manual_seed(seed)
            a, _, n = pml(emb, labels)
        assert set(zip(a.tolist(), n.tolist(), strict=True)) == set(allowed.items())


def _hdc() -> None:
    """``⌈filter_percentage · P⌉`` hardest pairs: with ``f · P`` an integer exactly that many
    (PML's ``topk(k=ceil(...))``), and with ``0.14 · 50 = 7.000000000000001`` eight (as PML)."""
    x11 = _signs(1, 11, 8)
    cases = [(DIST, LABELS, 0.5), (1.0 - x11 @ x11.T / 8, torch.tensor([0] * 5 + [1] * 6), 0.14)]
    for mat, labels, fraction in cases:
        pos, neg = _masks(labels)
        b = len(labels)
        mined = pf.miners.hdc(
            torch.zeros(b, 1, dtype=F64), labels, filter_percentage=fraction, mat=mat
        )
        pml = pml_miners.HDCMiner(filter_percentage=fraction, distance=given(mat))
        a1, p, a2, n = pml(torch.zeros(b, 1, dtype=F64), labels)
        for got, mask, rows, cols in ((mined.pos, pos, a1, p), (mined.neg, neg, a2, n)):
            count = int(mask.sum())
            assert int(got.sum()) == len(rows) == math.ceil(fraction * count)
            assert fraction != 0.14 or count != 50 or fraction * count > 7
            # ties at the boundary may pick other indices: the selected distances are PML's
            assert sorted(mat[got > 0].tolist()) == sorted(mat[rows, cols].tolist())
    assert 0.5 * int(POS.sum()) == int(0.5 * int(POS.sum())), "f · P must be an integer here"


def _uniform_histogram() -> None:
    """Bins ``[e_i, e_{i+1})``, the last one ``[e_{K−1}, e_K]``: each pair below sits exactly on
    an edge and each bin holds one value, so every value gets exactly ``pos_per_bin`` draws."""
    # 2 queries (classes 0, 1) against 4 references (0, 0, 1, 1), edges 0, 1/4, 1/2, 3/4, 1
    mat = torch.tensor([[0.0, 0.25, 0.5, 0.75], [1.0, 1.5, 0.5, 1.0]], dtype=F64)
    labels, ref_labels = torch.tensor([0, 1]), torch.tensor([0, 0, 1, 1])
    emb, ref = torch.zeros(2, 1, dtype=F64), torch.zeros(4, 1, dtype=F64)
    per_bin = 5
    ours = pf.miners.uniform_histogram(
        emb, labels, ref_emb=ref, ref_labels=ref_labels, mat=mat, num_bins=4,
        pos_per_bin=per_bin, neg_per_bin=per_bin, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    pml = pml_miners.UniformHistogramMiner(
        num_bins=4, pos_per_bin=per_bin, neg_per_bin=per_bin, distance=given(mat)
    )
    with torch.random.fork_rng():  # PML draws from the global generator
        torch.manual_seed(0)
        a1, p, a2, n = pml(emb, labels, ref, ref_labels)
    # positives 0, 1/4 | 1/2 | 1 on the edges of [0, 1]; negatives 1/2, 3/4, 1, 3/2 on [1/2, 3/2]
    want = torch.full((2, 4), float(per_bin), dtype=F64)
    torch.testing.assert_close(ours.pos + ours.neg, want, rtol=0, atol=0)
    torch.testing.assert_close(_grid((2, 4), a1, p) + _grid((2, 4), a2, n), want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Losses: a hinge exactly at 0 is not "nonzero" (avg_nonzero, a divisor), a selection rule
# (TCM, ranked list, ...) on a pair exactly at its margin


def _ours(loss: Callable, emb=EMB, labels=LABELS, **kw) -> Callable:
    """``m ↦ loss(emb, labels, mat=m, **kw)``."""
    return lambda m: loss(emb, labels, mat=m, **kw)


def _theirs(loss: type, base: type, emb=EMB, labels=LABELS, call=None, **kw) -> Callable:
    """``m ↦`` PML's ``loss(distance=given(m, base), **kw)(emb, labels, **call)``."""
    return lambda m: loss(distance=given(m, base), **kw)(emb, labels, **(call or {}))


def _contrastive(
    parameter: str, loss=pf.losses.contrastive, pml_loss=pml_losses.ContrastiveLoss
) -> None:
    """``[d_ap − m_pos]_+`` and ``[m_neg − d_an]_+`` (similarities: flipped) are 0 exactly at the
    margin, where avg_nonzero does not count them (PML: the same)."""
    if loss is pf.losses.contrastive:
        orientations = ORIENTATIONS.values()
    else:  # the SNR distance: mat= is read as one
        orientations = [(DIST, pf.distances.snr, pml_distances.SNRDistance)]
    for mat, ours_d, pml_d in orientations:
        pm, nm = _median(mat, POS), _median(mat, NEG)
        _on(mat, pm if parameter == "pos_margin" else nm, POS if parameter == "pos_margin" else NEG)
        margins = {"pos_margin": pm, "neg_margin": nm}
        _same_loss(
            _ours(loss, distance=ours_d(), **margins), _theirs(pml_loss, pml_d, **margins), mat
        )


def _snr_contrastive(parameter: str) -> None:
    loss = pml_losses.SignalToNoiseRatioContrastiveLoss
    _contrastive(parameter, pf.losses.signal_to_noise_ratio_contrastive, loss)


# how the all-triplet hinge is counted -> (the patches that select the path, what must run)
_TRIPLET_PATHS = {
    "sorted bits": ({}, "_merged_order_bits"),  # one merged sort of integer keys
    "sorted floats": ({"bitcast": False}, "_merged_order_floats"),  # vmap on older PyTorch
    "listed positives": ({"sparse": math.inf}, "_listed_hinge_stats"),  # few positives: no sort
}


@contextlib.contextmanager
def _path(bitcast: bool = True, sparse: float = 0.0) -> Iterator[None]:
    """Select a loss path: ``sparse`` is ``_ops.SPARSE_FRACTION`` (0: never list a row's
    columns, inf: always), ``bitcast`` whether the triplet losses may sort integer keys."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_ops, "SPARSE_FRACTION", sparse))
        if not bitcast:
            stack.enter_context(mock.patch.object(_triplets, "bitcast_ok", lambda: False))
        yield


def _triplet_margin_loss() -> None:
    """``[e_ap − e_an + m]_+`` is counted by avg_nonzero iff ``e_an < e_ap + m`` (PML: relu,
    then ``> 0``): with ``m = 1/4`` many triplets sit exactly at 0. Every way the loss counts
    them: the sorted paths, the listed-positives path, a PML triplet tuple."""
    margin = 0.25
    triplets = lmu.get_all_triplets_indices(LABELS)
    for kind, (mat, ours_d, pml_d) in ORIENTATIONS.items():
        t, valid = _triplet_cube(kind, mat)
        _on(t, margin, valid)
        ours = _ours(pf.losses.triplet_margin, margin=margin, distance=ours_d())
        theirs = _theirs(pml_losses.TripletMarginLoss, pml_d, margin=margin)
        for patch, runs in _TRIPLET_PATHS.values():
            with _path(**patch), _spy(_triplets, runs) as ran:
                _same_loss(ours, theirs, mat)
            assert ran.called, f"the loss did not take its path through {runs}"
        listed = _ours(
            pf.losses.triplet_margin, margin=margin, distance=ours_d(), indices_tuple=triplets
        )
        _same_loss(listed, theirs, mat)


def _margin_loss(parameter: str) -> None:
    """``[d_ap − β + α]_+ + [β − d_an + α]_+``: a part exactly at 0 is not counted in the
    divisor (PML: ``pos_loss > 0``). ``α = 1/4``, ``β = 1`` (distances) or ``1/2``
    (similarities), exact in PML's float32."""
    alpha = 0.25
    triplets = lmu.get_all_triplets_indices(LABELS)
    for kind, (mat, ours_d, pml_d) in ORIENTATIONS.items():
        s, beta = (1.0, 1.0) if kind == "distance" else (-1.0, 0.5)
        _on(s * (mat - beta) + alpha, 0.0, POS)
        _on(s * (beta - mat) + alpha, 0.0, NEG)
        theirs = _theirs(pml_losses.MarginLoss, pml_d, margin=alpha, beta=beta)
        for tup in (None, triplets):  # every (a, p) × (a, n), then a listed tuple
            kw = {"margin": alpha, "beta": beta, "distance": ours_d(), "indices_tuple": tup}
            _same_loss(_ours(pf.losses.margin, **kw), theirs, mat)


# the lifted-structure batch: rows 0, 1 (class 0) and 2, 3 (class 1); the 1000s underflow in
# every log-sum-exp, so each one is its single finite term exactly
_LIFTED = torch.tensor(
    [[0.0, 0.5, 0.5, 1e3], [0.5, 0.0, 1e3, 1e3], [0.5, 1e3, 0.0, 0.75], [1e3, 1e3, 0.75, 0.0]],
    dtype=F64,
)


def _lifted(loss, pml_loss) -> None:
    """The lifted losses' hinge ``[log Σ e^{m_neg − d_an} + d_ap − m_pos]_+`` is 0 exactly for
    the pair (0, 1) (``lse = 1/2``, ``d = 1/2``, both margins 1) and ``1/4`` for (2, 3): with
    avg_nonzero the zero is not counted (PML: the same)."""
    labels = torch.tensor([0, 0, 1, 1])
    emb = torch.zeros(4, 1, dtype=F64)
    value = _same_loss(
        lambda m: loss(
            emb, labels, neg_margin=1.0, pos_margin=1.0, mat=m, reducer=pf.reducers.avg_nonzero()
        ),
        lambda m: pml_loss(
            neg_margin=1.0,
            pos_margin=1.0,
            distance=given(m),
            reducer=pml_reducers.AvgNonZeroReducer(),
        )(emb, labels),
        _LIFTED,
    )
    assert value > 0


def _lifted_structure() -> None:
    _lifted(pf.losses.lifted_structure, pml_losses.LiftedStructureLoss)


def _generalized_lifted() -> None:
    _lifted(pf.losses.generalized_lifted_structure, pml_losses.GeneralizedLiftedStructureLoss)


def _circle() -> None:
    """``α_p = [1 + m − s_ap]_+`` and ``α_n = [s_an + m]_+`` are 0 exactly at ``s_ap = 1 + m``,
    ``s_an = −m``: no comparison, the value and the (detached-weight) gradient equal PML's."""
    mat = SIM.clone()
    mat[0, 1] = mat[1, 0] = 1.0  # a duplicated positive: s_ap = 1 = 1 + m with m = 0
    _on(mat, 0.0, NEG)
    _same_loss(
        lambda m: pf.losses.circle(EMB, LABELS, m=0.0, gamma=8.0, mat=m),
        lambda m: pml_losses.CircleLoss(
            m=0.0, gamma=8.0, distance=given(m, pml_distances.CosineSimilarity)
        )(EMB, LABELS),
        mat,
    )


def _threshold_consistent_margin(parameter: str) -> None:
    """Positives with ``s_ap ≤ m⁺``, negatives with ``s_an ≥ m⁻`` (PML: ``<=``, ``>=``). PML
    computes its cosines from the embeddings, so they are ``±1`` vectors in 16 dimensions
    (norm 4: exact cosines, multiples of 1/8), and pmlfunc gets the same embeddings."""
    x = _signs(2, 10, 16)
    s = x @ x.T / 16
    mp, mm = _median(s, POS), _median(s, NEG)
    _on(s, mp if parameter == "margin_plus" else mm, POS if parameter == "margin_plus" else NEG)
    kw = {"margin_plus": mp, "margin_minus": mm, "lambda_plus": 1.0, "lambda_minus": 1.0}
    ours = pf.losses.threshold_consistent_margin(x, LABELS, **kw)
    theirs = pml_losses.ThresholdConsistentMarginLoss(**kw)(x, LABELS)
    torch.testing.assert_close(ours, theirs.to(F64), **EXACT)


def _intra_pair_variance(parameter: str) -> None:
    """``[(1 − ε_+) μ_+ − s_ap]_+²`` is 0 exactly at ``s_ap = μ_+`` (``ε = 0``): not counted by
    avg_nonzero (PML: the same). Positive pairs 1/4, 1/2, 3/4 per class (mean 1/2), negative
    pairs 0, 1/4, 1/2 (mean 1/4)."""
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    within = torch.tensor([[1.0, 0.25, 0.5], [0.25, 1.0, 0.75], [0.5, 0.75, 1.0]], dtype=F64)
    across = torch.tensor([[0.0, 0.25, 0.5], [0.25, 0.5, 0.0], [0.5, 0.0, 0.25]], dtype=F64)
    mat = torch.cat([torch.cat([within, across], 1), torch.cat([across.T, within], 1)], 0)
    emb = torch.zeros(6, 1, dtype=F64)
    pos, neg = _masks(labels)
    _on(mat, 0.5, pos)
    _on(mat, 0.25, neg)
    kw = {"pos_eps": 0.0, "neg_eps": 0.0}
    _same_loss(
        _ours(pf.losses.intra_pair_variance, emb, labels, reducer=pf.reducers.avg_nonzero(), **kw),
        _theirs(
            pml_losses.IntraPairVarianceLoss, pml_distances.CosineSimilarity, emb, labels,
            reducer=pml_reducers.AvgNonZeroReducer(), **kw,
        ),
        mat,
    )  # fmt: skip


def _ranked_list(parameter: str) -> None:
    """Positives with ``d > α − m``, negatives with ``d < α`` (and ``d > 0``; PML: the same),
    ``m = 1/4``, ``α = 1``."""
    margin, alpha = 0.25, 1.0
    _on(DIST, alpha - margin, POS)
    _on(DIST, alpha, NEG)
    _same_loss(
        lambda m: pf.losses.ranked_list(
            EMB, LABELS, margin=margin, alpha=alpha, Tn=1.0, Tp=1.0, mat=m
        ),
        lambda m: pml_losses.RankedListLoss(
            margin=margin, alpha=alpha, Tn=1.0, Tp=1.0, distance=given(m)
        )(EMB, LABELS),
        DIST,
    )


def _manifold() -> None:
    """``z = x_k − x_own + m`` enters the log-sum-exp when ``z ≥ 0`` (PML: ``z < 0`` becomes
    ``−inf``). ``x`` comes out of a matrix inverse in the loss, so the rule is tested on the
    loss's helper with exact ``x`` (multiples of 1/4), against PML's masking written out."""
    x = SIM[:6, :5]  # six samples, five proxies
    own = F.one_hot(torch.tensor([0, 1, 2, 3, 4, 0]), 5).to(F64)
    margin = 0.25
    z = x - (x * own).sum(-1, keepdim=True) + margin
    _on(z, 0.0, own == 0)
    pml = z.masked_fill(own > 0, -torch.inf)
    pml = pml.masked_fill(pml < 0, -torch.inf)
    want = torch.log(1 + torch.exp(pml).sum(-1))
    torch.testing.assert_close(_neighbors._manifold_part(x, own, margin), want, **EXACT)


def _selectively_contrastive(parameter: str) -> None:
    """No PML counterpart. A triplet is hard when ``s_an > s_ap`` (ties are not) or, with
    ``hard_cutoff=c``, when ``s_an > c``: checked against the documented formula."""
    cutoff = 0.25 if parameter == "hard_cutoff" else None
    mat = SIM.clone()
    s_ap = torch.where(POS, mat, -torch.inf).amax(-1)
    s_an = torch.where(NEG, mat, -torch.inf).amax(-1)
    if cutoff is None:  # raise anchor 0's easiest positive to its hardest negative: a tie
        assert s_an[0] > s_ap[0]
        mat[0, torch.where(POS[0], mat[0], -torch.inf).argmax()] = s_ap[0] = s_an[0]
    else:
        assert ((s_an == cutoff) & (s_an <= s_ap)).any(), (
            "no hardest negative exactly at the cut-off"
        )
    hard = (s_an > s_ap) | ((s_an > cutoff) if cutoff is not None else False)
    per_anchor = torch.where(hard, 1.0 * s_an, F.softplus((s_an - s_ap) / 0.5))
    want = per_anchor.mean()
    got = pf.losses.selectively_contrastive_triplet(
        EMB, LABELS, temperature=0.5, penalty=1.0, hard_cutoff=cutoff, mat=mat
    )
    torch.testing.assert_close(got, want, **EXACT)


def _multi_supcon() -> None:
    """No PML 2.9.0 counterpart (PML's later multi-label code: ``jaccard > threshold``).
    Positives are ``J > threshold``: with ``J = 1/2`` exactly on ``threshold=0.5`` the loss
    equals the loss on the pairs of that rule given as a tuple, not on those of ``J ≥ 1/2``."""
    labels = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [0, 1, 0], [0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.int64
    )
    y = labels.to(F64)
    inter = y @ y.T
    jac = inter / (y.sum(-1, keepdim=True) + y.sum(-1) - inter)
    off = ~torch.eye(6, dtype=torch.bool)
    _on(jac, 0.5, off)
    emb = X8[:6]

    def pairs(pos):
        a1, p = torch.where(pos & off)
        a2, n = torch.where(~pos & off)
        return a1, p, a2, n

    got = pf.losses.multi_supcon(emb, labels, threshold=0.5)
    strict = pf.losses.multi_supcon(emb, labels, threshold=0.5, indices_tuple=pairs(jac > 0.5))
    inclusive = pf.losses.multi_supcon(emb, labels, threshold=0.5, indices_tuple=pairs(jac >= 0.5))
    torch.testing.assert_close(got, strict, **EXACT)
    assert not torch.allclose(got, inclusive), "the boundary pairs do not change the loss"


def _arcface() -> None:
    """The target logit is ``cos(θ + m)`` for ``θ ≤ π − m``, else ``cos θ − m sin m`` (PML:
    ``angles <= pi - margin``; pmlfunc: ``cos θ ≥ −cos m``). With ``m = 6°`` and the target
    cosine exactly ``−cos m`` (a class weight of float norm exactly 1), ``acos`` of it is
    exactly ``π − m`` in float64: the first branch in both (the second gives another value)."""
    m = float(np.radians(6.0))
    c = -math.cos(m)
    assert torch.acos(torch.tensor(c, dtype=F64)).item() == np.deg2rad(180) - m
    s = math.sqrt(1 - c * c)
    row = next(
        torch.tensor([c, s + k * float(np.spacing(s))], dtype=F64)
        for k in range(-64, 64)
        if torch.linalg.vector_norm(torch.tensor([c, s + k * float(np.spacing(s))], dtype=F64))
        == 1.0
    )
    weight = torch.stack(
        [row, torch.tensor([0.0, 1.0], dtype=F64), torch.tensor([1.0, 0.0], dtype=F64)]
    )
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=F64)
    labels = torch.tensor([0, 2, 1])  # no target cosine of ±1 (PML's acos has a NaN slope)
    pml = pml_losses.ArcFaceLoss(3, 2, margin=6.0, scale=64.0)
    pml.W.data = weight.T.clone()
    w = weight.clone().requires_grad_(True)
    e1, e2 = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    ours = pf.losses.arcface(e1, labels, {"weight": w}, margin=m, scale=64.0)
    theirs_value, (theirs_emb, theirs_w) = _value_and_grad(pml(e2, labels), e2, pml.W)
    assert_same(_value_and_grad(ours, e1, w), (theirs_value, [theirs_emb, theirs_w.T]), **EXACT)


def _dynamic_soft_margin() -> None:
    """A value's segment is ``⌊(v − min_val)/Δ⌋`` (an edge belongs to the upper segment; PML:
    ``torch.floor``), and the loss reads the histogram's CDF at it. ``Δ = 1/2``
    (``min_val = −2``, 8 bins) and ``v = d_ap − d_an`` multiples of 1/8: many exactly on edges."""
    mat = DIST / 2
    t, valid = _triplet_cube("distance", mat)
    v = -t  # d_ap − d_an
    assert (valid & (((v + 2) / 0.5) == ((v + 2) / 0.5).floor())).any()
    state = pf.losses.dynamic_soft_margin_init_state(num_bins=8, dtype=F64)
    _same_loss(
        lambda m: pf.losses.dynamic_soft_margin(
            EMB, LABELS, state, min_val=-2.0, num_bins=8, mat=m
        )[0],
        lambda m: pml_losses.DynamicSoftMarginLoss(min_val=-2.0, num_bins=8, distance=given(m))(
            EMB, LABELS
        ),
        mat,
    )


# ----------------------------------------------------------------------------------------------
# Reducers: threshold(low, high) keeps low < loss < high, avg_nonzero loss > 0 (PML: the same)

_ELEMENTS = torch.tensor([0.0, 0.25, 0.25, 0.5, 0.75, 0.75, 1.0], dtype=F64)


def _pml_reduce(reducer, losses: torch.Tensor) -> torch.Tensor:
    info = {"losses": losses, "indices": torch.arange(len(losses)), "reduction_type": "element"}
    return reducer({"loss": info}, torch.zeros(len(losses), 1, dtype=F64), None)


def _weighted_terms(out: dict) -> torch.Tensor:
    """The loss values of every term with a weight, from a loss's ``reducer=none()`` output."""
    return torch.cat([t["losses"][t["weights"] > 0].reshape(-1) for t in out.values()])


# the losses a reducer is tested on: name -> (pmlfunc loss, PML loss class, their kwargs) on DIST
_REDUCED = {
    "contrastive": (pf.losses.contrastive, pml_losses.ContrastiveLoss, {"pos_margin": 0.25, "neg_margin": 1.25}),
    "triplet_margin": (pf.losses.triplet_margin, pml_losses.TripletMarginLoss, {"margin": 0.5}),
    "margin": (pf.losses.margin, pml_losses.MarginLoss, {"margin": 0.25, "beta": 1.0}),
}  # fmt: skip


def _reduced_like_pml(name: str, reducer, pml_reducer, bound: float) -> None:
    """``name``'s loss with ``reducer`` equals PML's with ``pml_reducer``, on ``DIST`` where
    some of its terms are exactly ``bound``."""
    loss, pml_loss, kw = _REDUCED[name]
    terms = _weighted_terms(loss(EMB, LABELS, mat=DIST, reducer=pf.reducers.none(), **kw))
    assert (terms == bound).any(), f"{name}: no term exactly at {bound}"
    ours = _ours(loss, reducer=reducer, **kw)
    _same_loss(ours, _theirs(pml_loss, pml_distances.LpDistance, reducer=pml_reducer, **kw), DIST)


def _threshold(parameter: str) -> None:
    """``threshold(low, high)`` on element terms, pair terms (contrastive), all-triplet terms
    (triplet_margin's cube) and the margin loss's sorted pair sums, each with terms exactly at
    ``low`` and ``high``: the same values as PML's ``ThresholdReducer``."""
    low, high = 0.25, 0.75
    reducer = pf.reducers.threshold(low=low, high=high)
    pml_reducer = pml_reducers.ThresholdReducer(low=low, high=high)
    got = reducer(pf.reducers.elements(_ELEMENTS))
    torch.testing.assert_close(got, _pml_reduce(pml_reducer, _ELEMENTS), **EXACT)
    torch.testing.assert_close(got, torch.tensor(0.5, dtype=F64), rtol=0, atol=0)
    for name in _REDUCED:
        _reduced_like_pml(name, reducer, pml_reducer, low if parameter == "low" else high)


def _subcenter_outliers() -> None:
    """An outlier's angle to its dominant sub-centre exceeds the threshold: a row exactly at it
    (threshold 0: a row parallel to its centre, cosine exactly 1) is kept, as PML keeps it, and
    the others (cosine < 1) are outliers."""
    weight = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=F64)  # two classes, one centre
    emb = torch.tensor([[2.0, 0.0], [2.0, 1.0], [0.0, 3.0], [1.0, 3.0]], dtype=F64)
    labels = torch.tensor([0, 0, 1, 1])
    outliers, _ = pf.losses.subcenter_arcface_outliers(
        emb, labels, {"weight": weight}, threshold=0.0
    )
    assert outliers.tolist() == [False, True, False, True]
    pml = pml_losses.SubCenterArcFaceLoss(num_classes=2, embedding_size=2, sub_centers=1)
    pml.W.data = weight.reshape(2, 2).t().clone().float()
    want, _ = pml.get_outliers(emb.float(), labels, threshold=0)
    assert sorted(want.tolist()) == outliers.nonzero().flatten().tolist()


def _avg_nonzero() -> None:
    """``avg_nonzero()`` counts ``loss > 0``: element terms, the margin loss's sorted pair sums,
    and SupCon's anchors whose loss is exactly 0 (one positive, the negatives' ``e^{−2000}``
    underflowing) on the dense and the tiled path."""
    got = pf.reducers.avg_nonzero()(pf.reducers.elements(_ELEMENTS))
    want = _pml_reduce(pml_reducers.AvgNonZeroReducer(), _ELEMENTS)
    torch.testing.assert_close(got, want, **EXACT)
    torch.testing.assert_close(got, _ELEMENTS.sum() / 6, rtol=0, atol=0)
    _reduced_like_pml("margin", pf.reducers.avg_nonzero(), pml_reducers.AvgNonZeroReducer(), 0.0)
    emb = torch.tensor([[1.0, 0.0]] * 2 + [[-1.0, 0.0]] * 3, dtype=F64)
    labels = torch.tensor([0, 0, 1, 1, 1])
    per_anchor = pf.losses.supcon(emb, labels, temperature=1e-3, reducer=pf.reducers.none())
    assert (per_anchor["loss"]["losses"][:2] == 0).all()  # the anchors with one positive
    want = pml_losses.SupConLoss(temperature=1e-3)(emb, labels)
    torch.testing.assert_close(want, torch.tensor(math.log(2), dtype=F64), **EXACT)
    for chunk_size in (None, 2):
        got = pf.losses.supcon(emb, labels, temperature=1e-3, chunk_size=chunk_size)
        torch.testing.assert_close(got, want, **EXACT)


def _gist_margin(strategy: str) -> None:
    """GISTEmbed's guide mask (``multiple_negatives_ranking(guide=...)``): a candidate whose
    guide cosine ``g_c`` is *above* the row's threshold leaves the softmax, one exactly on it
    stays (sentence-transformers: ``guided_sim_mat > threshold``). ``±1`` guide rows of 16
    dimensions (norm 4: normalised exactly) give cosines in multiples of 1/8, and margins 1/4
    (absolute) or 1/2 (relative, on ``|g_i|`` a multiple of 1/8) put some candidates exactly on
    the threshold; the loss is the
    float64 loop reference's, which differs from the loss with those candidates masked."""
    from reference import retrieval as ref

    n, k = 6, 1
    guide = (_signs(1, n, 16), _signs(2, n, 16), _signs(3, n * k, 16).view(n, k, 16))
    g = torch.Generator().manual_seed(4)
    q, p, negs = (torch.randn(*s, generator=g, dtype=F64) for s in ((n, 4), (n, 4), (n, k, 4)))
    margin = 0.25 if strategy == "absolute" else 0.5
    gq, gp, gn = (t / 4 for t in guide)
    pos = (gq * gp).sum(-1)
    threshold = pos - margin if strategy == "absolute" else pos - pos.abs() * margin
    cands = torch.cat(
        [gp.T.unsqueeze(0).expand(n, -1, -1), gn.reshape(n * k, 16).T.expand(n, -1, -1)], 2
    )
    g_c = torch.einsum("id,idm->im", gq, cands)  # each query's guide cosines to every document
    on = g_c == threshold.unsqueeze(1)
    on[torch.arange(n), torch.arange(n)] = False  # the positive pair is never masked
    assert on.any(), "no candidate exactly on the threshold"
    kw = {"margin_strategy": strategy, "margin": margin}
    for chunk_size in (None, 2):
        got = pf.losses.multiple_negatives_ranking(
            q, p, negs, guide=guide, chunk_size=chunk_size, **kw
        )
        torch.testing.assert_close(
            got, ref.multiple_negatives_ranking(q, p, negs, guide=guide, **kw), **EXACT
        )
    # the tie matters: a margin a hair larger masks the candidates that were on the threshold
    nudged = {**kw, "margin": margin + 1e-9}
    tighter = pf.losses.multiple_negatives_ranking(q, p, negs, guide=guide, **nudged)
    assert not torch.isclose(got, tighter, rtol=1e-9, atol=0)


def _mega_batch_margin(side: str) -> None:
    """``[m⁺ − c_ii]_+`` and ``[max_{j≠i} c_ij − m⁻]_+`` (sentence-transformers'
    ``MegaBatchMarginLoss``: ``F.relu``): a cosine exactly on its margin adds 0 and no gradient.
    ``±1`` rows of 16 dimensions (norm 4: normalised exactly) give cosines in multiples of 1/8
    and margins taken from them put terms exactly on the boundary; the value and the gradients
    are the float64 loop reference's (and sentence-transformers' where it is installed), and a
    margin a hair off the boundary activates those terms: the tie decides the gradient."""
    from reference import in_batch as ref

    a, p = _signs(5, 10, 16), _signs(6, 10, 16)
    cos = (a @ p.T) / 16
    own = torch.eye(10, dtype=torch.bool)
    if side == "positive_margin":
        bound = _median(cos, own)
        kw = {"positive_margin": bound, "negative_margin": 0.0}
        on = _on(cos, bound, own)
        nudged = {**kw, "positive_margin": bound + 1e-9}
    else:
        hardest = cos.masked_fill(own, -math.inf).amax(1)
        bound = _median(hardest.unsqueeze(0), torch.ones(1, 10, dtype=torch.bool))
        kw = {"positive_margin": 0.0, "negative_margin": bound}
        on = _on(hardest, bound, torch.ones(10, dtype=torch.bool))
        nudged = {**kw, "negative_margin": bound - 1e-9}
    assert on.any()

    x1, y1, x2, y2 = _leaf(a), _leaf(p), _leaf(a), _leaf(p)
    mine = _value_and_grad(pf.losses.mega_batch_margin(x1, y1, **kw), x1, y1)
    assert_same(mine, _value_and_grad(ref.mega_batch_margin(x2, y2, **kw), x2, y2), **EXACT)
    try:
        from sentence_transformers.sentence_transformer.losses import MegaBatchMarginLoss
    except ImportError:
        pass
    else:
        st = MegaBatchMarginLoss.__new__(MegaBatchMarginLoss)
        torch.nn.Module.__init__(st)
        st.positive_margin, st.negative_margin = kw["positive_margin"], kw["negative_margin"]
        st.mini_batch_size = 10
        x3, y3 = _leaf(a), _leaf(p)
        theirs = _value_and_grad(st.calculate_loss([[x3], [y3]]), x3, y3)
        assert_same(mine, theirs, **EXACT)
    x4, y4 = _leaf(a), _leaf(p)
    off = _value_and_grad(pf.losses.mega_batch_margin(x4, y4, **nudged), x4, y4)
    assert not torch.allclose(off[1][0], mine[1][0], rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Row:
    """One threshold: ``function``'s ``parameter`` enters ``rule`` (pmlfunc); ``check`` runs
    the case; ``pml`` is PML 2.9.0's comparison (``None``: PML 2.9.0 has no such function)."""

    function: Callable
    parameter: str  # "-" for a rule with a fixed bound (no hyper-parameter)
    check: Callable[[], None]
    rule: str
    pml: str | None

    @property
    def id(self) -> str:
        """``module.function.parameter``, and the rule's first word where that repeats."""
        module = self.function.__module__.split(".")[-1]
        same = [r for r in TABLE if (r.function, r.parameter) == (self.function, self.parameter)]
        tag = "" if len(same) < 2 else "-" + re.sub(r"\W.*", "", self.rule.replace("s_", "s"))
        name = "fixed-bound" if self.parameter == "-" else self.parameter
        return f"{module}.{self.function.__name__}.{name}{tag}"


M, L, R = pf.miners, pf.losses, pf.reducers
TABLE: list[Row] = [
    # miners (d a distance, s a similarity; e = d or −s, t = e_an − e_ap)
    Row(M.pair_margin, "pos_margin", partial(_pair_margin, "pos"),
        "d_ap > m (s_ap < m)", "pos_pair > m (< if inverted)"),
    Row(M.pair_margin, "neg_margin", partial(_pair_margin, "neg"),
        "d_an < m (s_an > m)", "neg_pair < m (> if inverted)"),
    Row(M.multi_similarity, "epsilon", partial(_multi_similarity, "pos"),
        "s_ap − ε < max s_an (d_ap + ε > min d_an)", "the same"),
    Row(M.multi_similarity, "epsilon", partial(_multi_similarity, "neg"),
        "s_an + ε > min s_ap (d_an − ε < max d_ap)", "the same"),
    Row(M.triplet_margin, "margin", partial(_triplet_margin_miner, "all"),
        "all: t ≤ m", "t <= m"),
    Row(M.triplet_margin, "margin", partial(_triplet_margin_miner, "hard"),
        "hard: t ≤ min(m, 0)", "t <= m and t <= 0"),
    Row(M.triplet_margin, "margin", partial(_triplet_margin_miner, "semihard"),
        "semihard: 0 < t ≤ m", "t <= m and t > 0"),
    Row(M.triplet_margin, "margin", partial(_triplet_margin_miner, "easy"),
        "easy: t > m", "t > m"),
    Row(M.batch_easy_hard, "pos_strategy", partial(_batch_easy_hard, "pos_strategy"),
        "semihard: e_ap < e_an of the chosen negative", "mat >= thr excluded (<= if min)"),
    Row(M.batch_easy_hard, "neg_strategy", partial(_batch_easy_hard, "neg_strategy"),
        "semihard: e_an > e_ap of the chosen positive", "mat <= thr excluded (>= if max)"),
    Row(M.batch_easy_hard, "allowed_pos_range", partial(_batch_easy_hard, "allowed_pos_range"),
        "low ≤ d_ap ≤ high", "(mat > high) | (mat < low) excluded"),
    Row(M.batch_easy_hard, "allowed_neg_range", partial(_batch_easy_hard, "allowed_neg_range"),
        "low ≤ d_an ≤ high", "(mat > high) | (mat < low) excluded"),
    Row(M.angular, "angle", _angular,
        "atan(‖a − p‖ / 2‖n − c‖) > radians(angle)", "angles > angle"),
    Row(M.distance_weighted, "nonzero_loss_cutoff", partial(_distance_weighted, "nonzero_loss_cutoff"),
        "max(d, cutoff) < nonzero_loss_cutoff", "clamp(mat, cutoff) < nonzero_loss_cutoff"),
    Row(M.distance_weighted, "cutoff", partial(_distance_weighted, "cutoff"),
        "max(d, cutoff) < nonzero_loss_cutoff", "clamp(mat, cutoff) < nonzero_loss_cutoff"),
    Row(M.hdc, "filter_percentage", _hdc,
        "rank < ⌈f · P⌉ (float64 product)", "topk(k=ceil(f * P))"),
    Row(M.uniform_histogram, "num_bins", _uniform_histogram,
        "bin i: e_i ≤ d < e_{i+1}; last: e_{K−1} ≤ d ≤ e_K", "the same"),
    # losses (a hinge [x]_+ exactly 0 is not counted by avg_nonzero or a divisor)
    Row(L.contrastive, "pos_margin", partial(_contrastive, "pos_margin"),
        "[d_ap − m]_+ (s: [m − s_ap]_+)", "relu(margin(d, m))"),
    Row(L.contrastive, "neg_margin", partial(_contrastive, "neg_margin"),
        "[m − d_an]_+ (s: [s_an − m]_+)", "relu(margin(m, d))"),
    Row(L.signal_to_noise_ratio_contrastive, "pos_margin", partial(_snr_contrastive, "pos_margin"),
        "[d_ap − m]_+", "relu(d - m)"),
    Row(L.signal_to_noise_ratio_contrastive, "neg_margin", partial(_snr_contrastive, "neg_margin"),
        "[m − d_an]_+", "relu(m - d)"),
    Row(L.triplet_margin, "margin", _triplet_margin_loss,
        "[e_ap − e_an + m]_+ counted iff e_an < e_ap + m", "relu(...) > 0"),
    Row(L.margin, "margin", partial(_margin_loss, "margin"),
        "[d_ap − β + α]_+, [β − d_an + α]_+ counted iff > 0", "relu(...) > 0"),
    Row(L.margin, "beta", partial(_margin_loss, "beta"),
        "[d_ap − β + α]_+, [β − d_an + α]_+ counted iff > 0", "relu(...) > 0"),
    Row(L.lifted_structure, "pos_margin", _lifted_structure,
        "[lse(m_neg − d) + d_ap − m_pos]_+²", "relu(...) ** 2"),
    Row(L.lifted_structure, "neg_margin", _lifted_structure,
        "[lse(m_neg − d) + d_ap − m_pos]_+²", "relu(...) ** 2"),
    Row(L.generalized_lifted_structure, "pos_margin", _generalized_lifted,
        "[lse(d_ap − m_pos) + lse(m_neg − d_an)]_+", "relu(...)"),
    Row(L.generalized_lifted_structure, "neg_margin", _generalized_lifted,
        "[lse(d_ap − m_pos) + lse(m_neg − d_an)]_+", "relu(...)"),
    Row(L.circle, "m", _circle,
        "α_p = [1 + m − s_ap]_+, α_n = [s_an + m]_+ (continuous)", "relu(op - s), relu(s - on)"),
    Row(L.threshold_consistent_margin, "margin_plus", partial(_threshold_consistent_margin, "margin_plus"),
        "s_ap ≤ m⁺", "pos_sims <= margin_plus"),
    Row(L.threshold_consistent_margin, "margin_minus", partial(_threshold_consistent_margin, "margin_minus"),
        "s_an ≥ m⁻", "neg_sims >= margin_minus"),
    Row(L.intra_pair_variance, "pos_eps", partial(_intra_pair_variance, "pos_eps"),
        "[(1 − ε) μ_+ − s_ap]_+²", "relu(...) ** 2"),
    Row(L.intra_pair_variance, "neg_eps", partial(_intra_pair_variance, "neg_eps"),
        "[s_an − (1 + ε) μ_−]_+²", "relu(...) ** 2"),
    Row(L.ranked_list, "margin", partial(_ranked_list, "margin"),
        "positives d > α − m (and d > 0)", "mat > alpha - margin, P_star > 0"),
    Row(L.ranked_list, "alpha", partial(_ranked_list, "alpha"),
        "negatives d < α (and d > 0)", "mat < alpha, N_star > 0"),
    Row(L.manifold, "margin", _manifold,
        "z = x_k − x_own + m kept iff z ≥ 0", "loss[loss < 0] = -inf"),
    Row(L.selectively_contrastive_triplet, "hard_cutoff", partial(_selectively_contrastive, "hard_cutoff"),
        "hard iff s_an > c", None),
    Row(L.selectively_contrastive_triplet, "-", partial(_selectively_contrastive, "-"),
        "hard iff s_an > s_ap (a tie is easy)", None),
    Row(L.multi_supcon, "threshold", _multi_supcon,
        "positive iff J > threshold", None),
    Row(L.arcface, "margin", _arcface,
        "cos(θ + m) iff cos θ ≥ −cos m (θ ≤ π − m)", "angles <= pi - margin"),
    Row(L.dynamic_soft_margin, "num_bins", _dynamic_soft_margin,
        "segment ⌊(v − min_val)/Δ⌋ (an edge: the upper one)", "floor((v - min_val) / delta)"),
    Row(L.multiple_negatives_ranking, "margin", partial(_gist_margin, "absolute"),
        "guide: masked iff g_c > g_i − m (the positive pair kept)", None),
    Row(L.multiple_negatives_ranking, "margin_strategy", partial(_gist_margin, "relative"),
        "guide: masked iff g_c > g_i − |g_i| m (the positive pair kept)", None),
    Row(L.mega_batch_margin, "positive_margin", partial(_mega_batch_margin, "positive_margin"),
        "[m⁺ − c_ii]_+: c_ii = m⁺ adds 0, no gradient", None),
    Row(L.mega_batch_margin, "negative_margin", partial(_mega_batch_margin, "negative_margin"),
        "[max_{j≠i} c_ij − m⁻]_+: a hardest c_ij = m⁻ adds 0, no gradient", None),
    # reducers
    Row(R.threshold, "low", partial(_threshold, "low"),
        "loss > low", "losses > low"),
    Row(R.threshold, "high", partial(_threshold, "high"),
        "loss < high", "losses < high"),
    Row(R.avg_nonzero, "-", _avg_nonzero,
        "loss > 0", "losses > 0"),
    Row(L.subcenter_arcface_outliers, "threshold", _subcenter_outliers,
        "outlier: cos to the dominant centre < cos(threshold)", "dominant_dist < cos_threshold"),
]  # fmt: skip

# hyper-parameters whose name suggests a threshold but that enter no comparison
EXEMPT: dict[tuple[Callable, str], str] = {
    (M.uniform_histogram, "pos_per_bin"): "draws per bin (a count)",
    (M.uniform_histogram, "neg_per_bin"): "draws per bin (a count)",
    (L.angular, "alpha"): "tan²α scales a term inside a log-sum-exp",
    (L.cosface, "margin"): "subtracted from the target logit",
    (
        L.sphereface,
        "margin",
    ): "ψ(θ) = (−1)^k cos(mθ) − 2k is continuous with a continuous slope at θ = jπ/m",
    (
        L.large_margin_softmax,
        "margin",
    ): "ψ(θ) = (−1)^k cos(mθ) − 2k is continuous with a continuous slope at θ = jπ/m",
    (L.subcenter_arcface, "margin"): "arcface's target (the arcface row): the same _arc_target",
    (
        L.dynamic_arcface,
        "margins",
    ): "arcface's target per class (the arcface row): the same _arc_target",
    (L.dynamic_soft_margin_init_state, "num_bins"): "the histogram's size",
    (L.fast_ap, "num_bins"): "triangular histogram kernels, continuous at the nodes",
    (L.histogram, "n_bins"): "triangular histogram kernels, continuous at the nodes",
    (L.histogram, "delta"): "triangular histogram kernels, continuous at the nodes",
    (L.manifold, "alpha"): "the propagation weight inside a matrix inverse",
    (L.margin_init, "beta"): "an initial value",
    (L.multi_similarity, "alpha"): "a scale inside a log-sum-exp",
    (L.multi_similarity, "beta"): "a scale inside a log-sum-exp",
    (L.multi_similarity, "base"): "a shift inside a log-sum-exp",
    (L.pnp, "alpha"): "an exponent of a smooth rank",
    (L.proxy_anchor, "margin"): "a shift inside a log-sum-exp",
    (L.proxy_anchor, "alpha"): "a scale inside a log-sum-exp",
    (L.soft_triple, "margin"): "subtracted from the target logit",
    (L.tuplet_margin, "margin"): "an angle shift, cos(θ − β)",
    (L.vicreg, "eps"): "inside a square root",
    (L.vicregl, "eps"): "inside a square root (vicreg's variance hinge)",
    (L.vicregl, "alpha"): "the weight of the global loss against the local one, not a threshold",
    (L.barlow_twins, "eps"): "added to the variance inside a square root",
    (L.negative_cosine_similarity, "eps"): "a floor on each norm (F.cosine_similarity's)",
    (L.sym_neg_cosine_similarity, "eps"): "a floor on each norm (F.cosine_similarity's)",
    (L.hypersphere, "alpha"): "the alignment's power, not a threshold",
    (L.swav, "sinkhorn_epsilon"): "Sinkhorn's entropic temperature, exp(s / ε): a scale",
    (L.tico, "beta"): "the running covariance's momentum, not a threshold",
    (L.koleo, "eps"): "a floor on each norm and a shift inside a norm and a log (lightly's)",
    (L.wmse, "eps"): "the covariance's shrinkage to the identity, (1 − ε) Σ + ε I: a weight",
}

_THRESHOLD_NAMES = re.compile(
    r"margin|threshold|cutoff|eps|angle|range|percentage|bins|^m$|alpha|beta|base|^low$|^high$|delta|per_bin|strategy"
)


@pytest.mark.parametrize("row", TABLE, ids=lambda row: row.id)
def test_a_value_exactly_on_a_threshold_follows_the_rule_and_pml(row: Row) -> None:
    row.check()


def test_every_threshold_hyper_parameter_has_a_row_or_a_reason() -> None:
    """Every public miner, loss and reducer's parameter whose name is a threshold's (margin,
    threshold, cutoff, epsilon, angle, range, ...) has a row in :data:`TABLE` or a reason in
    :data:`EXEMPT`; and every row names a real parameter."""
    covered = {(row.function, row.parameter) for row in TABLE} | set(EXEMPT)
    missing = []
    for module in (pf.miners, pf.losses, pf.reducers):
        for name in module.__all__:
            fn = getattr(module, name)
            if not inspect.isfunction(fn):
                continue
            for parameter in inspect.signature(fn).parameters:
                if _THRESHOLD_NAMES.search(parameter) and (fn, parameter) not in covered:
                    missing.append(f"{module.__name__}.{name}({parameter}=)")
    assert not missing, f"thresholds with no row in TABLE and no reason in EXEMPT: {missing}"
    for fn, parameter in covered:
        assert parameter == "-" or parameter in inspect.signature(fn).parameters, (fn, parameter)


# ----------------------------------------------------------------------------------------------
# Part 2: indices exactly at the ends of their range (every reader of indices)

_GEN = torch.Generator().manual_seed(5)
_Q = torch.randn(6, 4, generator=_GEN, dtype=F64)  # B = 6 queries
_R = torch.randn(5, 4, generator=_GEN, dtype=F64)  # M = 5 references: the two sizes differ
_YQ, _YR = torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 1, 1, 2, 2])
_REF = {"ref_emb": _R, "ref_labels": _YR}
_TRIPLETS = ([0, 1, 4], [0, 2, 3], [1, 0, 0])  # (a, p, n), valid in ref mode and self mode
_PAIRS = ([0, 2, 5], [0, 1, 4], [1, 3, 0], [1, 0, 2])  # (a1, p, a2, n)


def _with(rows: tuple[list[int], ...], position: int, value: int) -> tuple[torch.Tensor, ...]:
    """The index tuple ``rows`` with its ``position``'s first entry replaced by ``value``."""
    out = [torch.tensor(r) for r in rows]
    out[position] = out[position].clone()
    out[position][0] = value
    return tuple(out)


def _mined(position: int, value: int) -> pf.tuples.MinedTriplets:
    a, p, n = _with(_TRIPLETS, position, value)
    return pf.tuples.MinedTriplets(a, p, n, torch.ones(3, dtype=F64))


@dataclass(frozen=True)
class IndexRow:
    """``call(v)`` passes ``v`` at one index position of ``name``; the valid values are
    ``low ≤ v < high``; outside, ``error`` names ``argument`` first in its message. ``wraps``:
    negative values wrap by this size (``call(v)`` equals ``call(v + wraps)``)."""

    name: str
    call: Callable[[int], object]
    low: int
    high: int
    argument: str
    error: type[Exception] = IndexError
    wraps: int | None = None


def _tuple_rows(
    name: str, fn: Callable, rows: tuple, sizes: tuple[int, ...], roles: tuple[str, ...]
):
    """One row per position of a PML tuple read by ``fn(tuple)`` (wrapping negative indices)."""
    return [
        IndexRow(
            f"{name}[{i}]",
            partial(lambda i, v: fn(_with(rows, i, v)), i),
            -size,
            size,
            f"indices_tuple[{i}] ({role})",
            wraps=size,
        )
        for i, (size, role) in enumerate(zip(sizes, roles, strict=True))
    ]


_TRIPLET_ROLES, _PAIR_ROLES = ("anchors", "positives", "negatives"), ("a1", "p", "a2", "n")
_PROXY = pf.losses.proxy_anchor_init(3, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
_NCA = pf.losses.proxy_nca_init(3, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
_ARC = pf.losses.arcface_init(3, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
_MANIFOLD = pf.losses.manifold_init(4, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
_MEMORY = pf.wrappers.cross_batch_memory_init(8, 4, dtype=F64)
_HIERARCHY = torch.tensor([[c, c // 2, c % 2] for c in range(6) for _ in range(2)])


def _class_labels(loss: Callable, params: dict, v: int) -> torch.Tensor:
    labels = _YQ.clone()
    labels[0] = v
    return loss(_Q, labels, params)


def _memory(key: str, v: int):
    memory = _MEMORY | {"index": torch.tensor(0), "count": torch.tensor(8), key: torch.tensor(v)}
    return pf.wrappers.cross_batch_memory(pf.losses.contrastive, _Q, _YQ, memory)


def _relevance_ids(v: int):
    ids = torch.tensor([[v, -1]] + [[0, 1]] * 5)
    return pf.evaluation.neighbor_relevance(
        torch.tensor([[0, 1]] * 6), relevant_ids=ids, num_references=5
    )


def _hierarchy(name: str, v: int) -> int:
    columns = {"inner_label": 0, "outer_label": 1} | {name: v}
    return pf.samplers.hierarchical_length(_HIERARCHY, 4, 1, **columns)


def _neighbor_indices(v: int):
    idx = torch.tensor([[v, 1]] + [[0, 1]] * 5)
    return pf.evaluation.neighbor_relevance(idx, query_labels=_YQ, reference_labels=_YR)


INDEX_ROWS: list[IndexRow] = [
    # PML tuples read by losses (pmlfunc.tuples.check_tuple), a reference set: B = 6, M = 5
    *_tuple_rows(
        "triplet_margin",
        lambda t: pf.losses.triplet_margin(_Q, _YQ, indices_tuple=t, **_REF),
        _TRIPLETS,
        (6, 5, 5),
        _TRIPLET_ROLES,
    ),
    *_tuple_rows(
        "contrastive",
        lambda t: pf.losses.contrastive(_Q, _YQ, indices_tuple=t, **_REF),
        _PAIRS,
        (6, 5, 6, 5),
        _PAIR_ROLES,
    ),
    *_tuple_rows(
        "labels.tuple_masks",
        lambda t: pf.labels.tuple_masks(t, (6, 5)),
        _TRIPLETS,
        (6, 5, 5),
        _TRIPLET_ROLES,
    ),
    # PML tuples read as sample weights (pmlfunc.tuples.sample_weights): the batch's rows
    *_tuple_rows(
        "proxy_anchor",
        lambda t: pf.losses.proxy_anchor(_Q, _YQ, _PROXY, indices_tuple=t),
        _TRIPLETS,
        (6, 6, 6),
        _TRIPLET_ROLES,
    ),
    *_tuple_rows(
        "proxy_nca",
        lambda t: pf.losses.proxy_nca(_Q, _YQ, _NCA, indices_tuple=t),
        _TRIPLETS,
        (6,),
        _TRIPLET_ROLES[:1],
    ),  # only the anchors are counted (PML's using_ref)
    *_tuple_rows(
        "samplers.tuples_to_weights",
        lambda t: pf.samplers.tuples_to_weights(t, 6),
        _TRIPLETS,
        (6, 6, 6),
        _TRIPLET_ROLES,
    ),
    IndexRow(
        "samplers.tuples_to_weights[indices]",
        lambda v: pf.samplers.tuples_to_weights(
            _with(_TRIPLETS, 0, 0), 10, indices=torch.tensor([v, 1, 2, 3, 4, 5])
        ),
        0,
        10,
        "indices",
    ),
    # a miner's MinedTriplets consumed (pmlfunc.tuples.check_mined): no wrapping
    *(
        IndexRow(
            f"contrastive[MinedTriplets.{role}]",
            partial(
                lambda i, v: pf.losses.contrastive(_Q, _YQ, indices_tuple=_mined(i, v), **_REF), i
            ),
            0,
            size,
            f"indices_tuple.{role}",
        )
        for i, (role, size) in enumerate(zip(_TRIPLET_ROLES, (6, 5, 5), strict=True))
    ),
    *(
        IndexRow(
            f"proxy_anchor[MinedTriplets.{role}]",
            partial(
                lambda i, v: pf.losses.proxy_anchor(_Q, _YQ, _PROXY, indices_tuple=_mined(i, v)), i
            ),
            0,
            6,
            f"indices_tuple.{role}",
        )
        for i, role in enumerate(_TRIPLET_ROLES)
    ),
    IndexRow(
        "multi_supcon[MinedTriplets.positives]",
        lambda v: pf.losses.multi_supcon(_Q, F.one_hot(_YQ, 3), indices_tuple=_mined(1, v)),
        0,
        6,
        "indices_tuple.positives",
    ),
    # manifold's meta-classes: one per proxy (3 proxies)
    IndexRow(
        "manifold[meta-classes]",
        lambda v: pf.losses.manifold(
            _Q, None, _MANIFOLD, indices_tuple=torch.tensor([v, 0, 1, 2, 0, 1])
        ),
        -3,
        3,
        "indices_tuple (meta-classes, one per proxy)",
        wraps=3,
    ),
    # class labels index a learnable loss's class-major parameters (pmlfunc.params.class_labels)
    IndexRow(
        "proxy_anchor[labels]",
        partial(_class_labels, pf.losses.proxy_anchor, _PROXY),
        0,
        3,
        "labels",
        ValueError,
    ),
    IndexRow(
        "arcface[labels]",
        partial(_class_labels, pf.losses.arcface, _ARC),
        0,
        3,
        "labels",
        ValueError,
    ),
    # evaluation: neighbour indices, relevant ids (-1 pads), text-to-image ids
    IndexRow("evaluation.neighbor_relevance[indices]", _neighbor_indices, 0, 5, "indices"),
    IndexRow("evaluation.neighbor_relevance[relevant_ids]", _relevance_ids, -1, 5, "relevant_ids"),
    IndexRow(
        "evaluation.retrieval_scores[relevant_ids]",
        lambda v: pf.evaluation.retrieval_scores(
            _Q, _R, metrics=("recall@2",), relevant_ids=torch.tensor([[v, -1]] + [[0, 1]] * 5)
        ),
        -1,
        5,
        "relevant_ids",
    ),
    IndexRow(
        "evaluation.cross_modal_scores[text_to_image]",
        lambda v: pf.evaluation.cross_modal_scores(
            _R, _Q, torch.tensor([v, 0, 1, 2, 3, 4]), metrics=("hit_rate@1",)
        ),
        0,
        5,
        "text_to_image",
    ),
    # samplers: the hierarchy's label columns (3 columns; negative ones wrap)
    *(
        IndexRow(
            f"samplers.hierarchical_length[{name}]", partial(_hierarchy, name), -3, 3, name, wraps=3
        )
        for name in ("inner_label", "outer_label")
    ),
    # cross-batch memory state: 8 slots, count in [0, 8], index in [0, 8) (a ValueError)
    IndexRow(
        "wrappers.cross_batch_memory[index]",
        partial(_memory, "index"),
        0,
        8,
        "memory['index']",
        ValueError,
    ),
    IndexRow(
        "wrappers.cross_batch_memory[count]",
        partial(_memory, "count"),
        0,
        9,
        "memory['count']",
        ValueError,
    ),
]


def _names(message: str, argument: str) -> bool:
    """Whether ``message`` starts with the argument's name (not a longer name)."""
    return re.match(re.escape(argument) + r"(?!\w)", message) is not None


@pytest.mark.parametrize("side", ["below", "above"])
@pytest.mark.parametrize("row", INDEX_ROWS, ids=lambda row: row.name)
def test_an_index_one_step_outside_its_range_is_an_error_naming_the_argument(row, side):
    value = row.low - 1 if side == "below" else row.high
    with pytest.raises(Exception) as info:  # the exact type is asserted below
        row.call(value)
    assert info.type is row.error, f"{row.name}({value}): {info.type.__name__}: {info.value}"
    assert _names(str(info.value), row.argument), f"does not name {row.argument!r}: {info.value}"


@pytest.mark.parametrize("row", INDEX_ROWS, ids=lambda row: row.name)
def test_an_index_at_either_end_of_its_range_is_accepted(row):
    """``low`` and ``high − 1`` run; a negative index gives the wrapped index's result."""
    low, last = row.call(row.low), row.call(row.high - 1)
    if row.wraps is not None:
        torch.testing.assert_close(low, row.call(row.low + row.wraps), rtol=0, atol=0)
        torch.testing.assert_close(last, row.call(row.high - 1 - row.wraps), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["MinedPairs", "TripletWindow", "TripletMask"])
def test_a_miner_result_for_another_grid_is_a_value_error_naming_its_field(kind):
    """A fixed-shape result mined for ``(B, B)`` given to a loss over ``(B, M)``, ``M ≠ B``."""
    mined = {
        "MinedPairs": lambda: pf.miners.pair_margin(_Q, _YQ),
        "TripletWindow": lambda: pf.miners.triplet_margin(_Q, _YQ),
        "TripletMask": lambda: pf.miners.angular(_Q, _YQ),
    }[kind]()
    assert type(mined).__name__ == kind
    field = {"MinedPairs": "pos", "TripletWindow": "e", "TripletMask": "mask"}[kind]
    with pytest.raises(ValueError, match=rf"^indices_tuple\.{field} \({kind}\) must have shape"):
        pf.losses.triplet_margin(_Q, _YQ, indices_tuple=mined, **_REF)
