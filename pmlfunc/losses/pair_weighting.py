r"""Pair-weighting losses: each anchor's positive and negative pairs combined through
log-sum-exps, so that the hardest pairs weigh most.

| loss | per anchor ``a`` (or positive pair ``(a, p)``) |
|---|---|
| :func:`multi_similarity` | ``(1/α) log(1 + Σ_p e^{−α(s_ap − λ)}) + (1/β) log(1 + Σ_n e^{β(s_an − λ)})`` |
| :func:`circle` | ``softplus(log Σ_p e^{−γ α_p (s_ap − Δ_p)} + log Σ_n e^{γ α_n (s_an − Δ_n)})`` |
| :func:`lifted_structure` | per positive pair: ``½[log Σ_{negatives of a and p} e^{m − d} + d_ap]_+²`` |
| :func:`generalized_lifted_structure` | ``[log Σ_p e^{d_ap − m_pos} + log Σ_n e^{m_neg − d_an}]_+`` |
| :func:`tuplet_margin` | per positive pair: ``softplus(log Σ_n e^{σ s_an} − σ cos(θ_ap − β))`` |

PML's ``LiftedStructureLoss`` and ``TupletMarginLoss`` build a (positive pairs × negative pairs)
matrix and take a masked log-sum-exp along its rows. Here every such log-sum-exp runs over one row
of the ``B × M`` matrix instead: the negatives that a positive pair ``(a, p)`` sees are the
negative pairs of its anchor's row (and, for the lifted structure, of its positive's row), so
``log Σ_n e^{x_n}`` is one per-row log-sum-exp, combined per pair with ``logaddexp``. Memory is
``O(B·M)``, never ``O(P·N)``.
"""

from __future__ import annotations

import math
from typing import Unpack

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._ops import (
    indicator,
    logaddexp,
    masked_logsumexp,
    rshift,
    scalar_like,
    scatter_rows,
    shift,
)
from ..distances import cosine, lp
from ..reducers import DenseTerms, Terms, avg_nonzero, elements, mean
from ._batch import Batch, BatchInputs, batch_loss, spec

__all__ = [
    "circle",
    "generalized_lifted_structure",
    "lifted_structure",
    "multi_similarity",
    "tuplet_margin",
]

_COSINE = ("cosine() (PML asserts CosineSimilarity)", lambda d: d == cosine())


