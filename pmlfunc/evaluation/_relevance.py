"""Relevance of ranked neighbours, from labels, a ``(Q, R)`` grade matrix or padded id lists:
the checked source (:class:`_Source`), the per-kind gathers and :func:`neighbor_relevance`."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _checks


class Relevance(NamedTuple):
    """The relevance of each query's ranked neighbours (from :func:`neighbor_relevance`)."""

    retrieved: Tensor
    """``(Q, K)`` float64: the relevance grade of each query's ``j``-th neighbour."""
    num_relevant: Tensor
    """``(Q,)`` int64: how many reference items are relevant (grade ``> 0``) to each query."""
    ideal: Tensor
    """``(Q, K)`` float64: each query's ``K`` largest grades, descending, zero-padded."""


def _int_tensor(t: object, name: str, ndim: int) -> Tensor:
    t = _checks.tensor(t, name)
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


def _one_source(
    query_labels: object,
    reference_labels: object,
    relevance: object,
    relevant_ids: object,
    relevant_grades: object,
) -> None:
    """Exactly one relevance source, and no argument that belongs to a source not given."""
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


def _label_source(
    query_labels: object,
    reference_labels: object,
    num_queries: int,
    num_references: int | None,
    exclude_self: bool | None,
    device: torch.device,
    query_name: str,
) -> tuple[Tensor, Tensor, int, bool]:
    """``(query_labels, reference_labels, R, default exclude_self)`` of a label source."""
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
        return ql, ql, num_queries, True
    reference_labels = _checks.tensor(reference_labels, "reference_labels")
    n_ref = reference_labels.shape[0] if reference_labels.ndim == 1 else -1
    if num_references is not None:
        n_ref = num_references
    rl = _checks.labels(reference_labels, n_ref, device, "reference_labels", "reference")
    return ql, rl, n_ref, False


def _matrix_source(
    relevance: object,
    num_queries: int,
    num_references: int | None,
    device: torch.device,
    query_name: str,
) -> Tensor:
    """The checked ``(Q, R)`` relevance matrix."""
    relevance = _checks.tensor(relevance, "relevance")
    if relevance.dtype.is_complex:
        raise TypeError(f"relevance must be real (bool, int or float), got {relevance.dtype}")
    if relevance.ndim != 2:
        raise ValueError(
            f"relevance must be 2-D of shape ({num_queries}, R) (queries × reference rows), "
            f"got shape {tuple(relevance.shape)}"
        )
    n_ref = relevance.shape[1] if num_references is None else num_references
    if relevance.shape != (num_queries, n_ref):
        raise ValueError(
            f"relevance must have shape ({num_queries}, {n_ref}) (queries × reference rows), "
            f"got {tuple(relevance.shape)}"
        )
    if relevance.device != device:
        raise ValueError(f"relevance is on {relevance.device} but {query_name} is on {device}")
    return relevance


def _id_source(
    relevant_ids: object,
    relevant_grades: object,
    num_queries: int,
    num_references: int | None,
    device: torch.device,
    query_name: str,
) -> tuple[Tensor, Tensor | None, int]:
    """``(relevant_ids, relevant_grades or None, R)`` of an id-list source."""
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
    _checks.in_range(ids, -1, num_references, "relevant_ids")
    if relevant_grades is None:
        return ids, None, num_references
    relevant_grades = _checks.tensor(relevant_grades, "relevant_grades")
    if relevant_grades.shape != ids.shape:
        raise ValueError(
            f"relevant_grades must have relevant_ids' shape {tuple(ids.shape)}, "
            f"got {tuple(relevant_grades.shape)}"
        )
    if relevant_grades.device != device:
        raise ValueError(
            f"relevant_grades is on {relevant_grades.device} but {query_name} is on {device}"
        )
    return ids, relevant_grades, num_references


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
    """Check the relevance arguments: shapes, dtypes, devices, and the range of relevant ids
    (labels and grades are not read)."""
    _one_source(query_labels, reference_labels, relevance, relevant_ids, relevant_grades)
    ql = rl = dense = ids = grades = None
    if query_labels is not None:
        ql, rl, n_ref, default_exclude = _label_source(
            query_labels,
            reference_labels,
            num_queries,
            num_references,
            exclude_self,
            device,
            query_name,
        )
    elif relevance is not None:
        dense = _matrix_source(relevance, num_queries, num_references, device, query_name)
        n_ref, default_exclude = dense.shape[1], False
    else:
        ids, grades, n_ref = _id_source(
            relevant_ids, relevant_grades, num_queries, num_references, device, query_name
        )
        default_exclude = False
    exclude = default_exclude if exclude_self is None else bool(exclude_self)
    if exclude and n_ref < num_queries:
        raise ValueError(
            f"exclude_self=True means query i is reference row i, so the reference needs at "
            f"least {num_queries} rows (one per query), got {n_ref}"
        )
    return _Source(ql, rl, dense, ids, grades, n_ref, exclude)


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


