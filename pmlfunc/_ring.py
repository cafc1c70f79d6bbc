r"""The ring exchange: the tiled engine's losses across ranks without gathering the global batch.

Each rank keeps its own rows ``x`` (``N_r × D``). The column blocks (``y``, or ``x`` itself in
self mode, with their labels) travel around the ring: at step ``k`` rank ``r`` holds the block
of rank ``(r − k) mod W``, hands it to the engine (:mod:`pmlfunc.losses._tiled`), and sends it on
to ``r + 1`` while it receives the next from ``r − 1`` (the transfer overlaps the work).
What must reach a block's owner travels *with* the block and gets one last hop home after the
``W``-th step:

| pass | travels with each block | comes home as |
|---|---|---|
| forward and backward | the block's metadata: its labels, or (retrieval) its columns' types, owners and ids, and the guide model's columns | |
| forward (CLIP; retrieval with ``doc_to_query``) | partial column statistics (log-sum-exp, ``|P|``, ``Σ_P S``; the positives' log-sum-exp) | the block's column statistics |
| backward | ``∂L/∂y`` summed over the ranks visited | the owner's column gradient |

A block has ``columns_per_row`` columns for each of its rank's rows (one; the retrieval kind's
``1 + k``, plus the queries when a direction reads them: a row's query, positive and hard
negatives travel together).

A document queue (the retrieval kind's ``memory``, :mod:`pmlfunc.queues`) does not travel: every
rank holds the same global queue, so each rank reads its own copy once, after the ring's steps,
as one more block that no row owns (:class:`_Queue`), in the forward and in the backward (no
gradient for it).

NT-Xent's terms need their row's final log-sum-exp, so its forward walks the ring twice.
Between the forward and the loss, one all-reduce sums the reducers' counts; another sums the
ranks' shares into the loss ``L`` (the same on every rank); the backward all-reduces the scale's
and bias's gradients. Per rank, memory is ``O(N_r·D + chunk × N_max)``: two blocks and a
traveling gradient at a time, no tensor with the global batch's rows.

Gradients follow :func:`pmlfunc.distributed.global_objective`'s convention: a rank's rows
receive ``W · ∂L/∂x_r`` and the scale and bias ``∂L/∂θ``, so DDP's averaging gives the
single-process gradient. The backward assumes every rank back-propagates the same cotangent into
``L`` (each rank calls ``backward`` on the same loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._agree import Session
from ._ops import apply
from .losses._tiled import (
    ROW_STATS,
    EngineCall,
    Retrieval,
    block_backward,
    block_forward,
    column_stats,
    columns,
    counts,
    kind_name,
    merge,
    reduce,
)

__all__ = ["Ring", "ring_loss", "split_queue"]


class Ring:
    """This rank's place in a :class:`~pmlfunc._agree.Session`'s ring and every rank's block
    size (agreed by the session); every wait is the session's bounded wait."""

    def __init__(self, session: Session, sizes: list[int]):
        self.session, self.group = session, session.group
        self.rank, self.world = session.rank, session.world
        self.sizes = sizes
        self._prev_rank = (self.rank - 1) % self.world
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(self.group, self._prev_rank)

    def shift(self, tensors: list[Tensor], rows: int, where: str) -> Callable[[], list[Tensor]]:
        """Send ``tensors`` to the next rank and receive the same kinds of tensor, with ``rows``
        leading rows, from the previous one; returns the wait that yields the received ones."""
        bufs = [t.new_empty((rows, *t.shape[1:])) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self._next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self._prev, self.group) for b in bufs]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[Tensor]:
            self.session.wait(works, where, peer=self._prev_rank)
            return bufs

        return wait

    def circulate(self, block: list[Tensor], visit, phase: str) -> list[Tensor] | None:
        """Pass this rank's ``block`` (tensors with its rows leading) around the ring. At each
        step, ``visit(owner, tensors, traveling)`` works on the block held and returns what
        travels with it (``None``: nothing); after the last step that returns to the block's
        owner. Returns what came home with this rank's own block. ``phase`` names the walk in
        the waits' messages."""
        owner, travel = self.rank, None
        for step in range(self.world):
            nxt = (owner - 1) % self.world  # the owner of the block that arrives next
            where = f"{phase}, ring step {step + 1} of {self.world}"
            pending = (
                self.shift(block, self.sizes[nxt], f"{where}: receiving rank {nxt}'s block")
                if step < self.world - 1
                else None
            )
            travel = visit(owner, block, travel)
            if travel is not None:  # on with the block; after the last step, home
                travel = self.shift(travel, self.sizes[nxt], f"{where}: passing statistics")()
            if pending is not None:
                block = pending()
            owner = nxt
        return travel

    def all_sum(self, values: dict[str, Tensor], where: str) -> dict[str, Tensor]:
        """Every entry summed over the ranks (one all-reduce, in float64)."""
        names = sorted(values)
        flat = torch.stack([values[k].reshape(()).to(torch.float64) for k in names])
        self.session.all_reduce(flat, where)
        return {k: flat[i].to(values[k].dtype) for i, k in enumerate(names)}


