r"""The tiled engine: the softmax and sigmoid contrastive losses in ``O(tile)`` memory, both passes.

Every loss of this family reads only per-row (and, for CLIP, per-column) statistics of the logit
matrix ``S = scale · x yᵀ + bias`` over the ``N × M`` grid of query rows ``x`` and reference rows
``y`` (``y = x`` in self mode, whose diagonal never counts):

| kind | a term | statistics kept by the forward |
|---|---|---|
| ``"ntxent"`` | positive pair ``(i, j)``: ``−log(σ(S_ij − lse_{N(i)} S_i) + ε)`` | ``lse`` over each row's negatives, ``Σ_P ∂term/∂S`` |
| ``"supcon"`` | row ``i``: ``lse_{C(i)} S_i − mean_{P(i)} S_ij`` (``C = P ∪ N``) | ``lse`` over candidates, ``|P(i)|``, ``Σ_P S`` |
| ``"clip"`` | row ``i`` and column ``j``: ``lse S_i − mean_{P(i)} S_ij``, likewise down columns | row and column ``lse``, ``|P|``, ``Σ_P S`` |
| ``"siglip"`` | pair ``(i, j)``: ``softplus(−z_ij S_ij)``, ``z = ±1`` for positives/negatives | none |
| :class:`Retrieval` | loss row ``i`` (``roles`` rows of ``x``: its query, its positive): ``lse`` over its candidates (masks from ids and guide rows, hardness terms, built per tile) ``− S(q_i, p_i)``, the positive read on the row's own block | ``lse`` per row (or per role), ``S(q_i, p_i)``; ``doc_to_query`` alone: each positive column's ``lse`` down the query rows |
| :class:`Retrieval` with ``sigmoid`` | each candidate ``(i, j)`` of a query row (the same masks): ``softplus(−z_ij S_ij)``, ``z = +1`` at its positive (SigLIP with ids or a queue) | none (as ``"siglip"``) |

The columns come in *blocks*. One process has one block, ``y`` itself; the ring
(:mod:`pmlfunc._ring`) hands this engine the other ranks' blocks one at a time. Per block:

- :func:`block_forward` walks static tiles of ``chunk`` rows: it builds the ``chunk × M`` tile,
  folds it into *partial* statistics (log-sum-exps and sums over this block's columns) and drops
  it. :func:`merge` combines the partials of two blocks (``logaddexp`` for a log-sum-exp, ``+``
  for a sum). NT-Xent's terms need the final log-sum-exp of their row, so across blocks it walks
  twice (``lse`` first, then the terms); with one block each tile has its whole row and one walk
  does both.
- :func:`counts` lists the numbers a reducer divides by (the ring sums them over the ranks) and
  :func:`reduce` gives the loss of these rows and the statistics the backward reads.
- :func:`block_backward` walks the tiles again, recomputes each one, forms ``∂L/∂S`` from the
  statistics and accumulates ``∂S y`` (the rows' gradient), ``∂Sᵀ x`` (the block's),
  ``Σ ∂S ⊙ x yᵀ`` (the scale's) and ``Σ ∂S`` (the bias's).

The columns are read as the caller holds them (:class:`Columns`): several segments (a retrieval
batch's positives and hard negatives) side by side without a concatenation, and, where the loss
normalises them, normalised in the tile (``S = scale · (x yᵀ) ⊙ inv``) with the normalisation's
backward applied to the column gradients in place: no normalised copy of the documents.

Labels' positives: where reading values is free (a CPU tensor in eager mode, outside
``torch.func``) and they are few (at most an eighth of the block), NT-Xent's and SupCon's walks
list them once a block (:func:`_label_listing`: the columns sorted by label, each row's run by
binary search, ``O(M log M + |P|)``) and each tile reads its positives by index and leaves them
(and the self pairs) out in place (:func:`_leave_out_`): no ``r × M`` masks, no ``nonzero`` or
``where`` pass a tile (dense NT-Xent at ``N = 2,048``, ``D = 128``, one thread: 94–100 → 61–66
ms, tiles of 256 rows 91–97 → 54–62 ms, floor 40–43). Elsewhere (compiled, transformed, an
accelerator, many positives) each tile builds its boolean masks.

Bounded logits: where ``|S| ≤ 40`` is known from the rows' norms (one temperature, a float or
0-d, no bias, a CPU in eager mode: :func:`_base2_units`), the listed NT-Xent and SupCon walks
that form the gradient take each tile as ``S log₂e`` (the GEMM scales the tile's rows) and its
exponentials as ``2^s`` with no shift: no row maximum, one ``exp2`` pass (on an AVX2 CPU 0.6×
``exp``'s time) and one row sum, against the softmax's three passes, two maxima and the
gradient's row scaling; the gradient goes to the sums as ``diag(w) · E`` (:class:`RowScaled`),
whose row scale multiplies the ``(r, D)`` operands (tiled NT-Xent at ``N = 2,048``, ``D = 128``,
one thread, against the floor: 1.21–1.27× → 1.14–1.18×, SupCon 1.26× → 1.19×). SigLIP,
where ``|S| ≤ 80`` (:data:`_SIGLIP_BOUND`, the scale and bias included), takes ``t = e^{−zS}``
from one ``exp2`` pass and its terms and gradient as ``log1p(t)`` and ``t / (1 + t)``
(:func:`_siglip_base2_fold_`), where ``softplus`` and ``sigmoid`` took three transcendental
passes (the same: 1.45–1.48× → 1.33–1.35×), the terms' sum folding the tile's column halves
first where the bound keeps the products finite (:func:`_log1p_sum`: one ``log1p`` an
entry in four at the default scale and bias). The retrieval kind whose query rows read every
document (no ids, guide, hardness or queue: :attr:`Retrieval.masked` false) takes the base-2
exponentials too (:func:`_retrieval_base2_fold_`; ``multiple_negatives_ranking`` at 2,048 ×
128 with no hard negatives 1.20× → 1.14×, with seven 477 → 446 ms). CLIP's walks, forward and
recomputed, read ``E = 2^s`` whose row and column sums are the log-sum-exps (no maxima, no
online rescaling) and form ``∂L/∂S = E ⊙ (u_i + v_j)`` minus the positives' terms
(:func:`_clip_fold_`, :func:`_clip_exp_ds_`; dense CLIP at 2,048 × 128 1.71× → 1.19–1.24× the
floor, tiled 1.98–2.07× → 1.56–1.61×); so do the nested walks' CLIP and SigLIP widths.

Tile buffers: on a CPU in eager mode a plain walk writes each tile's product and NT-Xent's and
SupCon's softmax into buffers reused from tile to tile
(:class:`_Scratch`), where fresh ``r × M`` buffers cost their page faults every tile (tiled
NT-Xent at ``N = 2,048``, ``D = 128``, one thread, in-process A/B: 47 ms against 59; SupCon 61
against 84). A dense call of a row-complete kind therefore walks small tiles, ``2¹⁹`` entries
(:data:`DENSE_TILE`), rather than one large one, but of at least 256 rows
(:data:`DENSE_MIN_ROWS`: each tile adds its product into the whole ``(M, D)`` column gradient).

Peak memory: the inputs, their gradients and a few tiles (masks are boolean), whatever ``N`` is.
Shapes are static and every count is a tensor, so the one-block path (:func:`tiled_loss`) runs
under ``torch.compile(fullgraph=True)``, ``torch.func`` and on the meta device; its backward
records no graph, and differentiating it again raises.

The public losses (:func:`pmlfunc.losses.ntxent`, :func:`pmlfunc.losses.supcon`,
:func:`pmlfunc.losses.clip`, :func:`pmlfunc.losses.siglip`) describe a call as an
:class:`EngineCall` (:data:`BUILDERS`), run by :func:`run_local` when given ``chunk_size`` and by
the ring under ``global_objective(..., exchange="ring")``; their dense paths compute the same
numbers from the whole matrix.

**Nested widths** (:func:`pmlfunc.transforms.matryoshka`, :func:`run_nested`): the same walks
with one tile a width in place of one tile. A width's logits come from the cumulative block
products of its prefix (:class:`_Prefixes`), each width folds into its own statistics with the
tile's masks built once, and the gradient sums (:class:`_NestedSums`) hold each width's
``∂S`` until the tile's last width, sum them from the widest down and multiply each feature
block once: every width's products cost one full-width call's. A width's product is accumulated
into the previous width's buffer, the gradient products into the gradient buffers (both by the
GEMM, :func:`~pmlfunc._ops.addmm_`), and on a CPU in eager mode the tiles' buffers are reused
from tile to tile (:class:`_Prefixes`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeGuard

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, _global
from .._inputs import validate
from .._ops import (
    _NORMALIZE_EPS,
    SELF_PRODUCT_FUSE_LIMIT,
    SPARSE_FRACTION,
    FirstOrder,
    addmm_,
    apply,
    count_true,
    first_order_backward,
    fresh,
    inside_transform,
    logaddexp,
    matmul,
    padded_copy,
    ratio,
    readable,
    renorm_rows,
    self_product_grad,
    sigmoid_,
    unit_rows,
    unrecorded,
)
from ..distances import _Dot, cosine, resolve
from ..reducers import Reducer
from ._batch import check_shared, regularized

__all__ = [
    "BUILDERS",
    "CLASS_TILED",
    "KINDS",
    "ROW_STATS",
    "Classes",
    "Columns",
    "EngineCall",
    "Retrieval",
    "block_backward",
    "block_forward",
    "builder_of",
    "builds",
    "class_cross_entropy",
    "class_statistics",
    "column_stats",
    "columns",
    "counts",
    "dense_rows",
    "dense_runs",
    "engine_call",
    "kind_name",
    "merge",
    "prefix_matrices",
    "rank_shared",
    "rank_sum",
    "reduce",
    "run_local",
    "softmax_call",
    "tiled_loss",
    "tiled_reducer",
    "unpartial",
]

# kind -> the reducers it supports (the first is the default)
KINDS = {
    "ntxent": ("mean", "sum"),
    "supcon": ("avg_nonzero", "mean", "sum"),
    "clip": ("mean", "sum"),
    "siglip": ("batch", "mean", "sum"),
    "retrieval": ("mean", "sum"),
}

# kind -> how many of the backward's statistics are per row (the rest are per column)
ROW_STATS = {"siglip": 1, "ntxent": 3, "supcon": 3, "clip": 3, "retrieval": 2}


class Retrieval(NamedTuple):
    r"""The static options of the ``"retrieval"`` kind (:func:`pmlfunc.losses.multiple_negatives_ranking`),
    passed where the other kinds pass their name.

    Loss row ``i`` has ``roles`` engine rows, laid out consecutively in ``x``: its query
    (role 0) and, when a direction starts from documents, its positive document (role 1). The
    columns are typed (:data:`COL_QUERY`, :data:`COL_POSITIVE`, :data:`COL_NEGATIVE`) and owned
    by a loss row. ``allowed[role][type]``: which column types a role's row reads (the
    directions). ``joint``: one log-sum-exp over all of a row's roles (else one per role,
    averaged). ``hardness``: which query-row entries get ``strength · stop_grad(sim)`` added,
    ``None`` for none (``in_batch_negatives``, ``hard_negatives``, ``all_negatives``). ``ids``:
    whether anchor ids and positive ids are given; rows related by an equal given id mask each
    other's query and positive. ``guide``: entries whose guide similarity exceeds the row's
    threshold are masked (the positive pair protected).

    ``doc_columns``: ``doc_to_query`` without ``doc_to_doc``. Its logits ``S(p_i, q_r)`` are
    ``S(q_r, p_i)``, the query rows' tiles read down the positives' columns, so the loss rows
    are queries only (``roles = 1``) and each positive column keeps a second log-sum-exp (a
    column statistic, as CLIP's) over the query rows it reads: half the logits of
    ``roles = 2``, whose query and document rows read disjoint column types, and the same
    tile count as CLIP. ``negatives``: ``k``, the hard negatives a row (a block's layout,
    :attr:`per_row`, :meth:`positive_span`). ``memory``: the columns after the block's own,
    a queue of earlier steps' documents (and queries) that no row owns
    (:mod:`pmlfunc.queues`): typed as documents or queries, masked by the ids as another row's
    would be, :data:`COL_EMPTY` where the slot is empty.

    ``sigmoid``: SigLIP's terms instead of the log-sum-exp (:func:`pmlfunc.losses.siglip` with
    ids or a queue): every candidate entry of a query row is a pair ``softplus(−z S)``, ``z = +1``
    at the row's positive and ``−1`` elsewhere; no row statistics (the totals and the number of
    pairs, as the ``"siglip"`` kind, whose reducers it takes: :func:`kind_name`).

    A block of columns is one process's (or one rank's) documents: its queries when a direction
    reads them (:attr:`query_columns`), then its positives, then its hard negatives, each owned
    by a row of the block's process. A row's own columns (its query, its positive, its hard
    negatives) and its positive ``p_i`` at column ``query_columns · n + i`` lie in its own block
    only (``diag``); another rank's block holds none of them, so that the ring gives the loss of
    the concatenated batch with row indices local to each block."""

    roles: int
    allowed: tuple[tuple[bool, bool, bool], ...]
    joint: bool
    hardness: str | None
    ids: tuple[bool, bool]
    guide: bool
    doc_columns: bool = False
    negatives: int = 0
    memory: int = 0
    sigmoid: bool = False

    @property
    def query_columns(self) -> bool:
        """Whether the block's queries are columns (a direction reads them)."""
        return any(reads[COL_QUERY] for reads in self.allowed)

    @property
    def reads_every(self) -> bool:
        """Whether every column is a candidate of every row: query rows only, against documents
        only (no query columns), no ids, no guide, no queue (whose empty slots are not)."""
        return (
            self.roles == 1
            and not self.query_columns
            and not any(self.ids)
            and not self.guide
            and not self.memory
        )

    @property
    def masked(self) -> bool:
        """Whether a tile reads masks (and so the rows' and columns' metadata): not when every
        column is a candidate (:attr:`reads_every`) and no hardness term is added."""
        return not (self.reads_every and self.hardness is None)

    @property
    def per_row(self) -> int:
        """The columns a loss row owns: its query (when queries are columns), its positive, its
        hard negatives."""
        return int(self.query_columns) + 1 + self.negatives

    @property
    def parts(self) -> int:
        """The log-sum-exps a loss row averages: one (``joint``) or one a direction's rows."""
        return 1 if self.joint else self.roles + int(self.doc_columns)

    def positive_span(self, m: int) -> tuple[int, int]:
        """The columns ``[c0, c1)`` of a block of ``m`` columns that are its positives."""
        nb = (m - self.memory) // self.per_row
        c0 = nb if self.query_columns else 0
        return c0, c0 + nb


COL_QUERY, COL_POSITIVE, COL_NEGATIVE = 0, 1, 2
COL_EMPTY = 3  # an empty memory slot: no row reads it

# a kind: its name (a key of KINDS), or the retrieval kind's options
Kind = str | Retrieval


def kind_name(kind) -> str:
    """The name of a kind (``"retrieval"`` for :class:`Retrieval` options, ``"siglip"`` for
    their ``sigmoid`` ones: the statistics and reducers they share)."""
    if isinstance(kind, Retrieval):
        return "siglip" if kind.sigmoid else "retrieval"
    return kind


def _ranked(kind) -> TypeGuard[Retrieval]:
    """Whether ``kind`` is the retrieval kind with its log-sum-exps (not ``sigmoid``)."""
    return isinstance(kind, Retrieval) and not kind.sigmoid


def _roles(kind) -> int:
    return kind.roles if isinstance(kind, Retrieval) else 1


def tiled_reducer(kind, reducer: Reducer | None, what: str | None = None) -> str:
    """The engine's name for a loss's reducer (``None``: the kind's default), or the error that
    says which reducers ``what`` (default: the loss) supports."""
    allowed = KINDS[kind_name(kind)]
    if reducer is None:
        return allowed[0]
    if not isinstance(reducer, Reducer):
        raise TypeError(
            "reducer must be a pmlfunc reducer (pmlfunc.reducers.mean(), ...), got "
            f"{type(reducer).__name__}"
        )
    name = repr(reducer)
    if not (name.endswith("()") and name[:-2] in allowed):
        supported = ", ".join(f"{k}()" for k in allowed if k != "batch")
        raise ValueError(
            f"{what or kind} supports reducer {supported} (or None); got reducer={name}"
        )
    return name[:-2]


