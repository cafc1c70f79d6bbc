r"""In-batch hardest-negative losses: (anchor, positive) pairs whose negatives are mined from
the batch's other positives.

| function | inputs | per anchor ``i`` | sentence-transformers |
|---|---|---|---|
| :func:`mega_batch_margin` | ``anchors`` ``a``, ``positives`` ``p`` | ``[m⁺ − cos(a_i, p_i)]_+ + [max_{j≠i} cos(a_i, p_j) − m⁻]_+`` | ``MegaBatchMarginLoss`` |

This module is apart from :mod:`pmlfunc.losses.graded` (losses that learn from given gold or
teacher scores) because its loss is given no score: the only supervision is which positive
belongs to which anchor, and each anchor's negative is found in the batch, so a larger batch
gives harder negatives (Wieting & Gimpel's "mega-batching"). It is not
:func:`~pmlfunc.losses.multiple_negatives_ranking` either: one negative an anchor, a hinge
instead of a softmax.

The mining is a hard choice, not a function to differentiate: the hardest negative's column
``j*(i) = argmax_{j≠i} cos(a_i, p_j)`` is found on detached rows (the first of equal maxima, as
``torch.max`` picks), and the loss is computed from the chosen pairs alone. Its gradient is the
one the full matrix's ``max`` would give, from an autograd graph of ``O(N · D)``, and
``chunk_size`` bounds the mining's similarity block to ``chunk_size × N``: the value and the
gradient do not depend on it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks
from .._ops import matmul, unit_rows

__all__ = ["mega_batch_margin"]


def mega_batch_margin(
    anchors: Tensor,
    positives: Tensor,
    *,
    positive_margin: float | Tensor = 0.8,
    negative_margin: float | Tensor = 0.3,
    chunk_size: int | None = None,
) -> Tensor:
    r"""Mega-batch margin loss: each anchor near its positive, far from the hardest other one.

    With ``c_ij = cos(a_i, p_j)``, the positive margin ``m⁺`` and the negative margin ``m⁻``:

    .. math::
        L = \frac{1}{N} \sum_{i=1}^{N} \Big( [m^{+} - c_{ii}]_{+}
            + \big[\max_{j \ne i} c_{ij} - m^{-}\big]_{+} \Big)

    (``[x]_+ = max(x, 0)``, whose gradient at 0 is 0, as ``F.relu``'s). A one-row batch has no
    negative: its second term is 0.

    sentence-transformers' ``MegaBatchMarginLoss(model, positive_margin=m⁺,
    negative_margin=m⁻)`` on the columns ``(anchor, positive)`` is
    ``mega_batch_margin(a, p, positive_margin=m⁺, negative_margin=m⁻)``, with either
    ``use_mini_batched_version`` (its mini-batches change neither the value nor the gradient):
    ``chunk_size=mini_batch_size`` bounds the loss's own memory as its ``mini_batch_size``
    bounds its similarity block; for the encoder's activations, the GradCache pattern of
    ``examples/gradcache.py``.

    Args:
        anchors: ``(N, D)`` float tensor.
        positives: ``(N, D)`` float tensor, row ``i`` the positive of anchor ``i``; every other
            row is a candidate negative of anchor ``i``.
        positive_margin: ``m⁺``, a number or 0-d tensor (default ``0.8``).
        negative_margin: ``m⁻``, a number or 0-d tensor (default ``0.3``).
        chunk_size: anchors mined at a time (``None``: all ``N``): the similarity block is
            ``chunk_size × N``; the autograd graph is ``O(N · D)`` either way.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> a, p = torch.randn(16, 8), torch.randn(16, 8)
        >>> loss = pf.losses.mega_batch_margin(a, p)
        >>> bool(torch.isclose(loss, pf.losses.mega_batch_margin(a, p, chunk_size=5)))
        True

    References: Wieting & Gimpel, "ParaNMT-50M: Pushing the Limits of Paraphrastic Sentence
    Embeddings with Millions of Machine Translations", ACL 2018.
    """
    a, p = _checks.paired_rows(anchors, positives, ("anchors", "positives"), "mega_batch_margin")
    n = a.shape[0]
    chunk = n if chunk_size is None else min(_checks.chunk_size(chunk_size), n)
    cd = _checks.compute_dtype(a.dtype)
    m_pos = _margin(positive_margin, "positive_margin", cd, a.device)
    m_neg = _margin(negative_margin, "negative_margin", cd, a.device)
    a, p = unit_rows(a.to(cd)), unit_rows(p.to(cd))
    loss = torch.relu(m_pos - (a * p).sum(-1))
    if n > 1:  # a one-row batch has no negative (sentence-transformers: max over -inf, relu 0)
        hardest = _hardest(a.detach(), p.detach(), chunk)
        loss = loss + torch.relu((a * p.index_select(0, hardest)).sum(-1) - m_neg)
    return loss.sum() / n


def _margin(value: object, name: str, cd: torch.dtype, device) -> float | Tensor:
    m = _checks.hyper(value, name)
    return m.to(dtype=cd, device=device) if isinstance(m, Tensor) else m


def _hardest(a: Tensor, p: Tensor, chunk: int) -> Tensor:
    """``(N,)`` int64: for each anchor row the column of its most similar other positive (the
    first of equal maxima; a NaN similarity is the maximum, so it reaches the loss), mined
    ``chunk`` anchors at a time."""
    n = a.shape[0]
    cols = torch.arange(n, device=a.device)
    out = []
    for start in range(0, n, chunk):
        sims = matmul(a[start : start + chunk], p.transpose(0, 1))
        own = cols[start : start + chunk].unsqueeze(1) == cols.unsqueeze(0)
        out.append(sims.masked_fill(own, -torch.inf).argmax(dim=1))
    return out[0] if len(out) == 1 else torch.cat(out)
