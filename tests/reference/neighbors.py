"""Float64 loop references of ``pmlfunc.losses.neighbors``: a softmax or ranking over each
anchor's neighbourhood.

Written from PML 2.9.0's semantics (``NCALoss``, ``NPairsLoss``, ``AngularLoss``,
``InstanceLoss``, ``RankedListLoss``, ``ManifoldLoss``), with pmlfunc's documented fixes: ``nca``
is 0 (not NaN) when no anchor has a positive and scores a batch of one; ``manifold`` with
``lambdaC=inf`` is the context loss alone (PML: inf·loss).
"""

from __future__ import annotations

import math

import torch

from . import distance_matrix, oriented, pair_distance, pair_lists, reduce, setup, unit, zero


def nca(
    emb,
    labels,
    *,
    softmax_scale=1.0,
    distance=("lp", {"power": 2}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``NCALoss``: per anchor with a positive, −log of the softmax mass of its positives
    (scaled similarities); a mined tuple weights each anchor by its count over the largest."""
    self_mode, ref, rl, mat = setup(emb, labels, ref_emb, ref_labels, distance)
    b, m = emb.shape[0], ref.shape[0]
    weights = [1.0] * b
    if indices_tuple is not None and any(len(t) for t in indices_tuple):
        t = [list(map(int, x)) for x in indices_tuple]
        idx = (t[0] if len(t) == 3 else t[0] + t[2]) if not self_mode else [i for x in t for i in x]
        counts = [idx.count(i) for i in range(b)]
        weights = [c / max(counts) for c in counts]
    losses, anchors = [], []
    for i in range(b):
        cols = [j for j in range(m) if not (self_mode and i == j)]
        z = {j: softmax_scale * oriented(mat[i][j], distance) for j in cols}
        mx = max(float(v.detach()) for v in z.values()) if z else 0.0
        den = sum(torch.exp(z[j] - mx) for j in cols)
        num = sum(torch.exp(z[j] - mx) for j in cols if int(labels[i]) == int(rl[j]))
        if not cols or not torch.is_tensor(num) or float(num.detach()) == 0.0:
            continue  # no positive: left out
        losses.append(-torch.log(num / den) * weights[i])
        anchors.append(i)
    return reduce(losses, anchors, None, "element", reducer, emb, labels, b)


def npairs(emb, labels, *, distance=("cosine", {}), reducer=("mean", {}), indices_tuple=None):
    """PML's ``NPairsLoss``: one (anchor, positive) pair per class, a softmax cross-entropy of
    each anchor over the chosen positives."""
    b = emb.shape[0]
    if indices_tuple is None:
        cand = [(i, j) for i in range(b) for j in range(b) if i != j and labels[i] == labels[j]]
    else:
        cand = list(zip(map(int, indices_tuple[0]), map(int, indices_tuple[1]), strict=True))
    chosen, seen = [], set()
    for a, p in cand:
        if int(labels[a]) not in seen:
            seen.add(int(labels[a]))
            chosen.append((a, p))
    losses = []
    for a, p in chosen:
        z = [oriented(pair_distance(emb[a], emb[q], distance), distance) for _, q in chosen]
        own = oriented(pair_distance(emb[a], emb[p], distance), distance)
        losses.append(torch.log(sum(torch.exp(v) for v in z)) - own)
    return reduce(losses, [a for a, _ in chosen], None, "element", reducer, emb, labels, b)


def angular(
    emb,
    labels,
    *,
    alpha=40.0,
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    """PML's ``AngularLoss``: per positive pair, log(1 + Σ_n e^{4 tan²α (x_a + x_p)·x_n −
    2(1 + tan²α) x_a·x_p}) with unit x_a, x_p and the negatives as given."""
    self_mode, ref, rl, _ = setup(emb, labels, ref_emb, ref_labels, ("lp", {}))
    pos, neg = pair_lists(labels, rl, self_mode, indices_tuple)
    if not pos or not neg:
        return zero(emb)
    t = math.tan(math.radians(alpha)) ** 2
    losses = []
    for a, p in pos:
        xa, xp = unit(emb[a]), unit(ref[p])
        terms = [
            4 * t * ((xa + xp) * ref[n]).sum() - 2 * (1 + t) * (xa * xp).sum()
            for n in range(ref.shape[0])
            if int(labels[a]) != int(rl[n])
        ]
        losses.append(torch.log(1 + sum(torch.exp(f) for f in terms)) if terms else zero(emb))
    return reduce(
        losses, [a for a, _ in pos], [p for _, p in pos], "pos_pair", reducer, emb, labels, len(emb)
    )


def instance(emb, labels, *, gamma=64.0, reducer=("mean", {})):
    """PML's ``InstanceLoss``: a softmax over the batch's cosine similarities (× γ) with each
    row's class index as its target."""
    classes = sorted(set(map(int, labels)))
    b = emb.shape[0]
    losses = []
    for i in range(b):
        z = [gamma * pair_distance(emb[i], emb[j], ("cosine", {})) for j in range(b)]
        t = classes.index(int(labels[i]))
        losses.append(torch.log(sum(torch.exp(v) for v in z)) - z[t])
    return reduce(losses, list(range(b)), None, "element", reducer, emb, labels, b)


