"""Tests for pmlfunc.evaluation's clustering metrics: kmeans, normalized_mutual_info,
adjusted_mutual_info and clustering_scores.

Proof by independent routes: scikit-learn's ``normalized_mutual_info_score`` /
``adjusted_mutual_info_score`` on many labelings and every edge case, an exact (mpmath
log-factorial) evaluation of scikit-learn's expected-mutual-information formula where its own
``lgamma`` rounding shows, scikit-learn's Lloyd ``KMeans`` started from the same centroids,
PML 2.9.0's ``AccuracyCalculator`` given our k-means, and invariances (chunk size, seeds, label
renaming)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN
from sklearn.cluster import KMeans
from sklearn.metrics import (
    adjusted_mutual_info_score,
    normalized_mutual_info_score,
)

from pmlfunc.evaluation import (
    KMeansResult,
    adjusted_mutual_info,
    clustering_scores,
    kmeans,
    normalized_mutual_info,
)
from pmlfunc.evaluation._clustering import _assign


# ----------------------------------------------------------------------------------------------
# data and references
# ----------------------------------------------------------------------------------------------
def blobs(gen, num_classes, per_class, dim=8, *, spread=20.0, noise=1.0, dtype=torch.float32):
    """``num_classes`` Gaussian blobs (centres ``spread`` apart in scale, unit noise), shuffled,
    with non-contiguous label ids."""
    centers = spread * torch.randn(num_classes, dim, generator=gen, dtype=dtype)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=gen)]
    emb = centers[labels] + noise * torch.randn(len(labels), dim, generator=gen, dtype=dtype)
    return emb, 10 * labels - 7


def random_labelings(gen, count, max_n):
    """``count`` random pairs of labelings of random size and numbers of labels, some of them
    correlated, with label ids spread over non-contiguous (also negative) values."""
    pairs = []
    for _ in range(count):
        n = int(torch.randint(1, max_n + 1, (), generator=gen))
        ka = int(torch.randint(1, n + 1, (), generator=gen))
        kb = int(torch.randint(1, n + 1, (), generator=gen))
        a = torch.randint(0, ka, (n,), generator=gen)
        b = torch.randint(0, kb, (n,), generator=gen)
        if torch.rand((), generator=gen) < 0.5:  # copy part of a into b: informative pairs
            keep = torch.rand(n, generator=gen) < torch.rand((), generator=gen)
            b = torch.where(keep, a, b)
        pairs.append((a * 3 - 5, b * 7 + 11))
    return pairs


def sk_scores(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return normalized_mutual_info_score(a, b), adjusted_mutual_info_score(a, b)


def exact_ami(a, b):
    """The AMI in 32-digit arithmetic (mpmath): the exact value the float64 results round."""
    mpmath = pytest.importorskip("mpmath")
    a, b = np.asarray(a), np.asarray(b)
    n = len(a)
    classes, sizes_a = np.unique(a, return_counts=True)
    clusters, sizes_b = np.unique(b, return_counts=True)
    cells, counts = np.unique(np.stack([a, b]), axis=1, return_counts=True)
    size_a = dict(zip(classes.tolist(), sizes_a.tolist(), strict=True))
    size_b = dict(zip(clusters.tolist(), sizes_b.tolist(), strict=True))
    with mpmath.workdps(32):
        mp, log = mpmath.mpf, mpmath.log
        table = [mpmath.loggamma(k + 1) for k in range(n + 1)]
        log_fact = table.__getitem__
        mi = mp(0)
        for (x, y), c in zip(cells.T.tolist(), counts.tolist(), strict=True):
            mi += mp(c) / n * log(mp(n) * c / (size_a[x] * size_b[y]))
        emi = mp(0)
        for u in sizes_a.tolist():
            for v in sizes_b.tolist():
                for k in range(max(1, u + v - n), min(u, v) + 1):
                    gln = (
                        log_fact(u) + log_fact(v) + log_fact(n - u) + log_fact(n - v)
                        - log_fact(n) - log_fact(k) - log_fact(u - k) - log_fact(v - k)
                        - log_fact(n - u - v + k)
                    )  # fmt: skip
                    emi += mp(k) / n * log(mp(n) * k / (u * v)) * mpmath.exp(gln)

        def entropy(sizes):
            return -sum(mp(c) / n * log(mp(c) / n) for c in sizes.tolist())

        mean_h = (entropy(sizes_a) + entropy(sizes_b)) / 2
        return float((mi - emi) / (mean_h - emi))


def sk_kmeans(x, init, iterations):
    return KMeans(
        init.shape[0], init=init.numpy(), n_init=1, algorithm="lloyd", max_iter=iterations, tol=0
    ).fit(x.numpy())


# ----------------------------------------------------------------------------------------------
# NMI and AMI against scikit-learn
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_n", [5, 30, 99])
def test_nmi_and_ami_equal_sklearn_on_many_random_labelings(max_n):
    gen = torch.Generator().manual_seed(max_n)
    for a, b in random_labelings(gen, 40, max_n):
        nmi, ami = sk_scores(a, b)
        assert normalized_mutual_info(a, b).item() == pytest.approx(nmi, abs=1e-12, rel=0)
        assert adjusted_mutual_info(a, b).item() == pytest.approx(ami, abs=1e-12, rel=0)


def test_nmi_and_ami_equal_sklearn_on_large_batches_with_tens_of_classes():
    """The PML use: hundreds to thousands of samples, tens of classes, clusters that mostly
    agree with the classes."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        n = int(torch.randint(100, 2000, (), generator=gen))
        k = int(torch.randint(2, 60, (), generator=gen))
        a = torch.randint(0, k, (n,), generator=gen)
        noise = torch.randint(0, k, (n,), generator=gen)
        b = torch.where(torch.rand(n, generator=gen) < torch.rand((), generator=gen), noise, a)
        nmi, ami = sk_scores(a, b)
        assert normalized_mutual_info(a, b).item() == pytest.approx(nmi, abs=1e-12, rel=0)
        assert adjusted_mutual_info(a, b).item() == pytest.approx(ami, abs=1e-12, rel=0)


