r"""Regularizers as pure functions of embeddings or of a weight matrix.

Each returns a 0-d tensor reduced by its ``reducer`` (PML's default: ``mean()``; ``divisor()`` for
:func:`sparse_centers`). A loss adds one as PML does, ``loss + embedding_reg_weight ·
embedding_regularizer(embeddings)``:

    >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> loss = pf.losses.contrastive(emb, labels, embedding_regularizer=pf.regularizers.lp)

Use ``functools.partial`` for a regularizer's own arguments
(``embedding_regularizer=functools.partial(pf.regularizers.lp, power=2)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks, _ops
from .reducers import DenseTerms, Reducer, divisor, elements, mean, reduce

__all__ = [
    "center_invariant",
    "lp",
    "regular_face",
    "sparse_centers",
    "spherical_embedding",
    "zero_mean",
]


def _input(x: object, name: str) -> tuple[Tensor, torch.dtype]:
    """``x`` in the compute dtype, and the regularizer's dtype: that one too (float32 for
    float16/bfloat16 inputs), as the losses'."""
    t = _checks.embeddings(x, name)
    cd = _checks.compute_dtype(t.dtype)
    return t.to(cd), cd


def _reduce(values: Tensor, reducer: Reducer | None, default: Reducer, out_dtype) -> Tensor:
    return reduce(
        default if reducer is None else reducer, {"loss": elements(values)}, None, out_dtype
    )


def lp(
    embeddings: Tensor, *, p: float = 2, power: float = 1, reducer: Reducer | None = None
) -> Tensor:
    r"""``‖x_i‖_p^power`` per row (PML ``LpRegularizer``), reduced (default ``mean()``).

    Example:
        >>> lp(torch.ones(2, 4))
        tensor(2.)
    """
    x, dtype = _input(embeddings, "embeddings")
    reg = torch.linalg.vector_norm(x, float(p), dim=-1)
    if power != 1:
        reg = reg**power
    return _reduce(reg, reducer, mean(), dtype)


def zero_mean(embeddings: Tensor, *, reducer: Reducer | None = None) -> Tensor:
    r"""``|Σ_d x_id|`` per row (PML ``ZeroMeanRegularizer``), reduced (default ``mean()``).

    Example:
        >>> zero_mean(torch.tensor([[1.0, -1.0], [2.0, 1.0]]))
        tensor(1.5000)
    """
    x, dtype = _input(embeddings, "embeddings")
    return _reduce(x.sum(-1).abs(), reducer, mean(), dtype)


def center_invariant(weights: Tensor, *, reducer: Reducer | None = None) -> Tensor:
    r"""``(‖w_c‖² − mean_c ‖w_c‖²)² / 4`` per row of a weight matrix (PML
    ``CenterInvariantRegularizer``), reduced (default ``mean()``).

    Reference: Wu et al., "Deep Features Learning with Center Invariant Loss", ICCV workshops 2017.

    Example:
        >>> center_invariant(torch.eye(3))
        tensor(0.)
    """
    w, dtype = _input(weights, "weights")
    sq = (w * w).sum(-1)
    return _reduce((sq - sq.mean()) ** 2 / 4, reducer, mean(), dtype)


def regular_face(weights: Tensor, *, reducer: Reducer | None = None) -> Tensor:
    r"""RegularFace (PML ``RegularFaceRegularizer``): per class, the cosine similarity to its
    nearest other class, ``max_{j≠c} cos(w_c, w_j)``, reduced (default ``mean()``).

    Reference: Zhao et al., "RegularFace: Deep Face Recognition via Exclusive Regularization",
    CVPR 2019.

    Example:
        >>> regular_face(torch.eye(3))
        tensor(0.)
    """
    w, dtype = _input(weights, "weights")
    if w.shape[0] < 2:
        raise ValueError(f"weights needs at least 2 rows (classes), got {w.shape[0]}")
    unit = torch.nn.functional.normalize(w, dim=-1)
    cos = _ops.matmul(unit, unit.T)
    with torch.no_grad():  # the nearest other class, as PML picks it (no gradient through argmax)
        masked = cos.clone().fill_diagonal_(-torch.inf)
        nearest = masked.argmax(-1, keepdim=True)
    return _reduce(cos.gather(-1, nearest).squeeze(-1), reducer, mean(), dtype)


def sparse_centers(
    weights: Tensor,
    *,
    num_classes: int,
    centers_per_class: int,
    reducer: Reducer | None = None,
) -> Tensor:
    r"""SparseCenters (PML ``SparseCentersRegularizer``): for every pair ``j < k`` of centres of
    the same class, ``sqrt(2 + ε − min(2·cos(w_j, w_k), 2))``, summed and divided by twice the
    number of such pairs (default ``divisor()``, as PML).

    ``weights`` are the ``(num_classes · centers_per_class, D)`` centres, class-major (centre ``k``
    of class ``c`` at row ``c · centers_per_class + k``).

    Reference: Qian et al., "SoftTriple Loss: Deep Metric Learning Without Triplet Sampling",
    ICCV 2019.

    Example:
        >>> w = torch.randn(6, 4)
        >>> reg = sparse_centers(w, num_classes=3, centers_per_class=2)
    """
    w, dtype = _input(weights, "weights")
    _checks.integer(num_classes, "num_classes")
    _checks.integer(centers_per_class, "centers_per_class", minimum=2)
    k = centers_per_class
    if w.shape[0] != num_classes * k:
        raise ValueError(
            f"weights must have num_classes * centers_per_class = {num_classes * k} rows, got {w.shape[0]}"
        )
    unit = torch.nn.functional.normalize(w, dim=-1).view(num_classes, k, -1)
    cos = _ops.matmul(unit, unit.transpose(-1, -2))  # (C, K, K): within-class blocks only
    i, j = torch.triu_indices(k, k, offset=1, device=w.device)  # static: no boolean indexing
    sims = cos[:, i, j].reshape(-1)  # (C · K(K−1)/2,), PML's order
    small = torch.finfo(w.dtype).tiny
    reg = torch.sqrt(2.0 + small - torch.clamp(2.0 * sims, max=2.0))
    n_pairs = num_classes * k * (k - 1) // 2
    terms = DenseTerms(reg, torch.ones_like(reg), "element", reg.shape[0], divisor=2 * n_pairs)
    return reduce(divisor() if reducer is None else reducer, {"loss": terms}, None, dtype)


def spherical_embedding(embeddings: Tensor, *, reducer: Reducer | None = None) -> Tensor:
    r"""Spherical embedding constraint: ``(‖x_i‖ − μ)²`` per row with ``μ`` the batch's mean norm
    (not differentiated, as the reference implementation), reduced (default ``mean()``).

    Keeps the embedding norms close to each other so that a cosine-based loss's gradients are
    balanced across samples (a PML 3 addition; PML 2.9.0 has no counterpart).

    Reference: Zhang et al., "Deep Metric Learning with Spherical Embedding", NeurIPS 2020.

    Example:
        >>> spherical_embedding(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor(4.)
    """
    x, dtype = _input(embeddings, "embeddings")
    norms = torch.linalg.vector_norm(x, dim=-1)
    return _reduce((norms - norms.mean().detach()) ** 2, reducer, mean(), dtype)
