r"""The tiled engine: the softmax and sigmoid contrastive losses in ``O(tile)`` memory, both passes.

Every loss of this family reads only per-row (and, for CLIP, per-column) statistics of the logit
matrix ``S = scale · x yᵀ + bias`` over the ``N × M`` grid of query rows ``x`` and reference rows
``y`` (``y = x`` in self mode, whose diagonal never counts):

| kind | a term | statistics kept by the forward |
|---|---|---|
| ``"ntxent"`` | positive pair ``(i, j)``: ``−log(σ(S_ij − lse_{N(i)} S_i) + ε)`` | ``lse`` over each row's negatives |
| ``"supcon"`` | row ``i``: ``lse_{C(i)} S_i − mean_{P(i)} S_ij`` (``C = P ∪ N``) | ``lse`` over candidates, ``|P(i)|``, ``∂L/∂ℓ_i`` |
| ``"clip"`` | row ``i`` and column ``j``: ``lse S_i − mean_{P(i)} S_ij``, likewise down columns | row and column ``lse``, ``|P|`` of both |
| ``"siglip"`` | pair ``(i, j)``: ``softplus(−z_ij S_ij)``, ``z = ±1`` for positives/negatives | none |

The forward walks static tiles of ``chunk`` rows: it builds the ``chunk × M`` tile, folds it into
the statistics (columns by an online log-sum-exp across tiles) and drops it. The backward (a
Function of its own, :class:`_TiledGrads`) walks the tiles again, recomputes each one, forms
``∂L/∂S`` from the statistics and accumulates ``∂L/∂x = scale·∂S y``, ``∂L/∂y += scale·∂Sᵀ x``,
``∂L/∂scale = Σ ∂S ⊙ x yᵀ`` and ``∂L/∂bias = Σ ∂S``. Peak memory: the inputs, their gradients and a
few tiles (masks are boolean), whatever ``N`` is. Shapes are static and every count is a tensor, so
the path runs under ``torch.compile(fullgraph=True)``, ``torch.func`` and on the meta device;
the backward records no graph, and differentiating it again raises.

The public losses (:func:`pmlfunc.losses.ntxent`, :func:`pmlfunc.losses.supcon`,
:func:`pmlfunc.losses.clip`, :func:`pmlfunc.losses.siglip`) call :func:`tiled_loss` when given
``chunk_size``; their dense paths compute the same numbers from the whole matrix.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._inputs import validate
from .._ops import fresh, matmul, ratio
from ..distances import cosine, resolve
from ..reducers import Reducer
from ._batch import check_shared, regularized

__all__ = ["KINDS", "tiled_loss", "tiled_reducer", "tiled_softmax"]

# kind -> the reducers it supports (the first is the default)
KINDS = {
    "ntxent": ("mean", "sum"),
    "supcon": ("avg_nonzero", "mean", "sum"),
    "clip": ("mean", "sum"),
    "siglip": ("batch", "mean", "sum"),
}


def tiled_reducer(kind: str, reducer: Reducer | None) -> str:
    """The engine's name for a loss's reducer (``None``: the kind's default), or the error that
    says which reducers the loss supports."""
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
        raise ValueError(f"{kind} supports reducer {supported} (or None); got reducer={name}")
    return name[:-2]


def _tiles(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _logits(x: Tensor, y: Tensor, r0: int, r1: int, scale, bias) -> Tensor:
    """``S = scale · x[r0:r1] yᵀ + bias``, one fresh ``(r1 − r0, M)`` tile updated in place."""
    s = matmul(x[r0:r1], y.transpose(-1, -2))
    if not (isinstance(scale, float) and scale == 1.0):
        s = s.mul_(scale)
    return s if bias is None else s.add_(bias)


def _masks(rows: Tensor | None, cols: Tensor | None, r0: int, r1: int, m: int, device, self_mode):
    """Boolean ``(pos, neg)`` of the tile. ``rows is None``: row ``i`` pairs with column ``i``
    (two aligned sets); else equal labels (``cols is None``: the columns carry ``rows``). Self
    mode: the diagonal is neither."""
    if rows is None:
        r = torch.arange(r0, r1, device=device)
        pos = r.unsqueeze(-1) == torch.arange(m, device=device).unsqueeze(-2)
    else:
        pos = rows[r0:r1].unsqueeze(-1) == (rows if cols is None else cols).unsqueeze(-2)
    neg = pos.logical_not()
    if self_mode:  # fresh masks: in place is safe
        pos.diagonal(offset=r0, dim1=-2, dim2=-1).fill_(False)
        neg.diagonal(offset=r0, dim1=-2, dim2=-1).fill_(False)
    return pos, neg


def _row_lse_(s: Tensor, keep: Tensor | None) -> Tensor:
    """Row-wise log-sum-exp over the kept entries (``None``: all), destroying ``s``: rows with
    nothing kept give ``−finfo.max``, NaN propagates (as :func:`pmlfunc._ops.row_logsumexp`)."""
    low = -torch.finfo(s.dtype).max
    if keep is not None:
        s = s.masked_fill_(keep.logical_not(), low)
    shift = s.amax(-1, keepdim=True)
    has = ~(shift <= low)
    shift = torch.where(has, shift, 0.0)
    # exp(max(x − shift, −80)): CPU exp of underflowing arguments is ~35× slower
    s = s.sub_(shift).clamp_min_(-80.0).exp_()
    if keep is not None:
        s = s.masked_fill_(keep.logical_not(), 0.0)
    total = s.sum(-1, keepdim=True)
    return torch.where(has, torch.log(torch.where(has, total, 1.0)) + shift, low).squeeze(-1)


def _exp_(s: Tensor, shift: Tensor) -> Tensor:
    """``exp(max(s − shift, −80))`` in place."""
    return s.sub_(shift).clamp_min_(-80.0).exp_()


def _forward(kind, x, y, rows, cols, scale, bias, chunk, self_mode) -> dict[str, Tensor]:
    """Walk the tiles once: the statistics of ``kind`` (per row, and per column for CLIP). Each
    tile is worked on in place: a few tile-sized buffers live at a time."""
    n, m = x.shape[-2], y.shape[-2]
    tiny = torch.finfo(x.dtype).tiny
    total = count = x.new_zeros(())
    row_lse, row_pos, row_pos_sum = [], [], []
    col_max = x.new_full((m,), -torch.finfo(x.dtype).max)
    col_sum = col_pos = col_pos_sum = x.new_zeros(m)
    for r0, r1 in _tiles(n, chunk):
        s = _logits(x, y, r0, r1, scale, bias)
        pos, neg = _masks(rows, cols, r0, r1, m, x.device, self_mode)
        if kind == "siglip":  # Σ softplus(−z·S), z = ±1
            t = s.mul_(torch.where(pos, -1.0, 1.0))
            total = total + F.softplus(t).sum()
            count = count + pos.sum() + neg.sum()
            continue
        if kind == "ntxent":  # −log(σ(S − lse_neg) + ε) on the positives
            lse = _row_lse_(s.clone(), neg)
            t = s.sub_(lse.unsqueeze(-1)).sigmoid_().add_(tiny).log_().neg_()
            total = total + t.masked_fill_(pos.logical_not(), 0.0).sum()
            count = count + pos.sum()
            row_lse.append(lse)
            continue
        if kind == "supcon":
            lse = _row_lse_(s.clone(), pos | neg)
            count = count + neg.sum()
        else:  # clip: every entry is a candidate, along rows and along columns (online)
            new_max = torch.maximum(col_max, s.amax(0))
            part = _exp_(s - new_max, 0.0).sum(0)
            col_sum = col_sum * (col_max - new_max).clamp_min(-80.0).exp() + part
            col_max = new_max
            lse = torch.logsumexp(s, -1)
            col_pos = col_pos + pos.sum(0)
        row_lse.append(lse)
        row_pos.append(pos.sum(-1).to(x.dtype))
        s = s.masked_fill_(pos.logical_not(), 0.0)  # the positives' logits
        row_pos_sum.append(s.sum(-1))
        if kind == "clip":
            col_pos_sum = col_pos_sum + s.sum(0)
    out = {"total": total, "count": count.to(x.dtype)}
    if kind != "siglip":
        out["row_lse"] = torch.cat(row_lse)
    if kind in ("supcon", "clip"):
        out.update(row_pos=torch.cat(row_pos), row_pos_sum=torch.cat(row_pos_sum))
    if kind == "clip":
        out.update(
            col_lse=torch.log(col_sum) + col_max,
            col_pos=col_pos.to(x.dtype),
            col_pos_sum=col_pos_sum,
        )
    return out


def _reduce(kind: str, st: dict[str, Tensor], reducer: str, n: int):
    """The loss and the statistics its backward needs, per kind."""
    one = st["total"].new_ones(())
    if kind == "siglip":
        coef = {"batch": one / n, "mean": ratio(one, st["count"]), "sum": one}[reducer]
        return st["total"] * coef, (coef,)
    if kind == "ntxent":
        coef = ratio(one, st["count"]) if reducer == "mean" else one
        return st["total"] * coef, (st["row_lse"], coef)
    if kind == "supcon":
        lse, n_pos, pos_sum = st["row_lse"], st["row_pos"], st["row_pos_sum"]
        mean_log_prob = pos_sum / n_pos.clamp_min(1.0) - torch.where(n_pos > 0, lse, 0.0)
        active = (n_pos.sum() > 0) & (st["count"] > 0)
        losses = torch.where(active, -mean_log_prob, torch.zeros_like(mean_log_prob))
        if reducer == "avg_nonzero":  # the reducers' window: loss > 0, by sign
            sel = losses.sign().clamp_min(0.0)
            coef = ratio(sel, sel.sum().expand_as(sel))
        elif reducer == "mean":
            coef = torch.ones_like(losses) / n
        else:
            coef = torch.ones_like(losses)
        coef = torch.where(active, coef, torch.zeros_like(coef))
        return matmul(coef, losses), (lse, n_pos, coef)
    # clip: (R(rows) + R(columns)) / 2 over the rows / columns that have a positive
    loss, coefs = None, []
    for side in ("row", "col"):
        lse, n_pos, pos_sum = st[f"{side}_lse"], st[f"{side}_pos"], st[f"{side}_pos_sum"]
        has = (n_pos > 0).to(lse.dtype)
        terms = (lse - pos_sum / n_pos.clamp_min(1.0)) * has
        coef = (ratio(has, has.sum().expand_as(has)) if reducer == "mean" else has) * 0.5
        loss = matmul(coef, terms) if loss is None else loss + matmul(coef, terms)
        coefs.append(coef)
    return loss, (st["row_lse"], st["row_pos"], coefs[0], st["col_lse"], st["col_pos"], coefs[1])


def _tile_ds_(kind, s, pos, neg, r0, r1, stats) -> Tensor:
    """``∂L/∂S`` of one tile (for a unit cotangent) from the forward's statistics, computed in
    ``s``'s buffer (destroyed) and at most one or two more."""
    if kind == "siglip":  # ∂ softplus(−zS)/∂S = −z σ(−zS)
        (coef,) = stats
        sign = torch.where(pos, -1.0, 1.0)  # −z
        return s.mul_(sign).sigmoid_().mul_(sign).mul_(coef)
    if kind == "ntxent":
        lse, coef = stats[0][r0:r1], stats[1]
        z = s.sub_(lse.unsqueeze(-1))
        # d/dx −log(σ(x) + ε) = −σ(x)(1 − σ(x)) / (σ(x) + ε): the dense loss's autograd chain
        r = torch.sigmoid(z)
        direct = r.add(torch.finfo(s.dtype).tiny).reciprocal_().mul_(r)
        direct = direct.addcmul_(direct, r, value=-1.0)
        del r
        direct = direct.masked_fill_(pos.logical_not(), 0.0).mul_(-coef)
        # the negatives' log-sum-exp carries −Σ_p direct_ap, spread by the negatives' softmax
        soft = _exp_(z, 0.0).masked_fill_(neg.logical_not(), 0.0)
        return direct.sub_(soft.mul_(direct.sum(-1, keepdim=True)))
    if kind == "supcon":
        lse, n_pos, coef = (v[r0:r1] for v in stats)
        d = coef  # ∂L/∂ℓ_i
        # ∂ℓ_i/∂S_ij = −pos_ij / |P(i)| + [|P(i)| > 0] · softmax over the candidates
        w_pos = (-d / n_pos.clamp_min(1.0)).unsqueeze(-1)
        w_soft = torch.where(n_pos > 0, d, torch.zeros_like(d)).unsqueeze(-1)
        soft = _exp_(s, lse.unsqueeze(-1)).masked_fill_((pos | neg).logical_not(), 0.0)
        return soft.mul_(w_soft).add_(torch.where(pos, w_pos, 0.0))
    row_lse, row_pos, row_coef, col_lse, col_pos, col_coef = stats
    cr, cc = row_coef[r0:r1].unsqueeze(-1), col_coef.unsqueeze(0)
    ds = _exp_(s - row_lse[r0:r1].unsqueeze(-1), 0.0).mul_(cr)
    ds = ds.add_(_exp_(s, col_lse.unsqueeze(0)).mul_(cc))  # s is free after this
    w_pos = s.copy_(cr / row_pos[r0:r1].clamp_min(1.0).unsqueeze(-1) + cc / col_pos.clamp_min(1.0))
    return ds.sub_(w_pos.masked_fill_(pos.logical_not(), 0.0))


class _TiledGrads(torch.autograd.Function):
    """The tiled backward as a Function of its own: its forward walks the tiles, recomputes each
    and accumulates the requested gradients ``[∂x][∂y][∂scale][∂bias]`` (``needs``); its backward
    raises. As a Function, the first-order backward records no graph under
    ``create_graph=True`` or ``torch.func.grad``, so memory stays bounded, and a second
    differentiation fails loudly instead of silently missing terms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, rows, cols, scale, bias, s0, s1, s2, s3, s4, s5, g, chunk, kind, needs):
        # s0..s5: the forward's statistics, padded with None (one argument each: transforms
        # see every tensor)
        stats = tuple(v for v in (s0, s1, s2, s3, s4, s5) if v is not None)
        need_x, need_y, need_scale, need_bias = needs
        self_mode = y is None
        yy = x if self_mode else y
        m = yy.shape[-2]
        need_rows = need_x or need_scale
        need_cols = need_y or (self_mode and need_x)
        row_parts, gy, x_dot, sum_ds = [], None, None, None
        for r0, r1 in _tiles(x.shape[-2], chunk):
            s = _logits(x, yy, r0, r1, scale, bias)
            pos, neg = _masks(rows, cols, r0, r1, m, x.device, self_mode)
            ds = _tile_ds_(kind, s, pos, neg, r0, r1, stats)  # for g = 1; g applied at the end
            del s, pos, neg
            if need_bias:
                part = ds.sum()
                sum_ds = part if sum_ds is None else sum_ds + part
            if need_cols:  # ∂L/∂y += (scale·∂S)ᵀ x
                part = matmul(ds.transpose(-1, -2), x[r0:r1])
                gy = part if gy is None else gy + part
            if need_rows:  # ∂S y, the rows' part before the scale
                part = matmul(ds, yy)
                if need_scale:  # ∂L/∂scale = Σ ∂S ⊙ x yᵀ = Σ_i x_i · (∂S y)_i
                    dot = (x[r0:r1] * part).sum()
                    x_dot = dot if x_dot is None else x_dot + dot
                if need_x and self_mode:  # x is both sides: one buffer for both parts
                    gy[r0:r1] += part
                elif need_x:
                    row_parts.append(part)
        # The cotangent g multiplies the results, not the tiles: under vmap of a vjp g is batched
        # while the tiles are not, and the tiles are updated in place.
        out = []
        if need_x:
            if not self_mode:
                gx, row_parts = torch.cat(row_parts, dim=-2), None
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
    """The loss over tiles. Inputs ``(x, y, rows, cols, scale, bias, chunk, kind, reducer)``;
    outputs ``(loss, *statistics)``, the statistics non-differentiable and saved."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, rows, cols, scale, bias, chunk, kind, reducer):
        self_mode = y is None
        st = _forward(kind, x, x if self_mode else y, rows, cols, scale, bias, chunk, self_mode)
        loss, stats = _reduce(kind, st, reducer, x.shape[-2])
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
            _TiledGrads.apply(x, y, rows, cols, scale, bias, *padded, g, ctx.chunk, ctx.kind, needs)
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
    of ``x``'s and ``y``'s rows (``cols=None`` in self mode), or both ``None`` for two aligned
    sets (row ``i`` pairs with column ``i``). ``scale``: a number or a 0-d tensor (its gradient
    is returned); ``bias``: ``None`` or a 0-d tensor. ``reducer`` one of ``KINDS[kind]``.
    """
    return _TiledLoss.apply(x, y, rows, cols, scale, bias, chunk, kind, reducer)[0]


def tiled_softmax(
    kind: str,
    embeddings: Tensor,
    labels: Tensor | None,
    temperature: float | Tensor,
    chunk_size: object,
    inputs: Mapping,
) -> Tensor:
    """``ntxent`` / ``supcon`` with ``chunk_size``: check the call (the tiled path builds its
    pairs from labels and its similarity by a matmul), then :func:`tiled_loss` with
    ``scale = 1/τ``; the embedding regularizer is added as on the dense path."""
    check_shared(kind, inputs)
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    chunk = _checks.chunk_size(chunk_size)
    for name in ("indices_tuple", "mat"):
        if inputs.get(name) is not None:
            raise ValueError(
                f"the tiled {kind} (chunk_size=...) builds its pairs from labels, tile by tile: "
                f"{name} is not supported"
            )
    if labels is None:
        raise ValueError(f"the tiled {kind} (chunk_size=...) needs labels, got None")
    ref_emb, ref_labels = inputs.get("ref_emb"), inputs.get("ref_labels")
    validate(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    distance = resolve(inputs.get("distance"), cosine())
    if distance.kind != "dot":
        raise ValueError(
            f"the tiled {kind} (chunk_size=...) needs a similarity computed by a matmul "
            f"(distance=cosine() or dot()); got distance={distance!r}"
        )
    reducer = tiled_reducer(kind, inputs.get("reducer"))
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
    loss = tiled_loss(
        x, y, labels, ref_labels, scale=1.0 / t, bias=None, chunk=chunk, kind=kind, reducer=reducer
    )
    return regularized(loss, embeddings, inputs)
