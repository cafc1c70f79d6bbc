r"""Softmax (InfoNCE-style) losses: a positive scored against a log-sum-exp of its row.

| loss | per positive pair ``(a, p)`` or anchor ``a`` |
|---|---|
| :func:`ntxent` | ``−log(e^{z_ap} / (e^{z_ap} + Σ_{n ∈ N(a)} e^{z_an}))`` |
| :func:`supcon` | ``−mean_{p ∈ P(a)} (z_ap − log Σ_{k ∈ A(a)} e^{z_ak})`` |
| :func:`decoupled_contrastive` | ``−w_ap z_ap + log Σ_{n ∈ N(a)} e^{z_an}`` (the positive left out) |
| :func:`multi_supcon` | SupCon with multi-hot labels, positives weighted by Jaccard overlap |

``z = s/τ`` for a similarity ``s`` (a distance enters as ``−d``). Every loss needs per-row
log-sum-exps only: no positive-pair × negative-pair matrix is built. ``ntxent`` and ``supcon``
run on the tiled engine (:mod:`pmlfunc.losses._tiled`) whenever it can (labels, no
``indices_tuple``/``mat``, ``cosine()``/``dot()``, a reducer it supports): ``chunk_size=`` sets its
tile (``O(chunk × M)`` memory in both passes; without it, tiles of ``2¹⁹`` entries and at least
256 rows), the forward
forms the gradient and the backward scales it. Other calls take the general batch path.
"""

from __future__ import annotations

import functools
from typing import Unpack

import torch
from torch import Tensor

from .. import _checks
from .._inputs import matrix
from .._ops import masked_logsumexp, matmul, scalar_like, sigmoid
from ..distances import cosine, resolve
from ..labels import pair_masks
from ..reducers import DenseTerms, Terms, avg_nonzero, elements, mean, reduce
from ..tuples import check_mined, is_mined
from ._batch import Batch, BatchInputs, batch_loss, check_shared, regularized, spec
from ._tiled import builds, dense_runs, run_local, softmax_call

__all__ = ["decoupled_contrastive", "multi_supcon", "ntxent", "supcon"]


