"""Sums over the ranks, for the losses that are functions of batch statistics.

A loss of batch statistics (Barlow Twins' cross-correlation, the batch's mean and variance) is
written with :func:`total` around every sum over rows: in one process ``total(t)`` is ``t``;
under :func:`pmlfunc.distributed.global_objective` it is ``t`` summed over the ranks (an
all-reduce with autograd), so each rank computes the statistics of the global batch from its
own rows, and no rank holds the global batch. The loss is then the same on every rank, and the
all-reduce's backward sums the ranks' cotangents, so each rank's rows receive ``W · ∂L/∂x``,
as under the gather (DDP's averaging cancels ``W``).

| name | what it is |
|---|---|
| :func:`total` | ``Σ_ranks t`` (``t`` in one process) |
| :func:`summing` | the context in which :func:`total` sums over the ranks |
| :func:`active` | whether :func:`total` sums over the ranks now |
| :func:`reduced` | a reducer's value over the global batch's row terms (its normaliser and share summed) |
| :func:`reduces_statistics` | registers a loss written this way, with its batch arguments |
| :data:`STATISTICS` | the registered losses: their batch arguments (sharded by rows) |
| :class:`ClassShard`, :func:`sharding`, :func:`class_shard` | a class table sharded across the ranks: this rank's classes, read by the class-tiled losses |

The state is a module-level list, not a ``ContextVar``: ``torch.compile`` reads it as a global
(in one process it is ``None``, and :func:`total` compiles to nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

F = TypeVar("F", bound=Callable)

_SUM: list[Callable[[Tensor], Tensor] | None] = [None]

STATISTICS: dict[Callable, tuple[str, ...]] = {}


def total(t: Tensor) -> Tensor:
    """``t`` summed over the ranks inside :func:`summing`, else ``t``."""
    fn = _SUM[0]
    return t if fn is None else fn(t)


def active() -> bool:
    """Whether :func:`total` sums over the ranks (a rank may then hold no rows)."""
    return _SUM[0] is not None


@contextlib.contextmanager
def summing(fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Within the block, :func:`total` is ``fn`` (the all-reduce of one call)."""
    previous = _SUM[0]
    _SUM[0] = fn
    try:
        yield
    finally:
        _SUM[0] = previous


def reduced(reducer, terms, labels=None) -> Tensor:
    """``reducer(terms, labels)`` over the global batch's terms: in one process the reducer
    itself; inside :func:`summing` its normaliser and this rank's share of the value
    (``Reducer.normalizer``, ``Reducer.partial``), each summed over the ranks."""
    if not active():
        return reducer(terms, labels)
    normaliser = total(reducer.normalizer(terms, labels))
    return total(reducer.partial(terms, labels, normaliser))


def reduces_statistics(*batch: str) -> Callable[[F], F]:
    """Register a loss written with :func:`total`; ``batch``: its arguments with one row per
    sample (each rank holds its rows of them)."""

    def register(fn: F) -> F:
        STATISTICS[fn] = batch
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# classes sharded across ranks (pmlfunc.distributed.sharded_classes)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClassShard:
    """This rank's part of a class table sharded across the ranks: classes ``[offset, offset +
    rows)`` of ``num_classes``, the in-place sum and maximum over the ranks (bounded
    collectives, no autograd) that combine the ranks' partial statistics, and ``guard(where)``,
    the context that reports a failure inside it to the waiting ranks (the session's, around
    the backward, which runs outside the call's own guard)."""

    offset: int
    num_classes: int
    sum_: Callable[[Tensor, str], Tensor]
    max_: Callable[[Tensor, str], Tensor]
    guard: Callable[[str], contextlib.AbstractContextManager[None]] = lambda where: (
        contextlib.nullcontext()
    )


_SHARD: list[ClassShard | None] = [None]


def class_shard() -> ClassShard | None:
    """The active :class:`ClassShard` (inside :func:`sharding`), else ``None``."""
    return _SHARD[0]


@contextlib.contextmanager
def sharding(shard: ClassShard) -> Iterator[None]:
    """Within the block the class-tiled losses read their params as this rank's shard and their
    labels as global class ids (``pmlfunc.losses._tiled.class_statistics``)."""
    previous = _SHARD[0]
    _SHARD[0] = shard
    try:
        yield
    finally:
        _SHARD[0] = previous
