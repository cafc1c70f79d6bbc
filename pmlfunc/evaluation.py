"""Retrieval evaluation: exact k-nearest neighbours, PML's retrieval metrics, the IR metrics
papers report (NDCG, MRR, MAP@k, recall@k, precision@k, hit rate@k), a shard merge and a
verification threshold.

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
arithmetic. :func:`merge_neighbors` merges per-shard top-k lists into the global top-k, and
:func:`select_threshold` picks the distance threshold that best separates matching pairs.

All are evaluation tools, not losses: they run under ``torch.no_grad()``, have static shapes
(shapes depend on ``Q``, ``R`` and ``k`` only) and synchronise with the host only when
``retrieval_metrics`` must choose ``k`` itself (``k=None``; see there) and, in eager mode on
CPU, to check index ranges.

Differences from PML 2.9.0 (on purpose):

- PML's default k-NN is ``FaissKNN`` (Euclidean ``IndexFlatL2``), and ``AccuracyCalculator()``
  fails without faiss; its torch alternative is ``CustomKNN(distance)``, a ``torch.topk`` whose
  order among tied values is unspecified. Here the default distance is :func:`cosine` (the
  same ranking as Euclidean on normalised embeddings) and ties are broken by reference index.
- PML removes a same-set query from its own neighbour list by searching ``k + 1`` neighbours and
  dropping the query's own index (or the last neighbour, when the query is not among them);
  here the query's own row is excluded by index before the search. Both give the same
  neighbours except for the order of exact ties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _checks
from .distances import Distance, cosine, resolve

__all__ = [
    "Relevance",
    "ThresholdResult",
    "cross_modal_scores",
    "hit_rate_at_k",
    "knn",
    "map_at_k",
    "merge_neighbors",
    "mrr",
    "ndcg",
    "neighbor_relevance",
    "neighbor_scores",
    "precision_at_k",
    "recall_at_k",
    "retrieval_metrics",
    "retrieval_scores",
    "select_threshold",
]


def _resolve_sets(
    query: Tensor, reference: Tensor | None, exclude_self: bool | None
) -> tuple[Tensor, bool]:
    """The reference matrix and whether query ``i`` excludes reference row ``i``."""
    _checks.embeddings(query, "query")
    if reference is None:
        if exclude_self is False:
            raise ValueError(
                "exclude_self=False needs a reference; reference=None always excludes each "
                "query from its own neighbours"
            )
        return query, True
    _checks.embeddings(reference, "reference")
    _checks.same_space(query, reference, "reference", "query")
    exclude = bool(exclude_self) if exclude_self is not None else False
    if exclude and reference.shape[0] < query.shape[0]:
        raise ValueError(
            f"exclude_self=True means query i is reference row i, so reference needs at least "
            f"{query.shape[0]} rows (one per query), got {reference.shape[0]}"
        )
    return reference, exclude


def _knn_chunk(
    mat: Tensor, start: int, k: int, is_similarity: bool, exclude_self: bool
) -> tuple[Tensor, Tensor]:
    """Exact, deterministic top-``k`` of one ``(C, R)`` block of the query × reference matrix.

    Ranks by closeness (similarity, or minus the distance; NaN and a query's own row count as
    farthest), and among equal closeness by reference index. ``torch.topk`` alone does not fix
    which of several entries tied at the k-th place it keeps, nor their order, so: ``topk`` gives
    the k-th best closeness ``t`` and every entry strictly closer than ``t`` (always all of them);
    a second ``topk`` over the distinct keys ``(R - j)·1[closeness_j = t]`` gives the
    lowest-indexed entries equal to ``t``; the first ``k - #closer`` of those fill the list, which
    is then sorted by index and stable-sorted by closeness (both ``C × k``). Static shapes only.
    """
    n_rows, n_cols = mat.shape
    closeness = mat if is_similarity else -mat
    drop = closeness.isnan()
    cols = torch.arange(n_cols, device=mat.device)
    own = None
    if exclude_self:
        rows = torch.arange(start, start + n_rows, device=mat.device)
        own = cols.unsqueeze(0) == rows.unsqueeze(1)
        drop = drop | own
    closeness = closeness.masked_fill(drop, float("-inf"))
    top_val, top_idx = closeness.topk(k, dim=1, largest=True, sorted=True)
    kth = top_val[:, -1:]
    closer = top_val > kth  # (C, k): always the complete set of strictly closer entries
    tied = closeness == kth
    if own is not None:
        tied = tied & ~own
    # Distinct keys R - j on the tied entries (exact in float32 below 2**24 columns).
    key_dtype = torch.float32 if n_cols < 2**24 else torch.float64
    tie_key = tied.to(key_dtype) * (n_cols - cols).to(key_dtype)
    tie_idx = tie_key.topk(k, dim=1, largest=True, sorted=True).indices  # ascending index
    need = k - closer.sum(1, keepdim=True)
    slots = torch.arange(k, device=mat.device)
    keep = torch.cat([closer, slots.unsqueeze(0) < need], dim=1)  # (C, 2k), k of them True
    cand = torch.cat([top_idx, tie_idx], dim=1)
    pos = torch.arange(2 * k, 0, -1, device=mat.device)
    pick = (keep * pos).topk(k, dim=1, largest=True, sorted=True).indices
    idx = cand.gather(1, pick).sort(dim=1).values  # the k neighbours, ascending index
    perm = closeness.gather(1, idx).sort(dim=1, descending=True, stable=True).indices
    idx = idx.gather(1, perm)
    return idx, mat.gather(1, idx)


def knn(
    query: Tensor,
    reference: Tensor | None = None,
    *,
    k: int,
    distance: Distance | None = None,
    chunk_size: int = 1024,
    exclude_self: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact k-nearest neighbours of each query row among the reference rows, in query chunks.

    For query ``q_i`` the neighbours are the ``k`` reference rows ``r_j`` with the smallest
    distance ``d(q_i, r_j)`` (the largest similarity when ``distance.is_similarity``), sorted
    nearest first. Exact ties are broken by the smaller reference index ``j`` (a deterministic
    rule; PML's ``CustomKNN`` uses ``torch.topk``, whose tie order is unspecified). NaN entries
    rank as the farthest.

    Memory: queries are processed in blocks of ``chunk_size``; only a ``chunk_size × R`` block of
    the distance matrix (plus a few masks of that size) lives at once. The neighbours do not
    depend on ``chunk_size`` (barring distances within float32 rounding of each other); the
    values agree to rounding, since the matmul's blocking follows the block's shape.

    Args:
        query: ``(Q, D)`` floating-point embeddings.
        reference: ``(R, D)`` embeddings to search, same dtype/device as ``query``. ``None``
            searches ``query`` itself and excludes each query's own row (by index, not by value:
            an exact duplicate of a query is still a neighbour).
        k: number of neighbours, ``1 <= k <= R`` (``<= R - 1`` when a query's own row is excluded).
        distance: a :mod:`pmlfunc.distances` object; default :func:`~pmlfunc.distances.cosine`.
        chunk_size: queries per block.
        exclude_self: exclude reference row ``i`` from query ``i``'s neighbours (PML's
            ``ref_includes_query``: the reference starts with the queries). Default: ``True``
            when ``reference is None``, else ``False``.

    Returns:
        ``(indices, values)``: ``(Q, k)`` int64 reference indices and the ``(Q, k)`` distances
        (similarities) to them, nearest first, in the distance's compute dtype (float32 for
        float16/bfloat16 inputs).

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
        >>> knn(x, k=1)[0]
        tensor([[1],
                [0],
                [1]])
    """
    reference, exclude = _resolve_sets(query, reference, exclude_self)
    k = _checks.integer(k, "k")
    chunk_size = _checks.integer(chunk_size, "chunk_size")
    dist = resolve(distance, cosine())
    available = reference.shape[0] - int(exclude)
    if k > available:
        raise ValueError(
            f"k={k} exceeds the {available} reference rows available to each query"
            + (" (its own row excluded)" if exclude else "")
        )
    indices, values = [], []
    with torch.no_grad():
        for start in range(0, query.shape[0], chunk_size):
            block = query[start : start + chunk_size]
            mat = dist.matrix(block, reference)
            idx, val = _knn_chunk(mat, start, k, dist.is_similarity, exclude)
            indices.append(idx)
            values.append(val)
    return torch.cat(indices), torch.cat(values)


