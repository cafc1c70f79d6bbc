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

from .tuples import check_tuple, grid_counts, is_mined

__all__ = [
    "PairMasks",
    "any_pairs",
    "check_tuple",
    "label_masks",
    "pair_masks",
    "tuple_masks",
]


class PairMasks(NamedTuple):
    """Pair weights over the ``(B, M)`` grid: ``pos[i, j]`` / ``neg[i, j]`` count how often
    ``(i, j)`` is a positive / negative pair (0/1 when built from labels)."""

    pos: Tensor
    neg: Tensor


def label_masks(
    labels: Tensor,
    ref_labels: Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    rows: tuple[int, int] | None = None,
) -> PairMasks:
    """Positive and negative masks from labels, with the reference-set rule.

    ``pos[i, j] = [labels_i == ref_labels_j]`` (and ``i != j`` when ``ref_labels is None``),
    ``neg[i, j] = [labels_i != ref_labels_j]``. ``rows = (r0, r1)``: only anchors ``r0 ≤ i < r1``
    (a chunk), still against every reference.

    Example:
        >>> label_masks(torch.tensor([0, 0, 1])).pos
        tensor([[0., 1., 0.],
                [1., 0., 0.],
                [0., 0., 0.]])
    """
    ref = labels if ref_labels is None else ref_labels
    r0, r1 = (0, labels.shape[-1]) if rows is None else rows
    pos = (labels[..., r0:r1].unsqueeze(-1) == ref.unsqueeze(-2)).to(dtype)
    neg = 1.0 - pos
    if ref_labels is None:  # a fresh mask: in place is safe
        pos.diagonal(offset=r0, dim1=-2, dim2=-1).zero_()
    return PairMasks(pos, neg)


def tuple_masks(
    indices_tuple,
    shape: tuple[int, int],
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
    rows: tuple[int, int] | None = None,
) -> PairMasks:
    """Pair-count masks from a PML index tuple: pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``
    (a triplet tuple contributes its ``(a, p)`` and ``(a, n)`` pairs, as PML's ``convert_to_pairs``).

    Indices are range-checked and negative ones wrapped by
    :func:`~pmlfunc.tuples.check_tuple`.

    Example:
        >>> a, p, n = torch.tensor([0]), torch.tensor([1]), torch.tensor([2])
        >>> tuple_masks((a, p, n), (3, 3)).neg
        tensor([[0., 0., 1.],
                [0., 0., 0.],
                [0., 0., 0.]])
    """
    t = check_tuple(indices_tuple, shape)
    if device is None:
        device = t[0].device
    a1, p, a2, n = (t[0], t[1], t[0], t[2]) if len(t) == 3 else t
    a1, p, a2, n = (x.to(device) for x in (a1, p, a2, n))
    return PairMasks(grid_counts(a1, p, shape, dtype, rows), grid_counts(a2, n, shape, dtype, rows))


def pair_masks(
    labels: Tensor | None,
    ref_labels: Tensor | None,
    indices_tuple,
    shape: tuple[int, int],
    *,
    dtype: torch.dtype,
    device,
    rows: tuple[int, int] | None = None,
) -> PairMasks:
    """The masks a loss uses: from ``indices_tuple`` when given, else from the labels (for the
    anchor ``rows`` of a chunk only, when given)."""
    if is_mined(indices_tuple):
        return PairMasks(*indices_tuple.pair_masks(shape, dtype, rows))
    if indices_tuple is not None:
        return tuple_masks(indices_tuple, shape, dtype=dtype, device=device, rows=rows)
    if labels is None:
        raise ValueError("labels and indices_tuple cannot both be None")
    return label_masks(labels, ref_labels, dtype=dtype, rows=rows)


def any_pairs(
    labels: Tensor | None, ref_labels: Tensor | None, indices_tuple, device
) -> tuple[Tensor, Tensor]:
    """``(has_pos, has_neg)``: whether the batch has any positive / negative pair, as 0-d bool
    tensors, without building the ``B × M`` masks (so a chunk can ask about the whole batch)."""
    if is_mined(indices_tuple):
        return indices_tuple.any_pairs()
    if indices_tuple is not None:  # the tuple's lengths are shapes: a static answer
        t = check_tuple(indices_tuple)
        n_pos, n_neg = (
            (t[0].shape[0], t[0].shape[0]) if len(t) == 3 else (t[0].shape[0], t[2].shape[0])
        )
        return (  # filled on the device: no host-to-device copy (CUDA-graph capture)
            torch.full((), n_pos > 0, dtype=torch.bool, device=device),
            torch.full((), n_neg > 0, dtype=torch.bool, device=device),
        )
    if labels is None:
        raise ValueError("labels and indices_tuple cannot both be None")
    lo, hi = labels.amin(), labels.amax()
    if ref_labels is None:
        ordered = labels.sort().values
        has_pos = (ordered[1:] == ordered[:-1]).any()
        return has_pos, lo != hi
    has_pos = torch.isin(labels, ref_labels).any()
    has_neg = (lo != hi) | (ref_labels.amin() != ref_labels.amax()) | (lo != ref_labels.amin())
    return has_pos, has_neg