def ntxent(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.07,
    chunk_size: int | None = None,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""NT-Xent (normalised temperature-scaled cross entropy, InfoNCE) loss.

    One term per positive pair ``(a, p)``, against the negatives ``N(a)`` of the same anchor,
    with similarity ``s`` (a distance enters as ``-d``) and temperature ``τ``:

    .. math::
        \ell_{ap} = -\log\Big(\frac{e^{s_{ap}/τ}}{e^{s_{ap}/τ} + \sum_{n \in N(a)} e^{s_{an}/τ}}
                     + \epsilon\Big)

    with ``ε = finfo(dtype).tiny`` as in PML (it caps a term at ``-log ε``). Computed from one
    log-sum-exp per row, the ratio as ``σ(s_ap/τ − lse_n)`` with its subnormal tail (a ratio
    between ``e^{−104}`` and ``ε`` still moves the term and gives it its gradient, as in PML;
    ``torch.sigmoid`` returns 0 there: ``pmlfunc._ops.sigmoid``).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        temperature: ``τ > 0`` (default ``0.07``); a 0-d tensor may be learnable.
        chunk_size: if given, the tiled engine's tile: rows in chunks of ``chunk_size``,
            keeping per-row log-sum-exps; the forward forms each ``chunk_size × M`` tile's
            gradient and the backward scales it (a plain ``loss.backward()`` works). Needs
            labels, ``cosine()``/``dot()``, ``mean()``/``sum()``. Without it, calls the engine
            can run (those) take tiles of ``2¹⁹`` entries (at least 256 rows); the others the
            general batch path.
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``cosine()``; ``reducer``: default ``mean()`` over positive pairs.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.ntxent(emb, labels, temperature=0.1)

    References: Chen et al., "A Simple Framework for Contrastive Learning of Visual
    Representations", ICML 2020; Sohn, "Improved Deep Metric Learning with Multi-class N-pair
    Loss Objective", NeurIPS 2016; van den Oord et al., "Representation Learning with Contrastive
    Predictive Coding", 2018.
    """
    if chunk_size is not None or dense_runs("ntxent", labels, inputs):
        return run_local(
            softmax_call("ntxent", embeddings, labels, temperature, chunk_size, inputs)
        )
    return spec(ntxent)(embeddings, labels, inputs, temperature=temperature)


@batch_loss(ntxent, distance=cosine(), reducer=mean(), exact_ties=False)
def _ntxent_terms(batch: Batch, *, temperature) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    z = batch.scaled_similarity(1.0 / temperature)
    neg = batch.masks.neg  # counts weight repeated negatives, as in PML
    neg_lse = masked_logsumexp(z, neg, batch.keep(neg))
    # PML's term, literally: -log(e^z / (e^z + Σ_n e^{z_n}) + ε) with the ratio a sigmoid
    # (with its subnormal tail, as PML's ratio has it: _ops.sigmoid)
    ratio = sigmoid(z - neg_lse.unsqueeze(-1))
    losses = -torch.log(ratio + torch.finfo(z.dtype).tiny)
    return {"loss": DenseTerms(losses, batch.masks.pos, "pos_pair", batch.num_anchors)}


def supcon(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    chunk_size: int | None = None,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Supervised contrastive loss.

    Per anchor ``a`` with positives ``P(a)`` and candidates ``A(a) = P(a) ∪ N(a)`` (the diagonal
    excluded in self mode), similarity ``s`` (a distance enters as ``-d``), temperature ``τ``:

    .. math::
        \ell_a = -\frac{1}{|P(a)|} \sum_{p \in P(a)}
                 \Big(\frac{s_{ap}}{τ} - \log \sum_{k \in A(a)} e^{s_{ak}/τ}\Big)

    ``ℓ_a = 0`` for anchors without positives. As in PML, the loss is 0 when the batch has no
    positive pair or no negative pair at all.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        temperature: ``τ > 0`` (default ``0.1``).
        chunk_size: if given, the tiled engine's tile (as in :func:`ntxent`); reducers
            ``avg_nonzero()``, ``mean()``, ``sum()``.
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``cosine()``; ``reducer``: default ``avg_nonzero()`` over anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.supcon(emb, labels)

    Reference: Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020.
    """
    if chunk_size is not None or dense_runs("supcon", labels, inputs):
        return run_local(
            softmax_call("supcon", embeddings, labels, temperature, chunk_size, inputs)
        )
    return spec(supcon)(embeddings, labels, inputs, temperature=temperature)


@batch_loss(supcon, distance=cosine(), reducer=avg_nonzero(), exact_ties=False)
def _supcon_terms(batch: Batch, *, temperature) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    z = batch.scaled_similarity(1.0 / temperature)
    pos, neg = batch.binary_masks()
    denom = masked_logsumexp(z, pos + neg)
    n_pos = pos.sum(-1)
    mean_log_prob = (pos * z).sum(-1) / n_pos.clamp_min(1.0) - torch.where(n_pos > 0, denom, 0.0)
    has_pos, has_neg = batch.any_pairs()  # of the whole batch, also when this is a chunk
    losses = torch.where(has_pos & has_neg, -mean_log_prob, torch.zeros_like(mean_log_prob))
    return {"loss": elements(losses)}


def decoupled_contrastive(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    sigma: float | Tensor | None = None,
    **inputs: Unpack[BatchInputs],
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
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        temperature: ``τ > 0`` (default ``0.1``, the paper's); a 0-d tensor may be learnable.
        sigma: ``σ > 0`` for DCLW (the paper uses ``0.5``), ``None`` for DCL (default).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``cosine()`` (the paper's normalised dot product); ``reducer``: default
            ``mean()`` over positive pairs.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> z = torch.randn(8, 4)  # two views of 4 samples
        >>> labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
        >>> loss = pf.losses.decoupled_contrastive(z, labels, temperature=0.1, sigma=0.5)

    Reference: Yeh, Hong, Hsu, Liu, Chen, LeCun, "Decoupled Contrastive Learning", ECCV 2022.
    """
    return spec(decoupled_contrastive)(
        embeddings, labels, inputs, temperature=temperature, sigma=sigma
    )


@batch_loss(
    decoupled_contrastive,
    distance=cosine(),
    reducer=mean(),
    unchunkable_with={"sigma": "DCLW normalises its weights over every positive pair of the batch"},
    exact_ties=False,
)
def _decoupled_contrastive_terms(batch: Batch, *, temperature, sigma) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    if sigma is not None:
        sigma = _checks.hyper(sigma, "sigma", positive=True)
    s = batch.similarity()
    z = s / scalar_like(temperature, s)
    pos, neg = batch.masks  # counts weight repeated pairs, as in NT-Xent
    neg_lse = masked_logsumexp(z, neg, batch.keep(neg))
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


def multi_supcon(
    embeddings: Tensor,
    labels: Tensor,
    *,
    temperature: float | Tensor = 0.1,
    threshold: float | Tensor = 0.0,
    **inputs: Unpack[BatchInputs],
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
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`), with
            ``ref_labels`` the reference set's ``(M, C)`` multi-hot labels; ``distance``:
            default ``cosine()``; ``reducer``: default ``avg_nonzero()`` over anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb = torch.randn(4, 8)
        >>> labels = torch.tensor([[1, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 1]])
        >>> loss = pf.losses.multi_supcon(emb, labels, temperature=0.1)

    Reference: Zhang & Wu, "Multi-Label Supervised Contrastive Learning", AAAI 2024; Khosla et
    al., "Supervised Contrastive Learning", NeurIPS 2020.
    """
    check_shared("multi_supcon", inputs)
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    threshold = _checks.hyper(threshold, "threshold")
    _checks.embeddings(embeddings)
    distance = resolve(inputs.get("distance"), cosine())
    ref_emb, ref_labels = inputs.get("ref_emb"), inputs.get("ref_labels")
    indices_tuple = inputs.get("indices_tuple")
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
    d = matrix(embeddings, ref_emb, inputs.get("mat"), distance)
    s = d if distance.is_similarity else -d
    jac = _jaccard(labels, ref_labels, cd)
    if indices_tuple is not None:
        if is_mined(indices_tuple):  # (pair_masks checks a PML tuple itself)
            check_mined(indices_tuple, (b, m))
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
    reducer = inputs.get("reducer")
    reducer = avg_nonzero() if reducer is None else reducer
    loss = reduce(
        reducer, {"loss": elements(losses)}, None, _checks.compute_dtype(embeddings.dtype)
    )
    return regularized(loss, embeddings, inputs)


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
    inter = matmul(y, r.t())
    union = y.sum(-1, keepdim=True) + r.sum(-1).unsqueeze(0) - inter
    return inter / torch.where(union > 0, union, 1.0)


def _engine_call(kind: str, a, what: str | None):
    """``ntxent``/``supcon``'s bound arguments ``a`` as the tiled engine's call (the ring's)."""
    inputs = a["inputs"]
    return softmax_call(
        kind, a["embeddings"], a["labels"], a["temperature"], a["chunk_size"], inputs, what
    )


builds(ntxent)(functools.partial(_engine_call, "ntxent"))
builds(supcon)(functools.partial(_engine_call, "supcon"))
