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

Peak memory: the inputs, their gradients and a few tiles (masks are boolean), whatever ``N`` is.
Shapes are static and every count is a tensor, so the one-block path (:func:`tiled_loss`) runs
under ``torch.compile(fullgraph=True)``, ``torch.func`` and on the meta device; its backward
records no graph, and differentiating it again raises.

The public losses (:func:`pmlfunc.losses.ntxent`, :func:`pmlfunc.losses.supcon`,
:func:`pmlfunc.losses.clip`, :func:`pmlfunc.losses.siglip`) describe a call as an
:class:`EngineCall` (:data:`BUILDERS`), run by :func:`run_local` when given ``chunk_size`` and by
the ring under ``global_objective(..., exchange="ring")``; their dense paths compute the same
numbers from the whole matrix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._inputs import validate
from .._ops import apply, count_true, fresh, matmul, ratio
from ..distances import _Dot, cosine, resolve
from ..reducers import Reducer
from ._batch import check_shared, regularized

__all__ = [
    "BUILDERS",
    "KINDS",
    "ROW_STATS",
    "EngineCall",
    "block_backward",
    "block_forward",
    "builder_of",
    "builds",
    "counts",
    "engine_call",
    "merge",
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
}

# kind -> how many of the backward's statistics are per row (the rest are per column)
ROW_STATS = {"siglip": 1, "ntxent": 3, "supcon": 3, "clip": 3}


def tiled_reducer(kind: str, reducer: Reducer | None, what: str | None = None) -> str:
    """The engine's name for a loss's reducer (``None``: the kind's default), or the error that
    says which reducers ``what`` (default: the loss) supports."""
    allowed = KINDS[kind]
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


def _logits(x: Tensor, y: Tensor, r0: int, r1: int, scale, bias) -> Tensor:
    """``S = scale · x[r0:r1] yᵀ + bias``, one fresh ``(r1 − r0, M)`` tile updated in place."""
    s = matmul(x[r0:r1], y.transpose(-1, -2))
    if not (isinstance(scale, float) and scale == 1.0):
        s = s.mul_(scale)
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
    if exclude and diag:  # fresh masks: in place is safe
        pos.diagonal(offset=r0, dim1=-2, dim2=-1).fill_(False)
        neg.diagonal(offset=r0, dim1=-2, dim2=-1).fill_(False)
    return pos, neg


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


def _exp_(s: Tensor, shift: float | Tensor) -> Tensor:
    """``exp(max(s − shift, −80))`` in place."""
    return s.sub_(shift).clamp_min_(-80.0).exp_()


