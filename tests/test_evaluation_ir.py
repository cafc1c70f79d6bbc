"""Tests for pmlfunc.evaluation's IR metrics: retrieval_scores, neighbor_scores,
neighbor_relevance, cross_modal_scores, merge_neighbors and the per-query arithmetic.

References: scikit-learn's ``ndcg_score`` for NDCG on graded relevance, and the float64
per-query loops of tests/reference/evaluation.py (which rank with a Python ``sorted`` of the
float64 scores, ties by lower index) for every metric, the cross-modal helper and the merge.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from reference import evaluation as ref
from sklearn.metrics import ndcg_score
from tracking import LargestTensor

import pmlfunc.distances as pfd
from pmlfunc.evaluation import (
    cross_modal_scores,
    hit_rate_at_k,
    knn,
    map_at_k,
    merge_neighbors,
    mrr,
    ndcg,
    neighbor_relevance,
    neighbor_scores,
    precision_at_k,
    recall_at_k,
    retrieval_metrics,
    retrieval_scores,
)

ALL = tuple(
    f"{name}@{k}"
    for name in ("ndcg", "mrr", "map", "recall", "precision", "hit_rate")
    for k in (1, 3, 10)
)
DISTANCES = {"dot": (pfd.dot(), True), "euclidean": (pfd.lp(normalize=False), False)}
NON_FINITE = [math.nan, math.inf, -math.inf]


def assert_scores(ours, expected, rtol=1e-9):
    assert list(ours) == list(expected)
    for name, value in expected.items():
        got = ours[name]
        assert got.dtype == torch.float64, name
        if isinstance(value, list):
            torch.testing.assert_close(
                got, ref.as_tensor(value), rtol=rtol, atol=1e-12, equal_nan=True
            )
        elif math.isnan(value):
            assert math.isnan(got.item()), name
        else:
            assert got.item() == pytest.approx(value, rel=rtol, abs=1e-12), name


def labelled(gen, n, classes, dim=6):
    centers = torch.randn(classes, dim, generator=gen)
    labels = torch.randint(0, classes, (n,), generator=gen)
    return centers[labels] + 0.7 * torch.randn(n, dim, generator=gen), labels


def graded(gen, q, r, *, levels=4, density=0.3):
    """A (q, r) integer relevance matrix, grades 1..levels-1 on about ``density`` of entries."""
    grade = torch.randint(1, levels, (q, r), generator=gen)
    return torch.where(torch.rand(q, r, generator=gen) < density, grade, 0)


def to_ids(matrix):
    """The padded id-list form of a dense relevance matrix: ids of nonzero entries, -1 padded,
    in a shuffled order (the order must not matter)."""
    rows = [torch.nonzero(row).flatten().tolist() for row in matrix]
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), -1)
    grades = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        r = r[::-1] if i % 2 else r
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        grades[i, : len(r)] = matrix[i, r].float()
    return ids, grades


# ----------------------------------------------------------------------------------------------
# NDCG against scikit-learn
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 10, 40])
def test_ndcg_equals_sklearn_ndcg_score_on_graded_relevance(gen, k):
    q, r = torch.randn(25, 6, generator=gen), torch.randn(40, 6, generator=gen)
    rel = graded(gen, 25, 40)
    rel[:, 0] = 2  # every query has a relevant item (sklearn would score the others 0)
    scores = (q.double() @ r.double().T).numpy()  # distinct: sklearn's tie averaging is moot
    expected = ndcg_score(rel.numpy(), scores, k=k)
    for source in ({"relevance": rel}, {"relevance": rel.float()}):
        got = retrieval_scores(q, r, metrics=(f"ndcg@{k}",), distance=pfd.dot(), **source)
        assert got[f"ndcg@{k}"].item() == pytest.approx(expected, rel=1e-9)
    ids, grades = to_ids(rel)
    got = retrieval_scores(
        q, r, metrics=(f"ndcg@{k}",), distance=pfd.dot(), relevant_ids=ids, relevant_grades=grades
    )
    assert got[f"ndcg@{k}"].item() == pytest.approx(expected, rel=1e-9)
    # Per query too.
    per = retrieval_scores(
        q, r, metrics=(f"ndcg@{k}",), relevance=rel, distance=pfd.dot(), reduction="none"
    )[f"ndcg@{k}"]
    rows = [ndcg_score(rel[i : i + 1].numpy(), scores[i : i + 1], k=k) for i in range(25)]
    np.testing.assert_allclose(per.numpy(), rows, rtol=1e-9)


def test_queries_without_relevance_are_left_out_where_sklearn_scores_zero(gen):
    q, r = torch.randn(12, 5, generator=gen), torch.randn(30, 5, generator=gen)
    rel = graded(gen, 12, 30, density=0.2)
    rel[:, 3] = 1
    rel[[2, 7]] = 0  # two queries without any relevant item
    scores = (q.double() @ r.double().T).numpy()
    sk = ndcg_score(rel.numpy(), scores, k=5)  # averages in 0 for queries 2 and 7
    per = retrieval_scores(
        q, r, metrics=("ndcg@5",), relevance=rel, distance=pfd.dot(), reduction="none"
    )["ndcg@5"]
    assert torch.isnan(per[[2, 7]]).all() and not torch.isnan(per[[0, 1, 3]]).any()
    assert per.nan_to_num(0.0).mean().item() == pytest.approx(sk, rel=1e-9)
    mean = retrieval_scores(q, r, metrics=("ndcg@5",), relevance=rel, distance=pfd.dot())
    assert mean["ndcg@5"].item() == pytest.approx(sk * 12 / 10, rel=1e-9)
    assert mean["ndcg@5"].item() == pytest.approx(per.nanmean().item(), rel=1e-12)


# ----------------------------------------------------------------------------------------------
# every metric against the loop reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distance", sorted(DISTANCES))
def test_label_relevance_same_set_matches_loop(gen, distance):
    dist, sim = DISTANCES[distance]
    emb, labels = labelled(gen, 60, 7)
    labels[0] = 99  # a lone query: left out
    ours = retrieval_scores(emb, metrics=ALL, query_labels=labels, distance=dist, chunk_size=16)
    rankings = ref.ranking(emb, emb, similarity=sim, exclude_self=True)
    rel = ref.relevance_from_labels(labels, labels, exclude_self=True)
    assert_scores(ours, ref.scores(rankings, rel, ALL))


@pytest.mark.parametrize("distance", sorted(DISTANCES))
def test_label_relevance_separate_sets_matches_loop(gen, distance):
    dist, sim = DISTANCES[distance]
    q, ql = labelled(gen, 30, 9)
    r, rl = labelled(gen, 45, 6)  # query classes 6..8 have no reference: lone
    ours = retrieval_scores(
        q, r, metrics=ALL, query_labels=ql, reference_labels=rl, distance=dist, chunk_size=7
    )
    rankings = ref.ranking(q, r, similarity=sim)
    assert_scores(ours, ref.scores(rankings, ref.relevance_from_labels(ql, rl), ALL))


def test_label_relevance_query_subset_of_reference_matches_loop(gen):
    # PML's ref_includes_query: the reference starts with the queries, which skip themselves.
    q, ql = labelled(gen, 20, 5)
    extra, el = labelled(gen, 25, 5)
    r, rl = torch.cat([q, extra]), torch.cat([ql, el])
    ours = retrieval_scores(
        q,
        r,
        metrics=ALL,
        query_labels=ql,
        reference_labels=rl,
        exclude_self=True,
        distance=pfd.dot(),
    )
    rankings = ref.ranking(q, r, similarity=True, exclude_self=True)
    rel = ref.relevance_from_labels(ql, rl, exclude_self=True)
    assert_scores(ours, ref.scores(rankings, rel, ALL))


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("exclude_self", [False, True])
def test_matrix_and_id_relevance_match_loop(gen, binary, exclude_self):
    q, r = torch.randn(18, 5, generator=gen), torch.randn(33, 5, generator=gen)
    if exclude_self:
        r = torch.cat([q, r])
    rel = graded(gen, 18, r.shape[0], levels=2 if binary else 5, density=0.15)
    rel[4] = 0  # no relevant item
    if exclude_self:
        rel[5] = 0
        rel[5, 5] = 3  # only itself: excluded, so no relevant item either
    matrix = rel.bool() if binary else rel.double()
    kw = {"metrics": ALL, "distance": pfd.lp(normalize=False), "exclude_self": exclude_self}
    rankings = ref.ranking(q, r, similarity=False, exclude_self=exclude_self)
    expected = ref.scores(rankings, ref.relevance_from_matrix(rel, exclude_self=exclude_self), ALL)
    assert_scores(retrieval_scores(q, r, relevance=matrix, **kw), expected)
    ids, grades = to_ids(rel)
    by_ids = retrieval_scores(
        q, r, relevant_ids=ids, relevant_grades=None if binary else grades, **kw
    )
    assert_scores(by_ids, expected)
    expected_ids = ref.relevance_from_ids(
        ids, None if binary else grades, exclude_self=exclude_self
    )
    assert_scores(by_ids, ref.scores(rankings, expected_ids, ALL))


def test_per_query_values_match_loop_with_nan_for_queries_without_relevance(gen):
    emb, labels = labelled(gen, 40, 6)
    labels[[3, 9]] = torch.tensor([50, 51])
    metrics = ("ndcg@5", "map@4", "recall@3", "mrr@5")
    ours = retrieval_scores(
        emb, metrics=metrics, query_labels=labels, reduction="none", distance=pfd.dot()
    )
    rankings = ref.ranking(emb, emb, similarity=True, exclude_self=True)
    rel = ref.relevance_from_labels(labels, labels, exclude_self=True)
    assert_scores(ours, {m: ref.per_query(rankings, rel, m) for m in metrics})
    assert all(v.shape == (40,) and torch.isnan(v[[3, 9]]).all() for v in ours.values())


def test_all_queries_without_relevance_give_nan():
    emb = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    out = retrieval_scores(
        emb, metrics=("ndcg@2", "mrr@2", "precision@1"), query_labels=torch.arange(6)
    )
    assert all(torch.isnan(v) for v in out.values())


def test_hit_rate_and_precision_at_1_agree_with_pml_style_retrieval_metrics(gen):
    emb, labels = labelled(gen, 80, 8)
    labels[:2] = torch.tensor([40, 41])  # lone queries, left out by both
    ours = retrieval_scores(
        emb, metrics=("hit_rate@1", "hit_rate@5", "precision@1"), query_labels=labels
    )
    pml = retrieval_metrics(emb, labels, recall_ks=(1, 5))
    assert ours["hit_rate@1"].item() == pytest.approx(pml["precision_at_1"].item(), rel=1e-12)
    assert ours["precision@1"].item() == pytest.approx(pml["precision_at_1"].item(), rel=1e-12)
    assert ours["hit_rate@5"].item() == pytest.approx(pml["recall_at_5"].item(), rel=1e-12)


# ----------------------------------------------------------------------------------------------
# the per-query arithmetic
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_arithmetic_functions_match_loop_definitions(seed):
    g = torch.Generator().manual_seed(seed)
    big_k = 7
    n_rel = torch.randint(0, 12, (30,), generator=g)
    retrieved = torch.randint(0, 4, (30, big_k), generator=g) * (
        torch.rand(30, big_k, generator=g) < 0.4
    )
    # Consistent inputs: at most n_i relevant among the retrieved; ideal = all grades sorted.
    retrieved = torch.stack(
        [
            torch.where((row > 0).cumsum(0) <= n, row, 0)
            for row, n in zip(retrieved, n_rel, strict=True)
        ]
    )
    rels, ideal = [], torch.zeros(30, big_k)
    for i in range(30):
        grades = {j: float(g_) for j, g_ in enumerate(retrieved[i].tolist()) if g_ > 0}
        extra = int(n_rel[i]) - len(grades)
        grades.update({100 + e: 1.0 for e in range(extra)})  # unretrieved relevant items
        rels.append(grades)
        best = sorted(grades.values(), reverse=True)[:big_k]
        ideal[i, : len(best)] = torch.tensor(best)
    rankings = [list(range(big_k))] * 30
    for k in (1, 4, big_k):
        got = {
            f"ndcg@{k}": ndcg(retrieved, ideal, k=k),
            f"mrr@{k}": mrr(retrieved, k=k),
            f"map@{k}": map_at_k(retrieved, n_rel, k=k),
            f"recall@{k}": recall_at_k(retrieved, n_rel, k=k),
            f"precision@{k}": precision_at_k(retrieved, k=k),
            f"hit_rate@{k}": hit_rate_at_k(retrieved, k=k),
        }
        for name, value in got.items():
            expected = ref.per_query(rankings, rels, name)
            if name.split("@")[0] in ("mrr", "precision", "hit_rate"):
                # defined (not NaN) for queries without relevant items: 0 there
                expected = [0.0 if math.isnan(e) else e for e in expected]
            torch.testing.assert_close(
                value, ref.as_tensor(expected), rtol=1e-12, atol=1e-12, equal_nan=True
            )
    # default k is the full width
    assert torch.equal(mrr(retrieved), mrr(retrieved, k=big_k))


def test_neighbor_relevance_from_ids_gathers_grades_without_dense_matrix():
    idx = torch.tensor([[4, 1, 0], [2, 3, 1]])
    ids = torch.tensor([[1, 4, -1, 3], [-1, -1, -1, 1]])
    grades = torch.tensor([[2.0, 5.0, 9.0, 1.0], [0.0, 0.0, 0.0, 4.0]])
    rel = neighbor_relevance(idx, relevant_ids=ids, relevant_grades=grades, num_references=5)
    assert rel.retrieved.tolist() == [[5.0, 2.0, 0.0], [0.0, 0.0, 4.0]]
    assert rel.num_relevant.tolist() == [3, 1]
    assert rel.ideal.tolist() == [[5.0, 2.0, 1.0], [4.0, 0.0, 0.0]]


def test_neighbor_relevance_from_a_matrix_takes_the_reference_count_from_its_width():
    """A dense ``(Q, R)`` matrix with no ``num_references``: R is its width; the grades are
    the matrix's at the neighbours, the ideal list its sorted row."""
    matrix = torch.tensor([[0.0, 3.0, 0.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    rel = neighbor_relevance(torch.tensor([[4, 0], [0, 1]]), relevance=matrix)
    assert rel.retrieved.tolist() == [[2.0, 0.0], [1.0, 0.0]]
    assert rel.num_relevant.tolist() == [3, 1]
    assert rel.ideal.tolist() == [[3.0, 2.0], [1.0, 0.0]]
    with pytest.raises(IndexError, match="indices"):  # 5 columns: index 5 is out of range
        neighbor_relevance(torch.tensor([[5], [0]]), relevance=matrix)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 1)])
