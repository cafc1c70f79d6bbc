"""Clustering quality: k-means (:func:`kmeans`), the normalised and adjusted mutual information
of two labelings (:func:`normalized_mutual_info`, :func:`adjusted_mutual_info`) and PML's
``"NMI"``/``"AMI"`` of an embedding set (:func:`clustering_scores`)."""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _checks, _ops
from .._random import seed_tensor, uniform

_DEFAULT_SEED = 1234  # faiss's default k-means seed, the one PML's FaissKMeans runs with
_F64_EPS = torch.finfo(torch.float64).eps


class KMeansResult(NamedTuple):
    """What :func:`kmeans` returns."""

    assignments: Tensor
    """``(N,)`` int64 in ``[0, num_clusters)``: the nearest final centroid of each row (the
    lower index among equally near ones)."""
    centroids: Tensor
    """``(num_clusters, D)`` final centroids, in the compute dtype (float32 for float16/bfloat16
    embeddings, else the embeddings' dtype); all NaN when an embedding is not finite."""
    inertia: Tensor
    """0-d float64: ``Σᵢ ‖xᵢ − c_{assignments[i]}‖²`` (the k-means objective); NaN when an
    embedding is not finite."""


# ---------------------------------------------------------------------------------------------
# k-means
# ---------------------------------------------------------------------------------------------


def _assign(x: Tensor, centroids: Tensor, chunk_size: int) -> Tensor:
    """``(N,)`` int64: each row's nearest centroid (squared Euclidean; the first of equals).

    Per block of ``chunk_size`` rows, the ``(chunk, K)`` scores ``‖c‖² − 2 x·c`` (``‖x‖²`` does
    not change a row's argmin), as scikit-learn's Lloyd step computes them. NaN scores win
    (``argmin`` returns a NaN's index), so a non-finite row stays in range.
    """
    c_sq = (centroids * centroids).sum(1)
    ct = centroids.t()
    parts = [  # (the products in float32 also under torch.autocast: _ops.matmul)
        _ops.matmul(x[s : s + chunk_size], ct).mul_(-2.0).add_(c_sq).argmin(1)
        for s in range(0, x.shape[0], chunk_size)
    ]
    return torch.cat(parts)


def _sq_dists(x: Tensor, x_sq: Tensor, y: Tensor) -> Tensor:
    """``(len(x), len(y))`` squared Euclidean distances by the expansion, clamped at 0."""
    y_sq = (y * y).sum(1)
    d2 = (x_sq.unsqueeze(1) + y_sq).add_(_ops.matmul(x, y.t()), alpha=-2)
    return d2.clamp_min_(0)


def _kmeans_plusplus(
    x: Tensor, num_clusters: int, seed: Tensor, local_trials: int, chunk_size: int
) -> Tensor:
    """Greedy k-means++ (scikit-learn's ``_kmeans_plusplus``) with counter-based draws.

    First centre: row ``⌊u₀·N⌋``. Centre ``c``: ``local_trials`` candidates drawn with
    probability ``∝ D(x)²`` (inverse CDF: ``searchsorted`` of ``uᵢ·ΣD²`` in the cumulative sum),
    of which the one that most lowers the potential ``Σ min(D(x)², d(x, cand)²)`` is kept.
    Static shapes; the candidates' potentials are summed over row blocks (``chunk × trials``).
    """
    n = x.shape[0]
    dev = x.device
    x_sq = (x * x).sum(1)
    first = (uniform(seed, 0, (1,), device=dev) * n).to(torch.int64).clamp_max(n - 1)
    centers = [x.index_select(0, first)]
    closest = _sq_dists(x, x_sq, centers[0]).squeeze(1)  # (N,): D(x)²
    for c in range(1, num_clusters):
        cum = closest.to(torch.float64).cumsum(0)
        draws = uniform(seed, c, (local_trials,), device=dev) * cum[-1]
        cand = torch.searchsorted(cum, draws).clamp_max(n - 1)
        cand_x = x.index_select(0, cand)
        pots = torch.zeros(local_trials, dtype=torch.float64, device=dev)
        for s in range(0, n, chunk_size):
            d = _sq_dists(x[s : s + chunk_size], x_sq[s : s + chunk_size], cand_x)
            pots = pots + torch.minimum(d, closest[s : s + chunk_size].unsqueeze(1)).sum(
                0, dtype=torch.float64
            )
        new = cand_x.index_select(0, pots.argmin().reshape(1))
        centers.append(new)
        closest = torch.minimum(closest, _sq_dists(x, x_sq, new).squeeze(1))
    return torch.cat(centers)