def _ntxent_terms_(s: Tensor, lse: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """A tile's NT-Xent terms summed, and per row ``Σ_P q`` with ``q = −∂term/∂S`` (what the
    backward spreads over the row's negatives), destroying ``s``."""
    r = s.sub_(lse.unsqueeze(-1)).sigmoid_()
    q = _ntxent_q_(r, pos)  # r is now σ + ε
    terms = r.log_().neg_().masked_fill_(pos.logical_not(), 0.0)
    return terms.sum(), q.sum(-1)


def _ntxent_q_(r: Tensor, pos: Tensor) -> Tensor:
    """``q = −∂term/∂z`` on the positives (0 elsewhere) from ``r = σ(z)``: ``d/dz −log(σ(z) + ε)
    = −σ(z)(1 − σ(z)) / (σ(z) + ε)``, the dense loss's autograd chain. One new tile; ``r`` is
    left holding ``σ(z) + ε`` (whose log is the term).

    No ``Tensor.addcmul_(..., value=)`` (nor ``addcdiv_(value=)``, ``add_(alpha=tensor)``):
    dynamo rewrites those into ``torch._inductor.inductor_prims.fma``, a prim without a
    functorch rule, so ``torch.compile(torch.func.grad(...))`` of the loss failed with "Cannot
    access data pointer of Tensor that doesn't have storage" (PyTorch 2.13; the rewrite of a
    scalar ``value`` came with pytorch/pytorch#176871, the prim's autograd formula with #184629,
    which covers plain autograd only: ``torch.func.grad`` of ``inductor_prims.fma`` fails in
    eager mode too)."""
    q = torch.rsub(r, 1.0).mul_(r)  # σ(1 − σ)
    return q.div_(r.add_(torch.finfo(r.dtype).tiny)).masked_fill_(pos.logical_not(), 0.0)


def block_forward(
    kind, x, y, rows, cols, scale, bias, chunk, *, diag, exclude, lse=None, final=True
) -> dict[str, Tensor]:
    """Partial statistics of ``kind`` over one block of columns ``y`` (labels ``cols``), in
    tiles of ``chunk`` rows of ``x``. NT-Xent: ``lse=None, final=False`` gives the negatives'
    log-sum-exp only; ``lse`` (the rows' final one) gives the terms; ``final=True`` (one block)
    both. Each tile is worked on in place: a few tile-sized buffers live at a time."""
    n, m = x.shape[-2], y.shape[-2]
    total = count = x.new_zeros(())
    parts: dict[str, list[Tensor]] = {k: [] for k in ("row_lse", "row_pos", "row_pos_sum", "row_q")}
    col_max = x.new_full((m,), -torch.finfo(x.dtype).max)
    col_sum = col_pos = col_pos_sum = x.new_zeros(m)
    for r0, r1 in _tiles(n, chunk):
        s = _logits(x, y, r0, r1, scale, bias)
        pos, neg = _masks(rows, cols, r0, r1, m, x.device, diag, exclude)
        if kind == "siglip":  # Σ softplus(−z·S), z = ±1
            total = total + F.softplus(s.mul_(torch.where(pos, -1.0, 1.0))).sum()
            count = count + count_true(pos) + count_true(neg)
            continue
        if kind == "ntxent":  # −log(σ(S − lse_neg) + ε) on the positives
            tile_lse = lse[r0:r1] if lse is not None else _row_lse_(s.clone() if final else s, neg)
            if lse is None and not final:
                parts["row_lse"].append(tile_lse)
                continue
            t, q = _ntxent_terms_(s, tile_lse, pos)
            total, count = total + t, count + count_true(pos)
            parts["row_lse"].append(tile_lse)
            parts["row_q"].append(q)
            continue
        if kind == "supcon":
            parts["row_lse"].append(_row_lse_(s.clone(), pos | neg))
            count = count + count_true(neg)
        else:  # clip: every entry is a candidate, along rows and along columns (online)
            new_max = torch.maximum(col_max, s.amax(0))
            part = _exp_(s - new_max, 0.0).sum(0)
            col_sum = col_sum * (col_max - new_max).clamp_min(-80.0).exp() + part
            col_max = new_max
            parts["row_lse"].append(torch.logsumexp(s, -1))
            col_pos = col_pos + count_true(pos, 0)
        parts["row_pos"].append(count_true(pos, -1).to(x.dtype))
        s = s.masked_fill_(pos.logical_not(), 0.0)  # the positives' logits
        parts["row_pos_sum"].append(s.sum(-1))
        if kind == "clip":
            col_pos_sum = col_pos_sum + s.sum(0)
    if kind == "siglip":
        keys: tuple[str, ...] = ()
    elif kind == "ntxent":  # a given lse is not a partial: not returned
        keys = ("row_q",) if lse is not None else ("row_lse", "row_q") if final else ("row_lse",)
    else:
        keys = ("row_lse", "row_pos", "row_pos_sum")
    # every key, also without a tile (an empty rank's rows, on the ring)
    out = {k: torch.cat(parts[k]) if parts[k] else x.new_zeros(0) for k in keys}
    if kind != "clip":
        out.update(total=total, count=count.to(x.dtype))
    else:
        out.update(
            col_lse=torch.log(col_sum) + col_max,
            col_pos=col_pos.to(x.dtype),
            col_pos_sum=col_pos_sum,
        )
    return out


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


def counts(kind: str, st: dict[str, Tensor], n: int) -> dict[str, Tensor]:
    """The numbers ``kind``'s reducers divide by, over these ``n`` rows (and, for CLIP, these
    columns): across ranks, their sums over the ranks are the global ones."""
    zero = next(iter(st.values())).new_zeros(())
    if kind == "siglip":
        return {"n": zero + n, "count": st["count"]}
    if kind == "ntxent":
        return {"count": st["count"]}
    if kind == "supcon":
        nonzero = _supcon_losses(st).sign().clamp_min(0.0).sum()  # the reducer's window: > 0
        pos = st["row_pos"].sum()
        return {"n": zero + n, "pos": pos, "count": st["count"], "nonzero": nonzero}
    return {f"{s}_has": (st[f"{s}_pos"] > 0).sum().to(zero.dtype) for s in ("row", "col")}


def reduce(kind: str, st: dict[str, Tensor], reducer: str, total: Mapping[str, Tensor]):
    """The loss of these rows (and columns) and the statistics its backward reads (per-row ones
    first, :data:`ROW_STATS`), given the :func:`counts` of the whole batch (``total``)."""
    if kind == "siglip":
        one = st["total"].new_ones(())
        coef = {"batch": one / total["n"], "mean": ratio(one, total["count"]), "sum": one}[reducer]
        return st["total"] * coef, (coef,)
    if kind == "ntxent":
        one = st["total"].new_ones(())
        coef = ratio(one, total["count"]) if reducer == "mean" else one
        return st["total"] * coef, (st["row_lse"], st["row_q"], coef)
    if kind == "supcon":
        losses = _supcon_losses(st)
        active = (total["pos"] > 0) & (total["count"] > 0)
        losses = torch.where(active, losses, torch.zeros_like(losses))
        if reducer == "avg_nonzero":  # the reducers' window: loss > 0, by sign
            sel = losses.sign().clamp_min(0.0)
            coef = ratio(sel, total["nonzero"].expand_as(sel))
        elif reducer == "mean":
            coef = torch.ones_like(losses) / total["n"]
        else:
            coef = torch.ones_like(losses)
        coef = torch.where(active, coef, torch.zeros_like(coef))
        return matmul(coef, losses), (st["row_lse"], st["row_pos"], coef)
    # clip: (R(rows) + R(columns)) / 2 over the rows / columns that have a positive
    loss, out = None, []
    for side in ("row", "col"):
        lse, n_pos, pos_sum = st[f"{side}_lse"], st[f"{side}_pos"], st[f"{side}_pos_sum"]
        has = (n_pos > 0).to(lse.dtype)
        terms = (lse - pos_sum / n_pos.clamp_min(1.0)) * has
        den = total[f"{side}_has"].expand_as(has)
        coef = (ratio(has, den) if reducer == "mean" else has) * 0.5
        loss = matmul(coef, terms) if loss is None else loss + matmul(coef, terms)
        out += [lse, n_pos, coef]
    return loss, tuple(out)


def _tile_ds_(kind, s, pos, neg, r0, r1, row, col) -> Tensor:
    """``∂L/∂S`` of one tile (for a unit cotangent) from the statistics of its rows (``row``)
    and its block's columns (``col``), computed in ``s``'s buffer (destroyed) and at most one or
    two more."""
    if kind == "siglip":  # ∂ softplus(−zS)/∂S = −z σ(−zS)
        (coef,) = row
        sign = torch.where(pos, -1.0, 1.0)  # −z
        return s.mul_(sign).sigmoid_().mul_(sign).mul_(coef)
    if kind == "ntxent":
        lse, q_sum, coef = row[0][r0:r1], row[1][r0:r1], row[2]
        z = s.sub_(lse.unsqueeze(-1))
        # the positives' terms: −q; the negatives' log-sum-exp carries Σ_P q, spread by softmax
        q = _ntxent_q_(torch.sigmoid(z), pos)
        soft = _exp_(z, 0.0).masked_fill_(neg.logical_not(), 0.0)
        return soft.mul_(q_sum.unsqueeze(-1)).sub_(q).mul_(coef)
    if kind == "supcon":
        lse, n_pos, coef = (v[r0:r1] for v in row)
        d = coef  # ∂L/∂ℓ_i
        # ∂ℓ_i/∂S_ij = −pos_ij / |P(i)| + [|P(i)| > 0] · softmax over the candidates
        w_pos = (-d / n_pos.clamp_min(1.0)).unsqueeze(-1)
        w_soft = torch.where(n_pos > 0, d, torch.zeros_like(d)).unsqueeze(-1)
        soft = _exp_(s, lse.unsqueeze(-1)).masked_fill_((pos | neg).logical_not(), 0.0)
        return soft.mul_(w_soft).add_(torch.where(pos, w_pos, 0.0))
    (row_lse, row_pos, row_coef), (col_lse, col_pos, col_coef) = row, col
    cr, cc = row_coef[r0:r1].unsqueeze(-1), col_coef.unsqueeze(0)
    ds = _exp_(s - row_lse[r0:r1].unsqueeze(-1), 0.0).mul_(cr)
    ds = ds.add_(_exp_(s, col_lse.unsqueeze(0)).mul_(cc))  # s is free after this
    w_pos = s.copy_(cr / row_pos[r0:r1].clamp_min(1.0).unsqueeze(-1) + cc / col_pos.clamp_min(1.0))
    return ds.sub_(w_pos.masked_fill_(pos.logical_not(), 0.0))


def block_backward(
    kind, x, y, rows, cols, scale, bias, chunk, row, col, needs, *, diag, exclude, into=None
):
    """One block's gradient sums for a unit cotangent, before the scale: ``(∂S y, ∂Sᵀ x,
    Σ ∂S ⊙ x yᵀ, Σ ∂S)``, each ``None`` unless ``needs = (rows, cols, scale, bias)`` asks.
    ``into``: a buffer that the rows' *and* the columns' parts are added to (self mode with one
    block: ``x`` is both sides), returned in place of both."""
    need_rows, need_cols, need_scale, need_bias = needs
    m = y.shape[-2]
    row_parts, gy, x_dot, sum_ds = [], into, None, None
    for r0, r1 in _tiles(x.shape[-2], chunk):
        s = _logits(x, y, r0, r1, scale, bias)
        pos, neg = _masks(rows, cols, r0, r1, m, x.device, diag, exclude)
        ds = _tile_ds_(kind, s, pos, neg, r0, r1, row, col)
        del s, pos, neg
        if need_bias:
            part = ds.sum()
            sum_ds = part if sum_ds is None else sum_ds + part
        if need_cols:  # ∂Sᵀ x
            part = matmul(ds.transpose(-1, -2), x[r0:r1])
            gy = part if gy is None else gy + part
        if need_rows or need_scale:  # ∂S y
            part = matmul(ds, y)
            if need_scale:  # Σ ∂S ⊙ x yᵀ = Σ_i x_i · (∂S y)_i
                dot = (x[r0:r1] * part).sum()
                x_dot = dot if x_dot is None else x_dot + dot
            if need_rows and into is not None:
                assert gy is not None  # into, or into plus the columns' parts
                gy[r0:r1] += part
            elif need_rows:
                row_parts.append(part)
    # what was asked for also without a tile (an empty rank's rows, on the ring): zeros
    gx = torch.cat(row_parts, dim=-2) if row_parts else None
    if gx is None and need_rows and into is None:
        gx = torch.zeros_like(x)
    if gy is None and need_cols:
        gy = torch.zeros_like(y)
    if x_dot is None and need_scale:
        x_dot = x.new_zeros(())
    if sum_ds is None and need_bias:
        sum_ds = x.new_zeros(())
    return gx, gy, x_dot, sum_ds


class _TiledGrads(torch.autograd.Function):
    """The one-block backward as a Function of its own: its forward walks the tiles,
    recomputes each and accumulates the requested gradients ``[∂x][∂y][∂scale][∂bias]``
    (``needs``); its backward raises. As a Function, the first-order backward records no graph
    under ``create_graph=True`` or ``torch.func.grad``, so memory stays bounded, and a second
    differentiation fails loudly instead of silently missing terms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, rows, cols, scale, bias, s0, s1, s2, s3, s4, s5, g, chunk, kind, needs):
        # s0..s5: the forward's statistics, padded with None (one argument each: transforms
        # see every tensor)
        stats = tuple(v for v in (s0, s1, s2, s3, s4, s5) if v is not None)
        row, col = stats[: ROW_STATS[kind]], stats[ROW_STATS[kind] :]
        need_x, need_y, need_scale, need_bias = needs
        self_mode = y is None
        yy = x if self_mode else y
        into = torch.zeros_like(x) if self_mode and need_x else None
        gx, gy, x_dot, sum_ds = block_backward(
            kind, x, yy, rows, rows if cols is None else cols, scale, bias, chunk, row, col,
            (need_x, need_y or into is not None, need_scale, need_bias),
            diag=True, exclude=self_mode, into=into,
        )  # fmt: skip
        # The cotangent g multiplies the results, not the tiles: under vmap of a vjp g is batched
        # while the tiles are not, and the tiles are updated in place.
        out = []
        if need_x:
            out.append((gy if self_mode else gx) * (scale * g))
        if need_y:
            out.append(gy * (scale * g))
        if need_scale:
            out.append(x_dot * g)
        if need_bias:
            out.append(sum_ds * g)
        return tuple(fresh(t) for t in out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "the tiled (chunk_size=...) contrastive gradient is not differentiable (double "
            "backward, torch.func.hessian); use the dense loss (chunk_size=None)"
        )


class _TiledLoss(torch.autograd.Function):
    """The loss over tiles of one block. Inputs ``(x, y, rows, cols, scale, bias, chunk, kind,
    reducer)``; outputs ``(loss, *statistics)``, the statistics non-differentiable and saved."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, rows, cols, scale, bias, chunk, kind, reducer):
        self_mode = y is None
        yy, cc = x if self_mode else y, rows if cols is None else cols
        st = block_forward(kind, x, yy, rows, cc, scale, bias, chunk, diag=True, exclude=self_mode)
        loss, stats = reduce(kind, st, reducer, counts(kind, st, x.shape[-2]))
        return (loss, *stats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, rows, cols, scale, bias, chunk, kind, _ = inputs
        stats = output[1:]
        ctx.mark_non_differentiable(*stats)
        ctx.chunk, ctx.kind, ctx.n_stats = chunk, kind, len(stats)
        ctx.scale_float = None if isinstance(scale, Tensor) else scale
        saved = (x, y, rows, cols, scale if isinstance(scale, Tensor) else None, bias, *stats)
        ctx.save_for_backward(*saved)

    @staticmethod
    def backward(ctx, g, *_):
        x, y, rows, cols, scale, bias, *stats = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 4, 5))
        if not any(needs):
            return (None,) * 9
        scale = ctx.scale_float if scale is None else scale
        padded = (*stats, *(None,) * (6 - len(stats)))
        grads = iter(
            apply(
                _TiledGrads, x, y, rows, cols, scale, bias, *padded, g, ctx.chunk, ctx.kind, needs
            )
        )
        out = [next(grads) if need else None for need in needs]
        return out[0], out[1], None, None, out[2], out[3], None, None, None


