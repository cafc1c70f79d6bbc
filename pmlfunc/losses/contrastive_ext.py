"""More contrastive losses: VICReg (two views, no labels) and three losses PML 2.9.0 does not have.

| function | what it is | PML |
|---|---|---|
| :func:`vicreg` | invariance + variance + covariance of two views | ``VICRegLoss`` (2.9.0) |
| :func:`decoupled_contrastive` | NT-Xent without the positive in the denominator (DCL, DCLW) | PML 3 only |
| :func:`multi_supcon` | SupCon for multi-hot labels, pairs weighted by Jaccard similarity | PML 3 only |
| :func:`selectively_contrastive_triplet` | easy-positive / hard-negative triplet, hard ones pushed apart | PML 3 only |

The last three have no PML 2.9.0 counterpart: each docstring states the exact formula computed,
and the tests compare them with float64 loop references written from the papers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._inputs import matrix
from ..distances import Distance, cosine
from ..labels import pair_masks
from ..reducers import DenseTerms, Reducer, Terms, avg_nonzero, elements, mean, reduce
from ._common import (
    Batch,
    LossSpec,
    _masked,
    default_reducer,
    masked_logsumexp,
    register,
    regularize,
    run,
    scalar_like,
)

__all__ = ["decoupled_contrastive", "multi_supcon", "selectively_contrastive_triplet", "vicreg"]


# ---------------------------------------------------------------------------------------------
# VICReg
# ---------------------------------------------------------------------------------------------
def vicreg(
    embeddings: Tensor,
    ref_emb: Tensor,
    *,
    invariance_lambda: float | Tensor = 25.0,
    variance_mu: float | Tensor = 25.0,
    covariance_v: float | Tensor = 1.0,
    eps: float | Tensor = 1e-4,
    reducer: Reducer | None = None,
) -> Tensor:
    r"""VICReg: variance-invariance-covariance regularisation of two views of a batch.

    For two views ``Z = embeddings`` and ``Z' = ref_emb`` (``B × D``, row ``i`` of each is the
    same sample), with ``Var`` the unbiased variance over the batch and ``C(Z)`` the unbiased
    ``D × D`` covariance matrix:

    .. math::
        L = \lambda\, R\Big(\big\{\tfrac{1}{D}\lVert z_i - z'_i\rVert^2\big\}_i\Big)
          + \mu\, R\Big(\big\{\tfrac12 [1 - \sqrt{\mathrm{Var}(Z_{:,d}) + ε}]_+\big\}_d\Big)
          + \mu\, R\Big(\big\{\tfrac12 [1 - \sqrt{\mathrm{Var}(Z'_{:,d}) + ε}]_+\big\}_d\Big)
          + \nu\, \frac{1}{D}\sum_{d \ne e} \big(C(Z)_{de}^2 + C(Z')_{de}^2\big)

    ``R`` is the reducer, applied to each of the first three sub-losses (``invariance_loss``,
    ``variance_loss1``, ``variance_loss2``); the covariance term is already reduced and is added
    as it is, whatever the reducer (as in PML). There are no labels, pairs or distance: PML's
    ``VICRegLoss`` rejects them too. The covariance term costs one ``D × D`` matrix per view.

    Args:
        embeddings: ``(B, D)`` float tensor, the first view (``B ≥ 2``: the variance is unbiased).
        ref_emb: ``(B, D)`` float tensor, the second view, row-aligned with ``embeddings``
            (PML: ``loss_fn(embeddings, ref_emb=ref_emb)``).
        invariance_lambda: weight λ of the invariance term (default ``25``).
        variance_mu: weight μ of the variance terms (default ``25``).
        covariance_v: weight ν of the covariance term (default ``1``).
        eps: ``ε`` added to the variance under the square root (default ``1e-4``).
        reducer: default ``mean()``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> z1, z2 = torch.randn(8, 4), torch.randn(8, 4)
        >>> loss = vicreg(z1, z2, invariance_lambda=25.0)

    Reference: Bardes, Ponce, LeCun, "VICReg: Variance-Invariance-Covariance Regularization for
    Self-Supervised Learning", ICLR 2022.
    """
    _checks.embeddings(embeddings)
    if ref_emb is None:
        raise ValueError("vicreg needs ref_emb: the second view of the batch, row-aligned")
    _checks.embeddings(ref_emb, "ref_emb")
    _checks.same_space(embeddings, ref_emb)
    if ref_emb.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"ref_emb must have as many rows as embeddings (two views of one batch), got "
            f"{ref_emb.shape[0]} and {embeddings.shape[0]}"
        )
    if embeddings.shape[0] < 2:
        raise ValueError("vicreg needs a batch of at least 2 rows (the variance is unbiased)")
    lam = _checks.hyper(invariance_lambda, "invariance_lambda")
    mu = _checks.hyper(variance_mu, "variance_mu")
    nu = _checks.hyper(covariance_v, "covariance_v")
    eps = _checks.hyper(eps, "eps", nonnegative=True)
    reducer = default_reducer(reducer, mean())
    cd = _checks.compute_dtype(embeddings.dtype)
    x, y = embeddings.to(cd), ref_emb.to(cd)
    lam, mu, nu, eps = (scalar_like(v, x) for v in (lam, mu, nu, eps))
    diff = x - y
    invariance = (diff * diff).mean(-1)
    terms = {
        "invariance_loss": elements(lam * invariance),
        "variance_loss1": elements(mu * _variance_hinge(x, eps)),
        "variance_loss2": elements(mu * _variance_hinge(y, eps)),
    }
    covariance = nu * (_off_diagonal_cov_sq(x) + _off_diagonal_cov_sq(y)) / x.shape[1]
    loss = reduce(reducer, terms, None, embeddings.dtype)
    if isinstance(loss, dict):  # none(): the terms, and the covariance as it is
        ones = torch.ones_like(covariance)
        return {
            **loss,
            "covariance_loss": {"losses": covariance, "weights": ones, "kind": "already_reduced"},
        }
    return loss + covariance.to(loss.dtype)


def _variance_hinge(x: Tensor, eps: float | Tensor) -> Tensor:
    """Per column ``[1 − √(Var + ε)]₊ / 2`` (unbiased variance over the rows)."""
    std = torch.sqrt(x.var(dim=0) + eps)
    return F.relu(1.0 - std) / 2


def _off_diagonal_cov_sq(x: Tensor) -> Tensor:
    """``Σ_{d≠e} C_de²`` of the unbiased covariance ``C`` of the columns of ``x``.

    The diagonal is subtracted before squaring (not ``‖C‖² − Σ C_dd²``, which cancels when the
    features are nearly decorrelated: the regime VICReg drives them to).
    """
    xc = x - x.mean(dim=0)
    cov = (xc.t() @ xc) / (x.shape[0] - 1)
    off = cov - torch.diag_embed(cov.diagonal())
    return (off * off).sum()


# ---------------------------------------------------------------------------------------------
# Decoupled contrastive (DCL, DCLW)
# ---------------------------------------------------------------------------------------------
def decoupled_contrastive(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    sigma: float | Tensor | None = None,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Decoupled contrastive loss (DCL, and DCLW with ``sigma``): NT-Xent without the positive
    in the denominator.

    One term per positive pair ``(a, p)``, against the negatives ``N(a)`` of the same anchor,
    with similarity ``s`` (a distance enters as ``-d``) and temperature ``τ``:

    .. math::
        \ell_{ap} = -w_{ap}\,\frac{s_{ap}}{τ} + \log \sum_{n \in N(a)} e^{s_{an}/τ}

    DCL (``sigma=None``): ``w_ap = 1``. DCLW (``sigma = σ``), the negative von Mises-Fisher
    weighting of the paper:

    .. math::
        w_{ap} = 2 - \frac{e^{s_{ap}/σ}}{\frac{1}{|\mathcal P|}\sum_{(a',p') \in \mathcal P} e^{s_{a'p'}/σ}}

    where ``𝒫`` is every positive pair that has a term (pairs listed several times in an index
    tuple count as often). The weights average 1 over ``𝒫``; they are differentiated through
    (the paper's code computes them as ``2 − B·softmax(s/σ)`` without a detach). The paper's
    ``weight_fn=None`` is ``sigma=None`` here.

    With two augmented views per sample (``labels`` = the sample index, both views of ``B``
    samples in the batch) this is the paper's loss summed over both views and averaged over the
    ``2B`` anchors: each view is an anchor whose positive is the other view of its sample and
    whose negatives are the ``2B − 2`` views of the other samples. With ordinary class labels it is the supervised form:
    every same-class pair is a positive, scored against the anchor's negatives only.

    An anchor without negatives has ``log Σ_∅ = −∞``: its pairs get no term (NT-Xent's term would
    be 0 there). Without ``sigma`` the loss splits over anchors (:mod:`pmlfunc.chunked`); the DCLW
    weight normalises over the whole batch, so ``sigma`` is not chunkable.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        temperature: ``τ > 0`` (default ``0.1``, the paper's); a 0-d tensor may be learnable.
        sigma: ``σ > 0`` for DCLW (the paper uses ``0.5``), ``None`` for DCL (default).
        distance: default ``cosine()`` (the paper's normalised dot product).
        reducer: default ``mean()`` over positive pairs.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> z = torch.randn(8, 4)  # two views of 4 samples
        >>> labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
        >>> loss = decoupled_contrastive(z, labels, temperature=0.1, sigma=0.5)

    Reference: Yeh, Hong, Hsu, Liu, Chen, LeCun, "Decoupled Contrastive Learning", ECCV 2022.
    """
    return run(
        DECOUPLED_CONTRASTIVE,
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
        temperature=temperature,
        sigma=sigma,
    )


def _decoupled_contrastive_terms(batch: Batch, *, temperature, sigma) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    if sigma is not None:
        sigma = _checks.hyper(sigma, "sigma", positive=True)
    s = batch.similarity()
    z = s / scalar_like(temperature, s)
    pos, neg = batch.masks  # counts weight repeated pairs, as in NT-Xent
    neg_lse = masked_logsumexp(z, neg, (neg > 0).to(z.dtype) if batch.counts else None)
    has_neg = neg.amax(-1, keepdim=True) > 0
    weights = pos * has_neg
    if sigma is None:
        positive = z
    else:
        # e^{s/σ} / mean_𝒫 e^{s/σ} = exp(s/σ − (log Σ_𝒫 c·e^{s/σ} − log |𝒫|)), ≤ |𝒫| on 𝒫.
        x = s / scalar_like(sigma, s)
        keep = (weights > 0).to(x.dtype)
        log_total = masked_logsumexp(x.reshape(1, -1), weights.reshape(1, -1), keep.reshape(1, -1))
        log_mean = log_total - torch.log(weights.sum().clamp_min(1.0))
        # Off 𝒫 the exponent is set to 0 before exp (no inf, no NaN gradient through a where).
        w = 2.0 - torch.exp(torch.where(keep > 0, x - log_mean, 0.0))
        positive = w * z
    losses = torch.where(has_neg, neg_lse.unsqueeze(-1) - positive, 0.0)
    return {"loss": DenseTerms(losses, weights, "pos_pair", batch.num_anchors)}


def _decoupled_unchunkable(*, temperature, sigma) -> str | None:
    if sigma is not None:
        return "sigma (DCLW) normalises the weights over every positive pair of the batch"
    return None


DECOUPLED_CONTRASTIVE = LossSpec(
    "decoupled_contrastive",
    _decoupled_contrastive_terms,
    cosine(),
    mean(),
    _decoupled_unchunkable,
)
register(decoupled_contrastive, DECOUPLED_CONTRASTIVE)


# ---------------------------------------------------------------------------------------------
# Multi-label SupCon
# ---------------------------------------------------------------------------------------------
def multi_supcon(
    embeddings: Tensor,
    labels: Tensor,
    *,
    temperature: float | Tensor = 0.1,
    threshold: float | Tensor = 0.0,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Multi-label supervised contrastive loss: SupCon with positives weighted by label overlap.

    Labels are multi-hot ``(B, C)`` rows ``y_i`` (sets of classes). The weight of a pair is the
    Jaccard similarity of the two label sets,

    .. math::
        J_{ij} = \frac{|y_i \cap y_j|}{|y_i \cup y_j|} = \frac{y_i \cdot y_j}{|y_i| + |y_j| - y_i \cdot y_j}
        \qquad (J_{ij} = 0 \text{ when both sets are empty}),

    positives are ``P(i) = {j : J_ij > threshold}``, negatives ``N(i)`` the rest, ``A(i) =
    P(i) ∪ N(i)`` (in self mode ``j ≠ i``), and with similarity ``s`` (a distance enters as
    ``-d``) and temperature ``τ``:

    .. math::
        \ell_i = -\frac{1}{|P(i)|} \sum_{p \in P(i)} J_{ip}
                 \Big(\frac{s_{ip}}{τ} - \log \sum_{k \in A(i)} e^{s_{ik}/τ}\Big)

    ``ℓ_i = 0`` for anchors without positives; as in :func:`pmlfunc.losses.supcon`, the loss is 0
    when the batch has no positive or no negative pair at all. With one-hot labels (and
    ``threshold < 1``) ``J`` is 0/1 and this is exactly :func:`pmlfunc.losses.supcon`.

    This is the Jaccard-weighted SupCon of PML's multi-label ``MultiSupConLoss`` code (not in
    PML 2.9.0; its positive normaliser is ``|P(i)|``, the number of positives, not ``Σ J``). It
    follows the idea of Zhang & Wu (weight a positive by how much its label set overlaps the
    anchor's) with the Jaccard form above; it is not a transcription of the paper's own loss.
    Two choices differ from that PML code: ``J`` of two empty label sets is 0 (``0/0`` there: a
    NaN that reaches the loss through ``NaN·0``), and the default ``threshold`` is 0 (any shared
    class makes a positive; the PML code used 0.3).

    An ``indices_tuple`` (pairs or triplets, or a pmlfunc miner result) replaces the positive
    and negative sets by the listed pairs (each counted once); ``J`` still weights the positives.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B, C)`` multi-hot tensor (bool, integer or 0/1 float), required.
        temperature: ``τ > 0`` (default ``0.1``).
        threshold: pairs with ``J > threshold`` are positives (default ``0``).
        distance: default ``cosine()``.
        reducer: default ``avg_nonzero()`` over anchors.
        ref_emb, ref_labels: a separate reference set ``(M, D)`` and its ``(M, C)`` labels
            (nothing excluded).
        indices_tuple: PML-style pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.
        mat: a precomputed ``(B, M)`` matrix of ``distance``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb = torch.randn(4, 8)
        >>> labels = torch.tensor([[1, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 1]])
        >>> loss = multi_supcon(emb, labels, temperature=0.1)

    Reference: Zhang & Wu, "Multi-Label Supervised Contrastive Learning", AAAI 2024; Khosla et
    al., "Supervised Contrastive Learning", NeurIPS 2020.
    """
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    threshold = _checks.hyper(threshold, "threshold")
    _checks.embeddings(embeddings)
    if distance is None:
        distance = cosine()
    if not isinstance(distance, Distance):
        raise TypeError(
            f"distance must be a pmlfunc distance (pmlfunc.distances.cosine(), ...), got {type(distance).__name__}"
        )
    b = embeddings.shape[0]
    _multi_hot(labels, b, embeddings.device, "labels")
    if ref_emb is not None:
        _checks.embeddings(ref_emb, "ref_emb")
        _checks.same_space(embeddings, ref_emb)
        if ref_labels is None:
            raise ValueError(
                "ref_emb was given without ref_labels: pass their (M, C) multi-hot labels"
            )
        _multi_hot(ref_labels, ref_emb.shape[0], embeddings.device, "ref_labels")
        if ref_labels.shape[1] != labels.shape[1]:
            raise ValueError(
                f"ref_labels has {ref_labels.shape[1]} classes but labels has {labels.shape[1]}"
            )
    elif ref_labels is not None:
        raise ValueError("ref_labels was given without ref_emb")
    m = b if ref_emb is None else ref_emb.shape[0]
    cd = _checks.compute_dtype(embeddings.dtype)
    d = matrix(embeddings, ref_emb, mat, distance)
    s = d if distance.is_similarity else -d
    jac = _jaccard(labels, ref_labels, cd)
    if indices_tuple is not None:
        pos, neg = pair_masks(None, None, indices_tuple, (b, m), dtype=cd, device=d.device)
        pos, neg = (pos > 0).to(cd), (neg > 0).to(cd)
    else:
        pos = (jac > scalar_like(threshold, jac)).to(cd)
        neg = 1.0 - pos
        if ref_emb is None:
            not_self = 1.0 - torch.eye(b, dtype=cd, device=d.device)
            pos, neg = pos * not_self, neg * not_self
    z = s / scalar_like(temperature, s)
    denom = masked_logsumexp(z, torch.clamp(pos + neg, max=1.0))
    wpos = pos * jac
    n_pos = pos.sum(-1).clamp_min(1.0)
    # Σ_p J (z − denom) / |P| = (Σ_p J z − denom Σ_p J) / |P|; Σ_p J = 0 on rows without
    # positives, where denom may be the finite stand-in for −∞ (finfo.min): zeroed by where.
    j_sum = wpos.sum(-1)
    mean_log_prob = ((wpos * z).sum(-1) - torch.where(j_sum > 0, denom, 0.0) * j_sum) / n_pos
    has_pairs = (pos.amax() > 0) & (neg.amax() > 0)
    losses = torch.where(has_pairs, -mean_log_prob, torch.zeros_like(mean_log_prob))
    loss = reduce(
        default_reducer(reducer, avg_nonzero()), {"loss": elements(losses)}, None, embeddings.dtype
    )
    return regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)


def _multi_hot(y: object, rows: int, device, name: str) -> Tensor:
    if not isinstance(y, Tensor):
        raise TypeError(
            f"{name} must be a (rows, num_classes) multi-hot tensor, got {type(y).__name__}"
        )
    if y.dtype.is_complex:
        raise TypeError(f"{name} must be real (bool, integer or 0/1 float), got {y.dtype}")
    if y.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-D multi-hot matrix of shape (rows, num_classes), got shape {tuple(y.shape)}"
        )
    if y.shape[0] != rows:
        raise ValueError(f"{name} has {y.shape[0]} rows but there are {rows} embeddings")
    if y.device != device:
        raise ValueError(f"{name} is on {y.device} but the embeddings are on {device}")
    return y


def _jaccard(labels: Tensor, ref_labels: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``(B, M)`` Jaccard similarities of multi-hot rows (0 where both sets are empty)."""
    y = labels.to(dtype)
    r = y if ref_labels is None else ref_labels.to(dtype)
    inter = y @ r.t()
    union = y.sum(-1, keepdim=True) + r.sum(-1).unsqueeze(0) - inter
    return inter / torch.where(union > 0, union, 1.0)


# ---------------------------------------------------------------------------------------------
# Selectively contrastive triplet
# ---------------------------------------------------------------------------------------------
def selectively_contrastive_triplet(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    penalty: float | Tensor = 1.0,
    hard_cutoff: float | Tensor | None = None,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Selectively contrastive triplet loss: hard negatives are only pushed away.

    Per anchor ``a``, with similarity ``s`` (a distance enters as ``-d``): the easiest positive
    ``p = argmax_{p ∈ P(a)} s_ap`` and the hardest negative ``n = argmax_{n ∈ N(a)} s_an`` form
    one triplet (the selection is not differentiated), whose loss is

    .. math::
        \ell_a = \begin{cases}
            λ\, s_{an} & \text{if } s_{an} > s_{ap}\ (\text{or } s_{an} > c) \\
            -\log \dfrac{e^{s_{ap}/τ}}{e^{s_{ap}/τ} + e^{s_{an}/τ}}
                = \log\big(1 + e^{(s_{an} - s_{ap})/τ}\big) & \text{otherwise}
        \end{cases}

    with ``λ = penalty``, ``τ = temperature`` and the optional cut-off ``c = hard_cutoff``. The
    first case (the paper's selectively contrastive ``L_SC``) lowers only the hard negative's similarity and
    leaves the positive alone; the second is the NCA triplet loss. Anchors without a positive or
    a negative have no triplet. The default reducer averages over the anchors that have one,
    which is the authors' ``(L_easy + λ·L_hard) / (N_easy + N_hard)``.

    Differences from the authors' code (``SCTLoss``): their ``0.8`` cut-off is ``hard_cutoff=0.8``
    here (the paper's rule, ``None``, is the default); they skip positives with ``s > 0.9999``
    (duplicate images) and triplets whose mined similarity is exactly ±1; here every positive
    and every triplet counts (drop duplicates from the batch, or pass an ``indices_tuple``).
    An ``indices_tuple`` restricts the candidate positives and negatives to the listed pairs.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        temperature: ``τ > 0`` of the NCA term (default ``0.1``, the authors').
        penalty: ``λ``, the weight of the hard-negative term (default ``1``).
        hard_cutoff: also treat a triplet as hard when ``s_an > hard_cutoff`` (default ``None``).
        distance: default ``cosine()``.
        reducer: default ``mean()`` over anchors with a triplet.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = selectively_contrastive_triplet(emb, labels, penalty=1.0)

    Reference: Xuan, Stylianou, Liu, Pless, "Hard Negative Examples are Hard, but Useful",
    ECCV 2020.
    """
    return run(
        SELECTIVELY_CONTRASTIVE_TRIPLET,
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
        temperature=temperature,
        penalty=penalty,
        hard_cutoff=hard_cutoff,
    )


def _sct_terms(batch: Batch, *, temperature, penalty, hard_cutoff) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    penalty = _checks.hyper(penalty, "penalty")
    if hard_cutoff is not None:
        hard_cutoff = _checks.hyper(hard_cutoff, "hard_cutoff")
    s = batch.similarity()
    pos, neg = batch.masks
    keep_p, keep_n = (pos > 0).to(s.dtype), (neg > 0).to(s.dtype)
    sd = s.detach()
    ip = _masked(sd, keep_p).argmax(-1, keepdim=True)
    i_n = _masked(sd, keep_n).argmax(-1, keepdim=True)
    s_ap = s.gather(-1, ip).squeeze(-1)
    s_an = s.gather(-1, i_n).squeeze(-1)
    valid = keep_p.amax(-1) * keep_n.amax(-1)
    hard = s_an.detach() > s_ap.detach()
    if hard_cutoff is not None:
        hard = hard | (s_an.detach() > scalar_like(hard_cutoff, s))
    nca = F.softplus((s_an - s_ap) / scalar_like(temperature, s))
    losses = torch.where(hard, scalar_like(penalty, s) * s_an, nca)
    return {"loss": DenseTerms(losses, valid, "triplet", batch.num_anchors)}


SELECTIVELY_CONTRASTIVE_TRIPLET = LossSpec(
    "selectively_contrastive_triplet", _sct_terms, cosine(), mean()
)
register(selectively_contrastive_triplet, SELECTIVELY_CONTRASTIVE_TRIPLET)