def multi_similarity(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    alpha: float | Tensor = 2.0,
    beta: float | Tensor = 50.0,
    base: float | Tensor = 0.5,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Multi-similarity loss.

    Per anchor ``a``, with similarity ``s`` (a distance enters as ``-d``):

    .. math::
        \ell_a = \frac{1}{\alpha}\log\Big(1 + \sum_{p} e^{-\alpha (s_{ap} - \lambda)}\Big)
               + \frac{1}{\beta}\log\Big(1 + \sum_{n} e^{\beta (s_{an} - \lambda)}\Big)

    with ``λ = base``; anchors without positives (negatives) get 0 for that part.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        alpha: weight of positive pairs (default ``2``).
        beta: weight of negative pairs (default ``50``).
        base: the similarity shift λ (default ``0.5``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``cosine()``; ``reducer``: default ``mean()`` over anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.multi_similarity(emb, labels)

    Reference: Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep Metric
    Learning", CVPR 2019.
    """
    return spec(multi_similarity)(embeddings, labels, inputs, alpha=alpha, beta=beta, base=base)


@batch_loss(multi_similarity, distance=cosine(), reducer=mean())
def _multi_similarity_terms(batch: Batch, *, alpha, beta, base) -> dict[str, Terms]:
    alpha = _checks.hyper(alpha, "alpha", positive=True)
    beta = _checks.hyper(beta, "beta", positive=True)
    base = _checks.hyper(base, "base")
    d, s = batch.mat, batch.distance.sign()
    alpha, beta, base = (scalar_like(v, d) for v in (alpha, beta, base))
    pos, neg = batch.binary_masks()  # PML's matrix-based losses count each listed pair once
    # PML's margin(mat, base) = s·(d − base): positives pay e^{α·s(d−base)}, negatives
    # e^{−β·s(d−base)}. The constant ∓·base leaves the log-sum-exp: one scaled matrix per part.
    pos_lse = masked_logsumexp(d * (alpha * s), pos) - alpha * s * base
    neg_lse = masked_logsumexp(d * (-beta * s), neg) + beta * s * base
    # log(1 + Σ e^x) = logaddexp(lse, 0); an empty row has lse = −finfo.max, which gives 0
    # (and second derivatives 0 there: twice)
    zero = pos_lse.new_zeros(())
    per_anchor = (
        logaddexp(pos_lse, zero, twice=True) / alpha + logaddexp(neg_lse, zero, twice=True) / beta
    )
    return {"loss": elements(per_anchor)}


def circle(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    m: float | Tensor = 0.4,
    gamma: float | Tensor = 80.0,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Circle loss (pair-wise labels).

    Per anchor ``a`` with cosine similarities ``s``, relaxation ``m`` and scale ``γ``:

    .. math::
        \ell_a = \mathrm{softplus}\Big(
            \log\!\sum_{p \in P(a)} e^{-γ\,α_p (s_{ap} - Δ_p)}
          + \log\!\sum_{n \in N(a)} e^{γ\,α_n (s_{an} - Δ_n)}\Big)

    with ``α_p = [1 + m − s_ap]_+``, ``α_n = [s_an + m]_+`` held constant in the gradient (PML
    and the paper's reference code detach them), ``Δ_p = 1 − m``, ``Δ_n = m``. Anchors without a
    positive or without a negative give ``0``. A pair listed several times counts once.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        m: relaxation factor (default ``0.4``).
        gamma: scale ``γ > 0`` (default ``80``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``: must
            be ``cosine()`` (the default), as PML asserts; ``reducer``: default
            ``avg_nonzero()`` over anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.circle(emb, labels, m=0.25, gamma=128.0)

    Reference: Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity Optimization",
    CVPR 2020.
    """
    return spec(circle)(embeddings, labels, inputs, m=m, gamma=gamma)


@batch_loss(circle, distance=cosine(), reducer=avg_nonzero(), distance_rule=_COSINE)
def _circle_terms(batch: Batch, *, m, gamma) -> dict[str, Terms]:
    m = _checks.hyper(m, "m")
    gamma = _checks.hyper(gamma, "gamma", positive=True)
    s = batch.mat
    m, gamma = scalar_like(m, s), scalar_like(gamma, s)
    pos, neg = batch.binary_masks()
    listed = batch.listed(pos)  # few positives (CPU): their term on their columns only
    s_p, w_p = (s, pos) if listed is None else (s.gather(-1, listed[0]), listed[1].to(s.dtype))
    alpha_p = F.relu(rshift(1.0 + m, s_p.detach()))  # op − s, op = 1 + m
    alpha_n = F.relu(s.detach() + m)  # s − on, on = −m
    logit_p = (-gamma * alpha_p) * (s_p - (1.0 - m))
    logit_n = (gamma * alpha_n) * (s - m)
    valid = (w_p.sum(-1) > 0) & (neg.sum(-1) > 0)
    z = masked_logsumexp(logit_p, w_p) + masked_logsumexp(logit_n, neg)
    losses = torch.where(valid, F.softplus(torch.where(valid, z, 0.0)), 0.0)
    return {"loss": elements(losses)}


def lifted_structure(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    neg_margin: float | Tensor = 1.0,
    pos_margin: float | Tensor = 0.0,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Lifted structured loss (PML's pair-based form).

    For each positive pair ``(a, p)``, with distance ``d`` (a similarity flips the sign of both
    margins, as PML's ``distance.margin``) and ``N(i)`` the negative pairs whose anchor is ``i``:

    .. math::
        \ell_{ap} = \tfrac12\Big[\log\!\!\sum_{(i, n):\, i \in \{a, p\},\, (i,n) \in N(i)}\!\!
                    e^{m_{neg} - d_{in}} \;+\; d_{ap} - m_{pos}\Big]_+^2

    The log-sum-exp is ``logaddexp(L_a, L_p)`` of two per-row log-sum-exps ``L_i`` (``L_a``
    alone when ``a = p``); PML's ``P × N`` matrix of pairs is never built. A pair without any
    negative gets ``0`` for its log-sum-exp (PML's ``logsumexp`` of an empty set), and the loss
    is ``0`` when the batch has no negative pair at all (as PML).

    With a separate reference set, the positive ``p`` is a reference row: its negatives are the
    negative pairs ``(k, p)`` of its column (query rows of another class). PML instead compares
    the reference index ``p`` with query anchor indices (two different index spaces: a bug);
    pmlfunc's choice reduces to PML's in self mode, where the label masks are symmetric.

    Not chunkable (:mod:`pmlfunc.chunked`): a pair needs its positive's row or column too.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        neg_margin: ``m_neg`` (default ``1``).
        pos_margin: ``m_pos`` (default ``0``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``lp()``; ``reducer``: default ``mean()`` over positive pairs.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.lifted_structure(emb, labels, neg_margin=1.0)

    Reference: Oh Song et al., "Deep Metric Learning via Lifted Structured Feature Embedding",
    CVPR 2016.
    """
    return spec(lifted_structure)(
        embeddings, labels, inputs, neg_margin=neg_margin, pos_margin=pos_margin
    )


@batch_loss(
    lifted_structure,
    distance=lp(),
    reducer=mean(),
    unchunkable="a positive pair needs the negatives of its positive's row (other anchors)",
)
def _lifted_terms(batch: Batch, *, neg_margin, pos_margin) -> dict[str, Terms]:
    neg_margin = _checks.hyper(neg_margin, "neg_margin")
    pos_margin = _checks.hyper(pos_margin, "pos_margin")
    d, s = batch.mat, batch.distance.sign()
    pos, neg = batch.masks  # counts: a repeated negative pair is a repeated column, as in PML
    x_neg = rshift(neg_margin, d) if s > 0 else shift(d, neg_margin)  # PML margin(m_neg, d)
    keep = batch.keep(neg)  # None for 0/1 masks
    row_lse = masked_logsumexp(x_neg, neg, keep)  # (B,), −finfo.max for rows without negatives
    row_has = neg.sum(-1) > 0
    if batch.ref_emb is None:  # the positive's negatives: its own row
        other_lse, other_has = row_lse, row_has
    else:  # a reference row's negatives: its column
        other_lse = masked_logsumexp(x_neg.t(), neg.t(), None if keep is None else keep.t())
        other_has = neg.sum(0) > 0
    # the terms on every (anchor, column) entry, or on each anchor's listed positive columns
    # (also under torch.compile: the per-pair logaddexp is a pass of its own)
    listed = batch.listed(pos, compiled=True)
    cols = None if listed is None else listed[0]

    def at_columns(x: Tensor) -> Tensor:  # a per-column value at each term's column
        return x.unsqueeze(-2) if cols is None else x[cols]

    d_pos = d if cols is None else d.gather(-1, cols)
    both = logaddexp(row_lse.unsqueeze(-1), at_columns(other_lse))
    if batch.ref_emb is None:  # (a, a): one row, counted once (PML's `|`)
        if cols is None:  # the diagonal, without a (B, M) mask (see _ops.indicator)
            both = torch.diagonal_scatter(both, row_lse)
        else:
            own = torch.arange(d.shape[0], device=d.device).unsqueeze(-1) == cols
            both = torch.where(own, row_lse.unsqueeze(-1), both)
    has = row_has.unsqueeze(-1) | at_columns(other_has)
    neg_part = torch.where(has, both, 0.0)
    pos_part = shift(d_pos, pos_margin) if s > 0 else rshift(pos_margin, d_pos)  # margin(d, m_pos)
    losses = F.relu(neg_part + pos_part).square() / 2
    _, has_neg = batch.any_pairs()
    losses = losses * has_neg.to(losses.dtype)  # PML: no negative pair at all gives 0
    # 0 off the positive pairs on either path (their weight is 0 anyway)
    losses = losses * indicator(pos) if listed is None else scatter_rows(losses, listed, d)
    return {"loss": DenseTerms(losses, pos, "pos_pair", batch.num_anchors)}


def generalized_lifted_structure(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    neg_margin: float | Tensor = 1.0,
    pos_margin: float | Tensor = 0.0,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Generalized lifted structure loss: one soft hardest-positive / hardest-negative term per anchor.

    Per anchor ``a`` with positives ``P(a)``, negatives ``N(a)`` and distance ``d`` (a similarity
    flips the sign of both margins):

    .. math::
        \ell_a = \Big[\log \sum_{p \in P(a)} e^{d_{ap} - m_{pos}}
                 + \log \sum_{n \in N(a)} e^{m_{neg} - d_{an}}\Big]_+

    where an empty sum contributes ``0`` (PML's ``logsumexp`` of an empty set). Every anchor is a
    term (anchors with neither positives nor negatives give ``0``). A pair listed several times
    in ``indices_tuple`` counts once (PML's matrix-based losses).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        neg_margin: ``m_neg`` (default ``1``).
        pos_margin: ``m_pos`` (default ``0``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``lp()``; ``reducer``: default ``mean()`` over anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.generalized_lifted_structure(emb, labels)

    Reference: Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", 2017 (section 2, "generalized lifted embedding").
    """
    return spec(generalized_lifted_structure)(
        embeddings, labels, inputs, neg_margin=neg_margin, pos_margin=pos_margin
    )


@batch_loss(generalized_lifted_structure, distance=lp(), reducer=mean())
def _generalized_lifted_terms(batch: Batch, *, neg_margin, pos_margin) -> dict[str, Terms]:
    neg_margin = _checks.hyper(neg_margin, "neg_margin")
    pos_margin = _checks.hyper(pos_margin, "pos_margin")
    d, s = batch.mat, batch.distance.sign()
    pos, neg = batch.binary_masks()
    # s·(d − m_pos) and s·(m_neg − d): the constant leaves the log-sum-exp
    sd = d if s > 0 else -d
    has_pos, has_neg = (pos.sum(-1) > 0).to(d.dtype), (neg.sum(-1) > 0).to(d.dtype)
    listed = batch.listed(pos)
    if listed is not None:  # few positives (CPU eager): only their columns
        idx, valid = listed
        pos_lse = _lse_or_zero(sd.gather(-1, idx), valid.to(d.dtype))
    else:
        pos_lse = _lse_or_zero(sd, pos)
    pos_lse = pos_lse - (s * scalar_like(pos_margin, d)) * has_pos
    neg_lse = _lse_or_zero(-sd, neg) + (s * scalar_like(neg_margin, d)) * has_neg
    return {"loss": elements(F.relu(pos_lse + neg_lse))}


def _lse_or_zero(x: Tensor, weights: Tensor) -> Tensor:
    """PML's ``lmu.logsumexp(..., add_one=False)``: the masked row log-sum-exp of 0/1
    ``weights``, ``0`` for rows with nothing kept (not ``−∞``)."""
    return torch.where(weights.sum(-1) > 0, masked_logsumexp(x, weights), 0.0)


def tuplet_margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    margin: float | Tensor = 5.73,
    scale: float | Tensor = 64.0,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Tuplet margin loss.

    For each positive pair ``(a, p)`` with angle ``θ_ap = arccos s_ap`` (cosine similarity),
    margin ``β`` (given in degrees) and scale ``σ``:

    .. math::
        \ell_{ap} = \log\Big(1 + \sum_{n \in N(a)} e^{σ (s_{an} - \cos(θ_{ap} - β))}\Big)
                  = \mathrm{softplus}\big(L_a - σ\cos(θ_{ap} - β)\big),
        \quad L_a = \log \sum_{n \in N(a)} e^{σ s_{an}}

    so one log-sum-exp per anchor replaces PML's positive-pair × negative-pair matrix. Repeated
    pairs of an ``indices_tuple`` count as often as they are listed (as PML).

    Where PML gives NaN: a cosine that rounds to ``|s| ≥ 1`` (duplicate embeddings). pmlfunc
    uses the clamped value (PML's value wherever PML is finite) and gives such entries a zero
    gradient (the cosine's own gradient is zero for aligned rows). ``cos(θ − β)`` is computed
    as ``s cos β + √(1 − s²) sin β``, without an ``arccos`` and a ``cos`` per entry.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        margin: ``β`` in degrees (default ``5.73``).
        scale: ``σ`` (default ``64``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``: must
            be ``cosine()`` (the default), as PML asserts; ``reducer``: default ``mean()`` over
            positive pairs.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.tuplet_margin(emb, labels, margin=5.73, scale=64.0)

    Reference: Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019.
    """
    return spec(tuplet_margin)(embeddings, labels, inputs, margin=margin, scale=scale)


@batch_loss(tuplet_margin, distance=cosine(), reducer=mean(), distance_rule=_COSINE)
def _tuplet_margin_terms(batch: Batch, *, margin, scale) -> dict[str, Terms]:
    margin = _checks.hyper(margin, "margin")
    scale = _checks.hyper(scale, "scale", positive=True)
    s = batch.mat
    beta = scalar_like(margin, s) * (math.pi / 180.0)  # np.radians
    scale = scalar_like(scale, s)
    pos, neg = batch.masks
    neg_lse = masked_logsumexp(scale * s, neg, batch.keep(neg)).unsqueeze(-1)  # −finfo.max: none
    # few positives (CPU, also compiled: the softplus is a pass of its own): their columns only
    listed = batch.listed(pos, compiled=True)
    s_pos = s if listed is None else s.gather(-1, listed[0])
    shifted = _cos_minus(s_pos, beta)
    # log(1 + e^x) exactly (F.softplus switches to x above its threshold)
    losses = logaddexp(neg_lse - scale * shifted, s.new_zeros(()), twice=True)
    # 0 off the positive pairs on either path (their weight is 0 anyway)
    losses = losses * indicator(pos) if listed is None else scatter_rows(losses, listed, s)
    return {"loss": DenseTerms(losses, pos, "pos_pair", batch.num_anchors)}


def _cos_minus(s: Tensor, beta: float | Tensor) -> Tensor:
    """``cos(arccos(clamp(s, −1, 1)) − β)`` as ``s·cos β + √(1 − s²)·sin β`` (the angle's sine
    is ``≥ 0`` on ``[0, π]``): no ``arccos`` and ``cos`` per entry (the whole ``B × M`` matrix
    on the static path). Where ``|s| ≥ 1`` it is ``±cos β`` with a zero (not infinite or NaN)
    gradient, as the clamped ``arccos`` with its gradient set to zero there; no bool mask
    (:func:`~pmlfunc._ops.indicator`)."""
    inside = indicator(1.0 - s.abs())  # |s| < 1
    # (1 − s)(1 + s): no cancellation in 1 − s² near |s| = 1; tiny: a finite √ slope at 0
    sine = ((1.0 - s) * (1.0 + s)).clamp_min(torch.finfo(s.dtype).tiny).sqrt()
    cos_b: float | Tensor
    sin_b: float | Tensor
    if isinstance(beta, Tensor):
        cos_b, sin_b = torch.cos(beta), torch.sin(beta)
    else:
        cos_b, sin_b = math.cos(beta), math.sin(beta)
    inner = s * cos_b + sine * sin_b
    return inner * inside + (1.0 - inside) * s.detach().sign() * cos_b
