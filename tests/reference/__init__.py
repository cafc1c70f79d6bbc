"""Naive float64 reference implementations of the five core losses.

Written from PML 2.9.0's semantics with plain Python loops over pairs, triplets and anchors.
Nothing here imports pmlfunc. Every number is a float64 torch scalar, so gradients of the
reference come from ``torch.autograd`` on the inputs.

Distances are given as ``(name, kwargs)``:
    ("lp", {"p": 2, "power": 1, "normalize": True}), ("cosine", {}), ("dot", {}), ("snr", {})
Reducers are given as ``(name, kwargs)``:
    ("mean", {}), ("sum", {}), ("avg_nonzero", {}), ("threshold", {"low": .., "high": ..}),
    ("class_weighted", {"weights": tensor}), ("per_anchor", {})
"""

from __future__ import annotations

import torch

SIMILARITIES = {"cosine", "dot"}


# ----------------------------------------------------------------------------------------------
# distances
# ----------------------------------------------------------------------------------------------
def _normalize_row(x, p):
    norm = sum(x[k].abs() ** p for k in range(x.shape[0])) ** (1.0 / p)
    return x / norm.clamp_min(1e-12)


def _variance(v):
    n = v.shape[0]
    mean = sum(v[k] for k in range(n)) / n
    return sum((v[k] - mean) ** 2 for k in range(n)) / (n - 1)


def pair_distance(x, y, distance):
    """Distance/similarity of one query row ``x`` and one reference row ``y``."""
    name, kw = distance
    if name == "lp":
        p, power, normalize = kw.get("p", 2), kw.get("power", 1), kw.get("normalize", True)
        if normalize:
            x, y = _normalize_row(x, p), _normalize_row(y, p)
        d = sum((x[k] - y[k]).abs() ** p for k in range(x.shape[0])) ** (1.0 / p)
        return d**power
    if name == "cosine":
        x, y = _normalize_row(x, 2), _normalize_row(y, 2)
        return sum(x[k] * y[k] for k in range(x.shape[0]))
    if name == "dot":
        if kw.get("normalize", False):
            x, y = _normalize_row(x, 2), _normalize_row(y, 2)
        return sum(x[k] * y[k] for k in range(x.shape[0]))
    if name == "snr":
        x, y = _normalize_row(x, 2), _normalize_row(y, 2)
        return _variance(x - y) / _variance(x)
    raise ValueError(name)


def distance_matrix(emb, ref, distance):
    """Entry-by-entry (B, M) matrix as a nested list of 0-d tensors."""
    return [
        [pair_distance(emb[i], ref[j], distance) for j in range(ref.shape[0])]
        for i in range(emb.shape[0])
    ]


def is_similarity(distance):
    return distance[0] in SIMILARITIES


def pml_margin(x, y, distance):
    """PML's ``distance.margin(x, y)``: x - y for distances, y - x for similarities."""
    return y - x if is_similarity(distance) else x - y


# ----------------------------------------------------------------------------------------------
# pairs and triplets
# ----------------------------------------------------------------------------------------------
def _as_list(t):
    return [int(v) for v in t]


def pairs(labels, ref_labels, self_mode, indices_tuple=None):
    """(pos_pairs, neg_pairs) as lists of (anchor, other), with PML's duplicates kept."""
    if indices_tuple is not None:
        if len(indices_tuple) == 4:
            a1, p, a2, n = (_as_list(t) for t in indices_tuple)
        else:
            a, p, n = (_as_list(t) for t in indices_tuple)
            a1, a2 = a, a
        return list(zip(a1, p, strict=True)), list(zip(a2, n, strict=True))
    pos, neg = [], []
    for i in range(len(labels)):
        for j in range(len(ref_labels)):
            if self_mode and i == j:
                continue
            if int(labels[i]) == int(ref_labels[j]):
                pos.append((i, j))
            else:
                neg.append((i, j))
    return pos, neg


def triplets(labels, ref_labels, self_mode, indices_tuple=None):
    """All (a, p, n) triplets, or PML's conversion of a given index tuple."""
    if indices_tuple is not None and len(indices_tuple) == 3:
        return list(zip(*(_as_list(t) for t in indices_tuple), strict=True))
    pos, neg = pairs(labels, ref_labels, self_mode, indices_tuple)
    return [(a, p, n) for (a, p) in pos for (a2, n) in neg if a2 == a]


# ----------------------------------------------------------------------------------------------
# reducers
# ----------------------------------------------------------------------------------------------
def _zero(emb):
    return (emb * 0).sum()


def _mean(vals, emb):
    if len(vals) == 0:
        return _zero(emb)
    return sum(vals) / len(vals)


def reduce(losses, anchors, others, kind, reducer, emb, labels, batch_size):
    """Reduce a list of 0-d losses.

    ``anchors[k]`` is the query row of loss k (the anchor of a pair/triplet, the row of an
    element loss); ``others`` the second index of a pair (None for element/triplet losses).
    """
    name, kw = reducer
    if name == "mean":
        return _mean(losses, emb)
    if name == "sum":
        return sum(losses) if losses else _zero(emb)
    if name in ("avg_nonzero", "threshold"):
        low = 0.0 if name == "avg_nonzero" else kw.get("low")
        high = None if name == "avg_nonzero" else kw.get("high")
        kept = [
            v
            for v in losses
            if (low is None or float(v.detach()) > low)
            and (high is None or float(v.detach()) < high)
        ]
        return _mean(kept, emb)
    if name == "class_weighted":
        w = kw["weights"]
        return _mean(
            [v * w[int(labels[a])].to(v.dtype) for v, a in zip(losses, anchors, strict=True)], emb
        )
    if name == "per_anchor":
        inner = kw.get("reducer", ("mean", {}))
        if kind == "element":
            return reduce(losses, anchors, None, "element", inner, emb, labels, batch_size)
        if kind == "triplet":
            raise NotImplementedError("per_anchor does not reduce triplets")
        # PML writes each pair into a B x B array (duplicates overwrite) and averages per row.
        cell = {}
        for v, a, o in zip(losses, anchors, others, strict=True):
            cell[(a, o)] = v
        rows = []
        for i in range(batch_size):
            vals = [v for (a, _), v in cell.items() if a == i]
            rows.append(sum(vals) / len(vals) if vals else _zero(emb))
        return reduce(
            rows, list(range(batch_size)), None, "element", inner, emb, labels, batch_size
        )
    raise ValueError(name)


