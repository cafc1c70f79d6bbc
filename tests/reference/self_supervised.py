"""Float64 loop reference of ``pmlfunc.losses.self_supervised``: VICReg, Barlow Twins, the
negative cosine similarity (and its symmetric form), the hypersphere loss, DINO, SwaV, TiCo,
KoLeo, MMCR, SIGReg, iBOT's patch loss, W-MSE, MSN, PMSN and VICRegL.

Written from PML 2.9.0's ``VICRegLoss`` (Bardes et al. 2022): λ·mean squared difference of the
two views per row, μ·relu(1 − √(var + ε))/2 per dimension of each view, and ν·Σ_{k≠m} cov²/D per
view.
"""

from __future__ import annotations

import math

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


def vicregl(
    g_pooled,
    g_maps,
    g_grids,
    l_pooled=None,
    l_maps=None,
    l_grids=None,
    lam=25.0,
    mu=25.0,
    nu=1.0,
    alpha=0.75,
    eps=1e-4,
    num_matches=(20, 4),
):
    """VICRegL (Bardes et al. 2022; the authors' code and lightly 1.6.0's ``VICRegLLoss``) entry
    by entry: views stacked ``(N, V, ...)``; the global term over the pooled embeddings, the
    local term over nearest-neighbour matches of the flattened maps (in feature space and by
    grid location), each match set's VICReg with variances and covariances per match rank."""
    n = g_pooled.shape[0]
    views = [
        (g_pooled[:, v], g_maps[:, v].flatten(1, 2), g_grids[:, v].flatten(1, 2))
        for v in range(g_pooled.shape[1])
    ]
    if l_pooled is not None:
        views += [
            (l_pooled[:, v], l_maps[:, v].flatten(1, 2), l_grids[:, v].flatten(1, 2))
            for v in range(l_pooled.shape[1])
        ]
    pairs = [(a, b) for a in range(g_pooled.shape[1]) for b in range(len(views)) if a != b]

    def mse(rows_a, rows_b):  # lists of equal-length vectors
        terms = [
            (x[e] - y[e]) ** 2 for x, y in zip(rows_a, rows_b, strict=True) for e in range(len(x))
        ]
        return sum(terms) / len(terms)

    def var_cov(cols):  # cols: N vectors of width d -> mean_d relu(1 - std), Σ_{d≠e} C² / d
        d = len(cols[0])
        means = [sum(c[k] for c in cols) / n for k in range(d)]

        def cov(k, m):
            return sum((c[k] - means[k]) * (c[m] - means[m]) for c in cols) / (n - 1)

        var = sum(torch.relu(1 - (cov(k, k) + eps).sqrt()) for k in range(d)) / d
        off = sum(cov(k, m) ** 2 for k in range(d) for m in range(d) if k != m) / d
        return var, off

    pooled = [v[0] for v in views]
    inv = sum(mse(list(pooled[a]), list(pooled[b])) for a, b in pairs) / len(pairs)
    stats = [var_cov(list(p)) for p in pooled]
    g_var = sum(s[0] for s in stats) / len(stats)
    g_cov = sum(s[1] for s in stats) / len(stats)
    global_loss = lam * inv + mu * g_var + nu * g_cov

    def match(x, y, kx, ky, k):  # per sample: the k rows of x nearest their neighbour in y
        out_x, out_y = [], []
        for i in range(n):
            best = []
            for r in range(kx.shape[1]):
                dist = [((kx[i, r] - ky[i, c]) ** 2).sum().sqrt() for c in range(ky.shape[1])]
                c = min(range(len(dist)), key=lambda j: float(dist[j]))
                best.append((float(dist[c]), r, c))
            kept = sorted(best)[: min(k, len(best))]
            out_x.append([x[i, r] for _, r, _ in kept])
            out_y.append([y[i, c] for _, _, c in kept])
        return out_x, out_y

    def vicreg_(xs, ys):  # N lists of k vectors each
        k = len(xs[0])
        inv = mse([v for row in xs for v in row], [v for row in ys for v in row])
        sx = [var_cov([xs[i][j] for i in range(n)]) for j in range(k)]
        sy = [var_cov([ys[i][j] for i in range(n)]) for j in range(k)]
        var = 0.5 * (sum(s[0] for s in sx) / k + sum(s[0] for s in sy) / k)
        cov = sum(s[1] for s in sx) / k + sum(s[1] for s in sy) / k
        return lam * inv + mu * var + 0.5 * nu * cov

    local = 0.0
    for a, b in pairs:
        (_, za, ga), (_, zb, gb) = views[a], views[b]
        for ka, kb in ((za, zb), (ga, gb)):  # in feature space, then by grid location
            m1 = vicreg_(*match(za, zb, ka.detach(), kb.detach(), num_matches[0]))
            m2 = vicreg_(*match(zb, za, kb.detach(), ka.detach(), num_matches[1]))
            local = local + 0.5 * (m1 + m2)
    return alpha * global_loss + (1 - alpha) * local / len(pairs)


