r"""Pair losses: each term is one (anchor, other) pair of the ``B × M`` grid, judged on its own
or against a mean over the batch's pairs.

| loss | a positive pair ``(a, p)`` costs | a negative pair ``(a, n)`` costs |
|---|---|---|
| :func:`contrastive` | ``[d_ap − m_pos]_+`` | ``[m_neg − d_an]_+`` |
| :func:`signal_to_noise_ratio_contrastive` | the same on the SNR distance | the same |
| :func:`intra_pair_variance` | ``[(1 − ε_+) μ_+ − s_ap]_+²`` | ``[s_an − (1 + ε_−) μ_−]_+²`` |
| :func:`threshold_consistent_margin` | ``λ⁺ (m⁺ − s_ap)`` below ``m⁺`` | ``λ⁻ (s_an − m⁻)`` above ``m⁻`` |

Each has two sub-losses, ``pos_loss`` and ``neg_loss``, reduced separately and summed.
"""

from __future__ import annotations

from typing import Unpack

import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._ops import indicator, matmul, rshift, scalar_like, shift
from ..distances import cosine, lp, snr
from ..reducers import DenseTerms, Terms, avg_nonzero, mean
from ._batch import Batch, BatchInputs, batch_loss, spec

__all__ = [
    "contrastive",
    "intra_pair_variance",
    "signal_to_noise_ratio_contrastive",
    "threshold_consistent_margin",
]


def contrastive(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    pos_margin: float | Tensor = 0.0,
    neg_margin: float | Tensor = 1.0,
    **inputs: Unpack[BatchInputs],
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
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); default
            ``distance=lp()`` (normalised Euclidean), ``reducer=avg_nonzero()``.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.contrastive(emb, labels, neg_margin=1.4)

    Reference: Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an Invariant
    Mapping", CVPR 2006.
    """
    return spec(contrastive)(
        embeddings, labels, inputs, pos_margin=pos_margin, neg_margin=neg_margin
    )


@batch_loss(contrastive, distance=lp(), reducer=avg_nonzero())
def _contrastive_terms(batch: Batch, *, pos_margin, neg_margin) -> dict[str, Terms]:
    pos_margin = _checks.hyper(pos_margin, "pos_margin")
    neg_margin = _checks.hyper(neg_margin, "neg_margin")
    d = batch.mat
    if batch.distance.is_similarity:  # PML's margin(x, y) = y - x for similarities
        pos_loss, neg_loss = F.relu(rshift(pos_margin, d)), F.relu(shift(d, neg_margin))
    else:
        pos_loss, neg_loss = F.relu(shift(d, pos_margin)), F.relu(rshift(neg_margin, d))
    b = batch.num_anchors
    return {
        "pos_loss": DenseTerms(pos_loss, batch.masks.pos, "pos_pair", b),
        "neg_loss": DenseTerms(neg_loss, batch.masks.neg, "neg_pair", b),
    }


def signal_to_noise_ratio_contrastive(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    pos_margin: float | Tensor = 0.0,
    neg_margin: float | Tensor = 1.0,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Contrastive loss on the signal-to-noise-ratio distance.

    :func:`pmlfunc.losses.contrastive` with ``d = snr()``:

    .. math::
        L = R\big(\{[d_{ap} - m_{pos}]_+\}\big) + R\big(\{[m_{neg} - d_{an}]_+\}\big), \qquad
        d_{ij} = \frac{\mathrm{Var}(\hat x_i - \hat x_j)}{\mathrm{Var}(\hat x_i)}

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        pos_margin: default ``0``.
        neg_margin: default ``1``.
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance`` must
            be an ``snr()`` distance (the default), as PML asserts; default
            ``reducer=avg_nonzero()`` per sub-loss, summed.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.signal_to_noise_ratio_contrastive(emb, labels)

    Reference: Yuan et al., "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric
    Learning", CVPR 2019.
    """
    return spec(signal_to_noise_ratio_contrastive)(
        embeddings, labels, inputs, pos_margin=pos_margin, neg_margin=neg_margin
    )


batch_loss(
    signal_to_noise_ratio_contrastive,
    distance=snr(),
    reducer=avg_nonzero(),
    distance_rule=("snr() (SNRDistance)", lambda d: d.kind == "snr"),
)(_contrastive_terms)


