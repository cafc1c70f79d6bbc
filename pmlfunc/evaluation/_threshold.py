"""The verification threshold: :func:`select_threshold` and its :class:`ThresholdResult`."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _checks


class ThresholdResult(NamedTuple):
    """The best threshold of :func:`select_threshold` and the metric value it reaches."""

    threshold: Tensor
    """0-d, in ``distances``' dtype; ``-inf`` (``+inf`` for similarities) when predicting no
    match at all is best; NaN when ``distances`` has a non-finite entry."""
    score: Tensor
    """0-d float64: the metric at ``threshold``; NaN when ``distances`` has a non-finite entry."""


_THRESHOLD_METRICS = ("accuracy", "balanced_accuracy", "f1")


def select_threshold(
    distances: Tensor,
    is_match: Tensor,
    *,
    metric: str = "accuracy",
    is_similarity: bool = False,
) -> ThresholdResult:
    """The distance threshold that best separates matching from non-matching pairs.

    A pair is predicted a match when ``distance <= threshold`` (``similarity >= threshold``
    with ``is_similarity=True``). Over every candidate threshold (each
    distinct value in ``distances``, plus "no match at all"), with ``TP, FP, TN, FN`` the
    confusion counts and ``P = TP + FN``, ``N = FP + TN``:

    - ``accuracy = (TP + TN) / (P + N)``;
    - ``balanced_accuracy = (TP / P + TN / N) / 2`` (a rate with an empty denominator is 0);
    - ``f1 = 2 TP / (2 TP + FP + FN)`` (0 when there is no positive at all).

    It returns the threshold with the highest value, the strictest one (smallest distance,
    largest similarity) among equal values. One sort and cumulative counts, ``O(N log N)``; no
    loop over candidates, no host synchronisation (static shapes).

    Non-finite distances: a NaN or ±inf entry (the trace of a non-finite embedding) makes both
    ``threshold`` and ``score`` NaN: no threshold is chosen from a broken pair, and it is not
    counted as a (mis)classified pair either. Drop such pairs first to score the others.

    Args:
        distances: pair distances (similarities with ``is_similarity``), any shape, at least
            one element, floating point.
        is_match: same shape, bool (or 0/1 integers): whether each pair is a true match.
        metric: ``"accuracy"``, ``"balanced_accuracy"`` or ``"f1"``.
        is_similarity: ``distances`` holds similarities (larger = more alike).

    Returns:
        :class:`ThresholdResult` ``(threshold, score)``, both NaN for non-finite ``distances``.

    Example:
        >>> d = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.9])
        >>> same = torch.tensor([True, True, False, False, True])
        >>> select_threshold(d, same)  # 0.1 and 0.4 both classify 3 of 5: the stricter wins
        ThresholdResult(threshold=tensor(0.1000), score=tensor(0.6000, dtype=torch.float64))
        >>> select_threshold(d, same, metric="f1")
        ThresholdResult(threshold=tensor(0.9000), score=tensor(0.7500, dtype=torch.float64))
    """
    distances = _checks.tensor(distances, "distances")
    if not distances.dtype.is_floating_point:
        raise TypeError(f"distances must be a floating-point tensor, got {distances.dtype}")
    if distances.numel() == 0:
        raise ValueError("distances is empty; at least one pair is required")
    is_match = _checks.tensor(is_match, "is_match")
    if is_match.dtype.is_floating_point or is_match.dtype.is_complex:
        raise TypeError(f"is_match must be a bool (or integer) tensor, got {is_match.dtype}")
    if is_match.shape != distances.shape:
        raise ValueError(
            f"is_match has shape {tuple(is_match.shape)} but distances has "
            f"{tuple(distances.shape)} (one flag per pair)"
        )
    if is_match.device != distances.device:
        raise ValueError(f"is_match is on {is_match.device} but distances is on {distances.device}")
    if metric not in _THRESHOLD_METRICS:
        raise ValueError(f"metric must be one of {_THRESHOLD_METRICS}, got {metric!r}")
    with torch.no_grad():
        key = distances.detach().flatten()
        if is_similarity:
            key = -key
        key, order = key.sort(stable=True)
        match = is_match.flatten().gather(0, order) != 0
        n = key.shape[0]
        tp = match.to(torch.int64).cumsum(0)
        fp = torch.arange(1, n + 1, device=key.device) - tp
        zero = torch.zeros(1, dtype=torch.int64, device=key.device)
        tp = torch.cat([zero, tp]).to(torch.float64)  # candidate 0: nothing predicted a match
        fp = torch.cat([zero, fp]).to(torch.float64)
        pos = match.to(torch.float64).sum()  # P
        neg = n - pos
        tn, fn = neg - fp, pos - tp
        # Each score is one correctly rounded division of exact integers, so candidates with
        # equal values compare equal and the strictest one wins (argmax: the first maximum).
        if metric == "accuracy":
            score = (tp + tn) / n
        elif metric == "balanced_accuracy":
            p1, n1 = pos.clamp_min(1), neg.clamp_min(1)
            score = (tp * n1 + tn * p1) / (2 * p1 * n1)
        else:
            score = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
        # A threshold at key[i] predicts all of key[:i+1]: only the last of equal values counts.
        last = torch.cat([key[1:] != key[:-1], key.new_ones(1, dtype=torch.bool)])
        valid = torch.cat([last.new_ones(1), last])
        best = score.masked_fill(~valid, -math.inf).argmax()
        inf = key.new_full((1,), -math.inf)
        threshold = torch.cat([inf, key]).gather(0, best.reshape(1)).squeeze(0)
        if is_similarity:
            threshold = -threshold
        broken = ~key.isfinite().all()  # 0-d: no host sync
        best_score = score.gather(0, best.reshape(1)).squeeze(0)
        return ThresholdResult(
            threshold.masked_fill(broken, math.nan), best_score.masked_fill(broken, math.nan)
        )
