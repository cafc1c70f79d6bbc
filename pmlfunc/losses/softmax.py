"""Softmax (InfoNCE-style) losses: a positive scored against a row's log-sum-exp.

Both losses need per-row log-sum-exps only; no positive-pair × negative-pair matrix is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import _checks
from ..distances import Distance, cosine
from ..reducers import DenseTerms, Reducer, Terms, avg_nonzero, elements, mean
from ._common import (
    Batch,
    LossSpec,
    masked_logsumexp,
    register,
    regularize,
    run,
    scalar_like,
)
from ._streaming import ntxent_streaming, supcon_streaming

__all__ = ["ntxent", "supcon"]


def ntxent(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.07,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    r"""NT-Xent (normalised temperature-scaled cross entropy, InfoNCE) loss.

    One term per positive pair ``(a, p)``, against the negatives ``N(a)`` of the same anchor,
    with similarity ``s`` (a distance enters as ``-d``) and temperature ``τ``:

    .. math::
        \ell_{ap} = -\log\Big(\frac{e^{s_{ap}/τ}}{e^{s_{ap}/τ} + \sum_{n \in N(a)} e^{s_{an}/τ}}
                     + \epsilon\Big)

    with ``ε = finfo(dtype).tiny`` as in PML (it caps a term at ``-log ε``). Computed from one
    log-sum-exp per row.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        temperature: ``τ > 0`` (default ``0.07``); a 0-d tensor may be learnable.
        distance: default ``cosine()``.
        reducer: default ``mean()`` over positive pairs.
        chunk_size: if given, the bounded-memory path: rows in chunks, keeping per-row
            log-sum-exps, backward recomputing each ``chunk_size × M`` tile (a plain
            ``loss.backward()`` works). Needs labels, ``cosine()``/``dot()``, ``mean()``/``sum()``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = ntxent(emb, labels, temperature=0.1)

    References: Chen et al., "A Simple Framework for Contrastive Learning of Visual
    Representations", ICML 2020; Sohn, "Improved Deep Metric Learning with Multi-class N-pair
    Loss Objective", NeurIPS 2016; van den Oord et al., "Representation Learning with Contrastive
    Predictive Coding", 2018.
    """
    if chunk_size is not None:
        loss = ntxent_streaming(
            embeddings,
            labels,
            temperature=temperature,
            distance=distance,
            reducer=reducer,
            ref_emb=ref_emb,
            ref_labels=ref_labels,
            indices_tuple=indices_tuple,
            mat=mat,
            chunk_size=chunk_size,
        )
        return regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)
    return run(
        NTXENT,
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
    )


def _ntxent_terms(batch: Batch, *, temperature) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    z = batch.similarity() / scalar_like(temperature, batch.mat)
    neg = batch.masks.neg  # counts weight repeated negatives, as in PML
    neg_lse = masked_logsumexp(z, neg, (neg > 0).to(z.dtype) if batch.counts else None)
    # PML's term, literally: -log(e^z / (e^z + Σ_n e^{z_n}) + ε) with the ratio a sigmoid.
    ratio = torch.sigmoid(z - neg_lse.unsqueeze(-1))
    losses = -torch.log(ratio + torch.finfo(z.dtype).tiny)
    return {"loss": DenseTerms(losses, batch.masks.pos, "pos_pair", batch.num_anchors)}


NTXENT = LossSpec("ntxent", _ntxent_terms, cosine(), mean())
register(ntxent, NTXENT)


def supcon(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    chunk_size: int | None = None,
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
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        temperature: ``τ > 0`` (default ``0.1``).
        distance: default ``cosine()``.
        reducer: default ``avg_nonzero()`` over anchors.
        chunk_size: if given, the bounded-memory path (as in :func:`ntxent`); reducers
            ``avg_nonzero()``, ``mean()``, ``sum()``.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = supcon(emb, labels)

    Reference: Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020.
    """
    if chunk_size is not None:
        loss = supcon_streaming(
            embeddings,
            labels,
            temperature=temperature,
            distance=distance,
            reducer=reducer,
            ref_emb=ref_emb,
            ref_labels=ref_labels,
            indices_tuple=indices_tuple,
            mat=mat,
            chunk_size=chunk_size,
        )
        return regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)
    return run(
        SUPCON,
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
    )


def _supcon_terms(batch: Batch, *, temperature) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    z = batch.similarity() / scalar_like(temperature, batch.mat)
    pos, neg = batch.binary_masks()
    denom = masked_logsumexp(z, pos + neg)
    n_pos = pos.sum(-1)
    mean_log_prob = (pos * z).sum(-1) / n_pos.clamp_min(1.0) - torch.where(n_pos > 0, denom, 0.0)
    has_pos, has_neg = batch.any_pairs()  # of the whole batch, also when this is a chunk
    losses = torch.where(has_pos & has_neg, -mean_log_prob, torch.zeros_like(mean_log_prob))
    return {"loss": elements(losses)}


SUPCON = LossSpec("supcon", _supcon_terms, cosine(), avg_nonzero())
register(supcon, SUPCON)
