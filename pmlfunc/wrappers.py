r"""Loss wrappers as pure functions: cross-batch memory (explicit state), self-supervised views,
a weighted combination of losses and miners.

Cross-batch memory (PML ``CrossBatchMemory``): the loss of a batch against a queue of earlier
batches' embeddings. PML keeps the queue and its fill position as module state (a Python-int
index, so a compiled step would recompile as it moves). Here the memory is a plain dict of
tensors that the step takes and returns:

    >>> emb, labels = torch.randn(8, 128), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
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
from ._ops import readable
from .queues import check_counters, ring_write
from .tuples import MinedPairs, MinedTriplets, TripletMask, TripletWindow

__all__ = [
    "cross_batch_memory",
    "cross_batch_memory_init",
    "enqueue",
    "multiple_losses",
    "self_supervised",
]

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
    _checks.integer(memory_size, "memory_size")
    _checks.integer(embedding_size, "embedding_size")
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    return {
        "embeddings": torch.zeros(memory_size, embedding_size, dtype=dtype, device=device),
        "labels": torch.zeros(memory_size, dtype=torch.int64, device=device),
        "index": torch.zeros((), dtype=torch.int64, device=device),
        "count": torch.zeros((), dtype=torch.int64, device=device),
    }


def _check_memory(memory: object, embeddings: Tensor) -> tuple[int, int]:
    """``(memory_size, batch rows)`` after checking the state: the keys, each tensor's shape,
    dtype and device (always: metadata only), then ``0 ≤ count ≤ size`` and
    ``0 ≤ index < size`` where that costs no host sync (:func:`pmlfunc._checks.in_range`: a
    ``ValueError`` in eager mode on CPU, a device-side assert on CUDA and under
    ``torch.compile``, not checked on ``meta`` or inside ``torch.func`` transforms)."""
    if not isinstance(memory, dict) or set(memory) != set(_KEYS):
        raise TypeError(
            f"memory must be the dict made by cross_batch_memory_init (keys {_KEYS}), "
            f"got {type(memory).__name__}"
        )
    for key in _KEYS:
        if not isinstance(memory[key], Tensor):
            raise TypeError(f"memory[{key!r}] must be a tensor, got {type(memory[key]).__name__}")
    mem = memory["embeddings"]
    if mem.ndim != 2:
        raise ValueError("memory['embeddings'] must be a (memory_size, embedding_size) tensor")
    if mem.dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"memory['embeddings'] must be floating-point, got {mem.dtype}")
    size = mem.shape[0]
    for key, shape in (("labels", (size,)), ("index", ()), ("count", ())):
        t = memory[key]
        if t.dtype != torch.int64:
            raise TypeError(f"memory[{key!r}] must be int64, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"memory[{key!r}] has shape {tuple(t.shape)}, expected {shape} "
                f"(memory['embeddings'] has {size} slots)"
            )
    if mem.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"memory holds embeddings of size {mem.shape[1]} but embeddings have size {embeddings.shape[1]}"
        )
    for key in _KEYS:
        if memory[key].device != embeddings.device:
            raise ValueError(
                f"memory[{key!r}] is on {memory[key].device}, expected {embeddings.device} "
                "(the embeddings' device)"
            )
    if embeddings.shape[0] > size:
        raise ValueError(
            f"the batch ({embeddings.shape[0]} rows) is larger than the memory ({size} slots)"
        )
    check_counters(memory, size, "memory", "memory")
    return size, embeddings.shape[0]


def enqueue(
    memory: dict[str, Tensor], embeddings: Tensor, labels: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """Write a batch into the memory's ring buffer (detached), oldest slots first.

    Returns the new memory and the slot each row went to (``(B,)`` int64). The input memory is
    not modified; it is checked as :func:`cross_batch_memory` says.

    Example:
        >>> memory = cross_batch_memory_init(4, 2)
        >>> memory, slots = enqueue(memory, torch.randn(3, 2), torch.tensor([5, 6, 7]))
        >>> slots.tolist(), memory["labels"].tolist()
        ([0, 1, 2], [5, 6, 7, 0])
    """
    _checks.embeddings(embeddings)
    _checks.labels(labels, embeddings.shape[0], embeddings.device)
    size, b = _check_memory(memory, embeddings)
    slots, counters = ring_write(memory, size, b)
    stored = memory["embeddings"]
    new = {
        "embeddings": stored.index_copy(0, slots, embeddings.detach().to(stored.dtype)),
        "labels": memory["labels"].index_copy(0, slots, labels.to(torch.int64)),
        **counters,
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

    Before the memory is full, the loss and the miner read the filled slots only, as PML's
    slice: in eager mode on a CPU, where the count is read for free. Elsewhere (CUDA, compiled,
    inside ``torch.func``: no host sync, fixed shapes) every slot is passed and the unfilled
    ones never form pairs, which is the same loss for every loss whose terms are its pairs; but
    ``nca`` and ``angular`` also read references outside the pairs (NCA's softmax over every
    reference, angular's negative term), and a miner that picks one candidate per anchor
    (batch-hard, HDC, multi-similarity) sees the empty slots as candidates before its result is
    restricted: those differ from PML's during the first ``memory_size / batch_size`` steps
    there, and agree once the memory is full.

    The state is checked on every call (and by :func:`enqueue`): a tensor of another dtype,
    shape or device than :func:`cross_batch_memory_init` makes raises a ``TypeError`` or
    ``ValueError`` naming it (``memory['labels'] is on meta, expected cpu``). Its values,
    ``0 ≤ count ≤ memory_size`` and ``0 ≤ index < memory_size``, are read where that costs no
    host sync: a ``ValueError`` in eager mode on CPU, a device-side assert
    (``torch._assert_async``, a ``RuntimeError`` when it fires) on CUDA and under
    ``torch.compile``; not on ``meta`` (no values) nor inside ``torch.func`` transforms (the
    assert has no batching rule).

    Example:
        >>> emb, labels = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> memory = cross_batch_memory_init(256, 16)
        >>> loss, memory = cross_batch_memory(pf.losses.contrastive, emb, labels, memory)

    Reference: Wang et al., "Cross-Batch Memory for Embedding Learning", CVPR 2020.
    """
    if "ref_emb" in loss_kwargs or "ref_labels" in loss_kwargs or "indices_tuple" in loss_kwargs:
        raise ValueError("cross_batch_memory supplies ref_emb, ref_labels and indices_tuple itself")
    memory, slots = enqueue(memory, embeddings, labels)
    mem_emb, mem_labels = memory["embeddings"], memory["labels"]
    size, index, count = mem_emb.shape[0], memory["index"], memory["count"]
    # the filled slots are the `count` last written, up to `index` (slots 0 .. count − 1 from
    # an initial memory, before the ring wraps)
    if readable(count) and int(count) < size:  # PML's slice of the filled slots, oldest first
        n = int(count)
        start = index - n
        kept = (start + torch.arange(n, device=index.device)) % size
        mem_emb, mem_labels = mem_emb.index_select(0, kept), mem_labels.index_select(0, kept)
        slots = (slots - start) % size  # each row's place among them
        filled = torch.ones(n, device=mem_emb.device)
    else:
        age = (index - 1 - torch.arange(size, device=mem_emb.device)) % size  # 0: the newest
        filled = (age < count).to(torch.float32)
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