def _label_relevance(
    indices: Tensor, src: _Source, chunk_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Grades ``1[label equal]``; ``R_i`` counted ``chunk_size`` queries at a time."""
    assert src.query_labels is not None and src.reference_labels is not None
    k = indices.shape[1]
    hit = src.reference_labels[indices] == src.query_labels.unsqueeze(1)
    retrieved = hit.to(torch.float64)
    n_rel = _relevant_counts(src.query_labels, src.reference_labels, src.exclude, chunk_size)
    slots = torch.arange(k, device=indices.device)
    ideal = (slots.unsqueeze(0) < n_rel.unsqueeze(1)).to(torch.float64)
    return retrieved, n_rel, ideal


def _matrix_relevance(indices: Tensor, src: _Source) -> tuple[Tensor, Tensor, Tensor]:
    """Grades gathered from the dense ``(Q, R)`` matrix."""
    assert src.relevance is not None
    n_queries, k = indices.shape
    dense = src.relevance
    if dense.dtype == torch.bool:
        dense = dense.to(torch.uint8)
    if src.exclude:  # the own entries are not relevant (a copy: the input is Q × R anyway)
        diag = torch.arange(n_queries, device=indices.device).unsqueeze(1)
        dense = dense.scatter(1, diag, torch.zeros_like(dense[:, :1]))
    retrieved = dense.gather(1, indices).to(torch.float64)
    n_rel = (dense > 0).sum(1)
    ideal = dense.topk(k, dim=1, largest=True, sorted=True).values.to(torch.float64)
    return retrieved, n_rel, ideal


def _id_relevance(indices: Tensor, src: _Source) -> tuple[Tensor, Tensor, Tensor]:
    """Grades of padded id lists: a sort per query and a binary search per neighbour."""
    assert src.relevant_ids is not None
    n_queries, k = indices.shape
    ids = src.relevant_ids.to(torch.int64)
    width = ids.shape[1]
    valid = ids >= 0
    if src.exclude:
        valid = valid & (ids != torch.arange(n_queries, device=indices.device).unsqueeze(1))
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
    return retrieved, n_rel, ideal


def _gather_relevance(indices: Tensor, src: _Source, chunk_size: int) -> Relevance:
    """The relevance of ranked neighbours; ``Q × k`` work except the label counts (chunked)."""
    if src.query_labels is not None:
        retrieved, n_rel, ideal = _label_relevance(indices, src, chunk_size)
    elif src.relevance is not None:
        retrieved, n_rel, ideal = _matrix_relevance(indices, src)
    else:
        retrieved, n_rel, ideal = _id_relevance(indices, src)
    if src.exclude:
        own = indices == torch.arange(indices.shape[0], device=indices.device).unsqueeze(1)
        retrieved = retrieved.masked_fill(own, 0.0)
    return Relevance(retrieved, n_rel, ideal)


def _check_indices(indices: object) -> Tensor:
    indices = _checks.tensor(indices, "indices")
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
    with torch.no_grad():
        return _gather_relevance(idx, src, chunk_size)
