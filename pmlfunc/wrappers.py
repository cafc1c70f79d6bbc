r"""Loss wrappers as pure functions with explicit state.

Cross-batch memory (PML ``CrossBatchMemory``): the loss of a batch against a queue of earlier
batches' embeddings. PML keeps the queue and its fill position as module state (a Python-int
index, so a compiled step would recompile as it moves). Here the memory is a plain dict of
tensors that the step takes and returns:

    >>> memory = cross_batch_memory_init(memory_size=1024, embedding_size=128)
    >>> loss, memory = cross_batch_memory(pf.losses.contrastive, emb, labels, memory)

| key | shape | meaning |
|---|---|---|
| ``"embeddings"`` | ``(S, D)`` | the queue (detached) |
| ``"labels"`` | ``(S,)`` int64 | their labels |
| ``"index"`` | ``()`` int64 | the next slot to write |
| ``"count"`` | ``()`` int64 | how many slots hold an embedding (``≤ S``) |

Every shape is static and nothing is read on the host, so the step compiles with
``fullgraph=True`` and can be captured in a CUDA graph, the memory's tensors updated in place
by the caller (``for k in memory: memory[k].copy_(new[k])``) between replays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import _checks
from .tuples import MinedPairs, MinedTriplets, TripletMask, TripletWindow

__all__ = ["cross_batch_memory", "cross_batch_memory_init", "enqueue"]

_KEYS = ("embeddings", "labels", "index", "count")


def cross_batch_memory_init(
    memory_size: int,
    embedding_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """An empty cross-batch memory (see the module docstring for its keys).

    Args:
        memory_size: ``S``, the number of embeddings kept (PML's default is 1024).
        embedding_size: ``D``.
        dtype, device: of the stored embeddings (labels are int64).

    Example:
        >>> memory = cross_batch_memory_init(512, 64)
        >>> memory["embeddings"].shape
        torch.Size([512, 64])
    """
    for name, v in (("memory_size", memory_size), ("embedding_size", embedding_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    return {
        "embeddings": torch.zeros(memory_size, embedding_size, dtype=dtype, device=device),
        "labels": torch.zeros(memory_size, dtype=torch.int64, device=device),
        "index": torch.zeros((), dtype=torch.int64, device=device),
        "count": torch.zeros((), dtype=torch.int64, device=device),
    }


def _check_memory(memory: object, embeddings: Tensor) -> tuple[int, int]:
    if not isinstance(memory, dict) or set(memory) != set(_KEYS):
        raise TypeError(
            f"memory must be the dict made by cross_batch_memory_init (keys {_KEYS}), "
            f"got {type(memory).__name__}"
        )
    mem = memory["embeddings"]
    if not isinstance(mem, Tensor) or mem.ndim != 2:
        raise ValueError("memory['embeddings'] must be a (memory_size, embedding_size) tensor")
    if mem.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"memory holds embeddings of size {mem.shape[1]} but embeddings have size {embeddings.shape[1]}"
        )
    if mem.device != embeddings.device:
        raise ValueError(f"memory is on {mem.device} but embeddings are on {embeddings.device}")
    if embeddings.shape[0] > mem.shape[0]:
        raise ValueError(
            f"the batch ({embeddings.shape[0]} rows) is larger than the memory ({mem.shape[0]} slots)"
        )
    return mem.shape[0], embeddings.shape[0]


def enqueue(
    memory: dict[str, Tensor], embeddings: Tensor, labels: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """Write a batch into the memory's ring buffer (detached), oldest slots first.

    Returns the new memory and the slot each row went to (``(B,)`` int64). The input memory is
    not modified.

    Example:
        >>> memory, slots = enqueue(memory, emb, labels)
    """
    _checks.embeddings(embeddings)
    _checks.labels(labels, embeddings.shape[0], embeddings.device)
    size, b = _check_memory(memory, embeddings)
    slots = (memory["index"] + torch.arange(b, device=embeddings.device)) % size
    stored = memory["embeddings"]
    new = {
        "embeddings": stored.index_copy(0, slots, embeddings.detach().to(stored.dtype)),
        "labels": memory["labels"].index_copy(0, slots, labels.to(torch.int64)),
        "index": (memory["index"] + b) % size,
        "count": torch.clamp_max(memory["count"] + b, size),
    }
    return new, slots


def _restrict(mined: Any, pos_keep: Tensor, neg_keep: Tensor, filled: Tensor) -> Any:
    """A miner result with pairs outside ``pos_keep``/``neg_keep`` removed."""
    if isinstance(mined, MinedPairs):
        return MinedPairs(mined.pos * pos_keep, mined.neg * neg_keep)
    if isinstance(mined, MinedTriplets):
        a, p, n = mined.anchors.long(), mined.positives.long(), mined.negatives.long()
        keep = pos_keep[a, p] * neg_keep[a, n]
        return mined._replace(valid=mined.valid * keep.to(mined.valid.dtype))
    if isinstance(mined, TripletWindow):
        return mined._replace(pos=mined.pos * pos_keep, neg=mined.neg * neg_keep)
    if isinstance(mined, TripletMask):
        keep = (pos_keep > 0).unsqueeze(-1) & (neg_keep > 0).unsqueeze(-2)
        return TripletMask(mined.mask & keep)
    raise TypeError(
        "miner must return a pmlfunc miner result (pf.miners.*), got " + type(mined).__name__
    )


def cross_batch_memory(
    loss_fn: Callable[..., Tensor],
    embeddings: Tensor,
    labels: Tensor,
    memory: dict[str, Tensor],
    *,
    miner: Callable[..., Any] | None = None,
    **loss_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""The loss of a batch against a memory of earlier batches (PML ``CrossBatchMemory``).

    As in PML, the batch is enqueued first, then ``loss_fn(embeddings, labels,
    ref_emb=memory, ref_labels=memory_labels, indices_tuple=pairs)`` is computed over the filled
    slots, where ``pairs`` are every (anchor, memory slot) pair with equal / different labels
    except each anchor with its own freshly enqueued slot (PML's ``remove_self_comparisons``).
    With ``miner``, ``miner(embeddings, labels, ref_emb=..., ref_labels=...)`` is mined against
    the memory instead and then restricted the same way.

    Args:
        loss_fn: a pmlfunc embedding loss (``pf.losses.contrastive``, ``ntxent``, ``supcon``,
            ``triplet_margin``, ``multi_similarity``, ...) or a ``functools.partial`` of one.
        embeddings: ``(B, D)`` with ``B ≤ memory_size``; labels: ``(B,)``.
        memory: the state from :func:`cross_batch_memory_init` (or a previous call).
        miner: optional, e.g. ``pf.miners.multi_similarity`` (a ``functools.partial`` for its
            keyword arguments).
        **loss_kwargs: passed to ``loss_fn`` (``temperature=``, ``distance=``, ...).

    Returns:
        ``(loss, new_memory)``.

    Before the memory is full, the unfilled slots never form pairs (PML slices them off). A
    miner still sees them as candidates before its result is restricted, so a miner that picks
    one candidate per anchor (batch-hard, HDC, multi-similarity) can differ from PML's during the
    first ``memory_size / batch_size`` steps; once the memory is full they agree.

    Example:
        >>> memory = cross_batch_memory_init(256, 16)
        >>> loss, memory = cross_batch_memory(pf.losses.contrastive, emb, labels, memory)

    Reference: Wang et al., "Cross-Batch Memory for Embedding Learning", CVPR 2020.
    """
    if "ref_emb" in loss_kwargs or "ref_labels" in loss_kwargs or "indices_tuple" in loss_kwargs:
        raise ValueError("cross_batch_memory supplies ref_emb, ref_labels and indices_tuple itself")
    memory, slots = enqueue(memory, embeddings, labels)
    mem_emb, mem_labels = memory["embeddings"], memory["labels"]
    size = mem_emb.shape[0]
    filled = (torch.arange(size, device=mem_emb.device) < memory["count"]).to(torch.float32)
    same = (labels.unsqueeze(-1) == mem_labels.unsqueeze(0)).to(torch.float32)
    own = torch.zeros_like(same).scatter(
        -1, slots.unsqueeze(-1), torch.ones_like(same[:, :1])
    )  # (anchor, its own slot)
    pos_keep = same * filled * (1.0 - own)
    neg_keep = (1.0 - same) * filled
    ref = mem_emb.to(embeddings.dtype)
    if miner is None:
        pairs: Any = MinedPairs(pos_keep, neg_keep)
    else:
        mined = miner(embeddings, labels, ref_emb=ref, ref_labels=mem_labels)
        pairs = _restrict(mined, pos_keep, neg_keep, filled)
    loss = loss_fn(
        embeddings, labels, ref_emb=ref, ref_labels=mem_labels, indices_tuple=pairs, **loss_kwargs
    )
    return loss, memory
