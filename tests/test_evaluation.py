"""Tests for pmlfunc.evaluation: knn, retrieval_metrics and pml_per_query.

Proof by three independent routes: PML 2.9.0's ``AccuracyCalculator`` (with its torch
``CustomKNN``, since faiss is not installed), a naive float64 loop reference (argsort of the full
distance matrix, then per-query Python loops for every metric), and invariances (chunk size,
tie-breaking, self exclusion by index).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN

import pmlfunc as pf
import pmlfunc.distances as pfd
from pmlfunc.evaluation import knn, neighbor_relevance, pml_per_query, retrieval_metrics

PML_METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


# ----------------------------------------------------------------------------------------------
# data and references
# ----------------------------------------------------------------------------------------------
def clustered(gen, sizes, dim=16, *, classes=None, noise=0.8, centers=None):
    """Embeddings around one random centre per class; ``sizes[c]`` rows of class ``classes[c]``."""
    classes = list(range(len(sizes))) if classes is None else classes
    if centers is None:
        centers = torch.randn(max(classes) + 1, dim, generator=gen)
    labels = torch.cat([torch.full((n,), c) for c, n in zip(classes, sizes, strict=True)])
    labels = labels[torch.randperm(len(labels), generator=gen)]
    emb = centers[labels] + noise * torch.randn(len(labels), dim, generator=gen)
    return emb, labels, centers


@pytest.fixture
def same_set(gen):
    # Uneven classes, two singletons (lone queries in same-set mode).
    emb, labels, _ = clustered(gen, [1, 1, 2, 3, 5, 8, 13, 20, 30, 40])
    return emb, labels


@pytest.fixture
def separate_sets(gen):
    # Query classes 0..7; reference classes 2..11: classes 0, 1 are lone (absent from reference).
    centers = torch.randn(12, 16, generator=gen)
    q, ql, _ = clustered(gen, [3, 4, 5, 6, 10, 12, 20, 25], classes=list(range(8)), centers=centers)
    r, rl, _ = clustered(
        gen, [1, 2, 4, 9, 15, 30, 7, 3, 5, 40], classes=list(range(2, 12)), centers=centers
    )
    return q, ql, r, rl


def float64_matrix(q, r, distance):
    q, r = q.double(), r.double()
    if distance == "cosine":
        return F.normalize(q, dim=1) @ F.normalize(r, dim=1).T
    return torch.cdist(F.normalize(q, dim=1), F.normalize(r, dim=1))


def loop_knn(q, r, k, distance, exclude_self):
    """Stable argsort of the full float64 matrix, own row dropped: nearest first, ties by index."""
    mat = float64_matrix(q, r, distance)
    key = -mat if distance == "cosine" else mat
    out_idx, out_val = [], []
    for i in range(q.shape[0]):
        order = torch.sort(key[i], stable=True).indices.tolist()
        if exclude_self:
            order = [j for j in order if j != i]
        out_idx.append(order[:k])
        out_val.append([mat[i, j].item() for j in order[:k]])
    return torch.tensor(out_idx), torch.tensor(out_val, dtype=torch.float64)


def loop_metrics(q, ql, r, rl, k, distance, exclude_self, recall_ks=()):
    """Per-query Python loops over the float64 neighbour lists; lone queries (R = 0) skipped."""
    idx, _ = loop_knn(q, r, k, distance, exclude_self)
    sums = dict.fromkeys([*PML_METRICS, *(f"recall_at_{kk}" for kk in recall_ks)], 0.0)
    n = 0
    for i in range(q.shape[0]):
        label = ql[i].item()
        big_r = sum(
            1 for j in range(r.shape[0]) if rl[j].item() == label and not (exclude_self and j == i)
        )
        if big_r == 0:
            continue
        n += 1
        rel = [rl[j].item() == label for j in idx[i].tolist()]
        sums["precision_at_1"] += float(rel[0])
        top = min(big_r, k)
        sums["r_precision"] += sum(rel[:top]) / top
        hits, ap = 0, 0.0
        for j in range(top):
            if rel[j]:
                hits += 1
                ap += hits / (j + 1)
        sums["mean_average_precision_at_r"] += ap / big_r
        for kk in recall_ks:
            sums[f"recall_at_{kk}"] += float(any(rel[:kk]))
    return {name: (s / n if n else math.nan) for name, s in sums.items()}


def pml_metrics(q, ql, r=None, rl=None, *, k="max_bin_count", distance="cosine", **kw):
    pml_dist = (
        pml_distances.CosineSimilarity() if distance == "cosine" else pml_distances.LpDistance()
    )
    calc = AccuracyCalculator(
        include=PML_METRICS, k=k, knn_func=CustomKNN(pml_dist), device=torch.device("cpu")
    )
    return calc.get_accuracy(q, ql, r, rl, **kw)


def pf_distance(name):
    return pfd.cosine() if name == "cosine" else pfd.lp()


def assert_metrics(ours, expected, rtol=1e-6):
    for name, value in expected.items():
        got = ours[name].item()
        if math.isnan(value):
            assert math.isnan(got), name
        else:
            assert got == pytest.approx(value, rel=rtol, abs=1e-12), name


# ----------------------------------------------------------------------------------------------
# PML parity
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distance", ["cosine", "lp"])
@pytest.mark.parametrize("k", [None, 3])
def test_pml_parity_same_set(same_set, distance, k):
    emb, labels = same_set
    expected = pml_metrics(emb, labels, k="max_bin_count" if k is None else k, distance=distance)
    ours = retrieval_metrics(emb, labels, k=k, distance=pf_distance(distance))
    assert_metrics(ours, expected)


def test_pml_default_k_all_references_agrees(same_set):
    # PML's default k=None retrieves every reference; MAP@R and R-precision only look at R_i.
    emb, labels = same_set
    assert_metrics(retrieval_metrics(emb, labels), pml_metrics(emb, labels, k=None))


@pytest.mark.parametrize("distance", ["cosine", "lp"])
@pytest.mark.parametrize("k", [None, 4])
def test_pml_parity_separate_sets(separate_sets, distance, k):
    q, ql, r, rl = separate_sets
    expected = pml_metrics(q, ql, r, rl, k="max_bin_count" if k is None else k, distance=distance)
    ours = retrieval_metrics(q, ql, r, rl, k=k, distance=pf_distance(distance))
    assert_metrics(ours, expected)


def test_pml_parity_ref_includes_query(separate_sets):
    # PML's ref_includes_query=True: the reference starts with the queries.
    q, ql, r, rl = separate_sets
    ref, ref_labels = torch.cat([q, r]), torch.cat([ql, rl])
    expected = pml_metrics(q, ql, ref, ref_labels, ref_includes_query=True)
    ours = retrieval_metrics(q, ql, ref, ref_labels, exclude_self=True)
    assert_metrics(ours, expected)


def test_all_lone_queries_give_nan_like_pml(gen):
    emb, labels = torch.randn(6, 4, generator=gen), torch.arange(6)
    expected = pml_metrics(emb, labels)
    assert all(math.isnan(v) for v in expected.values())
    ours = retrieval_metrics(emb, labels, recall_ks=(1, 3))
    assert all(torch.isnan(v) for v in ours.values())


# ----------------------------------------------------------------------------------------------
# float64 loop reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distance", ["cosine", "lp"])
def test_knn_matches_full_argsort(same_set, separate_sets, distance):
    emb, _ = same_set
    idx, val = knn(emb, k=10, distance=pf_distance(distance), chunk_size=32)
    ref_idx, ref_val = loop_knn(emb, emb, 10, distance, exclude_self=True)
    assert idx.dtype == torch.int64 and idx.shape == (emb.shape[0], 10)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(val.double(), ref_val, rtol=0, atol=1e-6)

    q, _, r, _ = separate_sets
    idx, val = knn(q, r, k=7, distance=pf_distance(distance), chunk_size=16)
    ref_idx, ref_val = loop_knn(q, r, 7, distance, exclude_self=False)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(val.double(), ref_val, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", [None, 2, 25])
def test_metrics_match_loop_same_set(same_set, k):
    emb, labels = same_set
    ks = (1, 2, 5, 10) if k != 2 else (1, 2)
    ours = retrieval_metrics(emb, labels, k=k, recall_ks=ks, chunk_size=37)
    used_k = int(k or max(39, max(ks)))  # max class size 40, own row excluded
    assert_metrics(ours, loop_metrics(emb, labels, emb, labels, used_k, "cosine", True, ks))


@pytest.mark.parametrize("k", [None, 3])
def test_metrics_match_loop_separate_sets(separate_sets, k):
    q, ql, r, rl = separate_sets
    ks = (1, 3)
    ours = retrieval_metrics(q, ql, r, rl, k=k, recall_ks=ks, distance=pfd.lp())
    r_max = max(int((rl == c).sum()) for c in ql.tolist())
    used_k = k or r_max
    assert_metrics(ours, loop_metrics(q, ql, r, rl, used_k, "lp", False, ks))


def test_recall_at_1_equals_precision_at_1(separate_sets):
    q, ql, r, rl = separate_sets
    m = retrieval_metrics(q, ql, r, rl, recall_ks=(1, 5))
    assert torch.equal(m["recall_at_1"], m["precision_at_1"])
    assert m["recall_at_5"] >= m["recall_at_1"]
    assert set(m) == {*PML_METRICS, "recall_at_1", "recall_at_5"}
    assert all(v.dtype == torch.float64 and v.ndim == 0 for v in m.values())


# ----------------------------------------------------------------------------------------------
# invariances: chunking, ties, self exclusion, static shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [1, 7, 50, 124, 4096])
def test_chunk_size_does_not_change_results(same_set, separate_sets, chunk_size):
    emb, labels = same_set  # 123 queries: none of these chunk sizes but 1 divides it
    base_idx, base_val = knn(emb, k=9, chunk_size=emb.shape[0])
    idx, val = knn(emb, k=9, chunk_size=chunk_size)
    # Same neighbours; values equal to float32 rounding (BLAS blocking depends on the block shape).
    assert torch.equal(idx, base_idx)
    torch.testing.assert_close(val, base_val, rtol=0, atol=1e-6)
    base = retrieval_metrics(emb, labels, recall_ks=(1, 4), chunk_size=emb.shape[0])
    got = retrieval_metrics(emb, labels, recall_ks=(1, 4), chunk_size=chunk_size)
    assert all(torch.equal(got[n], base[n]) for n in base)
    q, ql, r, rl = separate_sets
    base = retrieval_metrics(q, ql, r, rl, distance=pfd.lp(), chunk_size=q.shape[0])
    got = retrieval_metrics(q, ql, r, rl, distance=pfd.lp(), chunk_size=chunk_size)
    assert all(torch.equal(got[n], base[n]) for n in base)


@pytest.mark.parametrize("distance", [pfd.dot(), pfd.lp(normalize=False)])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_ties_broken_by_reference_index(distance, chunk_size):
    # Small-integer rows: every tied distance is bit-exact. 4 distinct rows, each repeated.
    base = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0], [2.0, 2.0]])
    ref = base[torch.tensor([3, 0, 2, 1, 0, 3, 2, 2, 1, 0, 3, 1])]
    query = base[torch.tensor([0, 1, 2, 3, 2])]
    idx, val = knn(query, ref, k=8, distance=distance, chunk_size=chunk_size)
    mat = distance(query, ref).double()
    key = -mat if distance.is_similarity else mat
    expected = torch.sort(key, dim=1, stable=True).indices[:, :8]
    assert torch.equal(idx, expected)
    assert torch.equal(val, distance(query, ref).gather(1, idx))


@pytest.mark.parametrize("seed", range(20))
def test_random_ties_match_stable_argsort(seed):
    # Entries in {-1, 0, 1}: many exact ties, also across the k-th place; with and without self.
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (9, 3), generator=g).float()
    r = torch.randint(-1, 2, (30, 3), generator=g).float()
    for distance in (pfd.dot(), pfd.lp(normalize=False)):
        for exclude, ref in ((False, r), (True, torch.cat([q, r]))):
            k = int(torch.randint(1, ref.shape[0] - 1, (1,), generator=g))
            idx, _ = knn(q, ref, k=k, distance=distance, exclude_self=exclude, chunk_size=4)
            mat = distance(q, ref).double()
            key = -mat if distance.is_similarity else mat
            expected = [
                [
                    j
                    for j in torch.sort(key[i], stable=True).indices.tolist()
                    if not (exclude and j == i)
                ][:k]
                for i in range(q.shape[0])
            ]
            assert idx.tolist() == expected, (distance, exclude, k)


def test_self_excluded_by_index_not_value():
    # Rows 0 and 1 are identical: each is the other's nearest neighbour; no row returns itself.
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    idx, _ = knn(x, k=3, chunk_size=2)
    assert idx[0, 0] == 1 and idx[1, 0] == 0
    assert not (idx == torch.arange(4).unsqueeze(1)).any()
    # All-equal rows: every query gets every other row, in index order.
    idx, _ = knn(torch.ones(5, 3), k=4)
    expected = torch.tensor([[j for j in range(5) if j != i] for i in range(5)])
    assert torch.equal(idx, expected)


def test_exclude_self_with_reference_and_k_limits(separate_sets):
    q, _, r, _ = separate_sets
    ref = torch.cat([q, r])
    idx, _ = knn(q, ref, k=ref.shape[0] - 1, exclude_self=True)
    assert not (idx == torch.arange(q.shape[0]).unsqueeze(1)).any()
    idx, _ = knn(q, ref, k=ref.shape[0])  # exclude_self defaults to False with a reference
    assert torch.equal(idx.sort(1).values, torch.arange(ref.shape[0]).expand(q.shape[0], -1))


def test_nan_ranks_farthest():
    ref = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [0.0, 1.0]])
    idx, _ = knn(torch.tensor([[1.0, 0.1]]), ref, k=3, distance=pfd.lp())
    assert idx.tolist() == [[0, 2, 1]]


def test_meta_device_with_given_k_has_no_host_sync(same_set):
    emb, labels = same_set
    m = retrieval_metrics(emb.to("meta"), labels.to("meta"), k=5, recall_ks=(1, 5))
    assert all(v.device.type == "meta" and v.shape == () for v in m.values())
    idx, val = knn(emb.to("meta"), k=5, chunk_size=50)
    assert idx.shape == (emb.shape[0], 5) and val.shape == (emb.shape[0], 5)


def test_low_precision_input(same_set):
    emb, labels = same_set
    m = retrieval_metrics(emb.bfloat16(), labels, recall_ks=(1,))
    assert all(torch.isfinite(v) for v in m.values())
    _, val = knn(emb.half(), k=3)
    assert val.dtype == torch.float32


def test_no_grad_and_inputs_unchanged(same_set):
    emb, labels = same_set
    emb = emb.clone().requires_grad_(True)
    before = emb.detach().clone()
    _, val = knn(emb, k=3)
    m = retrieval_metrics(emb, labels)
    assert not val.requires_grad and not any(v.requires_grad for v in m.values())
    assert torch.equal(emb.detach(), before)


# ----------------------------------------------------------------------------------------------
# non-finite embeddings: NaN for every query they could rank, never a finite number
# ----------------------------------------------------------------------------------------------
NON_FINITE = [math.nan, math.inf, -math.inf]
KNN_DISTANCES = {"cosine": None, "lp": pfd.lp(), "dot": pfd.dot()}


def with_bad_entry(x, row, value):
    x = x.clone()
    x[row, 1] = value
    return x


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("distance", sorted(KNN_DISTANCES))
def test_knn_gives_a_non_finite_query_row_nan_values_and_leaves_the_other_rows_exact(
    separate_sets, bad, distance
):
    q, _, r, _ = separate_sets
    d = KNN_DISTANCES[distance]
    clean_idx, clean_val = knn(q, r, k=5, distance=d, chunk_size=7)
    assert clean_val.isfinite().all()
    idx, val = knn(with_bad_entry(q, 3, bad), r, k=5, distance=d, chunk_size=7)
    assert val[3].isnan().all()
    others = torch.arange(q.shape[0]) != 3
    assert torch.equal(idx[others], clean_idx[others])
    assert torch.equal(val[others], clean_val[others])


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("distance", sorted(KNN_DISTANCES))
def test_knn_gives_every_query_nan_values_when_a_reference_row_is_non_finite(
    separate_sets, same_set, bad, distance
):
    q, _, r, _ = separate_sets
    d = KNN_DISTANCES[distance]
    idx, val = knn(q, with_bad_entry(r, 5, bad), k=5, distance=d)
    assert idx.shape == (q.shape[0], 5) and val.isnan().all()
    emb, _ = same_set  # same set: a row is a query and every other query's reference
    _, val = knn(with_bad_entry(emb, 0, bad), k=3, distance=d)
    assert val.isnan().all()


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("where", ["query", "lone query", "reference", "same set"])
def test_retrieval_metrics_are_nan_when_an_embedding_is_non_finite(
    separate_sets, same_set, bad, where
):
    q, ql, r, rl = separate_sets
    lone = int(torch.nonzero(ql < 2)[0])  # classes 0 and 1 have no reference row
    if where == "same set":
        emb, labels = same_set
        args, broken = (emb, labels), (with_bad_entry(emb, 7, bad), labels)
    else:
        args = (q, ql, r, rl)
        if where == "reference":
            broken = (q, ql, with_bad_entry(r, 4, bad), rl)
        else:
            broken = (with_bad_entry(q, lone if where == "lone query" else 5, bad), ql, r, rl)
    for k in (None, 6):  # k=None reads the label counts; a given k is static
        clean = retrieval_metrics(*args, k=k, recall_ks=(1, 3))
        assert all(torch.isfinite(v) for v in clean.values())
        got = retrieval_metrics(*broken, k=k, recall_ks=(1, 3))
        assert list(got) == list(clean)
        assert all(torch.isnan(v) for v in got.values()), got


def test_retrieval_metrics_of_finite_embeddings_are_unchanged_by_the_nan_rule(separate_sets):
    # The queries other than a non-finite one: the same metrics as PML's (and the loop's) on
    # exactly those queries; the NaN rule only adds NaN, it never moves a finite value.
    q, ql, r, rl = separate_sets
    keep = torch.arange(q.shape[0]) != 5
    ours = retrieval_metrics(q[keep], ql[keep], r, rl, k=6, recall_ks=(1, 3))
    assert_metrics(ours, loop_metrics(q[keep], ql[keep], r, rl, 6, "cosine", False, (1, 3)))
    assert_metrics(ours, pml_metrics(q[keep], ql[keep], r, rl, k=6))


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
X = torch.randn(6, 4)
Y = torch.tensor([0, 0, 1, 1, 2, 2])
R = torch.randn(5, 4)
RY = torch.tensor([0, 1, 1, 2, 2])


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [
        (lambda: knn(X[0], k=1), ValueError, "query"),
        (lambda: knn(X.long(), k=1), TypeError, "query"),
        (lambda: knn(X, torch.randn(5, 3), k=1), ValueError, "reference"),
        (lambda: knn(X, R.double(), k=1), TypeError, "reference"),
        (lambda: knn(X, k=0), ValueError, "k"),
        (lambda: knn(X, k=-2), ValueError, "k"),
        (lambda: knn(X, k=1.5), TypeError, "k"),
        (lambda: knn(X, k=6), ValueError, "k=6"),
        (lambda: knn(X, R, k=6), ValueError, "k=6"),
        (lambda: knn(X, k=1, chunk_size=0), ValueError, "chunk_size"),
        (lambda: knn(X, k=1, distance="cosine"), TypeError, "distance"),
        (lambda: knn(X, R, k=1, exclude_self=True), ValueError, "exclude_self"),
        (lambda: knn(X, k=1, exclude_self=False), ValueError, "exclude_self"),
        (lambda: retrieval_metrics(X, Y[:5]), ValueError, "query_labels"),
        (lambda: retrieval_metrics(X, Y.float()), TypeError, "query_labels"),
        (lambda: retrieval_metrics(X, Y, R), ValueError, "reference_labels"),
        (lambda: retrieval_metrics(X, Y, R, RY[:4]), ValueError, "reference_labels"),
        (lambda: retrieval_metrics(X, Y, reference_labels=RY), ValueError, "reference_labels"),
        (lambda: retrieval_metrics(X, Y, k=0), ValueError, "k"),
        (lambda: retrieval_metrics(X, Y, k=6), ValueError, "k=6"),
        (lambda: retrieval_metrics(X, Y, recall_ks=(0,)), ValueError, "recall_ks"),
        (lambda: retrieval_metrics(X, Y, k=2, recall_ks=(1, 3)), ValueError, "recall_ks"),
        (lambda: retrieval_metrics(X, Y, recall_ks=1), TypeError, "recall_ks"),
        (lambda: retrieval_metrics(X[:1], Y[:1]), ValueError, "reference"),
    ],
)
def test_errors_name_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


# ----------------------------------------------------------------------------------------------
# pml_per_query: PML's metrics per query, from the relevance of given neighbours
# ----------------------------------------------------------------------------------------------
PER_QUERY_KEYS = (
    "precision_at_1",
    "r_precision",
    "mean_average_precision_at_r",
    "mean_average_precision",
    "mean_reciprocal_rank",
)


def loop_per_query(retrieved, num_relevant, k):
    """PML 2.9.0's per-query definitions, one query at a time in Python float64: ``R = n_i``
    relevant items in all, ``rel`` the first ``k`` neighbours' relevance (grade > 0)."""
    out = {name: [] for name in PER_QUERY_KEYS}
    for row, big_r in zip(retrieved.tolist(), num_relevant.tolist(), strict=True):
        rel = [float(g > 0) for g in row[:k]]
        top = min(big_r, k)  # PML's relevance mask: the first min(R, k) neighbours
        hits, ap, ap_at_r, rr = 0, 0.0, 0.0, 0.0
        for j, r in enumerate(rel, start=1):
            if r:
                hits += 1
                ap += hits / j
                ap_at_r += hits / j if j <= top else 0.0
                rr = max(rr, 1.0 / j)
        out["precision_at_1"].append(rel[0])
        out["r_precision"].append(sum(rel[:top]) / top if top else math.nan)
        out["mean_average_precision_at_r"].append(ap_at_r / big_r if big_r else math.nan)
        out["mean_average_precision"].append(ap / big_r if big_r else math.nan)
        out["mean_reciprocal_rank"].append(rr)
    return {name: torch.tensor(v, dtype=torch.float64) for name, v in out.items()}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [None, 1, 4])
