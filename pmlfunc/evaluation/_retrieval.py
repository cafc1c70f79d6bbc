"""The retrieval entry points: search, relevance and metrics in one call
(:func:`retrieval_metrics`, PML's; :func:`retrieval_scores` and :func:`cross_modal_scores`, the IR
metrics; :func:`neighbor_scores`, the IR metrics of neighbours found elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _checks
from ..distances import Distance, cosine, resolve
from ._knn import _nan_rows, _resolve_sets, knn
from ._metrics import (
    _over_queries,
    _parse_metrics,
    _reduction,
    _scores,
    hit_rate_at_k,
    pml_per_query,
)
from ._relevance import (
    _check_indices,
    _gather_relevance,
    _relevant_counts,
    _source,
    neighbor_relevance,
)


def _label_pair(
    query: Tensor,
    query_labels: object,
    reference: Tensor,
    reference_labels: object,
    separate: bool,
) -> tuple[Tensor, Tensor]:
    """Checked ``(query_labels, reference_labels)``; the query's labels in same-set mode."""
    device = query.device
    query_labels = _checks.labels(query_labels, query.shape[0], device, "query_labels", "query")
    if not separate:
        if reference_labels is not None:
            raise ValueError("reference_labels was given without reference")
        return query_labels, query_labels
    if reference_labels is None:
        raise ValueError("reference_labels is required when reference is given")
    return query_labels, _checks.labels(
        reference_labels, reference.shape[0], device, "reference_labels", "reference"
    )


_PML_KEYS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


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
    ``recall_at_1`` equals ``precision_at_1``. :func:`pml_per_query` gives the per-query values
    (of neighbours found anywhere), e.g. to average them per class.

    Non-finite embeddings: a query whose embedding has a NaN or ±inf entry has NaN metrics, and
    so does every query when any reference row has one (a non-finite reference can land anywhere
    in a ranking; :func:`knn` marks these queries). Such a query counts in every mean, lone or
    not, so each metric is then NaN, never a finite number computed from a broken ranking.

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
        float64 0-d tensors on the embeddings' device (NaN with a non-finite embedding).

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
    query_labels, reference_labels = _label_pair(
        query, query_labels, reference, reference_labels, separate
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
        idx, val = knn(  # which checks k against the rows available
            query, reference, k=k, distance=dist, chunk_size=chunk_size, exclude_self=exclude
        )
        rel = reference_labels[idx] == query_labels.unsqueeze(1)  # (Q, k)
        every = pml_per_query(rel, r)
        per_query = {name: every[name] for name in _PML_KEYS}
        for kk in recall_ks:
            per_query[f"recall_at_{kk}"] = hit_rate_at_k(rel, k=kk)
        unranked = _nan_rows(val)
        # Lone queries (R_i = 0) are left out; every query lone: 0 / 0 = NaN, as in PML.
        return {name: _over_queries(v, r > 0, unranked, "mean") for name, v in per_query.items()}


def _unranked_from(values: object, indices: Tensor) -> Tensor:
    """``(Q,)`` bool: the queries with a NaN among their given neighbour ``values`` (none if
    ``values`` is ``None``)."""
    if values is None:
        return torch.zeros(indices.shape[0], dtype=torch.bool, device=indices.device)
    values = _checks.tensor(values, "values")
    if not values.dtype.is_floating_point:
        raise TypeError(f"values must be a floating-point tensor, got {values.dtype}")
    if values.shape != indices.shape:
        raise ValueError(
            f"values must have indices' shape {tuple(indices.shape)} (one distance per "
            f"neighbour), got {tuple(values.shape)}"
        )
    if values.device != indices.device:
        raise ValueError(f"values is on {values.device} but indices is on {indices.device}")
    return _nan_rows(values)


def neighbor_scores(
    indices: Tensor,
    *,
    values: Tensor | None = None,
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

    Pass the neighbours' ``values`` (as :func:`knn` and :func:`merge_neighbors` return them) to
    get NaN metrics for the queries ranked among non-finite embeddings: :func:`knn` gives such a
    query a NaN row (its embedding or any reference row has a NaN or ±inf entry), and any query
    with a NaN among its ``values`` is NaN here and counts in every mean, which is then NaN, as in
    :func:`retrieval_scores`. Indices alone cannot show it.

    Args:
        indices: ``(Q, K)`` ranked reference indices, nearest first; ``K >= max k``.
        values: ``(Q, K)`` distances (similarities) of ``indices``, or ``None`` (no query is
            marked).
        metrics: ``"name@k"`` strings, name in ``ndcg``, ``mrr``, ``map``, ``recall``,
            ``precision``, ``hit_rate``.
        query_labels, reference_labels, relevance: see :func:`neighbor_relevance`.
        relevant_ids, relevant_grades, num_references: see :func:`neighbor_relevance`.
        exclude_self, chunk_size: see :func:`neighbor_relevance`.
        reduction: ``"mean"`` (0-d tensors) or ``"none"`` (``(Q,)`` per-query values, NaN for
            queries without a relevant item or with a NaN among their ``values``).

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
    idx = _check_indices(indices)
    unranked = _unranked_from(values, idx)
    width = idx.shape[1]
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
        return _scores(rel, parsed, reduction, unranked)


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

    Non-finite embeddings: a query whose embedding has a NaN or ±inf entry has NaN metrics, and
    so does every query when any reference row has one (it could land anywhere in a ranking;
    :func:`knn` marks these queries). Such a query counts in every mean, relevant items or not,
    so the mean is then NaN; with ``reduction="none"`` the other queries keep their values.

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
            without a relevant item or with a non-finite embedding in their ranking).

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
    k = max(k for _, _, k in parsed)
    available = ref.shape[0] - int(exclude)
    if k > available:
        raise ValueError(
            f"metrics need k={k} neighbours but only {available} reference rows are available "
            "to each query" + (" (its own row excluded)" if exclude else "")
        )
    with torch.no_grad():
        idx, val = knn(
            query, ref, k=k, distance=distance, chunk_size=chunk_size, exclude_self=exclude
        )
        return _scores(_gather_relevance(idx, src, chunk_size), parsed, reduction, _nan_rows(val))


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

    Non-finite embeddings (:func:`retrieval_scores`' rule, in each direction): a NaN or ±inf
    entry in image ``i`` makes image ``i``'s image→text metrics and every text→image metric
    NaN; one in text ``t`` makes text ``t``'s text→image metrics and every image→text metric NaN.

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