def ranked_list(
    emb,
    labels,
    *,
    margin,
    Tn,
    imbalance=0.5,
    alpha=None,
    Tp=0.0,
    distance=("lp", {}),
    reducer=("mean", {}),
):
    """PML's ``RankedListLoss``: per anchor, weighted means of the positives beyond α − m and of
    the negatives within α, mixed by ``imbalance``."""
    alpha = 1 + margin / 2 if alpha is None else alpha
    b = emb.shape[0]
    mat = distance_matrix(emb, emb, distance)
    losses = []
    for i in range(b):
        num_p = den_p = num_n = den_n = zero(emb)
        for j in range(b):
            d = mat[i][j]
            if i == j or float(d) <= 0:
                continue
            if labels[i] == labels[j] and float(d) > alpha - margin:
                w = torch.exp(Tp * (d - (alpha - margin)))
                num_p, den_p = num_p + w * (d - (alpha - margin)), den_p + w
            if labels[i] != labels[j] and float(d) < alpha:
                w = torch.exp(Tn * (alpha - d))
                num_n, den_n = num_n + w * (alpha - d), den_n + w
        lp_ = num_p / (den_p + 1e-5 * b)
        ln_ = num_n / (den_n + 1e-5 * b)
        losses.append((1 - imbalance) * lp_ + imbalance * ln_)
    return reduce(losses, list(range(b)), None, "element", reducer, emb, labels, b)


def manifold(emb, proxies, meta, *, lambdaC=1.0, alpha=0.8, margin=5e-4):
    """PML's ``ManifoldLoss`` on given meta-classes: the random-walk affinity
    F = (1 − α)(I − α S̄)⁻¹ of the embeddings and proxies, its intrinsic and context parts."""
    n, k = emb.shape[0], proxies.shape[0]
    nodes = torch.cat([emb, proxies])
    size = n + k
    rows = []
    for i in range(size):
        row = []
        for j in range(size):
            c = pair_distance(nodes[i], nodes[j], ("cosine", {}))
            row.append(zero(emb) if i == j else torch.exp(torch.clamp(c, min=0) / 0.5))
        rows.append(torch.stack(row))
    s = torch.stack(rows)
    deg = [sum(s[i][j] for j in range(size)) for i in range(size)]
    s_bar = torch.stack(
        [
            torch.stack([s[i][j] / torch.sqrt(deg[i] * deg[j]) for j in range(size)])
            for i in range(size)
        ]
    )
    f = (1 - alpha) * torch.linalg.inv(torch.eye(size, dtype=emb.dtype) - alpha * s_bar)

    def cos(u, v):
        return (u * v).sum() / (torch.sqrt((u * u).sum()) * torch.sqrt((v * v).sum()))

    def part(x):
        total = zero(emb)
        for i in range(n):
            c = int(meta[i])
            terms = [x(i, q) - x(i, c) + margin for q in range(k) if q != c]
            total = total + torch.log(
                1 + sum((torch.exp(v) for v in terms if float(v) >= 0), zero(emb))
            )
        return total / n

    loss_ctx = part(lambda i, q: cos(f[i], f[n + q]))
    if lambdaC == math.inf:
        return loss_ctx
    return part(lambda i, q: f[i][n + q]) + lambdaC * loss_ctx