def _lloyd_update(x: Tensor, centroids: Tensor, assign: Tensor) -> Tensor:
    """One M-step: the mean of each cluster, with scikit-learn's empty-cluster rule.

    An empty cluster is re-seeded at a far point: with ``d_i = ‖x_i − c_{a_i}‖²`` under the old
    centroids, the empty clusters in index order take the rows with the largest ``d_i`` in
    descending order (ties to the lower row index), each row leaving its old cluster. When every
    ``d_i`` is 0 (fewer distinct rows than clusters) nothing is moved and an empty cluster sits on
    the largest cluster's new centroid. Static shapes: every cluster computes its candidate row;
    ``where`` keeps it only for the empty ones.
    """
    n, dim = x.shape
    k = centroids.shape[0]
    counts = x.new_zeros(k).index_add_(0, assign, x.new_ones(n))
    sums = x.new_zeros(k, dim).index_add_(0, assign, x)
    dist = (x - centroids.index_select(0, assign)).pow(2).sum(1)
    empty = counts == 0
    rank = (empty.cumsum(0) - 1).clamp(0, k - 1)
    far = dist.sort(descending=True, stable=True).indices[:k]
    pick = far.index_select(0, rank)
    move = empty & (dist.amax() > 0)
    moved = move.to(x.dtype)
    far_x = x.index_select(0, pick)
    old = assign.index_select(0, pick)
    sums = sums.index_add(0, old, far_x * -moved.unsqueeze(1))
    counts = counts.index_add(0, old, -moved)
    sums = torch.where(move.unsqueeze(1), far_x, sums)
    counts = torch.where(move, torch.ones_like(counts), counts)
    means = sums * (1.0 / counts.clamp_min(1)).unsqueeze(1)  # scikit-learn multiplies by 1/w
    largest = means.index_select(0, counts.argmax().reshape(1))
    return torch.where((counts > 0).unsqueeze(1), means, largest)


