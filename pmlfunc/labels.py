"""Positive/negative pair masks, the reference-set rule and PML index-tuple conversion.

All masks are ``(B, M)`` tensors over the query × reference grid, so their shapes depend on shapes
only. Pair *weights* are counts: a PML index tuple that lists the same pair twice gives weight 2,
which is what PML's pair-based losses compute (they index ``mat[a, p]`` once per listed pair).

Reference-set rule: with ``ref_labels=None`` the batch is compared with itself and the diagonal
(``i == j``) is never a positive pair; a given reference set is separate and nothing is excluded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["PairMasks", "check_tuple", "label_masks", "pair_masks", "tuple_masks"]


class PairMasks(NamedTuple):
    """Pair weights over the ``(B, M)`` grid: ``pos[i, j]`` / ``neg[i, j]`` count how often
    ``(i, j)`` is a positive / negative pair (0/1 when built from labels)."""

    pos: Tensor
    neg: Tensor


def label_masks(
    labels: Tensor, ref_labels: Tensor | None = None, *, dtype: torch.dtype = torch.float32
) -> PairMasks:
    """Positive and negative masks from labels, with the reference-set rule.

    ``pos[i, j] = [labels_i == ref_labels_j]`` (and ``i != j`` when ``ref_labels is None``),
    ``neg[i, j] = [labels_i != ref_labels_j]``.

    Example:
        >>> label_masks(torch.tensor([0, 0, 1])).pos
        tensor([[0., 1., 0.],
                [1., 0., 0.],
                [0., 0., 0.]])
    """
    ref = labels if ref_labels is None else ref_labels
    pos = (labels.unsqueeze(-1) == ref.unsqueeze(-2)).to(dtype)
    neg = 1.0 - pos
    if ref_labels is None:
        pos.diagonal(dim1=-2, dim2=-1).zero_()  # a fresh mask: in place is safe
    return PairMasks(pos, neg)


def _counts(
    rows: Tensor, cols: Tensor, shape: tuple[int, int], dtype: torch.dtype, device
) -> Tensor:
    flat = rows.reshape(-1).long() * shape[1] + cols.reshape(-1).long()
    out = torch.zeros(shape[0] * shape[1], dtype=dtype, device=device)
    out = out.index_add(0, flat, torch.ones(flat.shape, dtype=dtype, device=device))
    return out.view(shape)


def check_tuple(indices_tuple: object) -> tuple[Tensor, ...]:
    """Validate a PML index tuple (3 or 4 1-D integer tensors of matching lengths)."""
    if not isinstance(indices_tuple, (tuple, list)) or len(indices_tuple) not in (3, 4):
        raise ValueError(
            "indices_tuple must be a tuple of 3 (anchors, positives, negatives) or 4 (a1, p, a2, n) index tensors"
        )
    for i, t in enumerate(indices_tuple):
        if not isinstance(t, Tensor):
            raise TypeError(f"indices_tuple[{i}] must be a tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"indices_tuple[{i}] must be an integer index tensor, got {t.dtype}")
        if t.ndim != 1:
            raise ValueError(f"indices_tuple[{i}] must be 1-D, got shape {tuple(t.shape)}")
    n = len(indices_tuple)
    lengths = [t.shape[0] for t in indices_tuple]
    if n == 3 and len(set(lengths)) != 1:
        raise ValueError(f"indices_tuple (a, p, n) tensors must have equal lengths, got {lengths}")
    if n == 4 and (lengths[0] != lengths[1] or lengths[2] != lengths[3]):
        raise ValueError(
            f"indices_tuple (a1, p, a2, n) needs len(a1) == len(p) and len(a2) == len(n), got {lengths}"
        )
    return tuple(indices_tuple)


def tuple_masks(
    indices_tuple, shape: tuple[int, int], *, dtype: torch.dtype = torch.float32, device=None
) -> PairMasks:
    """Pair-count masks from a PML index tuple: pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``
    (a triplet tuple contributes its ``(a, p)`` and ``(a, n)`` pairs, as PML's ``convert_to_pairs``).

    Indices are not range-checked here (that would need a host sync); out-of-range indices raise
    inside ``index_add`` in eager mode.

    Example:
        >>> a, p, n = torch.tensor([0]), torch.tensor([1]), torch.tensor([2])
        >>> tuple_masks((a, p, n), (3, 3)).neg
        tensor([[0., 0., 1.],
                [0., 0., 0.],
                [0., 0., 0.]])
    """
    t = check_tuple(indices_tuple)
    if device is None:
        device = t[0].device
    a1, p, a2, n = (t[0], t[1], t[0], t[2]) if len(t) == 3 else t
    return PairMasks(_counts(a1, p, shape, dtype, device), _counts(a2, n, shape, dtype, device))


def pair_masks(
    labels: Tensor | None,
    ref_labels: Tensor | None,
    indices_tuple,
    shape: tuple[int, int],
    *,
    dtype: torch.dtype,
    device,
) -> PairMasks:
    """The masks a loss uses: from ``indices_tuple`` when given, else from the labels."""
    if indices_tuple is not None:
        return tuple_masks(indices_tuple, shape, dtype=dtype, device=device)
    if labels is None:
        raise ValueError("labels and indices_tuple cannot both be None")
    return label_masks(labels, ref_labels, dtype=dtype)
