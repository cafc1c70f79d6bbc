r"""Miners: PML's miners as pure functions with fixed-shape results.

Every miner is ``miner(embeddings, labels, *, <PML's kwargs>, distance=None, ref_emb=None,
ref_labels=None, mat=None, tuples_per_anchor=None, generator=None)`` and returns one of the
fixed-shape results of :mod:`pmlfunc.tuples`, which every loss accepts as ``indices_tuple``.
Shapes depend on shapes only: no ``nonzero``, no boolean indexing, no host sync, so a miner and
its loss compile together with ``torch.compile(fullgraph=True)`` and run inside a CUDA graph.

- ``mat``: a precomputed ``(B, M)`` matrix of ``distance`` (one matrix can serve the miner and
  several losses). Miners never differentiate: they read ``mat.detach()``.
- ``tuples_per_anchor=k``: at most ``k`` tuples per anchor, a uniform random subset without
  replacement of what the miner selects, of static size. Pair miners keep at most ``k`` positive
  and at most ``k`` negative pairs per anchor; triplet miners at most ``k`` triplets per anchor
  (a :class:`~pmlfunc.tuples.MinedTriplets` of length ``B·k``).
- ``generator``: randomness is always explicit. A ``torch.Generator`` (eager) or a 0-d integer
  seed tensor (under ``torch.compile`` and in CUDA graphs); the same generator state gives the
  same result. Required by the stochastic miners and by ``tuples_per_anchor``.

The reference-set rule is the losses' one: without ``ref_emb`` the batch is mined against itself
and ``(i, i)`` is never a pair; a given reference set is separate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _checks, _ops
from ._inputs import matrix, validate
from ._random import seed_tensor, uniform
from .distances import Distance, cosine, lp, resolve
from .tuples import (
    CUBE_BLOCK,
    MinedPairs,
    MinedTriplets,
    PackagedTriplets,
    TripletMask,
    TripletWindow,
    random_subset,
    sample_pairs,
    sample_without_replacement,
    source_of,
)

__all__ = [
    "angular",
    "batch_easy_hard",
    "batch_hard",
    "distance_weighted",
    "embeddings_already_packaged_as_triplets",
    "hdc",
    "multi_similarity",
    "pair_margin",
    "triplet_margin",
    "uniform_histogram",
]

_STRATEGIES = ("hard", "semihard", "easy", "all")
_TRIPLET_TYPES = ("all", "hard", "semihard", "easy")


def _tuples_per_anchor(k: object) -> int | None:
    return None if k is None else _checks.integer(k, "tuples_per_anchor")


class _Setup:
    """A miner's validated inputs: the detached matrix, its orientation and the label masks."""

    def __init__(
        self,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        mat,
        distance,
        default,
        tuples_per_anchor,
        generator,
        *,
        stochastic=False,
        need_matrix=True,
    ):
        if labels is None:
            raise ValueError("labels is required by a miner")
        validate(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
        self.distance: Distance = resolve(distance, default)
        self.k = _tuples_per_anchor(tuples_per_anchor)
        device = embeddings.device
        self._seed = seed_tensor(generator, device) if (stochastic or self.k is not None) else None
        # (angular works on the embeddings themselves: no matrix)
        self._mat = (
            matrix(embeddings, ref_emb, mat, self.distance, needs_grad=False).detach()
            if need_matrix
            else None
        )
        self.sign = self.distance.sign()
        self.is_similarity = self.distance.is_similarity
        ref = labels if ref_emb is None else ref_labels
        self.neg = labels.unsqueeze(-1) != ref.unsqueeze(0)
        self.pos = ~self.neg
        if ref_emb is None:  # the reference-set rule: (i, i) is never a pair
            self.pos.fill_diagonal_(False)
        self.source = source_of(self.distance, (mat,) if mat is not None else (embeddings, ref_emb))

    @property
    def mat(self) -> Tensor:
        """The detached ``(B, M)`` matrix (built unless ``need_matrix=False``)."""
        assert self._mat is not None, "this miner's setup built no matrix (need_matrix=False)"
        return self._mat

    @property
    def seed(self) -> Tensor:
        """The 0-d seed tensor (drawn for a stochastic miner or with ``tuples_per_anchor``)."""
        assert self._seed is not None, "this miner's setup drew no seed (not stochastic, no k)"
        return self._seed

    @property
    def e(self) -> Tensor:
        """The matrix oriented so that smaller means closer."""
        return self.mat if self.sign == 1.0 else -self.mat

    def bound_pairs(self, pos: Tensor, neg: Tensor) -> MinedPairs:
        """Pair masks, bounded to ``k`` per anchor (each side) when ``tuples_per_anchor`` is set."""
        dtype = self.mat.dtype
        pos, neg = pos.to(dtype), neg.to(dtype)
        if self.k is not None:
            pos = sample_pairs(pos, self.k, self.seed, 101)
            neg = sample_pairs(neg, self.k, self.seed, 102)
        return MinedPairs(pos, neg)


# --------------------------------------------------------------------------------------------
# Pair miners


def pair_margin(
    embeddings: Tensor,
    labels: Tensor,
    *,
    pos_margin: float | Tensor = 0.2,
    neg_margin: float | Tensor = 0.8,
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedPairs:
    r"""Pairs that violate a margin (PML ``PairMarginMiner``).

    Positive pairs with ``d_ap > pos_margin`` and negative pairs with ``d_an < neg_margin``
    (for a similarity: ``s_ap < pos_margin`` and ``s_an > neg_margin``).

    Args:
        embeddings: ``(B, D)``; labels: ``(B,)`` class ids.
        pos_margin: default ``0.2``; neg_margin: default ``0.8``.
        distance: default ``lp()``; ref_emb, ref_labels: a separate reference set; mat: a
            precomputed ``(B, M)`` matrix of ``distance``.
        tuples_per_anchor, generator: see the module docstring.

    Returns:
        :class:`~pmlfunc.tuples.MinedPairs`.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> pairs = pair_margin(emb, labels, pos_margin=0.2, neg_margin=1.4)
        >>> loss = pf.losses.contrastive(emb, labels, indices_tuple=pairs)

    Reference: the pair selection of Hadsell et al., CVPR 2006 (contrastive loss).
    """
    s = _Setup(
        embeddings, labels, ref_emb, ref_labels, mat, distance, lp(), tuples_per_anchor, generator
    )
    pm = _checks.hyper(pos_margin, "pos_margin")
    nm = _checks.hyper(neg_margin, "neg_margin")
    m = s.mat
    if s.is_similarity:
        pos, neg = s.pos & (m < pm), s.neg & (m > nm)
    else:
        pos, neg = s.pos & (m > pm), s.neg & (m < nm)
    return s.bound_pairs(pos, neg)


def multi_similarity(
    embeddings: Tensor,
    labels: Tensor,
    *,
    epsilon: float | Tensor = 0.1,
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedPairs:
    r"""Multi-similarity pair mining (PML ``MultiSimilarityMiner``).

    With a similarity ``s``: a positive pair is kept when ``s_ap − ε < max_n s_an`` (it is
    harder than the anchor's hardest negative, within ε), a negative when
    ``s_an + ε > min_p s_ap``. A distance flips both comparisons. An anchor without negatives
    (positives) keeps no positives (negatives).

    Args:
        epsilon: default ``0.1``; distance: default ``cosine()``; the rest as in
            :func:`pair_margin`.

    Returns:
        :class:`~pmlfunc.tuples.MinedPairs`.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> pairs = multi_similarity(emb, labels, epsilon=0.1)

    Reference: Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep Metric
    Learning", CVPR 2019.
    """
    s = _Setup(
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        mat,
        distance,
        cosine(),
        tuples_per_anchor,
        generator,
    )
    eps = _checks.hyper(epsilon, "epsilon")
    m = s.mat
    inf = torch.inf
    if s.is_similarity:
        hardest_neg = torch.where(s.neg, m, -inf).amax(-1, keepdim=True)
        hardest_pos = torch.where(s.pos, m, inf).amin(-1, keepdim=True)
        pos = s.pos & (m - eps < hardest_neg)
        neg = s.neg & (m + eps > hardest_pos)
    else:
        hardest_neg = torch.where(s.neg, m, inf).amin(-1, keepdim=True)
        hardest_pos = torch.where(s.pos, m, -inf).amax(-1, keepdim=True)
        pos = s.pos & (m + eps > hardest_neg)
        neg = s.neg & (m - eps < hardest_pos)
    return s.bound_pairs(pos, neg)


def hdc(
    embeddings: Tensor,
    labels: Tensor,
    *,
    filter_percentage: float = 0.5,
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedPairs:
    r"""Hard-aware cascaded mining (PML ``HDCMiner``): the hardest
    ``⌈filter_percentage · P⌉`` of the batch's ``P`` positive pairs (largest distances) and
    likewise of its negative pairs (smallest distances).

    Ranks are taken over the whole batch by one sort (ties broken by position; PML's ``topk``
    breaks them arbitrarily).

    Args:
        filter_percentage: in ``(0, 1]``, default ``0.5``; the rest as in :func:`pair_margin`.

    Returns:
        :class:`~pmlfunc.tuples.MinedPairs`.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> pairs = hdc(emb, labels, filter_percentage=0.3)

    Reference: Yuan, Yang, Zhang, "Hard-Aware Deeply Cascaded Embedding", ICCV 2017.
    """
    filter_percentage = _checks.number(filter_percentage, "filter_percentage")
    if not 0 < filter_percentage <= 1:
        raise ValueError(f"filter_percentage must be in (0, 1], got {filter_percentage}")
    s = _Setup(
        embeddings, labels, ref_emb, ref_labels, mat, distance, lp(), tuples_per_anchor, generator
    )
    e = s.e  # the hardest positives have the largest e, the hardest negatives the smallest
    pos = _hardest_fraction(-e, s.pos, float(filter_percentage))
    neg = _hardest_fraction(e, s.neg, float(filter_percentage))
    return s.bound_pairs(pos, neg)


def _hardest_fraction(key: Tensor, mask: Tensor, fraction: float) -> Tensor:
    """The ``⌈fraction · #mask⌉`` masked entries with the smallest ``key`` (over all rows)."""
    flat = torch.where(mask, key, torch.inf).reshape(-1)
    order = flat.argsort(stable=True)
    k = torch.ceil(fraction * mask.sum().to(torch.float64))
    rank_ok = torch.arange(flat.numel(), device=key.device) < k
    keep = torch.zeros_like(rank_ok).scatter(0, order, rank_ok)
    return keep.view(mask.shape) & mask


def uniform_histogram(
    embeddings: Tensor,
    labels: Tensor,
    *,
    num_bins: int = 100,
    pos_per_bin: int = 10,
    neg_per_bin: int = 10,
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedPairs:
    r"""Pairs spread uniformly over the distance range (PML ``UniformHistogramMiner``).

    The positive pairs' distances are split into ``num_bins`` equal-width bins between their
    minimum and maximum; from every non-empty bin ``pos_per_bin`` pairs are drawn uniformly with
    replacement (likewise for negatives). Repeated draws are multiplicities in the result.

    Args:
        num_bins: default ``100``; pos_per_bin, neg_per_bin: default ``10``; generator:
            required; the rest as in :func:`pair_margin`. With ``tuples_per_anchor`` the bound
            applies to distinct pairs (each kept once).

    Returns:
        :class:`~pmlfunc.tuples.MinedPairs` (``num_bins · pos_per_bin`` positive draws).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> pairs = uniform_histogram(emb, labels, num_bins=4, generator=torch.Generator().manual_seed(0))
    """
    for name, v in (
        ("num_bins", num_bins),
        ("pos_per_bin", pos_per_bin),
        ("neg_per_bin", neg_per_bin),
    ):
        _checks.integer(v, name)
    s = _Setup(
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        mat,
        distance,
        lp(),
        None,
        generator,
        stochastic=True,
    )
    s.k = _tuples_per_anchor(tuples_per_anchor)
    pos = _histogram_draws(s.mat, s.pos, num_bins, pos_per_bin, s.seed, 1)
    neg = _histogram_draws(s.mat, s.neg, num_bins, neg_per_bin, s.seed, 2)
    if s.k is not None:
        return s.bound_pairs(pos > 0, neg > 0)
    return MinedPairs(pos, neg)


def _histogram_draws(
    m: Tensor, mask: Tensor, num_bins: int, per_bin: int, seed: Tensor, stream: int
) -> Tensor:
    flat_m, flat_mask = m.reshape(-1), mask.reshape(-1)
    lo = torch.where(flat_mask, flat_m, torch.inf).amin()
    hi = torch.where(flat_mask, flat_m, -torch.inf).amax()
    any_pair = flat_mask.any()
    lo, hi = torch.where(any_pair, lo, 0.0), torch.where(any_pair, hi, 0.0)
    steps = torch.arange(num_bins + 1, device=m.device, dtype=m.dtype)
    # torch.linspace's formula: start + i·step from the start for the first half, end − (n−i)·step
    # from the end for the second half (so the last edge is exactly the maximum).
    step = (hi - lo) / num_bins
    half = (num_bins + 1) // 2
    edges = torch.where(steps < half, lo + step * steps, hi - step * (num_bins - steps))
    bins = (torch.searchsorted(edges, flat_m.contiguous(), right=True) - 1).clamp(0, num_bins - 1)
    bins = torch.where(flat_mask, bins, num_bins)  # non-pairs sort after every bin
    order = bins.argsort(stable=True)
    counts = torch.zeros(num_bins + 1, dtype=torch.int64, device=m.device).index_add(
        0, bins, torch.ones_like(bins)
    )[:num_bins]
    starts = counts.cumsum(0) - counts
    u = uniform(seed, stream, (num_bins, per_bin), torch.float64, m.device)
    r = (u * counts.unsqueeze(-1).to(torch.float64)).floor().long()
    r = torch.minimum(r, (counts - 1).clamp_min(0).unsqueeze(-1))
    picked = order[(starts.unsqueeze(-1) + r).clamp_max(flat_m.numel() - 1)]
    valid = (counts > 0).unsqueeze(-1).expand(num_bins, per_bin).to(m.dtype)
    out = torch.zeros(flat_m.numel(), dtype=m.dtype, device=m.device)
    return out.index_add(0, picked.reshape(-1), valid.reshape(-1)).view(m.shape)


def batch_easy_hard(
    embeddings: Tensor,
    labels: Tensor,
    *,
    pos_strategy: str = "easy",
    neg_strategy: str = "semihard",
    allowed_pos_range: tuple[float, float] | None = None,
    allowed_neg_range: tuple[float, float] | None = None,
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedPairs:
    r"""One positive and one negative per anchor by strategy (PML ``BatchEasyHardMiner``).

    Strategies: ``"hard"`` (farthest positive / closest negative), ``"easy"`` (closest positive
    / farthest negative), ``"semihard"`` (the farthest positive still closer than the chosen
    negative, or the closest negative still farther than the chosen positive), ``"all"`` (every
    pair on that side). ``allowed_*_range = (low, high)`` keeps only pairs with ``low ≤ d ≤ high``. An anchor
    is kept when both of its sides found a pair.

    Args:
        pos_strategy: default ``"easy"``; neg_strategy: default ``"semihard"``;
            allowed_pos_range, allowed_neg_range: default ``None``; the rest as in
            :func:`pair_margin`.

    Returns:
        :class:`~pmlfunc.tuples.MinedPairs` (at most one pair per anchor and side, unless
        ``"all"``).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> pairs = batch_easy_hard(emb, labels, pos_strategy="easy", neg_strategy="hard")

    Reference: Xuan, Stylianou, Pless, "Improved Embeddings with Easy Positive Triplet Mining",
    WACV 2020.
    """
    for name, v in (("pos_strategy", pos_strategy), ("neg_strategy", neg_strategy)):
        if v not in _STRATEGIES:
            raise ValueError(f"{name} must be one of {_STRATEGIES}, got {v!r}")
    if pos_strategy == neg_strategy == "semihard":
        raise ValueError('pos_strategy and neg_strategy cannot both be "semihard"')
    if {pos_strategy, neg_strategy} == {"all", "semihard"}:
        raise ValueError('"semihard" cannot be used in combination with "all"')
    for name, rng in (
        ("allowed_pos_range", allowed_pos_range),
        ("allowed_neg_range", allowed_neg_range),
    ):
        if rng is not None and (not isinstance(rng, (tuple, list)) or len(rng) != 2):
            raise ValueError(f"{name} must be None or a (low, high) pair, got {rng!r}")
    s = _Setup(
        embeddings, labels, ref_emb, ref_labels, mat, distance, lp(), tuples_per_anchor, generator
    )
    p_pick, n_pick = _easy_hard(s, pos_strategy, neg_strategy, allowed_pos_range, allowed_neg_range)
    if p_pick is not None and n_pick is not None:  # an anchor needs both of its sides
        keep = p_pick[1] & n_pick[1]
        p_pick, n_pick = (p_pick[0], keep), (n_pick[0], keep)
    pos = s.pos if p_pick is None else _index_mask(*p_pick, s.pos)
    neg = s.neg if n_pick is None else _index_mask(*n_pick, s.neg)
    return s.bound_pairs(pos, neg)


def _easy_hard(
    s: _Setup,
    pos_strategy: str,
    neg_strategy: str,
    pos_range: tuple[float, float] | None,
    neg_range: tuple[float, float] | None,
) -> tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None]:
    """PML's per-row selection: ``(p_idx, p_keep)`` and ``(n_idx, n_keep)``, each ``None`` for
    an ``"all"`` side."""

    def pick(
        mask: Tensor,
        strategy_is_far: bool,
        rng: tuple[float, float] | None,
        thresholds: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # "far" = largest distance (smallest similarity); PML's get_x_per_row.
        xtype_max = strategy_is_far != s.is_similarity
        m = s.mat
        ok = mask
        if thresholds is not None:
            cond = m >= thresholds.unsqueeze(-1) if xtype_max else m <= thresholds.unsqueeze(-1)
            ok = ok & ~cond
        if rng is not None:
            ok = ok & ~((m > rng[1]) | (m < rng[0]))
        fill = -torch.inf if xtype_max else torch.inf
        masked = torch.where(ok, m, fill)
        vals, idx = masked.max(-1) if xtype_max else masked.min(-1)
        return vals, idx, ok.amax(-1)  # any(-1): a bool any along rows is ~7x slower on a CPU

    pos_far = pos_strategy in ("hard", "semihard")  # hardest positive = farthest
    neg_far = neg_strategy == "easy"  # easiest negative = farthest
    p_pick = n_pick = None
    if pos_strategy == "semihard" and neg_strategy != "all":
        n_pick = pick(s.neg, neg_far, neg_range)
        p_pick = pick(s.pos, pos_far, pos_range, n_pick[0])
    elif neg_strategy == "semihard" and pos_strategy != "all":
        p_pick = pick(s.pos, pos_far, pos_range)
        n_pick = pick(s.neg, neg_far, neg_range, p_pick[0])
    else:
        if pos_strategy != "all":
            p_pick = pick(s.pos, pos_far, pos_range)
        if neg_strategy != "all":
            n_pick = pick(s.neg, neg_far, neg_range)
    return (None if p_pick is None else p_pick[1:]), (None if n_pick is None else n_pick[1:])


def _index_mask(idx: Tensor, keep: Tensor, like: Tensor) -> Tensor:
    """``(B, M)`` mask with ``keep[a]`` at column ``idx[a]`` of each row, 0 elsewhere."""
    return torch.zeros_like(like).scatter(-1, idx.unsqueeze(-1), keep.unsqueeze(-1))


# --------------------------------------------------------------------------------------------
# Triplet miners


def batch_hard(
    embeddings: Tensor,
    labels: Tensor,
    *,
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedTriplets:
    r"""The hardest positive and hardest negative of every anchor (PML ``BatchHardMiner``).

    Triplet ``(a, argmax_p d_ap, argmin_n d_an)`` for each anchor with a positive and a negative
    (``valid = 0`` otherwise). ``tuples_per_anchor`` is accepted for uniformity (there is one
    triplet per anchor already).

    Returns:
        :class:`~pmlfunc.tuples.MinedTriplets` of length ``B``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.triplet_margin(emb, labels, indices_tuple=batch_hard(emb, labels))

    Reference: Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", arXiv 2017.
    """
    _tuples_per_anchor(tuples_per_anchor)  # validated; there is one triplet per anchor already
    s = _Setup(embeddings, labels, ref_emb, ref_labels, mat, distance, lp(), None, None)
    p_pick, n_pick = _easy_hard(s, "hard", "hard", None, None)
    assert p_pick is not None and n_pick is not None  # only an "all" side picks nothing
    (p, p_keep), (n, n_keep) = p_pick, n_pick
    keep = (p_keep & n_keep).unsqueeze(-1)
    return _per_anchor_triplets(p.unsqueeze(-1), n.unsqueeze(-1), keep, s.mat.dtype)


def triplet_margin(
    embeddings: Tensor,
    labels: Tensor,
    *,
    margin: float | Tensor = 0.2,
    type_of_triplets: str = "all",
    distance: Distance | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> TripletWindow | MinedTriplets:
    r"""Triplets by their margin (PML ``TripletMarginMiner``).

    With ``t = d_an − d_ap`` (``s_ap − s_an`` for a similarity): ``"all"`` keeps ``t ≤ margin``
    (the triplets that violate the margin), ``"hard"`` ``t ≤ min(margin, 0)``, ``"semihard"``
    ``0 < t ≤ margin``, ``"easy"`` ``t > margin``.

    Without ``tuples_per_anchor`` the result is a :class:`~pmlfunc.tuples.TripletWindow`: the
    triplets are never enumerated (a triplet loss on the same embeddings reads them in
    ``O(B·M log M)``). With ``tuples_per_anchor=k``: a uniform random subset of at most ``k``
    triplets per anchor (Floyd's algorithm over the implicit triplet list; ``O(B·k²)``), as a
    :class:`~pmlfunc.tuples.MinedTriplets` of length ``B·k``.

    Args:
        margin: default ``0.2``; type_of_triplets: default ``"all"``; the rest as in
            :func:`pair_margin`.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> mined = triplet_margin(emb, labels, margin=0.2, type_of_triplets="semihard")
        >>> loss = pf.losses.triplet_margin(emb, labels, indices_tuple=mined)

    Reference: Schroff, Kalenichenko, Philbin, "FaceNet", CVPR 2015 (semi-hard triplets).
    """
    if type_of_triplets not in _TRIPLET_TYPES:
        raise ValueError(
            f"type_of_triplets must be one of {_TRIPLET_TYPES}, got {type_of_triplets!r}"
        )
    s = _Setup(
        embeddings, labels, ref_emb, ref_labels, mat, distance, lp(), tuples_per_anchor, generator
    )
    m = _checks.hyper(margin, "margin")
    if isinstance(m, Tensor):
        m = m.to(s.mat.dtype)
    inf = math.inf
    low, high = {
        "all": (-inf, m),
        "hard": (-inf, torch.clamp_max(m, 0.0) if isinstance(m, Tensor) else min(m, 0.0)),
        "semihard": (0.0, m),
        "easy": (m, inf),
    }[type_of_triplets]
    window = TripletWindow(s.e, s.pos.to(s.mat.dtype), s.neg.to(s.mat.dtype), low, high, s.source)
    if s.k is None:
        return window
    return _sample_window(window, s.k, s.seed)


def _per_anchor_triplets(p: Tensor, n: Tensor, valid: Tensor, dtype: torch.dtype) -> MinedTriplets:
    """``(B, k)`` positives, negatives and validity of each anchor's slots as a flat
    :class:`~pmlfunc.tuples.MinedTriplets` (invalid slots: index 0, weight 0)."""
    a = torch.arange(p.shape[0], device=p.device).unsqueeze(-1).expand_as(p)
    zero = torch.zeros_like(p)
    return MinedTriplets(
        a.reshape(-1),
        torch.where(valid, p, zero).reshape(-1),
        torch.where(valid, n, zero).reshape(-1),
        valid.reshape(-1).to(dtype),
    )


def _sample_window(window: TripletWindow, k: int, seed: Tensor) -> MinedTriplets:
    """``k`` triplets per anchor, uniform without replacement, from the implicit window list
    (anchor ``a``'s triplets listed by positive column, then by sorted negative)."""
    order, first, _, count, _ = window.search()
    m = count.shape[-1]
    cum = count.cumsum(-1)
    idx, valid = sample_without_replacement(cum[:, -1], k, seed, 201)
    p = torch.searchsorted(cum, idx, right=True).clamp_max(m - 1)
    offset = idx - (cum.gather(-1, p) - count.gather(-1, p))
    rank = (first.gather(-1, p) + offset).clamp(0, m - 1)
    n = order.gather(-1, rank)
    return _per_anchor_triplets(p, n, valid, window.e.dtype)


def angular(
    embeddings: Tensor,
    labels: Tensor,
    *,
    angle: float = 20.0,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> TripletMask | MinedTriplets:
    r"""Triplets whose angle at the negative exceeds ``angle`` degrees (PML ``AngularMiner``).

    With ``c = (x_a + x_p)/2`` the triplet's angle is ``atan(‖x_a − x_p‖ / (2‖x_n − c‖))``,
    computed on the raw embeddings as PML does (its distances add ``1e-6`` to each difference,
    as ``F.pairwise_distance``). The cube is evaluated from Gram matrices in anchor chunks: no
    ``B × M × D`` buffer, ``O(chunk·M·max(M, D))`` memory.

    Without ``tuples_per_anchor`` the result is a dense :class:`~pmlfunc.tuples.TripletMask`
    (``B·M²`` bytes); with ``tuples_per_anchor=k`` at most ``k`` triplets per anchor, a uniform
    random subset, as a :class:`~pmlfunc.tuples.MinedTriplets` (memory bounded by the chunk).

    Args:
        angle: in degrees, default ``20``; ref_emb, ref_labels, tuples_per_anchor, generator: as
            in :func:`pair_margin` (no ``distance``/``mat``: the angle needs the embeddings).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> mined = angular(emb, labels, angle=20)

    Reference: Wang et al., "Deep Metric Learning with Angular Loss", ICCV 2017.
    """
    angle = _checks.number(angle, "angle")
    s = _Setup(
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        None,
        lp(),
        lp(),
        tuples_per_anchor,
        generator,
        need_matrix=False,
    )
    cd = _checks.compute_dtype(embeddings.dtype)
    x = embeddings.detach().to(cd)
    y = x if ref_emb is None else ref_emb.detach().to(cd)
    b, m = s.pos.shape
    chunk = max(1, CUBE_BLOCK // max(1, m * max(m, x.shape[1])))
    threshold = math.radians(angle)
    blocks = []
    for start in range(0, b, chunk):
        stop = min(b, start + chunk)
        sel = _angular_block(x, y, s.pos, s.neg, start, stop, threshold)
        if s.k is None:
            blocks.append(sel)
        else:
            blocks.append(_sample_block(sel, s.k, s.seed, start))
    if s.k is None:
        return TripletMask(torch.cat(blocks, 0))
    return MinedTriplets(*(torch.cat([blk[i] for blk in blocks]) for i in range(4)))


def _angular_block(x, y, pos, neg, start, stop, threshold) -> Tensor:
    """``(chunk, M, M)``: ``atan(‖a − p + ε‖ / (2‖n − c + ε‖)) > threshold`` from Gram matrices,
    ``ε = 1e-6`` added to every difference as ``F.pairwise_distance`` does."""
    eps, dim = 1e-6, x.shape[1]
    a = x[start:stop]
    aa, yy = (a * a).sum(-1), (y * y).sum(-1)
    sa, sy = a.sum(-1), y.sum(-1)
    ay, gyy = _ops.matmul(a, y.T), _ops.matmul(y, y.T)  # (chunk, M), (M, M)

    def dist(sq):
        return sq.clamp_min(0).sqrt()

    # pair (a, p): ‖a − p + ε‖² and the center's norm ‖c‖², c = (a + p)/2
    ap = dist(
        aa[:, None] + yy[None] - 2 * ay + 2 * eps * (sa[:, None] - sy[None]) + dim * eps * eps
    )
    cc = (aa[:, None] + yy[None] + 2 * ay) / 4
    sc = (sa[:, None] + sy[None]) / 2
    # (a, p, n): n·c = (n·a + n·p)/2
    nc_dot = (ay[:, None, :] + gyy[None]) / 2
    nc = dist(
        yy[None, None, :]
        + cc[:, :, None]
        - 2 * nc_dot
        + 2 * eps * (sy[None, None, :] - sc[:, :, None])
        + dim * eps * eps
    )
    keep = torch.atan(ap[:, :, None] / (2 * nc)) > threshold
    return keep & pos[start:stop, :, None] & neg[start:stop, None, :]


def _sample_block(sel: Tensor, k: int, seed: Tensor, start: int):
    """At most ``k`` selected triplets per anchor of a ``(chunk, M, M)`` block (random keys;
    the seed's stream is offset by the block's first anchor)."""
    c, m, _ = sel.shape
    idx, valid = random_subset(sel.reshape(c, m * m), k, seed, 301 + start)
    a = torch.arange(start, start + c, device=sel.device).unsqueeze(-1).expand(c, k)
    return a.reshape(-1), (idx // m).reshape(-1), (idx % m).reshape(-1), valid.reshape(-1).float()


def distance_weighted(
    embeddings: Tensor,
    labels: Tensor,
    *,
    cutoff: float = 0.5,
    nonzero_loss_cutoff: float = 1.4,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    mat: Tensor | None = None,
    tuples_per_anchor: int | None = None,
    generator=None,
) -> MinedTriplets:
    r"""Distance-weighted negative sampling (PML ``DistanceWeightedMiner``).

    On the unit sphere in ``D`` dimensions, pairwise distances have density
    ``q(d) ∝ d^{D−2} (1 − d²/4)^{(D−3)/2}``; negatives are drawn with weight
    ``1/q(max(d, cutoff))`` and 0 where ``max(d, cutoff) ≥ nonzero_loss_cutoff`` (as PML: a
    ``cutoff`` at or above ``nonzero_loss_cutoff`` draws nothing). Every positive pair ``(a, p)``
    gets one negative drawn from ``a``'s weights (PML draws ``|class|`` positives per anchor
    with replacement instead; the negatives' distribution is the same). Anchors whose weights
    are all 0 get no triplets.

    Args:
        cutoff: default ``0.5``; nonzero_loss_cutoff: default ``1.4``; generator: required.
            The distance is ``lp()`` (normalised Euclidean), as PML requires; ``mat`` must be
            that matrix.

    Returns:
        :class:`~pmlfunc.tuples.MinedTriplets` of length ``B·M`` (``B·k`` with
        ``tuples_per_anchor=k``: ``k`` positives per anchor, each with its negative).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> mined = distance_weighted(emb, labels, generator=torch.Generator().manual_seed(0))

    Reference: Wu et al., "Sampling Matters in Deep Embedding Learning", ICCV 2017.
    """
    s = _Setup(
        embeddings, labels, ref_emb, ref_labels, mat, lp(), lp(), None, generator, stochastic=True
    )
    s.k = _tuples_per_anchor(tuples_per_anchor)
    d = float(embeddings.shape[1])
    dist = s.mat.clamp_min(float(cutoff))
    log_w = (2.0 - d) * torch.log(dist) - ((d - 3) / 2) * torch.log(1.0 - 0.25 * dist**2)
    bad = torch.isinf(log_w) | torch.isnan(log_w)
    other = s.neg  # PML masks every same-class entry, the diagonal too
    log_w = log_w * other.to(log_w.dtype)
    top = torch.where(bad, -torch.inf, log_w).amax()
    # PML compares the clamped distance: with cutoff >= nonzero_loss_cutoff nothing is drawn
    w = torch.exp(log_w - top) * other * (dist < float(nonzero_loss_cutoff))
    w = torch.where(bad, 0.0, w).to(torch.float64)
    b, m = w.shape
    cdf = w.cumsum(-1)
    total = cdf[:, -1:]
    has_neg = total.squeeze(-1) > 0
    if s.k is None:
        p = torch.arange(m, device=w.device).expand(b, m)
        p_valid = s.pos
    else:
        p, p_valid = random_subset(s.pos, s.k, s.seed, 401)
    u = uniform(s.seed, 402, tuple(p.shape), torch.float64, w.device)
    n = torch.searchsorted(cdf, (u * total).contiguous(), right=True).clamp_max(m - 1)
    valid = p_valid & has_neg.unsqueeze(-1)
    return _per_anchor_triplets(p, n, valid, s.mat.dtype)


def embeddings_already_packaged_as_triplets(
    embeddings: Tensor, labels: Tensor | None = None
) -> PackagedTriplets:
    r"""Rows ``(3i, 3i+1, 3i+2)`` are the triplet ``(anchor, positive, negative)`` (PML
    ``EmbeddingsAlreadyPackagedAsTriplets``). ``labels`` are not read.

    Returns:
        :class:`~pmlfunc.tuples.PackagedTriplets` (a ``MinedTriplets`` that losses read as
        strided views of the rows) of length ``B // 3``.

    Example:
        >>> emb = torch.randn(6, 4)
        >>> loss = pf.losses.triplet_margin(emb, indices_tuple=embeddings_already_packaged_as_triplets(emb))
    """
    _checks.embeddings(embeddings)
    b = embeddings.shape[0]
    if b % 3:
        raise ValueError(
            f"embeddings must hold whole triplets: batch size {b} is not a multiple of 3"
        )
    if labels is not None:
        _checks.labels(labels, b, embeddings.device)
    return PackagedTriplets.of(b, embeddings.device, _checks.compute_dtype(embeddings.dtype))
