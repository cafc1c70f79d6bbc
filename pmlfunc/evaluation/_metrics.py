"""The per-query IR metrics (:func:`ndcg`, :func:`mrr`, :func:`map_at_k`, :func:`recall_at_k`,
:func:`precision_at_k`, :func:`hit_rate_at_k`), PML's per-query metrics (:func:`pml_per_query`),
the ``"name@k"`` specs that name them and their reduction over queries."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _checks
from ._relevance import Relevance


def _ranked(retrieved: object, k: int | None, name: str = "retrieved") -> tuple[Tensor, int]:
    """The first ``k`` columns of a ``(Q, K)`` relevance-of-neighbours matrix, as float64."""
    retrieved = _checks.tensor(retrieved, name)
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
    values = _checks.tensor(values, name)
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


def pml_per_query(
    retrieved: Tensor, num_relevant: Tensor, *, k: int | None = None
) -> dict[str, Tensor]:
    """Per-query values of PML 2.9.0's ``AccuracyCalculator`` k-NN metrics, from the relevance
    of each query's ranked neighbours.

    With ``rel_i(j) = 1[g_i(j) > 0]`` for query ``i``'s ``j``-th neighbour, ``n_i`` its number
    of relevant reference items (PML's ``R``) and ``P_i(j) = (1/j) Σ_{m≤j} rel_i(m)``::

        precision_at_1_i              = rel_i(1)
        r_precision_i                 = (1 / min(n_i, k)) Σ_{j ≤ min(n_i, k)} rel_i(j)
        mean_average_precision_at_r_i = (1 / n_i) Σ_{j ≤ min(n_i, k)} rel_i(j) · P_i(j)
        mean_average_precision_i      = (1 / n_i) Σ_{j ≤ k} rel_i(j) · P_i(j)
        mean_reciprocal_rank_i        = max_{j ≤ k} rel_i(j) / j

    PML averages these over the queries with ``n_i > 0`` (:func:`retrieval_metrics` does, for
    the first three); being per query, they can also be averaged per class (PML's
    ``avg_of_avgs``) or over any other grouping. The three divided by ``n_i`` are NaN (0/0) for
    a query with ``n_i = 0``; ``precision_at_1`` and ``mean_reciprocal_rank`` are 0 there.
    ``mean_average_precision`` is trec_eval's ``map_cut_k`` (:func:`map_at_k` divides by
    ``min(n_i, k)`` instead), and ``mean_reciprocal_rank`` is :func:`mrr`. With ``k >= n_i``
    ``r_precision`` and ``mean_average_precision_at_r`` are exact; a smaller ``k`` truncates
    them as PML does.

    Args:
        retrieved: ``(Q, K)`` relevance grades of each query's ranked neighbours (relevant:
            ``> 0``), e.g. :attr:`Relevance.retrieved`.
        num_relevant: ``(Q,)`` number of relevant reference items of each query (all of them,
            not only those retrieved), e.g. :attr:`Relevance.num_relevant`.
        k: cut-off, ``1 <= k <= K``; default ``K`` (PML's ``k``: the neighbours retrieved).

    Returns:
        ``{"precision_at_1", "r_precision", "mean_average_precision_at_r",
        "mean_average_precision", "mean_reciprocal_rank"}``, each ``(Q,)`` float64.

    Example:
        >>> s = pml_per_query(torch.tensor([[1, 0, 1], [0, 1, 0]]), torch.tensor([2, 3]))
        >>> {name: [round(v, 4) for v in value.tolist()] for name, value in s.items()}
        {'precision_at_1': [1.0, 0.0], 'r_precision': [0.5, 0.3333],
         'mean_average_precision_at_r': [0.5, 0.1667], 'mean_average_precision': [0.8333, 0.1667],
         'mean_reciprocal_rank': [1.0, 0.5]}

    Reference:
        Musgrave, Belongie and Lim, "A Metric Learning Reality Check", ECCV 2020 (R-precision,
        MAP@R).
    """
    top, k = _ranked(retrieved, k)
    n = _per_query(num_relevant, top.shape[0], "num_relevant")
    rel = (top > 0).to(torch.float64)
    ranks = _ranks(k, top.device)
    within_r = (ranks.unsqueeze(0) <= n.unsqueeze(1)).to(torch.float64)  # j <= min(n_i, k)
    precision = rel.cumsum(1) / ranks
    return {
        "precision_at_1": rel[:, 0],
        "r_precision": (rel * within_r).sum(1) / n.clamp(max=k),
        "mean_average_precision_at_r": (precision * rel * within_r).sum(1) / n,
        "mean_average_precision": (precision * rel).sum(1) / n,
        "mean_reciprocal_rank": (rel / ranks).amax(1),
    }


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


def _over_queries(value: Tensor, counted: Tensor, unranked: Tensor, reduction: str) -> Tensor:
    """A ``(Q,)`` metric per query (``"none"``) or its mean (``"mean"``).

    ``counted``: the queries with a relevant item; the others are left out of the mean (NaN per
    query). ``unranked``: the queries ranked among non-finite embeddings (:func:`knn`'s mark):
    NaN per query, lone or not, and always in the mean, which is then NaN.
    """
    value = value.masked_fill(unranked, math.nan)
    if reduction == "none":
        return value.masked_fill(~counted, math.nan)
    included = counted | unranked
    return torch.where(included, value, 0.0).sum() / included.sum()


def _scores(
    rel: Relevance, parsed: list[tuple[str, str, int]], reduction: str, unranked: Tensor
) -> dict[str, Tensor]:
    """Every requested metric; queries without a relevant item left out (NaN per query), queries
    in ``unranked`` NaN (see :func:`_over_queries`)."""
    valid = rel.num_relevant > 0
    return {
        key: _over_queries(_metric_value(name, rel, k), valid, unranked, reduction)
        for key, name, k in parsed
    }
