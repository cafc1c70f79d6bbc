"""PML 2.9.0's miners (``pytorch_metric_learning.miners``) over :mod:`pmlfunc.miners`:
``miner(embeddings, labels, ref_emb=None, ref_labels=None)`` returns PML's index tuple (pairs
``(a1, p, a2, n)`` or triplets ``(a, p, n)``), which the compat and the pmlfunc losses take as
``indices_tuple``. The stochastic miners (``DistanceWeightedMiner``, ``UniformHistogramMiner``)
draw from the functions' counter-based generator (the same distributions as PML's draws, not
the same samples). ``.function`` of a miner is the function; pass the function's fixed-shape
result straight to a pmlfunc loss to avoid the host synchronisation of PML's tuple.

Example:
    >>> from pmlfunc.compat.pml.miners import BatchHardMiner
    >>> emb = torch.tensor([[0.0, 1.0], [0.0, 0.9], [1.0, 0.0], [0.9, 0.1]])
    >>> anchors, positives, negatives = BatchHardMiner()(emb, torch.tensor([0, 0, 1, 1]))
    >>> positives.tolist()
    [1, 0, 3, 2]
"""

from __future__ import annotations

from typing import Any

from ... import miners as _m
from ._base import Miner, degrees, global_seed, radians

__all__ = [
    "AngularMiner",
    "BatchEasyHardMiner",
    "BatchHardMiner",
    "DistanceWeightedMiner",
    "EmbeddingsAlreadyPackagedAsTriplets",
    "HDCMiner",
    "MultiSimilarityMiner",
    "PairMarginMiner",
    "TripletMarginMiner",
    "UniformHistogramMiner",
]


class AngularMiner(Miner):
    """``.angle`` holds PML's value in radians (the function takes degrees)."""

    function = _m.angular
    signature = ("angle",)
    units = {"angle": (radians, degrees)}
    shared = ()


class BatchEasyHardMiner(Miner):
    function = _m.batch_easy_hard
    signature = ("pos_strategy", "neg_strategy", "allowed_pos_range", "allowed_neg_range")


class BatchHardMiner(Miner):
    function = _m.batch_hard


class _Stochastic(Miner):
    """A miner that draws: its ``generator=`` a seed from torch's global RNG at each call."""

    def options(self) -> dict[str, Any]:
        return {**super().options(), "generator": global_seed()}


class DistanceWeightedMiner(_Stochastic):
    function = _m.distance_weighted
    signature = ("cutoff", "nonzero_loss_cutoff")
    shared = ()


class EmbeddingsAlreadyPackagedAsTriplets(Miner):
    function = _m.embeddings_already_packaged_as_triplets
    shared = ()


class HDCMiner(Miner):
    function = _m.hdc
    signature = ("filter_percentage",)


class MultiSimilarityMiner(Miner):
    function = _m.multi_similarity
    signature = ("epsilon",)


class PairMarginMiner(Miner):
    function = _m.pair_margin
    signature = ("pos_margin", "neg_margin")


class TripletMarginMiner(Miner):
    function = _m.triplet_margin
    signature = ("margin", "type_of_triplets")


class UniformHistogramMiner(_Stochastic):
    function = _m.uniform_histogram
    signature = ("num_bins", "pos_per_bin", "neg_per_bin")
