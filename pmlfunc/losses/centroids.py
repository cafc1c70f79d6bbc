r"""Centroid-similarity losses: each embedding scored against the centroids of the batch's classes.

| loss | params | per embedding ``e_ji`` (class ``j``) |
|---|---|---|
| :func:`ge2e` | ``{"w": 0-d, "b": 0-d}`` from :func:`ge2e_init` | ``−S_ji,j + log Σ_k e^{S_ji,k}`` or ``1 − σ(S_ji,j) + max_{k≠j} σ(S_ji,k)`` |

The centroids come from the batch itself: no class vectors are learned, only GE2E's similarity
scale ``w`` and bias ``b``. Classes are the distinct labels of the batch, held in static slots
(one slot per row, or ``num_classes`` slots when the labels are class ids in
``[0, num_classes)``), so shapes depend on the batch size only: no host sync, and the loss runs
under ``torch.compile(fullgraph=True)``, ``torch.func`` and on ``device="meta"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .. import params as _params
from .._ops import cross_entropy, inside_transform, matmul
from ..reducers import DenseTerms, Reducer, Terms, mean, reduce
from ._regularize import regularize

__all__ = ["ge2e", "ge2e_init"]

W_MIN = 1e-6  # the lower bound of GE2E's scale: w > 0 (the paper's constraint), as w.clamp(min=...)
VARIANTS = ("softmax", "contrast")


def ge2e(
    embeddings: Tensor,
    labels: Tensor,
    params: dict[str, Tensor],
    *,
    variant: str = "softmax",
    num_classes: int | None = None,
    reducer: Reducer | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Generalized end-to-end (GE2E) loss: each embedding against every class centroid, its own
    class's centroid computed without it.

    With ``ê_ji`` the L2-normalised embedding ``i`` of class ``j`` (the paper's eq. 4: centroids
    are means of unit vectors), ``M_j`` the size of class ``j`` in the batch, the centroids
    ``c_k = (1/M_k) Σ_m ê_km`` and the exclusive centroid
    ``c_j^{(-i)} = (1/(M_j − 1)) Σ_{m≠i} ê_jm`` (eq. 8), the similarities are

    .. math::
        S_{ji,k} = \begin{cases}
            w \cos(ê_{ji}, c_j^{(-i)}) + b & k = j \\
            w \cos(ê_{ji}, c_k) + b & k \ne j
        \end{cases}

    with ``w`` clamped at ``1e-6`` (the paper keeps ``w > 0``; the clamp has a zero gradient
    below the bound, as in common implementations). The loss of ``e_ji`` is, with
    ``variant="softmax"`` (eq. 6) or ``variant="contrast"`` (eq. 7):

    .. math::
        L_{\mathrm{softmax}}(e_{ji}) = -S_{ji,j} + \log \sum_k e^{S_{ji,k}},
        \qquad
        L_{\mathrm{contrast}}(e_{ji}) = 1 - σ(S_{ji,j}) + \max_{k \ne j} σ(S_{ji,k})

    over the classes ``k`` present in the batch. The paper sums the losses; the default
    reducer ``mean()`` averages them (PML 3's ``GE2ELoss``, and the other losses here), and
    ``reducer=pf.reducers.sum()`` gives the paper's sum.

    Numerics: the bias ``b`` is added to every similarity of a row, so it cancels in the
    softmax variant; that variant is the cross entropy of the logits ``w·cos`` alone (no
    rounding of ``b`` enters it, however large ``b`` is) and ``b``'s gradient is exactly 0.
    ``1 − σ(s)`` is computed as ``σ(−s)`` and ``max_k σ(s_k)`` as ``σ(max_k s_k)``. The
    exclusive centroid is the class sum minus the row itself (``O(B·D)``). A non-finite ``w`` or
    ``b`` makes the loss NaN in both variants: a saturated sigmoid would otherwise turn an
    infinite ``w`` into a finite loss with zero gradients.

    Which embeddings have a loss: those whose class has at least two embeddings in the batch.
    A class with one embedding has no exclusive centroid, so that embedding is left out (weight
    0, zero gradient through its own term); its centroid (the embedding itself) is still a
    class that the other embeddings are scored against. If no embedding is left, the loss is
    0 with zero gradients. A batch of one class has no ``k ≠ j``: the softmax loss is 0 and
    the contrast loss is ``1 − σ(S_ji,j)`` (its ``max`` over no class taken as 0).

    Args:
        embeddings: ``(B, D)`` float tensor (the paper's ``N`` speakers × ``M`` utterances, in
            any order and any class sizes).
        labels: ``(B,)`` integer class ids: any values (the distinct labels are the classes,
            ``B`` slots from a stable sort, ``O(B log B)``), or ids in ``[0, num_classes)``
            when ``num_classes`` is given.
        params: ``{"w": 0-d, "b": 0-d}`` floating-point tensors from :func:`ge2e_init`.
        variant: ``"softmax"`` (default) or ``"contrast"``.
        num_classes: if given, the labels are class ids in ``[0, num_classes)`` and the
            similarity matrix is ``(B, num_classes)`` instead of ``(B, B)``: with ``N``
            speakers of ``M`` utterances, ``num_classes=N`` makes it ``M`` times smaller. The
            range is checked eagerly on CPU (a ``ValueError``); under ``torch.compile``,
            ``torch.func`` or on a GPU no values are read and an out-of-range id fails inside
            the indexing op.
        reducer: default ``mean()`` over the embeddings that have a loss; ``sum()`` for the
            paper's sum; any reducer of :mod:`pmlfunc.reducers` over these ``"element"``
            terms (``class_weighted`` weights a term by its label).
        embedding_regularizer: a function of the embeddings returning a 0-d loss, added with
            weight ``embedding_reg_weight``.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = pf.losses.ge2e_init()
        >>> emb = torch.randn(12, 8)
        >>> labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])  # 4 speakers × 3
        >>> loss = pf.losses.ge2e(emb, labels, params)
        >>> loss = pf.losses.ge2e(emb, labels, params, variant="contrast", num_classes=4)
        >>> loss.shape
        torch.Size([])

    Reference: Wan, Wang, Papir, Moreno, "Generalized End-to-End Loss for Speaker
    Verification", ICASSP 2018.
    """
    _checks.embeddings(embeddings)
    _checks.labels(labels, embeddings.shape[0], embeddings.device)
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    w_raw = _scalar_param(params, "w", embeddings)
    b_raw = _scalar_param(params, "b", embeddings)
    cd = _checks.compute_dtype(embeddings.dtype)
    x = embeddings.to(cd)
    w_in, b = w_raw.to(cd), b_raw.to(cd)
    w = w_in.clamp(min=W_MIN)
    slot, k = _slots(labels, num_classes)

    u = F.normalize(x, dim=-1)  # ê: the centroids are means of unit vectors (eq. 4)
    sums = torch.zeros(k, u.shape[-1], dtype=cd, device=u.device).index_add(0, slot, u)
    counts = torch.zeros(k, dtype=cd, device=u.device).index_add(0, slot, torch.ones_like(u[:, 0]))
    # cos(ê, c) is invariant to c's positive scale: the sums stand for the means. No zero
    # vector is normalised (an absent class's sum, a class of one's exclusive centroid): the
    # second derivative of a norm at 0 is NaN, even where the term's weight is 0. Any nonzero
    # row stands in (their columns and terms are masked below).
    present = (counts > 0).unsqueeze(-1)
    cos = matmul(u, F.normalize(torch.where(present, sums, 1.0), dim=-1).t())  # (B, k)
    alone = (counts[slot] < 2).unsqueeze(-1)
    centroid = F.normalize(torch.where(alone, u, sums[slot] - u), dim=-1)
    own_cos = (u * torch.where(alone, 0.0, centroid)).sum(-1)  # cos(ê_ji, c_j^(-i)); 0 alone
    classes = torch.arange(k, device=slot.device)
    own = slot.unsqueeze(-1) == classes  # (B, k)
    others = (counts > 0) & ~own  # the classes present in the batch but the row's own
    z, z_own = w * cos, w * own_cos

    if variant == "softmax":
        # −S_own + log Σ_k e^{S_k} with S = z + b: b cancels, the cross entropy of z alone.
        lowest = torch.finfo(cd).min  # absent classes: e^{lowest − max} = 0, finite gradients
        logits = torch.where(own, z_own.unsqueeze(-1), torch.where(others, z, lowest))
        losses = cross_entropy(logits, slot)
    else:
        # 1 − σ(S_own) = σ(−S_own); max_{k≠j} σ(S_k) = σ(max_{k≠j} S_k): σ is increasing.
        hardest = torch.where(others, z, -torch.inf).amax(-1)  # −inf without another class
        losses = torch.sigmoid(-(z_own + b)) + torch.sigmoid(hardest + b)
    # 0 for finite params (with a zero gradient), NaN for a non-finite w or b: reported, not hidden.
    losses = losses + ((w_in - w_in) + (b - b))

    keep = (counts[slot] >= 2).to(cd)  # a class of one has no exclusive centroid
    terms: dict[str, Terms] = {"loss": DenseTerms(losses, keep, "element", x.shape[0])}
    loss = reduce(mean() if reducer is None else reducer, terms, labels, cd)
    return regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)