# ----------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------
def _setup(emb, labels, ref_emb, ref_labels, distance):
    self_mode = ref_emb is None
    ref = emb if self_mode else ref_emb
    rl = labels if self_mode else ref_labels
    return self_mode, ref, rl, distance_matrix(emb, ref, distance)


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
    self_mode, _, rl, mat = _setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pairs(labels, rl, self_mode, indices_tuple)
    relu = torch.nn.functional.relu
    pos_l = [relu(pml_margin(mat[a][p], pos_margin, distance)) for a, p in pos]
    neg_l = [relu(pml_margin(neg_margin, mat[a][n], distance)) for a, n in neg]
    B = emb.shape[0]
    return reduce(
        pos_l, [a for a, _ in pos], [p for _, p in pos], "pos_pair", reducer, emb, labels, B
    ) + reduce(neg_l, [a for a, _ in neg], [n for _, n in neg], "neg_pair", reducer, emb, labels, B)


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
    self_mode, ref, rl, mat = _setup(emb, labels, ref_emb, ref_labels, distance)
    trips = triplets(labels, rl, self_mode, indices_tuple)
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
):
    self_mode, _, rl, mat = _setup(emb, labels, ref_emb, ref_labels, distance)
    pos, neg = pairs(labels, rl, self_mode, indices_tuple)
    if not pos or not neg:  # PML: zero loss unless there is a positive and a negative pair
        return _zero(emb)
    sign = 1.0 if is_similarity(distance) else -1.0
    tiny = torch.finfo(emb.dtype).tiny
    losses = []
    for a, p in pos:
        num = torch.exp(sign * mat[a][p] / temperature)
        den = num + sum(
            (torch.exp(sign * mat[a2][n] / temperature) for a2, n in neg if a2 == a), 0.0
        )
        losses.append(-torch.log(num / den + tiny))
    return reduce(
        losses,
        [a for a, _ in pos],
        [p for _, p in pos],
        "pos_pair",
        reducer,
        emb,
        labels,
        emb.shape[0],
    )


def _masks(labels, rl, self_mode, indices_tuple, B, M):
    pos, neg = pairs(labels, rl, self_mode, indices_tuple)
    pos_set, neg_set = set(pos), set(neg)  # PML builds 0/1 masks: duplicates collapse
    P = [[(i, j) in pos_set for j in range(M)] for i in range(B)]
    N = [[(i, j) in neg_set for j in range(M)] for i in range(B)]
    return P, N, bool(pos_set), bool(neg_set)


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
    self_mode, ref, rl, mat = _setup(emb, labels, ref_emb, ref_labels, distance)
    B, M = emb.shape[0], ref.shape[0]
    P, N, any_pos, any_neg = _masks(labels, rl, self_mode, indices_tuple, B, M)
    if not (any_pos and any_neg):  # PML: zero loss unless both kinds of pair exist
        return _zero(emb)
    sign = 1.0 if is_similarity(distance) else -1.0
    tiny = torch.finfo(emb.dtype).tiny
    losses = []
    for i in range(B):
        logits = [sign * mat[i][j] / temperature for j in range(M)]
        keep = [logits[j] for j in range(M) if P[i][j] or N[i][j]]
        if keep:
            mx = max(float(v.detach()) for v in keep)
            lse = mx + torch.log(sum(torch.exp(v - mx) for v in keep))
        npos = sum(P[i])
        total = sum((logits[j] - lse for j in range(M) if P[i][j]), _zero(emb))
        losses.append(-total / (npos + tiny))
    return reduce(losses, list(range(B)), None, "element", reducer, emb, labels, B)


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
    self_mode, ref, rl, mat = _setup(emb, labels, ref_emb, ref_labels, distance)
    B, M = emb.shape[0], ref.shape[0]
    P, N, _, _ = _masks(labels, rl, self_mode, indices_tuple, B, M)
    losses = []
    for i in range(B):
        pos_terms = [
            torch.exp(alpha * pml_margin(mat[i][j], base, distance)) for j in range(M) if P[i][j]
        ]
        neg_terms = [
            torch.exp(beta * pml_margin(base, mat[i][j], distance)) for j in range(M) if N[i][j]
        ]
        lp = torch.log(1 + sum(pos_terms)) / alpha if pos_terms else _zero(emb)
        ln = torch.log(1 + sum(neg_terms)) / beta if neg_terms else _zero(emb)
        losses.append(lp + ln)
    return reduce(losses, list(range(B)), None, "element", reducer, emb, labels, B)


LOSSES = {
    "contrastive": contrastive,
    "triplet_margin": triplet_margin,
    "ntxent": ntxent,
    "supcon": supcon,
    "multi_similarity": multi_similarity,
}

__all__ = ["LOSSES", "distance_matrix", "pair_distance", "reduce"]
