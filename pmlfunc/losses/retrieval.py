r"""Retrieval training with in-batch negatives: queries against every document of the batch.

Row ``i`` of the batch is a query ``q_i`` (``anchors``), its positive document ``p_i``
(``positives``) and optionally ``k`` mined hard negatives ``n_i1 … n_ik`` (``negatives``). With
``s(u, v)`` the similarity (cosine by default) and the logit scale ``t``, every loss here reads
``S(u, v) = t · s(u, v)`` and, for row ``i``, a set ``C(i)`` of candidates that always holds the
positive pair:

| direction | row ``i`` reads | never |
|---|---|---|
| ``"query_to_doc"`` (always) | ``S(q_i, d)`` for every document ``d`` of the batch (positives and hard negatives) | |
| ``"query_to_query"`` | ``S(q_i, q_r)`` | ``r = i`` |
| ``"doc_to_query"`` | ``S(p_i, q_r)`` | |
| ``"doc_to_doc"`` | ``S(p_i, d)`` | row ``i``'s own documents |

``L = R_i[lse_{C(i)} S − S(q_i, p_i)]`` with ``R`` the mean (or sum) over rows:
``partition_mode="joint"`` takes one log-sum-exp over every direction's candidates,
``"per_direction"`` the mean of one log-sum-exp a direction (then ``query_to_doc`` +
``doc_to_query`` is symmetric InfoNCE, CLIP's loss). Masks remove candidates that are not
negatives: equal ``anchor_ids``/``positive_ids`` (duplicates, several positives a query) and a
guide model's similarities (GISTEmbed). Hardness weighting adds ``α · stop_grad(s)`` to chosen
negative logits.

It runs on the tiled engine (:mod:`pmlfunc.losses._tiled`, kind :class:`~pmlfunc.losses._tiled.Retrieval`):
the log-sum-exps are row statistics of tiles of ``chunk`` rows against the batch's documents
(and queries), the masks are built tile by tile from ids and guide rows, and the positive logit is
read on the row's own tile. Without ``chunk_size`` the tiles hold ``2²²`` entries; with it,
``chunk_size × M`` (``M`` the columns: the batch's documents, plus its queries when a direction
reads them), in both passes. The forward forms the gradient where autograd will ask for it (no
tile is computed twice) and that gradient is not differentiable again.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .. import params as _params
from .._ops import scalar_tensor, unit_rows
from ..distances import _Dot, cosine, resolve
from ..queues import check_queue
from ..reducers import Reducer
from ._tiled import (
    COL_EMPTY,
    COL_NEGATIVE,
    COL_POSITIVE,
    COL_QUERY,
    EngineCall,
    Retrieval,
    builds,
    dense_rows,
    run_local,
    tiled_reducer,
)

__all__ = ["multiple_negatives_ranking", "multiple_negatives_ranking_init"]

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
MARGIN_STRATEGIES = ("absolute", "relative")


def multiple_negatives_ranking(
    anchors: Tensor,
    positives: Tensor,
    negatives: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
    *,
    scale: float | Tensor = 20.0,
    distance=None,
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float | Tensor = 0.0,
    anchor_ids: Tensor | None = None,
    positive_ids: Tensor | None = None,
    guide: Sequence[Tensor] | None = None,
    margin_strategy: str = "absolute",
    margin: float | Tensor = 0.0,
    max_logit_scale: float | None = None,
    chunk_size: int | None = None,
    reducer: Reducer | None = None,
    memory: dict[str, Tensor] | None = None,
) -> Tensor:
    r"""In-batch negatives ranking loss (InfoNCE) with hard negatives, directions and masks.

    sentence-transformers' ``MultipleNegativesRankingLoss`` as a pure function, with its column
    layout and defaults. With the module docstring's logits ``S`` and candidates ``C(i)``:

    .. math::
        \ell_i = \log \sum_{c \in C(i)} e^{S_c + h_c} - S(q_i, p_i), \qquad
        L = \frac{1}{N} \sum_i \ell_i

    (``per_direction``: the log-sum-exp is the mean of one a direction). ``h_c = α · s_c`` with
    no gradient on the negatives ``hardness_mode`` chooses (Lan et al. 2025, EmbeddingGemma),
    0 elsewhere; only the ``query_to_doc`` logits get it, as in sentence-transformers.

    Masks (a masked candidate leaves ``C(i)``; the positive pair never does):

    - ``anchor_ids``/``positive_ids``: rows ``r ≠ i`` with an equal anchor id (the same query)
      or an equal positive id (the same document) are not negatives of each other: their
      queries and positives leave ``C(i)`` in every direction (hard negatives stay). This is
      how duplicates and several positives per query are trained without a sampler that skips
      data.
    - ``guide``: a guide model's embeddings of the same rows (GISTEmbed). Row ``i``'s threshold
      is ``g_i = cos_guide(q_i, p_i)``; a candidate whose guide cosine (between the same two
      texts) exceeds ``g_i − margin`` (``"absolute"``) or ``g_i − |g_i| · margin``
      (``"relative"``) is masked.

    Mapping from sentence-transformers (the "Coming from sentence-transformers" guide has all):
    ``MultipleNegativesRankingLoss`` and ``CachedMultipleNegativesRankingLoss`` (pass
    ``chunk_size`` for the bounded memory its mini-batches give; the value is the same) are this
    function with the same arguments; ``MultipleNegativesSymmetricRankingLoss`` is
    ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"``;
    ``GISTEmbedLoss`` is ``guide=`` with ``scale = 1/temperature``, and its ``contrast_anchors``
    / ``contrast_positives`` are ``"query_to_query"`` / ``"doc_to_doc"`` (with hard negatives,
    GISTEmbed's positive–positive term reads positives only, this ``doc_to_doc`` every document,
    as sentence-transformers' MNRL does). :func:`~pmlfunc.losses.clip` without labels is
    ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"``, without
    negatives, with ``params`` its ``logit_scale``.

    Args:
        anchors: ``(N, D)`` float tensor, the queries.
        positives: ``(N, D)`` float tensor, row ``i`` the positive document of query ``i``.
        negatives: ``None``, ``(N, D)`` (one hard negative a row) or ``(N, k, D)``: row ``i``'s
            hard negatives (in-batch negatives for every other row).
        params: ``None`` (the fixed ``scale``) or ``{"logit_scale": 0-d}`` from
            :func:`multiple_negatives_ranking_init` (or :func:`~pmlfunc.losses.clip_init`): a
            learnable scale ``t = exp(logit_scale)`` in log space, used instead of ``scale``.
        scale: ``t`` when ``params`` is ``None``: a positive number or 0-d tensor, default
            ``20.0`` (sentence-transformers'; ``scale = 1 / temperature``).
        distance: ``cosine()`` (default, sentence-transformers' ``cos_sim``) or ``dot()``.
        directions: a subset of ``("query_to_doc", "query_to_query", "doc_to_query",
            "doc_to_doc")`` holding ``"query_to_doc"``; default ``("query_to_doc",)``.
        partition_mode: ``"joint"`` (default) or ``"per_direction"`` (refused with
            ``query_to_query``/``doc_to_doc``, whose candidates lack the positive).
        hardness_mode: ``None`` (default), ``"in_batch_negatives"`` (the other rows'
            documents), ``"hard_negatives"`` (the row's own hard negatives) or
            ``"all_negatives"`` (every document but the positive).
        hardness_strength: ``α ≥ 0`` (default 0: no effect), a number or 0-d tensor that does
            not require grad (it is not learnable: a ``ValueError``).
        anchor_ids: ``None`` or ``(N,)`` integer ids of the queries.
        positive_ids: ``None`` or ``(N,)`` integer ids of the positive documents.
        guide: ``None`` or ``(guide_anchors, guide_positives[, guide_negatives])``: the guide
            model's embeddings of the same texts, shapes as ``anchors``/``negatives`` with their
            own width; never differentiated. Hard negatives need ``guide_negatives``.
        margin_strategy: ``"absolute"`` (default) or ``"relative"``, for ``guide``.
        margin: the guide's margin (default 0: mask what the guide finds more similar to the
            query than its positive).
        max_logit_scale: with ``params``, ``logit_scale`` is clamped at it before ``exp``.
        chunk_size: the engine's tile (``O(chunk_size × M)`` memory in both passes); ``None``:
            tiles of ``2²²`` entries.
        reducer: ``mean()`` (default, sentence-transformers') or ``sum()`` over rows.
        memory: ``None`` or a document queue (:func:`pmlfunc.queues.document_queue_init`):
            its filled entries are candidates as another row's would be: its documents for
            ``query_to_doc`` (and ``doc_to_doc``), its queries (a queue made with
            ``queries=True``) for ``query_to_query`` and ``doc_to_query``; masked by the ids
            the batch gives. No gradient reaches the queue. Refused with ``guide`` (the guide
            model has no rows for the queue). Under ``pf.distributed`` (gathered or on the
            ring, which reads each rank's copy once) every rank holds the same queue: push the
            global batch (docs/guides/large-batch.md, "Under DDP").

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> q, p, n = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 3, 16)
        >>> loss = pf.losses.multiple_negatives_ranking(q, p, n)
        >>> sym = pf.losses.multiple_negatives_ranking(
        ...     q, p, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
        ... )

    References: van den Oord et al., "Representation Learning with Contrastive Predictive
    Coding", 2018; Henderson et al., "Efficient Natural Language Response Suggestion for Smart
    Reply", 2017; Li et al., "Towards General Text Embeddings with Multi-stage Contrastive
    Learning" (GTE), 2023; Solatorio, "GISTEmbed", 2024; Lan et al., "LLaVE", 2025.
    """
    call = _retrieval_call(
        anchors, positives, negatives, params, scale, distance, directions, partition_mode,
        hardness_mode, hardness_strength, anchor_ids, positive_ids, guide, margin_strategy,
        margin, max_logit_scale, chunk_size, reducer, memory,
    )  # fmt: skip
    return run_local(call)


def multiple_negatives_ranking_init(
    scale: float = 20.0, *, dtype: torch.dtype = torch.float32, device=None
) -> dict[str, Tensor]:
    """Parameters of :func:`multiple_negatives_ranking` with a learnable scale:
    ``{"logit_scale": log(scale)}`` (default ``log 20``, sentence-transformers' fixed scale).

    Example:
        >>> round(float(pf.losses.multiple_negatives_ranking_init()["logit_scale"].exp()), 3)
        20.0
    """
    value = math.log(_checks.number(scale, "scale", positive=True))
    return {"logit_scale": torch.tensor(value, dtype=dtype, device=device)}


def _options(directions, partition_mode, hardness_mode) -> tuple[frozenset[str], bool]:
    if isinstance(directions, str) or not isinstance(directions, Sequence):
        raise TypeError(
            f"directions must be a tuple of direction names {DIRECTIONS}, got {directions!r}"
        )
    chosen = frozenset(directions)
    unknown = sorted(d for d in chosen if d not in DIRECTIONS)
    if unknown or not chosen:
        raise ValueError(
            f"directions must be a non-empty subset of {DIRECTIONS}, got {tuple(directions)!r}"
        )
    if "query_to_doc" not in chosen:
        raise ValueError("directions must hold 'query_to_doc' (it holds the positive pair)")
    if partition_mode not in PARTITION_MODES:
        raise ValueError(f"partition_mode must be one of {PARTITION_MODES}, got {partition_mode!r}")
    if partition_mode == "per_direction" and chosen & {"query_to_query", "doc_to_doc"}:
        raise ValueError(
            "partition_mode='per_direction' needs every direction's candidates to hold the "
            "positive pair; 'query_to_query' and 'doc_to_doc' do not: use partition_mode='joint'"
        )
    if hardness_mode is not None and hardness_mode not in HARDNESS_MODES:
        raise ValueError(
            f"hardness_mode must be None or one of {HARDNESS_MODES}, got {hardness_mode!r}"
        )
    return chosen, partition_mode == "joint"


def _documents(negatives, anchors: Tensor, name: str = "negatives") -> Tensor | None:
    """``negatives`` as ``(N, k, D)`` (a 2-D one is ``k = 1``), checked against ``anchors``."""
    if negatives is None:
        return None
    _checks.tensor(negatives, name)
    if negatives.ndim == 2:
        negatives = negatives.unsqueeze(1)
    if negatives.ndim != 3 or negatives.shape[0] != anchors.shape[0]:
        raise ValueError(
            f"{name} must be (N, D) or (N, k, D) with N = {anchors.shape[0]} (the anchors' "
            f"rows), got shape {tuple(negatives.shape)}"
        )
    if negatives.shape[1]:
        _checks.same_space(anchors, negatives[:, 0], name, "anchors")
    elif negatives.shape[2] != anchors.shape[1] or negatives.dtype != anchors.dtype:
        raise ValueError(f"{name} must match anchors' width and dtype, got {negatives.shape}")
    return negatives


def _segments(q: Tensor, p: Tensor, neg: Tensor | None, with_queries: bool) -> tuple[Tensor, ...]:
    """The columns as the caller holds them: the queries (when a direction reads them), the
    positives, the negatives (row-major, a view), in this order (:func:`_column_meta`)."""
    parts = ([q] if with_queries else []) + [p]
    if neg is not None:
        parts.append(neg.reshape(-1, neg.shape[-1]))
    return tuple(parts)


def _column_meta(n: int, k: int, with_queries: bool, row_meta: Tensor) -> Tensor:
    """``(M, 4)`` int64: each column's type, owner row, and the owner's anchor and positive
    ids (read from ``row_meta``), in :func:`_segments`' order."""
    dev = row_meta.device
    rows = torch.arange(n, device=dev)
    types = ([COL_QUERY] if with_queries else []) + [COL_POSITIVE]
    owner = [rows] * len(types)
    kinds = [torch.full((n,), t, dtype=torch.int64, device=dev) for t in types]
    if k:
        owner.append(rows.repeat_interleave(k))
        kinds.append(torch.full((n * k,), COL_NEGATIVE, dtype=torch.int64, device=dev))
    own = torch.cat(owner)
    return torch.stack([torch.cat(kinds), own, row_meta[own, 1], row_meta[own, 2]], 1)


def _ids(ids, n: int, device, name: str, fallback: Tensor) -> Tensor:
    if ids is None:
        return fallback
    return _checks.labels(ids, n, device, name, "anchors").to(torch.int64)


def _guide(guide, anchors: Tensor, neg: Tensor | None, cd, margin_strategy, margin):
    """The guide's normalised rows ``(q, p, negatives)`` and the rows' thresholds."""
    if isinstance(guide, Tensor) or not isinstance(guide, Sequence) or len(guide) not in (2, 3):
        raise TypeError(
            "guide must be (guide_anchors, guide_positives) or (guide_anchors, guide_positives, "
            f"guide_negatives), got {type(guide).__name__}"
        )
    if margin_strategy not in MARGIN_STRATEGIES:
        raise ValueError(
            f"margin_strategy must be one of {MARGIN_STRATEGIES}, got {margin_strategy!r}"
        )
    margin = _checks.hyper(margin, "margin")
    ga = _checks.embeddings(guide[0], "guide[0] (guide_anchors)")
    gp = _checks.embeddings(guide[1], "guide[1] (guide_positives)")
    _checks.same_space(ga, gp, "guide[1] (guide_positives)", "guide[0] (guide_anchors)")
    if ga.shape[0] != anchors.shape[0] or ga.device != anchors.device:
        raise ValueError(
            f"guide[0] must have the anchors' {anchors.shape[0]} rows on {anchors.device}, got "
            f"{tuple(ga.shape)} on {ga.device}"
        )
    if gp.shape[0] != anchors.shape[0]:
        raise ValueError(f"guide[1] must have {anchors.shape[0]} rows, got {tuple(gp.shape)}")
    gn = None
    if neg is not None:
        if len(guide) < 3 or guide[2] is None:
            raise ValueError("guide needs guide_negatives (guide[2]) when negatives are given")
        gn = _documents(guide[2], ga, "guide[2] (guide_negatives)")
        assert gn is not None
        if gn.shape[1] != neg.shape[1]:
            raise ValueError(
                f"guide[2] must have the negatives' k = {neg.shape[1]}, got {tuple(gn.shape)}"
            )
    elif len(guide) == 3 and guide[2] is not None:
        raise ValueError("guide has guide_negatives (guide[2]) but no negatives were given")
    ga, gp = (F.normalize(t.detach().to(cd), dim=-1) for t in (ga, gp))
    gn = None if gn is None else F.normalize(gn.detach().to(cd), dim=-1)
    pos = (ga * gp).sum(-1)
    m = margin.to(cd) if isinstance(margin, Tensor) else margin
    threshold = pos - m if margin_strategy == "absolute" else pos - pos.abs() * m
    return ga, gp, gn, threshold


class _Queue(NamedTuple):
    """A document queue as the engine reads it: its column ``segments`` in the compute dtype
    (queries where a direction reads them, then documents), their ``meta`` rows (``(M, 4)``:
    type, owner ``−1`` (no row owns them), anchor and positive ids; an empty slot's type
    :data:`~pmlfunc.losses._tiled.COL_EMPTY`), ``width`` their columns, ``queries`` the queued
    queries read (or ``None``)."""

    segments: tuple[Tensor, ...]
    meta: Tensor
    width: int
    queries: Tensor | None


def _queue(memory, q: Tensor, guide, chosen: frozenset[str], cd: torch.dtype) -> _Queue | None:
    """``memory`` checked (:func:`pmlfunc.queues.check_queue`) and laid out as columns: its
    queries when the queue holds them and a direction reads queries, then its documents."""
    if memory is None:
        return None
    if guide is not None:
        raise ValueError(
            "memory= with guide= is not supported: the guide model has no embeddings of the "
            "queued rows (mask them by ids instead)"
        )
    size, has_queries = check_queue(memory, q)
    reads_queries = bool(chosen & {"query_to_query", "doc_to_query"})
    queries = memory["queries"].detach().to(cd) if has_queries and reads_queries else None
    filled = torch.arange(size, device=q.device) < memory["count"]
    ids = (memory["anchor_ids"], memory["positive_ids"])
    owner = torch.full((size,), -1, dtype=torch.int64, device=q.device)

    def meta(col_type: int) -> Tensor:
        t = torch.where(filled, col_type, COL_EMPTY)
        return torch.stack([t, owner, *ids], 1)

    parts = [] if queries is None else [(queries, meta(COL_QUERY))]
    parts.append((memory["documents"].detach().to(cd), meta(COL_POSITIVE)))
    segs = tuple(p[0] for p in parts)
    return _Queue(segs, torch.cat([p[1] for p in parts]), size * len(parts), queries)


def _retrieval_call(
    anchors, positives, negatives, params, scale, distance, directions, partition_mode,
    hardness_mode, hardness_strength, anchor_ids, positive_ids, guide, margin_strategy, margin,
    max_logit_scale, chunk_size, reducer, memory=None, *, what=None, sigmoid=False,
) -> EngineCall:  # fmt: skip
    """The validated call as the engine runs it (:class:`~pmlfunc.losses._tiled.Retrieval`):
    ``x`` the rows (``N × roles``: query, then positive), ``y`` the columns, their metadata.
    ``sigmoid``: SigLIP's pair terms on the same candidates (:func:`pmlfunc.losses.siglip`
    with ids or a queue), its reducers and its ``params`` (a ``logit_bias`` read)."""
    what = what or "multiple_negatives_ranking"
    _checks.paired_rows(anchors, positives, ("anchors", "positives"), what)
    n = anchors.shape[0]
    neg = _documents(negatives, anchors)
    chosen, joint = _options(directions, partition_mode, hardness_mode)
    dist = resolve(distance, cosine())
    if not isinstance(dist, _Dot):
        raise ValueError(f"{what} needs distance=cosine() or dot(), got distance={dist!r}")
    red = tiled_reducer("siglip" if sigmoid else "retrieval", reducer, what)
    chunk = None if chunk_size is None else _checks.chunk_size(chunk_size)
    strength = _checks.hyper(hardness_strength, "hardness_strength", nonnegative=True)
    if isinstance(strength, Tensor) and strength.requires_grad:
        # the engine applies it to its tiles in place and forms no gradient for it: refused, not
        # silently left without one (sentence-transformers' is a fixed number too)
        raise ValueError(
            "hardness_strength must be a number or a tensor that does not require grad: it is "
            "not learnable (the engine differentiates the embeddings, the scale and the bias)"
        )
    cd = _checks.compute_dtype(anchors.dtype)
    dev = anchors.device
    if params is not None:
        if not isinstance(params, Mapping) or "logit_scale" not in params:
            raise TypeError(
                "params must be None or a dict with a 'logit_scale' entry (from "
                "pf.losses.multiple_negatives_ranking_init()), got "
                f"{params if not isinstance(params, Mapping) else sorted(params)!r}"
            )
        _params.known_keys(params, ("logit_scale", "logit_bias") if sigmoid else ("logit_scale",))
        log_t = _params.check(params, "logit_scale", anchors, ndim=0).to(cd)
        if max_logit_scale is not None:
            log_t = log_t.clamp(max=_checks.number(max_logit_scale, "max_logit_scale"))
        t: float | Tensor = log_t.exp()
    else:
        if max_logit_scale is not None:
            raise ValueError("max_logit_scale clamps params['logit_scale']: pass params")
        t = _checks.hyper(scale, "scale", positive=True)
        t = t.to(dtype=cd, device=dev) if isinstance(t, Tensor) else t
    rows_ = torch.arange(n, device=dev)
    aid = _ids(anchor_ids, n, dev, "anchor_ids", rows_)
    pid = _ids(positive_ids, n, dev, "positive_ids", rows_)
    row_meta = torch.stack([rows_, aid, pid], 1)

    q, p = anchors.to(cd), positives.to(cd)
    negs = None if neg is None else neg.to(cd)
    # the rows are normalised here (unit_rows: F.normalize with a shorter backward), the
    # columns by the engine, tile by tile: no normalised copy of the documents
    q_hat, p_hat = (unit_rows(q), unit_rows(p)) if dist.normalize else (q, p)
    queue = _queue(memory, q, guide, chosen, cd)
    # document rows for doc_to_doc, and for doc_to_query against a queue's queries (a row's
    # candidates); doc_to_query alone is read down the positives' columns of the query rows'
    # tiles (Retrieval.doc_columns)
    d2q, d2d = "doc_to_query" in chosen, "doc_to_doc" in chosen
    doc_rows = d2d or (d2q and queue is not None and queue.queries is not None)
    with_queries = "query_to_query" in chosen or (doc_rows and d2q)
    k = 0 if negs is None else negs.shape[1]
    opt = Retrieval(
        roles=2 if doc_rows else 1,
        allowed=(("query_to_query" in chosen, True, True), (d2q, d2d, d2d))[: 2 if doc_rows else 1],
        joint=joint,
        hardness=hardness_mode,
        ids=(anchor_ids is not None, positive_ids is not None),
        guide=guide is not None,
        doc_columns=d2q and not doc_rows,
        negatives=k,
        memory=0 if queue is None else queue.width,
        sigmoid=sigmoid,
    )
    x = torch.stack([q_hat, p_hat], 1).reshape(2 * n, -1) if doc_rows else q_hat
    y = _segments(q, p, negs, with_queries)
    s_t = strength.to(dtype=cd, device=dev) if isinstance(strength, Tensor) else strength
    rows: tuple = (row_meta, scalar_tensor(s_t, q))  # filled on the device: no host copy
    # the columns' metadata where a tile reads masks (none: the ring sends the columns alone)
    cols: tuple = (_column_meta(n, k, with_queries, row_meta),) if opt.masked else ()
    if queue is not None:  # after the block's own columns: Retrieval.memory
        y = (*y, *queue.segments)
        cols = (torch.cat([cols[0], queue.meta]),)
    if guide is not None:
        ga, gp, gn, threshold = _guide(guide, anchors, neg, cd, margin_strategy, margin)
        g_rows = torch.stack([ga, gp], 1).reshape(2 * n, -1) if doc_rows else ga
        rows = (*rows, g_rows, threshold)
        cols = (*cols, torch.cat(_segments(ga, gp, gn, with_queries)))
        if opt.doc_columns:  # each column's owner's threshold: a positive column's rows
            cols = (*cols, threshold[cols[0][:, 1]])
    per_row = opt.per_row  # the columns a row owns: the ring's block sizes
    if chunk is not None:  # at most the dense call's tile: M is (1 + k) N and more
        chunk = min(chunk, dense_rows(opt, x.shape[0], n * per_row + opt.memory))
    bias = None
    if sigmoid and params is not None and "logit_bias" in params:
        bias = _params.check(params, "logit_bias", anchors, ndim=0).to(cd)
    return EngineCall(
        opt, x, y, rows, cols, t, bias, chunk, red, columns_per_row=per_row,
        unit=dist.normalize,
    )  # fmt: skip


_PARAMETERS = tuple(inspect.signature(multiple_negatives_ranking).parameters)


def _engine_call(a, what: str | None) -> EngineCall:
    """``multiple_negatives_ranking``'s bound arguments ``a`` as the engine's call (the ring's)."""
    return _retrieval_call(*(a[name] for name in _PARAMETERS), what=what)


builds(multiple_negatives_ranking)(_engine_call)