def kmeans(
    embeddings: Tensor,
    num_clusters: int,
    *,
    generator: torch.Generator | Tensor | None = None,
    iterations: int = 20,
    init: Tensor | None = None,
    local_trials: int | None = None,
    chunk_size: int = 1024,
) -> KMeansResult:
    """k-means clustering: k-means++ seeding, then a fixed number of Lloyd iterations.

    Minimises the inertia ``Σᵢ ‖xᵢ − c_{a(i)}‖²`` over ``K = num_clusters`` centroids ``c`` and
    assignments ``a``. Seeding is greedy k-means++ (Arthur and Vassilvitskii; scikit-learn's
    variant): the first centroid is a uniformly drawn row; each next one is the best (lowest
    resulting inertia) of ``local_trials`` rows drawn with probability ``∝ D(x)²``, the squared
    distance to the nearest centroid so far. Then each of the ``iterations`` Lloyd steps assigns
    every row to its nearest centroid, ``a(i) = argmin_k ‖xᵢ − c_k‖²`` (the lower index among
    equals), and moves each centroid to the mean of its rows; the result's assignments are
    those of the final centroids.

    An empty cluster never yields NaN: as in scikit-learn, it is re-seeded at the row farthest
    from its centroid (the ``r``-th empty cluster, in index order, at the ``r``-th farthest row;
    that row leaves its cluster). Given the same initial centroids (``init``) the iterations are
    scikit-learn's ``KMeans(init=init, n_init=1, algorithm="lloyd", max_iter=iterations, tol=0)``
    to float rounding, its early stop included (once the assignments repeat and no cluster is
    empty, further steps change nothing); scikit-learn orders the relocated rows arbitrarily
    when several clusters are empty at once. The data are centred on their mean first, as
    scikit-learn does, which keeps the distance expansion ``‖c‖² − 2 x·c`` accurate far from
    the origin.

    Randomness is counter-based (:mod:`pmlfunc`'s ``generator=`` convention): one seed is
    drawn from ``generator`` and every draw is a hash of it, so a seeded generator gives the
    same clustering on every run and device. No host synchronisation, static shapes: the loops
    run ``num_clusters − 1`` seeding and ``iterations`` Lloyd steps whatever the data.

    Non-finite embeddings: when any entry of ``embeddings`` (or ``init``) is NaN or ±inf, the
    ``centroids`` and ``inertia`` are NaN and the ``assignments``, though in range, mean
    nothing.

    Memory: distances are computed for blocks of ``chunk_size`` rows, never more than
    ``chunk_size × max(K, local_trials)`` at once, plus ``O(N·D)`` for the centred rows and the
    per-row distances to their centroids. The result does not depend on ``chunk_size``
    (barring distances within rounding of each other).

    Args:
        embeddings: ``(N, D)`` floating-point rows; float16/bfloat16 are clustered in float32.
        num_clusters: ``K``, an int with ``1 <= K <= N``.
        generator: a ``torch.Generator`` (one seed is drawn from it, advancing it) or a 0-d
            integer seed tensor. Default ``None``: the fixed seed 1234 (faiss's default, with
            which PML's ``FaissKMeans`` runs), so the default result is the same on every call.
            Unused when ``init`` is given.
        iterations: Lloyd iterations, ``>= 0``; default 20 (PML's ``FaissKMeans(niter=20)``).
        init: ``(K, D)`` initial centroids on the embeddings' device, instead of k-means++.
        local_trials: candidates per k-means++ step; default ``2 + ⌊ln K⌋`` (scikit-learn's).
        chunk_size: rows per distance block (default 1024).

    Returns:
        :class:`KMeansResult` ``(assignments, centroids, inertia)``.

    Example:
        >>> x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0], [5.0, 5.1]])
        >>> result = kmeans(x, 2, generator=torch.Generator().manual_seed(0))
        >>> result.assignments
        tensor([1, 1, 0, 0, 0])
        >>> result.centroids
        tensor([[5.0333, 5.0333],
                [0.0500, 0.0000]])

    Reference: Arthur and Vassilvitskii, "k-means++: the advantages of careful seeding",
    SODA 2007.
    """
    embeddings = _checks.embeddings(embeddings)
    n, dim = embeddings.shape
    num_clusters = _checks.integer(num_clusters, "num_clusters")
    if num_clusters > n:
        raise ValueError(
            f"num_clusters={num_clusters} exceeds the {n} rows of embeddings (at most one "
            "cluster per row)"
        )
    iterations = _checks.integer(iterations, "iterations", minimum=0)
    chunk_size = _checks.chunk_size(chunk_size)
    if local_trials is None:
        local_trials = 2 + int(math.log(num_clusters))
    local_trials = _checks.integer(local_trials, "local_trials")
    if init is not None:
        init = _checks.embeddings(init, "init")
        if init.shape != (num_clusters, dim):
            raise ValueError(
                f"init must have shape (num_clusters, embedding_size) = ({num_clusters}, {dim}), "
                f"got {tuple(init.shape)}"
            )
        if init.device != embeddings.device:
            raise ValueError(f"init is on {init.device} but embeddings is on {embeddings.device}")
        seed = None
    else:
        if generator is None:
            generator = torch.tensor(_DEFAULT_SEED)
        seed = seed_tensor(generator, embeddings.device)
    with torch.no_grad():
        low = embeddings.dtype in _checks.LOW_PRECISION
        x = embeddings.float() if low else embeddings
        mean = x.mean(0)
        x = x - mean
        broken = ~x.isfinite().all()
        if init is not None:
            centroids = init.to(x.dtype) - mean
            broken = broken | ~init.isfinite().all()
        else:
            assert seed is not None
            centroids = _kmeans_plusplus(x, num_clusters, seed, local_trials, chunk_size)
        for _ in range(iterations):
            centroids = _lloyd_update(x, centroids, _assign(x, centroids, chunk_size))
        assign = _assign(x, centroids, chunk_size)
        residual = (x - centroids.index_select(0, assign)).pow(2).sum(1, dtype=torch.float64)
        inertia = residual.sum().masked_fill(broken, math.nan)
        return KMeansResult(assign, (centroids + mean).masked_fill(broken, math.nan), inertia)


# ---------------------------------------------------------------------------------------------
# Mutual information
# ---------------------------------------------------------------------------------------------