def _relevant_counts(
    query_labels: Tensor, reference_labels: Tensor, exclude: bool, chunk_size: int
) -> Tensor:
    """``R_i``: reference rows with query ``i``'s label, its own row excluded (chunked)."""
    counts = [
        (block.unsqueeze(1) == reference_labels.unsqueeze(0)).sum(1)
        for block in query_labels.split(chunk_size)
    ]
    count = torch.cat(counts)
    if exclude:
        q = query_labels.shape[0]
        count = count - (reference_labels[:q] == query_labels).long()
    return count


def retrieval_metrics(
    query: Tensor,
    query_labels: Tensor,
    reference: Tensor | None = None,
    reference_labels: Tensor | None = None,
    *,
    distance: Distance | None = None,
    k: int | None = None,
    recall_ks: Sequence[int] = (1,),
    chunk_size: int = 1024,
    exclude_self: bool | None = None,
) -> dict[str, Tensor]:
    """Precision@1, R-precision, MAP@R and recall@k of a k-NN retrieval, as PML 2.9.0 computes them.

    For query ``i`` let ``R_i`` be the number of reference rows with its label (its own row not
    counted when excluded), ``n_i(1), …, n_i(k)`` its nearest neighbours (:func:`knn`) and
    ``rel_i(j) = 1[label(n_i(j)) = label(q_i)]``. With ``P_i(j) = (1/j) Σ_{m≤j} rel_i(m)``::

        precision_at_1_i              = rel_i(1)
        r_precision_i                 = (1 / min(R_i, k)) Σ_{j ≤ min(R_i, k)} rel_i(j)
        mean_average_precision_at_r_i = (1 / R_i) Σ_{j ≤ min(R_i, k)} rel_i(j) · P_i(j)
        recall_at_K_i                 = max_{j ≤ K} rel_i(j)           (K in recall_ks)

    Each metric is the mean over the queries with ``R_i > 0``: like PML, queries whose label has
    no other reference row ("lone" queries) are left out of every average, and a metric is NaN
    when every query is lone. With ``k >= max_i R_i`` (the default) R-precision and MAP@R are
    exact; a smaller ``k`` truncates them exactly as PML does (it warns; this does not).
    ``recall_at_1`` equals ``precision_at_1``.

    Host synchronisation: ``k=None`` uses ``k = max(max_i R_i, max(recall_ks), 1)``, capped at
    the rows available to a query (PML's
    ``k="max_bin_count"``, which gives the same metrics as its default ``k=None``, all references),
    and reading ``max_i R_i`` is one host sync, done eagerly. Pass ``k`` to avoid it.

    Args:
        query: ``(Q, D)`` floating-point embeddings.
        query_labels: ``(Q,)`` integer labels.
        reference: ``(R, D)`` embeddings to retrieve from; ``None`` retrieves from ``query`` itself
            and excludes each query's own row (PML's ``get_accuracy(query, labels)``).
        reference_labels: ``(R,)`` integer labels; required with ``reference``.
        distance: a :mod:`pmlfunc.distances` object; default :func:`~pmlfunc.distances.cosine`.
        k: neighbours to retrieve (see above); ``None`` chooses it from the labels.
        recall_ks: the ``K`` of each ``recall_at_K`` key; each ``<= k``.
        chunk_size: queries per block (memory ``O(chunk_size · R)``); see :func:`knn`.
        exclude_self: query ``i`` excludes reference row ``i`` (PML's ``ref_includes_query=True``,
            the reference starts with the queries). Default: ``reference is None``.

    Returns:
        ``{"precision_at_1", "r_precision", "mean_average_precision_at_r", "recall_at_K"...}``,
        float64 0-d tensors on the embeddings' device.

    Example:
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> m = retrieval_metrics(emb, torch.tensor([0, 0, 1, 1]), recall_ks=(1, 2))
        >>> {name: value.item() for name, value in m.items()}["mean_average_precision_at_r"]
        1.0

    Reference:
        Musgrave, Belongie and Lim, "A Metric Learning Reality Check", ECCV 2020 (MAP@R).
    """
    separate = reference is not None
    reference, exclude = _resolve_sets(query, reference, exclude_self)
    device = query.device
    query_labels = _checks.labels(query_labels, query.shape[0], device, "query_labels", "query")
    if not separate:
        if reference_labels is not None:
            raise ValueError("reference_labels was given without reference")
        reference_labels = query_labels
    elif reference_labels is None:
        raise ValueError("reference_labels is required when reference is given")
    else:
        reference_labels = _checks.labels(
            reference_labels, reference.shape[0], device, "reference_labels", "reference"
        )
    if isinstance(recall_ks, (str, bytes)) or not isinstance(recall_ks, Sequence):
        raise TypeError(f"recall_ks must be a sequence of positive ints, got {recall_ks!r}")
    recall_ks = tuple(_checks.integer(kk, "recall_ks") for kk in recall_ks)
    chunk_size = _checks.integer(chunk_size, "chunk_size")
    dist = resolve(distance, cosine())
    available = reference.shape[0] - int(exclude)
    if available < 1:
        raise ValueError("reference has no row to retrieve (its only row is the query itself)")

    with torch.no_grad():
        r = _relevant_counts(query_labels, reference_labels, exclude, chunk_size)  # (Q,)
        if k is None:
            needed = max(recall_ks, default=1)
            k = min(max(int(r.max()), needed, 1), available)  # the one host sync
        k = _checks.integer(k, "k")
        if recall_ks and max(recall_ks) > k:
            raise ValueError(f"recall_ks={recall_ks} has a value above k={k}")
        if k > available:
            raise ValueError(
                f"k={k} exceeds the {available} reference rows available to each query"
            )
        idx, _ = knn(
            query, reference, k=k, distance=dist, chunk_size=chunk_size, exclude_self=exclude
        )
        rel = reference_labels[idx] == query_labels.unsqueeze(1)  # (Q, k)
        ranks = torch.arange(1, k + 1, device=device)
        relevant = ranks.unsqueeze(0) <= r.unsqueeze(1)  # first min(R_i, k) positions
        hits = rel & relevant
        n_hits = hits.sum(1).double()
        r64 = r.double()
        cum = hits.cumsum(1).double()
        ap = (cum * hits / ranks.double()).sum(1) / r64.clamp_min(1)
        per_query = {
            "precision_at_1": rel[:, 0].double(),
            "r_precision": n_hits / r64.clamp(min=1, max=k),
            "mean_average_precision_at_r": ap,
        }
        for kk in recall_ks:
            per_query[f"recall_at_{kk}"] = rel[:, :kk].any(1).double()
        valid = (r > 0).double()
        n_valid = valid.sum()  # 0 when every query is lone: 0 / 0 = NaN, as in PML
        return {name: (v * valid).sum() / n_valid for name, v in per_query.items()}