def test_pml_per_query_matches_a_float64_loop(seed, k):
    """Random grades (int, some 0) with ``n_i`` from 0 (NaN where PML divides by it) to more
    than the 7 retrieved (truncated R-precision and MAP@R), at most ``n_i`` relevant retrieved."""
    g = torch.Generator().manual_seed(seed)
    width = 7
    n_rel = torch.randint(0, 12, (40,), generator=g)
    grades = torch.randint(1, 4, (40, width), generator=g) * (
        torch.rand(40, width, generator=g) < 0.5
    )
    grades = torch.where((grades > 0).cumsum(1) <= n_rel.unsqueeze(1), grades, 0)
    got = pml_per_query(grades, n_rel, k=k)
    assert list(got) == list(PER_QUERY_KEYS)
    expected = loop_per_query(grades, n_rel, width if k is None else k)
    for name in PER_QUERY_KEYS:
        assert got[name].dtype == torch.float64 and got[name].shape == (40,)
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=0, equal_nan=True)
    assert got["r_precision"][n_rel == 0].isnan().all()  # the test data has such queries
    # relevance as bool or float grades: the same values
    for other in (grades > 0, grades.double() / 3):
        again = pml_per_query(other, n_rel.double(), k=k)
        assert all(torch.equal(again[n].nan_to_num(-1), got[n].nan_to_num(-1)) for n in got)