def ge2e_init(
    init_w: float = 10.0,
    init_b: float = -5.0,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    """Parameters of :func:`ge2e`: ``{"w": 0-d, "b": 0-d}``, by default the paper's
    ``w = 10``, ``b = −5`` (``init_w`` must be > 0).

    Example:
        >>> {k: float(v) for k, v in pf.losses.ge2e_init().items()}
        {'w': 10.0, 'b': -5.0}
    """
    w = _checks.number(init_w, "init_w", positive=True)
    b = _checks.number(init_b, "init_b")
    return {
        "w": torch.tensor(w, dtype=dtype, device=device),
        "b": torch.tensor(b, dtype=dtype, device=device),
    }


def _scalar_param(params: object, key: str, embeddings: Tensor) -> Tensor:
    """``params[key]``, a 0-d floating-point tensor on the embeddings' device."""
    if not isinstance(params, Mapping):
        raise TypeError(
            "params must be a dict {'w': 0-d tensor, 'b': 0-d tensor} (from "
            f"pf.losses.ge2e_init()), got {type(params).__name__}"
        )
    _params.known_keys(params, ("w", "b"))
    return _params.check(params, key, embeddings, ndim=0)


def _slots(labels: Tensor, num_classes: int | None) -> tuple[Tensor, int]:
    """``(slot, k)``: each row's class slot in ``[0, k)``. Without ``num_classes``, ``k = B``
    and the slots number the distinct labels in sorted order (a stable sort and a running
    count of label changes: no ``unique``, no host sync)."""
    y = labels.long()
    if num_classes is not None:
        k = _checks.integer(num_classes, "num_classes")
        _class_ids(y, k)
        return y, k
    b = y.shape[0]
    order = y.argsort(stable=True)
    ys = y[order]
    first = torch.ones(1, dtype=torch.bool, device=y.device)
    start = torch.cat([first, ys[1:] != ys[:-1]])
    sorted_slot = start.long().cumsum(0) - 1
    return torch.zeros_like(y).scatter(0, order, sorted_slot), b


def _class_ids(labels: Tensor, num_classes: int) -> None:
    """Eager-only check that the labels are class ids in ``[0, num_classes)``: on CPU tensors
    outside ``torch.compile`` and ``torch.func`` (reading values elsewhere would sync or break
    a trace)."""
    if torch.compiler.is_compiling() or labels.device.type != "cpu" or inside_transform():
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"labels must be class ids in [0, {num_classes}) with num_classes={num_classes}, "
            f"got values in [{lo}, {hi}] (leave num_classes=None for any integer labels)"
        )
