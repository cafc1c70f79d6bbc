"""Float64 loop references of ``pmlfunc.losses.pairs``: a hinge per positive and negative pair.

Written from PML 2.9.0's semantics (``ContrastiveLoss``, ``SignalToNoiseRatioContrastiveLoss``,
``IntraPairVarianceLoss``, ``ThresholdConsistentMarginLoss``), with pmlfunc's documented fix for
the last one: with a reference set its pairs are the reference rows (PML indexes the batch).
"""

from __future__ import annotations

import torch

from . import is_similarity, pair_lists, pml_margin, reduce_pairs, setup, zero


def contrastive(
    emb,
    labels=None,
    *,
    pos_margin=0.0,
    neg_margin=1.0,
    distance=("lp", {}),
    reducer=("avg_nonzero", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``ContrastiveLoss``: relu(d_ap − m_pos) per positive pair, relu(m_neg − d_an) per
    negative pair, each kind reduced on its own."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    relu = torch.nn.functional.relu
    pos_l = [relu(pml_margin(mat[a][p], pos_margin, distance)) for a, p in pos]
    neg_l = [relu(pml_margin(neg_margin, mat[a][n], distance)) for a, n in neg]
    return reduce_pairs(pos_l, pos, "pos_pair", reducer, emb, labels) + reduce_pairs(
        neg_l, neg, "neg_pair", reducer, emb, labels
    )


def signal_to_noise_ratio_contrastive(emb, labels=None, *, distance=("snr", {}), **kw):
    """PML's ``SignalToNoiseRatioContrastiveLoss``: the contrastive loss on the SNR distance."""
    return contrastive(emb, labels, distance=distance, **kw)


def intra_pair_variance(
    emb,
    labels=None,
    *,
    pos_eps=0.01,
    neg_eps=0.01,
    distance=("cosine", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``IntraPairVarianceLoss``: relu((1 − ε)·mean − s)² over the positive pairs and
    relu(s − (1 + ε)·mean)² over the negative pairs (flipped for a distance)."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    sim = is_similarity(distance)
    out = zero(emb)
    for listed, eps, kind, up in (
        (pos, pos_eps, "pos_pair", sim),
        (neg, neg_eps, "neg_pair", not sim),
    ):
        if not listed:
            continue
        vals = [mat[a][j] for a, j in listed]
        mu = sum(vals) / len(vals)
        var = [((1 - eps) * mu - v) if up else (v - (1 + eps) * mu) for v in vals]
        out = out + reduce_pairs(
            [torch.relu(x) ** 2 for x in var], listed, kind, reducer, emb, labels
        )
    return out


def threshold_consistent_margin(
    emb,
    labels,
    *,
    lambda_plus=1.0,
    lambda_minus=1.0,
    margin_plus=0.9,
    margin_minus=0.5,
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``ThresholdConsistentMarginLoss`` (cosine): λ₊ · mean of (m₊ − s) over the positive
    pairs with s ≤ m₊, plus λ₋ · mean of (s − m₋) over the negative pairs with s ≥ m₋."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, ("cosine", {}))
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    pl = [margin_plus - mat[a][p] for a, p in pos if float(mat[a][p].detach()) <= margin_plus]
    nl = [mat[a][n] - margin_minus for a, n in neg if float(mat[a][n].detach()) >= margin_minus]
    out = zero(emb)
    if pl:
        out = out + lambda_plus * sum(pl) / len(pl)
    if nl:
        out = out + lambda_minus * sum(nl) / len(nl)
    return out
