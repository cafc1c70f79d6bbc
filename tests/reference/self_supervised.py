"""Float64 loop reference of ``pmlfunc.losses.self_supervised``: VICReg, Barlow Twins, the
negative cosine similarity (and its symmetric form) and the hypersphere loss.

Written from PML 2.9.0's ``VICRegLoss`` (Bardes et al. 2022): λ·mean squared difference of the
two views per row, μ·relu(1 − √(var + ε))/2 per dimension of each view, and ν·Σ_{k≠m} cov²/D per
view.
"""

from __future__ import annotations

import torch

from . import zero


def vicreg(z1, z2, lam=25.0, mu=25.0, nu=1.0, eps=1e-4, reducer="mean"):
    """Invariance, variance and covariance terms entry by entry; ``reducer`` (``"mean"``,
    ``"sum"`` or ``"avg_nonzero"``) reduces the per-row and per-dimension terms."""
    b, d = z1.shape

    def red(vals):
        if reducer == "sum":
            return sum(vals)
        if reducer == "avg_nonzero":
            kept = [v for v in vals if float(v.detach()) > 0]
            return sum(kept) / len(kept) if kept else zero(z1)
        return sum(vals) / len(vals)

    inv = [lam * sum((z1[i, k] - z2[i, k]) ** 2 for k in range(d)) / d for i in range(b)]

    def var_terms(z):
        out = []
        for k in range(d):
            m = sum(z[i, k] for i in range(b)) / b
            var = sum((z[i, k] - m) ** 2 for i in range(b)) / (b - 1)
            out.append(mu * torch.relu(1 - (var + eps).sqrt()) / 2)
        return out

    def cov(z):
        means = [sum(z[i, k] for i in range(b)) / b for k in range(d)]
        total = zero(z)
        for k in range(d):
            for m in range(d):
                if k != m:
                    c = sum((z[i, k] - means[k]) * (z[i, m] - means[m]) for i in range(b)) / (b - 1)
                    total = total + c * c
        return total / d

    return red(inv) + red(var_terms(z1)) + red(var_terms(z2)) + nu * (cov(z1) + cov(z2))


def barlow_twins(za, zb, lambda_param=5e-3, unbiased=True, eps=0.0):
    """Barlow Twins (Zbontar et al. 2021, Algorithm 1), entry by entry: each view standardised
    per dimension over the batch (``unbiased``: ``N − 1``), ``C_ij = Σ_n ẑa_ni ẑb_nj / N``,
    ``L = Σ_i (1 − C_ii)² + λ Σ_{i≠j} C_ij²``."""
    n, d = za.shape

    def standardised(z):
        cols = []
        for j in range(d):
            col = z[:, j]
            mu = sum(col[k] for k in range(n)) / n
            var = sum((col[k] - mu) ** 2 for k in range(n)) / (n - 1 if unbiased else n)
            cols.append([(col[k] - mu) / (var + eps) ** 0.5 for k in range(n)])
        return cols  # cols[j][k]

    a, b = standardised(za), standardised(zb)
    loss = 0.0
    for i in range(d):
        for j in range(d):
            c = sum(a[i][k] * b[j][k] for k in range(n)) / n
            loss = loss + ((1 - c) ** 2 if i == j else lambda_param * c**2)
    return loss


def _cos(u, v, eps):
    nu = torch.clamp(u.norm(), min=eps)
    nv = torch.clamp(v.norm(), min=eps)
    return torch.dot(u, v) / (nu * nv)


def negative_cosine_similarity(a, b, eps=1e-8):
    """``−mean_i cos(a_i, b_i)``, ``cos = u·v / (max(‖u‖, ε) max(‖v‖, ε))`` (SimSiam, BYOL)."""
    n = a.shape[0]
    return -sum(_cos(a[i], b[i], eps) for i in range(n)) / n


def sym_neg_cosine_similarity(z0, p0, z1, p1, eps=1e-8):
    """SimSiam's symmetric loss: ``−(mean cos(p0, sg z1) + mean cos(p1, sg z0)) / 2``."""
    return (
        negative_cosine_similarity(p0, z1.detach(), eps)
        + negative_cosine_similarity(p1, z0.detach(), eps)
    ) / 2


