"""Float64 loop references of ``pmlfunc.losses.proxies``: losses of the similarities between
samples and learnable class proxies (or weights).

Written from PML 2.9.0's semantics (``ProxyAnchorLoss``, ``ProxyNCALoss``,
``NormalizedSoftmaxLoss``, ``SoftTripleLoss``, ``P2SGradLoss``), sample by sample and class by
class; a mined tuple weights each sample by PML's ``convert_to_weights``.
"""

from __future__ import annotations

import math

import torch

from . import miner_weights


def _sim(kind, a, b):
    """``(value, is_similarity)`` for one pair of vectors, PML's distances written out."""
    if kind == "cosine":
        return (a @ b) / (a.norm() * b.norm()), True
    if kind == "dot":
        return a @ b, True
    an, bn = a / a.norm(), b / b.norm()
    sq = ((an - bn) ** 2).sum()
    if kind == "lp_sq":
        return sq, False
    return sq.sqrt(), False


def proxy_anchor(emb, labels, proxies, *, margin=0.1, alpha=32.0, dist="cosine", tup=None):
    """PML's ``ProxyAnchorLoss``: per proxy, log(1 + Σ_pos e^{−α(s − δ)}) averaged over the
    proxies with a positive, plus log(1 + Σ_neg e^{α(s + δ)}) averaged over all proxies."""
    n, c_ = emb.shape[0], proxies.shape[0]
    mw = miner_weights(tup, n)
    y = labels.tolist()
    pos_total, neg_total, with_pos = 0.0, 0.0, 0
    for c in range(c_):
        pos_sum, neg_sum, has_pos, has_neg = 0.0, 0.0, False, False
        for i in range(n):
            s, is_sim = _sim(dist, emb[i], proxies[c])
            sign = -1.0 if is_sim else 1.0
            if y[i] == c:
                pos_sum = pos_sum + torch.exp(alpha * sign * (s - margin) + mw[i] - 1.0)
                has_pos = True
            else:
                neg_sum = neg_sum + torch.exp(alpha * sign * (-margin - s) + mw[i] - 1.0)
                has_neg = True
        if has_pos:
            pos_total = pos_total + torch.log(1.0 + pos_sum)
            with_pos += 1
        if has_neg:
            neg_total = neg_total + torch.log(1.0 + neg_sum)
    return pos_total / with_pos + neg_total / c_


def _log_softmax_own(z, y):
    top = max(float(v.detach()) for v in z)  # a constant shift, for range only
    return z[y] - top - torch.log(sum(torch.exp(v - top) for v in z))


def proxy_nca(emb, labels, proxies, *, softmax_scale=1.0, dist="lp_sq", tup=None):
    """PML's ``ProxyNCALoss``: the softmax cross-entropy of each sample over its scaled
    similarities to the proxies (a sample whose probability underflows to 0 is left out)."""
    n, c_ = emb.shape[0], proxies.shape[0]
    mw = miner_weights(tup, n, anchors_only=True)
    total, count = 0.0, 0
    for i in range(n):
        z = []
        for c in range(c_):
            s, is_sim = _sim(dist, emb[i], proxies[c])
            z.append(softmax_scale * (s if is_sim else -s))
        logp = _log_softmax_own(z, int(labels[i]))
        if math.exp(logp.detach().item()) != 0:
            total = total - logp * mw[i]
            count += 1
    return total / count


def normalized_softmax(emb, labels, weight, *, temperature=0.05, dist="cosine", tup=None):
    """PML's ``NormalizedSoftmaxLoss``: the softmax cross-entropy of each sample over its
    similarities to the L2-normalised class weights over the temperature."""
    n, c_ = emb.shape[0], weight.shape[0]
    mw = miner_weights(tup, n)
    p = 2.0
    total = 0.0
    for i in range(n):
        z = []
        for c in range(c_):
            w_hat = weight[c] / weight[c].abs().pow(p).sum().pow(1 / p)
            s, is_sim = _sim(dist, emb[i], w_hat)
            z.append((s if is_sim else -s) / temperature)
        total = total - _log_softmax_own(z, int(labels[i])) * mw[i]
    return total / n


def soft_triple(emb, labels, weight, *, la=20.0, gamma=0.1, margin=0.01, dist="cosine", tup=None):
    """PML's ``SoftTripleLoss``: per class, the softmax-weighted similarity to its centres; the
    softmax cross-entropy of λ·(those − δ at the target)."""
    n, c_, k_ = emb.shape[0], weight.shape[0], weight.shape[1]
    mw = miner_weights(tup, n)
    total = 0.0
    for i in range(n):
        z = []
        for c in range(c_):
            sims = [_sim(dist, emb[i], weight[c, k])[0] for k in range(k_)]
            den = sum(torch.exp(s / gamma) for s in sims)
            s_ic = sum(torch.exp(s / gamma) / den * s for s in sims)
            z.append(la * (s_ic - (margin if c == int(labels[i]) else 0.0)))
        total = total - _log_softmax_own(z, int(labels[i])) * mw[i]
    return total / n


def p2s_grad(emb, labels, weight_hat):
    """PML's ``P2SGradLoss``: the mean over samples and classes of (cos − onehot)². Takes the
    (already unit-norm) weight PML uses; gradients are w.r.t. it."""
    n, c_ = emb.shape[0], weight_hat.shape[0]
    total = 0.0
    for i in range(n):
        for c in range(c_):
            cos = (emb[i] @ weight_hat[c]) / emb[i].norm()
            cos = cos.clamp(-1.0, 1.0)
            total = total + (cos - (1.0 if c == int(labels[i]) else 0.0)) ** 2
    return total / (n * c_)