def test_ami_is_within_float64_rounding_of_the_exact_value_where_sklearn_is_too():
    """Hundreds of samples in hundreds of tiny clusters: ``E[MI]`` is then a sum of thousands
    of terms ``exp(gln)``, each ``gln`` a difference of ``ln k!`` values near ``N ln N``, whose
    float64 rounding (one ulp of ``ln N!`` is ~2e-13) sets a floor of ~1e-12 on any float64
    AMI. Both ours and scikit-learn's sit at that floor, on different sides: each is checked
    against the 32-digit value, and they agree with each other to 5e-12 (not 1e-12)."""
    gen = torch.Generator().manual_seed(2)
    for n, ka, kb in [(389, 341, 229), (250, 240, 90)]:
        a = torch.randint(0, ka, (n,), generator=gen)
        b = torch.randint(0, kb, (n,), generator=gen)
        exact = exact_ami(a, b)
        ours, sklearn = adjusted_mutual_info(a, b).item(), sk_scores(a, b)[1]
        assert ours == pytest.approx(exact, abs=1.5e-12, rel=0)
        assert sklearn == pytest.approx(exact, abs=3e-12, rel=0)
        assert ours == pytest.approx(sklearn, abs=5e-12, rel=0)


@pytest.mark.parametrize(
    "a, b",
    [
        pytest.param([0], [0], id="one-sample"),
        pytest.param([4, 4, 4, 4], [9, 9, 9, 9], id="one-class-one-cluster"),
        pytest.param([0, 0, 0, 0, 0], [0, 1, 2, 3, 4], id="one-class-all-distinct"),
        pytest.param([0, 1, 2, 3, 4], [1, 1, 1, 1, 1], id="all-distinct-one-cluster"),
        pytest.param([0, 0, 0, 1], [5, 5, 5, 5], id="two-classes-one-cluster"),
        pytest.param(list(range(7)), list(range(7)), id="all-distinct-both"),
        pytest.param(list(range(40)), list(range(39, -1, -1)), id="all-distinct-both-reversed"),
        pytest.param(list(range(12)), [i // 2 for i in range(12)], id="all-distinct-vs-pairs"),
        pytest.param([0, 0, 1, 1], [0, 1, 0, 1], id="independent"),
        pytest.param([0, 0, 1, 1, 2, 2], [5, 5, 3, 3, 1, 1], id="permuted-ids"),
        pytest.param([-3, -3, 100, 100, 7], [2, 2, 2, 50, 50], id="non-contiguous-ids"),
        pytest.param([True, True, False, False], [1, 0, 1, 0], id="bool"),
        pytest.param([1, 2], [3, 4], id="two-samples"),
    ],
)
def test_edge_cases_match_sklearn(a, b):
    ta, tb = torch.tensor(a), torch.tensor(b)
    nmi, ami = sk_scores(a, b)
    assert normalized_mutual_info(ta, tb).item() == pytest.approx(nmi, abs=1e-12, rel=0)
    assert adjusted_mutual_info(ta, tb).item() == pytest.approx(ami, abs=1e-12, rel=0)


def test_single_label_cases_are_exactly_sklearns_constants():
    one, many = torch.zeros(6, dtype=torch.int64), torch.arange(6)
    assert normalized_mutual_info(one, one).item() == 1.0
    assert adjusted_mutual_info(one, one).item() == 1.0
    assert normalized_mutual_info(one, many).item() == 0.0
    assert adjusted_mutual_info(many, one).item() == 0.0


def test_scores_are_float64_0d_whatever_the_label_dtype():
    for dtype in (torch.int8, torch.int32, torch.int64, torch.uint8):
        a, b = torch.tensor([0, 0, 1, 2], dtype=dtype), torch.tensor([1, 1, 0, 0], dtype=dtype)
        nmi, ami = normalized_mutual_info(a, b), adjusted_mutual_info(a, b)
        assert nmi.dtype == ami.dtype == torch.float64 and nmi.shape == ami.shape == ()
        assert (nmi.item(), ami.item()) == pytest.approx(sk_scores(a, b), abs=1e-12)


def test_scores_ignore_label_renaming_and_are_symmetric():
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, 9, (200,), generator=gen)
    b = torch.where(
        torch.rand(200, generator=gen) < 0.3, torch.randint(0, 6, (200,), generator=gen), a % 6
    )
    rename = torch.randperm(9, generator=gen) * 13 - 40
    for fn in (normalized_mutual_info, adjusted_mutual_info):
        base = fn(a, b).item()
        assert fn(rename[a], b).item() == pytest.approx(base, abs=1e-14)
        assert fn(b, a).item() == pytest.approx(base, abs=1e-14)


def test_ami_does_not_depend_on_its_chunk_size():
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(0, 30, (500,), generator=gen)
    b = torch.randint(0, 20, (500,), generator=gen)
    full = adjusted_mutual_info(a, b).item()
    for chunk_size in (1, 7, 1000):
        assert adjusted_mutual_info(a, b, chunk_size=chunk_size).item() == pytest.approx(
            full, abs=1e-14
        )


# ----------------------------------------------------------------------------------------------
# k-means
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("iterations", [1, 4, 100])
def test_kmeans_equals_sklearn_lloyd_from_the_same_initial_centroids(iterations):
    """Same init: the same assignments and centroids to float64 rounding after any number of
    iterations (100 lets scikit-learn stop early on strict convergence)."""
    gen = torch.Generator().manual_seed(iterations)
    x = torch.randn(600, 8, generator=gen, dtype=torch.float64) + 3.0
    init = x[torch.randperm(600, generator=gen)[:12]]
    ours = kmeans(x, 12, init=init, iterations=iterations)
    ref = sk_kmeans(x, init, iterations)
    assert torch.equal(ours.assignments, torch.from_numpy(ref.labels_).long())
    torch.testing.assert_close(
        ours.centroids, torch.from_numpy(ref.cluster_centers_), rtol=0, atol=1e-12
    )
    assert ours.inertia.item() == pytest.approx(ref.inertia_, rel=1e-12)


def test_kmeans_equals_sklearn_lloyd_in_float32():
    gen = torch.Generator().manual_seed(5)
    x, _ = blobs(gen, 6, 40, spread=3.0)
    init = x[:6]
    ours = kmeans(x, 6, init=init, iterations=10)
    ref = sk_kmeans(x, init, 10)
    assert torch.equal(ours.assignments, torch.from_numpy(ref.labels_).long())
    torch.testing.assert_close(ours.centroids, torch.from_numpy(ref.cluster_centers_))


def test_kmeans_under_autocast_is_the_float32_clustering():
    """The distance products in float32 also inside ``torch.autocast`` (in bfloat16, a seeded
    k-means++ run sent half of 2,000 rows to other clusters)."""
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0))
    want = kmeans(x, 20, generator=torch.tensor(7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = kmeans(x, 20, generator=torch.tensor(7))
    assert torch.equal(got.assignments, want.assignments)
    assert torch.equal(got.centroids, want.centroids)


@pytest.mark.parametrize("far", [[2], [2, 4]], ids=["one-empty", "two-empty"])
def test_kmeans_reseeds_empty_clusters_at_the_farthest_rows_as_sklearn(far):
    """Initial centroids far from every row leave their clusters empty; each is re-seeded at
    the row farthest from its centroid, as scikit-learn does, and nothing becomes NaN."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(300, 4, generator=gen, dtype=torch.float64)
    init = x[:5].clone()
    init[far] = 100.0
    ours = kmeans(x, 5, init=init, iterations=10)
    ref = sk_kmeans(x, init, 10)
    assert torch.equal(ours.assignments, torch.from_numpy(ref.labels_).long())
    torch.testing.assert_close(
        ours.centroids, torch.from_numpy(ref.cluster_centers_), rtol=0, atol=1e-12
    )
    assert ours.assignments.bincount(minlength=5).min() > 0


def test_kmeans_has_no_nan_with_more_clusters_than_distinct_rows():
    x = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    out = kmeans(x, 4, generator=torch.Generator().manual_seed(0))
    assert out.centroids.isfinite().all()
    assert out.inertia.item() == 0.0
    assert out.assignments[0] == out.assignments[1] != out.assignments[2]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kmeans_recovers_well_separated_blobs_exactly(seed):
    gen = torch.Generator().manual_seed(seed)
    x, labels = blobs(gen, 8, 25)
    out = kmeans(x, 8, generator=torch.Generator().manual_seed(seed))
    assert normalized_mutual_info(labels, out.assignments).item() == 1.0
    assert adjusted_mutual_info(labels, out.assignments).item() == 1.0


def test_kmeans_is_deterministic_for_a_seed_and_differs_for_another_seed():
    """On an ambiguous case (uniform noise, no cluster structure) the seeding decides the
    result: the same seed (a generator or a seed tensor) gives the same clustering, another
    seed another one; the default (no generator) is a fixed seed."""
    x = torch.rand(200, 2, generator=torch.Generator().manual_seed(7))
    first = kmeans(x, 6, generator=torch.Generator().manual_seed(0))
    again = kmeans(x, 6, generator=torch.Generator().manual_seed(0))
    other = kmeans(x, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first.assignments, again.assignments)
    assert torch.equal(first.centroids, again.centroids)
    assert not torch.equal(first.assignments, other.assignments)
    assert torch.equal(
        kmeans(x, 6, generator=torch.tensor(5)).centroids,
        kmeans(x, 6, generator=torch.tensor(5)).centroids,
    )
    assert torch.equal(kmeans(x, 6).centroids, kmeans(x, 6).centroids)


def test_kmeans_objective_is_no_worse_than_sklearns_kmeans_plusplus():
    """Moderate overlapping mixture: the mean inertia over three seeds is within 2% of
    scikit-learn's ``KMeans`` (k-means++ too, one init each, run to convergence)."""
    gen = torch.Generator().manual_seed(8)
    x, _ = blobs(gen, 10, 100, dim=8, spread=2.0)
    ours = [kmeans(x, 10, generator=torch.Generator().manual_seed(s)).inertia for s in range(3)]
    ref = [KMeans(10, n_init=1, random_state=s).fit(x.numpy()).inertia_ for s in range(3)]
    assert float(np.mean([o.item() for o in ours])) <= 1.02 * float(np.mean(ref))


def test_kmeans_inertia_is_the_sum_of_squared_distances_to_the_assigned_centroids():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(100, 5, generator=gen, dtype=torch.float64)
    out = kmeans(x, 4, generator=gen)
    expected = (x - out.centroids[out.assignments]).pow(2).sum()
    assert isinstance(out, KMeansResult)
    assert out.inertia.item() == pytest.approx(expected.item(), rel=1e-12)
    nearest = torch.cdist(x, out.centroids).argmin(1)
    assert torch.equal(out.assignments, nearest)


def test_chunked_assignment_equals_unchunked():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(103, 6, generator=gen, dtype=torch.float64)
    centroids = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    brute = torch.cdist(x, centroids).argmin(1)
    for chunk_size in (1, 7, 64, 103, 500):
        assert torch.equal(_assign(x, centroids, chunk_size), brute)


def test_kmeans_does_not_depend_on_chunk_size():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(150, 4, generator=gen, dtype=torch.float64)
    full = kmeans(x, 7, generator=torch.tensor(3))
    for chunk_size in (1, 16, 149):
        part = kmeans(x, 7, generator=torch.tensor(3), chunk_size=chunk_size)
        assert torch.equal(part.assignments, full.assignments)
        torch.testing.assert_close(part.centroids, full.centroids, rtol=0, atol=1e-12)


def test_kmeans_clusters_low_precision_in_float32():
    gen = torch.Generator().manual_seed(12)
    x, labels = blobs(gen, 4, 20)
    for dtype in (torch.float16, torch.bfloat16):
        out = kmeans(x.to(dtype), 4, generator=torch.tensor(0))
        assert out.centroids.dtype == torch.float32
        assert normalized_mutual_info(labels, out.assignments).item() == 1.0


def test_kmeans_and_nmi_run_on_the_meta_device():
    """Static shapes: nothing reads a value (the cheap test of DESIGN.md's rule 2)."""
    x = torch.empty(50, 3, device="meta")
    out = kmeans(x, 4, iterations=3, chunk_size=16)
    assert out.assignments.shape == (50,) and out.assignments.dtype == torch.int64
    assert out.centroids.shape == (4, 3) and out.inertia.shape == ()
    labels = torch.empty(50, dtype=torch.int64, device="meta")
    assert normalized_mutual_info(labels, out.assignments).shape == ()


def test_kmeans_with_k_equal_n_puts_every_row_in_its_own_cluster():
    x = torch.randn(9, 3, generator=torch.Generator().manual_seed(13))
    out = kmeans(x, 9)
    assert torch.equal(out.assignments.sort().values, torch.arange(9))
    assert out.inertia.item() == pytest.approx(0.0, abs=1e-10)


# ----------------------------------------------------------------------------------------------
# clustering_scores
# ----------------------------------------------------------------------------------------------
def test_clustering_scores_equal_sklearn_on_the_same_assignments():
    gen = torch.Generator().manual_seed(14)
    x, labels = blobs(gen, 7, 30, spread=1.5)  # overlapping: imperfect clusters
    scores = clustering_scores(x, labels, generator=torch.Generator().manual_seed(0))
    assert set(scores) == {"NMI", "AMI"}
    clusters = kmeans(x, 7, generator=torch.Generator().manual_seed(0)).assignments
    nmi, ami = sk_scores(labels, clusters)
    assert 0.2 < nmi < 0.99
    assert scores["NMI"].dtype == torch.float64 and scores["NMI"].shape == ()
    assert scores["NMI"].item() == pytest.approx(nmi, abs=1e-12)
    assert scores["AMI"].item() == pytest.approx(ami, abs=1e-12)


def test_clustering_scores_num_clusters_defaults_to_the_number_of_distinct_labels():
    gen = torch.Generator().manual_seed(15)
    x, labels = blobs(gen, 5, 20, spread=1.0)
    default = clustering_scores(x, labels)
    assert default == clustering_scores(x, labels, num_clusters=5)
    assert default != clustering_scores(x, labels, num_clusters=2)


def test_clustering_scores_equal_pml_accuracy_calculator_given_our_kmeans():
    """PML 2.9.0's ``AccuracyCalculator`` (``"NMI"``, ``"AMI"``) with our k-means as its
    ``kmeans_func``: the same numbers, so the number of clusters, the data clustered (the
    queries) and the scoring are PML's."""
    gen = torch.Generator().manual_seed(16)
    x, labels = blobs(gen, 6, 25, spread=1.5)

    def our_kmeans(query, num_clusters):
        return kmeans(query, num_clusters, generator=torch.tensor(1)).assignments

    calc = AccuracyCalculator(
        include=("NMI", "AMI"),
        kmeans_func=our_kmeans,
        knn_func=CustomKNN(None),
        device=torch.device("cpu"),
    )
    pml = calc.get_accuracy(x, labels)
    ours = clustering_scores(x, labels, generator=torch.tensor(1))
    assert ours["NMI"].item() == pytest.approx(pml["NMI"], abs=1e-12)
    assert ours["AMI"].item() == pytest.approx(pml["AMI"], abs=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_embeddings_make_the_scores_and_centroids_nan(bad):
    gen = torch.Generator().manual_seed(17)
    x, labels = blobs(gen, 3, 10)
    x[4, 2] = bad
    scores = clustering_scores(x, labels)
    assert math.isnan(scores["NMI"].item()) and math.isnan(scores["AMI"].item())
    out = kmeans(x, 3)
    assert out.centroids.isnan().all() and out.inertia.isnan()
    assert ((out.assignments >= 0) & (out.assignments < 3)).all()
    init = x[:3].clone()
    x[4, 2] = 0.0
    init[1, 0] = bad
    assert kmeans(x, 3, init=init).centroids.isnan().all()


# ----------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------
EMB = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
LAB = torch.tensor([0, 0, 1, 1, 2, 2])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: kmeans(EMB.numpy(), 2), TypeError, "embeddings must be a torch.Tensor"),
        (lambda: kmeans(LAB.view(6, 1), 2), TypeError, "embeddings must be a floating-point"),
        (lambda: kmeans(EMB[0], 2), ValueError, "embeddings must be 2-D"),
        (lambda: kmeans(EMB[:0], 1), ValueError, "embeddings is an empty batch"),
        (lambda: kmeans(EMB, 0), ValueError, "num_clusters must be an int >= 1"),
        (lambda: kmeans(EMB, 7), ValueError, "num_clusters=7 exceeds the 6 rows"),
        (lambda: kmeans(EMB, 2.0), TypeError, "num_clusters must be an int"),
        (lambda: kmeans(EMB, True), TypeError, "num_clusters must be an int"),
        (lambda: kmeans(EMB, 2, iterations=-1), ValueError, "iterations must be an int >= 0"),
        (lambda: kmeans(EMB, 2, chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (lambda: kmeans(EMB, 2, local_trials=0), ValueError, "local_trials must be an int"),
        (lambda: kmeans(EMB, 2, generator=3), TypeError, "generator must be a torch.Generator"),
        (lambda: kmeans(EMB, 2, init=EMB[:3]), ValueError, "init must have shape"),
        (lambda: kmeans(EMB, 2, init=LAB[:2]), TypeError, "init must be a floating-point"),
        (lambda: normalized_mutual_info([0, 1], LAB[:2]), TypeError, "labels_true must be a"),
        (lambda: normalized_mutual_info(LAB.float(), LAB), TypeError, "labels_true must have"),
        (
            lambda: normalized_mutual_info(LAB.view(2, 3), LAB),
            ValueError,
            "labels_true must be 1-D",
        ),
        (lambda: normalized_mutual_info(LAB[:0], LAB[:0]), ValueError, "labels_true is empty"),
        (lambda: adjusted_mutual_info(LAB, LAB.float()), TypeError, "labels_pred must have"),
        (lambda: adjusted_mutual_info(LAB, LAB[:5]), ValueError, "labels_pred has length 5"),
        (lambda: adjusted_mutual_info(LAB, LAB, chunk_size=0), ValueError, "chunk_size must"),
        (lambda: clustering_scores(EMB, LAB[:5]), ValueError, "labels has length 5"),
        (lambda: clustering_scores(EMB, LAB.float()), TypeError, "labels must have an integer"),
        (lambda: clustering_scores(EMB, LAB, num_clusters=0), ValueError, "num_clusters must"),
        (lambda: clustering_scores(EMB, LAB, num_clusters=9), ValueError, "num_clusters=9"),
        (lambda: clustering_scores(EMB.double()[0], LAB), ValueError, "embeddings must be 2-D"),
    ],
)
def test_bad_inputs_raise_errors_naming_the_argument(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()