class _Queue(NamedTuple):
    """A call's document queue, read by each rank from its own copy: the retrieval kind's
    options for a block of queue columns alone (``memory`` of them), the queue's column
    segments and their metadata."""

    kind: Retrieval
    y: tuple[Tensor, ...]
    cols: tuple[Tensor, ...]

    def forward(self, x, rows, scale, bias, chunk, lse, unit, self_mode) -> dict[str, Tensor]:
        """The queue's partial row statistics (no row owns a queue column: ``diag=False``)."""
        st = block_forward(
            self.kind, x, columns(self.y, unit), rows, self.cols, scale, bias, chunk,
            diag=False, exclude=self_mode, lse=lse, final=False,
        )  # fmt: skip
        return {k: v for k, v in st.items() if k not in column_stats(self.kind)}

    def backward(self, x, rows, scale, bias, chunk, row, needs, unit, self_mode):
        """The rows' gradient sums from the queue's columns (none for the queue itself)."""
        m = sum(seg.shape[-2] for seg in self.y)
        col = tuple(x.new_zeros(m) for _ in column_stats(self.kind))  # no positive column
        need_x, _, need_scale, need_bias = needs
        part_x, _, x_dot, sum_ds = block_backward(
            self.kind, x, columns(self.y, unit), rows, self.cols, scale, bias, chunk, row, col,
            (need_x, False, need_scale, need_bias), diag=False, exclude=self_mode,
        )  # fmt: skip
        return part_x, x_dot, sum_ds


def split_queue(call: EngineCall) -> tuple[EngineCall, _Queue | None]:
    """``call`` without its queue's columns (they end its segments and its column metadata:
    :func:`pmlfunc.losses.retrieval._retrieval_call`), and the queue; ``None`` without one."""
    kind = call.kind
    if not isinstance(kind, Retrieval) or not kind.memory:
        return call, None
    assert isinstance(call.y, tuple) and isinstance(call.cols, tuple)  # the retrieval layout
    segments, rows_left, at = call.y, kind.memory, len(call.y)
    while rows_left > 0:
        at -= 1
        rows_left -= segments[at].shape[-2]
    meta = call.cols[0]
    batch = dataclasses.replace(
        call, kind=kind._replace(memory=0), y=segments[:at], cols=(meta[: -kind.memory],)
    )
    return batch, _Queue(kind, segments[at:], (meta[-kind.memory :],))