def _tiles(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


@dataclass(frozen=True)
class Columns:
    """A block of columns ``y`` ``(M, D)`` as the engine reads it, without copying it:
    ``segments``, blocks of rows read as one matrix in order (a retrieval batch's positives,
    then its hard negatives, as the caller holds them), and, when the loss normalises the
    columns, their norms ``‖y_j‖`` and ``inv_j = 1 / max(‖y_j‖, ε)`` (``F.normalize``'s). The
    normalised columns are never made: a tile is ``scale · (x yᵀ) ⊙ inv``, the gradient
    sums take ``∂S ⊙ inv`` and :meth:`unit_backward_` turns a column gradient of the normalised
    rows into the raw rows' in place (``inv=None``: the columns are used as they are)."""

    segments: tuple[Tensor, ...]
    norm: Tensor | None = None
    inv: Tensor | None = None

    @property
    def m(self) -> int:
        return sum(seg.shape[-2] for seg in self.segments)

    def spans(self) -> list[tuple[int, int]]:
        """Each segment's columns ``[c0, c1)``."""
        out, c0 = [], 0
        for seg in self.segments:
            out.append((c0, c0 + seg.shape[-2]))
            c0 += seg.shape[-2]
        return out

    def product(self, xt: Tensor, out: Tensor | None = None) -> Tensor:
        """``xt yᵀ``: one fresh ``(r, M)`` tile (segments side by side), or written into
        ``out`` (one segment, a buffer of :class:`_Scratch`)."""
        if out is not None and len(self.segments) == 1:
            return matmul(xt, self.segments[0].transpose(-1, -2), out)
        parts = [matmul(xt, seg.transpose(-1, -2)) for seg in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def times(self, ds: Tensor) -> Tensor:
        """``∂S y`` ``(r, D)`` for a tile's ``∂S`` ``(r, M)``."""
        if len(self.segments) == 1:
            return matmul(ds, self.segments[0])
        parts = (
            matmul(ds[..., c0:c1], seg)
            for seg, (c0, c1) in zip(self.segments, self.spans(), strict=True)
        )
        out = next(parts)
        for part in parts:
            out = out.add_(part)  # a buffer of ours
        return out

    def unit_backward_(self, i: int, g: Tensor) -> Tensor:
        """Segment ``i``'s column gradient ``g`` of ``∂S ⊙ inv`` (what the sums hold) made the
        gradient of its raw rows, in place: ``g − ŷ (ŷ · g)`` with ``ŷ = inv · y``, the
        projection left out where ``‖y‖ < ε`` (as ``F.normalize``'s autograd)."""
        if self.inv is None or self.norm is None:
            return g
        c0, c1 = self.spans()[i]
        seg, inv = self.segments[i], self.inv[c0:c1]
        along = matmul(seg.unsqueeze(-2), g.unsqueeze(-1)).squeeze(-1).squeeze(-1)  # y_j · g_j
        w = torch.where(self.norm[c0:c1] >= _NORMALIZE_EPS, along * inv * inv, 0.0)
        return g.addcmul_(seg, w.neg().unsqueeze(-1))


def columns(y: Tensor | Columns | tuple[Tensor, ...], unit: bool = False) -> Columns:
    """``y`` as :class:`Columns`: a tensor or a tuple of segments, normalised in the engine
    when ``unit``; a :class:`Columns` as it is."""
    if isinstance(y, Columns):
        return y
    segments = (y,) if isinstance(y, Tensor) else tuple(y)
    if not unit:
        return Columns(segments)
    norm = torch.cat([torch.linalg.vector_norm(seg, dim=-1) for seg in segments], -1)
    return Columns(segments, norm, 1.0 / norm.clamp_min(_NORMALIZE_EPS))


def _tile_factor(y: Columns, scale) -> float | Tensor:
    """What a tile ``x yᵀ`` is multiplied by: ``scale``, times each column's ``inv`` where the
    engine normalises the columns (one ``(M,)`` vector a walk)."""
    return scale if y.inv is None else y.inv * scale


class _Scratch:
    """A walk's tile buffers, reused from tile to tile on a CPU in eager mode (``on``), where a
    fresh ``r × M`` buffer costs its page faults (about as much as the softmax that fills it).
    :meth:`take` gives a buffer's first ``rows`` rows, or ``None`` (a fresh tensor then)."""

    def __init__(self, on: bool):
        self.on = on
        self.held: dict[str, Tensor] = {}

    def take(self, name: str, rows: int, cols: int, like: Tensor) -> Tensor | None:
        if not self.on:
            return None
        buf = self.held.get(name)
        if buf is None or buf.shape[1] != cols or buf.shape[0] < rows:
            buf = self.held[name] = like.new_empty((rows, cols))
        return buf[:rows]


def _reuses(kind, x: Tensor, nested, rows: int, chunk: int) -> bool:
    """Whether a walk of ``rows`` rows in tiles of ``chunk`` reuses its tile buffers
    (:class:`_Scratch`): a plain walk (not nested, not the retrieval kind's) of more than one
    tile, on a CPU in eager mode, outside autograd (an engine Function's forward or backward).
    A tile's buffers are done with when the next one begins: its gradient's products are
    taken, and CLIP holds its one tile only. A walk of one tile holds nothing (dense CLIP's
    ``N × N`` tile is freed as soon as its softmaxes are taken). A nested walk takes its
    buffers from its :class:`_Prefixes` (one a width where a width's tile outlives it)."""
    plain = nested is None and not isinstance(kind, Retrieval) and rows > chunk
    return plain and _may_reuse(x)


def _may_reuse(x: Tensor) -> bool:
    """Whether a walk over rows ``x`` may take its tile buffers from tile to tile at all
    (:class:`_Scratch`): a 2-D ``x`` on a CPU in eager mode (:func:`readable`), outside
    autograd (an engine Function's forward or backward), where nothing else holds a tile."""
    return x.ndim == 2 and readable(x) and not torch.is_grad_enabled()


def _logits(x: Tensor, y: Columns, r0: int, r1: int, factor, bias, out=None) -> Tensor:
    """``S = scale · x[r0:r1] ŷᵀ + bias``, one fresh ``(r1 − r0, M)`` tile (or ``out``)
    updated in place (``ŷ``: the columns, normalised where ``y.inv`` says; ``factor``:
    :func:`_tile_factor`)."""
    xt = x[r0:r1]
    if isinstance(factor, float) or factor.ndim == 0:  # scales the (r, D) rows, not the tile
        s = y.product(xt if isinstance(factor, float) and factor == 1.0 else xt * factor, out)
    else:  # a column's own factor
        s = y.product(xt, out).mul_(factor)
    return s if bias is None else s.add_(bias)


def _masks(rows, cols, r0: int, r1: int, m: int, device, diag: bool, exclude: bool):
    """Boolean ``(pos, neg)`` of a tile. ``rows is None``: two aligned sets, row ``i`` pairs
    with column ``i`` of the *diagonal* block (``diag``) and with nothing in the others; else
    equal labels (``rows`` against ``cols``). ``exclude``: self mode, the diagonal block's
    diagonal is neither."""
    if rows is None:
        if diag:
            r = torch.arange(r0, r1, device=device)
            pos = r.unsqueeze(-1) == torch.arange(m, device=device).unsqueeze(-2)
        else:
            pos = torch.zeros((r1 - r0, m), dtype=torch.bool, device=device)
    else:
        pos = rows[r0:r1].unsqueeze(-1) == cols.unsqueeze(-2)
    neg = pos.logical_not()
    if exclude and diag and torch.compiler.is_compiling():
        # Compiled, a mask written in place is stored as a boolean tile, which inductor writes
        # slowly on a CPU (NT-Xent at 512 x 512: 3.6 ms of a 11.7 ms step); as an expression
        # of the labels and indices it is recomputed inside each kernel that reads it.
        off = torch.arange(r0, r1, device=device).unsqueeze(-1) != torch.arange(m, device=device)
        return pos & off, neg  # neg's diagonal is False already: a row pairs with itself
    if exclude and diag:  # fresh masks: in place is safe (eager: no pass over the tile)
        pos.diagonal(offset=r0, dim1=-2, dim2=-1).fill_(False)
        neg.diagonal(offset=r0, dim1=-2, dim2=-1).fill_(False)
    return pos, neg


def _tile_masks(rows, cols, r0, r1, m, device, diag, exclude, at: _TileAt):
    """:func:`_masks`, or ``(None, None)`` where the positives are a diagonal (``at.eye``), which
    the kinds read without masks."""
    if at.eye is not None:
        return None, None
    return _masks(rows, cols, r0, r1, m, device, diag, exclude)


def _tile_positives(rows, cols, r0, r1, m, device, diag, exclude, at, listing):
    """A tile's ``(pos, neg, memo)``: from the block's :class:`_Listing` when there is one
    (no masks, ``None``; the memo holds the tile's positives), else :func:`_tile_masks` and an
    empty memo (the tile's positives, listed once for every width)."""
    if listing is not None:
        return None, None, listing.memo(r0, r1)
    return (*_tile_masks(rows, cols, r0, r1, m, device, diag, exclude, at), {})


def _row_lse_(s: Tensor, keep: Tensor | None) -> Tensor:
    """Row-wise log-sum-exp over the kept entries (``None``: all), destroying ``s``: rows with
    nothing kept (or only −inf) give ``−finfo.max``, a kept +inf gives +inf, a kept NaN NaN (as
    :func:`pmlfunc._ops.row_logsumexp`; an entry not kept is not read)."""
    low = -torch.finfo(s.dtype).max
    if s.shape[-1] == 0:  # a block without columns (an empty rank's, on the ring)
        return s.new_full(s.shape[:-1], low)
    if keep is not None:
        s = s.masked_fill_(keep.logical_not(), low)
    shift = s.amax(-1, keepdim=True)
    has = ~(shift <= low)
    shift = torch.where(has & (shift != torch.inf), shift, 0.0)  # inf − inf would be NaN
    # exp(max(x − shift, −80)): CPU exp of underflowing arguments is ~35× slower
    s = s.sub_(shift).clamp_min_(-80.0).exp_()
    if keep is not None:
        s = s.masked_fill_(keep.logical_not(), 0.0)
    total = s.sum(-1, keepdim=True)
    return torch.where(has, torch.log(torch.where(has, total, 1.0)) + shift, low).squeeze(-1)


def _row_softmax(
    s: Tensor, keep: Tensor | None, dim: int = -1, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(lse, probs)`` along ``dim`` over the kept entries (``None``: all), ``s`` left as it
    is: one fused softmax kernel, the log-sum-exp read back from it as ``max − log max(probs)``
    (the largest entry's probability is ``1 / Σ e^{s − max}``, at least ``1/M``: no underflow).
    Entries not kept get probability 0; a row with nothing kept gets ``lse = −finfo.max`` (as
    :func:`_row_lse_`) and probabilities its callers weigh by 0; a kept +inf or NaN gives NaN."""
    low = -torch.finfo(s.dtype).max
    e = s if keep is None else torch.where(keep, s, low)
    if s.shape[dim] == 0:  # a block without columns (an empty rank's, on the ring)
        return e.sum(dim).fill_(low), e
    if out is None:
        probs = torch.softmax(e, dim)
    else:  # a buffer of the walk's (_Scratch)
        probs = torch.ops.aten._softmax.out(e, dim, False, out=out)
    lse = e.amax(dim) - torch.log(probs.amax(dim))
    return lse, probs


def _exp_(s: Tensor, shift: float | Tensor) -> Tensor:
    """``exp(max(s − shift, −80))`` in place."""
    return s.sub_(shift).clamp_min_(-80.0).exp_()


def _ntxent_q_(z: Tensor, pos: Tensor, *, reuse: bool = False) -> tuple[Tensor, Tensor]:
    """``q = −∂term/∂z`` on the positives (0 elsewhere) of ``z = S − lse_neg``, and ``σ(z) + ε``
    there (1 elsewhere: its log is the term, 0 off the positives), two new tiles (``reuse``:
    one, the second in ``z``'s buffer): ``d/dz
    −log(σ(z) + ε) = −σ(z)(1 − σ(z)) / (σ(z) + ε)``, the dense loss's autograd chain. Off the
    positives ``z`` is read as 100, where ``σ = 1`` exactly: no mask to apply after.

    No ``Tensor.addcmul_(..., value=)`` (nor ``addcdiv_(value=)``, ``add_(alpha=tensor)``):
    dynamo rewrites those into ``torch._inductor.inductor_prims.fma``, a prim without a
    functorch rule, so ``torch.compile(torch.func.grad(...))`` of the loss failed with "Cannot
    access data pointer of Tensor that doesn't have storage" (PyTorch 2.13; the rewrite of a
    scalar ``value`` came with pytorch/pytorch#176871, the prim's autograd formula with #184629,
    which covers plain autograd only: ``torch.func.grad`` of ``inductor_prims.fma`` fails in
    eager mode too)."""
    r = z.masked_fill_(pos.logical_not(), 100.0) if reuse else torch.where(pos, z, 100.0)
    return _ntxent_q_of_(r)


def _ntxent_q_of_(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(q, σ(z) + ε)`` of :func:`_ntxent_q_` at every entry of ``z`` (destroyed), with σ's
    subnormal tail (:func:`~pmlfunc._ops.sigmoid_`: ``torch.sigmoid`` is 0 below −88.7 in
    float32, where ``σ(z)`` is still comparable to ``ε`` and gives the term its gradient)."""
    r, q = sigmoid_(z)  # σ, σ(1 − σ)
    return q.div_(r.add_(torch.finfo(r.dtype).tiny)), r


class _Listing(NamedTuple):
    """A labelled block's positive pairs, listed once a walk (:func:`_label_listing`): ``rows``
    and ``cols`` in row-major order (``nonzero``'s), ``ends`` each row's end in them, and the
    left-out self pairs' diagonal (``excluded``: self mode's own block)."""

    rows: Tensor
    cols: Tensor
    ends: list[int]
    excluded: bool

    def memo(self, r0: int, r1: int) -> dict:
        """A tile's memo (:func:`_listed`): its positives ``(rows − r0, cols)``, and the
        offset of its left-out diagonal (``"diag"``, or ``None``)."""
        a, b = (self.ends[r0 - 1] if r0 else 0), self.ends[r1 - 1]
        return {
            "listed": (self.rows[a:b] - r0, self.cols[a:b]),
            "diag": r0 if self.excluded else None,
        }


def _label_listing(kind, x: Tensor, rows, cols, excluded: bool) -> _Listing | None:
    """NT-Xent's and SupCon's positive pairs of a block with labels, where listing them is free
    (:func:`readable`) and they are few (at most :data:`~pmlfunc._ops.SPARSE_FRACTION` of the
    block), in ``O(M log M + N + |P|)``: the columns sorted by label, each row's run of its
    label found by binary search. The tiles then need no ``r × M`` masks: the positives are
    read and left out by index (:func:`_leave_out_`). ``None`` elsewhere (the masks' path).
    In NumPy (the labels are readable CPU tensors here): a dozen small array ops cost ~1 µs
    each there, ~5 µs as tensor ops."""
    if kind not in ("ntxent", "supcon") or not isinstance(rows, Tensor) or not readable(x):
        return None
    if x.ndim != 2 or rows.ndim != 1 or not isinstance(cols, Tensor) or cols.ndim != 1:
        return None
    if rows.device.type != "cpu" or cols.device.type != "cpu":
        return None
    r, c = rows.numpy(), cols.numpy()
    n, m = r.shape[0], c.shape[0]
    order = np.argsort(c, kind="stable")  # equal labels keep their column order
    ordered = c[order]
    start = np.searchsorted(ordered, r, side="left")
    count = np.searchsorted(ordered, r, side="right") - start
    total = int(count.sum())
    if total > SPARSE_FRACTION * n * m:
        return None
    pr = np.repeat(np.arange(n), count)
    first = np.repeat(start - (np.cumsum(count) - count), count)
    pc = order[first + np.arange(total)]
    if excluded:  # a row's own column is no positive
        kept = pr != pc
        pr, pc = pr[kept], pc[kept]
        count = np.bincount(pr, minlength=n)
    ends = np.cumsum(count).tolist()
    return _Listing(torch.from_numpy(pr), torch.from_numpy(pc), ends, excluded)


def _leave_out_(s: Tensor, memo: dict | None, positives: bool, value: float) -> Tensor:
    """``s`` with its left-out diagonal and, if ``positives``, its listed positives set to
    ``value`` in place (a tile of :meth:`_Listing.memo`): what the masks' ``where`` does."""
    assert memo is not None  # a listed tile's (_tile_positives)
    if positives:
        s = s.index_put_(memo["listed"], s.new_full((), value))
    if memo["diag"] is not None:
        s.diagonal(offset=memo["diag"], dim1=-2, dim2=-1).fill_(value)
    return s


def _listed(s: Tensor, pos: Tensor, memo: dict | None = None) -> tuple[Tensor, Tensor] | None:
    """A tile's positives as ``(rows, cols)`` where listing them is free (:func:`readable`: a
    CPU tensor in eager mode, outside transforms), else ``None`` (the static-shape path). Work
    on the positives alone (a few entries a row) then costs ``O(|P|)`` instead of a pass over
    the ``r × M`` tile. ``memo``: the tile's, where several widths read one mask (listed once)."""
    if not readable(s):
        return None
    if memo is not None and "listed" in memo:
        return memo["listed"]
    rows, cols = pos.nonzero(as_tuple=True)
    if memo is not None:
        memo["listed"] = rows, cols
    return rows, cols


def _ntxent_listed(s: Tensor, lse: Tensor, pos, memo: dict | None = None, at_pos=None):
    """NT-Xent's positive terms on the listed positives (:func:`_listed`): ``(rows, cols, q,
    σ(z) + ε)`` at the positives of ``z = s − lse``, by :func:`_ntxent_q_`'s formulas, or
    ``None``. ``at_pos``: the positives' logits, read before ``s`` was overwritten."""
    listed = _listed(s, pos, memo)
    if listed is None:
        return None
    rows, cols = listed
    q, r = _ntxent_q_of_((s[rows, cols] if at_pos is None else at_pos) - lse[rows])
    return rows, cols, q, r


def _ntxent_fold_(s: Tensor, pos, neg, lse: Tensor | None, grad: bool, memo=None):
    """One tile of NT-Xent's terms ``−log(σ(S − lse_neg) + ε)`` on the positives, destroying
    ``s``: ``(Σ terms, lse, Σ_P q per row, ∂L/∂S or None)``. ``lse``: the rows' negatives'
    log-sum-exp when known (the ring's second walk), else computed here; ``grad`` (only then):
    also the tile's ``∂L/∂S`` for a unit weight, the softmax over the negatives from the same
    exponentials as the log-sum-exp (a :class:`RowScaled` where ``s`` is in base-2 units)."""
    if memo is not None and memo.get("base2"):
        return _ntxent_base2_fold_(s, memo)
    soft, at_pos = None, None
    if pos is None:  # listed, no masks: the positives read, then left out of the softmax
        assert memo is not None  # the listing's (_tile_positives)
        at_pos = s[memo["listed"]]
        s = _leave_out_(s, memo, True, -torch.finfo(s.dtype).max)
    if lse is None and grad:
        lse, soft = _row_softmax(s, neg, out=None if memo is None else memo.get("probs"))
    elif lse is None:
        lse = _row_lse_(s.clone() if at_pos is None else s, neg)
    listed = _ntxent_listed(s, lse, pos, memo, at_pos)
    if listed is not None:
        rows, cols, q_p, r = listed
        q_sum = q_p.new_zeros(s.shape[0]).index_add_(0, rows, q_p)
        ds = None
        if soft is not None:  # soft is 0 at the positives (they are not negatives)
            ds = soft.mul_(q_sum.unsqueeze(-1)).index_put_((rows, cols), -q_p, accumulate=True)
        return r.log_().sum().neg(), lse, q_sum, ds
    assert pos is not None  # not listed: the masks' path
    q, r = _ntxent_q_(s.sub_(lse.unsqueeze(-1)), pos, reuse=True)
    q_sum = q.sum(-1)
    ds = None
    if soft is not None:  # the positives' terms: −q; the negatives' log-sum-exp carries Σ_P q
        ds = soft.mul_(q_sum.unsqueeze(-1)).sub_(q)
    return r.log_().sum().neg(), lse, q_sum, ds


class RowScaled(NamedTuple):
    """A tile's ``∂L/∂S`` as ``diag(row) · tile``: the gradient sums scale the ``(r, D)``
    operands and products by ``row`` instead of the ``r × M`` tile (:meth:`_GradSums.add`)."""

    tile: Tensor
    row: Tensor


# the kinds whose backward's recomputed tiles (_tile_ds_) take base-2 logits where bounded
_BASE2_RECOMPUTED = ("clip",)
# |S| up to this bound: 2^(S log₂e) neither overflows a row's float32 sum nor underflows
_BASE2_BOUND = 40.0
# SigLIP's terms log1p(e^{±S}) and e^{±S} / (1 + e^{±S}): e^{±80} is a normal float32
_SIGLIP_BOUND = 80.0
_LOG2E, _LN2 = 1.4426950408889634, 0.6931471805599453


def _logit_bound(x: Tensor, y: Columns, factor, bias, unit: bool = False) -> float | None:
    """A bound on ``|S|`` from the rows' norms, ``max‖x_i‖ · max_j |factor_j| ‖y_j‖ + max|bias|``,
    where reading it is free (a 2-D float32 or float64 CPU tensor in eager mode, :func:`readable`),
    else ``None``; NaN where an input is (every comparison with it fails). ``O((N + M) D)``.
    ``unit``: the rows are normalised before the product (norms at most 1; NaN still read)."""
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.float64) or not readable(x):
        return None
    if not x.numel() or any(not seg.numel() for seg in y.segments):
        return None
    x_norms = torch.linalg.vector_norm(x, dim=-1)
    x_norm = float(x_norms.amax())
    # self mode's columns are the rows: their norms once
    norms = [x_norms if seg is x else torch.linalg.vector_norm(seg, dim=-1) for seg in y.segments]
    y_norm = norms[0] if len(norms) == 1 else torch.cat(norms)
    if unit:  # ‖x̂‖ ≤ 1 (0 below ε), NaN kept
        x_norm, y_norm = min(x_norm, 1.0) if x_norm == x_norm else x_norm, y_norm.clamp_max(1.0)
    if isinstance(factor, Tensor) and factor.shape == y_norm.shape:  # a column's own factor
        fy = float((factor.abs() * y_norm).amax())  # (normalised columns: the scale)
    else:
        f = float(factor.abs().amax()) if isinstance(factor, Tensor) else abs(factor)
        fy = f * float(y_norm.amax())
    b = 0.0 if bias is None else float(bias.abs().amax()) if isinstance(bias, Tensor) else abs(bias)
    return x_norm * fy + b


class _Base2(NamedTuple):
    """A walk's tiles in base-2 units (:func:`_base2_units`): its factor and bias times
    ``log₂e``, and the bound on ``|S|`` that allowed them."""

    factor: float | Tensor
    bias: float | Tensor | None
    bound: float


def _base2_units(
    kind, x: Tensor, y: Columns, factor, bias, *, listed: bool, fused: bool, unit: bool = False
) -> _Base2 | None:
    """``(factor · log₂e, bias · log₂e, bound)`` where a walk of ``kind`` takes its tiles as base-2
    logits ``S log₂e`` (the factor applied by :func:`_logits`) and their exponentials as
    ``2^s`` with no row maximum, else ``None``. ``|S|`` must be known bounded
    (:func:`_logit_bound`): by :data:`_BASE2_BOUND` for the softmax kinds (no row's float32 sum
    overflows or underflows), :data:`_SIGLIP_BOUND` for SigLIP; one ``exp2`` pass (on an AVX2
    CPU 0.6× ``exp``'s time) and one row sum replace the softmax's three passes and two maxima.

    Which walks: NT-Xent and SupCon whose positives are ``listed`` and whose walk forms the
    gradient (``fused``), with one factor (a float or a 0-d tensor: a learnable temperature's
    gradient is the sums' ``Σ ∂S ⊙ x yᵀ``, whatever the tile's units) and no bias (:func:`_ntxent_base2_fold_`,
    :func:`_supcon_base2_fold_`); the retrieval kind whose query rows read every document
    (``not masked``, not sigmoid, no document columns) when ``fused``
    (:func:`_retrieval_base2_fold_`); SigLIP (:func:`_siglip_base2_fold_`); CLIP
    (:func:`_clip_fold_`, :func:`_clip_whole_`; its recomputed tiles too, :data:`_BASE2_RECOMPUTED`).
    ``unit``: the rows are normalised before the product (a nested walk's prefixes)."""
    if kind in ("ntxent", "supcon"):  # one factor for all (a float or 0-d temperature)
        one = isinstance(factor, float) or factor.ndim == 0
        ok, limit = listed and fused and one and bias is None, _BASE2_BOUND
    elif kind == "clip":
        ok, limit = True, _BASE2_BOUND
    elif isinstance(kind, Retrieval):
        ok = fused and not (kind.masked or kind.sigmoid or kind.doc_columns)
        limit = _BASE2_BOUND
    else:
        ok, limit = kind == "siglip", _SIGLIP_BOUND
    bound = _logit_bound(x, y, factor, bias, unit) if ok else None
    if bound is None or not bound <= limit:
        return None
    return _Base2(factor * _LOG2E, None if bias is None else bias * _LOG2E, bound)


def _log_total(total: Tensor) -> Tensor:
    """``ln Σ E`` of unshifted exponentials' sums ``Σ E`` (:func:`_base2_units`), ``−finfo.max``
    where a sum is 0 (nothing kept, as :func:`_row_lse_`) or NaN, ``+inf`` where it is: two ops
    where two ``where``s took six (a sum is never negative; not differentiated)."""
    low = -torch.finfo(total.dtype).max
    return torch.log(total).nan_to_num_(nan=low, posinf=math.inf, neginf=low)


def _base2_exp_(s: Tensor, memo: dict, positives: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(E, Σ E, ln Σ E)`` of a tile of base-2 logits ``S log₂e`` (:func:`_base2_units`), in
    ``s``'s buffer: ``E = 2^s`` with the self pairs and, if ``positives``, the listed positives
    left out (:func:`_leave_out_`). A row with nothing kept gets ``lse = −finfo.max``, as
    :func:`_row_lse_`."""
    e = _leave_out_(s, memo, positives, -torch.finfo(s.dtype).max).exp2_()
    total = e.sum(-1)
    return e, total, _log_total(total)


def _row_scaled_(e: Tensor, row: Tensor, at: tuple[Tensor, Tensor], value: Tensor, add: bool):
    """``diag(row) · e + V`` as a :class:`RowScaled`, ``V`` (``value`` at the listed entries
    ``at``) written into ``e`` divided by its row's scale (``add``: onto ``e``'s entry, else in
    place of it, a left-out 0); a row of scale 0 takes none (its ``V`` is 0 too)."""
    r = row[at[0]]
    e = e.index_put_(at, torch.where(r > 0, value / r, 0.0), accumulate=add)
    return RowScaled(e, row)


def _ntxent_base2_fold_(s: Tensor, memo: dict):
    """:func:`_ntxent_fold_` with the gradient, on a tile of base-2 logits with listed
    positives: ``∂L/∂S = diag(Σ_P q / Σ E) · E − Q`` (:func:`_base2_exp_`,
    :func:`_row_scaled_`), no pass of its own over the tile."""
    rows, cols = memo["listed"]
    at_pos = s[rows, cols].mul_(_LN2)
    e, total, lse = _base2_exp_(s, memo, True)
    listed = _ntxent_listed(s, lse, None, memo, at_pos)
    assert listed is not None  # a listed tile's memo
    _, _, q_p, r = listed
    q_sum = q_p.new_zeros(s.shape[0]).index_add_(0, rows, q_p)
    scale = torch.where(total > 0, q_sum / total, 0.0)  # (not differentiated: 0/0 unread)
    return r.log_().sum().neg(), lse, q_sum, _row_scaled_(e, scale, (rows, cols), -q_p, False)


def _supcon_base2_fold_(s: Tensor, local, memo: dict):
    """:func:`_supcon_fold_` with the gradient, on a tile of base-2 logits with listed
    positives: ``∂L/∂S = diag(w / Σ E) · E − w [P] / |P|`` over the candidates (every column
    but the self pair), as :func:`_ntxent_base2_fold_`."""
    rows, cols = memo["listed"]
    n_pos = s.new_zeros(s.shape[0]).index_add_(0, rows, s.new_ones(rows.shape))
    pos_sum = s.new_zeros(s.shape[0]).index_add_(0, rows, s[rows, cols]).mul_(_LN2)
    e, total, lse = _base2_exp_(s, memo, False)
    w = local({"row_lse": lse, "row_pos": n_pos, "row_pos_sum": pos_sum})
    w_pos = w / n_pos.clamp_min(1.0)
    scale = torch.where((n_pos > 0) & (total > 0), w / total, 0.0)  # (0/0 unread)
    ds = _row_scaled_(e, scale, (rows, cols), -w_pos[rows], True)
    return lse, n_pos, pos_sum, ds


def _supcon_fold_(s: Tensor, pos, cand, local, memo=None):
    """One tile of SupCon's row statistics, destroying ``s``: ``(lse over the candidates,
    |P|, Σ_P S, ∂L/∂S or None)``; ``cand`` ``None`` when every entry is one. ``local``: the
    rule giving each row's weight from its statistics (:func:`_row_weight`), or ``None`` for no
    gradient; the gradient ``w_i (softmax_C − [P]/|P(i)|)`` takes its softmax from the same
    exponentials as the log-sum-exp (a :class:`RowScaled` where ``s`` is in base-2 units)."""
    if local is not None and memo is not None and memo.get("base2"):
        return _supcon_base2_fold_(s, local, memo)
    listed = _listed(s, pos, memo)
    if listed is not None:  # |P| and Σ_P S from the listed positives
        rows, cols = listed
        n_pos = s.new_zeros(s.shape[0]).index_add_(0, rows, s.new_ones(rows.shape))
        pos_sum = s.new_zeros(s.shape[0]).index_add_(0, rows, s[rows, cols])
    else:
        n_pos = count_true(pos, -1).to(s.dtype)
    if pos is None:  # listed, no masks: the self pairs left out of the candidates
        s = _leave_out_(s, memo, False, -torch.finfo(s.dtype).max)
    if local is None:
        lse, soft = _row_lse_(s if listed is not None else s.clone(), cand), None
    else:
        lse, soft = _row_softmax(s, cand, out=None if memo is None else memo.get("probs"))
    if listed is None:
        assert pos is not None  # not listed: the masks' path
        pos_sum = s.masked_fill_(pos.logical_not(), 0.0).sum(-1)  # the positives' logits
    ds = None
    if local is not None and soft is not None:
        w = local({"row_lse": lse, "row_pos": n_pos, "row_pos_sum": pos_sum})
        w_pos = w / n_pos.clamp_min(1.0)
        w_soft = torch.where(n_pos > 0, w, torch.zeros_like(w)).unsqueeze(-1)
        ds = soft.mul_(w_soft)
        if listed is not None:
            return lse, n_pos, pos_sum, ds.index_put_(listed, -w_pos[listed[0]], accumulate=True)
        assert pos is not None  # not listed: the masks' path
        ds = ds.sub_(torch.where(pos, w_pos.unsqueeze(-1), 0.0))
    return lse, n_pos, pos_sum, ds


def _siglip_fold_(s: Tensor, pos, eye: int | None, grad: bool):
    """One tile of SigLIP's ``Σ softplus(−z S)``, destroying ``s``: ``(the sum, ∂L/∂S or
    None)``. ``eye``: the positives are the diagonal at this offset (aligned sets on their own
    block, no labels): then ``softplus(−S) = softplus(S) − S`` turns the tile into one
    ``softplus`` pass corrected on the diagonal, and ``∂/∂S = σ(S)`` corrected there."""
    if eye is None:  # labels: z = ±1 read from the mask
        sign = torch.where(pos, -1.0, 1.0)  # −z
        total = F.softplus(s.mul_(sign)).sum()
        ds = s.sigmoid_().mul_(sign) if grad else None
        return total, ds
    d = s.diagonal(offset=eye, dim1=-2, dim2=-1).clone()
    sp = F.softplus(s)
    total = sp.sum() - sp.diagonal(offset=eye, dim1=-2, dim2=-1).sum() + F.softplus(-d).sum()
    if not grad:
        return total, None
    ds = s.sigmoid_()
    ds.diagonal(offset=eye, dim1=-2, dim2=-1).copy_(torch.sigmoid(-d).neg_())
    return total, ds


def _siglip_base2_fold_(
    s: Tensor, pos, eye: int | None, grad: bool, out: Tensor | None = None, levels: int = 0
):
    """:func:`_siglip_fold_` on a tile of base-2 logits ``S log₂e`` with ``|S| ≤``
    :data:`_SIGLIP_BOUND` (:func:`_logit_bound`): one exponential ``t = e^{−zS}`` (``exp2``)
    gives both ``softplus(−zS) = log1p(t)`` and ``σ(−zS) = t / (1 + t)``, where ``softplus`` and
    ``sigmoid`` took two and one transcendental passes (on an AVX2 CPU ``softplus`` alone costs
    four times ``sigmoid``'s). ``out``: a buffer of the walk's for the terms (:class:`_Scratch`);
    ``levels``: :func:`_log1p_sum`'s folds (:func:`_log1p_levels` of the tile's bound)."""
    sign = None
    if eye is None:  # labels: z = ±1 read from the mask
        sign = torch.where(pos, -1.0, 1.0)  # −z
        s = s.mul_(sign)
        d = None
    else:  # the positives' S; every other pair is a negative: t = e^S
        d = s.diagonal(offset=eye, dim1=-2, dim2=-1).mul(_LN2)
    t = s.exp2_()
    terms = torch.empty_like(t) if out is None else out  # the sum's scratch, then 1 + t
    total = _log1p_sum(t, levels, terms)
    if d is not None:
        total = total - F.softplus(d).sum() + F.softplus(-d).sum()
    if not grad:
        return total, None
    ds = t.div_(torch.add(t, 1.0, out=terms))
    if sign is not None:
        return total, ds.mul_(sign)
    assert d is not None and eye is not None  # the diagonal's: −σ(−S)
    ds.diagonal(offset=eye, dim1=-2, dim2=-1).copy_(torch.sigmoid(-d).neg_())
    return total, ds


# float32's largest finite value is e^88.7: a product of 2^k factors (1 + t), t ≤ e^B, stays
# finite while 2^k (B + ln 2) ≤ 88
_LOG_FLOAT32_MAX = 88.0
_MAX_LOG1P_LEVELS = 3


def _log1p_levels(bound: float) -> int:
    """The folds :func:`_log1p_sum` may take over terms ``t = e^{±S}`` with ``|S| ≤ bound``:
    the most (up to :data:`_MAX_LOG1P_LEVELS`) whose product of ``2^levels`` factors
    ``(1 + t)`` is finite in float32."""
    levels = 0
    while levels < _MAX_LOG1P_LEVELS and 2 ** (levels + 1) * (bound + _LN2) <= _LOG_FLOAT32_MAX:
        levels += 1
    return levels


def _log1p_sum(t: Tensor, levels: int, out: Tensor) -> Tensor:
    """``Σ log1p(t)`` over a tile of ``t ≥ 0`` (SigLIP's terms), folding its two column halves
    into one ``levels`` times first, ``(1 + a)(1 + b) = 1 + (a + b + ab)``: each fold costs two
    passes over half the entries, where ``log1p`` costs three ``exp2`` passes an entry on an
    AVX2 CPU (``levels = 2``: one ``log1p`` an entry in four; 2,048² entries, one thread, 3.7
    → 2.2 ms with the sum). ``a + b + ab`` is positive and exact to a few ulp, so each term
    keeps ``log1p``'s relative accuracy; the caller bounds the products (:func:`_log1p_levels`).
    ``out``: scratch of ``t``'s shape (``t`` is left as it is)."""
    total = t.new_zeros(())
    free = out
    for _ in range(levels):
        h = t.shape[-1] // 2
        if h == 0:
            break
        if t.shape[-1] % 2:  # the odd column: on its own
            total = total + torch.log1p(t[..., -1]).sum()
        a, b = t[..., :h], t[..., h : 2 * h]
        t = torch.add(a, b, out=free[..., :h]).addcmul_(a, b)
        free = free[..., h:]  # the next fold's buffer: columns this one did not write
    return total + torch.log1p(t, out=free[..., : t.shape[-1]]).sum()


def _sigmoid_fold_(s: Tensor, keep: Tensor | None, at: int | None, grad: bool):
    """One tile of the ``sigmoid`` retrieval kind (:class:`Retrieval`), destroying ``s``
    ``(r, M)``: ``(Σ softplus(−z S) over the kept entries, their number, ∂L/∂S or None)``, with
    ``z = +1`` on the rows' positives (the diagonal from column ``at``, :func:`_positive_at`;
    none where ``at`` is ``None``) and ``−1`` elsewhere; ``keep`` (``None``: all) as
    :func:`_retrieval_masks` gives it (roles 1)."""
    r, m = s.shape[-2], s.shape[-1]
    flip = None if at is None else s[:, at : at + r].diagonal(dim1=-2, dim2=-1)
    if flip is not None:  # −z S
        flip.neg_()
    terms = F.softplus(s)
    if keep is not None:
        keep = keep.reshape(r, m)
        terms = terms.masked_fill_(keep.logical_not(), 0.0)
    cells = r * m if keep is None else count_true(keep)
    if not grad:
        return terms.sum(), cells, None
    ds = s.sigmoid_()  # ∂softplus(−zS)/∂S = −z σ(−zS)
    if flip is not None:
        flip.neg_()
    if keep is not None:
        ds = ds.masked_fill_(keep.logical_not(), 0.0)
    return terms.sum(), cells, ds


def block_forward(
    kind, x, y, rows, cols, scale, bias, chunk, *, diag, exclude, lse=None, final=True, grads=None
) -> dict[str, Tensor]:
    """Partial statistics of ``kind`` over one block of columns: :func:`walk_forward`'s, at
    one width."""
    return walk_forward(
        kind, x, y, rows, cols, scale, bias, chunk, diag=diag, exclude=exclude, lse=lse,
        final=final, grads=grads,
    )[0]  # fmt: skip


def walk_forward(
    kind, x, y, rows, cols, scale, bias, chunk, *, diag, exclude, lse=None, final=True, grads=None,
    nested=None,
) -> list[dict[str, Tensor]]:  # fmt: skip
    """Partial statistics of ``kind`` over one block of columns ``y`` (labels ``cols``), in
    tiles of ``chunk`` rows of ``x``. NT-Xent: ``lse=None, final=False`` gives the negatives'
    log-sum-exp only; ``lse`` (the rows' final one) gives the terms; ``final=True`` (one block)
    both. Each tile is worked on in place: a few tile-sized buffers live at a time.

    ``grads`` (a :class:`_GradSums`, one block only): also form each tile's ``∂L/∂S`` while it
    is held and add its products to ``grads`` (:func:`fused_loss`), so that no tile is computed
    twice. The retrieval kind's tiles are ``chunk`` loss rows, each of ``roles`` rows of ``x``
    (:class:`Retrieval`). ``y``: a tensor or :class:`Columns`.

    ``nested`` (a :class:`_Prefixes`, not the retrieval kind): every tile is one tile a width,
    from one blocked product, each folded into its own statistics (returned as a list, one
    dict a width) with the tile's masks built once; ``grads`` then is a :class:`_NestedSums`."""
    y = columns(y)
    n, m = x.shape[-2], y.m
    accs = [_Partials(kind, x, m) for _ in ((0,) if nested is None else nested.bounds)]
    acc = accs[0]
    factor = _tile_factor(y, scale)
    roles = _roles(kind)
    listing = _label_listing(kind, x, rows, cols, diag and exclude)
    # the plain walk's tile and softmax reused from tile to tile (a tile's buffers are done
    # with when the next begins: its gradient's products are taken, CLIP holds one tile only)
    scratch = _Scratch(_reuses(kind, x, nested, n // roles, chunk))
    base2 = None  # the tiles' factor and bias in base-2 units: (S log₂e), or None
    if nested is None:
        base2 = _base2_units(
            kind, x, y, factor, bias, listed=listing is not None, fused=grads is not None
        )
    f, b = (factor, bias) if base2 is None else (base2.factor, base2.bias)
    # SigLIP's folds of its terms before their log1p (_log1p_sum), once a walk
    levels = _log1p_levels(base2.bound) if base2 is not None and kind == "siglip" else 0
    for r0, r1 in _tiles(n // roles, chunk):
        if isinstance(kind, Retrieval):  # rows, cols: the rows' and columns' metadata
            s = _logits(x, y, r0 * roles, r1 * roles, f, b)
            keep, pen, col_keep = _retrieval_masks(kind, rows, cols, r0, r1, m, diag)
            pos_at = _positive_at(kind, n, r0, diag)
            if kind.sigmoid:
                total, cells, ds = _sigmoid_fold_(s, keep, pos_at, grads is not None)
                acc.total, acc.count = acc.total + total, acc.count + cells
                if grads is not None:
                    grads.add(ds, r0, r1)
                continue
            if kind.doc_columns and grads is not None:  # one tile (_fused): columns complete
                held = _retrieval_whole_(kind, s, keep, pen, col_keep, rows[1], scale, pos_at, acc)
                grads.held = (held, pos_at)
                continue
            if kind.doc_columns:  # the raw logits, down the positives' columns (online)
                c0, c1 = kind.positive_span(m)
                acc.fold_columns(s[..., c0:c1], col_keep)
            if base2 is not None:
                tile_lse, target, ds = _retrieval_base2_fold_(s, pos_at)
            else:
                tile_lse, target, ds = _retrieval_fold_(
                    kind, s, keep, pen, rows[1], scale, pos_at, grads is not None
                )
            acc.parts["row_lse"].append(tile_lse)
            acc.parts["row_pos_sum"].append(target)
            if grads is not None:
                grads.add(ds, r0 * roles, r1 * roles)
            continue
        at = _tile_at(rows, r0, r1, m, diag, exclude)
        pos, neg, memo = _tile_positives(
            rows, cols, r0, r1, m, x.device, diag, exclude, at, listing
        )
        tile_lse = None if lse is None else lse[r0:r1]
        if nested is None:
            tiles = ((0, _logits(x, y, r0, r1, f, b, scratch.take("logits", r1 - r0, m, x))),)
            memo["base2"], memo["log1p_levels"] = base2 is not None, levels
            # a second buffer: the softmax's (NT-Xent, SupCon), the base-2 terms' (SigLIP)
            if kind in ("ntxent", "supcon") if base2 is None else kind == "siglip":
                memo["probs"] = scratch.take("probs", r1 - r0, m, x)
        else:  # a width's logits die in its fold unless they become its gradient (SigLIP's)
            tiles = nested.tiles(r0, r1, held=grads is not None and kind == "siglip")
            memo["base2"] = nested.base2
        for k, s in tiles:
            sink = grads if nested is None or grads is None else grads.width(k)
            if nested is not None and grads is not None and kind in ("ntxent", "supcon"):
                memo["probs"] = nested.take(f"probs{k}", r1 - r0)  # the width's gradient
            if sink is None:
                _fold_tile_(kind, s, pos, neg, accs[k], tile_lse, final, at, memo=memo)
            elif kind == "clip":  # one tile: its ∂S once the reduction has its columns' stats
                held = _clip_whole_(s, pos, at.eye, accs[k], memo["base2"])
                sink.held = (*held, pos, at.eye)
            else:
                local = functools.partial(_row_weight, kind, sink.reducer)
                ds = _fold_tile_(kind, s, pos, neg, accs[k], tile_lse, final, at, local, memo)
                sink.add(ds, r0, r1)
        if nested is not None and grads is not None:
            grads.flush(r0, r1)
    return [a.result(lse is not None, final) for a in accs]


class _Partials:
    """What :func:`block_forward` folds its tiles into: the totals, the per-row parts (one
    entry per tile, in order) and CLIP's online column statistics."""

    ROW = ("row_lse", "row_pos", "row_pos_sum", "row_q")

    def __init__(self, kind: Kind, x: Tensor, m: int):
        self.kind, self.m = kind, m
        self.total = self.count = x.new_zeros(())
        self.parts: dict[str, list[Tensor]] = {k: [] for k in self.ROW}
        if isinstance(kind, Retrieval):  # doc_columns: the positive columns' log-sum-exps
            c0, c1 = kind.positive_span(m)
            m = c1 - c0
        self.col_max = x.new_full((m,), -torch.finfo(x.dtype).max)
        self.col_sum = self.col_pos = self.col_pos_sum = x.new_zeros(m)
        self.col_lse: Tensor | None = None  # set by one whole tile (_clip_whole_, ...)
        self.x = x

    def fold_columns(self, s: Tensor, keep: Tensor | None) -> None:
        """Fold a tile's logits ``s`` (the kept entries; ``None``: all) into the online
        log-sum-exp down each column (``s`` left as it is)."""
        low = -torch.finfo(s.dtype).max
        e = s - 0.0 if keep is None else torch.where(keep, s, low)  # a buffer of ours
        new_max = torch.maximum(self.col_max, e.amax(0))
        part = _exp_(e, new_max)
        if keep is not None:
            part = part.masked_fill_(keep.logical_not(), 0.0)
        self.col_sum = self.col_sum * (self.col_max - new_max).clamp_min(-80.0).exp() + part.sum(0)
        self.col_max = new_max

    def fold_column_sums(self, sums: Tensor) -> None:
        """Fold the column sums of a tile's unshifted exponentials ``E = e^S``
        (:func:`_base2_units`: every tile of the walk so) into the columns', their shift 0."""
        self.col_max = self.col_max.zero_()
        self.col_sum = self.col_sum + sums

    def column_lse(self) -> Tensor:
        """The columns' log-sum-exps folded so far (``−finfo.max`` for a column that read
        nothing; NaN propagates)."""
        if self.col_lse is not None:
            return self.col_lse
        low = -torch.finfo(self.col_sum.dtype).max
        return torch.where(self.col_sum == 0, low, torch.log(self.col_sum) + self.col_max)

    def last(self) -> dict[str, Tensor]:
        """The latest tile's per-row statistics."""
        return {k: v[-1] for k, v in self.parts.items() if v}

    def result(self, given_lse: bool, final: bool) -> dict[str, Tensor]:
        kind, x = self.kind, self.x
        if kind_name(kind) == "siglip":
            keys: tuple[str, ...] = ()
        elif isinstance(kind, Retrieval):
            keys = ("row_lse", "row_pos_sum")
        elif kind == "ntxent":  # a given lse is not a partial: not returned
            keys = ("row_q",) if given_lse else ("row_lse", "row_q") if final else ("row_lse",)
        else:
            keys = ("row_lse", "row_pos", "row_pos_sum")
        # every key, also without a tile (an empty rank's rows, on the ring)
        parts = self.parts
        out = {k: torch.cat(parts[k]) if parts[k] else x.new_zeros(0) for k in keys}
        if _ranked(kind) and not parts["row_lse"]:  # (0, one lse or one a role)
            out["row_lse"] = x.new_zeros((0, 1 if kind.joint else kind.roles))
        if isinstance(kind, Retrieval) and kind.doc_columns:  # over the block's M columns
            c0, c1 = kind.positive_span(self.m)
            lse = self.column_lse()
            low = -torch.finfo(lse.dtype).max
            out["col_lse"] = F.pad(lse, (c0, self.m - c1), value=low)
        if kind != "clip":
            out.update(total=self.total, count=self.count.to(x.dtype))
        else:
            out.update(
                col_lse=self.column_lse(),
                col_pos=self.col_pos.to(x.dtype),
                col_pos_sum=self.col_pos_sum,
            )
        return out


def _fold_tile_(
    kind, s, pos, neg, acc: _Partials, lse, final, where: _TileAt, local=None, memo=None
):
    """Fold one tile ``s`` (destroyed) with its masks into ``acc``; ``lse``: the tile rows'
    final NT-Xent log-sum-exp, when known. ``local`` (the row-complete kinds in one block: the
    row weights' rule, :func:`_row_weight`): also return the tile's ``∂L/∂S`` for those weights,
    formed from the same exponentials as the statistics. ``memo``: :func:`_listed`'s."""
    parts = acc.parts
    grad = local is not None
    if kind == "siglip":  # Σ softplus(−z·S), z = ±1
        if memo is not None and memo.get("base2"):
            levels = memo.get("log1p_levels", 0)
            t, ds = _siglip_base2_fold_(s, pos, where.eye, grad, memo.get("probs"), levels)
        else:
            t, ds = _siglip_fold_(s, pos, where.eye, grad)
        acc.total = acc.total + t
        cells = where.cells if where.cells is not None else count_true(pos) + count_true(neg)
        acc.count = acc.count + cells
        return ds
    if kind == "ntxent":  # −log(σ(S − lse_neg) + ε) on the positives
        if lse is None and not final:
            if pos is None:  # listed: the positives left out in place
                s = _leave_out_(s, memo, True, -torch.finfo(s.dtype).max)
            parts["row_lse"].append(_row_lse_(s, neg))
            return None
        t, tile_lse, q, ds = _ntxent_fold_(s, pos, neg, lse, grad, memo)
        acc.total, acc.count = acc.total + t, acc.count + _positives_count(pos, memo)
        parts["row_lse"].append(tile_lse)
        parts["row_q"].append(q)
        return ds
    if kind == "supcon":
        cand = (pos | neg) if where.excluded and pos is not None else None
        row_lse, n_pos, pos_sum, ds = _supcon_fold_(s, pos, cand, local, memo)
        if pos is None:  # listed: the candidates that are not positives
            r, m = s.shape[-2], s.shape[-1]
            acc.count = acc.count + (r * m - _positives_count(pos, memo) - r * where.excluded)
        else:
            acc.count = acc.count + count_true(neg)
        parts["row_lse"].append(row_lse)
        parts["row_pos"].append(n_pos)
        parts["row_pos_sum"].append(pos_sum)
        return ds
    return _clip_fold_(s, pos, where.eye, acc, memo is not None and memo.get("base2", False))


def _clip_positives(s: Tensor, pos, eye: int | None, acc: _Partials, unit: float) -> None:
    """A CLIP tile's positives into ``acc``, ``s`` read only: their number and the sum of
    their logits along each row and each column (``s`` times ``unit``: ``ln 2`` for base-2
    logits). ``eye``: one positive a row, on this diagonal (no mask)."""
    parts = acc.parts
    if eye is not None:
        d = s.diagonal(offset=eye, dim1=-2, dim2=-1) * unit
        ones, pad = torch.ones_like(d), (eye, s.shape[-1] - eye - d.shape[-1])
        n_r, sum_r, n_c, sum_c = ones, d, F.pad(ones, pad), F.pad(d, pad)
    else:
        n_r, n_c = count_true(pos, -1).to(s.dtype), count_true(pos, 0)
        on = torch.where(pos, s, 0.0)  # the positives' logits
        sum_r, sum_c = on.sum(-1) * unit, on.sum(0) * unit
    parts["row_pos"].append(n_r)
    parts["row_pos_sum"].append(sum_r)
    acc.col_pos, acc.col_pos_sum = acc.col_pos + n_c, acc.col_pos_sum + sum_c


def _clip_fold_(s: Tensor, pos, eye: int | None, acc: _Partials, base2: bool) -> None:
    """One CLIP tile into ``acc``, destroying ``s``: every entry is a candidate along its row
    and its column (the columns' log-sum-exps online). ``base2``: ``s`` holds ``S log₂e`` with
    ``|S|`` bounded (:func:`_base2_units`): one ``exp2`` pass and the row and column sums of
    ``E = e^S``, where the softmax took two maxima, a shift and an exponential each way."""
    _clip_positives(s, pos, eye, acc, _LN2 if base2 else 1.0)
    if base2:
        acc.fold_column_sums(_clip_exp_(s, acc)[1])
        return
    acc.fold_columns(s, None)
    acc.parts["row_lse"].append(torch.logsumexp(s, -1))


def _clip_exp_(s: Tensor, acc: _Partials) -> tuple[Tensor, Tensor]:
    """A tile of base-2 CLIP logits ``S log₂e`` made ``E = e^S`` in place (:func:`_base2_units`),
    its rows' log-sum-exps ``ln Σ_j E`` into ``acc``: ``E`` and its column sums."""
    e = s.exp2_()
    acc.parts["row_lse"].append(_log_total(e.sum(-1)))
    return e, e.sum(0)


def _positives_count(pos, memo) -> int | Tensor:
    """A tile's number of positives: its mask's, or its listing's (``pos`` ``None``)."""
    return memo["listed"][0].shape[0] if pos is None else count_true(pos)


def _clip_whole_(
    s: Tensor, pos, eye: int | None, acc: _Partials, base2: bool = False
) -> tuple[Tensor, Tensor | None]:
    """CLIP over one tile that holds the whole matrix (every row and column complete),
    destroying ``s``: its statistics into ``acc``, and its row and its column softmax (one
    fused kernel each, :func:`_row_softmax`) for :func:`_clip_whole_ds_`. ``base2`` (``s``
    holds ``S log₂e``, :func:`_base2_units`): ``E = e^S`` from one ``exp2`` pass, whose row and
    column sums give both log-sum-exps, held alone (``(E, None)``: one tile, not two)."""
    _clip_positives(s, pos, eye, acc, _LN2 if base2 else 1.0)
    if base2:
        e, down = _clip_exp_(s, acc)
        acc.col_lse = _log_total(down)
        return e, None
    lse_r, p_r = _row_softmax(s, None, -1)
    lse_c, p_c = _row_softmax(s, None, 0)
    acc.parts["row_lse"].append(lse_r)
    acc.col_lse = lse_c
    return p_r, p_c


def _clip_whole_ds_(p_r: Tensor, p_c: Tensor | None, pos, eye: int | None, row, col) -> Tensor:
    """CLIP's ``∂L/∂S`` over its one whole tile from its two softmaxes (destroyed), or from
    ``E`` alone (``p_c`` ``None``: :func:`_clip_whole_`'s ``base2``)."""
    (row_lse, row_pos, row_coef), (col_lse, col_pos, col_coef) = row, col
    if p_c is None:
        ds = _clip_exp_ds_(p_r, row_lse, row_coef, col_lse, col_coef)
    else:
        ds = p_r.mul_(row_coef.unsqueeze(-1)).add_(p_c.mul_(col_coef.unsqueeze(0)))
    return _clip_positives_ds_(ds, pos, eye, row_pos, row_coef, col_pos, col_coef)


# Rows a step of an in-place broadcast update of a tile on a CPU in eager mode (entries a step):
# the step's (rows, M) operand stays in cache, and the update needs no second tile (a fresh
# tile of over 32 MiB is mapped and faulted in anew: 25-30 ms for 4,096 × 4,096 here, where
# an in-place pass over a tile in memory took 4-6)
_INPLACE_STEP = 2**16


def _steps(t: Tensor):
    """The row ranges of :func:`readable` ``t``'s steps of about :data:`_INPLACE_STEP` entries."""
    step = max(1, _INPLACE_STEP // max(t.shape[-1], 1))
    return ((r0, r0 + step) for r0 in range(0, t.shape[-2], step))


def _clip_exp_ds_(e: Tensor, row_lse, row_coef, col_lse, col_coef) -> Tensor:
    """CLIP's softmax terms of ``∂L/∂S``, ``c_i softmax_row + c_j softmax_col``, from a tile's
    unshifted exponentials ``E = e^S`` (:func:`_base2_units`' bound), in place of ``E``:
    ``E ⊙ (u_i + v_j)`` with ``u = c_row e^{−lse_row}``, ``v = c_col e^{−lse_col}``, one pass
    where the shifted softmaxes took ten (a step of rows at a time where :func:`readable`;
    elsewhere one fused kernel, compiled, or one temporary)."""
    u = (row_coef * torch.exp(-row_lse)).unsqueeze(-1)
    v = col_coef * torch.exp(-col_lse)
    if not readable(e):
        return e.mul_(u + v)
    for r0, r1 in _steps(e):
        e[r0:r1].mul_(torch.add(u[r0:r1], v))
    return e


def _clip_positives_ds_(ds: Tensor, pos, eye, row_pos, row_coef, col_pos, col_coef, buf=None):
    """``ds`` (a tile's softmax terms) minus CLIP's positives' terms, in place:
    ``[P](c_i / |P(i)| + c_j / |P(j)|)`` (``row_*``: the tile's rows'; ``eye``: one positive a
    row and a column, on this diagonal, no mask). ``buf``: a free tile for the masks' weights."""
    if eye is not None:
        r = ds.shape[-2]
        ds.diagonal(offset=eye, dim1=-2, dim2=-1).sub_(row_coef + col_coef[eye : eye + r])
        return ds
    w_r = (row_coef / row_pos.clamp_min(1.0)).unsqueeze(-1)
    w_c = col_coef / col_pos.clamp_min(1.0)
    if buf is None or inside_transform():  # (vmap has no batching rule for out=)
        return ds.sub_(torch.where(pos, w_r + w_c, 0.0))
    w = torch.add(w_r, w_c, out=buf)
    return ds.sub_(w.masked_fill_(pos.logical_not(), 0.0))


@dataclass(frozen=True)
class _TileAt:
    """Where a tile lies, for the shortcuts that read it: ``eye``, the diagonal offset of the
    positives when they are exactly a diagonal (aligned sets, own block), else ``None``;
    ``excluded``, whether the tile holds self pairs left out; ``cells``, the number of
    candidate pairs when no entry is left out (else ``None``: counted from the masks)."""

    eye: int | None
    excluded: bool
    cells: int | None


def _tile_at(rows, r0: int, r1: int, m: int, diag: bool, exclude: bool) -> _TileAt:
    excluded = exclude and diag
    eye = r0 if rows is None and diag and not excluded else None
    return _TileAt(eye, excluded, None if excluded else (r1 - r0) * m)


def _retrieval_masks(opt: Retrieval, rows, cols, r0: int, r1: int, m: int, diag: bool):
    """``(keep, pen, col_keep)`` of the retrieval kind's loss rows ``r0:r1``: ``keep``
    ``(r, roles, M)``, the entries that are candidates of their row; ``pen`` ``(r, M)``, the
    query rows' entries that get the hardness term (``None``: no hardness); ``col_keep``
    (``doc_columns``) ``(r, P)`` over the block's ``P`` positive columns, the query rows each
    positive reads (``None``: all). ``rows = (meta, strength, guide, threshold)`` with ``meta``
    ``(N, 3)`` = (row index, anchor id, positive id); ``cols = (meta, guide, threshold)`` with
    ``meta`` ``(M, 4)`` = (column type, owner row, its anchor id, its positive id) and the
    threshold of each column's owner (``doc_columns`` only); row indices are the block's own,
    so a row owns columns of its own block only (``diag``).

    A query row never reads its own query; a document row never reads its own documents (its
    own query, the positive pair read backwards, it does). With ids, another row whose anchor
    id or positive id is equal is the same query or document: its query and positive are
    masked. With a guide, an entry whose guide similarity exceeds the row's threshold is
    masked, except the positive pair. ``keep`` is ``None`` where every entry is a candidate (a
    query row against documents only, no ids, no guide): no mask is built or read."""
    if not opt.masked:
        return None, None, None
    meta, cm = rows[0][r0:r1], cols[0]
    ctype = cm[:, 0]
    own = meta[:, :1] == cm[:, 1]  # (r, M): this row's query and documents
    if not diag:  # another rank's block: equal local indices are other rows
        own = torch.zeros_like(own)
    is_query, is_doc = ctype == COL_QUERY, ctype != COL_QUERY
    keeps = []
    for role in range(opt.roles):
        read = [ctype == t for t, ok in enumerate(opt.allowed[role]) if ok]
        typed = functools.reduce(torch.logical_or, read)
        keeps.append(typed & ~(own & (is_query if role == 0 else is_doc)))
    keep = torch.stack(keeps, 1)
    c0, c1 = opt.positive_span(m)
    col_keep: Tensor | None = None  # doc_columns: (r, c1 − c0), None: every query row read
    if any(opt.ids):  # the ids given: a row's default id (its index) relates it to no other
        by_anchor, by_positive = (meta[:, 1:2] == cm[:, 2]), (meta[:, 2:3] == cm[:, 3])
        related = (
            by_anchor | by_positive if all(opt.ids) else by_anchor if opt.ids[0] else by_positive
        )
        same = related & ~own & (ctype != COL_NEGATIVE)
        keep = keep & ~same.unsqueeze(1)
        if opt.doc_columns:  # related is symmetric: column p_j leaves out query q_r alike
            col_keep = ~same[:, c0:c1]
    if opt.guide:
        guide_rows, threshold = rows[2], rows[3]
        g = matmul(guide_rows[r0 * opt.roles : r1 * opt.roles], cols[1].transpose(-1, -2))
        over = g.view(r1 - r0, opt.roles, m) > threshold[r0:r1, None, None]
        pair = [own & (ctype == COL_POSITIVE), own & is_query][: opt.roles]
        keep = keep & ~(over & ~torch.stack(pair, 1))
        if opt.doc_columns:  # p_j reads q_r unless cos_guide(q_r, p_j) exceeds p_j's threshold
            over_c = (g[:, c0:c1] > cols[2][c0:c1]) & ~own[:, c0:c1]
            col_keep = ~over_c if col_keep is None else col_keep & ~over_c
    kept: Tensor | None = None if opt.reads_every else keep
    if opt.hardness is None:
        return kept, None, col_keep
    if opt.hardness == "in_batch_negatives":
        return kept, is_doc & ~own, col_keep
    if opt.hardness == "hard_negatives":
        return kept, (ctype == COL_NEGATIVE) & own, col_keep
    return kept, is_doc & ~(own & (ctype == COL_POSITIVE)), col_keep  # all_negatives


def _hardness_(s: Tensor, opt: Retrieval, pen, strength, scale) -> Tensor:
    """The tile ``s`` ``(r·roles, M)`` with ``strength · stop_grad(sim)`` added to the query rows'
    entries ``pen`` (``sim = S / scale``: the penalty enters as a constant of the logits), in
    place; ``(r, roles, M)``."""
    s3 = s.view(s.shape[-2] // opt.roles, opt.roles, s.shape[-1])
    if pen is not None:
        s3[:, 0].mul_(torch.where(pen, 1.0 + strength / scale, 1.0))
    return s3


def _positive_at(opt: Retrieval, n: int, r0: int, diag: bool) -> int | None:
    """The column of the first tile row's positive ``p_{r0}`` in its own block (``n`` rows of
    ``x``, ``roles`` a loss row): the tile's positives are the diagonal from there; ``None`` in
    another rank's block, which holds none."""
    if not diag:
        return None
    return (n // opt.roles if opt.query_columns else 0) + r0


def _retrieval_fold_(opt: Retrieval, s: Tensor, keep, pen, strength, scale, at, grad: bool):
    """One tile of the retrieval kind, destroying ``s``: ``(lse, S(q_i, p_i), ∂L/∂S or None)``.
    ``lse`` ``(r, 1)`` over each row's candidates of every role (``joint``) or ``(r, roles)``,
    one a role; the positives' logits ``(r,)`` from column ``at`` on (:func:`_positive_at`;
    zeros where ``at`` is ``None``); ``∂L/∂S`` ``(r·roles, M)`` of ``mean_roles lse − S(q_i,
    p_i)`` for a unit weight: the softmax over the candidates (over a role's, divided by
    ``roles``), from the same exponentials, minus 1 at the positive. ``doc_columns``: the
    softmax alone (:func:`_retrieval_whole_ds_` weighs it once the columns' statistics are
    known)."""
    s3 = _hardness_(s, opt, pen, strength, scale)  # the positive gets no hardness term
    r = s3.shape[0]
    target = s3.new_zeros(r) if at is None else _positives(s3, at).clone()
    e, k = (s3.reshape(r, -1), keep) if opt.joint else (s3, keep)
    if k is not None and opt.joint:
        k = k.reshape(r, -1)
    if not grad:
        return _row_lse_(e, k).reshape(r, -1), target, None
    lse, probs = _row_softmax(e, k)
    if opt.doc_columns:
        return lse.reshape(r, -1), target, probs.reshape(s.shape)
    if not opt.joint:
        probs = probs.div_(opt.roles)
    ds = probs.reshape(s3.shape)
    if at is not None:
        _positives(ds, at).sub_(1.0)
    return lse.reshape(r, -1), target, ds.reshape(s.shape)


def _retrieval_base2_fold_(s: Tensor, at: int | None):
    """:func:`_retrieval_fold_` with the gradient, where every entry of a query row is a
    candidate and there is no hardness term (``not opt.masked``, one role), on a tile of base-2
    logits (:func:`_base2_units`): ``E = 2^s``, ``lse = ln Σ E`` and ``∂L/∂S =
    diag(1 / Σ E) · E − [positive]`` as a :class:`RowScaled` (the positive's ``−1`` written into
    ``E`` as ``−Σ E``), where the softmax took three passes and two row maxima."""
    r = s.shape[0]
    target = s.new_zeros(r) if at is None else s[:, at : at + r].diagonal().mul(_LN2)
    e = s.exp2_()
    total = e.sum(-1)
    lse = _log_total(total)
    if at is not None:  # w E_pp − 1 = w (E_pp − Σ E)
        e[:, at : at + r].diagonal().sub_(total)
    has = total > 0
    scale = torch.where(has, 1.0 / torch.where(has, total, 1.0), 0.0)
    return lse.unsqueeze(-1), target, RowScaled(e, scale)


def _positives(t3: Tensor, at: int) -> Tensor:
    """The query rows' entries at their positives: a view of ``t3`` ``(r, roles, M)``, the
    diagonal of the query role from column ``at``."""
    r = t3.shape[0]
    return t3[:, 0, at : at + r].diagonal(dim1=-2, dim2=-1)


def _retrieval_ds_(
    opt: Retrieval, s: Tensor, keep, pen, strength, scale, at, lse, coef, col=None
) -> Tensor:
    """The retrieval kind's ``∂L/∂S`` of one tile recomputed from the rows' log-sum-exps
    ``lse`` ``(r, 1 or roles)`` (the backward of :class:`_TiledGrads`); ``doc_columns``: ``col =
    (col_keep, the block's column log-sum-exps (M,))`` adds the positive columns' softmax down
    the query rows (from the raw logits: no hardness term)."""
    col_part = None
    if col is not None:
        col_keep, col_lse = col
        c0, c1 = opt.positive_span(s.shape[-1])
        col_part = _exp_(s[..., c0:c1] - col_lse[c0:c1], 0.0)
        if col_keep is not None:
            col_part = col_part.masked_fill_(col_keep.logical_not(), 0.0)
    s3 = _hardness_(s, opt, pen, strength, scale)
    p = _exp_(s3, lse.unsqueeze(-1))
    if keep is not None:
        p = p.masked_fill_(keep.logical_not(), 0.0)
    if col_part is not None:
        p[:, 0, c0:c1].add_(col_part)
    if opt.parts != 1:
        p = p.div_(opt.parts)
    if at is not None:
        _positives(p, at).sub_(1.0)
    return p.mul_(coef).reshape(s.shape)


def _retrieval_whole_(opt: Retrieval, s: Tensor, keep, pen, col_keep, strength, scale, at, acc):
    """``doc_columns`` over one tile that holds every row (the columns' statistics complete),
    destroying ``s``: the rows' statistics into ``acc`` and, for :func:`_retrieval_whole_ds_`,
    the rows' softmax, the positive columns' softmax down the rows (raw logits) and their
    log-sum-exps."""
    c0, c1 = opt.positive_span(s.shape[-1])
    col_lse, col_p = _row_softmax(s[..., c0:c1], col_keep, 0)
    row_lse, target, row_p = _retrieval_fold_(opt, s, keep, pen, strength, scale, at, True)
    acc.parts["row_lse"].append(row_lse)
    acc.parts["row_pos_sum"].append(target)
    acc.col_lse = col_lse
    return row_p, col_p, row_lse, col_lse


def _retrieval_whole_ds_(opt: Retrieval, held, stats, at) -> Tensor:
    """``doc_columns``' ``∂L/∂S`` over its one whole tile from :func:`_retrieval_whole_`'s
    softmaxes (destroyed), each reweighed from its own log-sum-exp to the one the loss reads
    (:func:`reduce`: the joint one, or its own with weight ``1/2``)."""
    row_p, col_p, row_lse, col_lse = held
    row_ref, coef, col_ref = stats
    c0, c1 = opt.positive_span(row_p.shape[-1])
    ds = row_p.mul_(torch.exp(row_lse - row_ref))
    ds[:, c0:c1].add_(col_p.mul_(torch.exp(col_lse - col_ref[c0:c1])))
    if opt.parts != 1:
        ds = ds.div_(opt.parts)
    if at is not None:
        _positives(ds.unsqueeze(1), at).sub_(1.0)
    return ds.mul_(coef)


def merge(a: dict[str, Tensor] | None, b: dict[str, Tensor]) -> dict[str, Tensor]:
    """The statistics of two blocks of columns together: log-sum-exps by ``logaddexp`` (an
    empty side's ``−finfo.max`` leaves the other unchanged; NaN propagates), the rest summed."""
    if a is None:
        return b
    return {k: torch.logaddexp(a[k], v) if k.endswith("lse") else a[k] + v for k, v in b.items()}


def _supcon_losses(st: dict[str, Tensor]) -> Tensor:
    """SupCon's per-row loss ``−mean_P log softmax`` (0 for a row without positives)."""
    n_pos = st["row_pos"]
    mean_log_prob = st["row_pos_sum"] / n_pos.clamp_min(1.0) - torch.where(
        n_pos > 0, st["row_lse"], 0.0
    )
    return -mean_log_prob


def counts(kind: Kind, st: dict[str, Tensor], n: int) -> dict[str, Tensor]:
    """The numbers ``kind``'s reducers divide by, over these ``n`` rows (and, for CLIP, these
    columns): across ranks, their sums over the ranks are the global ones."""
    zero = next(iter(st.values())).new_zeros(())
    if _ranked(kind):  # n counts x's rows, ``roles`` a loss row
        return {"n": zero + st["row_lse"].shape[0]}
    if kind_name(kind) == "siglip":
        return {"n": zero + n, "count": st["count"]}
    if kind == "ntxent":
        return {"count": st["count"]}
    if kind == "supcon":
        nonzero = _supcon_losses(st).sign().clamp_min(0.0).sum()  # the reducer's window: > 0
        pos = st["row_pos"].sum()
        return {"n": zero + n, "pos": pos, "count": st["count"], "nonzero": nonzero}
    return {f"{s}_has": (st[f"{s}_pos"] > 0).sum().to(zero.dtype) for s in ("row", "col")}


def _row_weight(
    kind: Kind, reducer: str, st: dict[str, Tensor], losses: Tensor | None = None
) -> float | Tensor:
    """The row-complete kinds weigh row ``i``'s loss by ``row_weight_i × batch_weight``: this
    is the first factor, from these rows' own statistics (a tile's: SupCon's ``avg_nonzero``
    window, the row's loss ``> 0``). The forward walk that forms the gradient as it goes
    (:func:`block_forward` with ``grads``) weighs each tile by it and scales the sums by
    :func:`_batch_weight` once at the end; :func:`reduce` multiplies the two. ``losses``: the
    rows' SupCon losses where the caller has them (:func:`_supcon_losses` of ``st``)."""
    if kind != "supcon":
        return 1.0
    if reducer == "avg_nonzero":  # the reducers' window: loss > 0, by sign
        return (_supcon_losses(st) if losses is None else losses).sign().clamp_min(0.0)
    return torch.ones_like(st["row_lse"])


def _batch_weight(kind: Kind, reducer: str, total: Mapping[str, Tensor]) -> Tensor:
    """The second factor of :func:`_row_weight`: a scalar from the whole batch's
    :func:`counts` (``total``)."""
    one = next(iter(total.values())).new_ones(())
    if _ranked(kind):
        return ratio(one, total["n"]) if reducer == "mean" else one
    if kind_name(kind) == "siglip":  # (each weight computed only for its reducer: a few ops a call)
        if reducer == "batch":
            return one / total["n"]
        return ratio(one, total["count"]) if reducer == "mean" else one
    if kind == "ntxent":
        return ratio(one, total["count"]) if reducer == "mean" else one
    # supcon: 0 unless the batch has a positive and a negative pair
    if reducer == "avg_nonzero":
        glob = ratio(one, total["nonzero"])
    else:
        glob = one / total["n"] if reducer == "mean" else one
    return torch.where((total["pos"] > 0) & (total["count"] > 0), glob, 0.0)


def reduce(
    kind: Kind, st: dict[str, Tensor], reducer: str, total: Mapping[str, Tensor]
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The loss of these rows (and columns) and the statistics its backward reads (per-row ones
    first, :data:`ROW_STATS`), given the :func:`counts` of the whole batch (``total``)."""
    if _ranked(kind):  # Σ_i w · (mean_roles lse_i − S(q_i, p_i))
        coef = _batch_weight(kind, reducer, total)
        row_lse = st["row_lse"]
        if not kind.doc_columns:
            terms = row_lse.mean(-1) - st["row_pos_sum"]
            return terms.sum() * coef, (row_lse, coef)
        # doc_to_query down the positive columns: row i's second log-sum-exp is its positive's
        full = st["col_lse"]
        c0, c1 = kind.positive_span(full.shape[-1])
        col = full[c0:c1]
        if kind.joint:  # one log-sum-exp over both directions' candidates
            lse = torch.logaddexp(row_lse[:, 0], col)
            row_ref, col_ref = lse.unsqueeze(-1), F.pad(lse, (c0, full.shape[-1] - c1))
        else:  # the mean of the two
            lse = (row_lse[:, 0] + col) / 2
            row_ref, col_ref = row_lse, full
        return (lse - st["row_pos_sum"]).sum() * coef, (row_ref, coef, col_ref)
    if kind_name(kind) == "siglip":
        coef = _batch_weight(kind, reducer, total)
        return st["total"] * coef, (coef,)
    if kind == "ntxent":
        coef = _batch_weight(kind, reducer, total)
        return st["total"] * coef, (st["row_lse"], st["row_q"], coef)
    if kind == "supcon":
        active = (total["pos"] > 0) & (total["count"] > 0)
        row_losses = _supcon_losses(st)
        losses = torch.where(active, row_losses, 0.0)
        coef = torch.where(
            active,
            _row_weight(kind, reducer, st, row_losses) * _batch_weight(kind, reducer, total),
            0.0,
        )
        return matmul(coef, losses), (st["row_lse"], st["row_pos"], coef)
    # clip: (R(rows) + R(columns)) / 2 over the rows / columns that have a positive
    loss: Tensor | None = None
    out: list[Tensor] = []
    for side in ("row", "col"):
        lse, n_pos, pos_sum = st[f"{side}_lse"], st[f"{side}_pos"], st[f"{side}_pos_sum"]
        has = (n_pos > 0).to(lse.dtype)
        terms = (lse - pos_sum / n_pos.clamp_min(1.0)) * has
        # the mean over the sides' rows with a positive (has is 0 wherever that count is 0)
        coef = has / total[f"{side}_has"].clamp_min(1.0) if reducer == "mean" else has
        coef = coef * 0.5
        loss = matmul(coef, terms) if loss is None else loss + matmul(coef, terms)
        out += [lse, n_pos, coef]
    assert loss is not None  # two sides
    return loss, tuple(out)


def _tile_ds_(kind, s, pos, neg, r0, r1, row, col, eye=None, memo=None) -> Tensor:
    """``∂L/∂S`` of one tile (for a unit cotangent) from the statistics of its rows (``row``)
    and its block's columns (``col``), computed in ``s``'s buffer (destroyed) and at most one or
    two more. ``eye``: the positives are this diagonal (:class:`_TileAt`; no masks given)."""
    if kind == "siglip":  # ∂ softplus(−zS)/∂S = −z σ(−zS)
        (coef,) = row
        if eye is not None:  # σ(S), and −σ(−S) on the diagonal
            d = s.diagonal(offset=eye, dim1=-2, dim2=-1).clone()
            ds = s.sigmoid_()
            ds.diagonal(offset=eye, dim1=-2, dim2=-1).copy_(torch.sigmoid(-d).neg_())
            return ds.mul_(coef)
        sign = torch.where(pos, -1.0, 1.0)  # −z
        return s.mul_(sign).sigmoid_().mul_(sign).mul_(coef)
    if kind == "ntxent":
        lse, q_sum, coef = row[0][r0:r1], row[1][r0:r1], row[2]
        listed = _ntxent_listed(s, lse, pos, memo)  # read before s is overwritten
        z = s.sub_(lse.unsqueeze(-1))
        # the positives' terms: −q; the negatives' log-sum-exp carries Σ_P q, spread by softmax
        if listed is not None:
            rows, cols, q_p, _ = listed
            soft = _exp_(z, 0.0)
            if pos is None:  # listed, no masks
                soft = _leave_out_(soft, memo, True, 0.0)
            else:
                soft = soft.masked_fill_(neg.logical_not(), 0.0)
            soft = soft.mul_(q_sum.unsqueeze(-1))
            return soft.index_put_((rows, cols), -q_p, accumulate=True).mul_(coef)
        q = _ntxent_q_(z, pos)[0]
        soft = _exp_(z, 0.0).masked_fill_(neg.logical_not(), 0.0)
        return soft.mul_(q_sum.unsqueeze(-1)).sub_(q).mul_(coef)
    if kind == "supcon":
        lse, n_pos, coef = (v[r0:r1] for v in row)
        d = coef  # ∂L/∂ℓ_i
        # ∂ℓ_i/∂S_ij = −pos_ij / |P(i)| + [|P(i)| > 0] · softmax over the candidates
        w_pos = (-d / n_pos.clamp_min(1.0)).unsqueeze(-1)
        w_soft = torch.where(n_pos > 0, d, torch.zeros_like(d)).unsqueeze(-1)
        listed = _listed(s, pos, memo)
        soft = _exp_(s, lse.unsqueeze(-1))
        if pos is None:  # listed, no masks: the self pairs are no candidates
            soft = _leave_out_(soft, memo, False, 0.0)
        else:
            soft = soft.masked_fill_((pos | neg).logical_not(), 0.0)
        if listed is not None:
            return soft.mul_(w_soft).index_put_(listed, w_pos[listed[0], 0], accumulate=True)
        assert pos is not None  # not listed: the masks' path
        return soft.mul_(w_soft).add_(torch.where(pos, w_pos, 0.0))
    (row_lse, row_pos, row_coef), (col_lse, col_pos, col_coef) = row, col
    cr, lse_r, n_r = row_coef[r0:r1], row_lse[r0:r1], row_pos[r0:r1]
    if memo is not None and memo.get("base2"):  # S log₂e, bounded: E = 2^s, ∂S written over it
        e = s.exp2_()
        ds = _clip_exp_ds_(e, lse_r, cr, col_lse, col_coef)
        return _clip_positives_ds_(ds, pos, eye, n_r, cr, col_pos, col_coef, None)
    ds = _exp_(s - lse_r.unsqueeze(-1), 0.0).mul_(cr.unsqueeze(-1))
    ds = ds.add_(_exp_(s, col_lse.unsqueeze(0)).mul_(col_coef.unsqueeze(0)))  # s is free after
    return _clip_positives_ds_(ds, pos, eye, n_r, cr, col_pos, col_coef, s)


# a walk's gradient sums: (∂x, (∂segment, ...), ∂scale, ∂bias), None where not asked for
Sums = tuple[Tensor | None, tuple[Tensor | None, ...], Tensor | None, Tensor | None]


class _GradSums:
    """The gradient sums of one block for a unit cotangent, before the scale: ``∂S ŷ`` (the
    rows'), ``∂Sᵀ x`` (each column segment's, made the raw rows' gradient where the engine
    normalises them: :meth:`Columns.unit_backward_`), ``Σ ∂S ⊙ x ŷᵀ`` (the scale's) and
    ``Σ ∂S`` (the bias's), each kept only when ``needs = (rows, (segment, ...), scale, bias)``
    asks. ``into``: a buffer that the rows' *and* the columns' parts are added to (self mode
    with one block: ``x`` is both sides), returned as the one segment's.

    :meth:`add` takes one tile's ``∂L/∂S``: the backward's recomputed tiles, or the forward's
    when it forms the gradient as it goes (:func:`block_forward` with ``grads``: each row's
    weight local, :func:`_row_weight`, the global factor applied once after the walk). ``held``:
    CLIP's and the retrieval kind's (``doc_columns``) one tile, kept by the forward walk until
    the reduction of its statistics, whose columns are complete only after it
    (:func:`fused_loss`)."""

    def __init__(self, x: Tensor, y: Columns, needs, into: Tensor | None = None, reducer=None):
        self.x, self.y, self.needs, self.reducer = x, y, needs, reducer
        self.rows: list[Tensor] = []
        self.gy: list[Tensor | None] = [into] if into is not None else [None] * len(y.segments)
        self.x_dot: Tensor | None = None
        self.sum_ds: Tensor | None = None
        self.into = into
        self.held: tuple | None = None
        self.kept: Kept = []  # blocks kept for later tiles (_self_tile_products_)

    def add(self, ds: Tensor | RowScaled, r0: int, r1: int) -> None:
        need_rows, need_cols, need_scale, need_bias = self.needs
        x, y = self.x, self.y
        # self mode, one tile of every row: ∂S x + ∂Sᵀ x, one product where cheaper
        whole_self = (
            self.into is not None and need_rows and r1 - r0 == x.shape[-2] and y.segments[0] is x
        )
        # (a shorter last tile meets the block its predecessor kept for it)
        split = not whole_self and (bool(self.kept) or self._splits(r0, r1))
        w = None
        if isinstance(ds, RowScaled):
            scaled = ds
            ds, w = scaled.tile, scaled.row.unsqueeze(-1)
            if need_bias or whole_self or split:
                ds, w = ds.mul_(w), None  # the bias's sum, the self product: the tile itself
        if split:
            self._add_self_tile(ds, r0, r1)
            return
        if need_bias:
            part = ds.sum()
            self.sum_ds = part if self.sum_ds is None else self.sum_ds + part
        if y.inv is not None and (need_rows or need_scale or any(need_cols)):
            ds = ds.mul_(y.inv)  # S = scale · (x yᵀ) ⊙ inv: ∂S ⊙ inv meets the raw columns
        xt = x[r0:r1] if w is None else x[r0:r1] * w  # ∂Sᵀ x = Eᵀ (diag(w) x)
        whole = len(y.segments) == 1
        if whole_self:
            into = self.gy[0]
            assert into is not None  # self mode: the rows' and columns' buffer
            h = self_product_grad(ds, x)
            if need_scale:  # Σ ∂S ⊙ x xᵀ = ½ Σ h ⊙ x
                dot = 0.5 * (h * x).sum()
                self.x_dot = dot if self.x_dot is None else self.x_dot + dot
            into += h
            return
        for i, (c0, c1) in enumerate(y.spans()):
            if not need_cols[i]:
                continue
            d = ds if whole else ds[..., c0:c1]
            g = self.gy[i]  # ∂Sᵀ x, into the first tile's buffer (no second (M, D) buffer)
            if g is not None and d.ndim == 2 and x.ndim == 2:
                g.addmm_(d.transpose(-1, -2), xt)
            else:
                part = matmul(d.transpose(-1, -2), xt)
                self.gy[i] = part if g is None else g.add_(part)  # a buffer of ours
        if need_rows or need_scale:  # ∂S ŷ
            part = y.times(ds) if w is None else y.times(ds).mul_(w)
            if need_scale:  # Σ ∂S ⊙ x ŷᵀ = Σ_i x_i · (∂S ŷ)_i
                dot = (x[r0:r1] * part).sum()
                self.x_dot = dot if self.x_dot is None else self.x_dot + dot
            if need_rows and self.into is not None:
                into = self.gy[0]
                assert into is not None  # into, or into plus the columns' parts
                into[r0:r1].add_(part)  # (+= on a slice adds a copy_ back)
            elif need_rows:
                self.rows.append(part)

    def _splits(self, r0: int, r1: int) -> bool:
        """Whether a tile of rows ``[r0, r1)`` goes to :meth:`_add_self_tile`: self mode with
        one block (``into``), only the gradient of ``x`` asked for, raw columns, a tile that
        :func:`_splits_tile`."""
        need_rows, need_cols, need_scale, need_bias = self.needs
        x, y = self.x, self.y
        return (
            self.into is not None
            and need_rows
            and all(need_cols)
            and not (need_scale or need_bias)
            and y.inv is None
            and len(y.segments) == 1
            and y.segments[0] is x
            and _splits_tile(x, r1 - r0, x.shape[-1])
        )

    def _add_self_tile(self, ds: Tensor, r0: int, r1: int) -> None:
        """A self-mode tile's products, fewer of them (:func:`_self_tile_products_`)."""
        into = self.gy[0]
        assert into is not None  # _splits: self mode, the rows' and columns' buffer
        self.kept = _self_tile_products_(into, self.x, ds, r0, r1, self.kept)

    def result(self) -> Sums:
        """``(∂x or None, (∂segment or None, ...), ∂scale or None, ∂bias or None)``."""
        need_rows, need_cols, need_scale, need_bias = self.needs
        x, y = self.x, self.y
        if self.kept:  # blocks whose tile did not come
            into = self.gy[0]
            assert into is not None  # (_add_self_tile's)
            self.kept = _kept_products_(into, x, self.kept)
        # what was asked for also without a tile (an empty rank's rows, on the ring): zeros
        gx = torch.cat(self.rows, dim=-2) if self.rows else None
        if gx is None and need_rows and self.into is None:
            gx = torch.zeros_like(x)
        gy = []
        for i, seg in enumerate(y.segments):
            g = self.gy[i]
            if g is None and need_cols[i]:
                g = torch.zeros_like(seg)
            gy.append(None if g is None else y.unit_backward_(i, g))
        x_dot, sum_ds = self.x_dot, self.sum_ds
        if x_dot is None and need_scale:
            x_dot = x.new_zeros(())
        if sum_ds is None and need_bias:
            sum_ds = x.new_zeros(())
        return gx, tuple(gy), x_dot, sum_ds


# _splits_tile: the least c² · width (a square block's entries times its columns) at which a
# tile splits its products. The split saves two or more block products a tile (4c² · width
# FLOPs) and dispatches about a dozen more ops (~40 µs on this CPU); at 2¹⁹ the saving is ~2
# MFLOP, ~45 µs at this CPU's ~45 GFLOPS (an estimate of the crossover, not a measured one:
# the tiles that matter, 256 rows at D = 128, are at 2²³)
SPLIT_MIN_WORK = 1 << 19


Kept = list[tuple[int, int, int, int, Tensor]]  # blocks kept for later tiles: rows, columns, G


def _self_tile_products_(into: Tensor, x: Tensor, ds: Tensor, r0: int, r1: int, kept: Kept) -> Kept:
    """A self-mode tile ``ds`` (rows ``[r0, r1)`` of ``G = ∂L/∂S``, read only) into ``into``
    (``∂L/∂x = (G + Gᵀ) x``), with fewer products than two a block; returns the blocks kept
    for later tiles (``kept``: those kept so far).

    Block ``(t, u)`` of ``G`` (rows of tile ``t``, columns of tile ``u``) adds ``G_tu x_u`` to
    the rows of ``t`` and ``G_tuᵀ x_t`` to those of ``u``: two products a block. The diagonal
    block takes one, ``(G_tt + G_ttᵀ) x_t`` (a transposed add in cache). The blocks of the next
    ``k`` tiles' columns (:func:`_kept_tiles`) are kept (copies) until their tile, whose own
    block of this tile's columns meets each: ``V = G_ut + G_tuᵀ`` adds ``V x_t`` and ``Vᵀ x_u``,
    two products for two blocks. With ``n`` tiles the backward's ``2n²`` block products lose
    ``n + 2 Σ_{d ≤ k} (n − d)`` (4 of 8 at two tiles, 34 of 128 at eight); the forward's ``n²``
    are unchanged. A block kept for a tile that does not come when expected is multiplied on
    its own (tiles in another order, or a shorter last tile: the same gradient)."""
    m = x.shape[-2]
    done = [(r0, r1)]  # column ranges whose products are taken (the diagonal's below)
    waiting = []
    for p0, p1, q0, q1, block in kept:
        if q0 >= r1:  # for a later tile
            waiting.append((p0, p1, q0, q1, block))
        elif (q0, q1) == (r0, r1):  # G_tu of an earlier tile t, this tile u
            v = ds[:, p0:p1] + block.transpose(-1, -2)
            addmm_(into[r0:r1], v, x[p0:p1])
            addmm_(into[p0:p1], v.transpose(-1, -2), x[r0:r1])
            done.append((p0, p1))
        else:  # not the tile it was kept for: its two products
            _block_products_(into, block, x, (p0, p1), (q0, q1))
    into[r0:r1].add_(self_product_grad(ds[:, r0:r1], x[r0:r1]))
    c = r1 - r0
    for q0 in range(r1, min(m, r1 + _kept_tiles(m, c) * c), c):
        q1 = min(m, q0 + c)  # the next tiles' columns, kept for them
        # (read transposed when its tile meets it: padded, as unaliased's copies)
        waiting.append((r0, r1, q0, q1, padded_copy(ds[:, q0:q1])))
        done.append((q0, q1))
    start = 0
    for c0, c1 in [*sorted(done), (m, m)]:  # the rest: two products a block
        if c0 > start:
            _block_products_(into, ds[:, start:c0], x, (r0, r1), (start, c0))
        start = max(start, c1)
    return waiting


def _kept_products_(into: Tensor, x: Tensor, kept: Kept) -> Kept:
    """The kept blocks whose tiles did not come, two products each (:func:`_self_tile_products_`);
    returns none left."""
    for p0, p1, q0, q1, block in kept:
        _block_products_(into, block, x, (p0, p1), (q0, q1))
    return []


def _splits_tile(x: Tensor, c: int, width: int) -> bool:
    """Whether a self-mode tile of ``c`` rows takes :func:`_self_tile_products_`: a square
    block that stays in cache (:data:`SELF_PRODUCT_FUSE_LIMIT`) and block products of ``width``
    columns of ``x`` that cost more than the dozen ops the split adds (:data:`SPLIT_MIN_WORK`),
    CPU eager (:func:`readable`: the transposed adds are cheap only there, and the kept blocks
    are state between tiles)."""
    return (
        x.ndim == 2
        and c * c <= SELF_PRODUCT_FUSE_LIMIT
        and c * c * width >= SPLIT_MIN_WORK
        and readable(x)
    )


def _kept_tiles(m: int, c: int) -> int:
    """How many following tiles' blocks a self-mode tile of ``c`` rows keeps
    (:func:`_self_tile_products_`), of ``n = ⌈m / c⌉`` tiles: the most ``k`` whose
    ``k (k + 1) / 2`` live blocks hold at most half a tile's entries (``n / 2`` blocks), at
    least one: 1 at two tiles, 2 at eight, 5 at thirty-two."""
    n = -(-m // c)
    return max(1, int((math.sqrt(4 * n + 1) - 1) / 2))


def _block_products_(
    into: Tensor, g: Tensor, x: Tensor, rows: tuple[int, int], cols: tuple[int, int]
) -> None:
    """Block ``g`` of a self product's ``∂L/∂S`` (``rows × cols``) into ``∂L/∂x``: ``g
    x_cols`` to the rows and ``gᵀ x_rows`` to the columns."""
    (r0, r1), (c0, c1) = rows, cols
    addmm_(into[r0:r1], g, x[c0:c1])
    addmm_(into[c0:c1], g.transpose(-1, -2), x[r0:r1])


def block_backward(
    kind, x, y, rows, cols, scale, bias, chunk, row, col, needs, *, diag, exclude, into=None,
    nested=None,
):  # fmt: skip
    """One block's gradient sums for a unit cotangent, before the scale (:class:`_GradSums`),
    from the forward's statistics: every tile recomputed. ``y``: a tensor or :class:`Columns`;
    the columns' gradients are a tuple, one a segment; ``needs[1]`` a bool for all columns or
    one a segment. ``nested`` (a :class:`_Prefixes`): the statistics ``row``/``col`` hold one
    entry a width along their first dimension, and the sums are :class:`_NestedSums`."""
    y = columns(y)
    m = y.m
    factor = _tile_factor(y, scale)
    need_x, need_cols, need_scale, need_bias = needs
    if not isinstance(need_cols, tuple):
        need_cols = (bool(need_cols),) * len(y.segments)
    listing = _label_listing(kind, x, rows, cols, diag and exclude)
    if nested is not None:  # one tile a width a step, the masks built once
        widths = _NestedSums(nested, (need_x, need_cols, need_scale, need_bias))
        for r0, r1 in _tiles(x.shape[-2], chunk):
            at = _tile_at(rows, r0, r1, m, diag, exclude)
            pos, neg, memo = _tile_positives(
                rows, cols, r0, r1, m, x.device, diag, exclude, at, listing
            )
            memo["base2"] = nested.base2
            for k, s in nested.tiles(r0, r1):
                row_k, col_k = tuple(t[k] for t in row), tuple(t[k] for t in col)
                widths.width(k).add(
                    _tile_ds_(kind, s, pos, neg, r0, r1, row_k, col_k, at.eye, memo), r0, r1
                )
            widths.flush(r0, r1)
        return widths.result()
    sums = _GradSums(x, y, (need_x, need_cols, need_scale, need_bias), into)
    roles = _roles(kind)
    scratch = _Scratch(_reuses(kind, x, nested, x.shape[-2] // roles, chunk))
    # the recomputed tiles in base-2 units: CLIP's (_tile_ds_), where the forward's may be
    base2 = None
    if kind in _BASE2_RECOMPUTED:
        base2 = _base2_units(kind, x, y, factor, bias, listed=False, fused=False)
    f, b = (factor, bias) if base2 is None else (base2.factor, base2.bias)
    for r0, r1 in _tiles(x.shape[-2] // roles, chunk):
        out = scratch.take("logits", (r1 - r0) * roles, m, x)
        s = _logits(x, y, r0 * roles, r1 * roles, f, b, out)
        if isinstance(kind, Retrieval):
            keep, pen, col_keep = _retrieval_masks(kind, rows, cols, r0, r1, m, diag)
            pos_at = _positive_at(kind, x.shape[-2], r0, diag)
            if kind.sigmoid:
                ds = _sigmoid_fold_(s, keep, pos_at, True)[2]
                assert ds is not None  # asked for
                sums.add(ds.mul_(row[0]), r0, r1)
                continue
            lse, coef = row[0][r0:r1], row[1]
            down = (col_keep, col[0]) if kind.doc_columns else None
            sums.add(
                _retrieval_ds_(kind, s, keep, pen, rows[1], scale, pos_at, lse, coef, down),
                r0 * roles, r1 * roles,
            )  # fmt: skip
            continue
        at = _tile_at(rows, r0, r1, m, diag, exclude)
        pos, neg, memo = _tile_positives(
            rows, cols, r0, r1, m, x.device, diag, exclude, at, listing
        )
        if base2 is not None:
            memo["base2"] = True
        ds = _tile_ds_(kind, s, pos, neg, r0, r1, row, col, at.eye, memo)
        del s, pos, neg
        sums.add(ds, r0, r1)
    return sums.result()


def _times_cotangent(gx, gy, g_scale, g_bias, scale, g) -> tuple[Tensor, ...]:
    """The gradient sums that are not ``None`` (for a unit cotangent, before the logit scale:
    ``gx``, each of ``gy``, ``g_scale``, ``g_bias``, in this order) times the cotangent ``g``,
    those of the rows and columns also times ``scale``."""
    sg = scale * g
    out = [t * sg for t in (gx, *gy) if t is not None]
    out += [t * g for t in (g_scale, g_bias) if t is not None]
    return tuple(fresh(t) for t in out)


# Column segments a call may have (the retrieval kind's queries, positives and hard negatives,
# then a queue's queries and documents): the Functions below take them in fixed argument slots,
# padded with None (dynamo traces a Function's forward by its fixed parameters, not *args)
MAX_SEGMENTS = 5
MAX_FORMED = MAX_SEGMENTS + 3  # the gradients a walk may form: x, each segment, scale, bias


def _padded(tensors, size: int) -> tuple:
    return (*tensors, *(None,) * (size - len(tensors)))


def _slots(needs) -> list[bool]:
    """``needs = (x, (segment, ...), scale, bias)`` flat, in the order gradients are listed."""
    need_x, need_y, need_scale, need_bias = needs
    return [need_x, *need_y, need_scale, need_bias]


_tiled_notfirst_order_backward = first_order_backward(
    "the tiled engine's gradient (clip, siglip, multiple_negatives_ranking, and ntxent/supcon "
    "given labels, dense or chunk_size=...)",
    "for ntxent/supcon, pass the similarity matrix as mat= (the general batch path, "
    "differentiable twice)",
)


class _TiledGrads(FirstOrder):
    """The one-block backward (:class:`FirstOrder`): its forward walks the tiles, recomputes
    each and accumulates the requested gradients ``[∂x][∂segment …][∂scale][∂bias]``
    (``needs``); its backward raises."""

    @staticmethod
    def forward(x, y0, y1, y2, y3, y4, rows, cols, scale, bias, s0, s1, s2, s3, s4, s5, g, chunk,
                kind, needs, unit):  # fmt: skip
        # y0..y4: the column segments, s0..s5: the forward's statistics, each padded with None
        # (one argument each: transforms see every tensor)
        segments = tuple(v for v in (y0, y1, y2, y3, y4) if v is not None)
        stats = tuple(v for v in (s0, s1, s2, s3, s4, s5) if v is not None)
        split = ROW_STATS[kind_name(kind)]
        row, col = stats[:split], stats[split:]
        need_x, need_y, need_scale, need_bias = needs
        self_mode = y0 is None  # the segments are packed from y0
        yy = Columns((x,)) if self_mode else columns(segments, unit)
        into = torch.zeros_like(x) if self_mode and need_x else None
        gx, gy, x_dot, sum_ds = block_backward(
            kind, x, yy, rows, rows if cols is None else cols, scale, bias, chunk, row, col,
            (need_x, (into is not None,) if self_mode else need_y, need_scale, need_bias),
            diag=True, exclude=self_mode, into=into,
        )  # fmt: skip
        # The cotangent g multiplies the results, not the tiles: under vmap of a vjp g is batched
        # while the tiles are not, and the tiles are updated in place.
        gx = (gy[0] if self_mode else gx) if need_x else None
        gy = () if self_mode else tuple(t if n else None for t, n in zip(gy, need_y, strict=True))
        return _times_cotangent(gx, gy, x_dot, sum_ds, scale, g)

    backward = staticmethod(_tiled_notfirst_order_backward)


class _Scaled(FirstOrder):
    """The gradients the forward walk formed (:func:`fused_loss`; ``formed``, in
    :func:`_slots` order) times the cotangent ``g`` (the rows' and columns' also times the logit
    scale): the backward of the row-complete kinds, a Function of the loss's inputs ``x``, the
    columns, ``scale`` and ``bias`` (which it does not read) so that, as :class:`_TiledGrads`,
    it records no graph and a second differentiation raises (:class:`FirstOrder`)."""

    @staticmethod
    def forward(x, y0, y1, y2, y3, y4, scale, bias, g, needs, f0, f1, f2, f3, f4, f5, f6, f7):
        # f0..f7: the formed gradients in _slots order, padded with None (MAX_FORMED)
        gx, *gy, g_scale, g_bias = _formed_slots(needs, (f0, f1, f2, f3, f4, f5, f6, f7))
        return _times_cotangent(gx, gy, g_scale, g_bias, scale, g)

    backward = staticmethod(_tiled_notfirst_order_backward)


def _formed_slots(needs, formed) -> tuple:
    """The gradients a walk formed (those ``needs`` asks for, in :func:`_slots` order; any
    padding after them unread) in their slots, ``None`` in the others: ``(gx, *gy, g_scale,
    g_bias)``."""
    given = iter(formed)
    return tuple(next(given) if n else None for n in _slots(needs))


def _wanted_grads(formed_needs, wanted, x, ys, scale, bias, g, formed, recompute) -> list:
    """The engine Functions' backward (:class:`_TiledLoss`, :class:`_NestedLoss`): the gradients
    autograd ``wanted`` (:func:`_slots` order, ``None`` where not), the forward walk's
    ``formed`` ones times the cotangent (:class:`_Scaled`) where it formed every one wanted
    (``formed_needs``: what it formed, ``None``: nothing), else ``recompute()`` (the tiles
    walked again: a Function's outputs, one a wanted slot)."""
    if formed_needs is not None and all(
        f or not w for f, w in zip(_slots(formed_needs), wanted, strict=True)
    ):
        if unrecorded():  # nothing records the scaled gradients: no Function needed
            gx, *gy, g_scale, g_bias = _formed_slots(formed_needs, formed)
            grads = iter(_times_cotangent(gx, gy, g_scale, g_bias, scale, g))
        else:
            grads = iter(
                apply(_Scaled, x, *ys, scale, bias, g, formed_needs, *_padded(formed, MAX_FORMED))
            )
        out = [next(grads) if f else None for f in _slots(formed_needs)]
    else:
        grads = iter(recompute())
        out = [next(grads) if w else None for w in wanted]
    return [o if w else None for o, w in zip(out, wanted, strict=True)]


def column_stats(kind: Kind) -> tuple[str, ...]:
    """The statistics ``kind`` keeps per column (:func:`block_forward`'s ``col_*`` entries; the
    ring carries them with their block): CLIP's, the retrieval kind's positives' log-sum-exp
    (``doc_columns``), none for the row-complete kinds."""
    if kind == "clip":
        return ("col_lse", "col_pos", "col_pos_sum")
    if isinstance(kind, Retrieval) and kind.doc_columns:
        return ("col_lse",)
    return ()


def _fused(kind: Kind, n: int, chunk: int, needs) -> bool:
    """Whether the forward walk forms the gradient (``needs`` known): the row-complete kinds,
    whose every term lies in one tile of rows, and those with column statistics in one tile."""
    return needs is not None and (not column_stats(kind) or chunk >= n // _roles(kind))


def fused_loss(kind, x, y, rows, cols, scale, bias, chunk, reducer, needs):
    """The loss of one block, its statistics and the gradient sums ``needs`` asks for (each
    times its global weight, before the cotangent and the logit scale; :func:`_slots` order), in
    one walk: each tile is computed once, its ``∂L/∂S`` formed while it is held (three products
    a tile, the dense floor's; fewer in self mode, :meth:`_GradSums._add_self_tile`). ``y``:
    :class:`Columns`, or ``None`` (self mode)."""
    self_mode = y is None
    yy, cc = Columns((x,)) if self_mode else y, rows if cols is None else cols
    need_x, need_y, need_scale, need_bias = needs
    into = torch.zeros_like(x) if self_mode and need_x else None
    seg_needs = (into is not None,) if self_mode else need_y
    sums = _GradSums(x, yy, (need_x, seg_needs, need_scale, need_bias), into, reducer)
    st = block_forward(
        kind, x, yy, rows, cc, scale, bias, chunk, diag=True, exclude=self_mode, grads=sums
    )
    total = counts(kind, st, x.shape[-2])
    loss, stats = reduce(kind, st, reducer, total)
    glob: float | Tensor = 1.0
    if sums.held is not None:  # one tile, held until its columns' statistics were reduced
        held, sums.held = sums.held, None
        if kind == "clip":  # (its statistics carry the weights: glob stays 1)
            p_r, p_c, pos, eye = held
            ds = _clip_whole_ds_(p_r, p_c, pos, eye, stats[:3], stats[3:])
        else:
            ds = _retrieval_whole_ds_(kind, held[0], stats, held[1])
        sums.add(ds, 0, x.shape[-2])
    elif _ranked(kind):  # reduce's batch weight, the second statistic
        glob = stats[1]
    elif kind == "ntxent" or kind_name(kind) == "siglip":  # reduce's batch weight, the last
        glob = stats[-1]
    elif kind != "clip":
        glob = _batch_weight(kind, reducer, total)
    gx, gy, x_dot, sum_ds = sums.result()
    grads = [gy[0] if self_mode else gx, *(() if self_mode else gy), x_dot, sum_ds]
    # the sums are buffers of this walk: scaled in place
    formed = (_scaled_(t, glob) for t, need in zip(grads, _slots(needs), strict=True) if need)
    return loss, stats, tuple(formed)


def _scaled_(t: Tensor | None, factor: float | Tensor) -> Tensor:
    assert t is not None  # every gradient asked for is formed (_GradSums.result)
    return t.mul_(factor)


class _TiledLoss(torch.autograd.Function):
    """The loss over tiles of one block. Inputs ``(x, y0, …, y4, rows, cols, scale, bias,
    chunk, kind, reducer, needs, unit)`` (``y0..y4``: the column segments, padded with ``None``;
    none: self mode; ``unit``: the engine normalises the columns, :class:`Columns`); outputs ``(loss, *statistics, *gradients)``, all but the
    loss non-differentiable and saved. ``needs``: which of ``(x, (segment, ...), scale,
    bias)`` the backward will differentiate, when known before the walk (:func:`tiled_loss`);
    the walk then forms their gradients as it goes (:func:`fused_loss`) and the backward scales
    them (:class:`_Scaled`); ``None``, or a backward that asks for more, recomputes the tiles
    (:class:`_TiledGrads`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y0, y1, y2, y3, y4, rows, cols, scale, bias, chunk, kind, reducer, needs, unit):
        segments = tuple(v for v in (y0, y1, y2, y3, y4) if v is not None)
        y = None if y0 is None else columns(segments, unit)
        if _fused(kind, x.shape[-2], chunk, needs):
            loss, stats, grads = fused_loss(
                kind, x, y, rows, cols, scale, bias, chunk, reducer, needs
            )
            return (loss, *stats, *grads)
        self_mode = y is None
        yy, cc = Columns((x,)) if y is None else y, rows if cols is None else cols
        st = block_forward(kind, x, yy, rows, cc, scale, bias, chunk, diag=True, exclude=self_mode)
        loss, stats = reduce(kind, st, reducer, counts(kind, st, x.shape[-2]))
        return (loss, *stats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y0, y1, y2, y3, y4, rows, cols, scale, bias, chunk, kind, _, needs, unit = inputs
        segments = tuple(v for v in (y0, y1, y2, y3, y4) if v is not None)
        fused = _fused(kind, x.shape[-2], chunk, needs)
        n_grads = sum(_slots(needs)) if fused else 0
        rest = output[1:]
        ctx.mark_non_differentiable(*rest)
        # no zeros for the statistics' and gradients' cotangents (as large as x and y)
        ctx.set_materialize_grads(False)
        ctx.chunk, ctx.kind, ctx.n_stats = chunk, kind, len(rest) - n_grads
        ctx.needs = needs if fused else None
        ctx.unit, ctx.n_segments = unit, len(segments)
        ctx.scale_float = None if isinstance(scale, Tensor) else scale
        # the retrieval kind's rows and cols are tuples of metadata: saved flat
        ctx.n_meta = [len(t) if isinstance(t, tuple) else None for t in (rows, cols)]
        meta = [t for m in (rows, cols) for t in (m if isinstance(m, tuple) else (m,))]
        scale_t = scale if isinstance(scale, Tensor) else None
        ctx.save_for_backward(x, *segments, *meta, scale_t, bias, *rest)

    @staticmethod
    def backward(ctx, g, *_):
        x, *saved = ctx.saved_tensors
        segments, saved = tuple(saved[: ctx.n_segments]), saved[ctx.n_segments :]
        meta: list = []
        for n in ctx.n_meta:  # rows, cols
            meta.append(saved[0] if n is None else tuple(saved[:n]))
            saved = saved[1 if n is None else n :]
        (rows, cols), (scale, bias, *rest) = meta, saved
        stats, formed = rest[: ctx.n_stats], rest[ctx.n_stats :]
        nig = ctx.needs_input_grad
        at = 1 + MAX_SEGMENTS + 2  # the inputs' scale and bias: after x, the segments, rows, cols
        needs = (nig[0], tuple(nig[1 : 1 + ctx.n_segments]), nig[at], nig[at + 1])
        if not any(_slots(needs)) or g is None:  # g None: the loss itself is not differentiated
            return (None,) * len(nig)
        scale = ctx.scale_float if scale is None else scale
        ys = _padded(segments, MAX_SEGMENTS)
        padded = (*stats, *(None,) * (6 - len(stats)))
        gx, *g_segments, g_scale, g_bias = _wanted_grads(
            ctx.needs, _slots(needs), x, ys, scale, bias, g, formed,
            lambda: apply(
                _TiledGrads, x, *ys, rows, cols, scale, bias, *padded, g, ctx.chunk, ctx.kind,
                needs, ctx.unit,
            ),
        )  # fmt: skip
        g_ys = _padded(g_segments, MAX_SEGMENTS)
        return (gx, *g_ys, None, None, g_scale, g_bias, None, None, None, None, None)


def _needs(x: Tensor, segments: tuple[Tensor, ...], scale, bias):
    """Which of ``(x, (segment, ...), scale, bias)`` autograd will differentiate (:func:`_slots`
    order), known before the walk so that it forms those gradients as it goes; ``None`` where
    none is (or grad mode is off: an evaluation)."""
    if not torch.is_grad_enabled():
        return None
    wants = (
        x.requires_grad,
        tuple(seg.requires_grad for seg in segments),
        isinstance(scale, Tensor) and scale.requires_grad,
        isinstance(bias, Tensor) and bias.requires_grad,
    )
    return wants if any(_slots(wants)) else None


def tiled_loss(
    x: Tensor,
    y: Tensor | tuple[Tensor, ...] | None,
    rows: Tensor | tuple[Tensor, ...] | None,
    cols: Tensor | tuple[Tensor, ...] | None,
    *,
    scale: float | Tensor,
    bias: Tensor | None,
    chunk: int,
    kind: Kind,
    reducer: str,
    unit: bool = False,
) -> Tensor:
    """The loss of ``kind`` over ``S = scale · x ŷᵀ + bias`` in tiles of ``chunk`` rows.

    ``x``: ``(N, D)`` rows in the compute dtype, already normalised where the loss normalises.
    ``y``: the columns ``(M, D)``, a tensor or a tuple of segments read as their concatenation
    (none is made), normalised by the engine when ``unit`` (:class:`Columns`), else as they are;
    ``y=None``: self mode, ``x`` against itself, the diagonal excluded. ``rows``/``cols``: the
    labels of ``x``'s and ``y``'s rows (``cols=None``: ``rows`` label both, as in self mode),
    or both ``None`` for two aligned sets (row ``i`` pairs with column ``i``). ``scale``: a
    number or a 0-d tensor (its gradient is returned); ``bias``: ``None`` or a 0-d tensor.
    ``reducer`` one of ``KINDS[kind]``.

    Where autograd records (``torch.is_grad_enabled()``) and an input requires its gradient,
    the walk forms the gradients of those that do as it goes: the forward costs the three
    products of a forward and backward, and the backward is a scale. Without grad mode (an
    evaluation) it is one product a tile.
    """
    # Function.apply refuses one tensor given twice (under compile: "duplicate tensor input")
    if isinstance(rows, Tensor) and cols is rows:
        cols = None  # the same labels for both: what cols=None says
    segments: tuple[Tensor, ...] = () if y is None else (y,) if isinstance(y, Tensor) else tuple(y)
    if len(segments) > MAX_SEGMENTS:
        raise ValueError(
            f"the engine takes at most {MAX_SEGMENTS} column segments, got {len(segments)}"
        )
    seen: list[Tensor] = [x]
    for i, seg in enumerate(segments):  # a reference set that is the batch itself: a view
        if any(seg is t for t in seen):
            segments = (*segments[:i], seg.view_as(seg), *segments[i + 1 :])
        seen.append(segments[i])
    needs = _needs(x, segments, scale, bias)
    ys = _padded(segments, MAX_SEGMENTS)
    return apply(_TiledLoss, x, *ys, rows, cols, scale, bias, chunk, kind, reducer, needs, unit)[0]


# ----------------------------------------------------------------------------------------------
# Nested widths (Matryoshka): every prefix's logits from one blocked product
# ----------------------------------------------------------------------------------------------
# The prefix products are cumulative sums of block products, C_k = Σ_{j ≤ k} x_j y_jᵀ over the
# feature blocks j = [d_{j−1}, d_j), and a normalised prefix's logits are a rank-1 rescale of
# them, S_k = scale · a_k b_kᵀ ⊙ C_k + bias (a_k, b_k: the prefixes' inverse norms, or 1). A
# walk's tile is one tile a width (block_forward / block_backward with ``nested``); the gradient
# of a tile is W_k = w_k ∂S_k ⊙ a_k b_kᵀ a width, summed from the widest down, G_j = Σ_{k ≥ j}
# W_k, and multiplied by each block once: every width's three products cost one full-width
# call's. The normalisations' backward is −a_k² (Σ_m W_k ⊙ C_k) a row, on the rows' prefix.


class _Prefixes:
    """The nested widths of one call: rows ``x`` ``(N, D)``, columns ``y`` (``None``: self
    mode, ``x``), the widths' blocks ``bounds`` (``dims`` ascending), their weights ``(K,)``
    and, when ``unit``, each prefix's norms and inverse norms (``F.normalize``'s ``1 / max(‖·‖,
    ε)``), ``(K, N)`` and ``(K, M)``. :meth:`tiles` yields a tile's logits a width; ``c``, the
    latest width's unscaled product, is the caller's to read until it asks for the next width,
    which is accumulated into the same buffer (no copy of the tile a width).

    ``reuse``: the walks' tile buffers (``c``, the logits, the callers' softmaxes and
    ``W ⊙ C``, :attr:`scratch`) are taken from tile to tile where :class:`_Scratch` may (a CPU
    in eager mode, outside autograd: an engine Function's forward); they are the buffers a walk
    of fresh tiles holds at its peak (a tile's K gradients wait for its products), so the
    memory is the same."""

    def __init__(self, x, y, dims, unit, scale, bias, weights, reuse: bool = False, base2=None):
        self.x, self.self_mode = x, y is None
        self.y = x if y is None else y
        self.bounds = list(zip((0, *dims[:-1]), dims, strict=True))
        self.unit, self.scale, self.bias, self.weights = unit, scale, bias, weights
        # base2 (a kind): its tiles as S log₂e where :func:`_base2_units` allows, at every width
        # (a prefix's norm is at most its row's; 1 where normalised)
        units = None
        if base2 is not None:
            cols = Columns((self.y,))
            units = _base2_units(base2, x, cols, scale, bias, listed=False, fused=False, unit=unit)
        self.base2 = units is not None
        if units is not None:
            self.scale, self.bias = units.factor, units.bias
        self.c: Tensor | None = None
        self.held = True  # tiles()'s: whether each width's logits have a buffer of their own
        self.scratch = _Scratch(reuse and _may_reuse(x))
        if unit:
            self.na, self.a = _inverse_norms(self.x, dims)
            self.nb, self.b = (self.na, self.a) if y is None else _inverse_norms(self.y, dims)

    def tiles(self, r0: int, r1: int, held: bool = True):
        """``(k, S_k)`` for rows ``r0:r1``, a tile each (the caller's to overwrite), from one
        product a block. ``held``: the caller keeps each width's tile until the tile's last
        width (its gradient is the logits' buffer), so every width has a buffer of its own;
        else one buffer serves them all."""

        def block(j: int) -> tuple[Tensor, Tensor]:
            lo, hi = self.bounds[j]
            return self.x[r0:r1, lo:hi], self.y[:, lo:hi].transpose(-1, -2)

        self.held = held
        c = matmul(*block(0), out=self.take("c", r1 - r0))
        for k in range(len(self.bounds)):
            if k:  # the caller is done with C_{k−1}: C_k = C_{k−1} + x_k y_kᵀ in its buffer
                c = addmm_(c, *block(k))
            self.c = c
            out = self.take(f"s{k}" if held else "s", r1 - r0)
            if self.unit:
                s = torch.mul(c, (self.a[k, r0:r1] * self.scale).unsqueeze(-1), out=out)
                s = s.mul_(self.b[k])
            else:
                s = torch.mul(c, self.scale, out=out)
            yield k, s if self.bias is None else s.add_(self.bias)

    def take(self, name: str, rows: int) -> Tensor | None:
        """A reused ``(rows, M)`` buffer of the walk's (:attr:`scratch`), or ``None``."""
        return self.scratch.take(name, rows, self.y.shape[-2], self.x)


def _inverse_norms(x: Tensor, dims) -> tuple[Tensor, Tensor]:
    norms = torch.stack([torch.linalg.vector_norm(x[:, :d], dim=-1) for d in dims])
    return norms, 1.0 / norms.clamp_min(_NORMALIZE_EPS)


class _NestedSums:
    """A nested walk's gradient sums for a unit cotangent, before the scale (as
    :class:`_GradSums`, ``needs = (rows, (columns,) or () in self mode, scale, bias)``). A
    width's tile ``∂S_k`` (:meth:`width`'s ``add``) is weighed and held as ``W_k``; the tile's
    :meth:`flush` sums them from the widest down and multiplies each block once; :meth:`result`
    applies the normalisations' backward to the prefixes."""

    def __init__(self, pre: _Prefixes, needs, reducer=None):
        self.pre, self.reducer = pre, reducer
        need_x, need_cols, self.need_scale, self.need_bias = needs
        need_y = need_x if pre.self_mode else any(need_cols)
        self.gx = torch.zeros_like(pre.x) if need_x else None
        self.gy = self.gx if pre.self_mode else torch.zeros_like(pre.y) if need_y else None
        k = len(pre.bounds)
        # the normalisations' coefficients: the rows' a tile ((K, r) each), the columns' a width
        self.row_coef: list[Tensor] = []
        self.tile_coef: list[Tensor] = []
        self.col_coef: list[Tensor | None] = [None] * k
        self.x_dot: Tensor | None = None
        self.sum_ds: Tensor | None = None
        self.pending: list[Tensor] = []
        self.kept: list[Kept] = [[] for _ in range(k)]  # a block's (_self_tile_products_)

    def width(self, k: int) -> _Width:
        return _Width(self, k)

    def add(self, k: int, ds: Tensor, r0: int, r1: int, logits: Tensor | None = None) -> None:
        """Width ``k``'s tile ``∂S_k`` (overwritten). ``logits``: the tile's ``S_k`` before
        the scale and the bias, from a caller that kept them (:func:`prefix_matrices`); then
        ``W ⊙ C = w_k ∂S_k ⊙ logits``, ``pre.c`` is not read and ``ds`` is left as it is."""
        pre, weight = self.pre, self.pre.weights[k]
        if self.need_bias:
            part = ds.sum() * weight
            self.sum_ds = part if self.sum_ds is None else self.sum_ds + part
        wc = None
        if logits is not None and (self.need_scale or pre.unit):
            wc = (ds * logits).mul_(weight)
        if pre.unit:  # ∂C_k = w_k ∂S_k ⊙ a_k b_kᵀ (the scale applied at the end)
            a = (pre.a[k, r0:r1] * weight).unsqueeze(-1)
            w = (ds.mul_(a) if logits is None else ds * a).mul_(pre.b[k])
        else:
            w = ds.mul_(weight) if logits is None else ds * weight
        if self.need_scale or pre.unit:
            if wc is None:
                c = pre.c
                assert c is not None  # the width's product, from tiles(): read only
                # W ⊙ C: its row sums are a_k · ∂L/∂a_k (and the scale's); into the logits'
                # buffer where the widths share one (their fold is done with it)
                wc = torch.mul(c, w, out=pre.take("wc" if pre.held else "s", r1 - r0))
            along = wc.sum(-1)
            if self.need_scale:
                self.x_dot = along.sum() if self.x_dot is None else self.x_dot + along.sum()
            if pre.unit and self.gx is not None:
                self.tile_coef.append(_unit_coef(along, pre.na[k, r0:r1], pre.a[k, r0:r1]))
            if pre.unit and self.gy is not None:
                down = _unit_coef(wc.sum(-2), pre.nb[k], pre.b[k])
                held = self.col_coef[k]
                self.col_coef[k] = down if held is None else held + down
        self.pending.append(w)

    def flush(self, r0: int, r1: int) -> None:
        """The tile's products: ``G_j = Σ_{k ≥ j} W_k`` times block ``j`` of the columns (the
        rows' gradient) and of the rows (the columns')."""
        pre, total = self.pre, None
        for j in reversed(range(len(self.pending))):
            total = self.pending[j] if total is None else total.add_(self.pending[j])
            lo, hi = pre.bounds[j]
            if pre.self_mode and self.gx is not None and r1 - r0 == pre.x.shape[-2]:
                self.gx[:, lo:hi].add_(self_product_grad(total, pre.x[:, lo:hi]))  # all the rows
                continue
            if (
                pre.self_mode
                and self.gx is not None
                and (self.kept[j] or _splits_tile(pre.x, r1 - r0, hi - lo))
            ):  # (G_j + G_jᵀ) x_j with fewer products (total is read only)
                into, xj = self.gx[:, lo:hi], pre.x[:, lo:hi]
                self.kept[j] = _self_tile_products_(into, xj, total, r0, r1, self.kept[j])
                continue
            # accumulated by the GEMMs: no (M, d) product a tile to add to the columns' block
            if self.gx is not None:
                addmm_(self.gx[r0:r1, lo:hi], total, pre.y[:, lo:hi])
            if self.gy is not None:
                addmm_(self.gy[:, lo:hi], total.transpose(-1, -2), pre.x[r0:r1, lo:hi])
        self.pending.clear()
        if self.tile_coef:
            self.row_coef.append(torch.stack(self.tile_coef))
            self.tile_coef = []

    def result(self) -> Sums:
        """``(∂x or None, (∂y or None,) or () in self mode, ∂scale or None, ∂bias or None)``."""
        pre = self.pre
        for j, kept in enumerate(self.kept):  # blocks whose tiles did not come
            if kept and self.gx is not None:
                lo, hi = pre.bounds[j]
                self.kept[j] = _kept_products_(self.gx[:, lo:hi], pre.x[:, lo:hi], kept)
        if self.gx is not None and self.row_coef:
            _prefix_backward_(self.gx, pre.x, torch.cat(self.row_coef, -1), pre.bounds)
        if self.gy is not None and self.col_coef[0] is not None:
            coef = torch.stack([c for c in self.col_coef if c is not None])
            _prefix_backward_(self.gy, pre.y, coef, pre.bounds)
        x_dot, sum_ds = self.x_dot, self.sum_ds
        if x_dot is None and self.need_scale:
            x_dot = pre.x.new_zeros(())
        if sum_ds is None and self.need_bias:
            sum_ds = pre.x.new_zeros(())
        gy = () if pre.self_mode else (self.gy,)
        return self.gx, gy, x_dot, sum_ds


class _Width(NamedTuple):
    """Width ``k``'s view of :class:`_NestedSums`: what the kinds' folds call ``add`` on."""

    sums: _NestedSums
    k: int

    @property
    def reducer(self):
        return self.sums.reducer

    def add(self, ds: Tensor, r0: int, r1: int) -> None:
        self.sums.add(self.k, ds, r0, r1)


def _unit_coef(along: Tensor, norm: Tensor, inv: Tensor) -> Tensor:
    """The normalisation's backward as a coefficient of the raw prefix: ``∂L/∂a · ∂a/∂x =
    −a² (Σ W ⊙ C) x``, none where the norm is below ε (``F.normalize``'s clamp)."""
    return torch.where(norm >= _NORMALIZE_EPS, along * inv * inv, 0.0).neg()


def _prefix_backward_(g: Tensor, x: Tensor, coef: Tensor, bounds) -> Tensor:
    """Add each width's normalisation backward ``coef[k] · x[:, :d_k]`` to ``g``: block ``j``
    gets ``Σ_{k ≥ j} coef[k]`` times its features."""
    total = None
    for j in reversed(range(len(bounds))):
        total = coef[j] if total is None else total + coef[j]
        lo, hi = bounds[j]
        g[:, lo:hi].add_(total.unsqueeze(-1) * x[:, lo:hi])
    return g


def _nested_fused(kind: str, reducer: str, needs) -> bool:
    """Whether the nested forward walk forms the gradient: the row-complete kinds whose batch
    weight (:func:`_batch_weight`) is the same at every width (it reads the labels only; SupCon's
    ``avg_nonzero`` counts each width's positive losses). CLIP walks twice: its widths' column
    statistics are complete only after the last tile, so forming the gradient in one walk holds
    every width's whole ``N × M`` tile. Tried on 2026-12-07 for the dense call (one tile of all
    the rows, ``K + 2`` tiles live), one thread, in-process, medians of five: 4,096 × 768 at five
    widths 1.71 s against 1.95 walking twice (the naive sum 2.42) but 456 MiB live against 47;
    2,048 × 128 0.30 s against 0.26 (the fresh whole tiles miss the cache). Not kept."""
    return needs is not None and kind in ("ntxent", "supcon", "siglip") and reducer != "avg_nonzero"


class _NestedLoss(torch.autograd.Function):
    """``Σ_k w_k · loss_k`` over the nested widths (:class:`_Prefixes`) of one block, from one
    blocked product a tile. Inputs ``(x, y, rows, cols, scale, bias, weights, chunk, kind,
    reducer, dims, unit, needs)`` (``y=None``: self mode; ``dims`` ascending; ``needs`` in
    :func:`_slots` order, or ``None``); outputs ``(loss, per-width losses, *statistics,
    *gradients)``, the statistics stacked a width along their first dimension. As
    :class:`_TiledLoss`: the row-complete kinds form their gradient in the forward walk
    (:func:`_nested_fused`), CLIP recomputes its tiles in the backward (:class:`_NestedGrads`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, rows, cols, scale, bias, weights, chunk, kind, reducer, dims, unit, needs):
        fused = _nested_fused(kind, reducer, needs)
        base2 = kind if (kind == "siglip" and fused) or kind in _BASE2_RECOMPUTED else None
        pre = _Prefixes(x, y, dims, unit, scale, bias, weights, reuse=True, base2=base2)
        n = x.shape[-2]
        sums = _NestedSums(pre, needs, reducer) if fused else None
        sts = walk_forward(
            kind, x, Columns((pre.y,)), rows, rows if cols is None else cols, scale, bias, chunk,
            diag=True, exclude=pre.self_mode, grads=sums, nested=pre,
        )  # fmt: skip
        losses, stats = [], []
        for st in sts:
            loss_k, stats_k = reduce(kind, st, reducer, counts(kind, st, n))
            losses.append(loss_k)
            stats.append(stats_k)
        per_width = torch.stack(losses)
        stacked = tuple(torch.stack(t) for t in zip(*stats, strict=True))
        loss = matmul(weights, per_width)
        if sums is None:
            return (loss, per_width, *stacked)
        glob = _batch_weight(kind, reducer, counts(kind, sts[0], n))  # the same at every width
        gx, gy, x_dot, sum_ds = sums.result()
        grads = [gx, *gy, x_dot, sum_ds]
        formed = (_scaled_(t, glob) for t, need in zip(grads, _slots(needs), strict=True) if need)
        return (loss, per_width, *stacked, *formed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, rows, cols, scale, bias, weights, chunk, kind, reducer, dims, unit, needs = inputs
        fused = _nested_fused(kind, reducer, needs)
        n_grads = sum(_slots(needs)) if fused else 0
        rest = output[1:]
        ctx.mark_non_differentiable(*rest)
        ctx.set_materialize_grads(False)
        ctx.chunk, ctx.kind, ctx.reducer, ctx.dims, ctx.unit = chunk, kind, reducer, dims, unit
        ctx.n_stats = len(rest) - 1 - n_grads
        ctx.needs = needs if fused else None
        ctx.scale_float = None if isinstance(scale, Tensor) else scale
        scale_t = scale if isinstance(scale, Tensor) else None
        ctx.save_for_backward(x, y, rows, cols, scale_t, bias, weights, *rest)

    @staticmethod
    def backward(ctx, g, *_):
        x, y, rows, cols, scale, bias, weights, per_width, *rest = ctx.saved_tensors
        nig = ctx.needs_input_grad
        nothing = (None,) * len(nig)
        if g is None:
            return nothing
        g_weights = g * per_width if nig[6] else None
        needs = (nig[0], () if y is None else (nig[1],), nig[4], nig[5])
        wanted = _slots(needs)
        out: list = [None] * len(wanted)
        if any(wanted):
            scale = ctx.scale_float if scale is None else scale
            stats, formed = rest[: ctx.n_stats], rest[ctx.n_stats :]
            padded = (*stats, *(None,) * (6 - len(stats)))
            out = _wanted_grads(
                ctx.needs, wanted, x, _padded(() if y is None else (y,), MAX_SEGMENTS), scale,
                bias, g, formed,
                lambda: apply(
                    _NestedGrads, x, y, rows, cols, scale, bias, weights, *padded, g, ctx.chunk,
                    ctx.kind, needs, ctx.dims, ctx.unit,
                ),
            )  # fmt: skip
        gx, *g_y, g_scale, g_bias = out
        gy = g_y[0] if g_y else None
        return (gx, gy, None, None, g_scale, g_bias, g_weights, *(None,) * 6)


class _NestedGrads(FirstOrder):
    """The nested walk's backward (:class:`FirstOrder`): every tile recomputed from its
    blocks, a width at a time, from the forward's statistics; its backward raises."""

    @staticmethod
    def forward(x, y, rows, cols, scale, bias, weights, s0, s1, s2, s3, s4, s5, g, chunk, kind,
                needs, dims, unit):  # fmt: skip
        stats = tuple(v for v in (s0, s1, s2, s3, s4, s5) if v is not None)
        split = ROW_STATS[kind]
        base2 = kind if kind in _BASE2_RECOMPUTED else None
        pre = _Prefixes(x, y, dims, unit, scale, bias, weights, reuse=True, base2=base2)
        gx, gy, x_dot, sum_ds = block_backward(
            kind, x, Columns((pre.y,)), rows, rows if cols is None else cols, scale, bias, chunk,
            stats[:split], stats[split:], needs, diag=True, exclude=pre.self_mode, nested=pre,
        )  # fmt: skip
        return _times_cotangent(gx, gy, x_dot, sum_ds, scale, g)

    backward = staticmethod(_tiled_notfirst_order_backward)


NESTED_KINDS = ("ntxent", "supcon", "clip", "siglip")


def nested_call(loss_fn: Callable, args: tuple, kwargs: Mapping, what: str) -> EngineCall | None:
    """``loss_fn(*args, **kwargs)`` as the :class:`EngineCall` that :func:`run_nested` runs at
    nested widths, or ``None`` where it does not (another loss, the retrieval kind, an embedding
    regularizer, a call the engine does not run: the general batch path's ``mat=``, a miner's
    tuples, a distance other than ``cosine()``/``dot()``, a wrong argument; the caller then
    calls the loss a width at a time, which raises what the loss raises)."""
    if unpartial(loss_fn)[0] not in BUILDERS:
        return None
    try:
        call = engine_call(loss_fn, args, kwargs, what)
    except (ValueError, TypeError):
        return None
    if not isinstance(call.kind, str) or call.kind not in NESTED_KINDS:
        return None
    if call.finish is not None or call.unit or call.x.ndim != 2:
        return None
    if call.y is not None and not isinstance(call.y, Tensor):
        return None
    return call


def run_nested(call: EngineCall, dims: tuple[int, ...], weights: Tensor, unit: bool) -> Tensor:
    """``Σ_k weights[k] · loss(prefix_k)`` of ``call`` at the ascending widths ``dims`` (each
    prefix normalised when ``unit`` or when the loss normalises, ``call.normalized``), in one
    walk: a dense call in tiles of at most :data:`FRESH_DENSE_TILE` entries over all the widths."""
    x, y, rows, cols = call.x, call.y, call.rows, call.cols
    n, m = x.shape[-2], call.m
    chunk = call.chunk or max(1, min(n, FRESH_DENSE_TILE // max(m * len(dims), 1)))
    if isinstance(rows, Tensor) and cols is rows:
        cols = None
    assert y is None or isinstance(y, Tensor)  # nested_call's
    if y is not None and y is x:
        y = y.view_as(y)
    needs = _needs(x, () if y is None else (y,), call.scale, call.bias)
    return apply(
        _NestedLoss, x, y, rows, cols, call.scale, call.bias, weights, chunk, call.kind,
        call.reducer, dims, unit or call.normalized, needs,
    )[0]  # fmt: skip


class _PrefixMatrices(torch.autograd.Function):
    """The whole ``(N, M)`` logits of every nested width, ``S_k = x[:, :d_k] y[:, :d_k]ᵀ``
    (each prefix normalised when ``unit``), from one blocked product (:class:`_Prefixes`, one
    tile of all the rows). Inputs ``(x, y, dims, unit)`` (``y=None``: self mode, ``dims``
    ascending); output ``(K, N, M)``, a width a slice. The backward is :class:`_NestedSums`
    over that tile: each block multiplied once by the sum of the widths' gradients from the
    widest down."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, dims, unit):
        pre = _Prefixes(x, y, dims, unit, 1.0, None, x.new_ones(len(dims)))
        return torch.stack([s for _, s in pre.tiles(0, x.shape[-2])])

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, dims, unit = inputs
        ctx.dims, ctx.unit = dims, unit
        ctx.save_for_backward(x, y, output if unit else None)

    @staticmethod
    def backward(ctx, g):
        x, y, logits = ctx.saved_tensors
        need_x, need_y = ctx.needs_input_grad[:2]
        if g is None or not (need_x or need_y):
            return None, None, None, None
        gx, gy = apply(_PrefixMatricesGrads, x, y, logits, g, ctx.dims, ctx.unit, need_x, need_y)
        return gx, gy, None, None


class _PrefixMatricesGrads(FirstOrder):
    """:class:`_PrefixMatrices`' backward (:class:`FirstOrder`): ``(∂x, ∂y)`` from the
    widths' gradients ``g`` ``(K, N, M)`` and, when ``unit``, their logits."""

    @staticmethod
    def forward(x, y, logits, g, dims, unit, need_x, need_y):
        need_y = bool(need_y) and y is not None
        pre = _Prefixes(x, y, dims, unit, 1.0, None, x.new_ones(len(dims)))
        sums = _NestedSums(pre, (need_x or y is None, () if y is None else (need_y,), 0, 0))
        n = x.shape[-2]
        for k in range(len(dims)):
            # the cotangent is not ours: read beside the logits, or a copy to overwrite
            if unit:
                sums.add(k, g[k], 0, n, logits=logits[k])
            else:
                sums.add(k, g[k].clone(), 0, n)
        sums.flush(0, n)
        gx, gy, _, _ = sums.result()
        return gx if need_x else None, gy[0] if need_y and gy else None

    backward = staticmethod(
        first_order_backward(
            "matryoshka's one-product matrices (a pair loss on cosine() or dot())",
            "call the loss a width at a time (differentiable twice)",
        )
    )


def prefix_matrices(x: Tensor, y: Tensor | None, dims: tuple[int, ...], unit: bool) -> Tensor:
    """Every nested width's ``(N, M)`` logits ``x[:, :d_k] y[:, :d_k]ᵀ`` (``y=None``: ``x``'s
    self product; each prefix L2-normalised first when ``unit``) at the ascending widths
    ``dims``, stacked ``(K, N, M)``, from one blocked product forward and backward: the
    products of one full-width matrix for all the widths (first-order)."""
    return apply(_PrefixMatrices, x, y, dims, unit)


# ----------------------------------------------------------------------------------------------
# Class tiles: the classifier losses' columns are their class weights
# ----------------------------------------------------------------------------------------------
# The losses with class_chunk_size= (tiles of classes), each with the key of its class table in
# its params: registered by their modules (pmlfunc.distributed.sharded_classes takes these)
CLASS_TILED: dict[Callable, str] = {}


class Classes(NamedTuple):
    r"""The static options of a walk over tiles of classes (:func:`class_statistics`).

    The columns are the ``C`` class weights ``w`` ``(C, K, D)``, walked in tiles of ``chunk``
    classes; each tile is one block of columns read by all ``B`` rows ``u`` at once (a
    ``B × chunk·K`` product ``v = u ŵᵀ``), cast to the rows' dtype as it is read (bf16 weights
    stay bf16) and read as ``ŵ`` (:func:`_read`): normalised when ``unit``, renormalised with
    the gradient passed straight through when ``renorm`` (P2SGrad), else as they are. A
    class's value ``z_ij`` is the largest of its ``K = sub_centers`` values, or with ``soft``
    their soft maximum ``Σ_k softmax_k(v_ijk / τ_i) v_ijk`` at the rows' temperatures ``τ``
    (SoftTriple). What the walk keeps (``fold``):

    | fold | statistic | for |
    |---|---|---|
    | ``"softmax"`` | ``A_i = log Σ_{j ≠ y_i} e^{z_ij}``, each row over the classes | the margin softmaxes, ``proxy_nca``, ``normalized_softmax``, ``soft_triple`` |
    | ``"squares"`` | ``Q_i = Σ_j clamp(z_ij, −1, 1)²``, each row over the classes | ``p2s_grad`` |
    | ``"columns"`` | ``L_j = log Σ_{i: y_i ≠ j} e^{z_ij + b_i}``, each class over the rows | ``proxy_anchor`` |

    Beside it, every walk returns the rows' target values ``T_i``, ``z`` of ``x_i`` and its
    class ``y_i``, read by index; ``norm``: also ``‖w_{y_i}‖`` (``K = 1``; L-Softmax's
    magnitude)."""

    chunk: int
    sub_centers: int = 1
    unit: bool = True
    norm: bool = False
    fold: str = "softmax"
    soft: bool = False
    renorm: bool = False


def _read(kind: Classes, rows: Tensor, dtype: torch.dtype, dim: int) -> tuple[Columns, Tensor]:
    """Weight rows as the walk reads them: ``(Columns, ŵ)`` with ``ŵ`` ``(n·K, D)`` cast to
    ``dtype`` (a copy of these rows only) and normalised (``kind.unit``: the norms kept in the
    :class:`Columns` for the backward) or renormalised (``kind.renorm``); :func:`_read_backward`
    is its gradient."""
    block = rows.to(dtype).reshape(-1, dim)
    if kind.renorm:
        return Columns((block,)), renorm_rows(block)
    y = columns(block, kind.unit)
    return y, block if y.inv is None else block * y.inv.unsqueeze(-1)


def _read_backward(y: Columns, g: Tensor) -> Tensor:
    """``∂ŵ`` (ours, changed in place) made the gradient of the rows :func:`_read` read: through
    the normalisation (:meth:`Columns.unit_backward_`), else as it is (the raw rows, and
    P2SGrad's renormalised ones, whose gradient passes straight through)."""
    if y.inv is None:
        return g
    return y.unit_backward_(0, g.mul_(y.inv.unsqueeze(-1)))


def _class_tile(kind: Classes, u: Tensor, weight: Tensor, c0: int, c1: int):
    """Classes ``[c0, c1)`` read for the rows ``u`` (:func:`_read`): a copy of one tile's
    weights, never of the table."""
    return _read(kind, weight[c0:c1], u.dtype, u.shape[-1])


def _centres(kind: Classes, v: Tensor, tau: Tensor | None):
    """A class's value from its ``K`` centres' values ``v`` ``(B, …, K)``: ``(z, saved)`` with
    ``z`` the largest (``saved``: the argmax) or, with ``kind.soft``, ``Σ_k p_k v_k``, ``p =
    softmax(v / τ_i)`` (``saved``: ``p`` and ``v − z``); :func:`_centres_backward` takes
    ``saved``."""
    if not kind.soft:
        return v.max(-1)
    assert tau is not None  # the soft centres' temperatures
    p = torch.softmax(v / tau.view(-1, *([1] * (v.ndim - 1))), -1)
    z = (p * v).sum(-1)
    return z, (p, v - z.unsqueeze(-1))


def _centres_backward(kind: Classes, dz: Tensor, saved, tau: Tensor | None):
    """``(∂v, ∂τ)`` for the cotangent ``dz`` of :func:`_centres`' ``z``: to the argmax centre
    (``∂τ = None``), or ``∂v_k = dz · p_k (1 + (v_k − z)/τ)`` and ``∂τ_i = −Σ dz · Σ_k p_k
    (v_k − z)² / τ_i²`` summed over the row's classes."""
    if not kind.soft:
        full = dz.new_zeros((*dz.shape, kind.sub_centers))
        return full.scatter(-1, saved.unsqueeze(-1), dz.unsqueeze(-1)), None
    assert tau is not None
    p, dev = saved
    t = tau.view(-1, *([1] * (dev.ndim - 1)))
    dv = (dev / t).add_(1.0).mul_(p).mul_(dz.unsqueeze(-1))
    spread = (p * dev * dev).sum(-1) * dz
    dtau = -spread.reshape(spread.shape[0], -1).sum(-1) / (tau * tau)
    return dv, dtau


def _class_logits(kind: Classes, u: Tensor, w_hat: Tensor, tau: Tensor | None):
    """The tile's ``(B, m)`` class values ``z`` (a fresh tile) and what the backward of the
    centres takes (``None`` for ``K = 1``)."""
    v = matmul(u, w_hat.t())
    if kind.sub_centers == 1:
        return v, None
    return _centres(kind, v.view(u.shape[0], -1, kind.sub_centers), tau)


def _class_target(labels: Tensor, c0: int, m: int) -> tuple[Tensor, Tensor]:
    """Whether each row's class lies in ``[c0, c0 + m)``, and its index there (clamped into the
    range where it does not: read, then discarded)."""
    t = labels - c0
    return (t >= 0) & (t < m), t.clamp(0, max(m - 1, 0)).unsqueeze(-1)


def _drop_target_(z: Tensor, inside: Tensor, at: Tensor, value: float) -> Tensor:
    """``z`` (a tile of ours) with each row's target entry, where it lies in the tile, set to
    ``value``, in place."""
    old = z.gather(-1, at).squeeze(-1)
    return z.scatter_(-1, at, torch.where(inside, value, old).unsqueeze(-1))


def _target_rows(kind: Classes, x: Tensor, weight: Tensor, labels: Tensor, tau: Tensor | None):
    """The rows' target classes read by index (``B × K × D``, never a tile): ``(inside, index,
    their Columns, ŵ_t, T, saved)`` with ``T_i`` the class value (:func:`_centres`) of
    ``x_i · ŵ_{y_i k}``."""
    inside, at = _class_target(labels, 0, weight.shape[0])
    index = at.squeeze(-1)
    rows = weight[index]  # (B, K, D)
    y, w_hat = _read(kind, rows, x.dtype, x.shape[-1])
    w_hat = w_hat.view(rows.shape)
    dots = matmul(w_hat, x.unsqueeze(-1)).squeeze(-1)  # (B, K)
    t, saved = _centres(kind, dots, tau)
    return inside, index, y, w_hat, t, saved


def class_count(weight: Tensor) -> int:
    """The number of classes of the whole table: ``weight``'s, or all the ranks' together when
    it is a shard (:func:`pmlfunc._global.sharding`)."""
    shard = _global.class_shard()
    return weight.shape[0] if shard is None else shard.num_classes


def _class_fold_(kind: Classes, z: Tensor, inside, at, b: Tensor | None) -> Tensor:
    """A tile's part of :class:`Classes`' statistic (rows' ``(B,)`` or columns' ``(m,)``)."""
    if kind.fold == "squares":
        k = z.clamp_(-1.0, 1.0)
        return (k * k).sum(-1)
    low = -torch.finfo(z.dtype).max
    if kind.fold == "columns":
        assert b is not None  # the rows' bias
        return torch.logsumexp(_drop_target_(z.add_(b.unsqueeze(-1)), inside, at, low), 0)
    # logsumexp out of place: a compiled torch.func.grad traces this forward with autograd
    # and checks its saved tensors (_row_lse_ updates its tile after its amax read it)
    return torch.logsumexp(_drop_target_(z, inside, at, low), -1)


def _class_ds_(kind: Classes, z: Tensor, inside, at, b, stat: Tensor, g: Tensor):
    """``∂z`` of a tile for the cotangent ``g`` of its statistic ``stat`` (the rows' ``(B,)``;
    the columns': this tile's ``(m,)`` of each), from the tile ``z`` (ours: changed)."""
    if kind.fold == "squares":  # ∂Q/∂z = 2 clamp(z) where −1 ≤ z ≤ 1 (clamp's mask, inclusive)
        inner = (z >= -1.0) & (z <= 1.0)
        return z.mul_(inner).mul_(2.0 * g.unsqueeze(-1))
    low = -torch.finfo(z.dtype).max
    if kind.fold == "columns":
        assert b is not None
        p = _exp_(_drop_target_(z.add_(b.unsqueeze(-1)), inside, at, low), stat)
        return _drop_target_(p, inside, at, 0.0).mul_(g)
    p = _exp_(_drop_target_(z, inside, at, low), stat.unsqueeze(-1))
    return _drop_target_(p, inside, at, 0.0) * g.unsqueeze(-1)  # new: g may be batched


def class_forward(kind: Classes, u: Tensor, x: Tensor, weight: Tensor, labels: Tensor, aux):
    """``(S, T[, N])``: :class:`Classes`' statistic ``S`` over the tiles of classes (the class
    values of the rows ``u``; rows' log-sum-exps merged across tiles as across the ring's
    blocks, :func:`merge`; squares summed; the columns' one per class, ``(C,)``), ``T_i`` the
    class value of ``x_i`` and its class read by index (0 for a class outside this table:
    another rank's, when sharded) and, with ``kind.norm``, ``N_i = ‖w_{y_i}‖``. ``aux``: the
    rows' temperatures ``τ`` (soft centres) or bias ``b`` (columns), ``(B,)``; else ``None``."""
    tau = aux if kind.soft else None
    key = "row_lse" if kind.fold == "softmax" else "row_sq"
    rows: dict[str, Tensor] | None = None
    cols: list[Tensor] = []
    for c0, c1 in _tiles(weight.shape[0], kind.chunk):
        _, w_hat = _class_tile(kind, u, weight, c0, c1)
        z, _ = _class_logits(kind, u, w_hat, tau)
        inside, at = _class_target(labels, c0, c1 - c0)
        part = _class_fold_(kind, z, inside, at, aux)
        if kind.fold == "columns":
            cols.append(part)
        else:
            rows = merge(rows, {key: part})
    if kind.fold == "columns":
        stat = torch.cat(cols) if cols else u.new_zeros(0)
    elif rows is None:  # no classes: a rank's empty shard
        stat = u.new_full(u.shape[:-1], -torch.finfo(u.dtype).max if key == "row_lse" else 0.0)
    else:
        stat = rows[key]
    if weight.shape[0] == 0:
        zero = u.new_zeros(u.shape[:-1])
        return (stat, zero, zero) if kind.norm else (stat, zero)
    inside, _, y, _, t, _ = _target_rows(kind, x, weight, labels, tau)
    out: tuple[Tensor, ...] = (stat, torch.where(inside, t, 0.0))
    if kind.norm:  # K = 1
        assert y.norm is None  # the raw rows (unit=False): their norm here
        norm = torch.linalg.vector_norm(y.segments[0], dim=-1)
        out += (torch.where(inside, norm, 0.0),)
    return out


def class_backward(kind: Classes, u, x, weight, labels, aux, stat, gs, gt, gn, needs):
    """``(∂u, ∂x, ∂w, ∂aux)`` (those ``needs`` asks for) for the cotangents ``gs``, ``gt``,
    ``gn`` of :func:`class_forward`'s ``(S, T, N)`` (``None``: not differentiated). Every tile
    recomputed: its ``∂z`` (:func:`_class_ds_`), through the centres (:func:`_centres_backward`),
    then ``∂u = ∂v ŵ`` and the tile's ``∂ŵ = ∂vᵀ u`` made the raw rows' gradient
    (:func:`_read_backward`); ``T``'s and ``N``'s by index: ``∂x_i = ∂v_{ik} ŵ_{y_i k}``,
    ``∂w_{y_i}`` added with :meth:`Tensor.index_add_`. The weight gradient is the one
    ``(C, K, D)`` tensor, filled a tile at a time (under ``torch.func`` transforms the tiles
    are concatenated instead: a batched tensor cannot be written into an unbatched one)."""
    need_u, need_x, need_w, need_aux = needs
    n, dim, k = u.shape[-2], u.shape[-1], kind.sub_centers
    tau = aux if kind.soft else None
    batched = inside_transform()
    gu = gx = gaux = None
    blocks: list[Tensor] = []
    gw = torch.zeros_like(weight) if need_w and not batched else None
    if gs is not None and (need_u or need_w or need_aux):
        for c0, c1 in _tiles(weight.shape[0], kind.chunk):
            y, w_hat = _class_tile(kind, u, weight, c0, c1)
            z, saved = _class_logits(kind, u, w_hat, tau)
            inside, at = _class_target(labels, c0, c1 - c0)
            if kind.fold == "columns":
                ds = _class_ds_(kind, z, inside, at, aux, stat[c0:c1], gs[c0:c1])
                part = ds.sum(-1)  # ∂b_i
                gaux = part if gaux is None else gaux + part
            else:
                ds = _class_ds_(kind, z, inside, at, aux, stat, gs)
            if saved is not None:  # through the centres
                ds, dtau = _centres_backward(kind, ds, saved, tau)
                ds = ds.view(n, -1)
                if dtau is not None:
                    gaux = dtau if gaux is None else gaux + dtau
            if need_u:
                part = matmul(ds, w_hat)
                gu = part if gu is None else gu + part
            if need_w:
                g = _read_backward(y, matmul(ds.t(), u)).view(c1 - c0, k, dim).to(weight.dtype)
                if gw is None:
                    blocks.append(g)
                else:
                    gw[c0:c1] = g
    if need_w and gw is None:
        gw = torch.cat(blocks) if blocks else torch.zeros_like(weight)
    if (gt is not None or gn is not None) and weight.shape[0] > 0:
        inside, index, y, w_hat, _, saved = _target_rows(kind, x, weight, labels, tau)
        g_rows = None  # ∂ŵ of the target rows, (B, K, D)
        if gt is not None:
            dv, dtau = _centres_backward(kind, gt * inside, saved, tau)  # (B, K)
            if need_x:
                gx = (dv.unsqueeze(-1) * w_hat).sum(1)
            if dtau is not None:
                gaux = dtau if gaux is None else gaux + dtau
            g_rows = dv.unsqueeze(-1) * x.unsqueeze(1)
        if need_w:
            g_rows = x.new_zeros(w_hat.shape) if g_rows is None else g_rows
            g_rows = _read_backward(y, g_rows.reshape(-1, dim)).view(w_hat.shape)
            if gn is not None:  # N_i = ‖w_{y_i}‖ (K = 1, raw rows): ∂w += gn_i w/‖w‖
                norm = torch.linalg.vector_norm(w_hat, dim=-1, keepdim=True)
                unit = torch.where(norm > 0, w_hat / torch.where(norm > 0, norm, 1.0), 0.0)
                g_rows = g_rows + (gn * inside).view(-1, 1, 1) * unit
            assert gw is not None  # need_w
            if batched:  # (out of place: a batched source cannot go into an unbatched tensor)
                gw = gw.index_add(0, index, g_rows.to(gw.dtype))
            else:  # in place: the one (C, K, D) gradient
                gw = gw.index_add_(0, index, g_rows.to(gw.dtype))
    zeros = {0: u, 1: x, 3: aux}
    out = []
    for i, (t, need) in enumerate(zip((gu, gx, gw, gaux), needs, strict=True)):
        if need:
            out.append(fresh(torch.zeros_like(zeros[i]) if t is None else t))
    return tuple(out)


_notfirst_order_backward = first_order_backward(
    "the class-tiled losses' gradient (class_chunk_size=...)",
    "leave class_chunk_size=None for the dense loss, differentiable twice",
)


class _ClassGrads(FirstOrder):
    """:func:`class_backward` as a Function whose backward raises (:class:`FirstOrder`): the
    first-order backward records no graph, a second differentiation fails loudly."""

    @staticmethod
    def forward(u, x, weight, labels, aux, stat, gs, gt, gn, kind, needs):
        return class_backward(kind, u, x, weight, labels, aux, stat, gs, gt, gn, needs)

    backward = staticmethod(_notfirst_order_backward)


def _class_needs(ctx) -> tuple[bool, ...]:
    """Which of ``(u, x, weight, aux)`` (inputs 0, 1, 2 and 4) want a gradient."""
    n = ctx.needs_input_grad
    return (n[0], n[1], n[2], n[4])


def _class_grads(needs, grads) -> tuple:
    """The Function's input gradients ``(u, x, weight, labels, aux, …)`` from those formed."""
    it = iter(grads)
    gu, gx, gw, gaux = (next(it) if need else None for need in needs)
    return gu, gx, gw, None, gaux


class _ClassStats(torch.autograd.Function):
    """:func:`class_forward` as a Function of ``(u, x, weight, labels, aux, kind)``: saves the
    inputs (no copy) and ``S``; its backward is :class:`_ClassGrads`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(u, x, weight, labels, aux, kind):
        return class_forward(kind, u, x, weight, labels, aux)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, x, weight, labels, aux, kind = inputs
        ctx.set_materialize_grads(False)
        ctx.kind = kind
        ctx.save_for_backward(u, x, weight, labels, aux, output[0])

    @staticmethod
    def backward(ctx, gs, gt, gn=None):
        u, x, weight, labels, aux, stat = ctx.saved_tensors
        needs = _class_needs(ctx)
        if not any(needs) or (gs is None and gt is None and gn is None):
            return (None,) * 6
        # the cotangents detached: a traced backward then records no graph through them (a
        # second differentiation still raises, through u, x and weight)
        gs, gt, gn = (None if g is None else g.detach() for g in (gs, gt, gn))
        args = (u, x, weight, labels, aux, stat, gs, gt, gn, ctx.kind, needs)
        return (*_class_grads(needs, apply(_ClassGrads, *args)), None)


class _ShardedClassStats(torch.autograd.Function):
    """:func:`class_forward` over a class table sharded across the ranks
    (:class:`pmlfunc._global.ClassShard`; eager, the collectives wait on the host).

    Forward: this rank's statistics over its classes, combined over the ranks into those of
    all ``C`` classes, the same on every rank: a log-sum-exp ``S`` by a maximum and a sum of
    ``e^{S_r − max}``, a sum of squares ``S``, ``T`` and ``N`` (non-zero on the rank that owns
    the row's class only) by a sum. The columns' statistics (``fold="columns"``) are complete
    on their rank and stay there, with the owned rows' ``T``. Backward: the cotangents are
    ``∂L/∂`` of this rank's statistics (the same on every rank where they are combined); this
    rank's tiles give its shard's exact weight gradient and its classes' part of the rows'
    gradients, summed over the ranks so that every rank holds the whole of them and the
    computation upstream (the same on every rank) differentiates as under the gather."""

    @staticmethod
    def forward(u, x, weight, labels, aux, kind, shard):
        stats = class_forward(kind, u, x, weight, labels - shard.offset, aux)
        if kind.fold == "columns":  # each class's statistic is complete on the rank that owns it
            return tuple(t.clone() for t in stats)  # T: the owned rows' (0 elsewhere)
        if kind.fold == "softmax":
            top = shard.max_(stats[0].clone(), "the classes' log-sum-exp (maximum)")
            shift = torch.where(torch.isfinite(top), top, 0.0)
            total = shard.sum_(torch.exp(stats[0] - shift), "the classes' log-sum-exp (sum)")
            out = [torch.log(total) + shift]
        else:
            out = [shard.sum_(stats[0].clone(), "the classes' sum of squares")]
        for i, what in enumerate(("target values", "target weight norms")[: len(stats) - 1]):
            out.append(shard.sum_(stats[1 + i].clone(), f"the classes' {what}"))
        return tuple(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, x, weight, labels, aux, kind, shard = inputs
        ctx.set_materialize_grads(False)
        ctx.kind, ctx.shard = kind, shard
        ctx.save_for_backward(u, x, weight, labels, aux, output[0])

    @staticmethod
    def backward(ctx, gs, gt, gn=None):
        if torch.is_grad_enabled():  # create_graph=True: this backward records no graph
            _notfirst_order_backward(ctx)
        u, x, weight, labels, aux, stat = ctx.saved_tensors
        needs = _class_needs(ctx)
        shard = ctx.shard
        where = "the backward of the classes' statistics"
        with shard.guard(where):  # a failure here reaches the ranks waiting in the sums
            local = labels - shard.offset
            args = (ctx.kind, u, x, weight, local, aux, stat, gs, gt, gn, needs)
            gu, gx, gw, _, gaux = _class_grads(needs, class_backward(*args))
            gu = None if gu is None else shard.sum_(gu.contiguous(), f"{where} (rows)")
            gx = None if gx is None else shard.sum_(gx.contiguous(), f"{where} (targets)")
            gaux = None if gaux is None else shard.sum_(gaux.contiguous(), f"{where} (row inputs)")
        return gu, gx, gw, None, gaux, None, None


def class_statistics(
    u: Tensor, x: Tensor, weight: Tensor, labels: Tensor, kind: Classes, aux: Tensor | None = None
):
    r"""``(S, T)`` (and ``N`` with ``kind.norm``): :class:`Classes`' statistic of the class
    values ``z_ij`` of the rows ``u`` over tiles of ``kind.chunk`` classes, never the ``B × C``
    matrix, and the target values of ``x`` (:func:`class_forward`); differentiable in ``u``
    and ``x`` ``(B, D)``, ``weight`` ``(C, K, D)`` and ``aux`` (:func:`class_backward`).
    ``labels``: int64 in ``[0, C)``.

    Inside :func:`pmlfunc._global.sharding` (:func:`pmlfunc.distributed.sharded_classes`)
    ``weight`` is this rank's shard of the table, ``labels`` are global class ids and the
    statistics are combined over the ranks (:class:`_ShardedClassStats`; not the columns'
    statistics, which stay with their rank: :func:`rank_sum` and :func:`rank_shared` carry
    the rest of such a loss)."""
    if x is u:  # one tensor as two inputs of an autograd.Function: dynamo refuses it
        x = x.view_as(x)
    shard = _global.class_shard()
    if shard is not None:
        return _ShardedClassStats.apply(u, x, weight, labels, aux, kind, shard)
    return apply(_ClassStats, u, x, weight, labels, aux, kind)


class _RankSum(torch.autograd.Function):
    """The sum over the ranks of a tensor each rank computed from its own classes; its
    cotangent, the same on every rank, is each rank's part's."""

    @staticmethod
    def forward(ctx, value, shard):
        return shard.sum_(value.clone(), "a sum over the ranks' classes")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _RankShared(torch.autograd.Function):
    """A tensor every rank holds alike, used by each rank for its own classes: the identity,
    whose gradient is the sum of the ranks' parts."""

    @staticmethod
    def forward(ctx, value, shard):
        ctx.shard = shard
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        where = "the gradient of a shared input"
        with ctx.shard.guard(where):
            return ctx.shard.sum_(grad.contiguous(), where), None


def rank_sum(value: Tensor) -> Tensor:
    """Inside :func:`pmlfunc._global.sharding`: ``value`` summed over the ranks, as autograd
    sees it (each rank's part gets the common cotangent); ``value`` itself otherwise."""
    shard = _global.class_shard()
    return value if shard is None else _RankSum.apply(value, shard)


def rank_shared(value: Tensor) -> Tensor:
    """Inside :func:`pmlfunc._global.sharding`: ``value`` (the same on every rank) for a
    computation over this rank's classes only, its gradient summed over the ranks; ``value``
    itself otherwise."""
    shard = _global.class_shard()
    return value if shard is None else _RankShared.apply(value, shard)


def softmax_term(lse: Tensor, logit: Tensor) -> Tensor:
    """``−log softmax`` of the target from the log-sum-exp of the other classes' logits and the
    target's own: ``log(e^{A} + e^{ψ}) − ψ``."""
    return logaddexp(lse, logit) - logit


def class_cross_entropy(
    x: Tensor,
    r: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk: int,
    target: Callable[[Tensor], Tensor] | None = None,
    unit: bool = True,
    magnitude: bool = False,
) -> Tensor:
    r"""The per-row cross entropy ``ℓ_i = log(e^{A_i} + e^{ψ_i}) − ψ_i`` of the classifier
    losses over tiles of ``chunk`` classes: ``A_i`` the log-sum-exp of the other classes'
    logits ``r_i c_ij`` (``c_ij = max_k x_i · ŵ_jk``; the tiles read the rows ``u = r ⊙ x``)
    and ``ψ_i = r_i · target(c_{i y_i})`` the target's (:func:`class_statistics`); with
    ``magnitude`` (L-Softmax: ``z = r_i ‖w_j‖ cos``, the weights not normalised)
    ``ψ_i = r_i ‖w_{y_i}‖ · target(cos_{i y_i})``. ``weight``: ``(C, D)`` or ``(C, K, D)``
    (sub-centres: a class's cosine is its largest)."""
    w = class_table(weight)
    kind = Classes(chunk, w.shape[1], unit, magnitude)
    stats = class_statistics(r.unsqueeze(-1) * x, x, w, labels, kind)
    if magnitude:
        lse, dot, norm = stats
        cos = dot / norm.clamp_min(_NORMALIZE_EPS)
        logit = r * norm * (cos if target is None else target(cos))
    else:
        lse, cos = stats
        logit = r * (cos if target is None else target(cos))
    return softmax_term(lse, logit)


def class_table(weight: Tensor) -> Tensor:
    """A class table ``(C, D)`` or ``(C, K, D)`` as the walk takes it, ``(C, K, D)``: always a
    view (given the caller's ``(C, K, D)`` tensor itself, a compiled
    ``torch.func.grad_and_value`` over the embeddings and the weight returned a wrong weight
    gradient: PyTorch 2.13, aot_eager and inductor alike)."""
    return weight.unsqueeze(1) if weight.ndim == 2 else weight.view_as(weight)


@dataclass(frozen=True)
class EngineCall:
    """A loss call as the engine runs it: ``x`` normalised in the compute dtype, the columns
    ``y`` (a tensor or a tuple of segments, read as their concatenation; ``y=None``: self mode)
    in the compute dtype, normalised by the engine when ``unit`` (:class:`Columns`: no
    normalised copy is made), their labels ``rows``/``cols`` (``None``: aligned sets), the logit ``scale`` and
    ``bias``, ``chunk`` rows a tile (``None``: the dense loss; the engine then takes all rows at
    once), the engine's reducer name, and ``finish`` (the embedding regularizer's addition, or
    ``None``). The retrieval kind (:class:`Retrieval` options as ``kind``) passes tuples of its
    rows' and columns' metadata as ``rows``/``cols`` (:func:`_retrieval_masks`), and
    ``columns_per_row``, the columns a loss row owns (``1 + k``, plus its query when queries are
    columns): the ring's blocks are that many times a rank's batch size. ``normalized``: ``x``
    and ``y`` are the unit rows of the loss's embeddings (a cosine similarity), which nested
    widths renormalise a prefix at a time (:func:`run_nested`)."""

    kind: Kind
    x: Tensor
    y: Tensor | tuple[Tensor, ...] | None
    rows: Tensor | tuple[Tensor, ...] | None
    cols: Tensor | tuple[Tensor, ...] | None
    scale: float | Tensor
    bias: Tensor | None
    chunk: int | None
    reducer: str
    finish: Callable[[Tensor], Tensor] | None = None
    columns_per_row: int = 1
    unit: bool = False
    normalized: bool = False

    @property
    def m(self) -> int:
        """The number of columns (``x``'s rows in self mode)."""
        if self.y is None:
            return self.x.shape[-2]
        return columns(self.y).m


# The entries of one tile when the engine runs a dense call (``chunk_size=None``) of a
# row-complete kind: 2 MiB of float32, about a core's L2 cache, whose buffers the walk reuses
# from tile to tile (:class:`_Scratch`); every self-mode call of up to 724 rows (the self
# product's fuse limit) is still one tile. Measured dense NT-Xent, one thread, against 2**22:
# 2,048 × 128 45 ms against 79, 2,048 × 512 131 against 137, 4,096 × 128 214 against 267.
DENSE_TILE = 2**19
# A walk whose buffers are fresh each tile (the retrieval kind's): 16 MiB of float32, under
# glibc's 32 MiB mmap threshold, so that its tile buffers come back from the heap instead of
# being mapped and faulted in again for every tile. The nested widths' walk (its K tiles a step
# in reused buffers) takes the same over all its widths: each of its tiles adds K blocks'
# products into the whole (M, D) column gradient, so that fewer, larger tiles win (4,096 × 768,
# widths 768 to 48, one thread, in-process: 2**22 0.93-1.08 s, 2**20 1.07-1.24, 2**19 1.34-1.51).
FRESH_DENSE_TILE = 2**22
# The fewest rows of x a row-complete kind's dense tile takes, whatever M (the retrieval kind's
# fresh tiles keep within FRESH_DENSE_TILE): each tile adds its product
# ∂Sᵀ x_tile into the whole (M, D) column gradient, a GEMM whose inner dimension is the tile's
# rows, and reads and writes that (M, D) buffer once a tile; below ~256 rows both cost more
# than the smaller tile saves. Dense NT-Xent, one thread, one process, tiles of 64 rows (2**19
# entries at M = 8,192) against 256: 8,192 × 128 0.85 against 0.72 of the floor, 8,192 × 512
# 1.07 against 0.81; 4,096 × 128 (128 rows) 0.74 against 0.70.
DENSE_MIN_ROWS = 256


def dense_rows(kind, n: int, m: int) -> int:
    """Rows a tile for a dense call of ``kind`` over ``n × m`` logits: CLIP takes one tile (its
    columns' statistics are then complete in the forward, which forms the gradient too); the
    row-complete kinds tiles of :data:`DENSE_TILE` entries, but at least :data:`DENSE_MIN_ROWS`
    rows of ``x`` (the memory of a tiled call, at no cost: no tile is computed twice); the
    retrieval kind tiles of at most :data:`FRESH_DENSE_TILE` entries (its buffers are fresh
    each tile: a larger one would be mapped and faulted in again every tile)."""
    if kind == "clip":
        return max(n, 1)
    if isinstance(kind, Retrieval):  # a tile: rows × roles of x
        return max(1, min(n // kind.roles, FRESH_DENSE_TILE // max(m * kind.roles, 1)))
    return max(1, min(n, max(DENSE_TILE // max(m, 1), DENSE_MIN_ROWS)))


def dense_runs(kind: str, labels: Tensor | None, inputs: Mapping) -> bool:
    """Whether the engine runs the dense call of ``ntxent``/``supcon`` with these inputs (else
    the general batch path does): labels given, no ``indices_tuple`` nor ``mat``, a matmul
    similarity (``cosine()``, ``dot()``) and a reducer of :data:`KINDS`."""
    if labels is None or inputs.get("indices_tuple") is not None or inputs.get("mat") is not None:
        return False
    distance, reducer = inputs.get("distance"), inputs.get("reducer")
    if distance is not None and not isinstance(distance, _Dot):
        return False
    return reducer is None or (isinstance(reducer, Reducer) and repr(reducer)[:-2] in KINDS[kind])


def run_local(call: EngineCall) -> Tensor:
    """The loss of ``call`` in this process (:func:`tiled_loss`); a dense call (``chunk``
    ``None``) in tiles of :func:`dense_rows`."""
    n = call.x.shape[-2]
    chunk = call.chunk or dense_rows(call.kind, n, call.m)
    loss = tiled_loss(
        call.x, call.y, call.rows, call.cols, scale=call.scale, bias=call.bias,
        chunk=chunk, kind=call.kind, reducer=call.reducer, unit=call.unit,
    )  # fmt: skip
    return loss if call.finish is None else call.finish(loss)


def softmax_call(
    kind: str,
    embeddings: Tensor,
    labels: Tensor | None,
    temperature: float | Tensor,
    chunk_size: object,
    inputs: Mapping,
    what: str | None = None,
) -> EngineCall:
    """``ntxent`` / ``supcon`` as an :class:`EngineCall`, after checking the call: the engine
    builds its pairs from labels and its similarity by a matmul; ``scale = 1/τ``. ``what`` names
    the caller in errors (default: the tiled loss)."""
    what = what or f"the tiled {kind} (chunk_size=...)"
    check_shared(kind, inputs)
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    chunk = None if chunk_size is None else _checks.chunk_size(chunk_size)
    for name in ("indices_tuple", "mat"):
        if inputs.get(name) is not None:
            raise ValueError(
                f"{what} builds its pairs from labels, tile by tile: {name} is not supported"
            )
    if labels is None:
        raise ValueError(f"{what} needs labels, got None")
    ref_emb, ref_labels = inputs.get("ref_emb"), inputs.get("ref_labels")
    validate(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    distance = resolve(inputs.get("distance"), cosine())
    if not isinstance(distance, _Dot):  # kind "dot": cosine() or dot()
        raise ValueError(
            f"{what} needs a similarity computed by a matmul (distance=cosine() or dot()); "
            f"got distance={distance!r}"
        )
    reducer = tiled_reducer(kind, inputs.get("reducer"), what)
    cd = _checks.compute_dtype(embeddings.dtype)
    x = embeddings.to(cd)
    y = None if ref_emb is None else ref_emb.to(cd)
    if distance.normalize:
        x = unit_rows(x)  # F.normalize's values, a shorter backward
        y = None if y is None else unit_rows(y)
    t = (
        temperature.to(dtype=cd, device=x.device)
        if isinstance(temperature, Tensor)
        else temperature
    )
    finish: Callable[[Tensor], Tensor] | None = None
    if inputs.get("embedding_regularizer") is not None:

        def add_regularizer(loss: Tensor) -> Tensor:
            return regularized(loss, embeddings, inputs)

        finish = add_regularizer

    return EngineCall(
        kind, x, y, labels, ref_labels, 1.0 / t, None, chunk, reducer, finish,
        normalized=distance.normalize,
    )  # fmt: skip


# loss function -> a builder of its EngineCall from the call's bound arguments (and the name of
# the caller for errors); filled by the loss modules (:func:`builds`)
BUILDERS: dict[Callable, Callable[[Mapping, str | None], EngineCall]] = {}


def builds(loss_fn: Callable):
    """Register the decorated function as ``loss_fn``'s :class:`EngineCall` builder."""

    def register(builder):
        BUILDERS[loss_fn] = builder
        return builder

    return register


def unpartial(loss_fn: Callable, args: tuple = (), kwargs: Mapping | None = None):
    """``(function, args, kwargs)`` of a call through any ``functools.partial`` layers."""
    fn, kwargs = loss_fn, dict(kwargs or {})
    while isinstance(fn, functools.partial):
        args, kwargs, fn = (*fn.args, *args), {**fn.keywords, **kwargs}, fn.func
    return fn, args, kwargs


def builder_of(loss_fn: Callable, what: str) -> Callable[[Mapping, str | None], EngineCall]:
    """The :class:`EngineCall` builder of a loss of :data:`BUILDERS` (or a ``functools.partial``
    of one); ``ValueError`` naming the losses ``what`` runs for any other function."""
    fn = unpartial(loss_fn)[0]
    builder = BUILDERS.get(fn)
    if builder is None:
        names = ", ".join(sorted(f.__name__ for f in BUILDERS))
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(f"{what} runs {names} (or a functools.partial of one); got {name}")
    return builder


def engine_call(loss_fn: Callable, args: tuple, kwargs: Mapping, what: str) -> EngineCall:
    """``loss_fn(*args, **kwargs)`` as an :class:`EngineCall` (checked as the loss checks it)."""
    builder = builder_of(loss_fn, what)
    fn, args, kwargs = unpartial(loss_fn, args, kwargs)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return builder(bound.arguments, what)
