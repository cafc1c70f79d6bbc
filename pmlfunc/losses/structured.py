r"""Structured pair losses: lifted structure, circle, tuplet margin, intra-pair variance, margin.

PML's ``LiftedStructureLoss`` and ``TupletMarginLoss`` build a (positive pairs × negative pairs)
matrix and take a masked log-sum-exp along its rows. Here every such log-sum-exp runs over one
row of the ``B × M`` matrix instead: the negatives that a positive pair ``(a, p)`` sees are the
negative pairs of its anchor's row (and, for the lifted structure, of its positive's row), so
``log Σ_n e^{x_n}`` is one per-row log-sum-exp, combined per pair with ``logaddexp``. Memory is
``O(B·M)``, never ``O(P·N)``. ``margin`` sums over all triplets without building them: a
triplet's loss is a positive-pair part plus a negative-pair part, so each pair enters weighted
by the number of triplets that contain it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .. import params as _params
from ..distances import _SNR, Distance, _Dot, cosine, lp, snr
from ..reducers import Bound, DenseTerms, Reducer, Terms, avg_nonzero, divisor, elements, mean
from ..tuples import MinedTriplets, TripletMask, TripletWindow, is_mined
from ._common import (
    Batch,
    LossSpec,
    default_reducer,
    finish,
    masked_logsumexp,
    prepare,
    register,
    regularize,
    rshift,
    run,
    scalar_like,
    shift,
)
from .pairs import _contrastive_terms

__all__ = [
    "circle",
    "generalized_lifted_structure",
    "intra_pair_variance",
    "lifted_structure",
    "margin",
    "margin_init",
    "signal_to_noise_ratio_contrastive",
    "tuplet_margin",
]


# ---------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------
def _lse_or_zero(x: Tensor, weights: Tensor, keep: Tensor | None = None) -> Tensor:
    """PML's ``lmu.logsumexp(..., add_one=False)``: the masked row log-sum-exp, ``0`` for rows
    with nothing kept (not ``−∞``)."""
    kept = weights if keep is None else keep
    has = kept.sum(-1) > 0
    return torch.where(has, masked_logsumexp(x, weights, keep), 0.0)


def _keep(batch: Batch, w: Tensor) -> Tensor | None:
    """The 0/1 indicator of ``w > 0`` when ``w`` holds pair counts (``None`` for 0/1 masks)."""
    return (w > 0).to(w.dtype) if batch.counts else None


def _require_cosine(distance: Distance | None, name: str, *, normalized: bool = True) -> None:
    """``distance`` must be ``cosine()``. ``normalized=False`` (inside the terms) also admits
    the un-normalising dot product that :mod:`pmlfunc.chunked` uses on rows it has normalised
    once; the public function checks the caller's distance itself."""
    if not isinstance(distance, Distance):  # None (the default), or validate's TypeError
        return
    if not (isinstance(distance, _Dot) and (distance.normalize or not normalized)):
        raise ValueError(
            f"{name} needs distance=cosine() (PML asserts CosineSimilarity), got {distance!r}"
        )