# ----------------------------------------------------------------------------------------------
# IR metrics: the per-query arithmetic
# ----------------------------------------------------------------------------------------------
def _ranked(retrieved: object, k: int | None, name: str = "retrieved") -> tuple[Tensor, int]:
    """The first ``k`` columns of a ``(Q, K)`` relevance-of-neighbours matrix, as float64."""
    if not isinstance(retrieved, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(retrieved).__name__}")
    if retrieved.ndim != 2 or retrieved.shape[1] == 0:
        raise ValueError(
            f"{name} must be 2-D of shape (num_queries, num_neighbors >= 1), "
            f"got shape {tuple(retrieved.shape)}"
        )
    width = retrieved.shape[1]
    k = width if k is None else _checks.integer(k, "k")
    if k > width:
        raise ValueError(f"k={k} exceeds the {width} neighbours in {name}")
    return retrieved[:, :k].to(torch.float64), k


def _per_query(values: object, num_queries: int, name: str) -> Tensor:
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.shape != (num_queries,):
        raise ValueError(
            f"{name} must have shape ({num_queries},) (one value per query), "
            f"got shape {tuple(values.shape)}"
        )
    return values.to(torch.float64)


def _ranks(k: int, device: torch.device) -> Tensor:
    return torch.arange(1, k + 1, device=device, dtype=torch.float64)


def precision_at_k(retrieved: Tensor, *, k: int | None = None) -> Tensor:
    """Per-query precision@k: the fraction of the first ``k`` neighbours that are relevant.

    ``precision@k_i = (1/k) Σ_{j≤k} 1[g_i(j) > 0]`` with ``g_i(j)`` the relevance grade of
    query ``i``'s ``j``-th neighbour (trec_eval's ``P_k``: always divided by ``k``, also when the
    query has fewer than ``k`` relevant items).

    Args:
        retrieved: ``(Q, K)`` relevance grades of each query's ranked neighbours (bool, int or
            float; relevant means ``> 0``), e.g. :attr:`Relevance.retrieved`.
        k: cut-off, ``1 <= k <= K``; default ``K``.

    Returns:
        ``(Q,)`` float64.

    Example:
        >>> precision_at_k(torch.tensor([[1, 0, 1], [0, 0, 0]]), k=2)
        tensor([0.5000, 0.0000], dtype=torch.float64)
    """
    top, k = _ranked(retrieved, k)
    return (top > 0).to(torch.float64).sum(1) / k


def hit_rate_at_k(retrieved: Tensor, *, k: int | None = None) -> Tensor:
    """Per-query hit rate@k: 1 when any of the first ``k`` neighbours is relevant, else 0.

    ``hit_rate@k_i = max_{j≤k} 1[g_i(j) > 0]``: PML's ``recall_at_k`` (``retrieval_metrics``)
    and the "R@K" of cross-modal retrieval papers (image→text: at least one of the image's
    captions among the first ``K`` texts).

    Args:
        retrieved: ``(Q, K)`` relevance grades of the ranked neighbours (relevant: ``> 0``).
        k: cut-off, ``1 <= k <= K``; default ``K``.

    Returns:
        ``(Q,)`` float64.

    Example:
        >>> hit_rate_at_k(torch.tensor([[0, 0, 1], [0, 1, 0]]), k=2)
        tensor([0., 1.], dtype=torch.float64)
    """
    top, _ = _ranked(retrieved, k)
    return (top > 0).any(1).to(torch.float64)


def recall_at_k(retrieved: Tensor, num_relevant: Tensor, *, k: int | None = None) -> Tensor:
    """Per-query recall@k: the fraction of the query's relevant items among its first ``k``.

    ``recall@k_i = Σ_{j≤k} 1[g_i(j) > 0] / n_i`` with ``n_i`` the number of relevant reference
    items of query ``i`` (all of them, not just those retrieved; trec_eval's ``recall_k``). NaN
    (0/0) for a query with ``n_i = 0``. Not PML's ``recall_at_k``, which is
    :func:`hit_rate_at_k`; the two agree when every query has one relevant item.

    Args:
        retrieved: ``(Q, K)`` relevance grades of the ranked neighbours (relevant: ``> 0``).
        num_relevant: ``(Q,)`` number of relevant reference items of each query.
        k: cut-off, ``1 <= k <= K``; default ``K``.

    Returns:
        ``(Q,)`` float64.

    Example:
        >>> recall_at_k(torch.tensor([[1, 0, 1], [0, 1, 0]]), torch.tensor([4, 1]), k=3)
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """
    top, _ = _ranked(retrieved, k)
    n = _per_query(num_relevant, top.shape[0], "num_relevant")
    return (top > 0).to(torch.float64).sum(1) / n


def mrr(retrieved: Tensor, *, k: int | None = None) -> Tensor:
    """Per-query reciprocal rank@k: ``1 / rank`` of the first relevant neighbour, 0 when none
    of the first ``k`` is relevant.

    ``rr@k_i = max_{j≤k} 1[g_i(j) > 0] / j``; its mean over queries is MRR@k.

    Args:
        retrieved: ``(Q, K)`` relevance grades of the ranked neighbours (relevant: ``> 0``).
        k: cut-off, ``1 <= k <= K``; default ``K``.

    Returns:
        ``(Q,)`` float64.

    Example:
        >>> mrr(torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]]))
        tensor([0.5000, 0.0000, 1.0000], dtype=torch.float64)

    Reference: Voorhees, "The TREC-8 Question Answering Track Report", TREC 1999.
    """
    top, k = _ranked(retrieved, k)
    return ((top > 0).to(torch.float64) / _ranks(k, top.device)).amax(1)


def map_at_k(retrieved: Tensor, num_relevant: Tensor, *, k: int | None = None) -> Tensor:
    """Per-query average precision@k (its mean over queries is MAP@k).

    ``AP@k_i = (1 / min(n_i, k)) Σ_{j≤k} 1[g_i(j) > 0] · P_i(j)`` with ``P_i(j)`` the precision
    at ``j`` and ``n_i`` the query's number of relevant reference items. Dividing by
    ``min(n_i, k)`` makes a perfect ranking score 1 at every ``k``; trec_eval's ``map_cut_k``
    divides by ``n_i`` instead (its value is ours times ``min(n_i, k) / n_i``), and PML's MAP@R
    (:func:`retrieval_metrics`) stops each query at ``j ≤ n_i``. For ``k ≥ n_i`` it is the
    query's full average precision. NaN (0/0) for a query with ``n_i = 0``.

    Args:
        retrieved: ``(Q, K)`` relevance grades of the ranked neighbours (relevant: ``> 0``).
        num_relevant: ``(Q,)`` number of relevant reference items of each query.
        k: cut-off, ``1 <= k <= K``; default ``K``.

    Returns:
        ``(Q,)`` float64.

    Example:
        >>> map_at_k(torch.tensor([[1, 0, 1], [0, 1, 0]]), torch.tensor([2, 3]))
        tensor([0.8333, 0.1667], dtype=torch.float64)
    """
    top, k = _ranked(retrieved, k)
    n = _per_query(num_relevant, top.shape[0], "num_relevant")
    rel = (top > 0).to(torch.float64)
    precision = rel.cumsum(1) / _ranks(k, top.device)
    return (precision * rel).sum(1) / n.clamp(max=k)