def koleo(x, p=2, eps=1e-8):
    """KoLeo (Sablayrolles et al. 2019; DINOv2's and lightly's form), row by row: each row
    normalised, its nearest neighbour the largest cosine (``j ≠ i``, compared as Python
    floats), ``−mean_i log(‖x̂_i − x̂_n(i) + ε‖_p + ε)``."""
    n, d = x.shape
    unit = [x[i] / torch.clamp(x[i].norm(), min=eps) for i in range(n)]
    loss = 0.0
    for i in range(n):
        cos = [float(torch.dot(unit[i], unit[j]).detach()) if j != i else -3.0 for j in range(n)]
        j = max(range(n), key=lambda k: cos[k])
        diff = [unit[i][k] - unit[j][k] + eps for k in range(d)]
        dist = sum(abs(v) ** p for v in diff) ** (1 / p)
        loss = loss - torch.log(dist + eps) / n
    return loss


def _nuclear(rows):
    """``Σ σ`` of the matrix of ``rows`` (a list of ``(D,)``): the square roots of the
    eigenvalues of the smaller Gram matrix, its entries summed product by product (full rank in
    the tests: every eigenvalue positive, so its square root differentiable)."""
    m, d = len(rows), rows[0].shape[0]
    if m <= d:
        gram = torch.stack(
            [torch.stack([torch.dot(rows[a], rows[b]) for b in range(m)]) for a in range(m)]
        )
    else:
        cols = [torch.stack([r[k] for r in rows]) for k in range(d)]
        gram = torch.stack(
            [torch.stack([torch.dot(cols[a], cols[b]) for b in range(d)]) for a in range(d)]
        )
    return torch.linalg.eigvalsh(gram).sqrt().sum()


def mmcr(z, momentum=None, lmda=5e-3, normalize=True):
    """MMCR (Yerxa et al. 2023; lightly's ``MMCRLoss``), sample by sample: the views (and the
    momentum views) of each sample, normalised when ``normalize``, their centroid; ``−‖C‖_*
    + λ mean_n ‖Z_n‖_*``."""
    n, k, _ = z.shape
    views = [[z[i, v] for v in range(k)] for i in range(n)]
    if momentum is not None:
        views = [views[i] + [momentum[i, v] for v in range(momentum.shape[1])] for i in range(n)]
    if normalize:
        views = [[v / v.norm() for v in sample] for sample in views]
    centroids = [sum(sample) / len(sample) for sample in views]
    local = sum(_nuclear(sample) for sample in views) / n
    return -_nuclear(centroids) + lmda * local


def sigreg(x, directions, knots=17, t_max=3.0):
    """SIGReg (LeJEPA, Balestriero & LeCun 2025): for each direction ``a_m`` (a column of
    ``directions``) and frequency ``t_k = k t_max / (knots − 1)``, the empirical characteristic
    function of ``x_n · a_m`` summed sample by sample, its squared distance to ``exp(−t²/2)``,
    integrated by the trapezoidal rule over ``[−t_max, t_max]`` with the weight ``exp(−t²/2)``
    and times ``N``; the mean over the directions (and over the views of ``(N, V, D)``)."""
    if x.ndim == 3:
        per_view = [sigreg(x[:, v], directions, knots, t_max) for v in range(x.shape[1])]
        return sum(per_view) / len(per_view)
    n = x.shape[0]
    dt = t_max / (knots - 1)
    total = 0.0
    for m in range(directions.shape[1]):
        s = [torch.dot(x[i], directions[:, m]) for i in range(n)]
        integral = 0.0
        for k in range(-(knots - 1), knots):  # the whole symmetric grid
            t = k * dt
            phi = math.exp(-t * t / 2)
            re = sum(torch.cos(t * v) for v in s) / n
            im = sum(torch.sin(t * v) for v in s) / n
            w = dt / 2 if abs(k) == knots - 1 else dt
            integral = integral + w * phi * ((re - phi) ** 2 + im**2)
        total = total + n * integral
    return total / directions.shape[1]


def ibot_patch(
    teacher, student, mask, center, teacher_temp=0.04, student_temp=0.1, center_momentum=0.9
):
    """iBOT's patch loss (Zhou et al. 2022; DINOv2's and lightly's ``IBOTPatchLoss``), image by
    image over ``(B, P, K)`` patch outputs and a ``(B, P)`` mask: each masked patch's cross
    entropy of the centred, sharpened teacher with the student, averaged over the image's
    masked patches, then over the images; the centre ``m c + (1 − m) mean`` of the masked
    teacher patches."""
    b, p, _ = teacher.shape
    loss, picked = 0.0, []
    for i in range(b):
        masked = [j for j in range(p) if bool(mask[i, j])]
        for j in masked:
            pt = torch.softmax((teacher[i, j].detach() - center) / teacher_temp, 0)
            ls = torch.log_softmax(student[i, j] / student_temp, 0)
            loss = loss - (pt * ls).sum() / max(1, len(masked)) / b
            picked.append(teacher[i, j].detach())
    if not picked:
        return loss, center
    return loss, center_momentum * center + (1 - center_momentum) * sum(picked) / len(picked)