# ---------------------------------------------------------------------------------------------
# Lifted structure
# ---------------------------------------------------------------------------------------------
def lifted_structure(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    neg_margin: float | Tensor = 1.0,
    pos_margin: float | Tensor = 0.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
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
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        neg_margin: ``m_neg`` (default ``1``).
        pos_margin: ``m_pos`` (default ``0``).
        distance: default ``lp()``.
        reducer: default ``mean()`` over positive pairs.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.lifted_structure(emb, labels, neg_margin=1.0)

    Reference: Oh Song et al., "Deep Metric Learning via Lifted Structured Feature Embedding",
    CVPR 2016.
    """
    return run(
        LIFTED_STRUCTURE,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        neg_margin=neg_margin,
        pos_margin=pos_margin,
    )


def _lifted_terms(batch: Batch, *, neg_margin, pos_margin) -> dict[str, Terms]:
    neg_margin = _checks.hyper(neg_margin, "neg_margin")
    pos_margin = _checks.hyper(pos_margin, "pos_margin")
    d, s = batch.mat, batch.distance.sign()
    pos, neg = batch.masks  # counts: a repeated negative pair is a repeated column, as in PML
    x_neg = rshift(neg_margin, d) if s > 0 else shift(d, neg_margin)  # PML margin(m_neg, d)
    keep = (neg > 0).to(neg.dtype)
    row_lse = masked_logsumexp(x_neg, neg, keep)  # (B,), finfo.min for rows without negatives
    row_has = keep.sum(-1) > 0
    if batch.ref_emb is None:  # the positive's negatives: its own row
        other_lse, other_has = row_lse, row_has
    else:  # a reference row's negatives: its column
        other_lse = masked_logsumexp(x_neg.t(), neg.t(), keep.t())
        other_has = keep.sum(0) > 0
    both = torch.logaddexp(row_lse.unsqueeze(-1), other_lse.unsqueeze(-2))
    if batch.ref_emb is None:  # (a, a): one row, counted once (PML's `|`)
        eye = torch.eye(d.shape[0], d.shape[1], dtype=torch.bool, device=d.device)
        both = torch.where(eye, row_lse.unsqueeze(-1), both)
    has = row_has.unsqueeze(-1) | other_has.unsqueeze(-2)
    neg_part = torch.where(has, both, 0.0)
    pos_part = shift(d, pos_margin) if s > 0 else rshift(pos_margin, d)  # margin(d, m_pos)
    losses = F.relu(neg_part + pos_part).square() / 2
    _, has_neg = batch.any_pairs()
    losses = losses * has_neg.to(losses.dtype)  # PML: no negative pair at all gives 0
    return {"loss": DenseTerms(losses, pos, "pos_pair", batch.num_anchors)}


LIFTED_STRUCTURE = LossSpec(
    "lifted_structure",
    _lifted_terms,
    lp(),
    mean(),
    lambda **hyper: "a positive pair needs the negatives of its positive's row (other anchors)",
)
register(lifted_structure, LIFTED_STRUCTURE)


def generalized_lifted_structure(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    neg_margin: float | Tensor = 1.0,
    pos_margin: float | Tensor = 0.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
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
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        neg_margin: ``m_neg`` (default ``1``).
        pos_margin: ``m_pos`` (default ``0``).
        distance: default ``lp()``.
        reducer: default ``mean()`` over anchors.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.generalized_lifted_structure(emb, labels)

    Reference: Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", 2017 (section 2, "generalized lifted embedding").
    """
    return run(
        GENERALIZED_LIFTED_STRUCTURE,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        neg_margin=neg_margin,
        pos_margin=pos_margin,
    )


def _generalized_lifted_terms(batch: Batch, *, neg_margin, pos_margin) -> dict[str, Terms]:
    neg_margin = _checks.hyper(neg_margin, "neg_margin")
    pos_margin = _checks.hyper(pos_margin, "pos_margin")
    d, s = batch.mat, batch.distance.sign()
    pos, neg = batch.binary_masks()
    # s·(d − m_pos) and s·(m_neg − d): the constant leaves the log-sum-exp
    sd = d if s > 0 else -d
    has_pos, has_neg = (pos.sum(-1) > 0).to(d.dtype), (neg.sum(-1) > 0).to(d.dtype)
    pos_lse = _lse_or_zero(sd, pos) - (s * scalar_like(pos_margin, d)) * has_pos
    neg_lse = _lse_or_zero(-sd, neg) + (s * scalar_like(neg_margin, d)) * has_neg
    return {"loss": elements(F.relu(pos_lse + neg_lse))}


GENERALIZED_LIFTED_STRUCTURE = LossSpec(
    "generalized_lifted_structure", _generalized_lifted_terms, lp(), mean()
)
register(generalized_lifted_structure, GENERALIZED_LIFTED_STRUCTURE)


# ---------------------------------------------------------------------------------------------
# Circle
# ---------------------------------------------------------------------------------------------
def circle(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    m: float | Tensor = 0.4,
    gamma: float | Tensor = 80.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
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
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        m: relaxation factor (default ``0.4``).
        gamma: scale ``γ > 0`` (default ``80``).
        distance: must be ``cosine()`` (the default), as PML asserts.
        reducer: default ``avg_nonzero()`` over anchors.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.circle(emb, labels, m=0.25, gamma=128.0)

    Reference: Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity Optimization",
    CVPR 2020.
    """
    _require_cosine(distance, "circle")
    return run(
        CIRCLE,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        m=m,
        gamma=gamma,
    )


def _circle_terms(batch: Batch, *, m, gamma) -> dict[str, Terms]:
    m = _checks.hyper(m, "m")
    gamma = _checks.hyper(gamma, "gamma", positive=True)
    _require_cosine(batch.distance, "circle", normalized=False)
    s = batch.mat
    m, gamma = scalar_like(m, s), scalar_like(gamma, s)
    sd = s.detach()
    alpha_p = F.relu(rshift(1.0 + m, sd))  # op − s, op = 1 + m
    alpha_n = F.relu(sd + m)  # s − on, on = −m
    logit_p = (-gamma * alpha_p) * (s - (1.0 - m))
    logit_n = (gamma * alpha_n) * (s - m)
    pos, neg = batch.binary_masks()
    valid = (pos.sum(-1) > 0) & (neg.sum(-1) > 0)
    z = masked_logsumexp(logit_p, pos) + masked_logsumexp(logit_n, neg)
    losses = torch.where(valid, F.softplus(torch.where(valid, z, 0.0)), 0.0)
    return {"loss": elements(losses)}


CIRCLE = LossSpec("circle", _circle_terms, cosine(), avg_nonzero())
register(circle, CIRCLE)


# ---------------------------------------------------------------------------------------------
# Intra-pair variance
# ---------------------------------------------------------------------------------------------
def intra_pair_variance(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    pos_eps: float | Tensor = 0.01,
    neg_eps: float | Tensor = 0.01,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Intra-pair variance loss: pairs far from their group's mean similarity are penalised.

    With ``μ_+`` (``μ_-``) the mean of ``s`` over all positive (negative) pairs of the batch,
    for a similarity ``s``:

    .. math::
        \ell_{ap} = \big[(1 - ε_+)\,μ_+ - s_{ap}\big]_+^2, \qquad
        \ell_{an} = \big[s_{an} - (1 + ε_-)\,μ_-\big]_+^2

    and for a distance ``d`` the mirror images ``[d_ap − (1 + ε_+) μ_+]_+²`` and
    ``[(1 − ε_-) μ_- − d_an]_+²``. The means carry gradients (as in PML) and count repeated pairs
    of an ``indices_tuple`` as often as they are listed. Two sub-losses, ``pos_loss`` and
    ``neg_loss``, each reduced over its pairs.

    Not chunkable (:mod:`pmlfunc.chunked`): the means are over the whole batch.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        pos_eps: ``ε_+`` (default ``0.01``).
        neg_eps: ``ε_-`` (default ``0.01``).
        distance: default ``cosine()``.
        reducer: default ``mean()`` per sub-loss, summed.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.intra_pair_variance(emb, labels)

    Reference: Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019.
    """
    return run(
        INTRA_PAIR_VARIANCE,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        pos_eps=pos_eps,
        neg_eps=neg_eps,
    )


def _intra_pair_variance_terms(batch: Batch, *, pos_eps, neg_eps) -> dict[str, Terms]:
    pos_eps = _checks.hyper(pos_eps, "pos_eps")
    neg_eps = _checks.hyper(neg_eps, "neg_eps")
    d = batch.mat
    pos_eps, neg_eps = scalar_like(pos_eps, d), scalar_like(neg_eps, d)
    pos, neg = batch.masks
    flat = d.reshape(-1)
    mean_pos = (pos.reshape(-1) @ flat) / pos.sum().clamp_min(1.0)
    mean_neg = (neg.reshape(-1) @ flat) / neg.sum().clamp_min(1.0)
    if batch.distance.is_similarity:  # PML's variance_with_eps(incentivize_increase=...)
        pos_var = rshift((1.0 - pos_eps) * mean_pos, d)
        neg_var = shift(d, (1.0 + neg_eps) * mean_neg)
    else:
        pos_var = shift(d, (1.0 + pos_eps) * mean_pos)
        neg_var = rshift((1.0 - neg_eps) * mean_neg, d)
    b = batch.num_anchors
    return {
        "pos_loss": DenseTerms(F.relu(pos_var).square(), pos, "pos_pair", b),
        "neg_loss": DenseTerms(F.relu(neg_var).square(), neg, "neg_pair", b),
    }


INTRA_PAIR_VARIANCE = LossSpec(
    "intra_pair_variance",
    _intra_pair_variance_terms,
    cosine(),
    mean(),
    lambda **hyper: "the positive and negative means are over the whole batch",
)
register(intra_pair_variance, INTRA_PAIR_VARIANCE)


# ---------------------------------------------------------------------------------------------
# Tuplet margin
# ---------------------------------------------------------------------------------------------
def tuplet_margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    margin: float | Tensor = 5.73,
    scale: float | Tensor = 64.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
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
    takes ``arccos`` of the clamped value (PML's value wherever PML is finite) and gives such
    entries a zero gradient (the cosine's own gradient is zero for aligned rows).

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        margin: ``β`` in degrees (default ``5.73``).
        scale: ``σ`` (default ``64``).
        distance: must be ``cosine()`` (the default), as PML asserts.
        reducer: default ``mean()`` over positive pairs.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.tuplet_margin(emb, labels, margin=5.73, scale=64.0)

    Reference: Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019.
    """
    _require_cosine(distance, "tuplet_margin")
    return run(
        TUPLET_MARGIN,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        margin=margin,
        scale=scale,
    )


def _safe_acos(s: Tensor) -> Tensor:
    """``arccos(clamp(s, −1, 1))`` with a zero (not infinite or NaN) gradient where ``|s| ≥ 1``."""
    inside = s.abs() < 1.0
    angle = torch.acos(torch.where(inside, s, 0.0))
    return torch.where(inside, angle, torch.acos(s.detach().clamp(-1.0, 1.0)))


def _tuplet_margin_terms(batch: Batch, *, margin, scale) -> dict[str, Terms]:
    margin = _checks.hyper(margin, "margin")
    scale = _checks.hyper(scale, "scale", positive=True)
    _require_cosine(batch.distance, "tuplet_margin", normalized=False)
    s = batch.mat
    beta = scalar_like(margin, s) * (math.pi / 180.0)  # np.radians
    scale = scalar_like(scale, s)
    pos, neg = batch.masks
    neg_lse = masked_logsumexp(scale * s, neg, _keep(batch, neg))  # finfo.min: no negatives
    shifted = torch.cos(_safe_acos(s) - beta)
    # log(1 + e^x) exactly (F.softplus switches to x above its threshold)
    losses = torch.logaddexp(neg_lse.unsqueeze(-1) - scale * shifted, s.new_zeros(()))
    return {"loss": DenseTerms(losses, pos, "pos_pair", batch.num_anchors)}


TUPLET_MARGIN = LossSpec("tuplet_margin", _tuplet_margin_terms, cosine(), mean())
register(tuplet_margin, TUPLET_MARGIN)


# ---------------------------------------------------------------------------------------------
# Signal-to-noise-ratio contrastive
# ---------------------------------------------------------------------------------------------
def signal_to_noise_ratio_contrastive(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    pos_margin: float | Tensor = 0.0,
    neg_margin: float | Tensor = 1.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Contrastive loss on the signal-to-noise-ratio distance.

    :func:`pmlfunc.losses.contrastive` with ``d = snr()``:

    .. math::
        L = R\big(\{[d_{ap} - m_{pos}]_+\}\big) + R\big(\{[m_{neg} - d_{an}]_+\}\big), \qquad
        d_{ij} = \frac{\mathrm{Var}(\hat x_i - \hat x_j)}{\mathrm{Var}(\hat x_i)}

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        pos_margin: default ``0``.
        neg_margin: default ``1``.
        distance: must be an ``snr()`` distance (the default), as PML asserts.
        reducer: default ``avg_nonzero()`` per sub-loss, summed.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.signal_to_noise_ratio_contrastive(emb, labels)

    Reference: Yuan et al., "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric
    Learning", CVPR 2019.
    """
    return run(
        SIGNAL_TO_NOISE_RATIO_CONTRASTIVE,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        pos_margin=pos_margin,
        neg_margin=neg_margin,
    )


def _snr_contrastive_terms(batch: Batch, **hyper) -> dict[str, Terms]:
    if not isinstance(batch.distance, _SNR):
        raise ValueError(
            "signal_to_noise_ratio_contrastive needs distance=snr() (PML asserts SNRDistance), "
            f"got {batch.distance!r}"
        )
    return _contrastive_terms(batch, **hyper)


SIGNAL_TO_NOISE_RATIO_CONTRASTIVE = LossSpec(
    "signal_to_noise_ratio_contrastive", _snr_contrastive_terms, snr(), avg_nonzero()
)
register(signal_to_noise_ratio_contrastive, SIGNAL_TO_NOISE_RATIO_CONTRASTIVE)


# ---------------------------------------------------------------------------------------------
# Margin
# ---------------------------------------------------------------------------------------------
def margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
    *,
    margin: float | Tensor = 0.2,
    nu: float | Tensor = 0.0,
    beta: float | Tensor = 1.2,
    triplets_per_anchor: str = "all",
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Margin loss: positives inside, negatives outside a (learnable) boundary ``β``.

    For every triplet ``(a, p, n)``, with distance ``d`` (a similarity flips the signs, as PML's
    ``distance.margin``), margin ``α`` and boundary ``β_a``:

    .. math::
        \ell_{apn} = [d_{ap} - β_a + α]_+ + [β_a - d_{an} + α]_+

    The default ``divisor()`` reducer divides the sum over triplets by the number of non-zero
    parts, ``#{[d_ap − β + α]_+ > 0} + #{[β − d_an + α]_+ > 0}`` over triplets (PML's divisor).
    Triplets are never built: the positive part depends on ``(a, p)`` only and the negative part
    on ``(a, n)`` only, so each pair enters weighted by the number of triplets holding it
    (``O(B·M)``; a ``threshold``/``avg_nonzero`` window is counted per anchor by one sort of
    the negative parts and a binary search per positive, ``O(B·M log M)``). Given pairs
    ``(a1, p, a2, n)`` form the triplets that share an anchor (PML's ``convert_to_triplets``);
    given triplets are used as listed.

    Learnable ``β`` (PML's ``learn_beta=True``): pass ``params`` from :func:`margin_init`.
    ``params["beta"]`` of shape ``(1,)`` is one boundary, and ``ν·β`` is added to the loss;
    of shape ``(C,)`` (PML's ``num_classes=C``) the anchor's class picks ``β_a``, and the
    sub-loss ``beta_reg_loss`` of per-triplet terms ``ν·β_a`` is reduced like the margin loss
    (default: divided by the same divisor). Without ``params`` (``learn_beta=False``), ``β`` is
    the fixed ``beta`` and there is no regularisation term. As in PML, no triplet at all gives 0
    (regularisation included). PML keeps ``β`` in a float32 tensor (so its ``1.2`` is
    ``1.2000000477`` against float64 inputs); pmlfunc uses the number given.

    ``triplets_per_anchor`` must be ``"all"`` when triplets come from the labels (PML's random
    sampling needs an explicit generator; use a miner such as ``pf.miners.triplet_margin`` with
    ``tuples_per_anchor`` instead). Not chunkable with ``params`` or the default ``divisor()``.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`. A :class:`~pmlfunc.tuples.TripletWindow` or
            :class:`~pmlfunc.tuples.TripletMask` miner result works with the ``divisor()``,
            ``mean()``, ``sum()``, ``class_weighted`` and ``per_anchor`` reducers.
        params: ``{"beta": (1,) or (C,)}`` from :func:`margin_init`, or ``None`` (fixed ``beta``).
        margin: ``α`` (default ``0.2``).
        nu: regularisation weight ``ν`` of a learnable ``β`` (default ``0``).
        beta: the fixed boundary when ``params`` is ``None`` (default ``1.2``).
        triplets_per_anchor: ``"all"`` (default; the only supported value without a tuple).
        distance: default ``lp()``.
        reducer: default ``divisor()``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> params = pf.losses.structured.margin_init(beta=1.2, num_classes=4)
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.structured.margin(emb, labels, params, margin=0.2, nu=0.01)

    Reference: Wu et al., "Sampling Matters in Deep Embedding Learning", ICCV 2017.
    """
    if triplets_per_anchor != "all" and indices_tuple is None:
        raise ValueError(
            f'triplets_per_anchor must be "all" (got {triplets_per_anchor!r}); for a random '
            "subset of triplets pass a miner's result (e.g. pf.miners.triplet_margin(..., "
            "tuples_per_anchor=k)) as indices_tuple"
        )
    batch = prepare(embeddings, labels, ref_emb, ref_labels, indices_tuple, mat, distance, lp())
    terms, scalar_reg = _margin_parts(batch, params, margin, nu, beta)
    loss = finish(batch, terms, default_reducer(reducer, divisor()))
    loss = regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)
    if scalar_reg is None:
        return loss
    if isinstance(loss, dict):
        return {**loss, "beta_reg_loss": scalar_reg}
    return loss + scalar_reg.to(loss.dtype)


def margin_init(
    beta: float = 1.2,
    num_classes: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`margin` with a learnable boundary: ``{"beta": (C,)}``.

    PML's ``initialize_beta``: one value ``beta`` (``num_classes=None``, shape ``(1,)``) or one
    per class (shape ``(num_classes,)``), all equal to ``beta``.

    Example:
        >>> pf.losses.structured.margin_init(1.2, num_classes=3)["beta"]
        tensor([1.2000, 1.2000, 1.2000])
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a Python number, got {type(beta).__name__}")
    size = 1
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0:
            raise ValueError(f"num_classes must be a positive integer or None, got {num_classes!r}")
        size = num_classes
    return {"beta": torch.full((size,), float(beta), dtype=dtype, device=device)}


def _beta_param(params: object, embeddings: Tensor) -> Tensor:
    if not isinstance(params, dict):
        raise TypeError(
            f"params must be a dict of tensors (from margin_init), got {type(params).__name__}"
        )
    if "beta" not in params:
        raise ValueError(f"params has no 'beta' entry (keys: {sorted(params)})")
    b = params["beta"]
    if not isinstance(b, Tensor) or not b.dtype.is_floating_point:
        raise TypeError("params['beta'] must be a floating-point tensor")
    if b.ndim != 1 or b.shape[0] == 0:
        raise ValueError(
            f"params['beta'] must have shape (1,) or (num_classes,), got {tuple(b.shape)}"
        )
    if b.device != embeddings.device:
        raise ValueError(
            f"params['beta'] is on {b.device} but embeddings are on {embeddings.device}"
        )
    return b


def _margin_parts(
    batch: Batch, params, margin_, nu, beta
) -> tuple[dict[str, Terms], Tensor | None]:
    """The sub-losses' terms and, for one learnable ``β``, the already-reduced ``ν·β``."""
    margin_ = _checks.hyper(margin_, "margin")
    nu = _checks.hyper(nu, "nu")
    d, s = batch.mat if _needs_matrix(batch) else None, batch.distance.sign()
    cd = _checks.compute_dtype(batch.embeddings.dtype)
    per_class = False
    if params is None:
        beta_v = _checks.hyper(beta, "beta")
        if isinstance(beta_v, Tensor):
            beta_v = beta_v.to(dtype=cd, device=batch.embeddings.device)
    else:
        b = _beta_param(params, batch.embeddings).to(cd)
        per_class = b.shape[0] > 1
        if per_class:
            if batch.labels is None:
                raise ValueError("params['beta'] with one value per class needs labels")
            _params.class_labels(batch.all_labels, b.shape[0])
            beta_v = b[batch.labels.long()]  # (B,): the anchor's class
        else:
            beta_v = b[0]
    it = batch.indices_tuple
    if it is not None and not is_mined(it) and len(it) == 3:  # a PML triplet tuple
        a, p, n = (t.long() for t in it)
        it = MinedTriplets(a, p, n, torch.ones(a.shape, device=a.device))
    if isinstance(it, MinedTriplets):
        a, p, n = it.anchors.long(), it.positives.long(), it.negatives.long()
        w = it.valid
        if batch.rows is not None:  # a chunk: the triplets of its own anchors
            r0, r1 = batch.rows
            w = w * ((a >= r0) & (a < r1)).to(w.dtype)
            a = (a - r0).clamp(0, r1 - r0 - 1)
        d_ap, d_an = batch.pair_values(a, p), batch.pair_values(a, n)
        w = w.to(d_ap.dtype)
        b_t = beta_v[a] if per_class else beta_v
        pos_l, neg_l = _margin_parts_of(d_ap, d_an, b_t, margin_, s)
        div = w @ (pos_l > 0).to(w.dtype) + w @ (neg_l > 0).to(w.dtype)
        b = batch.num_anchors
        terms: dict[str, Terms] = {
            "margin_loss": DenseTerms(pos_l + neg_l, w, "triplet", b, anchor_index=a, divisor=div)
        }
        if params is not None and per_class:
            reg = b_t * scalar_like(nu, b_t)
            terms["beta_reg_loss"] = DenseTerms(reg, w, "element", b, anchor_index=a, divisor=div)
        any_triplet = w.sum() > 0
    else:
        pos, neg = batch.masks
        b_col = beta_v.unsqueeze(-1) if per_class else beta_v
        pos_l, neg_l = _margin_parts_of(d, d, b_col, margin_, s)
        product = not isinstance(it, (TripletWindow, TripletMask))
        if product:  # labels, pairs (a1, p, a2, n), MinedPairs: all (a, p) × (a, n)
            n_pos, n_neg = pos.sum(-1), neg.sum(-1)
            wp, wn, total = pos * n_neg.unsqueeze(-1), neg * n_pos.unsqueeze(-1), n_pos * n_neg
        else:  # a triplet selection: its pair counts are the triplet multiplicities
            wp, wn, total = pos, neg, pos.sum(-1)
        flat = lambda x: x.reshape(-1)  # noqa: E731
        div = flat(wp) @ flat((pos_l > 0).to(wp.dtype)) + flat(wn) @ flat((neg_l > 0).to(wn.dtype))
        select = None if product else it
        terms = {"margin_loss": _MarginTerms(pos_l, neg_l, pos, neg, wp, wn, total, select, div)}
        if params is not None and per_class:
            reg = beta_v * scalar_like(nu, beta_v)
            terms["beta_reg_loss"] = DenseTerms(
                reg, total, "element", batch.num_anchors, divisor=div
            )
        any_triplet = total.sum() > 0
    scalar_reg = None
    if params is not None and not per_class:
        reg = beta_v * scalar_like(nu, beta_v)
        scalar_reg = torch.where(any_triplet, reg, torch.zeros_like(reg))
    return terms, scalar_reg


def _needs_matrix(batch: Batch) -> bool:
    """Listed triplets read their pairs only; every other case reads the matrix."""
    it = batch.indices_tuple
    listed = isinstance(it, MinedTriplets) or (it is not None and not is_mined(it) and len(it) == 3)
    return not listed


def _margin_parts_of(d_ap, d_an, beta_, margin_, s: float) -> tuple[Tensor, Tensor]:
    """``([s(d_ap − β) + α]_+, [s(β − d_an) + α]_+)`` (PML's ``distance.margin``)."""
    m = scalar_like(margin_, d_ap)
    pos_l = F.relu(s * (d_ap - beta_) + m)
    neg_l = F.relu(s * (beta_ - d_an) + m)
    return pos_l, neg_l


@dataclass(frozen=True, eq=False)
class _MarginTerms(Terms):
    """Margin-loss triplets ``(a, p, n)`` with loss ``u_ap + v_an``, never enumerated.

    ``wp``/``wn`` are the pairs' triplet multiplicities and ``total`` each anchor's number of
    triplets. ``select is None``: the triplets are all ``(a, p) × (a, n)`` with weights
    ``pos_ap·neg_an`` (a product, so a value window is counted by sorting); otherwise a miner's
    triplet selection (no value windows)."""

    u: Tensor  # (B, M) positive parts
    v: Tensor  # (B, M) negative parts
    pos: Tensor
    neg: Tensor
    wp: Tensor
    wn: Tensor
    total: Tensor
    select: Any
    divisor: Tensor | None = None
    kind: str = "triplet"

    @property
    def num_anchors(self) -> int:  # type: ignore[override]
        return self.u.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.u.device

    def stats(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        if low is None and high is None:
            return (self.wp * self.u).sum(-1) + (self.wn * self.v).sum(-1), self.total
        if self.select is not None:
            raise ValueError(
                "margin with a TripletWindow/TripletMask miner result supports the divisor(), "
                "mean(), sum(), class_weighted() and per_anchor() reducers, not a value window "
                "(avg_nonzero/threshold); pass tuples_per_anchor to the miner instead"
            )
        return _pair_sum_window(self.u, self.pos, self.v, self.neg, low, high)

    def dense(self) -> dict[str, Any]:
        losses = self.u.unsqueeze(-1) + self.v.unsqueeze(-2)
        if self.select is None:
            weights = self.pos.unsqueeze(-1) * self.neg.unsqueeze(-2)
        else:
            weights = self.select.select(0, self.u.shape[-2]).to(losses.dtype)
        return {"losses": losses, "weights": weights, "kind": self.kind}


def _pair_sum_window(
    u: Tensor, cu: Tensor, v: Tensor, cv: Tensor, low: Bound, high: Bound
) -> tuple[Tensor, Tensor]:
    r"""Per row ``(Σ_{p,n} cu_p cv_n (u_p + v_n), Σ cu_p cv_n)`` over ``low < u_p + v_n < high``.

    One sort of each row's ``v``, prefix sums of ``cv`` and ``cv·v``, and a binary search per
    ``p`` for ``low − u_p < v_n < high − u_p``: ``O(B·M log M)``, never the ``(B, M, M)`` cube.
    The sort and the search carry no gradient; the values flow through the gathered sums.
    """
    vs, order = v.detach().sort(-1)
    cvs = cv.gather(-1, order)
    vals = v.gather(-1, order)
    zero = torch.zeros_like(cvs[..., :1])
    cum_w = torch.cat([zero, cvs.cumsum(-1)], -1)
    cum_s = torch.cat([zero, (cvs * vals).cumsum(-1)], -1)
    ud = u.detach()
    m = v.shape[-1]
    if low is None:
        lo = torch.zeros_like(ud, dtype=torch.long)
    else:
        lo = torch.searchsorted(vs, torch.rsub(ud, low).contiguous(), right=True)
    if high is None:
        hi = torch.full_like(ud, m, dtype=torch.long)
    else:
        hi = torch.searchsorted(vs, torch.rsub(ud, high).contiguous(), right=False)
    hi = torch.maximum(hi, lo)
    cnt = cum_w.gather(-1, hi) - cum_w.gather(-1, lo)
    sv = cum_s.gather(-1, hi) - cum_s.gather(-1, lo)
    count = (cu * cnt).sum(-1)
    total = (cu * (u * cnt + sv)).sum(-1)
    return total, count


def _margin_terms(batch: Batch, *, params, margin, nu, beta, triplets_per_anchor):
    return _margin_parts(batch, params, margin, nu, beta)[0]


def _margin_unchunkable(*, params, **_) -> str | None:
    if params is not None:
        return "a learnable beta adds an already-reduced (or divisor-scaled) regularisation term"
    return None


MARGIN = LossSpec("margin", _margin_terms, lp(), divisor(), _margin_unchunkable)
register(margin, MARGIN)