def ndcg(retrieved: Tensor, ideal: Tensor, *, k: int | None = None) -> Tensor:
    """Per-query normalised discounted cumulative gain@k.

    ``DCG@k_i = Σ_{j≤k} g_i(j) / log2(j + 1)`` with linear gains (the relevance grade itself,
    as scikit-learn's ``ndcg_score``), and ``NDCG@k_i = DCG@k_i / IDCG@k_i`` where ``IDCG@k_i``
    is the DCG of the query's ``k`` largest grades over its whole relevance (not only the
    retrieved items), given as ``ideal``. NaN (0/0) for a query without a relevant item
    (scikit-learn scores such a query 0).

    Args:
        retrieved: ``(Q, K)`` relevance grades of the ranked neighbours (non-negative).
        ideal: ``(Q, K')`` with ``K' >= k``: each query's largest grades in descending order,
            zero-padded (:attr:`Relevance.ideal`).
        k: cut-off, ``1 <= k <= K``; default ``K``.

    Returns:
        ``(Q,)`` float64.

    Example:
        >>> got = torch.tensor([[0.0, 2.0, 1.0]])
        >>> best = torch.tensor([[2.0, 1.0, 0.0]])
        >>> round(ndcg(got, best).item(), 4)
        0.6697

    Reference: Järvelin and Kekäläinen, "Cumulated gain-based evaluation of IR techniques",
    ACM TOIS 2002.
    """
    top, k = _ranked(retrieved, k)
    best, _ = _ranked(ideal, k, "ideal")
    if best.shape[0] != top.shape[0]:
        raise ValueError(
            f"ideal has {best.shape[0]} rows but retrieved has {top.shape[0]} (one per query)"
        )
    discount = 1.0 / torch.log2(_ranks(k, top.device) + 1.0)
    return (top * discount).sum(1) / (best * discount).sum(1)


_METRIC_NAMES = ("ndcg", "mrr", "map", "recall", "precision", "hit_rate")


def _metric_value(name: str, rel: Relevance, k: int) -> Tensor:
    if name == "ndcg":
        return ndcg(rel.retrieved, rel.ideal, k=k)
    if name == "mrr":
        return mrr(rel.retrieved, k=k)
    if name == "map":
        return map_at_k(rel.retrieved, rel.num_relevant, k=k)
    if name == "recall":
        return recall_at_k(rel.retrieved, rel.num_relevant, k=k)
    if name == "precision":
        return precision_at_k(rel.retrieved, k=k)
    return hit_rate_at_k(rel.retrieved, k=k)


def _parse_metrics(metrics: object) -> list[tuple[str, str, int]]:
    """``"name@k"`` strings → ``(key, name, k)``; ``ValueError``/``TypeError`` naming ``metrics``."""
    if isinstance(metrics, (str, bytes)) or not isinstance(metrics, Sequence):
        raise TypeError(
            f"metrics must be a sequence of 'name@k' strings (e.g. ('ndcg@10', 'mrr@10')), "
            f"got {metrics!r}"
        )
    if len(metrics) == 0:
        raise ValueError("metrics is empty; name at least one 'name@k' metric")
    parsed = []
    for spec in metrics:
        if not isinstance(spec, str):
            raise TypeError(f"metrics must hold 'name@k' strings, got {spec!r}")
        name, sep, kk = spec.partition("@")
        if name not in _METRIC_NAMES or not sep or not kk.isdigit() or int(kk) < 1:
            raise ValueError(
                f"metrics: {spec!r} is not 'name@k' with name in {_METRIC_NAMES} and an int k >= 1"
            )
        parsed.append((spec, name, int(kk)))
    return parsed


def _reduction(reduction: object) -> str:
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return str(reduction)


# ----------------------------------------------------------------------------------------------
# relevance of given neighbours
# ----------------------------------------------------------------------------------------------
class Relevance(NamedTuple):
    """The relevance of each query's ranked neighbours (from :func:`neighbor_relevance`)."""

    retrieved: Tensor
    """``(Q, K)`` float64: the relevance grade of each query's ``j``-th neighbour."""
    num_relevant: Tensor
    """``(Q,)`` int64: how many reference items are relevant (grade ``> 0``) to each query."""
    ideal: Tensor
    """``(Q, K)`` float64: each query's ``K`` largest grades, descending, zero-padded."""


