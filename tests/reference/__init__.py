"""Naive float64 references of every loss, one module per loss family (named like the
``pmlfunc.losses`` modules), and the loops they share: distances, pairs, triplets, reducers.

Each reference is written from its paper or from PML 2.9.0's semantics (its docstring says which)
with plain Python loops over pairs, triplets, anchors and classes. Nothing here imports pmlfunc.
Every number is a float64 torch scalar, so gradients of a reference come from ``torch.autograd``
on its inputs.

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


def unit(x):
    """``x`` over its Euclidean norm, summed entry by entry."""
    return x / torch.sqrt(sum(x[k] * x[k] for k in range(x.shape[0])))


def lse(xs):
    """log Σ e^x over a list of 0-d tensors; ``None`` for an empty list (PML's logsumexp of an
    empty set is 0: callers add 0 for it)."""
    if not xs:
        return None
    top = max(float(x.detach()) for x in xs)
    return top + torch.log(sum(torch.exp(x - top) for x in xs))


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


def oriented(value, distance):
    """``value`` oriented so that larger means closer (a distance negated)."""
    return value if is_similarity(distance) else -value


def pml_margin(x, y, distance):
    """PML's ``distance.margin(x, y)``: x - y for distances, y - x for similarities."""
    return y - x if is_similarity(distance) else x - y


# ----------------------------------------------------------------------------------------------
# pairs and triplets
# ----------------------------------------------------------------------------------------------
def _as_list(t):
    return [int(v) for v in t]


def pair_lists(labels, ref_labels, self_mode, indices_tuple=None):
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


def triplet_lists(labels, ref_labels, self_mode, indices_tuple=None):
    """All (a, p, n) triplets, or PML's conversion of a given index tuple."""
    if indices_tuple is not None and len(indices_tuple) == 3:
        return list(zip(*(_as_list(t) for t in indices_tuple), strict=True))
    pos, neg = pair_lists(labels, ref_labels, self_mode, indices_tuple)
    return [(a, p, n) for (a, p) in pos for (a2, n) in neg if a2 == a]


# ----------------------------------------------------------------------------------------------
# reducers
# ----------------------------------------------------------------------------------------------
def zero(emb):
    """A 0-d zero that stays in ``emb``'s autograd graph (a loss with nothing to average)."""
    return (emb * 0).sum()


def _mean(vals, emb):
    if len(vals) == 0:
        return zero(emb)
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
        return sum(losses) if losses else zero(emb)
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
            rows.append(sum(vals) / len(vals) if vals else zero(emb))
        return reduce(
            rows, list(range(batch_size)), None, "element", inner, emb, labels, batch_size
        )
    raise ValueError(name)


def setup(emb, labels, ref_emb, ref_labels, distance):
    """``(self_mode, ref, ref_labels, matrix)`` of the reference-set rule: without ``ref_emb``
    the batch is compared with itself."""
    self_mode = ref_emb is None
    ref = emb if self_mode else ref_emb
    rl = labels if self_mode else ref_labels
    return self_mode, ref, rl, distance_matrix(emb, ref, distance)


def reduce_pairs(losses, pairs, kind, reducer, emb, labels):
    """:func:`reduce` for one loss per ``(anchor, other)`` pair of ``pairs``."""
    return reduce(
        losses, [a for a, _ in pairs], [o for _, o in pairs], kind, reducer, emb, labels, len(emb)
    )


def reduce_rows(losses, reducer, emb, labels):
    """:func:`reduce` for one loss per query row."""
    return reduce(losses, list(range(len(emb))), None, "element", reducer, emb, labels, len(emb))


def masks(labels, ref_labels, self_mode, indices_tuple, b, m):
    """``(P, N, any_pos, any_neg)``: 0/1 ``b × m`` pair masks as nested lists of bools (PML's
    matrix-based losses build 0/1 masks: a pair listed twice counts once)."""
    pos, neg = pair_lists(labels, ref_labels, self_mode, indices_tuple)
    pos_set, neg_set = set(pos), set(neg)
    p = [[(i, j) in pos_set for j in range(m)] for i in range(b)]
    n = [[(i, j) in neg_set for j in range(m)] for i in range(b)]
    return p, n, bool(pos_set), bool(neg_set)


def similarity(x, y, name):
    """The similarity of two rows (larger means closer) under the distance called ``name``
    with its default options: cosine, dot, or minus the normalised Euclidean distance."""
    return oriented(pair_distance(x, y, (name, {})), (name, {}))


def miner_weights(indices_tuple, n, anchors_only=False):
    """PML's ``convert_to_weights``: each row's count in the tuple (its anchors only, when
    ``anchors_only``) over the largest count; all ones without a tuple or with an empty one."""
    if indices_tuple is None or all(len(t) == 0 for t in indices_tuple):
        return [1.0] * n
    if anchors_only:
        tensors = (
            [indices_tuple[0]] if len(indices_tuple) == 3 else [indices_tuple[0], indices_tuple[2]]
        )
    else:
        tensors = list(indices_tuple)
    counts = [0] * n
    for t in tensors:
        for i in t.tolist():
            counts[i] += 1
    top = max(counts)
    return [c / top for c in counts]
