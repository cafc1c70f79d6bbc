"""Float64 loop references of ``pmlfunc.losses.ranking``: losses of each anchor's ranking
(average precision, histograms of similarities, soft margins from a running histogram).

Written from the papers and PML 2.9.0's semantics (``FastAPLoss``, ``HistogramLoss``,
``SmoothAPLoss``, ``PNPLoss``, ``DynamicSoftMarginLoss``), without PML's known problems: SmoothAP
ranks each anchor's own class (PML groups consecutive blocks of rows), HistogramLoss puts a
similarity of exactly 1 on its last node, and DynamicSoftMarginLoss is one step on values in
range.
"""

from __future__ import annotations

import math

import torch

from . import miner_weights, pair_distance, triplet_lists, zero


def _relu(x):
    return x.clamp_min(0)


def fast_ap(emb, labels, ref=None, ref_labels=None, num_bins=10, power=2, tup=None):
    """FastAP (Cakir et al. 2019) as PML computes it: per anchor with a positive, 1 − the
    histogram-binned average precision of its ranking by the distance (to ``power``)."""
    self_mode = ref is None
    refs, rl = (emb, labels) if self_mode else (ref, ref_labels)
    lab_, rlab = labels.tolist(), rl.tolist()
    delta = 2**power / num_bins
    w = miner_weights(tup, len(lab_))
    out = []
    for a in range(emb.shape[0]):
        hp, hn, npos = [0.0] * (num_bins + 1), [0.0] * (num_bins + 1), 0
        for j in range(refs.shape[0]):
            if self_mode and j == a:
                continue
            d = pair_distance(emb[a], refs[j], ("lp", {"power": power}))
            same = lab_[a] == rlab[j]
            npos += same
            for e in range(num_bins + 1):
                pulse = _relu(1 - (d - e * delta).abs() / delta)
                if same:
                    hp[e] = hp[e] + pulse
                else:
                    hn[e] = hn[e] + pulse
        if npos == 0:
            continue
        cum_p, cum, total = 0.0, 0.0, 0.0
        for e in range(num_bins + 1):
            cum_p, cum = cum_p + hp[e], cum + hp[e] + hn[e]
            if float((hp[e] * cum_p).detach()) > 0 and float(cum.detach()) > 0:
                total = total + hp[e] * cum_p / cum
        out.append((1 - total / npos) * w[a])
    return sum(out) / len(out) if out else zero(emb)


def histogram(emb, labels, n_bins=100, tup=None):
    """Histogram loss (Ustinova & Lempitsky 2016): Σ_r p_neg(r) · P_pos(≤ r) of the linearly
    binned cosine similarities of the positive and negative pairs of the triplets."""
    trip = triplet_lists(labels, labels, True, tup)
    if not trip:
        return zero(emb)
    pos = sorted({tuple(sorted((a, p))) for a, p, _ in trip})
    neg = sorted({tuple(sorted((a, n))) for a, _, n in trip})
    delta = 2 / n_bins

    def density(pairs):
        out = []
        for r in range(n_bins + 1):
            node = -1 + r * delta
            out.append(
                sum(
                    _relu(1 - (pair_distance(emb[i], emb[j], ("cosine", {})) - node).abs() / delta)
                    for i, j in pairs
                )
                / len(pairs)
            )
        return out

    pp, pn = density(pos), density(neg)
    total, cum = 0.0, 0.0
    for r in range(n_bins + 1):
        cum = cum + pp[r]
        total = total + pn[r] * cum
    return total