def _cholesky(a):
    """The lower Cholesky factor of ``a`` entry by entry (Cholesky–Banachiewicz)."""
    d = a.shape[0]
    rows = [[zero(a) for _ in range(d)] for _ in range(d)]
    for i in range(d):
        for j in range(i + 1):
            s = sum((rows[i][k] * rows[j][k] for k in range(j)), zero(a))
            if i == j:
                rows[i][j] = torch.sqrt(a[i, i] - s)
            else:
                rows[i][j] = (a[i, j] - s) / rows[j][j]
    return rows


def _whiten(rows, eps):
    """``(x − x̄) L^{−ᵀ}`` for each row (``L L^ᵀ`` the shrunk unbiased covariance): forward
    substitution ``L z = x − x̄``, entry by entry."""
    w, d = len(rows), rows[0].shape[0]
    mean = sum(rows) / w
    xc = [r - mean for r in rows]
    cov = torch.stack(
        [torch.stack([sum(v[a] * v[c] for v in xc) / (w - 1) for c in range(d)]) for a in range(d)]
    )
    chol = _cholesky((1 - eps) * cov + eps * torch.eye(d, dtype=cov.dtype))
    out = []
    for v in xc:
        z = []
        for i in range(d):
            z.append((v[i] - sum((chol[i][k] * z[k] for k in range(i)), zero(v))) / chol[i][i])
        out.append(torch.stack(z))
    return out


def wmse(x, orders, w_size, eps=0.0):
    """W-MSE (Ermolov et al. 2021; lightly's ``WMSELoss``) over ``(N, V, D)`` views: for each
    order of the rows (one per iteration), each view of each consecutive block of ``w_size``
    rows whitened, then ``2 − 2 cos`` of every pair of views of every row, averaged over the
    rows, the pairs and the iterations."""
    n, v, _ = x.shape
    total, count = 0.0, 0
    for order in orders:
        z = [[None] * v for _ in range(n)]
        for start in range(0, n, w_size):
            block = order[start : start + w_size]
            for u in range(v):
                for r, white in zip(block, _whiten([x[r, u] for r in block], eps), strict=True):
                    z[r][u] = white / white.norm()
        for a in range(v):
            for c in range(a + 1, v):
                total = total + sum(2 - 2 * torch.dot(z[r][a], z[r][c]) for r in range(n)) / n
                count += 1
    return total / count


def _unit(x):
    return x / torch.clamp(x.norm(), min=1e-12)


def msn(anchors, targets, prototypes, temperature=0.1, iterations=3, weight=1.0, sharpen=0.25,
        power=None):  # fmt: skip
    """MSN (Assran et al. 2022; lightly's ``MSNLoss``), image by image over ``(N, V, D)``
    anchors: ``p_nv = softmax(â·Ĉᵀ/τ)``; the target's ``softmax(t̂·Ĉᵀ/τ)^(1/T)`` renormalised,
    then lightly's Sinkhorn entry by entry (the matrix scaled to sum 1, each prototype's row to
    ``1/K``, each image's column to ``1/N``; returned ``N · Qᵀ``); the mean over ``(n, v)`` of
    ``−Σ_k q_nk log p_nvk`` plus ``λ KL(p̄ ‖ prior)`` (``Σ p̄ log p̄ + log K`` for the uniform
    prior, ``power=None``; else ``Σ π log(π / p̄)``, ``π_k ∝ k^(−power)``, PMSN's)."""
    n, v, _ = anchors.shape
    c = [_unit(prototypes[j]) for j in range(prototypes.shape[0])]
    k = len(c)

    def probs(x, tau):
        return torch.softmax(torch.stack([torch.dot(_unit(x), cj) for cj in c]) / tau, 0)

    q = []
    for b in range(n):
        p = probs(targets[b].detach(), temperature).detach() ** (1 / sharpen)
        q.append([p[j] / p.sum() for j in range(k)])
    if iterations > 0:
        qt = [[q[b][j] for b in range(n)] for j in range(k)]  # K × N
        whole = sum(sum(row) for row in qt)
        qt = [[x / whole for x in row] for row in qt]
        for _ in range(iterations):
            qt = [[x / sum(row) / k for x in row] for row in qt]
            cols = [sum(qt[j][b] for j in range(k)) for b in range(n)]
            qt = [[qt[j][b] / cols[b] / n for b in range(n)] for j in range(k)]
        q = [[qt[j][b] * n for j in range(k)] for b in range(n)]
    loss, mean_p = 0.0, [0.0] * k
    for b in range(n):
        for u in range(v):
            p = probs(anchors[b, u], temperature)
            loss = loss - sum(q[b][j] * torch.log(p[j]) for j in range(k)) / (n * v)
            mean_p = [mean_p[j] + p[j] / (n * v) for j in range(k)]
    if power is None:
        reg = sum(m * torch.log(m) for m in mean_p) + math.log(k)
    else:
        prior = [(j + 1) ** -power for j in range(k)]
        prior = [x / sum(prior) for x in prior]
        reg = sum(
            pi * math.log(pi) - pi * torch.log(m) for pi, m in zip(prior, mean_p, strict=True)
        )
    return loss + weight * reg
