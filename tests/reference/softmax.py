"""Float64 loop references of ``pmlfunc.losses.softmax``: a softmax over each anchor's pairs.

``ntxent`` and ``supcon`` follow PML 2.9.0's semantics (``NTXentLoss``, ``SupConLoss``). The
PML-3-only losses are independent transcriptions: ``decoupled_contrastive`` of Yeh et al. 2022
(the positive left out of the denominator; DCLW's von Mises-Fisher weights), with the paper's
symmetric two-view equation as its own reference, and ``multi_supcon`` of the multi-label SupCon
(Jaccard-weighted positives, a pair positive when its Jaccard similarity exceeds the threshold).
"""

from __future__ import annotations

import torch

from . import (
    is_similarity,
    lse,
    masks,
    pair_lists,
    reduce_pairs,
    reduce_rows,
    setup,
    similarity,
    unit,
    zero,
)


def ntxent(
    emb,
    labels=None,
    *,
    temperature=0.07,
    distance=("cosine", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
    eps=None,
):
    """PML's ``NTXentLoss``: per positive pair, −log(e^{s_ap/τ} / (e^{s_ap/τ} + Σ_n e^{s_an/τ})
    + ε) over the anchor's negatives (``eps``: ε, default ``finfo(emb.dtype).tiny``); 0 unless
    there is a positive and a negative pair."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    if not pos or not neg:  # PML: zero loss unless there is a positive and a negative pair
        return zero(emb)
    sign = 1.0 if is_similarity(distance) else -1.0
    tiny = torch.finfo(emb.dtype).tiny if eps is None else eps
    losses = []
    for a, p in pos:
        num = torch.exp(sign * mat[a][p] / temperature)
        den = num + sum(
            (torch.exp(sign * mat[a2][n] / temperature) for a2, n in neg if a2 == a), 0.0
        )
        losses.append(-torch.log(num / den + tiny))
    return reduce_pairs(losses, pos, "pos_pair", reducer, emb, labels)


def supcon(
    emb,
    labels=None,
    *,
    temperature=0.1,
    distance=("cosine", {}),
    reducer=("avg_nonzero", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``SupConLoss``: per anchor, minus the mean over its positives of the log-softmax
    over its positive and negative pairs (0/1 masks); 0 unless both kinds of pair exist."""
    self_mode, ref, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    b, m = emb.shape[0], ref.shape[0]
    p_mask, n_mask, any_pos, any_neg = masks(labels, rl, self_mode, indices_tuple, b, m)
    if not (any_pos and any_neg):  # PML: zero loss unless both kinds of pair exist
        return zero(emb)
    sign = 1.0 if is_similarity(distance) else -1.0
    tiny = torch.finfo(emb.dtype).tiny
    losses = []
    for i in range(b):
        logits = [sign * mat[i][j] / temperature for j in range(m)]
        total_lse = lse([logits[j] for j in range(m) if p_mask[i][j] or n_mask[i][j]])
        npos = sum(p_mask[i])
        total = sum((logits[j] - total_lse for j in range(m) if p_mask[i][j]), zero(emb))
        losses.append(-total / (npos + tiny))
    return reduce_rows(losses, reducer, emb, labels)


def decoupled_contrastive(
    emb,
    labels,
    ref=None,
    ref_labels=None,
    *,
    temperature=0.1,
    sigma=None,
    distance="cosine",
    indices_tuple=None,
    reducer="mean",
):
    """Per positive pair with a negative: −w·s_ap/τ + log Σ_n e^{s_an/τ} (no positive in the
    denominator); DCLW's w = 2 − e^{s_ap/σ} / mean over the pairs of e^{s/σ} (w = 1 for DCL)."""
    self_mode = ref is None
    other, other_labels = (emb, labels) if self_mode else (ref, ref_labels)
    pos, neg = pair_lists(labels, other_labels, self_mode, indices_tuple)
    negs = {}
    for a, n in neg:
        negs.setdefault(a, []).append(n)
    kept = [(a, p) for a, p in pos if negs.get(a)]
    s = {(a, j): similarity(emb[a], other[j], distance) for a, j in set(kept) | set(neg)}
    if sigma is not None and kept:
        mean_e = sum(torch.exp(s[a, p] / sigma) for a, p in kept) / len(kept)
    terms = []
    for a, p in kept:
        w = 1.0 if sigma is None else 2 - torch.exp(s[a, p] / sigma) / mean_e
        neg_lse = torch.log(sum(torch.exp(s[a, n] / temperature) for n in negs[a]))
        terms.append(-w * s[a, p] / temperature + neg_lse)
    if not terms:
        return zero(emb)
    return sum(terms) if reducer == "sum" else sum(terms) / len(terms)


def decoupled_contrastive_two_views(z1, z2, temperature, sigma):
    """The paper's symmetric two-view loss, transcribed: (1/2N) Σ_k Σ_i L_i^(k)."""
    n = z1.shape[0]
    u1 = [unit(z1[i]) for i in range(n)]
    u2 = [unit(z2[i]) for i in range(n)]

    def dot(x, y):
        return sum(x[k] * y[k] for k in range(x.shape[0]))

    if sigma is not None:
        mean_e = sum(torch.exp(dot(u1[j], u2[j]) / sigma) for j in range(n)) / n
    total = zero(z1)
    for view, other in ((u1, u2), (u2, u1)):
        for i in range(n):
            s_pos = dot(view[i], other[i])
            w = 1.0 if sigma is None else 2 - torch.exp(s_pos / sigma) / mean_e
            neg = sum(
                torch.exp(dot(view[i], vv[j]) / temperature)
                for vv in (view, other)
                for j in range(n)
                if j != i
            )
            total = total + (-w * s_pos / temperature + torch.log(neg))
    return total / (2 * n)


def multi_supcon(
    emb,
    labels,
    ref=None,
    ref_labels=None,
    *,
    temperature=0.1,
    threshold=0.0,
    distance="cosine",
    indices_tuple=None,
    reducer="avg_nonzero",
):
    """Multi-label SupCon: a pair is positive when the Jaccard similarity J of its label sets
    exceeds ``threshold``; per anchor, −(1/|P|) Σ_p J·log-softmax over its pairs."""
    self_mode = ref is None
    other, other_labels = (emb, labels) if self_mode else (ref, ref_labels)
    b, m = emb.shape[0], other.shape[0]

    def jac(i, j):
        a = {k for k in range(labels.shape[1]) if float(labels[i, k]) > 0}
        c = {k for k in range(labels.shape[1]) if float(other_labels[j, k]) > 0}
        return len(a & c) / len(a | c) if (a | c) else 0.0

    if indices_tuple is not None:
        p_list, n_list = pair_lists(None, None, self_mode, indices_tuple)
        pos_set, neg_set = set(p_list), set(n_list)
    else:
        pos_set, neg_set = set(), set()
        for i in range(b):
            for j in range(m):
                if self_mode and i == j:
                    continue
                (pos_set if jac(i, j) > threshold else neg_set).add((i, j))
    if not pos_set or not neg_set:
        return zero(emb)
    losses = []
    for i in range(b):
        ps = [j for j in range(m) if (i, j) in pos_set]
        cand = [j for j in range(m) if (i, j) in pos_set or (i, j) in neg_set]
        if not ps:
            losses.append(zero(emb))
            continue
        z = {j: similarity(emb[i], other[j], distance) / temperature for j in cand}
        row_lse = torch.log(sum(torch.exp(z[j]) for j in cand))
        losses.append(-sum(jac(i, p) * (z[p] - row_lse) for p in ps) / len(ps))
    if reducer == "mean":
        return sum(losses) / len(losses)
    kept = [v for v in losses if float(v.detach()) > 0]
    return sum(kept) / len(kept) if kept else zero(emb)