class _Table(NamedTuple):
    """The contingency table of two labelings in static shapes (every vector has length N)."""

    n: int
    rows: Tensor  # (N,) float64 class sizes a_i, zero-padded
    cols: Tensor  # (N,) float64 cluster sizes b_j, zero-padded
    cells: Tensor  # (N,) float64 non-zero cell counts n_ij in row-major order, zero-padded
    cell_rows: Tensor  # (N,) float64 a_i of each cell (0 for padding)
    cell_cols: Tensor  # (N,) float64 b_j of each cell (0 for padding)
    num_classes: Tensor  # 0-d int64
    num_clusters: Tensor  # 0-d int64


def _dense_ids(y: Tensor) -> Tensor:
    """``(N,)`` int64: the rank of each value among the distinct values of ``y`` (0, 1, ...)."""
    values, order = y.sort(stable=True)
    new = torch.ones_like(values, dtype=torch.bool)
    new[1:] = values[1:] != values[:-1]
    return torch.empty_like(order).scatter_(0, order, new.cumsum(0) - 1)


def _labelings(labels_true: object, labels_pred: object) -> tuple[Tensor, Tensor]:
    true = _checks.tensor(labels_true, "labels_true")
    if true.dtype.is_floating_point or true.dtype.is_complex:
        raise TypeError(f"labels_true must have an integer (or bool) dtype, got {true.dtype}")
    if true.ndim != 1:
        raise ValueError(
            f"labels_true must be 1-D of shape (num_samples,), got shape {tuple(true.shape)}"
        )
    if true.shape[0] == 0:
        raise ValueError("labels_true is empty; at least one sample is required")
    pred = _checks.labels(labels_pred, true.shape[0], true.device, "labels_pred", "labels_true")
    return true.to(torch.int64), pred.to(torch.int64)


