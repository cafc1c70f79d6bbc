"""Pair losses: each term is one (anchor, other) pair of the ``B × M`` grid."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from ..distances import Distance, cosine, lp
from ..reducers import DenseTerms, Reducer, Terms, avg_nonzero, elements, mean
from ._common import Batch, LossSpec, masked_logsumexp, register, rshift, run, scalar_like, shift

__all__ = ["contrastive", "multi_similarity"]


def contrastive(
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
    r"""Contrastive (pair margin) loss.

    For a distance ``d`` (similarities flip the sign of both hinges):

    .. math::
        L = R\big(\{[d_{ap} - m_{pos}]_+\}_{(a,p)}\big) + R\big(\{[m_{neg} - d_{an}]_+\}_{(a,n)}\big)

    over positive pairs ``(a, p)`` and negative pairs ``(a, n)``; ``R`` is the reducer, applied to
    each sub-loss (``pos_loss``, ``neg_loss``) separately.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        pos_margin: positives closer than this cost nothing (default ``0``).
        neg_margin: negatives farther than this cost nothing (default ``1``).
        distance: default ``lp()`` (normalised Euclidean).
        reducer: default ``avg_nonzero()``.
        ref_emb, ref_labels: a separate reference set (nothing excluded); default: the batch
            itself without the diagonal.
        indices_tuple: PML-style pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.
        mat: a precomputed ``(B, M)`` matrix of ``distance``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = contrastive(emb, labels, neg_margin=1.4)

    Reference: Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an Invariant
    Mapping", CVPR 2006.
    """
    return run(
        CONTRASTIVE,
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


def _contrastive_terms(batch: Batch, *, pos_margin, neg_margin) -> dict[str, Terms]:
    pos_margin = _checks.hyper(pos_margin, "pos_margin")
    neg_margin = _checks.hyper(neg_margin, "neg_margin")
    d = batch.mat
    if batch.distance.is_similarity:  # PML's margin(x, y) = y - x for similarities
        pos_loss, neg_loss = F.relu(rshift(pos_margin, d)), F.relu(shift(d, neg_margin))
    else:
        pos_loss, neg_loss = F.relu(shift(d, pos_margin)), F.relu(rshift(neg_margin, d))
    b = batch.num_anchors
    terms = {
        "pos_loss": DenseTerms(pos_loss, batch.masks.pos, "pos_pair", b),
        "neg_loss": DenseTerms(neg_loss, batch.masks.neg, "neg_pair", b),
    }
    return terms


CONTRASTIVE = LossSpec("contrastive", _contrastive_terms, lp(), avg_nonzero())
register(contrastive, CONTRASTIVE)


def multi_similarity(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    alpha: float | Tensor = 2.0,
    beta: float | Tensor = 50.0,
    base: float | Tensor = 0.5,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Multi-similarity loss.

    Per anchor ``a``, with similarity ``s`` (a distance enters as ``-d``):

    .. math::
        \ell_a = \frac{1}{\alpha}\log\Big(1 + \sum_{p} e^{-\alpha (s_{ap} - \lambda)}\Big)
               + \frac{1}{\beta}\log\Big(1 + \sum_{n} e^{\beta (s_{an} - \lambda)}\Big)

    with ``λ = base``; anchors without positives (negatives) get 0 for that part.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in :func:`contrastive`.
        alpha: weight of positive pairs (default ``2``).
        beta: weight of negative pairs (default ``50``).
        base: the similarity shift λ (default ``0.5``).
        distance: default ``cosine()``.
        reducer: default ``mean()`` over anchors.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = multi_similarity(emb, labels)

    Reference: Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep Metric
    Learning", CVPR 2019.
    """
    return run(
        MULTI_SIMILARITY,
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
        alpha=alpha,
        beta=beta,
        base=base,
    )


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
    # log(1 + Σ e^x) = logaddexp(lse, 0); an empty row has lse = finfo.min, which gives 0.
    zero = pos_lse.new_zeros(())
    per_anchor = torch.logaddexp(pos_lse, zero) / alpha + torch.logaddexp(neg_lse, zero) / beta
    return {"loss": elements(per_anchor)}


MULTI_SIMILARITY = LossSpec("multi_similarity", _multi_similarity_terms, cosine(), mean())
register(multi_similarity, MULTI_SIMILARITY)
