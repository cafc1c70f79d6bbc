"""Retrieval evaluation: exact k-nearest neighbours, PML's retrieval metrics, the IR metrics
papers report (NDCG, MRR, MAP@k, recall@k, precision@k, hit rate@k), a shard merge, a
verification threshold and PML's clustering metrics (NMI, AMI).

:func:`knn` finds the exact ``k`` nearest reference rows of every query, one block of
``chunk_size`` queries at a time, so memory is ``O(chunk_size · R)``, never ``Q × R``.
:func:`retrieval_metrics` turns those neighbours into pytorch-metric-learning 2.9.0's
``AccuracyCalculator`` metrics (``precision_at_1``, ``r_precision``,
``mean_average_precision_at_r``) plus ``recall_at_k``.

:func:`retrieval_scores` computes any set of ``"name@k"`` metrics (``ndcg``, ``mrr``, ``map``,
``recall``, ``precision``, ``hit_rate``) in one call, with relevance from labels, from a
``(Q, R)`` relevance matrix (binary or graded) or from padded lists of relevant reference ids;
:func:`cross_modal_scores` does both directions of image↔text retrieval. The layers underneath
are public: :func:`neighbor_relevance` gathers the relevance of given neighbours (static
shapes, no ``Q × R`` matrix for labels or id lists), :func:`neighbor_scores` averages the
metrics of given neighbours, and :func:`ndcg`, :func:`mrr`, :func:`map_at_k`,
:func:`recall_at_k`, :func:`precision_at_k` and :func:`hit_rate_at_k` are the per-query
arithmetic; :func:`pml_per_query` is that of PML's metrics (what :func:`retrieval_metrics`
averages, plus PML's MAP@k and MRR), to average per class or any other way.
:func:`merge_neighbors` merges per-shard top-k lists into the global top-k, and
:func:`select_threshold` picks the distance threshold that best separates matching pairs.

:func:`clustering_scores` computes PML's clustering metrics ``"NMI"`` and ``"AMI"``: it runs
:func:`kmeans` (k-means++ seeding from an explicit ``generator``, a fixed number of Lloyd
iterations, distances in row blocks) with as many clusters as there are distinct labels, and
scores the clusters with :func:`normalized_mutual_info` and :func:`adjusted_mutual_info`,
scikit-learn's ``normalized_mutual_info_score`` and ``adjusted_mutual_info_score`` in float64
torch (equal to them to float64 rounding). :func:`kmeans` and :func:`normalized_mutual_info`
have static shapes; :func:`adjusted_mutual_info` reads the label sizes on the host (the terms of
its expected mutual information depend on them), and :func:`clustering_scores` also counts the
distinct labels there when ``num_clusters`` is not given. PML clusters with faiss instead, so
the cluster ids, and with them the scores, can differ from PML's where the classes are not well
separated.

All are evaluation tools, not losses: they run under ``torch.no_grad()``, have static shapes
(shapes depend on ``Q``, ``R`` and ``k`` only) and synchronise with the host only when
``retrieval_metrics`` must choose ``k`` itself (``k=None``; see there), for the clustering
metrics as just said and, in eager mode on CPU, to check index ranges. No metric is finite when
it comes from a broken ranking: a query whose embedding has a NaN or ±inf entry has NaN
metrics, every query does when a reference row has one, and a mean that includes such a query
is NaN (:func:`knn` marks these queries with a NaN row of values; :func:`select_threshold` is
NaN for non-finite distances; :func:`clustering_scores` is NaN when any embedding is).

Differences from PML 2.9.0 (on purpose):

- PML's default k-NN is ``FaissKNN`` (Euclidean ``IndexFlatL2``), and ``AccuracyCalculator()``
  fails without faiss; its torch alternative is ``CustomKNN(distance)``, a ``torch.topk`` whose
  order among tied values is unspecified. Here the default distance is :func:`cosine` (the
  same ranking as Euclidean on normalised embeddings) and ties are broken by reference index.
- PML removes a same-set query from its own neighbour list by searching ``k + 1`` neighbours and
  dropping the query's own index (or the last neighbour, when the query is not among them);
  here the query's own row is excluded by index before the search. Both give the same
  neighbours except for the order of exact ties.

Where the code lives: ``_knn.py`` (the search, its tie rule, the shard merge), ``_relevance.py``
(relevance from labels, a grade matrix or id lists), ``_metrics.py`` (the per-query metrics and
their reduction), ``_retrieval.py`` (the entry points that search and score in one call),
``_threshold.py`` (the verification threshold) and ``_clustering.py`` (k-means, NMI and AMI).
Every public name is re-exported here.

Example:
    >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> labels = torch.tensor([0, 0, 1, 1])
    >>> pf.evaluation.knn(emb, k=1)[0].flatten()
    tensor([1, 0, 3, 2])
    >>> s = pf.evaluation.retrieval_scores(emb, metrics=("mrr@1",), query_labels=labels)
    >>> s["mrr@1"].item()
    1.0
"""

from ._clustering import (
    KMeansResult,
    adjusted_mutual_info,
    clustering_scores,
    kmeans,
    normalized_mutual_info,
)
from ._knn import knn, merge_neighbors
from ._metrics import (
    hit_rate_at_k,
    map_at_k,
    mrr,
    ndcg,
    pml_per_query,
    precision_at_k,
    recall_at_k,
)
from ._relevance import Relevance, neighbor_relevance
from ._retrieval import cross_modal_scores, neighbor_scores, retrieval_metrics, retrieval_scores
from ._threshold import ThresholdResult, select_threshold

__all__ = [
    "KMeansResult",
    "Relevance",
    "ThresholdResult",
    "adjusted_mutual_info",
    "clustering_scores",
    "cross_modal_scores",
    "hit_rate_at_k",
    "kmeans",
    "knn",
    "map_at_k",
    "merge_neighbors",
    "mrr",
    "ndcg",
    "neighbor_relevance",
    "neighbor_scores",
    "normalized_mutual_info",
    "pml_per_query",
    "precision_at_k",
    "recall_at_k",
    "retrieval_metrics",
    "retrieval_scores",
    "select_threshold",
]