def self_supervised(
    loss_fn: Callable[..., Tensor],
    embeddings: Tensor,
    *views: Tensor,
    symmetric: bool = True,
    **loss_kwargs: Any,
) -> Tensor:
    r"""A metric loss on augmented views, with the labels made for you (PML ``SelfSupervisedLoss``).

    Row ``i`` of every view is the same input, so the label of row ``i`` is ``i``. With
    ``symmetric=True`` (PML's default) the views are stacked into one batch of ``V·B`` rows with
    labels ``[0..B−1] · V`` and every view serves as anchors; with ``symmetric=False`` the first
    view is the query set and the others the reference set (``ref_emb``: nothing excluded).
    PML 2.9.0 takes exactly two views; any number ``V ≥ 2`` works here (two views give PML's
    numbers).

    Args:
        loss_fn: a pmlfunc embedding loss (or a ``functools.partial`` of one).
        embeddings: ``(B, D)``, the first view.
        *views: one or more further ``(B, D)`` views.
        symmetric: default ``True``.
        **loss_kwargs: passed to ``loss_fn``.

    Example:
        >>> view1, view2 = torch.randn(8, 4), torch.randn(8, 4)
        >>> loss = self_supervised(pf.losses.ntxent, view1, view2, temperature=0.1)

    Reference: PML issue #411; Chen et al., "A Simple Framework for Contrastive Learning of
    Visual Representations" (SimCLR), ICML 2020.
    """
    _checks.embeddings(embeddings)
    if not views:
        raise ValueError("self_supervised needs at least two views: embeddings and one more")
    for k, v in enumerate(views):
        _checks.embeddings(v, f"views[{k}]")
        _checks.same_space(embeddings, v, f"views[{k}]")
        if v.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"views[{k}] has {v.shape[0]} rows but embeddings has {embeddings.shape[0]}"
            )
    for key in ("labels", "ref_emb", "ref_labels"):
        if key in loss_kwargs:
            raise ValueError(f"self_supervised makes {key} itself")
    b = embeddings.shape[0]
    labels = torch.arange(b, device=embeddings.device)
    if symmetric:
        stacked = torch.cat([embeddings, *views], 0)
        return loss_fn(stacked, labels.repeat(len(views) + 1), **loss_kwargs)
    ref = views[0] if len(views) == 1 else torch.cat(views, 0)
    return loss_fn(
        embeddings, labels, ref_emb=ref, ref_labels=labels.repeat(len(views)), **loss_kwargs
    )