class _RingLoss(torch.autograd.Function):
    """``L`` of an :class:`EngineCall` over the ranks' rows. Inputs ``(x, y, scale, bias, call,
    ring, queue)`` (``y=None``: self mode; ``queue``: :class:`_Queue` or ``None``); the labels
    travel in ``call``."""

    @staticmethod
    def forward(ctx, x, y, scale, bias, call: EngineCall, ring: Ring, queue: _Queue | None):
        with ring.session.guard("the ring's forward"):
            return _RingLoss._forward(ctx, x, y, scale, bias, call, ring, queue)

    @staticmethod
    def _forward(ctx, x, y, scale, bias, call: EngineCall, ring: Ring, queue: _Queue | None):
        kind, rows, unit = call.kind, call.rows, call.unit
        self_mode = y is None
        chunk = call.chunk or max(x.shape[-2], 1)
        meta = _block_meta(call)
        block = [x if self_mode else y, *meta]
        col_keys = column_stats(kind)  # partial column statistics travel with their block

        def walk(lse: Tensor | None) -> dict[str, Tensor]:
            acc: dict[str, Tensor] | None = None

            def visit(owner, blk, travel):
                nonlocal acc
                st = block_forward(
                    kind, x, columns(blk[0], unit), rows, _cols(kind, blk[1 : 1 + len(meta)]),
                    scale, bias, chunk, diag=owner == ring.rank, exclude=self_mode, lse=lse,
                    final=False,
                )  # fmt: skip
                acc = merge(acc, {k: v for k, v in st.items() if k not in col_keys})
                if not col_keys:
                    return None
                col = torch.stack([st[k] for k in col_keys], -1)
                return [col if travel is None else _merge_cols(col_keys, travel[0], col)]

            home = ring.circulate(block, visit, "the forward" if lse is None else "the terms")
            assert acc is not None  # circulate visits every rank's block, this one's included
            if queue is not None:
                acc = merge(acc, queue.forward(x, rows, scale, bias, chunk, lse, unit, self_mode))
            if home is not None:
                acc.update(zip(col_keys, home[0].unbind(-1), strict=True))
            return acc

        st = walk(None)
        if kind == "ntxent":  # the terms need each row's final log-sum-exp: a second walk
            st = {"row_lse": st["row_lse"], **walk(st["row_lse"])}
        total = ring.all_sum(counts(kind, st, x.shape[-2]), "summing the reducers' counts")
        share, stats = reduce(kind, st, call.reducer, total)
        loss = ring.all_sum({"loss": share}, "summing the ranks' shares of the loss")["loss"]
        # not the call itself: it holds x and y, which belong in save_for_backward
        ctx.kind, ctx.chunk, ctx.rows, ctx.ring = kind, chunk, rows, ring
        ctx.meta, ctx.unit, ctx.queue = meta, unit, queue
        ctx.scale_float = None if isinstance(scale, Tensor) else scale
        ctx.save_for_backward(x, y, scale if isinstance(scale, Tensor) else None, bias, *stats)
        return loss

    @staticmethod
    def backward(ctx, g):
        with ctx.ring.session.guard("the ring's backward"):
            return _RingLoss._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
        x, y, scale, bias, *stats = ctx.saved_tensors
        kind, rows, ring = ctx.kind, ctx.rows, ctx.ring
        scale = ctx.scale_float if scale is None else scale
        need_x, need_y, need_scale, need_bias = (ctx.needs_input_grad[i] for i in range(4))
        self_mode = y is None
        split = ROW_STATS[kind_name(kind)]
        row, own_col = stats[:split], stats[split:]
        n_meta = len(ctx.meta)
        block = [x if self_mode else y, *ctx.meta]
        if own_col:  # the columns' statistics travel with their block
            block.append(torch.stack(own_col, -1))
        need_cols = need_x if self_mode else need_y
        needs = (need_x, need_cols, need_scale, need_bias)
        gx: Tensor | None = None
        sums: dict[str, Tensor] = {}

        def visit(owner, blk, travel):
            nonlocal gx
            col = tuple(blk[-1].unbind(-1)) if own_col else ()
            part_x, (part_y,), x_dot, sum_ds = block_backward(
                kind, x, columns(blk[0], ctx.unit), rows, _cols(kind, blk[1 : 1 + n_meta]),
                scale, bias, ctx.chunk, row, col, needs, diag=owner == ring.rank,
                exclude=self_mode,
            )  # fmt: skip
            if part_x is not None:
                gx = part_x if gx is None else gx + part_x
            for name, v in (("scale", x_dot), ("bias", sum_ds)):
                if v is not None:
                    sums[name] = v if name not in sums else sums[name] + v
            if part_y is None:
                return None
            part_y = part_y * (scale * g)
            return [part_y if travel is None else travel[0] + part_y]

        home = ring.circulate(block, visit, "the backward")
        if ctx.queue is not None:
            part_x, x_dot, sum_ds = ctx.queue.backward(
                x, rows, scale, bias, ctx.chunk, row, needs, ctx.unit, self_mode
            )
            if part_x is not None:
                gx = part_x if gx is None else gx + part_x
            for name, v in (("scale", x_dot), ("bias", sum_ds)):
                if v is not None:
                    sums[name] = v if name not in sums else sums[name] + v
        w = ring.world
        grad_x = grad_y = None
        if need_x:
            grad_x = gx * (scale * g) if gx is not None else torch.zeros_like(x)
            if self_mode:
                grad_x = grad_x + home[0]
            grad_x = grad_x * w
        if need_y:
            grad_y = home[0] * w
        totals = (
            ring.all_sum({k: v * g for k, v in sums.items()}, "summing the scale's gradient")
            if sums
            else {}
        )
        return grad_x, grad_y, totals.get("scale"), totals.get("bias"), None, None, None


def _merge_cols(keys: tuple[str, ...], a: Tensor, b: Tensor) -> Tensor:
    """Two partial column statistics (``keys``, :func:`column_stats`) stacked on the last
    dimension."""
    cols = merge(
        dict(zip(keys, a.unbind(-1), strict=True)), dict(zip(keys, b.unbind(-1), strict=True))
    )
    return torch.stack([cols[k] for k in keys], -1)


def _block_meta(call: EngineCall) -> list[Tensor]:
    """The metadata of this rank's block of columns, as the tensors that travel with it: none
    (aligned sets), its labels, or the retrieval kind's column metadata."""
    labels = call.rows if call.cols is None else call.cols
    if labels is None:
        return []
    return list(labels) if isinstance(labels, tuple) else [labels]


def _cols(kind, meta: list[Tensor]):
    """A block's metadata (:func:`_block_meta`) as the engine reads it (``cols``)."""
    if isinstance(kind, Retrieval):
        return tuple(meta)
    return meta[0] if meta else None


def ring_loss(call: EngineCall, queue: _Queue | None, session: Session, sizes: list[int]) -> Tensor:
    """The loss of ``call`` (this rank's rows, without its queue: :func:`split_queue`) and its
    document ``queue`` (or ``None``) over every rank's rows (``sizes``, agreed by ``session``), by
    the ring."""
    ring = Ring(session, [n * call.columns_per_row for n in sizes])
    scale = call.scale if isinstance(call.scale, Tensor) else float(call.scale)
    # a block travels as one tensor: the segments of the columns concatenated (autograd splits
    # the gradient back); the engine normalises each block as it arrives (call.unit)
    y = call.y if call.y is None or isinstance(call.y, Tensor) else torch.cat(call.y)
    loss = apply(_RingLoss, call.x, y, scale, call.bias, call, ring, queue)
    return loss if call.finish is None else call.finish(loss)