def tiled_loss(
    x: Tensor,
    y: Tensor | None,
    rows: Tensor | None,
    cols: Tensor | None,
    *,
    scale: float | Tensor,
    bias: Tensor | None,
    chunk: int,
    kind: str,
    reducer: str,
) -> Tensor:
    """The loss of ``kind`` over ``S = scale · x yᵀ + bias`` in tiles of ``chunk`` rows.

    ``x``, ``y``: ``(N, D)``, ``(M, D)`` rows in the compute dtype, already normalised where the
    loss normalises (``y=None``: self mode, the diagonal excluded). ``rows``/``cols``: the labels
    of ``x``'s and ``y``'s rows (``cols=None``: ``rows`` label both, as in self mode), or both
    ``None`` for two aligned sets (row ``i`` pairs with column ``i``). ``scale``: a number or a 0-d tensor (its gradient
    is returned); ``bias``: ``None`` or a 0-d tensor. ``reducer`` one of ``KINDS[kind]``.
    """
    return apply(_TiledLoss, x, y, rows, cols, scale, bias, chunk, kind, reducer)[0]


@dataclass(frozen=True)
class EngineCall:
    """A loss call as the engine runs it: ``x``/``y`` normalised in the compute dtype (``y=None``:
    self mode), their labels ``rows``/``cols`` (``None``: aligned sets), the logit ``scale`` and
    ``bias``, ``chunk`` rows a tile (``None``: the dense loss; the engine then takes all rows at
    once), the engine's reducer name, and ``finish`` (the embedding regularizer's addition, or
    ``None``)."""

    kind: str
    x: Tensor
    y: Tensor | None
    rows: Tensor | None
    cols: Tensor | None
    scale: float | Tensor
    bias: Tensor | None
    chunk: int | None
    reducer: str
    finish: Callable[[Tensor], Tensor] | None = None


def run_local(call: EngineCall) -> Tensor:
    """The loss of ``call`` in this process (:func:`tiled_loss`)."""
    loss = tiled_loss(
        call.x, call.y, call.rows, call.cols, scale=call.scale, bias=call.bias,
        chunk=call.chunk or call.x.shape[-2], kind=call.kind, reducer=call.reducer,
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
        x = F.normalize(x, p=2, dim=-1)
        y = None if y is None else F.normalize(y, p=2, dim=-1)
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

    return EngineCall(kind, x, y, labels, ref_labels, 1.0 / t, None, chunk, reducer, finish)


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
