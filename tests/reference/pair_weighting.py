"""Float64 loop references of ``pmlfunc.losses.pair_weighting``: losses that weight each pair by
the other pairs of its anchor (log-sum-exps over an anchor's positives and negatives).

Written from PML 2.9.0's semantics (``MultiSimilarityLoss``, ``LiftedStructureLoss``,
``GeneralizedLiftedStructureLoss``, ``CircleLoss``, ``TupletMarginLoss``), with pmlfunc's
documented deviation for ``lifted_structure`` with a separate reference set: the positive's
negatives are its column's negative pairs (PML compares a reference index with query indices).
"""

from __future__ import annotations

import math

import torch

from . import lse, masks, pair_lists, pml_margin, reduce_pairs, reduce_rows, setup, zero


def multi_similarity(
    emb,
    labels=None,
    *,
    alpha=2.0,
    beta=50.0,
    base=0.5,
    distance=("cosine", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``MultiSimilarityLoss``: per anchor, log(1 + Σ_p e^{−α(s−λ)})/α over its positives
    plus log(1 + Σ_n e^{β(s−λ)})/β over its negatives (0/1 masks)."""
    self_mode, ref, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    b, m = emb.shape[0], ref.shape[0]
    p_mask, n_mask, _, _ = masks(labels, rl, self_mode, indices_tuple, b, m)
    losses = []
    for i in range(b):
        pos_terms = [
            torch.exp(alpha * pml_margin(mat[i][j], base, distance))
            for j in range(m)
            if p_mask[i][j]
        ]
        neg_terms = [
            torch.exp(beta * pml_margin(base, mat[i][j], distance))
            for j in range(m)
            if n_mask[i][j]
        ]
        lp = torch.log(1 + sum(pos_terms)) / alpha if pos_terms else zero(emb)
        ln = torch.log(1 + sum(neg_terms)) / beta if neg_terms else zero(emb)
        losses.append(lp + ln)
    return reduce_rows(losses, reducer, emb, labels)


def lifted_structure(
    emb,
    labels=None,
    *,
    neg_margin=1.0,
    pos_margin=0.0,
    distance=("lp", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``LiftedStructureLoss``: per positive pair (a, p), relu(lse over the negative pairs
    of a and of p of (m_neg − d) + d_ap − m_pos)² / 2."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    if not neg:
        return zero(emb)
    losses = []
    for a, p in pos:
        if self_mode:  # negative pairs whose anchor is a or p (PML)
            chosen = [(i, n) for i, n in neg if i == a or i == p]
        else:  # the deviation: the anchor's row and the positive's column
            chosen = [(i, n) for i, n in neg if i == a] + [(i, n) for i, n in neg if n == p]
        total = lse([pml_margin(neg_margin, mat[i][n], distance) for i, n in chosen])
        x = (0.0 if total is None else total) + pml_margin(mat[a][p], pos_margin, distance)
        losses.append(torch.relu(x) ** 2 / 2)
    return reduce_pairs(losses, pos, "pos_pair", reducer, emb, labels)


def generalized_lifted_structure(
    emb,
    labels=None,
    *,
    neg_margin=1.0,
    pos_margin=0.0,
    distance=("lp", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``GeneralizedLiftedStructureLoss``: per anchor, relu(lse of its positives'
    (d − m_pos) + lse of its negatives' (m_neg − d)); a listed pair counts once."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    pos, neg = set(pos), set(neg)  # matrix-based: a listed pair counts once
    losses = []
    for a in range(len(emb)):
        lp = lse([pml_margin(mat[i][j], pos_margin, distance) for i, j in pos if i == a])
        ln = lse([pml_margin(neg_margin, mat[i][j], distance) for i, j in neg if i == a])
        losses.append(
            torch.relu(zero(emb) + (0.0 if lp is None else lp) + (0.0 if ln is None else ln))
        )
    return reduce_rows(losses, reducer, emb, labels)


def circle(
    emb,
    labels=None,
    *,
    m=0.4,
    gamma=80.0,
    distance=("cosine", {}),
    reducer=("avg_nonzero", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``CircleLoss`` (Sun et al. 2020): per anchor, softplus(lse_p(−γ α_p (s − Δ_p)) +
    lse_n(γ α_n (s − Δ_n))) with the weights α_p = relu(1 + m − s), α_n = relu(s + m) detached."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    pos, neg = set(pos), set(neg)
    losses = []
    for a in range(len(emb)):
        sp = [mat[i][j] for i, j in sorted(pos) if i == a]
        sn = [mat[i][j] for i, j in sorted(neg) if i == a]
        if not sp or not sn:
            losses.append(zero(emb))
            continue
        lp = lse([-gamma * torch.relu(1 + m - s.detach()) * (s - (1 - m)) for s in sp])
        ln = lse([gamma * torch.relu(s.detach() + m) * (s - m) for s in sn])
        losses.append(torch.nn.functional.softplus(lp + ln))
    return reduce_rows(losses, reducer, emb, labels)


def circle_with_frozen_weights(emb, labels, frozen, *, m, gamma):
    """:func:`circle` (cosine, self mode, ``avg_nonzero``) with α_p, α_n computed from the
    similarities of the ``frozen`` rows instead of ``emb``: a function whose true gradient is
    the one circle's detached weights give."""
    self_mode, _, rl, mat = setup(emb, labels, None, None, ("cosine", {}))
    _, _, _, mat0 = setup(frozen, labels, None, None, ("cosine", {}))
    pos, neg = pair_lists(labels, rl, self_mode)
    losses = []
    for a in range(len(emb)):
        ps = [j for i, j in pos if i == a]
        ns = [j for i, j in neg if i == a]
        if not ps:
            losses.append(zero(emb))
            continue
        lp = lse([-gamma * torch.relu(1 + m - mat0[a][j]) * (mat[a][j] - 1 + m) for j in ps])
        ln = lse([gamma * torch.relu(mat0[a][j] + m) * (mat[a][j] - m) for j in ns])
        losses.append(torch.nn.functional.softplus(lp + ln))
    return reduce_rows(losses, ("avg_nonzero", {}), emb, labels)


def tuplet_margin(
    emb,
    labels=None,
    *,
    margin=5.73,
    scale=64.0,
    distance=("cosine", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``TupletMarginLoss``: per positive pair, log(1 + Σ_n e^{s(cos θ_an − cos(θ_ap −
    β))}) over the anchor's negatives, β the margin in degrees."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    beta = math.radians(margin)
    losses = []
    for a, p in pos:
        shifted = torch.cos(torch.acos(mat[a][p].clamp(-1, 1)) - beta)
        xs = [scale * (mat[i][n] - shifted) for i, n in neg if i == a]
        losses.append(lse([*xs, zero(emb)]))  # log(1 + Σ)
    return reduce_pairs(losses, pos, "pos_pair", reducer, emb, labels)