def test_neighbor_relevance_takes_one_query_or_one_neighbour(shape):
    labels = torch.tensor([0, 1, 0, 1])
    idx = torch.tensor([[2, 1, 3], [3, 0, 2]])[: shape[0], : shape[1]]
    rel = neighbor_relevance(idx, query_labels=labels[: shape[0]], reference_labels=labels)
    want = [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert rel.retrieved.tolist() == [row[: shape[1]] for row in want[: shape[0]]]


@pytest.mark.parametrize("shape", [(0, 2), (2, 0)], ids=["no-query", "no-neighbour"])
def test_neighbor_relevance_refuses_empty_indices_by_name(shape):
    with pytest.raises(
        ValueError, match=r"indices must be 2-D of shape \(num_queries >= 1, k >= 1\)"
    ):
        neighbor_relevance(
            torch.zeros(shape, dtype=torch.long), query_labels=torch.zeros(shape[0], dtype=torch.long),
            reference_labels=torch.zeros(4, dtype=torch.long),
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# cross-modal
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distance", sorted(DISTANCES))
def test_cross_modal_scores_match_loop_both_directions(gen, distance):
    dist, sim = DISTANCES[distance]
    n_img = 14
    image = torch.randn(n_img, 8, generator=gen)
    caps = torch.randint(1, 6, (n_img,), generator=gen)
    caps[5] = 0  # an image without a caption: left out of image→text
    t2i = torch.repeat_interleave(torch.arange(n_img), caps)
    t2i = t2i[torch.randperm(len(t2i), generator=gen)]
    text = image[t2i] + 0.9 * torch.randn(len(t2i), 8, generator=gen)
    metrics = (
        "hit_rate@1",
        "hit_rate@5",
        "hit_rate@10",
        "recall@1",
        "recall@5",
        "recall@10",
        "ndcg@10",
        "mrr@10",
        "map@10",
        "precision@5",
    )
    ours = cross_modal_scores(image, text, t2i, metrics=metrics, distance=dist, chunk_size=5)
    expected = ref.cross_modal(image, text, t2i, metrics, similarity=sim)
    assert set(ours) == {"image_to_text", "text_to_image"}
    for direction in ours:
        assert_scores(ours[direction], expected[direction])
    t2i_scores = ours["text_to_image"]
    for k in (1, 5, 10):  # one relevant image per text: recall = hit rate
        assert torch.equal(t2i_scores[f"recall@{k}"], t2i_scores[f"hit_rate@{k}"])


def test_cross_modal_default_metrics_are_paper_recall_at_1_5_10(gen):
    image = torch.randn(12, 4, generator=gen)
    out = cross_modal_scores(image, image.repeat(2, 1), torch.arange(12).repeat(2))
    assert list(out["image_to_text"]) == ["hit_rate@1", "hit_rate@5", "hit_rate@10"]
    assert all(v.item() == 1.0 for d in out.values() for v in d.values())


# ----------------------------------------------------------------------------------------------
# sharded references
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("distance", sorted(DISTANCES))
def test_shard_merge_equals_unsharded_knn_with_ties(seed, distance):
    dist, _ = DISTANCES[distance]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (11, 3), generator=g).float()  # many exact ties
    r = torch.randint(-1, 2, (47, 3), generator=g).float()
    k = int(torch.randint(1, 20, (1,), generator=g))
    cuts = sorted(torch.randperm(46, generator=g)[:3].add(1).tolist())
    bounds = [0, *cuts, 47]
    parts = [
        knn(q, r[a:b], k=min(k, b - a), distance=dist, chunk_size=4)
        for a, b in itertools.pairwise(bounds)
    ]
    idx, val = merge_neighbors(parts, k=k, distance=dist, offsets=bounds[:-1])
    base_idx, base_val = knn(q, r, k=k, distance=dist)
    assert torch.equal(idx, base_idx)
    assert torch.equal(val, base_val)
    # Global indices given directly, shards in another order: the same.
    shifted = [(i + a, v) for (i, v), a in zip(parts, bounds[:-1], strict=True)][::-1]
    assert torch.equal(merge_neighbors(shifted, k=k, distance=dist)[0], base_idx)


@pytest.mark.parametrize("seed", range(4))
def test_shard_merge_with_exclusion_equals_same_set_knn(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (40, 3), generator=g).float()
    k = 9
    bounds = [0, 13, 14, 31, 40]
    parts = [
        knn(x, x[a:b], k=min(k + 1, b - a), distance=pfd.dot())
        for a, b in itertools.pairwise(bounds)
    ]
    idx, val = merge_neighbors(
        parts, k=k, distance=pfd.dot(), offsets=bounds[:-1], exclude=torch.arange(40)
    )
    base_idx, base_val = knn(x, k=k, distance=pfd.dot())
    assert torch.equal(idx, base_idx) and torch.equal(val, base_val)
    # Scores from merged neighbours equal the unsharded retrieval_scores.
    labels = torch.randint(0, 4, (40,), generator=g)
    metrics = ("ndcg@9", "map@5", "recall@9")
    merged = neighbor_scores(idx, metrics=metrics, query_labels=labels)
    direct = retrieval_scores(x, metrics=metrics, query_labels=labels, distance=pfd.dot())
    assert all(torch.equal(merged[m], direct[m]) for m in metrics)


def test_shard_merge_ranks_a_nan_value_farthest_and_makes_its_query_row_nan():
    # Values from another search (faiss, say): query 0 has a NaN in shard 0, query 1 has none.
    shard0 = (torch.tensor([[0, 1], [0, 1]]), torch.tensor([[0.1, math.nan], [0.1, 0.4]]))
    shard1 = (torch.tensor([[2, 3], [2, 3]]), torch.tensor([[0.2, 0.3], [0.2, 0.3]]))
    idx, val = merge_neighbors([shard0, shard1], k=4, distance=pfd.lp())
    assert idx.tolist() == [[0, 2, 3, 1], [0, 2, 3, 1]]
    assert val[0].isnan().all()
    assert val[1].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("where", ["query", "reference"])
def test_shard_merge_of_non_finite_embeddings_carries_knns_nan_rows(gen, bad, where):
    x, labels = labelled(gen, 30, 4)
    r, r_labels = labelled(gen, 24, 4)
    if where == "query":
        x[4, 2] = bad
    else:
        r[17, 0] = bad  # in the second shard
    parts = [knn(x, r[:10], k=6), knn(x, r[10:], k=6)]
    idx, val = merge_neighbors(parts, k=6, offsets=[0, 10])
    base_idx, base_val = knn(x, r, k=6)
    marked = base_val.isnan().any(1)
    assert marked.sum().item() == (1 if where == "query" else 30)
    assert torch.equal(val.isnan(), base_val.isnan())  # the same queries, whole rows
    assert torch.equal(idx[~marked], base_idx[~marked])
    # Gaussian rows: a shard's matmul may round differently from the whole one's (its own
    # blocking on this CPU), so the values agree to float32 rounding, the order exactly.
    torch.testing.assert_close(val[~marked], base_val[~marked])
    # The merged neighbours with their values score as the unsharded search, NaN included.
    kw = {"query_labels": labels, "reference_labels": r_labels, "reduction": "none"}
    merged = neighbor_scores(idx, values=val, metrics=("ndcg@6", "mrr@3"), **kw)
    direct = retrieval_scores(x, r, metrics=("ndcg@6", "mrr@3"), **kw)
    for m, v in merged.items():
        assert v[marked].isnan().all()
        torch.testing.assert_close(v, direct[m], rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------------
# non-finite embeddings: NaN for every query they could rank, never a finite number
# ----------------------------------------------------------------------------------------------
def relevance_kwargs(gen, source, n_q, r):
    """Separate-set keyword arguments of each relevance source (every query has relevance)."""
    rel = graded(gen, n_q, r.shape[0])
    rel[:, 0] = 1
    if source == "labels":
        return {
            "query_labels": torch.randint(0, 3, (n_q,), generator=gen),
            "reference_labels": torch.arange(r.shape[0]) % 3,
        }
    if source == "matrix":
        return {"relevance": rel}
    ids, grades = to_ids(rel)
    return {"relevant_ids": ids, "relevant_grades": grades}


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("source", ["labels", "matrix", "ids"])
def test_retrieval_scores_are_nan_for_a_non_finite_query_and_exact_for_the_others(gen, bad, source):
    q, r = torch.randn(20, 6, generator=gen), torch.randn(30, 6, generator=gen)
    kw = relevance_kwargs(gen, source, 20, r)
    clean = retrieval_scores(q, r, metrics=ALL, reduction="none", **kw)
    broken_q = q.clone()
    broken_q[7, 3] = bad
    got = retrieval_scores(broken_q, r, metrics=ALL, reduction="none", **kw)
    others = torch.arange(20) != 7
    for m in ALL:
        assert got[m][7].isnan(), m
        assert torch.equal(got[m][others], clean[m][others]), m
    mean = retrieval_scores(broken_q, r, metrics=ALL, **kw)
    assert all(torch.isnan(v) for v in mean.values())
    assert all(torch.isfinite(v) for v in retrieval_scores(q, r, metrics=ALL, **kw).values())


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("source", ["labels", "matrix", "ids"])
def test_retrieval_scores_are_nan_for_every_query_when_a_reference_row_is_non_finite(
    gen, bad, source
):
    q, r = torch.randn(20, 6, generator=gen), torch.randn(30, 6, generator=gen)
    kw = relevance_kwargs(gen, source, 20, r)
    broken_r = r.clone()
    broken_r[11, 0] = bad
    for reduction in ("none", "mean"):
        got = retrieval_scores(q, broken_r, metrics=ALL, reduction=reduction, **kw)
        assert all(v.isnan().all() for v in got.values())


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
def test_retrieval_scores_same_set_and_a_query_without_relevance_are_nan_too(gen, bad):
    emb, labels = labelled(gen, 25, 4)
    broken = emb.clone()
    broken[2, 1] = bad
    got = retrieval_scores(broken, metrics=ALL, query_labels=labels, reduction="none")
    assert all(v.isnan().all() for v in got.values())  # row 2 is every query's reference
    # A query with no relevant item is left out of the means, but not when it is non-finite.
    q, r = torch.randn(8, 4, generator=gen), torch.randn(12, 4, generator=gen)
    rel = graded(gen, 8, 12)
    rel[:, 0], rel[3] = 1, 0
    clean = retrieval_scores(q, r, metrics=ALL, relevance=rel)
    assert all(torch.isfinite(v) for v in clean.values())
    q[3, 0] = bad
    assert all(torch.isnan(v) for v in retrieval_scores(q, r, metrics=ALL, relevance=rel).values())


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
def test_neighbor_scores_given_knns_values_are_nan_for_the_marked_queries(gen, bad):
    q, ql = labelled(gen, 20, 3)
    r, rl = labelled(gen, 25, 3)
    kw = {"query_labels": ql, "reference_labels": rl}
    q[6, 0] = bad
    idx, val = knn(q, r, k=10)
    per = neighbor_scores(idx, values=val, metrics=ALL, reduction="none", **kw)
    unmarked = neighbor_scores(idx, metrics=ALL, reduction="none", **kw)  # indices alone
    others = torch.arange(20) != 6
    for m in ALL:
        assert per[m][6].isnan() and not unmarked[m][6].isnan(), m
        torch.testing.assert_close(
            per[m][others], unmarked[m][others], rtol=0, atol=0, equal_nan=True
        )
    assert all(torch.isnan(v) for v in neighbor_scores(idx, values=val, metrics=ALL, **kw).values())
    r[0, 1] = bad  # a non-finite reference: every query
    idx, val = knn(q, r, k=10)
    per = neighbor_scores(idx, values=val, metrics=ALL, reduction="none", **kw)
    assert all(v.isnan().all() for v in per.values())


@pytest.mark.parametrize("bad", NON_FINITE, ids=str)
@pytest.mark.parametrize("side", ["image", "text"])
def test_cross_modal_scores_are_nan_where_a_non_finite_row_could_rank(gen, bad, side):
    image = torch.randn(10, 6, generator=gen)
    t2i = torch.arange(10).repeat(3)
    text = image[t2i] + 0.8 * torch.randn(30, 6, generator=gen)
    metrics = ("hit_rate@1", "hit_rate@5", "ndcg@5")
    clean = cross_modal_scores(image, text, t2i, metrics=metrics, reduction="none")
    if side == "image":
        image = image.clone()
        image[4, 2] = bad
        own, other, row = "image_to_text", "text_to_image", 4
    else:
        text = text.clone()
        text[13, 2] = bad
        own, other, row = "text_to_image", "image_to_text", 13
    got = cross_modal_scores(image, text, t2i, metrics=metrics, reduction="none")
    keep = torch.arange(got[own][metrics[0]].shape[0]) != row
    for m in metrics:
        assert got[own][m][row].isnan() and got[other][m].isnan().all(), m
        assert torch.equal(got[own][m][keep], clean[own][m][keep]), m
    means = cross_modal_scores(image, text, t2i, metrics=metrics)
    assert all(torch.isnan(v) for d in means.values() for v in d.values())


# ----------------------------------------------------------------------------------------------
# invariances, compile, meta
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunk_size_does_not_change_scores(gen, chunk_size):
    emb, labels = labelled(gen, 64, 5)
    r = torch.randn(50, 6, generator=gen)
    rel = graded(gen, 64, 50)
    ids, grades = to_ids(rel)
    for kw in (
        {"query_labels": labels},
        {"reference": r, "relevance": rel},
        {"reference": r, "relevant_ids": ids, "relevant_grades": grades},
    ):
        base = retrieval_scores(emb, metrics=ALL, chunk_size=64, **kw)
        got = retrieval_scores(emb, metrics=ALL, chunk_size=chunk_size, **kw)
        assert all(torch.equal(got[m], base[m]) for m in ALL)


COMPILE_METRICS = ("ndcg@10", "mrr@5", "map@10", "recall@3", "precision@10", "hit_rate@1")


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("source", ["labels", "matrix", "ids"])
def test_metric_arithmetic_under_compile_fullgraph_equals_eager(gen, source):
    torch._dynamo.reset()
    emb, labels = labelled(gen, 30, 4)
    r = torch.randn(25, 6, generator=gen)
    rel = graded(gen, 30, 25).float()
    ids, grades = to_ids(rel)
    if source == "labels":
        idx, kw = knn(emb, k=10)[0], {"query_labels": labels}
    elif source == "matrix":
        idx, kw = knn(emb, r, k=10)[0], {"relevance": rel}
    else:
        idx = knn(emb, r, k=10)[0]
        kw = {"relevant_ids": ids, "relevant_grades": grades, "num_references": 25}

    def scores(idx):
        return neighbor_scores(idx, metrics=COMPILE_METRICS, **kw)

    eager = scores(idx)
    compiled = torch.compile(scores, fullgraph=True)(idx)
    for m in COMPILE_METRICS:
        torch.testing.assert_close(compiled[m], eager[m], rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.compile
@pytest.mark.slow
def test_neighbor_scores_nan_rule_under_compile_fullgraph_equals_eager(gen):
    torch._dynamo.reset()
    q, ql = labelled(gen, 30, 4)
    r, rl = labelled(gen, 25, 4)
    q[3, 0] = math.nan
    idx, val = knn(q, r, k=10)  # query 3 marked, the others not

    def scores(idx, val, reduction):
        return neighbor_scores(
            idx,
            values=val,
            metrics=COMPILE_METRICS,
            query_labels=ql,
            reference_labels=rl,
            reduction=reduction,
        )

    compiled = torch.compile(scores, fullgraph=True)
    for reduction in ("none", "mean"):
        eager, got = scores(idx, val, reduction), compiled(idx, val, reduction)
        for m in COMPILE_METRICS:
            if reduction == "none":  # query 3 NaN, the others finite
                assert eager[m][3].isnan() and eager[m].isfinite().sum() == 29, m
            else:
                assert eager[m].isnan(), m
            torch.testing.assert_close(got[m], eager[m], rtol=1e-12, atol=1e-12, equal_nan=True)


def test_runs_on_meta_device(gen):
    emb, labels = labelled(gen, 20, 3)
    r = torch.randn(30, 6, generator=gen)
    rel = graded(gen, 20, 30)
    ids, grades = to_ids(rel)
    meta = torch.device("meta")
    for kw in (
        {"query_labels": labels.to(meta)},
        {"reference": r.to(meta), "relevance": rel.to(meta)},
        {"reference": r.to(meta), "relevant_ids": ids.to(meta), "relevant_grades": grades.to(meta)},
    ):
        out = retrieval_scores(emb.to(meta), metrics=ALL, **kw)
        assert all(v.device.type == "meta" and v.shape == () for v in out.values())
    both = cross_modal_scores(r.to(meta), emb.to(meta), labels.to(meta), metrics=("hit_rate@3",))
    assert both["text_to_image"]["hit_rate@3"].device.type == "meta"
    parts = [knn(emb.to(meta), r[:10].to(meta), k=5), knn(emb.to(meta), r[10:].to(meta), k=5)]
    idx, _ = merge_neighbors(parts, k=5, offsets=[0, 10])
    assert idx.shape == (20, 5) and idx.device.type == "meta"


def test_inputs_unchanged_and_no_grad(gen):
    emb, labels = labelled(gen, 20, 3)
    emb.requires_grad_(True)
    before = emb.detach().clone()
    out = retrieval_scores(emb, metrics=("ndcg@5",), query_labels=labels)
    assert not out["ndcg@5"].requires_grad and torch.equal(emb.detach(), before)


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
Q = torch.randn(6, 4)
QL = torch.tensor([0, 0, 1, 1, 2, 2])
RR = torch.randn(8, 4)
RL = torch.tensor([0, 1, 1, 2, 2, 3, 3, 0])
IDX = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 2], [1, 3]])
REL = torch.ones(6, 8)
IDS = torch.tensor([[0, -1]] * 6)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: retrieval_scores(Q, query_labels=QL, metrics="ndcg@2"), TypeError, "metrics"),
        (lambda: retrieval_scores(Q, query_labels=QL, metrics=()), ValueError, "metrics"),
        (lambda: retrieval_scores(Q, query_labels=QL, metrics=("ndcg",)), ValueError, "name@k"),
        (lambda: retrieval_scores(Q, query_labels=QL, metrics=("ndcg@0",)), ValueError, "name@k"),
        (lambda: retrieval_scores(Q, query_labels=QL, metrics=("foo@2",)), ValueError, "name@k"),
        (lambda: retrieval_scores(Q, query_labels=QL, metrics=(3,)), TypeError, "metrics"),  # type: ignore[arg-type]
        (lambda: retrieval_scores(Q, query_labels=QL, metrics=("ndcg@6",)), ValueError, "k=6"),
        (lambda: retrieval_scores(Q, RR, relevance=REL, metrics=("ndcg@9",)), ValueError, "k=9"),
        (lambda: retrieval_scores(Q, metrics=("ndcg@2",)), ValueError, "exactly one"),
        (
            lambda: retrieval_scores(Q, query_labels=QL, relevance=REL[:, :6]),
            ValueError,
            "exactly one",
        ),
        (
            lambda: retrieval_scores(Q, RR, query_labels=QL, metrics=("mrr@1",)),
            ValueError,
            "reference_labels",
        ),
        (
            lambda: retrieval_scores(Q, RR, query_labels=QL, reference_labels=RL[:5]),
            ValueError,
            "reference_labels",
        ),
        (lambda: retrieval_scores(Q, query_labels=QL[:5]), ValueError, "query_labels"),
        (lambda: retrieval_scores(Q, query_labels=QL.float()), TypeError, "query_labels"),
        (
            lambda: retrieval_scores(Q, RR, relevance=REL[:, :7], metrics=("mrr@1",)),
            ValueError,
            "relevance",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevance=REL[:5], metrics=("mrr@1",)),
            ValueError,
            "relevance",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevance=REL[:, 0], metrics=("mrr@1",)),
            ValueError,
            r"relevance must be 2-D of shape \(6, R\)",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevant_ids=IDS.float(), metrics=("mrr@1",)),
            TypeError,
            "relevant_ids",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevant_ids=IDS[:5], metrics=("mrr@1",)),
            ValueError,
            "relevant_ids",
        ),
        (
            lambda: retrieval_scores(
                Q, RR, relevant_ids=IDS, relevant_grades=torch.ones(6, 3), metrics=("mrr@1",)
            ),
            ValueError,
            "relevant_grades",
        ),
        (
            lambda: retrieval_scores(
                Q, RR, relevance=REL, relevant_grades=torch.ones(6, 2), metrics=("mrr@1",)
            ),
            ValueError,
            "relevant_grades",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevant_ids=IDS + 8, metrics=("mrr@1",)),
            IndexError,
            "relevant_ids",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevant_ids=IDS - 1, metrics=("mrr@1",)),
            IndexError,
            "relevant_ids",
        ),
        (
            lambda: retrieval_scores(Q, RR, relevance=REL, metrics=("mrr@1",), reduction="sum"),
            ValueError,
            "reduction",
        ),
        (
            lambda: retrieval_scores(
                Q, RR[:4], relevance=REL[:, :4], exclude_self=True, metrics=("mrr@1",)
            ),
            ValueError,
            "exclude_self",
        ),
        (
            lambda: neighbor_scores(IDX, query_labels=QL, reference_labels=RL, metrics=("ndcg@3",)),
            ValueError,
            "k=3",
        ),
        (
            lambda: neighbor_scores(
                IDX + 7, query_labels=QL, reference_labels=RL, metrics=("ndcg@2",)
            ),
            IndexError,
            "indices",
        ),
        (
            lambda: neighbor_scores(
                IDX - 1, query_labels=QL, reference_labels=RL, metrics=("ndcg@2",)
            ),
            IndexError,
            "indices",
        ),
        (
            lambda: neighbor_scores(
                IDX.float(), query_labels=QL, reference_labels=RL, metrics=("ndcg@2",)
            ),
            TypeError,
            "indices",
        ),
        (
            lambda: neighbor_scores(
                IDX[0], query_labels=QL, reference_labels=RL, metrics=("ndcg@1",)
            ),
            ValueError,
            "indices",
        ),
        (
            lambda: neighbor_scores(IDX, relevant_ids=IDS, metrics=("ndcg@2",)),
            ValueError,
            "num_references",
        ),
        (
            lambda: neighbor_relevance(IDX, query_labels=QL, reference_labels=RL, chunk_size=0),
            ValueError,
            "chunk_size",
        ),
        (lambda: ndcg(torch.ones(3, 2), torch.ones(3, 1)), ValueError, "ideal"),
        (lambda: ndcg(torch.ones(3, 2), torch.ones(2, 2)), ValueError, "ideal"),
        (lambda: mrr(torch.ones(3, 2), k=3), ValueError, "k=3"),
        (lambda: mrr(torch.ones(3), k=1), ValueError, "retrieved"),
        (lambda: recall_at_k(torch.ones(3, 2), torch.ones(2)), ValueError, "num_relevant"),
        (lambda: map_at_k(torch.ones(3, 2), [1, 1, 1]), TypeError, "num_relevant"),  # type: ignore[arg-type]
        (lambda: precision_at_k([[1, 0]]), TypeError, "retrieved"),  # type: ignore[arg-type]
        (
            lambda: cross_modal_scores(
                Q, RR, torch.tensor([0, 1, 2, 3, 4, 5, 6, 0]), metrics=("hit_rate@1",)
            ),
            IndexError,
            "text_to_image",
        ),
        (
            lambda: cross_modal_scores(Q, RR, torch.zeros(7, dtype=torch.long)),
            ValueError,
            "text_to_image",
        ),
        (
            lambda: cross_modal_scores(Q, torch.randn(8, 3), torch.zeros(8, dtype=torch.long)),
            ValueError,
            "text",
        ),
        (lambda: merge_neighbors([], k=1), ValueError, "shards"),
        # a string is a sequence, an iterator is not one: both rejected by name
        (lambda: merge_neighbors("ab", k=1), TypeError, "shards must be a sequence"),  # type: ignore[arg-type]
        (
            lambda: merge_neighbors(iter([(IDX, REL[:, :2])]), k=1),  # type: ignore[arg-type]
            TypeError,
            "shards must be a sequence",
        ),
        (lambda: merge_neighbors((IDX, REL[:, :2]), k=1), TypeError, "pair"),  # type: ignore[arg-type]
        (lambda: merge_neighbors([(IDX, REL[:, :2])], k=3), ValueError, "k=3"),
        (
            lambda: merge_neighbors([(IDX, REL[:, :2])], k=2, exclude=torch.arange(6)),
            ValueError,
            "k=2",
        ),
        (
            lambda: merge_neighbors([(IDX, REL[:, :2]), (IDX[:5], REL[:5, :2])], k=2),
            ValueError,
            "shards\\[1\\]",
        ),
        (lambda: merge_neighbors([(IDX, REL[:, :3])], k=1), ValueError, "shards\\[0\\]"),
        (lambda: merge_neighbors([(IDX.float(), REL[:, :2])], k=1), TypeError, "shards\\[0\\]"),
        (
            lambda: merge_neighbors([(IDX, REL[:, :2]), (IDX, REL[:, :2].double())], k=1),
            TypeError,
            "shards\\[1\\]",
        ),
        (lambda: merge_neighbors([(IDX, REL[:, :2])], k=1, offsets=[0, 1]), ValueError, "offsets"),
        (lambda: merge_neighbors([(IDX, REL[:, :2])], k=1, offsets=[-1]), ValueError, "offsets"),
        (lambda: merge_neighbors([(IDX, REL[:, :2])], k=0), ValueError, "k"),
        (
            lambda: neighbor_scores(IDX, values=[[0.0]], query_labels=QL, metrics=("mrr@1",)),  # type: ignore[arg-type]
            TypeError,
            "values",
        ),
        (
            lambda: neighbor_scores(IDX, values=IDX, query_labels=QL, metrics=("mrr@1",)),
            TypeError,
            "values",
        ),
        (
            lambda: neighbor_scores(IDX, values=REL[:, :3], query_labels=QL, metrics=("mrr@1",)),
            ValueError,
            "values",
        ),
    ],
)
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_separate_reference_with_labels_needs_reference_labels_even_when_sizes_match():
    # R == Q must not silently reuse the query labels for the reference.
    with pytest.raises(ValueError, match="reference_labels"):
        retrieval_scores(Q, RR[:6], query_labels=QL, metrics=("mrr@1",))
    with pytest.raises(ValueError, match="reference_labels"):
        retrieval_scores(Q, query_labels=QL, reference_labels=QL, metrics=("mrr@1",))


