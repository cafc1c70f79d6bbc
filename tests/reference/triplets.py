"""Float64 loop references of ``pmlfunc.losses.triplets``: one term per (anchor, positive,
negative) triplet, or per anchor's chosen triplet.

``triplet_margin`` and ``margin`` follow PML 2.9.0's semantics (``TripletMarginLoss``,
``MarginLoss``), with pmlfunc's documented deviation for ``swap=True`` with a reference set (the
p-n distance is ``distance(ref_emb, ref_emb)``). ``selectively_contrastive_triplet`` has no PML
2.9.0 counterpart: it is transcribed from Xuan et al. 2020 (easiest positive, hardest negative,
a log-softmax for an easy triplet and λ·s_an for a hard one).
"""

from __future__ import annotations

import torch

from . import (
    distance_matrix,
    is_similarity,
    pair_lists,
    pml_margin,
    reduce,
    setup,
    similarity,
    triplet_lists,
    zero,
)


def triplet_margin(
    emb,
    labels=None,
    *,
    margin=0.2,
    swap=False,
    smooth_loss=False,
    distance=("lp", {}),
    reducer=("avg_nonzero", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``TripletMarginLoss``: relu(d_ap − d_an + m) per triplet (softplus when smooth);
    ``swap`` takes the smaller of d_an and d_pn."""
    self_mode, ref, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    trips = triplet_lists(labels, rl, self_mode, indices_tuple)
    pn_mat = distance_matrix(ref, ref, distance) if swap else None
    losses = []
    for a, p, n in trips:
        ap, an = mat[a][p], mat[a][n]
        if swap:
            pn = pn_mat[p][n]
            an = torch.maximum(an, pn) if is_similarity(distance) else torch.minimum(an, pn)
        v = pml_margin(ap, an, distance) + margin
        losses.append(
            torch.nn.functional.softplus(v) if smooth_loss else torch.nn.functional.relu(v)
        )
    return reduce(
        losses, [t[0] for t in trips], None, "triplet", reducer, emb, labels, emb.shape[0]
    )


def margin(
    emb,
    labels=None,
    params=None,
    *,
    margin=0.2,
    nu=0.0,
    beta=1.2,
    distance=("lp", {}),
    reducer=("divisor", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``MarginLoss``: relu(d_ap − β + m) + relu(β − d_an + m) per triplet, β a constant,
    one learnable value (``params["beta"]`` of one entry) or one per class, plus ν·β."""
    self_mode, _, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    trips = triplet_lists(labels, rl, self_mode, indices_tuple)
    if not trips:
        return zero(emb)
    b_vec = None if params is None else params["beta"]

    def beta_of(a):
        if b_vec is None:
            return beta
        return b_vec[0] if len(b_vec) == 1 else b_vec[int(labels[a])]

    pos_l = [torch.relu(pml_margin(mat[a][p], beta_of(a), distance) + margin) for a, p, _ in trips]
    neg_l = [torch.relu(pml_margin(beta_of(a), mat[a][n], distance) + margin) for a, _, n in trips]
    losses = [x + y for x, y in zip(pos_l, neg_l, strict=True)]
    anchors = [a for a, _, _ in trips]
    reg = [beta_of(a) * nu for a in anchors] if b_vec is not None and len(b_vec) > 1 else None
    if reducer[0] == "divisor":
        div = sum(float(x.detach()) > 0 for x in pos_l) + sum(float(x.detach()) > 0 for x in neg_l)
        out = sum(losses) / div if div else zero(emb)
        if reg is not None:
            out = out + (sum(reg) / div if div else 0.0)
    else:
        out = reduce(losses, anchors, None, "triplet", reducer, emb, labels, len(emb))
        if reg is not None:
            out = out + reduce(reg, anchors, None, "element", reducer, emb, labels, len(emb))
    if b_vec is not None and len(b_vec) == 1:
        out = out + b_vec[0] * nu
    return out


def selectively_contrastive_triplet(
    emb,
    labels,
    ref=None,
    ref_labels=None,
    *,
    temperature=0.1,
    penalty=1.0,
    hard_cutoff=None,
    distance="cosine",
    indices_tuple=None,
    reducer="mean",
):
    """Per anchor, its easiest positive and hardest negative: −log(e^{s_ap/τ} / (e^{s_ap/τ} +
    e^{s_an/τ})) when s_an ≤ s_ap (and below the cutoff), else λ·s_an; averaged (or summed)."""
    self_mode = ref is None
    other, other_labels = (emb, labels) if self_mode else (ref, ref_labels)
    pos, neg = pair_lists(labels, other_labels, self_mode, indices_tuple)
    terms = []
    for a in range(emb.shape[0]):
        ps = sorted({p for aa, p in pos if aa == a})
        ns = sorted({n for aa, n in neg if aa == a})
        if not ps or not ns:
            continue
        sp = {p: similarity(emb[a], other[p], distance) for p in ps}
        sn = {n: similarity(emb[a], other[n], distance) for n in ns}
        s_ap = max(sp.values(), key=lambda v: float(v.detach()))  # the easiest positive
        s_an = max(sn.values(), key=lambda v: float(v.detach()))  # the hardest negative
        s_an_v, s_ap_v = float(s_an.detach()), float(s_ap.detach())
        hard = s_an_v > s_ap_v or (hard_cutoff is not None and s_an_v > hard_cutoff)
        if hard:
            terms.append(penalty * s_an)
        else:
            e_p, e_n = torch.exp(s_ap / temperature), torch.exp(s_an / temperature)
            terms.append(-torch.log(e_p / (e_p + e_n)))
    if not terms:
        return zero(emb)
    return sum(terms) if reducer == "sum" else sum(terms) / len(terms)