def _int_tensor(t: object, name: str, ndim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


class _Source(NamedTuple):
    """A validated relevance source: exactly one of the three kinds is set."""

    query_labels: Tensor | None
    reference_labels: Tensor | None
    relevance: Tensor | None
    relevant_ids: Tensor | None
    relevant_grades: Tensor | None
    num_references: int
    exclude: bool


def _source(
    num_queries: int,
    device: torch.device,
    *,
    query_labels: object,
    reference_labels: object,
    relevance: object,
    relevant_ids: object,
    relevant_grades: object,
    num_references: int | None,
    exclude_self: bool | None,
    query_name: str = "indices",
) -> _Source:
    """Check the relevance arguments (shapes, dtypes, devices; never values)."""
    given = [
        name
        for name, value in (
            ("query_labels", query_labels),
            ("relevance", relevance),
            ("relevant_ids", relevant_ids),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give exactly one relevance source: query_labels (with reference_labels, or alone "
            "for a same-set search), relevance (a (Q, R) matrix) or relevant_ids (padded ids), "
            f"got {given or 'none'}"
        )
    if reference_labels is not None and query_labels is None:
        raise ValueError("reference_labels was given without query_labels")
    if relevant_grades is not None and relevant_ids is None:
        raise ValueError("relevant_grades was given without relevant_ids")
    ql = rl = dense = ids = grades = None
    if query_labels is not None:
        ql = _checks.labels(query_labels, num_queries, device, "query_labels", query_name)
        if reference_labels is None:
            if num_references is not None and num_references != num_queries:
                raise ValueError(
                    "reference_labels is required when the reference is not the query set "
                    f"({num_references} reference rows, {num_queries} queries)"
                )
            if exclude_self is False:
                raise ValueError(
                    "exclude_self=False needs reference_labels; without them the reference is "
                    "the query set and each query is excluded from its own neighbours"
                )
            rl, n_ref, default_exclude = ql, num_queries, True
        else:
            if not isinstance(reference_labels, Tensor):
                raise TypeError(
                    f"reference_labels must be a torch.Tensor, got {type(reference_labels).__name__}"
                )
            n_ref = reference_labels.shape[0] if reference_labels.ndim == 1 else -1
            if num_references is not None:
                n_ref = num_references
            rl = _checks.labels(reference_labels, n_ref, device, "reference_labels", "reference")
            default_exclude = False
    elif relevance is not None:
        if not isinstance(relevance, Tensor):
            raise TypeError(f"relevance must be a torch.Tensor, got {type(relevance).__name__}")
        if relevance.dtype.is_complex:
            raise TypeError(f"relevance must be real (bool, int or float), got {relevance.dtype}")
        n_ref = relevance.shape[1] if relevance.ndim == 2 else -1
        if num_references is not None:
            n_ref = num_references
        if relevance.shape != (num_queries, n_ref):
            raise ValueError(
                f"relevance must have shape ({num_queries}, {n_ref}) (queries × reference rows), "
                f"got {tuple(relevance.shape)}"
            )
        if relevance.device != device:
            raise ValueError(f"relevance is on {relevance.device} but {query_name} is on {device}")
        dense, default_exclude = relevance, False
    else:
        ids = _int_tensor(relevant_ids, "relevant_ids", 2)
        if ids.shape[0] != num_queries or ids.shape[1] == 0:
            raise ValueError(
                f"relevant_ids must have shape ({num_queries}, M) with M >= 1 (one row of "
                f"reference ids per query, -1 padded), got {tuple(ids.shape)}"
            )
        if ids.device != device:
            raise ValueError(f"relevant_ids is on {ids.device} but {query_name} is on {device}")
        if num_references is None:
            raise ValueError("relevant_ids needs num_references (the number of reference rows)")
        n_ref = num_references
        if relevant_grades is not None:
            if not isinstance(relevant_grades, Tensor):
                raise TypeError(
                    f"relevant_grades must be a torch.Tensor, got {type(relevant_grades).__name__}"
                )
            if relevant_grades.shape != ids.shape:
                raise ValueError(
                    f"relevant_grades must have relevant_ids' shape {tuple(ids.shape)}, "
                    f"got {tuple(relevant_grades.shape)}"
                )
            if relevant_grades.device != device:
                raise ValueError(
                    f"relevant_grades is on {relevant_grades.device} but {query_name} is on {device}"
                )
            grades = relevant_grades
        default_exclude = False
    exclude = default_exclude if exclude_self is None else bool(exclude_self)
    if exclude and n_ref < num_queries:
        raise ValueError(
            f"exclude_self=True means query i is reference row i, so the reference needs at "
            f"least {num_queries} rows (one per query), got {n_ref}"
        )
    return _Source(ql, rl, dense, ids, grades, n_ref, exclude)


def _gather_relevance(indices: Tensor, src: _Source, chunk_size: int) -> Relevance:
    """The relevance of ranked neighbours; ``Q × k`` work except the label counts (chunked)."""
    n_queries, k = indices.shape
    device = indices.device
    own = None
    if src.exclude:
        own = indices == torch.arange(n_queries, device=device).unsqueeze(1)
    if src.query_labels is not None:
        assert src.reference_labels is not None
        hit = src.reference_labels[indices] == src.query_labels.unsqueeze(1)
        retrieved = hit.to(torch.float64)
        n_rel = _relevant_counts(src.query_labels, src.reference_labels, src.exclude, chunk_size)
        slots = torch.arange(k, device=device)
        ideal = (slots.unsqueeze(0) < n_rel.unsqueeze(1)).to(torch.float64)
    elif src.relevance is not None:
        dense = src.relevance
        if dense.dtype == torch.bool:
            dense = dense.to(torch.uint8)
        if src.exclude:  # the own entries are not relevant (a copy: the input is Q × R anyway)
            diag = torch.arange(n_queries, device=device).unsqueeze(1)
            dense = dense.scatter(1, diag, torch.zeros_like(dense[:, :1]))
        retrieved = dense.gather(1, indices).to(torch.float64)
        n_rel = (dense > 0).sum(1)
        ideal = dense.topk(k, dim=1, largest=True, sorted=True).values.to(torch.float64)
    else:
        assert src.relevant_ids is not None
        ids = src.relevant_ids.to(torch.int64)
        width = ids.shape[1]
        valid = ids >= 0
        if src.exclude:
            valid = valid & (ids != torch.arange(n_queries, device=device).unsqueeze(1))
        if src.relevant_grades is None:
            grades = valid.to(torch.float64)
        else:
            grades = torch.where(valid, src.relevant_grades.to(torch.float64), 0.0)
        # Sorted ids per query, then a binary search for each neighbour: O(Q·(M + k)), no Q × R.
        sorted_ids, order = ids.sort(1)
        sorted_grades = grades.gather(1, order)
        pos = torch.searchsorted(sorted_ids, indices.contiguous()).clamp_max(width - 1)
        found = sorted_ids.gather(1, pos) == indices
        retrieved = torch.where(found, sorted_grades.gather(1, pos), 0.0)
        n_rel = (grades > 0).sum(1)
        top = grades.topk(min(k, width), dim=1, largest=True, sorted=True).values
        ideal = torch.nn.functional.pad(top, (0, k - top.shape[1]))
    if own is not None:
        retrieved = retrieved.masked_fill(own, 0.0)
    return Relevance(retrieved, n_rel, ideal)


def _check_indices(indices: object) -> Tensor:
    if not isinstance(indices, Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be an int64 (or int32) tensor, got {indices.dtype}")
    if indices.ndim != 2 or indices.shape[0] == 0 or indices.shape[1] == 0:
        raise ValueError(
            f"indices must be 2-D of shape (num_queries >= 1, k >= 1), got {tuple(indices.shape)}"
        )
    return indices.to(torch.int64)


def neighbor_relevance(
    indices: Tensor,
    *,
    query_labels: Tensor | None = None,
    reference_labels: Tensor | None = None,
    relevance: Tensor | None = None,
    relevant_ids: Tensor | None = None,
    relevant_grades: Tensor | None = None,
    num_references: int | None = None,
    exclude_self: bool | None = None,
    chunk_size: int = 1024,
) -> Relevance:
    """The relevance of each query's ranked neighbours, from one of three sources.

    Relevance is a grade per (query, reference row); an item is relevant when its grade is
    ``> 0``. Give exactly one source:

    - labels: ``query_labels`` ``(Q,)`` and ``reference_labels`` ``(R,)``; grade
      ``1[label equal]``. Without ``reference_labels`` the reference is the query set
      (``R = Q``) and each query's own row is excluded.
    - ``relevance``: a dense ``(Q, R)`` matrix of grades (bool, int or float, non-negative).
    - ``relevant_ids``: ``(Q, M)`` reference ids per query, ``-1`` for padding (distinct ids
      within a row), with optional ``relevant_grades`` ``(Q, M)`` (default: grade 1); needs
      ``num_references``.

    With ``exclude_self`` query ``i``'s own row ``i`` is not relevant (it is not counted in
    ``num_relevant`` nor in ``ideal``, and scores 0 if it appears in ``indices``): PML's
    ``ref_includes_query``, the reference starting with the queries.

    No ``Q × R`` tensor is built for labels (the relevant counts compare ``chunk_size`` queries
    at a time) or for id lists (a sort per query and a binary search per neighbour). Static
    shapes; it runs under ``torch.compile(fullgraph=True)`` and on ``device="meta"``.

    Args:
        indices: ``(Q, K)`` ranked reference indices, nearest first (:func:`knn`,
            :func:`merge_neighbors` or any other search), each in ``[0, R)``.
        query_labels: ``(Q,)`` integer labels.
        reference_labels: ``(R,)`` integer labels.
        relevance: ``(Q, R)`` relevance grades.
        relevant_ids: ``(Q, M)`` integer reference ids, ``-1`` padded, each in ``[-1, R)``.
        relevant_grades: ``(Q, M)`` grades of ``relevant_ids``.
        num_references: ``R``; required with ``relevant_ids``.
        exclude_self: query ``i`` is reference row ``i`` and is not its own relevant item.
            Default: ``True`` for labels without ``reference_labels``, else ``False``.
        chunk_size: queries per block when counting label matches.

    Returns:
        A :class:`Relevance` ``(retrieved, num_relevant, ideal)``.

    Raises:
        IndexError: an index or id out of range (eager on CPU; a device-side assert elsewhere).

    Example:
        >>> rel = neighbor_relevance(
        ...     torch.tensor([[2, 0], [1, 2]]),
        ...     relevant_ids=torch.tensor([[0, 2, -1], [0, -1, -1]]),
        ...     relevant_grades=torch.tensor([[3.0, 1.0, 0.0], [2.0, 0.0, 0.0]]),
        ...     num_references=3,
        ... )
        >>> rel.retrieved
        tensor([[1., 3.],
                [0., 0.]], dtype=torch.float64)
        >>> rel.num_relevant, rel.ideal[0]
        (tensor([2, 1]), tensor([3., 1.], dtype=torch.float64))
    """
    idx = _check_indices(indices)
    chunk_size = _checks.integer(chunk_size, "chunk_size")
    src = _source(
        idx.shape[0],
        idx.device,
        query_labels=query_labels,
        reference_labels=reference_labels,
        relevance=relevance,
        relevant_ids=relevant_ids,
        relevant_grades=relevant_grades,
        num_references=num_references,
        exclude_self=exclude_self,
    )
    if idx.shape[1] > src.num_references:
        raise ValueError(
            f"indices has {idx.shape[1]} neighbours per query but there are only "
            f"{src.num_references} reference rows"
        )
    _checks.in_range(idx, 0, src.num_references, "indices")
    if src.relevant_ids is not None:
        _checks.in_range(src.relevant_ids, -1, src.num_references, "relevant_ids")
    with torch.no_grad():
        return _gather_relevance(idx, src, chunk_size)


def _scores(
    rel: Relevance, parsed: list[tuple[str, str, int]], reduction: str
) -> dict[str, Tensor]:
    """Every requested metric; queries without a relevant item left out (NaN per query)."""
    valid = rel.num_relevant > 0
    out = {}
    for key, name, k in parsed:
        value = _metric_value(name, rel, k)
        if reduction == "none":
            out[key] = value.masked_fill(~valid, math.nan)
        else:
            out[key] = torch.where(valid, value, 0.0).sum() / valid.sum()
    return out


def neighbor_scores(
    indices: Tensor,
    *,
    metrics: Sequence[str] = ("ndcg@10", "mrr@10", "map@10", "recall@10", "precision@10"),
    query_labels: Tensor | None = None,
    reference_labels: Tensor | None = None,
    relevance: Tensor | None = None,
    relevant_ids: Tensor | None = None,
    relevant_grades: Tensor | None = None,
    num_references: int | None = None,
    exclude_self: bool | None = None,
    reduction: str = "mean",
    chunk_size: int = 1024,
) -> dict[str, Tensor]:
    """Retrieval metrics of given ranked neighbours (:func:`retrieval_scores` without the search).

    For neighbours found elsewhere: :func:`merge_neighbors` over reference shards, a faiss
    index, or a compiled search. The relevance arguments are :func:`neighbor_relevance`'s; the
    metrics and the treatment of queries without a relevant item are :func:`retrieval_scores`'.

    Args:
        indices: ``(Q, K)`` ranked reference indices, nearest first; ``K >= max k``.
        metrics: ``"name@k"`` strings, name in ``ndcg``, ``mrr``, ``map``, ``recall``,
            ``precision``, ``hit_rate``.
        query_labels, reference_labels, relevance: see :func:`neighbor_relevance`.
        relevant_ids, relevant_grades, num_references: see :func:`neighbor_relevance`.
        exclude_self, chunk_size: see :func:`neighbor_relevance`.
        reduction: ``"mean"`` (0-d tensors) or ``"none"`` (``(Q,)`` per-query values, NaN for
            queries without a relevant item).

    Returns:
        ``{metric: value}`` in the order of ``metrics``, float64 on ``indices``' device.

    Example:
        >>> idx = torch.tensor([[1, 2], [0, 2], [1, 0]])
        >>> s = neighbor_scores(idx, metrics=("mrr@2", "recall@1"), query_labels=torch.tensor([0, 0, 1]))
        >>> {name: round(v.item(), 3) for name, v in s.items()}
        {'mrr@2': 1.0, 'recall@1': 1.0}
    """
    parsed = _parse_metrics(metrics)
    reduction = _reduction(reduction)
    width = _check_indices(indices).shape[1]
    k_max = max(k for _, _, k in parsed)
    if k_max > width:
        raise ValueError(f"metrics need k={k_max} neighbours but indices has {width} per query")
    rel = neighbor_relevance(
        indices,
        query_labels=query_labels,
        reference_labels=reference_labels,
        relevance=relevance,
        relevant_ids=relevant_ids,
        relevant_grades=relevant_grades,
        num_references=num_references,
        exclude_self=exclude_self,
        chunk_size=chunk_size,
    )
    with torch.no_grad():
        return _scores(rel, parsed, reduction)


def retrieval_scores(
    query: Tensor,
    reference: Tensor | None = None,
    *,
    metrics: Sequence[str] = ("ndcg@10", "mrr@10", "map@10", "recall@10", "precision@10"),
    query_labels: Tensor | None = None,
    reference_labels: Tensor | None = None,
    relevance: Tensor | None = None,
    relevant_ids: Tensor | None = None,
    relevant_grades: Tensor | None = None,
    distance: Distance | None = None,
    chunk_size: int = 1024,
    exclude_self: bool | None = None,
    reduction: str = "mean",
) -> dict[str, Tensor]:
    """NDCG, MRR, MAP, recall, precision and hit rate at any cut-offs, in one exact k-NN search.

    Runs :func:`knn` once with ``k`` = the largest cut-off in ``metrics`` (chunked: memory
    ``O(chunk_size · R)``; ties in distance ordered by the lower reference index), gathers the
    relevance of the neighbours (:func:`neighbor_relevance`) and averages each metric over the
    queries. With ``g_i(j)`` the grade of query ``i``'s ``j``-th neighbour, ``rel = g > 0`` and
    ``n_i`` the query's number of relevant reference items:

    - ``ndcg@k``: ``Σ_{j≤k} g_i(j)/log2(j+1)`` over the same sum for the query's ``k`` best
      grades (:func:`ndcg`; scikit-learn's ``ndcg_score``);
    - ``mrr@k``: ``1/j`` of the first relevant ``j ≤ k``, else 0 (:func:`mrr`);
    - ``map@k``: ``(1/min(n_i, k)) Σ_{j≤k} rel_i(j)·P_i(j)`` (:func:`map_at_k`);
    - ``recall@k``: ``Σ_{j≤k} rel_i(j) / n_i`` (:func:`recall_at_k`);
    - ``precision@k``: ``Σ_{j≤k} rel_i(j) / k`` (:func:`precision_at_k`);
    - ``hit_rate@k``: ``max_{j≤k} rel_i(j)``, PML's ``recall_at_k`` (:func:`hit_rate_at_k`).

    Queries without a relevant item (``n_i = 0``, e.g. a class with no other member) are left
    out of every average, as PML's ``AccuracyCalculator`` and :func:`retrieval_metrics` do; a
    metric is NaN when no query has a relevant item. (scikit-learn's ``ndcg_score`` instead
    scores such queries 0 and averages them in: ``reduction="none"`` then ``nan_to_num(0).mean()``
    reproduces it.)

    Relevance (exactly one source; see :func:`neighbor_relevance`): ``query_labels`` with
    ``reference_labels`` (or alone when ``reference is None``), a ``(Q, R)`` ``relevance``
    matrix, or ``relevant_ids`` ``(Q, M)`` (``-1`` padded) with optional ``relevant_grades``.

    Args:
        query: ``(Q, D)`` floating-point embeddings.
        reference: ``(R, D)`` embeddings; ``None`` searches ``query`` itself, each query
            excluded from its own neighbours.
        metrics: ``"name@k"`` strings, ``k <= `` the rows available to a query.
        query_labels, reference_labels, relevance, relevant_ids, relevant_grades: the
            relevance source.
        distance: a :mod:`pmlfunc.distances` object; default :func:`~pmlfunc.distances.cosine`.
        chunk_size: queries per block.
        exclude_self: query ``i`` is reference row ``i``: excluded from its neighbours and not
            relevant to itself (PML's ``ref_includes_query``). Default: ``reference is None``.
        reduction: ``"mean"`` (0-d tensors) or ``"none"`` (``(Q,)`` per query, NaN for queries
            without a relevant item).

    Returns:
        ``{metric: value}`` in the order of ``metrics``, float64 on the embeddings' device.

    Example:
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.7, 0.7]])
        >>> labels = torch.tensor([0, 0, 1, 1, 0])
        >>> s = retrieval_scores(emb, metrics=("ndcg@2", "mrr@2", "recall@1"), query_labels=labels)
        >>> {name: round(v.item(), 3) for name, v in s.items()}
        {'ndcg@2': 0.923, 'mrr@2': 1.0, 'recall@1': 0.7}

    References:
        Järvelin and Kekäläinen, "Cumulated gain-based evaluation of IR techniques", ACM TOIS 2002.
    """
    parsed = _parse_metrics(metrics)
    reduction = _reduction(reduction)
    ref, exclude = _resolve_sets(query, reference, exclude_self)
    if reference is None and reference_labels is not None:
        raise ValueError("reference_labels was given without reference")
    if reference is not None and query_labels is not None and reference_labels is None:
        raise ValueError("reference_labels is required when reference is given")
    chunk_size = _checks.integer(chunk_size, "chunk_size")
    src = _source(
        query.shape[0],
        query.device,
        query_labels=query_labels,
        reference_labels=reference_labels,
        relevance=relevance,
        relevant_ids=relevant_ids,
        relevant_grades=relevant_grades,
        num_references=ref.shape[0],
        exclude_self=exclude,
        query_name="query",
    )
    if src.relevant_ids is not None:
        _checks.in_range(src.relevant_ids, -1, src.num_references, "relevant_ids")
    k = max(k for _, _, k in parsed)
    available = ref.shape[0] - int(exclude)
    if k > available:
        raise ValueError(
            f"metrics need k={k} neighbours but only {available} reference rows are available "
            "to each query" + (" (its own row excluded)" if exclude else "")
        )
    with torch.no_grad():
        idx, _ = knn(
            query, ref, k=k, distance=distance, chunk_size=chunk_size, exclude_self=exclude
        )
        return _scores(_gather_relevance(idx, src, chunk_size), parsed, reduction)


def cross_modal_scores(
    image: Tensor,
    text: Tensor,
    text_to_image: Tensor,
    *,
    metrics: Sequence[str] = ("hit_rate@1", "hit_rate@5", "hit_rate@10"),
    distance: Distance | None = None,
    chunk_size: int = 1024,
    reduction: str = "mean",
) -> dict[str, dict[str, Tensor]]:
    """Image→text and text→image retrieval metrics, where each image has one or more captions.

    Text ``t`` describes image ``text_to_image[t]``. Image→text: every image queries all texts,
    its own captions are relevant. Text→image: every text queries all images, its image is
    relevant. Both are :func:`retrieval_scores` with label relevance (image ``i`` has label
    ``i``, text ``t`` has label ``text_to_image[t]``), one exact chunked search each.

    The "R@K" that cross-modal papers report (COCO / Flickr30k retrieval, CLIP) is
    ``hit_rate@K``: image→text counts an image as found when *any* of its captions is among
    the first ``K`` texts; for text→image (one relevant image) it equals ``recall@K``. The
    other metrics (``ndcg``, ``mrr``, ``map``, ``recall``, ``precision``) are also accepted. An
    image without a caption has no relevant text and is left out of the image→text averages.

    Args:
        image: ``(N_img, D)`` image embeddings.
        text: ``(N_txt, D)`` text embeddings, same dtype and device.
        text_to_image: ``(N_txt,)`` integer index of each text's image, in ``[0, N_img)``.
        metrics: ``"name@k"`` strings (see :func:`retrieval_scores`); each ``k`` at most
            ``N_img`` and ``N_txt``.
        distance: a :mod:`pmlfunc.distances` object; default :func:`~pmlfunc.distances.cosine`.
        chunk_size: queries per block.
        reduction: ``"mean"`` or ``"none"`` (see :func:`retrieval_scores`).

    Returns:
        ``{"image_to_text": {metric: value}, "text_to_image": {metric: value}}``.

    Raises:
        IndexError: a ``text_to_image`` entry outside ``[0, N_img)`` (eager on CPU).

    Example:
        >>> image = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        >>> text = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
        >>> s = cross_modal_scores(image, text, torch.tensor([0, 1, 1]), metrics=("hit_rate@1", "recall@2"))
        >>> {d: {m: round(v.item(), 3) for m, v in r.items()} for d, r in s.items()}
        {'image_to_text': {'hit_rate@1': 1.0, 'recall@2': 1.0}, 'text_to_image': {'hit_rate@1': 0.667, 'recall@2': 1.0}}
    """
    _checks.embeddings(image, "image")
    _checks.embeddings(text, "text")
    _checks.same_space(image, text, "text", "image")
    t2i = _checks.labels(text_to_image, text.shape[0], text.device, "text_to_image", "text")
    _checks.in_range(t2i, 0, image.shape[0], "text_to_image")
    image_ids = torch.arange(image.shape[0], device=image.device)
    common = {"metrics": metrics, "distance": distance, "chunk_size": chunk_size}
    return {
        "image_to_text": retrieval_scores(
            image,
            text,
            query_labels=image_ids,
            reference_labels=t2i,
            reduction=reduction,
            **common,  # type: ignore[arg-type]
        ),
        "text_to_image": retrieval_scores(
            text,
            image,
            query_labels=t2i,
            reference_labels=image_ids,
            reduction=reduction,
            **common,  # type: ignore[arg-type]
        ),
    }


# ----------------------------------------------------------------------------------------------
# sharded references
# ----------------------------------------------------------------------------------------------
def merge_neighbors(
    shards: Sequence[tuple[Tensor, Tensor]],
    *,
    k: int,
    distance: Distance | None = None,
    offsets: Sequence[int] | None = None,
    exclude: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Merge per-shard top-k neighbour lists into the global top-k, with :func:`knn`'s order.

    Search a reference set too large for one device shard by shard (``knn(query, shard, k=k)``
    for each), then merge: the result equals ``knn`` over the concatenated reference, ties in
    distance included (ordered by the lower global index, NaN farthest), provided each shard
    returned its ``min(k, R_s)`` nearest rows (``min(k + 1, R_s)`` with ``exclude``), with
    ``knn``'s tie rule, in the distance given here.

    Args:
        shards: ``[(indices, values), ...]`` as :func:`knn` returns them: ``(Q, k_s)`` int64
            indices and ``(Q, k_s)`` distances (similarities), all on one device and dtype.
            The indices are global, or local to the shard when ``offsets`` is given.
        k: neighbours to keep, ``1 <= k <= Σ k_s`` (``< Σ k_s`` with ``exclude``).
        distance: the distance the shards were searched with (only its ``is_similarity``
            matters); default :func:`~pmlfunc.distances.cosine`, as for :func:`knn`.
        offsets: the global index of each shard's first row, added to its indices.
        exclude: ``(Q,)`` global index of a row to drop from each query's list (same-set
            search: the query's own row, e.g. ``torch.arange(Q)``).

    Returns:
        ``(indices, values)``: ``(Q, k)`` global int64 indices and their values, nearest first.

    Example:
        >>> ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [0.6, 0.8]])
        >>> q = torch.tensor([[1.0, 0.1]])
        >>> parts = [knn(q, ref[:2], k=2), knn(q, ref[2:], k=2)]
        >>> merge_neighbors(parts, k=3, offsets=[0, 2])[0]
        tensor([[0, 2, 3]])
        >>> knn(q, ref, k=3)[0]
        tensor([[0, 2, 3]])
    """
    if isinstance(shards, (str, bytes, Tensor)) or not isinstance(shards, Sequence):
        raise TypeError("shards must be a sequence of (indices, values) pairs")
    if len(shards) == 0:
        raise ValueError("shards is empty")
    k = _checks.integer(k, "k")
    dist = resolve(distance, cosine())
    if offsets is not None:
        if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence):
            raise TypeError("offsets must be a sequence of ints, one per shard")
        if len(offsets) != len(shards):
            raise ValueError(
                f"offsets has {len(offsets)} entries but there are {len(shards)} shards"
            )
        offs = [_checks.integer(o, "offsets", minimum=0) for o in offsets]
    idx_parts: list[Tensor] = []
    val_parts: list[Tensor] = []
    for s, pair in enumerate(shards):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"shards[{s}] must be an (indices, values) pair")
        idx, val = pair
        if not isinstance(idx, Tensor) or idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"shards[{s}] indices must be an int64 tensor")
        if not isinstance(val, Tensor) or not val.dtype.is_floating_point:
            raise TypeError(f"shards[{s}] values must be a floating-point tensor")
        if idx.ndim != 2 or val.shape != idx.shape:
            raise ValueError(
                f"shards[{s}] indices and values must be 2-D of one shape (Q, k_s), got "
                f"{tuple(idx.shape)} and {tuple(val.shape)}"
            )
        first_idx, first_val = (
            idx_parts[0] if idx_parts else idx,
            val_parts[0] if val_parts else val,
        )
        if idx.shape[0] != first_idx.shape[0]:
            raise ValueError(
                f"shards[{s}] has {idx.shape[0]} queries but shards[0] has {first_idx.shape[0]}"
            )
        if idx.device != first_idx.device or val.device != first_idx.device:
            raise ValueError(f"shards[{s}] is on another device than shards[0]")
        if val.dtype != first_val.dtype:
            raise TypeError(
                f"shards[{s}] values have dtype {val.dtype}, shards[0] {first_val.dtype}"
            )
        idx = idx.to(torch.int64)
        idx_parts.append(idx + offs[s] if offsets is not None else idx)
        val_parts.append(val)
    width = sum(p.shape[1] for p in idx_parts)
    need = k + int(exclude is not None)
    if need > width:
        raise ValueError(
            f"k={k} needs {need} candidates per query"
            + (" (one may be excluded)" if exclude is not None else "")
            + f" but the shards hold {width}"
        )
    with torch.no_grad():
        idx = torch.cat(idx_parts, 1)
        val = torch.cat(val_parts, 1)
        n_queries = idx.shape[0]
        drop = None
        if exclude is not None:
            ex = _checks.labels(exclude, n_queries, idx.device, "exclude", "the shards' queries")
            drop = idx == ex.unsqueeze(1)
        closeness = val if dist.is_similarity else -val
        closeness = closeness.masked_fill(closeness.isnan(), float("-inf"))
        # Ascending index, then stable by closeness (descending), then the dropped row last.
        order = idx.sort(dim=1, stable=True).indices
        perm = closeness.gather(1, order).sort(dim=1, descending=True, stable=True).indices
        order = order.gather(1, perm)
        if drop is not None:
            perm = drop.gather(1, order).to(torch.uint8).sort(dim=1, stable=True).indices
            order = order.gather(1, perm)
        order = order[:, :k]
        return idx.gather(1, order), val.gather(1, order)


# ----------------------------------------------------------------------------------------------
# verification threshold
# ----------------------------------------------------------------------------------------------
class ThresholdResult(NamedTuple):
    """The best threshold of :func:`select_threshold` and the metric value it reaches."""

    threshold: Tensor
    """0-d, in ``distances``' dtype; ``-inf`` (``+inf`` for similarities) when predicting no
    match at all is best."""
    score: Tensor
    """0-d float64: the metric at ``threshold``."""


_THRESHOLD_METRICS = ("accuracy", "balanced_accuracy", "f1")


def select_threshold(
    distances: Tensor,
    is_match: Tensor,
    *,
    metric: str = "accuracy",
    is_similarity: bool = False,
) -> ThresholdResult:
    """The distance threshold that best separates matching from non-matching pairs.

    A pair is predicted a match when ``distance <= threshold`` (``similarity >= threshold``
    with ``is_similarity=True``; a NaN never matches). Over every candidate threshold (each
    distinct value in ``distances``, plus "no match at all"), with ``TP, FP, TN, FN`` the
    confusion counts and ``P = TP + FN``, ``N = FP + TN``:

    - ``accuracy = (TP + TN) / (P + N)``;
    - ``balanced_accuracy = (TP / P + TN / N) / 2`` (a rate with an empty denominator is 0);
    - ``f1 = 2 TP / (2 TP + FP + FN)`` (0 when there is no positive at all).

    It returns the threshold with the highest value, the strictest one (smallest distance,
    largest similarity) among equal values. One sort and cumulative counts, ``O(N log N)``; no
    loop over candidates, no host synchronisation (static shapes).

    Args:
        distances: pair distances (similarities with ``is_similarity``), any shape, at least
            one element, floating point.
        is_match: same shape, bool (or 0/1 integers): whether each pair is a true match.
        metric: ``"accuracy"``, ``"balanced_accuracy"`` or ``"f1"``.
        is_similarity: ``distances`` holds similarities (larger = more alike).

    Returns:
        :class:`ThresholdResult` ``(threshold, score)``.

    Example:
        >>> d = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.9])
        >>> same = torch.tensor([True, True, False, False, True])
        >>> select_threshold(d, same)  # 0.1 and 0.4 both classify 3 of 5: the stricter wins
        ThresholdResult(threshold=tensor(0.1000), score=tensor(0.6000, dtype=torch.float64))
        >>> select_threshold(d, same, metric="f1")
        ThresholdResult(threshold=tensor(0.9000), score=tensor(0.7500, dtype=torch.float64))
    """
    if not isinstance(distances, Tensor):
        raise TypeError(f"distances must be a torch.Tensor, got {type(distances).__name__}")
    if not distances.dtype.is_floating_point:
        raise TypeError(f"distances must be a floating-point tensor, got {distances.dtype}")
    if distances.numel() == 0:
        raise ValueError("distances is empty; at least one pair is required")
    if not isinstance(is_match, Tensor):
        raise TypeError(f"is_match must be a torch.Tensor, got {type(is_match).__name__}")
    if is_match.dtype.is_floating_point or is_match.dtype.is_complex:
        raise TypeError(f"is_match must be a bool (or integer) tensor, got {is_match.dtype}")
    if is_match.shape != distances.shape:
        raise ValueError(
            f"is_match has shape {tuple(is_match.shape)} but distances has "
            f"{tuple(distances.shape)} (one flag per pair)"
        )
    if is_match.device != distances.device:
        raise ValueError(f"is_match is on {is_match.device} but distances is on {distances.device}")
    if metric not in _THRESHOLD_METRICS:
        raise ValueError(f"metric must be one of {_THRESHOLD_METRICS}, got {metric!r}")
    with torch.no_grad():
        key = distances.detach().flatten()
        if is_similarity:
            key = -key
        key, order = key.sort(stable=True)  # NaN last
        match = is_match.flatten().gather(0, order) != 0
        n = key.shape[0]
        tp = match.to(torch.int64).cumsum(0)
        fp = torch.arange(1, n + 1, device=key.device) - tp
        zero = torch.zeros(1, dtype=torch.int64, device=key.device)
        tp = torch.cat([zero, tp]).to(torch.float64)  # candidate 0: nothing predicted a match
        fp = torch.cat([zero, fp]).to(torch.float64)
        pos = match.to(torch.float64).sum()  # P
        neg = n - pos
        tn, fn = neg - fp, pos - tp
        # Each score is one correctly rounded division of exact integers, so candidates with
        # equal values compare equal and the strictest one wins (argmax: the first maximum).
        if metric == "accuracy":
            score = (tp + tn) / n
        elif metric == "balanced_accuracy":
            p1, n1 = pos.clamp_min(1), neg.clamp_min(1)
            score = (tp * n1 + tn * p1) / (2 * p1 * n1)
        else:
            score = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
        # A threshold at key[i] predicts all of key[:i+1]: only the last of equal values counts.
        last = torch.cat([key[1:] != key[:-1], key.new_ones(1, dtype=torch.bool)]) & ~key.isnan()
        valid = torch.cat([last.new_ones(1), last])
        best = score.masked_fill(~valid, -math.inf).argmax()
        inf = key.new_full((1,), -math.inf)
        threshold = torch.cat([inf, key]).gather(0, best.reshape(1)).squeeze(0)
        if is_similarity:
            threshold = -threshold
        return ThresholdResult(threshold, score.gather(0, best.reshape(1)).squeeze(0))