@pytest.mark.parametrize("distance", ["cosine", "lp"])
def test_pml_per_query_averaged_per_class_is_pmls_avg_of_avgs(same_set, distance):
    """Averaged over the non-lone queries, or per class first, the per-query values of the
    neighbours of :func:`knn` are PML's ``AccuracyCalculator`` means (lone queries included in
    the data)."""
    emb, labels = same_set
    idx, _ = knn(emb, k=emb.shape[0] - 1, distance=pf_distance(distance))
    rel = neighbor_relevance(idx, query_labels=labels)
    per_query = pml_per_query(rel.retrieved, rel.num_relevant)
    counted = rel.num_relevant > 0
    assert not counted.all()  # the fixture has lone queries
    classes = labels[counted].unique()
    pml_dist = (
        pml_distances.CosineSimilarity() if distance == "cosine" else pml_distances.LpDistance()
    )
    for avg_of_avgs in (False, True):
        calc = AccuracyCalculator(
            include=PER_QUERY_KEYS,
            avg_of_avgs=avg_of_avgs,
            knn_func=CustomKNN(pml_dist),
            device=torch.device("cpu"),
        )
        theirs = calc.get_accuracy(emb, labels)
        for name in PER_QUERY_KEYS:
            value = per_query[name]
            if avg_of_avgs:
                ours = torch.stack([value[counted & (labels == c)].mean() for c in classes]).mean()
            else:
                ours = value[counted].mean()
            assert ours.item() == pytest.approx(theirs[name], rel=1e-6), (name, avg_of_avgs)
    # and the plain means are retrieval_metrics'
    means = retrieval_metrics(emb, labels, distance=pf_distance(distance))
    for name in PML_METRICS:
        torch.testing.assert_close(per_query[name][counted].mean(), means[name], rtol=1e-12, atol=0)