@pytest.mark.parametrize("source", ["labels", "ids"])
def test_memory_is_chunk_times_reference_never_query_times_reference(gen, source):
    # Q = 400 queries, R = 300 references, chunk 16: no tensor beyond 2 · chunk · R = 9,600
    # elements (Q × R would be 120,000).
    q, r = torch.randn(400, 8, generator=gen), torch.randn(300, 8, generator=gen)
    kw: dict[str, Any]
    if source == "labels":
        kw = {
            "query_labels": torch.randint(0, 9, (400,)),
            "reference_labels": torch.randint(0, 9, (300,)),
        }
    else:
        # six relevant ids per query, in [0, 300), then six -1 paddings
        first = (torch.arange(400) % 50 * 6).unsqueeze(1)
        kw = {"relevant_ids": torch.where(torch.arange(12) < 6, first + torch.arange(12), -1)}
    with LargestTensor() as rec:
        retrieval_scores(q, r, metrics=("ndcg@10", "map@5", "recall@10"), chunk_size=16, **kw)
    assert rec.largest <= 16 * 300 * 2, rec.largest


def test_low_precision_embeddings_and_int32_ids(gen):
    emb, labels = labelled(gen, 40, 4)
    r = torch.randn(30, 6, generator=gen)
    out = retrieval_scores(emb.bfloat16(), metrics=("ndcg@5", "mrr@5"), query_labels=labels)
    assert all(v.dtype == torch.float64 and torch.isfinite(v) for v in out.values())
    rel = graded(gen, 40, 30)
    rel[:, 0] = 1
    ids, grades = to_ids(rel)
    as64 = retrieval_scores(emb, r, metrics=ALL, relevant_ids=ids, relevant_grades=grades)
    as32 = retrieval_scores(
        emb, r, metrics=ALL, relevant_ids=ids.int(), relevant_grades=grades.half()
    )
    assert all(torch.equal(as64[m], as32[m]) for m in ALL)


