r"""Two-tower negative memory: a queue of earlier steps' documents (and queries) as explicit state.

In-batch negatives give a query ``N − 1`` negatives; gradient accumulation does not add any.
A document queue (MoCo's, for two towers) keeps the last ``S`` documents the document tower
embedded, detached, and the retrieval losses read them as extra negatives of every query
(:func:`pmlfunc.losses.multiple_negatives_ranking`, :func:`pmlfunc.losses.clip` and
:func:`pmlfunc.losses.siglip`, argument ``memory=``; SigLIP's queued documents are negative
pairs of every row). With ``queries=True`` it keeps the queries too, read by the directions that read
queries (``doc_to_query``, ``query_to_query``). The queue is a plain dict of tensors that the
step takes and returns:

    >>> queue = pf.queues.document_queue_init(4096, 128)
    >>> q, d = torch.randn(8, 128), torch.randn(8, 128)
    >>> loss = pf.losses.multiple_negatives_ranking(q, d, memory=queue)
    >>> queue = pf.queues.document_queue_push(queue, d)

| key | shape | meaning |
|---|---|---|
| ``"documents"`` | ``(S, D)`` | the queued documents (detached) |
| ``"queries"`` | ``(S, D)`` | their queries (``queries=True`` only) |
| ``"anchor_ids"`` | ``(S,)`` int64 | each entry's query id (:data:`NO_ID` when none was given) |
| ``"positive_ids"`` | ``(S,)`` int64 | each entry's document id (:data:`NO_ID` when none was given) |
| ``"index"`` | ``()`` int64 | the next slot to write |
| ``"count"`` | ``()`` int64 | how many slots hold an entry (``≤ S``) |

Rules:

- **Order**: compute the loss, then push the batch (a batch pushed first would be its own
  negative). :func:`document_queue_push` overwrites the oldest slots (a ring buffer, FIFO) and
  returns a new dict; the input is not modified. A push holds at most ``S`` rows.
- **Ids**: a queued entry whose anchor id equals a row's anchor id (the same query, seen
  before) or whose positive id equals a row's positive id (the same document) is not a
  negative of that row, exactly as for another row of the batch: push the ids the loss is
  given (dataset ids, stable across steps). The loss compares the ids the batch gives
  (``anchor_ids=``/``positive_ids=``); entries pushed without ids never match.
- **Empty slots** are read by no row: a queue with ``count = 0`` gives the loss without memory.
- **Gradients**: none flow into the queue (it holds detached rows; MoCo's momentum encoder,
  if any, is the caller's).
- **DDP**: every rank must hold the same queue. Push the global batch: gather the documents
  (and ids) with :func:`pmlfunc.distributed.all_gather` and push them on every rank, and
  compute the loss with ``global_objective(loss)``: the gather passes the queue through as it
  passes ``ref_emb``; the ring (``exchange="ring"``) does not send it, each rank reads its own
  copy once after the ring's steps. Then every rank's queue holds the
  same global entries and the loss is the single-process loss of the global batch against it.

Every shape is static and nothing is read on the host, so a step with a push compiles with
``fullgraph=True`` and can be captured in a CUDA graph (copy the returned tensors into the
captured ones between replays, as for :func:`pmlfunc.wrappers.cross_batch_memory`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks

__all__ = ["NO_ID", "document_queue_init", "document_queue_push"]

NO_ID = -(2**63)
"""The id of an entry pushed without ids: equal to no id a batch gives in practice."""

_IDS = ("anchor_ids", "positive_ids")
_COUNTERS = ("index", "count")


def document_queue_init(
    size: int,
    embedding_size: int,
    *,
    queries: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """An empty document queue (the module docstring lists its keys).

    Args:
        size: ``S``, the entries kept (e.g. 4,096 to 65,536; MoCo's default is 65,536).
        embedding_size: ``D``, the documents' (and queries') width.
        queries: keep the queries too (for ``doc_to_query`` / ``query_to_query`` against the
            queue, CLIP's second direction).
        dtype, device: of the stored rows (ids and counters are int64). Store float32 (the
            default) for bfloat16 training to keep the queue's logits exact to float32.

    Example:
        >>> queue = pf.queues.document_queue_init(1024, 64, queries=True)
        >>> sorted(queue)
        ['anchor_ids', 'count', 'documents', 'index', 'positive_ids', 'queries']
    """
    _checks.integer(size, "size")
    _checks.integer(embedding_size, "embedding_size")
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    rows = torch.zeros(size, embedding_size, dtype=dtype, device=device)
    queue = {"documents": rows}
    if queries:
        queue["queries"] = rows.clone()
    for key in _IDS:
        queue[key] = torch.full((size,), NO_ID, dtype=torch.int64, device=device)
    for key in _COUNTERS:
        queue[key] = torch.zeros((), dtype=torch.int64, device=device)
    return queue


def check_queue(queue: object, like: Tensor, name: str = "memory") -> tuple[int, bool]:
    """``(S, holds queries)`` after checking ``queue`` as :func:`document_queue_init` makes it,
    against ``like`` (the batch's rows: width and device): keys, shapes, dtypes and devices
    (metadata only), then ``0 ≤ count ≤ S`` and ``0 ≤ index < S`` where that costs no host
    sync (:func:`pmlfunc._checks.in_range`)."""
    if not isinstance(queue, dict) or "documents" not in queue:
        raise TypeError(
            f"{name} must be the dict made by pf.queues.document_queue_init, got "
            f"{type(queue).__name__}"
        )
    keys = {"documents", *_IDS, *_COUNTERS}
    extra = set(queue) - keys - {"queries"}
    missing = keys - set(queue)
    if extra or missing:
        raise TypeError(
            f"{name} must be the dict made by pf.queues.document_queue_init: "
            f"missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    for key, t in queue.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{key!r}] must be a tensor, got {type(t).__name__}")
        if t.device != like.device:
            raise ValueError(f"{name}[{key!r}] is on {t.device}, expected {like.device}")
    docs = queue["documents"]
    size = docs.shape[0] if docs.ndim == 2 else -1
    for key in ("documents", "queries"):
        t = queue.get(key)
        if t is None:
            continue
        if t.dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"{name}[{key!r}] must be floating-point, got {t.dtype}")
        if t.shape != (size, like.shape[-1]):
            raise ValueError(
                f"{name}[{key!r}] must be ({max(size, 0)}, {like.shape[-1]}) (slots, the "
                f"embeddings' width), got {tuple(t.shape)}"
            )
    for key, shape in [(k, (size,)) for k in _IDS] + [(k, ()) for k in _COUNTERS]:
        t = queue[key]
        if t.dtype != torch.int64 or tuple(t.shape) != shape:
            raise ValueError(
                f"{name}[{key!r}] must be int64 of shape {shape}, got {t.dtype} {tuple(t.shape)}"
            )
    check_counters(queue, size, name)
    return size, "queries" in queue


def check_counters(state: dict[str, Tensor], size: int, name: str, noun: str = "queue") -> None:
    """``0 ≤ state["count"] ≤ size`` and ``0 ≤ state["index"] < size`` where that costs no host
    sync (:func:`pmlfunc._checks.in_range`): a ring buffer's counters."""
    slots = f"for a {noun} of {size} slots"
    _checks.in_range(state["count"], 0, size + 1, f"{name}['count']", slots, ValueError)
    _checks.in_range(state["index"], 0, size, f"{name}['index']", slots, ValueError)


def ring_write(state: dict[str, Tensor], size: int, b: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Where a push of ``b ≤ size`` rows goes in a ring buffer of ``size`` slots: the slots
    ``(b,)`` (the oldest first, from ``state["index"]``) and the new counters ``{"index",
    "count"}`` (no host sync)."""
    index = state["index"]
    slots = (index + torch.arange(b, device=index.device)) % size
    counters = {"index": (index + b) % size, "count": torch.clamp_max(state["count"] + b, size)}
    return slots, counters


def document_queue_push(
    queue: dict[str, Tensor],
    documents: Tensor,
    *,
    queries: Tensor | None = None,
    anchor_ids: Tensor | None = None,
    positive_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """``queue`` with ``documents`` (and their ``queries`` and ids) written over its oldest
    slots, detached; a new dict (the input is not modified).

    Args:
        queue: from :func:`document_queue_init` or an earlier push.
        documents: ``(B, D)`` with ``B ≤ S``: the rows to queue (a batch's positives; hard
            negatives too, flattened, if they should stay negatives of later steps).
        queries: ``(B, D)``, the queries of those rows: required when the queue holds queries,
            refused otherwise.
        anchor_ids, positive_ids: ``(B,)`` integer ids (the loss's ``anchor_ids`` /
            ``positive_ids`` of the same rows); ``None`` stores :data:`NO_ID`.

    Example:
        >>> queue = pf.queues.document_queue_init(4, 2)
        >>> queue = pf.queues.document_queue_push(
        ...     queue, torch.randn(3, 2), positive_ids=torch.tensor([7, 8, 9])
        ... )
        >>> queue["positive_ids"][:3].tolist(), int(queue["count"])
        ([7, 8, 9], 3)
    """
    docs = _checks.embeddings(documents, "documents")
    size, with_queries = check_queue(queue, docs, "queue")
    b = docs.shape[0]
    if b > size:
        raise ValueError(f"documents has {b} rows, more than the queue's {size} slots")
    rows = {"documents": docs}
    if with_queries:
        if queries is None:
            raise ValueError("this queue holds queries (queries=True at init): pass queries=")
        rows["queries"] = _checks.paired_rows(
            docs, queries, ("documents", "queries"), "document_queue_push"
        )[1]
    elif queries is not None:
        raise ValueError("this queue holds no queries: init it with queries=True to push them")
    slots, counters = ring_write(queue, size, b)
    new = {}
    for key, value in rows.items():
        stored = queue[key]
        new[key] = stored.index_copy(0, slots, value.detach().to(stored.dtype))
    for key, ids in (("anchor_ids", anchor_ids), ("positive_ids", positive_ids)):
        if ids is None:
            value = torch.full((b,), NO_ID, dtype=torch.int64, device=docs.device)
        else:
            value = _checks.labels(ids, b, docs.device, key, "documents").to(torch.int64)
        new[key] = queue[key].index_copy(0, slots, value)
    return {**new, **counters}