def hypersphere(a, b, t=1.0, lam=1.0, alpha=2.0):
    """Wang & Isola's alignment + λ·(uniformity(a) + uniformity(b)) / 2 on unit rows, pair by
    pair: alignment ``mean_i ‖â_i − b̂_i‖^α``, uniformity ``log mean_{i<j} exp(−t ‖x_i − x_j‖²)``."""
    n = a.shape[0]
    ua = [a[i] / a[i].norm() for i in range(n)]
    ub = [b[i] / b[i].norm() for i in range(n)]
    align = sum((ua[i] - ub[i]).norm() ** alpha for i in range(n)) / n

    def unif(x):
        terms = [
            torch.exp(-t * (x[i] - x[j]).norm() ** 2) for i in range(n) for j in range(i + 1, n)
        ]
        return torch.log(sum(terms) / len(terms))

    return align + lam * (unif(ua) + unif(ub)) / 2


def dino(teacher, student, center, teacher_temp=0.04, student_temp=0.1, center_momentum=0.9):
    """DINO (Caron et al. 2021, Algorithm 1) over views, row by row: the teacher's views
    centred and sharpened, ``H(P_t^(i), P_s^(v))`` for every pair ``v ≠ i`` averaged over the
    rows and the pairs; the centre ``m c + (1 − m) mean(teacher)``."""
    n, v_t, _ = teacher.shape
    v_s = student.shape[1]
    loss, pairs = 0.0, 0
    for i in range(v_t):
        for v in range(v_s):
            if v == i:
                continue
            pairs += 1
            for r in range(n):
                pt = torch.softmax((teacher[r, i].detach() - center) / teacher_temp, 0)
                ls = torch.log_softmax(student[r, v] / student_temp, 0)
                loss = loss - (pt * ls).sum() / n
    rows = [teacher[r, i].detach() for r in range(n) for i in range(v_t)]
    new_center = center_momentum * center + (1 - center_momentum) * sum(rows) / len(rows)
    return loss / pairs, new_center


def _sinkhorn_loops(scores, eps, iterations):
    """SwaV's Sinkhorn–Knopp (Caron et al. 2020, Algorithm 1) on one crop's ``(N, K)`` scores,
    entry by entry: ``Q = exp(s / ε)ᵀ`` scaled to sum 1, then ``iterations`` rounds of rows
    (each prototype's sum over the batch to ``1/K``) and columns (each sample's to ``1/N``);
    returned ``N · Qᵀ`` (each sample's codes sum to 1)."""
    n, k = scores.shape
    q = [[torch.exp(scores[b, j] / eps) for b in range(n)] for j in range(k)]
    whole = sum(sum(row) for row in q)
    q = [[v / whole for v in row] for row in q]
    for _ in range(iterations):
        q = [[v / sum(row) / k for v in row] for row in q]
        cols = [sum(q[j][b] for j in range(k)) for b in range(n)]
        q = [[q[j][b] / cols[b] / n for b in range(n)] for j in range(k)]
    return torch.stack([torch.stack([q[j][b] * n for j in range(k)]) for b in range(n)])


def swav(high, low=None, temperature=0.1, iterations=3, eps=0.05):
    """SwaV's swapped prediction: for each high-resolution crop ``i`` its codes, and the mean
    over the other crops ``v`` of ``−mean_n Σ_k q_nk log softmax(z_v / τ)_nk``; the mean over
    ``i``."""
    crops = [high[:, i] for i in range(high.shape[1])]
    crops += [] if low is None else [low[:, v] for v in range(low.shape[1])]
    n = high.shape[0]
    loss = 0.0
    for i in range(high.shape[1]):
        q = _sinkhorn_loops(high[:, i].detach(), eps, iterations)
        sub = 0.0
        for v, z in enumerate(crops):
            if v == i:
                continue
            sub = (
                sub
                - sum((q[b] * torch.log_softmax(z[b] / temperature, 0)).sum() for b in range(n)) / n
            )
        loss = loss + sub / (len(crops) - 1)
    return loss / high.shape[1]


def tico(za, zb, c0, beta=0.9, rho=20.0):
    """TiCo (Zhu et al. 2022), row by row on unit rows: ``C = β C₀ + (1 − β) Σ_n a_n a_nᵀ / N``,
    ``L = 1 − mean_n a_n·b_n + ρ mean_n a_nᵀ C a_n``; returns ``(L, C)``."""
    n = za.shape[0]
    a = [za[i] / za[i].norm() for i in range(n)]
    b = [zb[i] / zb[i].norm() for i in range(n)]
    c = beta * c0 + (1 - beta) * sum(torch.outer(v, v) for v in a) / n
    align = sum(torch.dot(a[i], b[i]) for i in range(n)) / n
    penalty = sum(torch.dot(a[i], c @ a[i]) for i in range(n)) / n
    return 1 - align + rho * penalty, c