def test_metrics_k_is_bounded_by_the_reference_rows_each_query_can_retrieve():
    """retrieval_scores' own bound: a same-set query has N - 1 candidates, a separate query
    all M reference rows."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 4, generator=g), torch.tensor([0, 0, 1, 1, 2, 2])
    refs, ref_y = torch.randn(5, 4, generator=g), torch.tensor([0, 1, 1, 2, 2])
    got = retrieval_scores(x, metrics=("precision@5",), query_labels=y)
    assert float(got["precision@5"]) == pytest.approx(0.2)  # one same-class row among 5
    with pytest.raises(ValueError, match=r"k=6 neighbours but only 5 .* \(its own row excluded\)"):
        retrieval_scores(x, metrics=("precision@6",), query_labels=y)
    retrieval_scores(x, refs, metrics=("precision@5",), query_labels=y, reference_labels=ref_y)
    with pytest.raises(
        ValueError, match=r"k=6 neighbours but only 5 reference rows are available to each query$"
    ):
        retrieval_scores(x, refs, metrics=("precision@6",), query_labels=y, reference_labels=ref_y)


@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
def test_chunk_size_changes_no_score_or_relevance(gen, chunk_size):
    """retrieval_scores and neighbor_relevance read the same rows in chunks of any size: equal
    to one chunk of every query, for labels, a graded matrix and id lists."""
    emb, labels = labelled(gen, 23, 4)
    r = torch.randn(17, 6, generator=gen)
    rel = graded(gen, 23, 17)
    ids = torch.randint(-1, 17, (23, 5), generator=gen)
    for kw in (
        {"query_labels": labels},
        {"reference": r, "relevance": rel},
        {"reference": r, "relevant_ids": ids, "relevant_grades": ids.clamp_min(0).double()},
    ):
        whole = retrieval_scores(emb, metrics=ALL, chunk_size=23, **kw)
        got = retrieval_scores(emb, metrics=ALL, chunk_size=chunk_size, **kw)
        assert all(torch.equal(got[m], whole[m]) for m in ALL)
    idx = knn(emb, r, k=10)[0]
    for kw in ({"relevance": rel}, {"relevant_ids": ids, "num_references": 17}):
        whole_rel = neighbor_relevance(idx, chunk_size=23, **kw)
        got_rel = neighbor_relevance(idx, chunk_size=chunk_size, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got_rel, whole_rel, strict=True))
