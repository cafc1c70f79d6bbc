"""Retrieval evaluation: exact k-nearest neighbours and PML's retrieval metrics.

:func:`knn` finds the exact ``k`` nearest reference rows of every query, one block of
``chunk_size`` queries at a time, so memory is ``O(chunk_size · R)``, never ``Q × R``.
:func:`retrieval_metrics` turns those neighbours into pytorch-metric-learning 2.9.0's
``AccuracyCalculator`` metrics (``precision_at_1``, ``r_precision``,
``mean_average_precision_at_r``) plus ``recall_at_k``.

Both are evaluation tools, not losses: they run under ``torch.no_grad()``, have static shapes
(shapes depend on ``Q``, ``R`` and ``k`` only) and synchronise with the host only when
``retrieval_metrics`` must choose ``k`` itself (``k=None``; see there).

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

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _checks
from .distances import Distance, cosine, resolve

__all__ = ["knn", "retrieval_metrics"]


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