def intra_pair_variance(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    pos_eps: float | Tensor = 0.01,
    neg_eps: float | Tensor = 0.01,
    **inputs: Unpack[BatchInputs],
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
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        pos_eps: ``ε_+`` (default ``0.01``).
        neg_eps: ``ε_-`` (default ``0.01``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); default
            ``distance=cosine()``, ``reducer=mean()`` per sub-loss, summed.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.intra_pair_variance(emb, labels)

    Reference: Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019.
    """
    return spec(intra_pair_variance)(embeddings, labels, inputs, pos_eps=pos_eps, neg_eps=neg_eps)


@batch_loss(
    intra_pair_variance,
    distance=cosine(),
    reducer=mean(),
    unchunkable="the positive and negative means are over the whole batch",
)
def _intra_pair_variance_terms(batch: Batch, *, pos_eps, neg_eps) -> dict[str, Terms]:
    pos_eps = _checks.hyper(pos_eps, "pos_eps")
    neg_eps = _checks.hyper(neg_eps, "neg_eps")
    d = batch.mat
    pos_eps, neg_eps = scalar_like(pos_eps, d), scalar_like(neg_eps, d)
    pos, neg = batch.masks
    flat = d.reshape(-1)
    mean_pos = matmul(pos.reshape(-1), flat) / pos.sum().clamp_min(1.0)
    mean_neg = matmul(neg.reshape(-1), flat) / neg.sum().clamp_min(1.0)
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


def threshold_consistent_margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    lambda_plus: float | Tensor = 1.0,
    lambda_minus: float | Tensor = 1.0,
    margin_plus: float | Tensor = 0.9,
    margin_minus: float | Tensor = 0.5,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Threshold-consistent margin (TCM) loss: penalise positives below ``m⁺`` and negatives above
    ``m⁻`` in cosine similarity.

    .. math::
        L = λ^+ \frac{\sum_{(a,p):\, s_{ap} \le m^+} (m^+ - s_{ap})}{|\{(a,p): s_{ap} \le m^+\}|}
          + λ^- \frac{\sum_{(a,n):\, s_{an} \ge m^-} (s_{an} - m^-)}{|\{(a,n): s_{an} \ge m^-\}|}

    over positive and negative pairs (listed pairs count with their multiplicity); an empty part
    is 0. PML returns this as an already-reduced value and ignores its reducer: here the two
    parts are pair terms (``pos_loss``, ``neg_loss``) whose default reducer ``mean()`` over the
    selected pairs gives exactly the formula; another reducer acts on the same selected terms.
    With ``ref_emb`` the pairs' second members are the reference rows (PML 2.9.0 indexes the
    batch with the reference indices there, a bug).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` with ``indices_tuple``).
        lambda_plus, lambda_minus: weights ``λ⁺``, ``λ⁻`` (default ``1``).
        margin_plus: ``m⁺`` (default ``0.9``).
        margin_minus: ``m⁻`` (default ``0.5``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance`` must
            be ``cosine()`` (the default; PML asserts ``CosineSimilarity``); default
            ``reducer=mean()`` (see above).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.threshold_consistent_margin(emb, labels)

    Reference: Zhang et al., "Threshold-Consistent Margin Loss for Open-World Deep Metric
    Learning", ICLR 2024.
    """
    return spec(threshold_consistent_margin)(
        embeddings,
        labels,
        inputs,
        lambda_plus=lambda_plus,
        lambda_minus=lambda_minus,
        margin_plus=margin_plus,
        margin_minus=margin_minus,
    )


@batch_loss(
    threshold_consistent_margin,
    distance=cosine(),
    reducer=mean(),
    distance_rule=("cosine()", lambda d: d == cosine()),
)
def _tcm_terms(
    batch: Batch, *, lambda_plus, lambda_minus, margin_plus, margin_minus
) -> dict[str, Terms]:
    s = batch.mat
    lp_, lm, mp, mm = (
        scalar_like(_checks.hyper(v, name), s)
        for v, name in (
            (lambda_plus, "lambda_plus"),
            (lambda_minus, "lambda_minus"),
            (margin_plus, "margin_plus"),
            (margin_minus, "margin_minus"),
        )
    )
    pos, neg = batch.masks
    w_pos = pos * indicator(mp - s, strict=False)  # s ≤ m⁺
    w_neg = neg * indicator(s - mm, strict=False)  # s ≥ m⁻
    b = batch.num_anchors
    return {
        "pos_loss": DenseTerms(lp_ * (mp - s), w_pos, "pos_pair", b),
        "neg_loss": DenseTerms(lm * (s - mm), w_neg, "neg_pair", b),
    }
