"""Exact k-nearest neighbours: the chunked search (:func:`knn`), its deterministic tie rule, and
the merge of per-shard neighbour lists (:func:`merge_neighbors`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _checks
from ..distances import Distance, cosine, resolve


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


def _unranked(query: Tensor, reference: Tensor) -> Tensor:
    """``(Q,)`` bool: query ``i``'s ranking is unreliable, because its own row or any reference row
    has a non-finite entry (a non-finite reference can land anywhere in every query's ranking).
    Static shapes, no host sync."""
    return ~query.isfinite().all(1) | ~reference.isfinite().all()


def _nan_rows(values: Tensor) -> Tensor:
    """``(Q,)`` bool: the queries whose neighbour values hold a NaN (the mark :func:`knn` sets)."""
    return values.isnan().any(1)


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

    Non-finite embeddings: a query whose row has a NaN or ±inf entry gets NaN ``values`` (its
    whole row), and so does every query when any reference row has one, since a non-finite
    reference can land anywhere in a ranking. The indices are still returned, ranked as above.
    This NaN row is the mark every metric of :mod:`pmlfunc.evaluation` reads: such a query's
    metrics are NaN.

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
        float16/bfloat16 inputs); a NaN row for a query ranked among non-finite embeddings.

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
        unranked = _unranked(query, reference).unsqueeze(1)
        return torch.cat(indices), torch.cat(values).masked_fill(unranked, math.nan)


def _shard_parts(
    shards: Sequence[tuple[Tensor, Tensor]], offsets: Sequence[int] | None
) -> tuple[list[Tensor], list[Tensor]]:
    """Each shard's checked ``(Q, k_s)`` global int64 indices and values (same Q, device, dtype)."""
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
    return idx_parts, val_parts


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
    ``knn``'s tie rule, in the distance given here, and the same distance values as the whole
    search (a matmul over a shard can round an entry differently in the last bit: then the
    values agree to float rounding, and only entries that close can swap).

    NaN propagates: a query with a NaN among its values in any shard gets NaN values throughout
    its merged row (its indices are still merged, NaN ranked farthest). :func:`knn` marks a query
    ranked among non-finite embeddings with a NaN row, so a non-finite row in any shard gives the
    merged result :func:`knn`'s mark over the whole reference, and :func:`neighbor_scores` (given
    ``values``) NaN metrics.

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
        ``(indices, values)``: ``(Q, k)`` global int64 indices and their values, nearest first;
        a NaN row for a query with a NaN value in any shard.

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
    idx_parts, val_parts = _shard_parts(shards, offsets)
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
        merged = val.gather(1, order).masked_fill(_nan_rows(val).unsqueeze(1), math.nan)
        return idx.gather(1, order), merged