def test_pml_per_query_runs_on_meta_with_static_shapes():
    meta = torch.device("meta")
    out = pml_per_query(
        torch.zeros(5, 3, device=meta), torch.zeros(5, dtype=torch.long, device=meta)
    )
    assert all(
        v.device == meta and v.shape == (5,) and v.dtype == torch.float64 for v in out.values()
    )
    out = pml_per_query(torch.ones(2, 4, device=meta), torch.ones(2, device=meta), k=2)
    assert all(v.shape == (2,) for v in out.values())


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [
        (lambda: pml_per_query(torch.ones(3), torch.ones(3)), ValueError, "retrieved"),
        (lambda: pml_per_query(torch.ones(3, 0), torch.ones(3)), ValueError, "retrieved"),
        (lambda: pml_per_query([[1, 0]], torch.ones(1)), TypeError, "retrieved"),  # type: ignore[arg-type]
        (lambda: pml_per_query(torch.ones(3, 2), torch.ones(2)), ValueError, "num_relevant"),
        (lambda: pml_per_query(torch.ones(3, 2), [1, 1, 1]), TypeError, "num_relevant"),  # type: ignore[arg-type]
        (lambda: pml_per_query(torch.ones(3, 2), torch.ones(3), k=3), ValueError, "k=3"),
        (lambda: pml_per_query(torch.ones(3, 2), torch.ones(3), k=0), ValueError, "k"),
    ],
)
def test_pml_per_query_errors_name_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