def smooth_ap(emb, labels, temperature, tup=None):
    """Smooth-AP (Brown et al. 2020): per anchor, 1 − the mean over its class of the sigmoid
    rank among its class over the sigmoid rank among all rows."""
    y = labels.tolist()
    n = len(y)
    s = [[pair_distance(emb[i], emb[j], ("cosine", {})) for j in range(n)] for i in range(n)]
    w = miner_weights(tup, n)

    def sig(x):
        return torch.sigmoid(x / temperature)

    losses = []
    for a in range(n):
        group = [k for k in range(n) if y[k] == y[a]]
        ap = 0.0
        for pos in group:
            rp = 1 + sum(sig(s[a][k] - s[a][pos]) for k in group if k != pos)
            ra = 1 + sum(sig(s[a][k] - s[a][pos]) for k in range(n) if k != pos)
            ap = ap + rp / ra
        losses.append((1 - ap / len(group)) * w[a])
    return sum(losses) / n


def pnp(emb, labels, anneal=0.01, variant="O", b=2.0, alpha=1.0):
    """PNP (Li et al. 2022): per anchor with a positive, the mean over its positives of the
    chosen variant of the number of negatives ranked above it (sigmoid counts)."""
    y = labels.tolist()
    n = len(y)
    s = [[pair_distance(emb[i], emb[j], ("cosine", {})) for j in range(n)] for i in range(n)]

    def sig(x):
        return 1 / (1 + torch.exp((-x / anneal).clamp(-50, 50)))

    losses = []
    for a in range(n):
        pos = [j for j in range(n) if y[j] == y[a]]
        if len(pos) < 2:
            continue
        terms = []
        for j in pos:
            r = sum((sig(s[a][k] - s[a][j]) for k in range(n) if y[k] != y[a]), zero(emb))
            terms.append(
                {
                    "O": r,
                    "Ds": torch.log(1 + r),
                    "Dq": 1 / (1 + r) ** alpha,
                    "Iu": (1 + r) * torch.log(1 + r),
                    "Ib": (b * r - torch.log(1 + b * r)) / b**2,
                }[variant]
            )
        losses.append(sum(terms) / len(pos))
    if not losses:
        return zero(emb)
    loss = sum(losses) / len(losses)
    return 1 - loss if variant == "Dq" else loss


def dynamic_soft_margin(
    emb, labels, hist, ref=None, ref_labels=None, tup=None, min_val=-2.0, k=10, momentum=0.01
):
    """One PML step (values in range): returns (loss, new_hist)."""
    refs = emb if ref is None else ref
    dist = ("lp", {})
    if labels is None:
        n = min(emb.shape[0], refs.shape[0])
        vals = []
        for i in range(n):
            others = [pair_distance(emb[i], refs[j], dist) for j in range(refs.shape[0]) if j != i]
            others += [pair_distance(emb[j], refs[i], dist) for j in range(emb.shape[0]) if j != i]
            d_pos = (
                zero(emb) if ref is None else pair_distance(emb[i], refs[i], dist)
            )  # d(x, x) = 0
            vals.append(d_pos - min(others, key=float))
    else:
        if tup is None and ref is not None:
            y, ry = labels.tolist(), ref_labels.tolist()
            trip = [
                (a, p, n)
                for a in range(len(y))
                for p in range(len(ry))
                for n in range(len(ry))
                if y[a] == ry[p] and y[a] != ry[n]
            ]
        else:
            trip = triplet_lists(labels, labels, True, tup)
        vals = [
            pair_distance(emb[a], refs[p], dist) - pair_distance(emb[a], refs[n], dist)
            for a, p, n in trip
        ]
    if not vals:
        return zero(emb), hist
    delta = 2 * abs(min_val) / k
    mu = momentum if float(hist.sum()) != 0 else 1.0
    new = [(1 - mu) * hist[i] for i in range(k)]
    for v in vals:
        t = (v - min_val) / delta
        i = math.floor(float(t))
        frac = t - i
        new[i] = new[i] + mu * (1 - frac)
        new[i + 1] = new[i + 1] + mu * frac
    total = sum(new)
    new = [h / total for h in new]
    cdf = [sum(new[: i + 1]) for i in range(k)]
    loss = sum(cdf[math.floor(float((v - min_val) / delta))] * v for v in vals) / len(vals)
    return loss, torch.stack(new).detach()
