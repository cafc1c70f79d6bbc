"""Bounded-memory NT-Xent and SupCon: a plain ``loss.backward()`` in O(chunk × M) memory.

:func:`ntxent_streaming` and :func:`supcon_streaming` return what :func:`pmlfunc.losses.ntxent`
and :func:`pmlfunc.losses.supcon` return (value and gradients, to rounding) for label-defined
pairs and a matmul similarity (``cosine()`` or ``dot()``), without ever building the ``(B, M)``
similarity matrix. Each loss is one :class:`torch.autograd.Function`:

* the forward loops over static row chunks of the anchors, builds the ``(chunk, M)`` tile
  ``z = x[rows] @ yᵀ / τ`` and its label masks, and keeps only per-row statistics (the log-sum-exp
  over the row's negatives for NT-Xent; over its candidates for SupCon, with the positive count)
  and the scalar result;
* the backward loops over the chunks again, recomputes each tile, forms ``∂L/∂z`` for it and
  accumulates ``∂L/∂x[rows] = ∂L/∂S @ y`` and ``∂L/∂y += ∂L/∂Sᵀ @ x[rows]`` (both into one tensor
  in self mode), plus ``∂L/∂τ = −Σ ∂L/∂z · z / τ``.

The row normalisation of ``cosine()`` and the float32 cast of float16/bfloat16 inputs happen
outside the Function with ordinary autograd ops on ``(B, D)`` tensors. Rows are whole in every
tile, so each row's log-sum-exp is computed exactly as the dense loss computes it (no online
rescaling). Peak memory: a few ``chunk × M`` tiles plus the ``(B, D)`` / ``(M, D)`` inputs and
their gradients. Shapes are static and every global count is a tensor (no host sync), so the
functions run under ``torch.compile(fullgraph=True)``, ``torch.func`` transforms (the Functions
have ``generate_vmap_rule = True``) and on the meta device. The backward is itself a Function
(:class:`_TileGrads`): ``create_graph=True`` and ``torch.func.grad`` record no graph of the tiles,
and differentiating the gradient again (double backward, ``torch.func.hessian``) raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Unpack

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._inputs import validate
from .._ops import ratio, row_logsumexp, row_softmax
from ..distances import cosine, resolve
from ..reducers import Reducer
from ._batch import BatchInputs, check_shared, regularized

__all__ = ["ntxent_streaming", "supcon_streaming"]


# ---------------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------------


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _tile(x: Tensor, y: Tensor, start: int, stop: int, t: float | Tensor) -> Tensor:
    """``z = (x[rows] @ yᵀ) / τ``, the ``(chunk, M)`` tile (``/`` as the dense loss divides)."""
    return torch.mm(x[start:stop], y.transpose(-1, -2)) / t


def _tile_masks(
    labels: Tensor, ref_labels: Tensor | None, start: int, stop: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """0/1 positive and negative masks of the tile (self mode: ``ref_labels is None``, the
    diagonal is neither)."""
    ref = labels if ref_labels is None else ref_labels
    eq = (labels[start:stop].unsqueeze(-1) == ref.unsqueeze(-2)).to(dtype)
    neg = 1.0 - eq
    if ref_labels is None:
        rows = torch.arange(start, stop, device=labels.device)
        cols = torch.arange(ref.shape[-1], device=labels.device)
        eq = eq - (rows.unsqueeze(-1) == cols.unsqueeze(-2)).to(dtype)  # eq is 1 on the diagonal
    return eq, neg


def _tile_dz(kind, z, pos, neg, start, stop, g, s0, s1, s2):
    """``∂L/∂z`` for one tile, from the cotangent ``g`` and the forward's per-row statistics:
    NT-Xent ``(neg_lse, #positive pairs, _)``; SupCon ``(candidate lse, |P(a)|, ∂loss/∂ℓ_a)``."""
    if kind == "supcon":
        lse, n_pos, coef = s0[..., start:stop], s1[..., start:stop], s2[..., start:stop]
        d = coef * g  # ∂L/∂ℓ_a
        # ∂ℓ_a/∂z_aj = −pos_aj / max(|P(a)|, 1) + [|P(a)| > 0] · softmax over the candidates
        w_pos = (-d / n_pos.clamp_min(1.0)).unsqueeze(-1)
        w_soft = torch.where(n_pos > 0, d, torch.zeros_like(d)).unsqueeze(-1)
        return pos * w_pos + row_softmax(z, pos + neg, lse) * w_soft
    lse = s0[..., start:stop]
    coef = ratio(g, s1) if kind == "ntxent_mean" else g
    r = torch.sigmoid(z - lse.unsqueeze(-1))
    # d/dx −log(σ(x) + ε) = −σ(x)(1 − σ(x)) / (σ(x) + ε): the dense loss's autograd chain
    direct = (r * (1.0 - r)).div_(r + torch.finfo(z.dtype).tiny).mul_(pos) * -coef
    # the negatives' log-sum-exp carries −Σ_p direct_ap, spread by the negatives' softmax
    return direct - direct.sum(-1, keepdim=True) * row_softmax(z, neg, lse)


class _TileGrads(torch.autograd.Function):
    """The streaming backward as a Function of its own: its forward loops over the chunks,
    recomputes each tile and accumulates the requested gradients ``[∂x][∂y][∂τ]`` (``needs``);
    its backward raises (double backward is not supported). As a Function, the first-order
    backward records no graph under ``create_graph=True`` or ``torch.func.grad`` (whose
    backward runs with grad mode on), so memory stays bounded, and a second differentiation
    fails loudly instead of silently missing terms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, labels, ref_labels, t, s0, s1, s2, g, chunk, kind, needs):
        need_x, need_y, need_t = needs
        self_mode = y is None
        yy = x if self_mode else y
        need_gy = need_y or (self_mode and need_x)
        gx_parts, gy, zdz = [], None, None
        for start, stop in _chunks(x.shape[-2], chunk):
            z = _tile(x, yy, start, stop, t)
            pos, neg = _tile_masks(labels, ref_labels, start, stop, z.dtype)
            dz = _tile_dz(kind, z, pos, neg, start, stop, g, s0, s1, s2)
            if need_t:
                part = (dz * z).sum()
                zdz = part if zdz is None else zdz + part
            ds = dz / t
            if need_x:
                gx_parts.append(torch.mm(ds, yy))
            if need_gy:
                part = torch.mm(ds.transpose(-1, -2), x[start:stop])
                gy = part if gy is None else gy + part
        out = []
        if need_x:
            grad_x = torch.cat(gx_parts, dim=-2)
            out.append(grad_x + gy if self_mode else grad_x)  # self mode: x is both sides
        if need_y:
            out.append(gy)
        if need_t:
            out.append(-zdz / t)  # z = s / τ: ∂z/∂τ = −z / τ
        return tuple(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "the streaming (chunk_size=...) NT-Xent/SupCon gradient is not differentiable "
            "(double backward, torch.func.hessian); use the dense loss (chunk_size=None)"
        )


def _setup(ctx, inputs, stats):
    """Save ``(x, y, labels, ref_labels, t)`` and the per-row statistics."""
    x, y, labels, ref_labels, t, chunk, _ = inputs
    ctx.mark_non_differentiable(*stats)
    ctx.chunk = chunk
    is_tensor = isinstance(t, Tensor)
    ctx.t_float = None if is_tensor else t
    ctx.save_for_backward(x, y, labels, ref_labels, t if is_tensor else None, *stats)


def _backward(ctx, kind, g):
    """The gradients of the loss Functions' seven inputs, by :class:`_TileGrads`."""
    x, y, labels, ref_labels, t, *stats = ctx.saved_tensors
    stats += [None] * (3 - len(stats))
    need_x, need_y, need_t = (ctx.needs_input_grad[i] for i in (0, 1, 4))
    if not (need_x or need_y or need_t):
        return (None,) * 7
    grads = iter(
        _TileGrads.apply(
            x,
            y,
            labels,
            ref_labels,
            ctx.t_float if t is None else t,
            *stats,
            g,
            ctx.chunk,
            kind,
            (need_x, need_y, need_t),
        )
    )
    grad_x = next(grads) if need_x else None
    grad_y = next(grads) if need_y else None
    grad_t = next(grads) if need_t else None
    return grad_x, grad_y, None, None, grad_t, None, None


# ---------------------------------------------------------------------------------------------
# NT-Xent
# ---------------------------------------------------------------------------------------------


class _NTXentStreaming(torch.autograd.Function):
    """NT-Xent over row chunks. Inputs ``(x, y, labels, ref_labels, t, chunk, use_mean)``
    (``y = ref_labels = None`` in self mode); outputs ``(loss, neg_lse, count)``, the last two
    saved for the backward (non-differentiable)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, labels, ref_labels, t, chunk, use_mean):
        yy = x if y is None else y
        tiny = torch.finfo(x.dtype).tiny
        lses, total, count = [], None, None
        for start, stop in _chunks(x.shape[-2], chunk):
            z = _tile(x, yy, start, stop, t)
            pos, neg = _tile_masks(labels, ref_labels, start, stop, z.dtype)
            lse = row_logsumexp(z, neg)
            # PML's term, literally: -log(e^z / (e^z + Σ_n e^{z_n}) + ε) with the ratio a sigmoid.
            losses = -torch.log(torch.sigmoid(z - lse.unsqueeze(-1)) + tiny)
            part, n = (pos * losses).sum(), pos.sum()
            total = part if total is None else total + part
            count = n if count is None else count + n
            lses.append(lse)
        loss = ratio(total, count) if use_mean else total
        return loss, torch.cat(lses, dim=-1), count

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup(ctx, inputs, output[1:])
        ctx.kind = "ntxent_mean" if inputs[-1] else "ntxent_sum"

    @staticmethod
    def backward(ctx, g, _g_lse, _g_count):
        return _backward(ctx, ctx.kind, g)


# ---------------------------------------------------------------------------------------------
# SupCon
# ---------------------------------------------------------------------------------------------


class _SupConStreaming(torch.autograd.Function):
    """SupCon over row chunks. Inputs ``(x, y, labels, ref_labels, t, chunk, reducer)`` with
    ``reducer`` in ``"avg_nonzero"``, ``"mean"``, ``"sum"``; outputs ``(loss, lse, n_pos, coef)``:
    the candidates' log-sum-exp, the positive counts and ``∂loss/∂ℓ_a`` per anchor (saved for the
    backward, non-differentiable)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y, labels, ref_labels, t, chunk, reducer):
        yy = x if y is None else y
        lses, n_pos, pos_z, n_neg = [], [], [], None
        for start, stop in _chunks(x.shape[-2], chunk):
            z = _tile(x, yy, start, stop, t)
            pos, neg = _tile_masks(labels, ref_labels, start, stop, z.dtype)
            lses.append(row_logsumexp(z, pos + neg))
            n_pos.append(pos.sum(-1))
            pos_z.append((pos * z).sum(-1))
            part = neg.sum()
            n_neg = part if n_neg is None else n_neg + part
        lse, n_pos, pos_z = (torch.cat(v, dim=-1) for v in (lses, n_pos, pos_z))
        has_pos = n_pos > 0
        mean_log_prob = pos_z / n_pos.clamp_min(1.0) - torch.where(has_pos, lse, 0.0)
        active = (n_pos.sum() > 0) & (n_neg > 0)
        losses = torch.where(active, -mean_log_prob, torch.zeros_like(mean_log_prob))
        if reducer == "avg_nonzero":  # the reducers' window: loss > 0, by sign
            sel = losses.sign().clamp_min(0.0)
            count = sel.sum()
            loss = ratio(sel @ losses, count)
            coef = ratio(sel, count.expand_as(sel))
        elif reducer == "mean":
            loss = losses.sum() / losses.shape[-1]
            coef = torch.ones_like(losses) / losses.shape[-1]
        else:
            loss = losses.sum()
            coef = torch.ones_like(losses)
        coef = torch.where(active, coef, torch.zeros_like(coef))
        return loss, lse, n_pos, coef

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup(ctx, inputs, output[1:])

    @staticmethod
    def backward(ctx, g, _g_lse, _g_n_pos, _g_coef):
        return _backward(ctx, "supcon", g)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def _tile_inputs(
    loss: str,
    embeddings: Tensor,
    labels: Tensor | None,
    temperature: float | Tensor,
    chunk_size: object,
    inputs: Mapping,
    reducers: tuple[str, ...],
):
    """Validate a tiled call (shapes, dtypes, devices only) and return the Function's inputs
    ``(x, y, t, chunk, reducer)``: the rows in the compute dtype, normalised for ``cosine()``."""
    check_shared(loss, inputs)
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    chunk_size = _checks.chunk_size(chunk_size)
    for name in ("indices_tuple", "mat"):
        if inputs.get(name) is not None:
            raise ValueError(
                f"the tiled {loss} (chunk_size=...) builds its pairs from labels, tile by tile: "
                f"{name} is not supported"
            )
    if labels is None:
        raise ValueError(f"the tiled {loss} (chunk_size=...) needs labels, got None")
    ref_emb, ref_labels = inputs.get("ref_emb"), inputs.get("ref_labels")
    validate(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    distance = resolve(inputs.get("distance"), cosine())
    if distance.kind != "dot":
        raise ValueError(
            f"the tiled {loss} (chunk_size=...) needs a similarity computed by a matmul "
            f"(distance=cosine() or dot()); got distance={distance!r}"
        )
    reducer = inputs.get("reducer")
    if reducer is not None and not isinstance(reducer, Reducer):
        raise TypeError(
            "reducer must be a pmlfunc reducer (pmlfunc.reducers.mean(), ...), got "
            f"{type(reducer).__name__}"
        )
    kind = reducers[0] if reducer is None else repr(reducer)[:-2]
    if reducer is not None and (not repr(reducer).endswith("()") or kind not in reducers):
        supported = ", ".join(f"{k}()" for k in reducers)
        raise ValueError(
            f"the tiled {loss} (chunk_size=...) supports reducer {supported}; got "
            f"reducer={reducer!r}"
        )
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
    return x, y, t, chunk_size, kind


def ntxent_streaming(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.07,
    chunk_size: int,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""NT-Xent in O(chunk_size × M) memory, forward and backward: what
    ``pf.losses.ntxent(..., chunk_size=k)`` runs.

    The same loss as :func:`pmlfunc.losses.ntxent` (one term per positive pair against the
    log-sum-exp of the anchor's negatives, averaged over positive pairs), computed over static
    chunks of ``chunk_size`` anchor rows: the forward keeps one log-sum-exp per row, the backward
    recomputes each ``(chunk_size, M)`` similarity tile.

    Args:
        embeddings, labels, temperature: as in :func:`pmlfunc.losses.ntxent`.
        chunk_size: anchor rows per tile, a Python int ``>= 1`` (need not divide the batch).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``indices_tuple``
            and ``mat``; ``distance`` ``cosine()`` (default) or ``dot()``; ``reducer``
            ``mean()`` (default) or ``sum()``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = ntxent_streaming(emb, labels, temperature=0.1, chunk_size=3)
    """
    x, y, t, chunk, kind = _tile_inputs(
        "ntxent", embeddings, labels, temperature, chunk_size, inputs, ("mean", "sum")
    )
    ref_labels = inputs.get("ref_labels")
    loss = _NTXentStreaming.apply(x, y, labels, ref_labels, t, chunk, kind == "mean")[0]
    return regularized(loss.to(embeddings.dtype), embeddings, inputs)


def supcon_streaming(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    chunk_size: int,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Supervised contrastive loss in O(chunk_size × M) memory, forward and backward: what
    ``pf.losses.supcon(..., chunk_size=k)`` runs.

    The same loss as :func:`pmlfunc.losses.supcon` (per anchor, minus the mean over its
    positives of ``z_ap − log Σ_{k ∈ A(a)} e^{z_ak}``; 0 for anchors without positives and for
    batches without a positive or a negative pair), computed over static chunks of
    ``chunk_size`` anchor rows: the forward keeps per-row log-sum-exps, positive counts and
    ``Σ_p z_ap``, the backward recomputes each ``(chunk_size, M)`` similarity tile.

    Args:
        embeddings, labels, temperature: as in :func:`pmlfunc.losses.supcon`.
        chunk_size: anchor rows per tile, a Python int ``>= 1`` (need not divide the batch).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``indices_tuple``
            and ``mat``; ``distance`` ``cosine()`` (default) or ``dot()``; ``reducer``
            ``avg_nonzero()`` (default), ``mean()`` or ``sum()``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = supcon_streaming(emb, labels, chunk_size=3)

    Reference: Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020.
    """
    x, y, t, chunk, kind = _tile_inputs(
        "supcon",
        embeddings,
        labels,
        temperature,
        chunk_size,
        inputs,
        ("avg_nonzero", "mean", "sum"),
    )
    ref_labels = inputs.get("ref_labels")
    loss = _SupConStreaming.apply(x, y, labels, ref_labels, t, chunk, kind)[0]
    return regularized(loss.to(embeddings.dtype), embeddings, inputs)