# ----------------------------------------------------------------------------------------------
# code health
# ----------------------------------------------------------------------------------------------
def _code_lines(func: ast.FunctionDef, lines: list[str]) -> int:
    """Non-blank, non-comment source lines of a function's body, its docstring left out."""
    body = func.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    spanned = {n for stmt in body for n in range(stmt.lineno, stmt.end_lineno + 1)}
    return sum(
        1 for n in spanned if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
    )


def test_no_evaluation_function_is_over_60_code_lines():
    package = Path(pf.evaluation.__file__).parent
    lengths = {}
    for path in sorted(package.glob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[f"{path.name}:{node.name}"] = _code_lines(node, lines)
    assert len(lengths) > 30  # the walk saw the package's functions
    sample = 'def f(x):\n    """Doc\n    string."""\n    # a comment\n\n    y = (x +\n         1)\n    return y\n'
    assert _code_lines(ast.parse(sample).body[0], sample.splitlines()) == 3  # the count itself
    assert {name: n for name, n in lengths.items() if n > 60} == {}


def test_k_is_bounded_by_the_reference_rows_each_query_can_retrieve():
    """Same set: a query's own row is not a candidate (5 of X's 6 rows); separate sets: every
    reference row. The bound is retrieval_metrics' own check, before the search's."""
    assert retrieval_metrics(X, Y, k=5)["precision_at_1"].isfinite()
    with pytest.raises(ValueError, match="k=6 exceeds the 5 reference rows available"):
        retrieval_metrics(X, Y, k=6)
    assert retrieval_metrics(X, Y, R, RY, k=5)["precision_at_1"].isfinite()
    with pytest.raises(ValueError, match="k=6 exceeds the 5 reference rows available"):
        retrieval_metrics(X, Y, R, RY, k=6)
    # two rows of one class: each retrieves the other, the only row it can
    out = retrieval_metrics(X[:2], Y[:2])
    assert all(float(v) == 1.0 for v in out.values())


def test_the_default_k_is_bounded_by_the_rows_available_and_recall_ks_by_k():
    """Without k: the most same-class rows of a query, the largest recall k, at most the
    candidates (N - 1 in one set); a recall k above it is refused by name, as is a set whose
    only row is the query."""
    with pytest.raises(ValueError, match=r"recall_ks=\(6,\) has a value above k=5"):
        retrieval_metrics(X, Y, recall_ks=(6,))
    with pytest.raises(ValueError, match=r"recall_ks=\(4,\) has a value above k=3"):
        retrieval_metrics(X, Y, k=3, recall_ks=(4,))
    assert retrieval_metrics(X, Y, recall_ks=(5,))["recall_at_5"].isfinite()
    with pytest.raises(ValueError, match="reference has no row to retrieve"):
        retrieval_metrics(X[:1], Y[:1])