def multiple_losses(
    losses: dict[str, Callable[..., Tensor]] | list[Callable[..., Tensor]],
    *,
    miners: dict[str, Callable[..., Any]] | list[Callable[..., Any] | None] | None = None,
    weights: dict[str, float | Tensor] | list[float | Tensor] | None = None,
) -> Callable[..., Tensor]:
    r"""A weighted sum of losses, each with its own optional miner (PML ``MultipleLosses``).

    Returns ``fn(embeddings, labels, indices_tuple=None, **kwargs) = Σ_i w_i · loss_i(embeddings,
    labels, indices_tuple=miner_i(embeddings, labels) or indices_tuple, **kwargs)``. Losses,
    miners and weights are a list (miners aligned by position, ``None`` for none) or a dict
    (miners for some of the keys; weights for all of them). Default weights are 1. Passing an
    ``indices_tuple`` together with miners is an error, as in PML.

    Example:
        >>> fn = multiple_losses(
        ...     {"tri": pf.losses.triplet_margin, "con": pf.losses.contrastive},
        ...     miners={"tri": pf.miners.batch_hard}, weights={"tri": 1.0, "con": 0.5})
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = fn(emb, labels)
    """
    is_dict = isinstance(losses, dict)
    if not is_dict and not isinstance(losses, (list, tuple)):
        raise TypeError(
            f"losses must be a dict or a list of loss functions, got {type(losses).__name__}"
        )
    # the dict's keys (str) or the list's positions (int): whatever indexes losses
    keys: list[Any] = list(losses) if is_dict else list(range(len(losses)))
    if not keys:
        raise ValueError("losses is empty")
    for k in keys:
        if not callable(losses[k]):
            raise TypeError(f"losses[{k!r}] must be a loss function")

    def aligned(x: Any, name: str, all_keys: bool) -> dict[Any, Any]:
        if x is None:
            return {}
        if is_dict:
            if not isinstance(x, dict):
                raise TypeError(f"{name} must be a dict like losses")
            extra = set(x) - set(keys)
            if extra or (all_keys and set(x) != set(keys)):
                raise ValueError(f"{name} keys must match the losses' keys {keys}, got {list(x)}")
            return dict(x)
        if not isinstance(x, (list, tuple)) or len(x) != len(keys):
            raise ValueError(f"{name} must be a list of the same length as losses ({len(keys)})")
        return dict(enumerate(x))

    miner_of = {k: m for k, m in aligned(miners, "miners", False).items() if m is not None}
    weight_of = aligned(weights, "weights", True)
    for k in keys:
        _checks.hyper(weight_of.get(k, 1.0), f"weights[{k!r}]")

    def combined(
        embeddings: Tensor, labels: Tensor | None = None, indices_tuple=None, **kwargs: Any
    ) -> Tensor:
        if miner_of and indices_tuple is not None:
            raise ValueError("indices_tuple cannot be given when miners are set")
        total: Tensor | None = None
        for k in keys:
            it = miner_of[k](embeddings, labels) if k in miner_of else indices_tuple
            term = losses[k](embeddings, labels, indices_tuple=it, **kwargs) * weight_of.get(k, 1.0)
            total = term if total is None else total + term
        assert total is not None  # keys is not empty (checked above)
        return total

    return combined
