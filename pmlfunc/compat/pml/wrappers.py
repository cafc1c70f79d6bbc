"""PML 2.9.0's loss wrappers ``CrossBatchMemory`` and ``MultipleLosses``
(``pytorch_metric_learning.losses``; also re-exported from ``pmlfunc.compat.pml.losses``) over
:func:`pmlfunc.wrappers.cross_batch_memory` and :func:`pmlfunc.wrappers.multiple_losses`.

``CrossBatchMemory(loss, embedding_size, memory_size=1024, miner=None)`` holds the queue as
PML's buffers ``embedding_memory`` ``(memory_size, embedding_size)`` and ``label_memory``
``(memory_size,)`` int64 (so PML's state dict loads, strictly, and the other way round), and the
queue position as two non-persistent int64 buffers read through PML's attributes
``queue_idx`` and ``has_been_filled`` (properties: reading one is a host synchronisation, as
PML's Python ints are; setting one sets the buffer). Each call hands the buffers to
:func:`~pmlfunc.wrappers.cross_batch_memory` as its state dict and copies the new state back
in place. ``loss`` is one of PML's supported losses as a compat class (PML's
``supported_losses()``; anything else raises as PML does) or a pmlfunc loss function; ``miner``
a compat miner or a pmlfunc miner function. The memory follows the embeddings' dtype and device
at each call, as PML's does. ``reset_queue()`` empties it.

``MultipleLosses(losses, miners=None, weights=None)``: losses and miners as a list (miners
aligned by position, ``None`` for none) or a dict (miners for some keys, weights for all), held
as PML's ``nn.ModuleList`` / ``nn.ModuleDict`` (PML's state-dict names); ``loss(embeddings,
labels, indices_tuple=None)`` is the weighted sum.

Not provided (PML has them, the functions do not): ``CrossBatchMemory``'s ``enqueue_mask``
(enqueue some rows, use the others as queries) and an ``indices_tuple`` added to the memory's
pairs (both raise ``ValueError``); PML's loss and miner *classes* in place of the compat ones
(``TypeError``: the function passes its pairs as a pmlfunc miner result); ``curr_batch_idx``
and the recordable statistics.

Differs from PML: with a miner that keeps one candidate per anchor (batch-hard, HDC,
multi-similarity), the mined tuples can differ from PML's until the memory has been filled once
(the function's miner sees the empty slots as candidates before restricting to filled ones;
:func:`~pmlfunc.wrappers.cross_batch_memory`); threshold miners (pair margin, triplet margin)
and no miner agree from the first call. HDC's fraction cut can fall between two pairs of equal
distance (``(i, j)`` and ``(j, i)`` of a self matrix) at any call, filled or not: pmlfunc keeps
the first by position, PML's ``topk`` its own choice (:func:`pmlfunc.miners.hdc`), so the
triplets it feeds the loss can differ there. ``MultipleLosses`` with miners rejects an
``indices_tuple`` with ``ValueError`` (PML: ``AssertionError``), and only when a miner is set
(PML: also with a list of ``None`` miners).

Example:
    >>> from pmlfunc.compat.pml import losses, miners
    >>> memory = losses.CrossBatchMemory(losses.ContrastiveLoss(), 16, memory_size=64)
    >>> emb, labels = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> loss = memory(emb, labels)
    >>> memory.queue_idx, memory.has_been_filled, sorted(memory.state_dict())
    (8, False, ['embedding_memory', 'label_memory'])
    >>> both = losses.MultipleLosses(
    ...     [losses.NTXentLoss(), losses.ContrastiveLoss()],
    ...     miners=[miners.BatchHardMiner(), None], weights=[1.0, 0.5])
    >>> both(emb, labels).shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ... import wrappers as _w
from ._base import Loss, Miner, no_grad_copy, required

__all__ = ["CrossBatchMemory", "MultipleLosses"]

# PML 2.9.0's CrossBatchMemory.supported_losses()
_SUPPORTED = (
    "AngularLoss",
    "CircleLoss",
    "ContrastiveLoss",
    "GeneralizedLiftedStructureLoss",
    "IntraPairVarianceLoss",
    "LiftedStructureLoss",
    "MarginLoss",
    "MultiSimilarityLoss",
    "NCALoss",
    "NTXentLoss",
    "SignalToNoiseRatioContrastiveLoss",
    "SupConLoss",
    "TripletMarginLoss",
    "TupletMarginLoss",
)


def _not_pml(value: Any, name: str) -> None:
    """``TypeError`` for one of PML's own losses or miners (the compat class is needed)."""
    if type(value).__module__.startswith("pytorch_metric_learning"):
        raise TypeError(
            f"{name} must be a pmlfunc.compat.pml class or a pmlfunc function, got PML's "
            f"{type(value).__name__}: import it from pmlfunc.compat.pml instead"
        )


def _pure_miner(miner: Any) -> Callable[..., Any] | None:
    """The function :func:`pmlfunc.wrappers.cross_batch_memory` calls for ``miner``: a compat
    miner's function with its arguments as they stand now (its fixed-shape result, not PML's
    tuple), a pmlfunc miner function as it is."""
    if miner is None or not isinstance(miner, Miner):
        return miner
    function = type(miner).function

    def mine(embeddings: Tensor, labels: Tensor, **inputs: Any) -> Any:
        return function(embeddings, labels, **miner.options(), **inputs)

    return mine