def _table(labels_true: Tensor, labels_pred: Tensor) -> _Table:
    """Contingency counts from one sort of the pair keys ``id_true · N + id_pred``: ``O(N)``
    memory whatever the numbers of classes, no host synchronisation."""
    n = labels_true.shape[0]
    dev = labels_true.device
    f64 = torch.float64
    ids_t, ids_p = _dense_ids(labels_true), _dense_ids(labels_pred)
    ones = torch.ones(n, dtype=f64, device=dev)
    rows = torch.zeros(n, dtype=f64, device=dev).index_add_(0, ids_t, ones)
    cols = torch.zeros(n, dtype=f64, device=dev).index_add_(0, ids_p, ones)
    keys = (ids_t * n + ids_p).sort().values
    new = torch.ones_like(keys, dtype=torch.bool)
    new[1:] = keys[1:] != keys[:-1]
    cell = new.cumsum(0) - 1
    cells = torch.zeros(n, dtype=f64, device=dev).index_add_(0, cell, ones)
    # Every key of a cell is the same, so which duplicate the scatter writes does not matter.
    cell_keys = torch.zeros(n, dtype=torch.int64, device=dev).scatter_(0, cell, keys)
    present = cells > 0
    cell_rows = torch.where(present, rows.gather(0, cell_keys // n), 0.0)
    cell_cols = torch.where(present, cols.gather(0, cell_keys % n), 0.0)
    return _Table(
        n,
        rows,
        cols,
        cells,
        cell_rows,
        cell_cols,
        (rows > 0).sum(),
        (cols > 0).sum(),
    )


def _entropy(counts: Tensor, n: int) -> Tensor:
    """``H = −Σ (c/N) (ln c − ln N)`` over the non-zero ``counts`` (scikit-learn's ``_entropy``)."""
    present = counts > 0
    logs = torch.where(present, counts, 1.0).log() - math.log(n)
    return -torch.where(present, counts / n * logs, 0.0).sum()


def _mutual_info(t: _Table) -> Tensor:
    """scikit-learn's ``mutual_info_score`` from the table, term by term and in its order:
    ``Σ (n_ij/N)(ln n_ij − ln N) + (n_ij/N)(ln N + ln N − ln(a_i b_j))``, terms below float64's
    eps in magnitude zeroed, the sum clipped at 0, and 0 for a single class or cluster."""
    present = t.cells > 0
    nz = torch.where(present, t.cells, 1.0)
    outer = torch.where(present, t.cell_rows * t.cell_cols, 1.0)
    log_n = math.log(t.n)
    log_outer = -outer.log() + log_n + log_n
    frac = nz / t.n
    terms = frac * (nz.log() - log_n) + frac * log_outer
    terms = torch.where(present & (terms.abs() >= _F64_EPS), terms, 0.0)
    mi = terms.sum().clamp_min(0.0)
    single = (t.num_classes == 1) | (t.num_clusters == 1)
    return torch.where(single, 0.0, mi)


def _expected_mutual_info(t: _Table, chunk_size: int) -> Tensor:
    """``E[MI]`` under the hypergeometric model (scikit-learn's ``expected_mutual_information``):

    ``Σ_{i,j} Σ_{n=max(1, a_i+b_j−N)}^{min(a_i, b_j)} (n/N) ln(N n / (a_i b_j)) ·
    a_i! b_j! (N−a_i)! (N−b_j)! / (N! n! (a_i−n)! (b_j−n)! (N−a_i−b_j+n)!)``.

    A term depends on ``(a_i, b_j)`` only, so the sum runs over the distinct class sizes times
    the distinct cluster sizes, each pair weighted by how often it occurs (at most ``√(2N)``
    distinct sizes per side). Reading those sizes is the one host synchronisation; the terms
    are evaluated ``chunk_size`` at a time with ``torch.lgamma``, in scikit-learn's order of
    operations.
    """
    f64 = torch.float64
    dev = t.rows.device
    n = t.n
    size_a, mult_a = torch.unique(t.rows.to(torch.int64), return_counts=True)
    size_b, mult_b = torch.unique(t.cols.to(torch.int64), return_counts=True)
    keep_a, keep_b = size_a > 0, size_b > 0
    size_a, mult_a = size_a[keep_a], mult_a[keep_a]
    size_b, mult_b = size_b[keep_b], mult_b[keep_b]
    u = size_a.unsqueeze(1).expand(-1, size_b.shape[0]).flatten()
    v = size_b.unsqueeze(0).expand(size_a.shape[0], -1).flatten()
    weight = (mult_a.unsqueeze(1) * mult_b.unsqueeze(0)).flatten().to(f64)
    lo = (u + v - n).clamp_min(1)
    length = torch.minimum(u, v) - lo + 1
    uf, vf = u.to(f64), v.to(f64)
    lg = torch.lgamma
    # gln_a + gln_b + gln_Na + gln_Nb, per pair (left to right, as scikit-learn adds them)
    gln_pair = lg(uf + 1) + lg(vf + 1) + lg(n - uf + 1) + lg(n - vf + 1)
    log_u, log_v = uf.log(), vf.log()
    lg_n1 = math.lgamma(n + 1)
    log_n = math.log(n)
    cum = length.cumsum(0).tolist()
    emi = torch.zeros((), dtype=f64, device=dev)
    start = 0
    while start < len(cum):
        base = cum[start - 1] if start else 0
        end = max(bisect.bisect_right(cum, base + chunk_size, lo=start), start + 1)
        total = cum[end - 1] - base
        lens = length[start:end]
        pair = torch.repeat_interleave(
            torch.arange(start, end, device=dev), lens, output_size=total
        )
        first = (lens.cumsum(0) - lens).index_select(0, pair - start)
        nij = (lo.index_select(0, pair) + torch.arange(total, device=dev) - first).to(f64)
        a, b = uf.index_select(0, pair), vf.index_select(0, pair)
        term1 = nij / n
        term2 = (log_n + nij.log()) - log_u.index_select(0, pair) - log_v.index_select(0, pair)
        gln = (
            gln_pair.index_select(0, pair)
            - (lg(nij + 1) + lg_n1)
            - lg(a - nij + 1)
            - lg(b - nij + 1)
            - lg(n - a - b + nij + 1)
        )
        emi = emi + (weight.index_select(0, pair) * (term1 * term2 * gln.exp())).sum()
        start = end
    return emi


def _both_single(t: _Table) -> Tensor:
    return (t.num_classes == 1) & (t.num_clusters == 1)


def normalized_mutual_info(labels_true: Tensor, labels_pred: Tensor) -> Tensor:
    """Normalised mutual information of two labelings (scikit-learn's
    ``normalized_mutual_info_score`` with its default arithmetic mean; PML's ``"NMI"``).

    With ``n_ij`` the number of samples in class ``i`` and cluster ``j``, ``a_i = Σ_j n_ij``,
    ``b_j = Σ_i n_ij`` and ``N`` samples:

    ``MI = Σ_{ij} (n_ij/N) ln(N n_ij / (a_i b_j))``,
    ``H(a) = −Σ_i (a_i/N) ln(a_i/N)`` (likewise ``H(b)``),
    ``NMI = MI / ((H(a) + H(b)) / 2)``.

    As scikit-learn: 1.0 when both labelings have a single label (nothing is split, a perfect
    match), 0.0 when ``MI = 0`` otherwise (one of them has a single label, or they are
    independent). Label values are arbitrary ids (any integers, not necessarily contiguous);
    renaming them changes nothing, and the score is symmetric.

    Computed in float64 from the contingency table, term by term as scikit-learn does (equal to
    it to float64 rounding). The table comes from one sort of the ``N`` label pairs, so memory
    is ``O(N)`` whatever the numbers of classes, shapes are static and nothing is read on the
    host.

    Args:
        labels_true: ``(N,)`` integer (or bool) class ids, ``N >= 1``.
        labels_pred: ``(N,)`` integer (or bool) cluster ids on the same device.

    Returns:
        0-d float64 tensor in ``[0, 1]``.

    Example:
        >>> normalized_mutual_info(torch.tensor([0, 0, 1, 1]), torch.tensor([7, 7, 3, 3]))
        tensor(1., dtype=torch.float64)
        >>> normalized_mutual_info(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]))
        tensor(0., dtype=torch.float64)

    Reference: Strehl and Ghosh, "Cluster ensembles — a knowledge reuse framework for
    combining multiple partitions", JMLR 2002.
    """
    true, pred = _labelings(labels_true, labels_pred)
    with torch.no_grad():
        t = _table(true, pred)
        mi = _mutual_info(t)
        normalizer = (_entropy(t.rows, t.n) + _entropy(t.cols, t.n)) / 2
        nmi = mi / torch.where(normalizer > 0, normalizer, 1.0)
        return torch.where(_both_single(t), 1.0, torch.where(mi == 0, 0.0, nmi))


def adjusted_mutual_info(
    labels_true: Tensor, labels_pred: Tensor, *, chunk_size: int = 1 << 18
) -> Tensor:
    """Adjusted mutual information of two labelings (scikit-learn's
    ``adjusted_mutual_info_score`` with its default arithmetic mean; PML's ``"AMI"``).

    ``AMI = (MI − E[MI]) / ((H(a) + H(b)) / 2 − E[MI])`` with ``MI``, ``H`` as in
    :func:`normalized_mutual_info` and ``E[MI]`` the expected mutual information of two random
    labelings with the same label sizes (the hypergeometric model of Vinh et al.):

    ``E[MI] = Σ_{ij} Σ_{n} (n/N) ln(N n / (a_i b_j)) · a_i! b_j! (N−a_i)! (N−b_j)! /
    (N! n! (a_i−n)! (b_j−n)! (N−a_i−b_j+n)!)``, ``n`` from ``max(1, a_i + b_j − N)`` to
    ``min(a_i, b_j)``.

    0 in expectation for a random labeling, 1 for identical ones (up to renaming), negative
    when worse than chance. As scikit-learn: 1.0 when both labelings have a single label, 0.0
    when exactly one has; and the numerator and denominator are each pushed away from 0 to at
    least float64's eps in magnitude (keeping their sign), so a 0/0 (e.g. all labels distinct
    on both sides) gives ±1 rather than NaN, following scikit-learn's rounding.

    Computed in float64; ``E[MI]`` with ``torch.lgamma`` over the distinct pairs of (class size,
    cluster size), ``chunk_size`` terms at a time. Unlike :func:`normalized_mutual_info` this
    synchronises with the host once: the number of terms depends on the label sizes. Equal to
    scikit-learn to float64 rounding (the factorial ratio is the exponential of a difference
    of ``ln N!``-sized numbers, so both carry a relative error of about ``N ln N · 1e-16``).

    Args:
        labels_true: ``(N,)`` integer (or bool) class ids, ``N >= 1``.
        labels_pred: ``(N,)`` integer (or bool) cluster ids on the same device.
        chunk_size: terms of the ``E[MI]`` sum evaluated at once (memory about
            ``100 · chunk_size`` bytes; default ``2**18``).

    Returns:
        0-d float64 tensor.

    Example:
        >>> adjusted_mutual_info(torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 0, 0]))
        tensor(1., dtype=torch.float64)
        >>> adjusted_mutual_info(torch.tensor([0, 0, 0, 0]), torch.tensor([0, 1, 2, 3]))
        tensor(0., dtype=torch.float64)

    Reference: Vinh, Epps and Bailey, "Information theoretic measures for clusterings
    comparison", JMLR 2010.
    """
    true, pred = _labelings(labels_true, labels_pred)
    chunk_size = _checks.chunk_size(chunk_size)
    with torch.no_grad():
        t = _table(true, pred)
        mi = _mutual_info(t)
        emi = _expected_mutual_info(t, chunk_size)
        normalizer = (_entropy(t.rows, t.n) + _entropy(t.cols, t.n)) / 2
        den = normalizer - emi
        den = torch.where(den < 0, den.clamp_max(-_F64_EPS), den.clamp_min(_F64_EPS))
        num = mi - emi
        num = torch.where(num < 0, num.clamp_max(-_F64_EPS), num.clamp_min(_F64_EPS))
        one_single = (t.num_classes == 1) | (t.num_clusters == 1)
        ami = torch.where(one_single, 0.0, num / den)
        return torch.where(_both_single(t), 1.0, ami)


# ---------------------------------------------------------------------------------------------
# PML's NMI and AMI
# ---------------------------------------------------------------------------------------------


def clustering_scores(
    embeddings: Tensor,
    labels: Tensor,
    *,
    num_clusters: int | None = None,
    generator: torch.Generator | Tensor | None = None,
    iterations: int = 20,
    chunk_size: int = 1024,
) -> dict[str, Tensor]:
    """PML's clustering metrics of an embedding set: k-means, then NMI and AMI against the labels.

    As pytorch-metric-learning 2.9.0's ``AccuracyCalculator`` (keys ``"NMI"`` and ``"AMI"``):
    the rows are clustered by k-means into ``num_clusters`` clusters (default: as many as there
    are distinct labels), and the cluster ids are scored against ``labels`` with
    :func:`normalized_mutual_info` and :func:`adjusted_mutual_info` (scikit-learn's
    ``normalized_mutual_info_score`` and ``adjusted_mutual_info_score``, arithmetic mean).

    The scores equal scikit-learn's on the same cluster ids; the cluster ids themselves come
    from :func:`kmeans` (k-means++ seeding, ``iterations`` Lloyd steps, all rows), not from
    PML's ``FaissKMeans`` (faiss: randomly chosen initial centroids, seed 1234, 20 iterations
    on a subsample of at most 256 rows per centroid, empty clusters split off large ones), so
    the scores agree with PML's where both clusterings find the same partition (well-separated
    classes) and otherwise only approximately. The default is deterministic, as PML's is.

    Non-finite embeddings: when any entry is NaN or ±inf, both scores are NaN (a clustering of
    such rows means nothing). Host synchronisation: counting the distinct labels (only when
    ``num_clusters`` is ``None``) and the label sizes of the AMI.

    Args:
        embeddings: ``(N, D)`` floating-point embeddings (PML's ``query``).
        labels: ``(N,)`` integer (or bool) class ids (PML's ``query_labels``).
        num_clusters: k-means's ``K``, ``1 <= K <= N``; default the number of distinct labels.
        generator: seeds the k-means++ draws (see :func:`kmeans`); default the fixed seed 1234.
        iterations: Lloyd iterations (default 20, PML's).
        chunk_size: rows per distance block of the k-means.

    Returns:
        ``{"NMI": ..., "AMI": ...}``, float64 0-d tensors on the embeddings' device (NaN with a
        non-finite embedding).

    Example:
        >>> emb = torch.tensor([[0.0, 0.0], [0.1, 0.0], [4.0, 4.0], [4.1, 4.0], [0.0, 4.0]])
        >>> scores = clustering_scores(emb, torch.tensor([3, 3, 8, 8, 5]))
        >>> {name: round(value.item(), 6) for name, value in scores.items()}
        {'NMI': 1.0, 'AMI': 1.0}
    """
    embeddings = _checks.embeddings(embeddings)
    n = embeddings.shape[0]
    labels = _checks.labels(labels, n, embeddings.device)
    if num_clusters is None:
        num_clusters = int(torch.unique(labels).numel())
    result = kmeans(
        embeddings,
        num_clusters,
        generator=generator,
        iterations=iterations,
        chunk_size=chunk_size,
    )
    with torch.no_grad():
        broken = ~embeddings.isfinite().all()
        scores = {
            "NMI": normalized_mutual_info(labels, result.assignments),
            "AMI": adjusted_mutual_info(labels, result.assignments),
        }
        return {name: value.masked_fill(broken, math.nan) for name, value in scores.items()}