class CrossBatchMemory(Loss):
    """PML's ``CrossBatchMemory``: the loss of a batch against a queue of earlier batches
    (module docstring)."""

    signature = ("loss", "embedding_size", "memory_size", "miner")
    defaults = {
        "loss": required(),
        "embedding_size": required(),
        "memory_size": 1024,
        "miner": None,
    }
    shared = ()
    consumed = signature

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        loss, miner = self.argument("loss"), self.argument("miner")
        _not_pml(loss, "loss")
        _not_pml(miner, "miner")
        if isinstance(loss, Loss):
            self.check_loss_support(type(loss).__name__)
        elif not callable(loss):
            raise TypeError(f"loss must be a compat loss or a loss function, got {loss!r}")
        if miner is not None and not callable(miner):
            raise TypeError(f"miner must be a compat miner or a miner function, got {miner!r}")
        self.reset_queue()

    @staticmethod
    def supported_losses() -> list[str]:
        """PML's list of the losses it wraps (compat classes of these names are accepted)."""
        return list(_SUPPORTED)

    @classmethod
    def check_loss_support(cls, loss_name: str) -> None:
        if loss_name not in cls.supported_losses():
            raise ValueError(f"CrossBatchMemory not supported for {loss_name}")

    def reset_queue(self) -> None:
        """An empty queue (PML's float32 zeros; the next call moves it to the embeddings')."""
        size, width = int(self.argument("memory_size")), int(self.argument("embedding_size"))
        memory = _w.cross_batch_memory_init(size, width)
        self.register_buffer("embedding_memory", memory["embeddings"])
        self.register_buffer("label_memory", memory["labels"])
        self.register_buffer("queue_index_", memory["index"], persistent=False)
        self.register_buffer("queue_count_", memory["count"], persistent=False)

    @property
    def queue_idx(self) -> int:
        """The next slot to write (PML's attribute; reading it synchronises with the host)."""
        return int(self.get_buffer("queue_index_"))

    @queue_idx.setter
    def queue_idx(self, value: int) -> None:
        index, count = self.get_buffer("queue_index_"), self.get_buffer("queue_count_")
        filled = self.has_been_filled
        index.fill_(int(value))
        if not filled:
            count.fill_(int(value))

    @property
    def has_been_filled(self) -> bool:
        """Whether every slot holds an embedding (PML's attribute; a host synchronisation)."""
        return int(self.get_buffer("queue_count_")) == self.get_buffer("label_memory").shape[0]

    @has_been_filled.setter
    def has_been_filled(self, value: bool) -> None:
        size = self.get_buffer("label_memory").shape[0]
        index = self.get_buffer("queue_index_")
        self.get_buffer("queue_count_").copy_(torch.full_like(index, size) if value else index)

    def forward(self, embeddings, labels, indices_tuple=None, enqueue_mask=None):
        if indices_tuple is not None and enqueue_mask is not None:
            raise ValueError("indices_tuple and enqueue_mask are mutually exclusive")
        if enqueue_mask is not None:
            raise ValueError(
                "CrossBatchMemory(enqueue_mask=...) is not provided: pmlfunc's "
                "cross_batch_memory enqueues the whole batch"
            )
        if indices_tuple is not None:
            raise ValueError(
                "CrossBatchMemory(indices_tuple=...) is not provided: pmlfunc's "
                "cross_batch_memory forms its pairs itself (pass a miner to the constructor)"
            )
        device = embeddings.device
        for name in ("embedding_memory", "label_memory", "queue_index_", "queue_count_"):
            buffer = self.get_buffer(name)
            dtype = embeddings.dtype if name == "embedding_memory" else buffer.dtype
            if buffer.device != device or buffer.dtype != dtype:
                setattr(self, name, buffer.to(device, dtype))  # as PML's memory follows
        memory = {
            "embeddings": self.get_buffer("embedding_memory"),
            "labels": self.get_buffer("label_memory"),
            "index": self.get_buffer("queue_index_"),
            "count": self.get_buffer("queue_count_"),
        }
        loss, new = _w.cross_batch_memory(
            self.argument("loss"),
            embeddings,
            labels.to(device),
            memory,
            miner=_pure_miner(self.argument("miner")),
        )
        for key, buffer in memory.items():
            no_grad_copy(buffer, new[key])
        return loss

    def extra_repr(self) -> str:
        sizes = ("embedding_size", "memory_size")
        return ", ".join(f"{n}={self.argument(n)!r}" for n in sizes)


class MultipleLosses(Loss):
    """PML's ``MultipleLosses``: ``Σ weights[i] · losses[i](embeddings, labels, miners[i](...)
    or indices_tuple)`` (:func:`pmlfunc.wrappers.multiple_losses`)."""

    signature = ("losses", "miners", "weights")
    defaults = {"losses": required(), "miners": None, "weights": None}
    shared = ()
    consumed = signature

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        losses, miners, weights = (self.argument(n) for n in self.signature)
        self.is_dict = isinstance(losses, dict)
        holder = nn.ModuleDict if self.is_dict else nn.ModuleList
        self.losses = holder(losses)
        self.miners = None if miners is None else holder(miners)
        if weights is None:
            weights = {k: 1 for k in losses} if self.is_dict else [1] * len(losses)
        self.weights: Any = weights  # PML: a list or dict of numbers (or tensors)
        self._combined()  # the function's checks of keys, lengths and weights, now

    def _combined(self) -> Callable[..., Tensor]:
        def items(modules: Any) -> Any:
            if modules is None:
                return None
            return dict(modules.items()) if self.is_dict else list(modules)

        return _w.multiple_losses(
            items(self.losses), miners=items(self.miners), weights=self.weights
        )

    def forward(self, embeddings, labels, indices_tuple=None):
        return self._combined()(embeddings, labels, indices_tuple)
