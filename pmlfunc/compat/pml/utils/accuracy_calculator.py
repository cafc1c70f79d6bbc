"""PML 2.9.0's ``AccuracyCalculator`` (``pytorch_metric_learning.utils.accuracy_calculator``)
over :mod:`pmlfunc.evaluation`.

``AccuracyCalculator(include=(), exclude=(), avg_of_avgs=False, return_per_class=False,
k=None, label_comparison_fn=None, device=None, knn_func=None, kmeans_func=None)`` and
``get_accuracy(query, query_labels, reference=None, reference_labels=None,
ref_includes_query=False, include=(), exclude=())`` return PML's keys, as Python floats (lists
of floats per class with ``return_per_class``):

| key | computed by |
|---|---|
| ``"AMI"``, ``"NMI"`` | :func:`~pmlfunc.evaluation.clustering_scores` (or ``kmeans_func``'s clusters scored by :func:`~pmlfunc.evaluation.adjusted_mutual_info` / :func:`~pmlfunc.evaluation.normalized_mutual_info`) |
| ``"mean_average_precision"``, ``"mean_average_precision_at_r"``, ``"mean_reciprocal_rank"``, ``"precision_at_1"``, ``"r_precision"`` | :func:`~pmlfunc.evaluation.pml_per_query`'s per-query values of the same name |

The neighbours come from one :func:`~pmlfunc.evaluation.knn` search of PML's ``k`` (``None``:
every reference row; ``"max_bin_count"``: the largest number of relevant rows; an int), their
relevance from :func:`~pmlfunc.evaluation.neighbor_relevance`. Queries without a relevant
reference row are left out of every average (NaN when all are), as in PML; ``avg_of_avgs``
averages per class first, ``return_per_class`` returns the classes' averages (sorted labels).
Labels may be of any dtype and shape PML takes (rows of a 2-D label are compared whole);
``label_comparison_fn(a, b)`` is PML's: it is called once on ``(Q, 1, ...)`` query against
``(1, R, ...)`` reference labels and must broadcast to the ``(Q, R)`` relevance.

``knn_func``: ``None`` searches with pmlfunc's default, the cosine similarity (ties broken by
reference index); a pmlfunc distance (``pf.distances.lp()``) or a compat distance searches with
it; any other callable is PML's k-NN protocol, ``knn_func(query, k, reference,
ref_includes_query) -> (distances, indices)`` (PML's ``CustomKNN``, ``FaissKNN``), and its
indices are used. ``kmeans_func``: ``None`` is :func:`~pmlfunc.evaluation.kmeans` (k-means++
from a fixed seed, 20 Lloyd iterations); any callable is PML's protocol, ``kmeans_func(query,
num_clusters) -> cluster ids``.

Differs from PML: PML's default k-NN is faiss's Euclidean ``IndexFlatL2`` (it needs faiss) and
its default k-means faiss's; the Euclidean and cosine rankings agree on normalised embeddings
only, and the two k-means agree where they find the same partition, so ``NMI``/``AMI`` equal
PML's only given the same clusters (pass the same ``kmeans_func`` to both for the same
numbers). PML casts embeddings and labels to float32 and moves them to CUDA when available
(``device=None``); here they keep their dtype and device unless ``device`` is given.
``k`` smaller than the largest class warns with ``warnings.warn`` (PML logs).
``mean_reciprocal_rank`` alone works (PML's needs another k-NN metric with it).

Not provided: ``calculate_*`` methods added by a subclass (PML's custom metrics;
``NotImplementedError`` at construction), and ``recall_at_k``-style metrics PML does not have
here (see :func:`~pmlfunc.evaluation.retrieval_scores`).

Example:
    >>> from pmlfunc.compat.pml.utils.accuracy_calculator import AccuracyCalculator
    >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.7, 0.3]])
    >>> calc = AccuracyCalculator(include=("precision_at_1", "r_precision", "NMI"))
    >>> {k: round(v, 4) for k, v in calc.get_accuracy(emb, torch.tensor([0, 0, 1, 1, 1])).items()}
    {'NMI': 0.4325, 'precision_at_1': 0.8, 'r_precision': 0.8}
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ....distances import Distance
from ....evaluation import (
    adjusted_mutual_info,
    clustering_scores,
    knn,
    neighbor_relevance,
    normalized_mutual_info,
    pml_per_query,
)
from .._base import Compat

__all__ = ["AccuracyCalculator"]

_CLUSTERING = ("AMI", "NMI")
_RETRIEVAL = (
    "mean_average_precision",
    "mean_average_precision_at_r",
    "mean_reciprocal_rank",
    "precision_at_1",
    "r_precision",
)
_METRICS = (*_CLUSTERING, *_RETRIEVAL)  # PML's order (its calculate_* methods, sorted)


def _tensor(x: Any, device: torch.device | None) -> Tensor:
    t = torch.as_tensor(x)
    return t if device is None else t.to(device)


class AccuracyCalculator:
    """PML's ``AccuracyCalculator`` (module docstring)."""

    def __init__(
        self,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        avg_of_avgs: bool = False,
        return_per_class: bool = False,
        k: int | str | None = None,
        label_comparison_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        device: torch.device | str | None = None,
        knn_func: Any = None,
        kmeans_func: Callable[[Tensor, int], Any] | None = None,
    ) -> None:
        custom = [
            n.removeprefix("calculate_")
            for n in dir(self)
            if n.startswith("calculate_") and n.removeprefix("calculate_") not in _METRICS
        ]
        if custom:
            raise NotImplementedError(
                f"AccuracyCalculator: metrics added by a subclass ({', '.join(custom)}) are not "
                "provided; pmlfunc computes " + ", ".join(_METRICS)
            )
        self.check_primary_metrics(include, exclude)
        self.original_metrics = self._select(_METRICS, include, exclude)
        self.curr_metrics = list(self.original_metrics)
        if avg_of_avgs and return_per_class:
            raise ValueError("avg_of_avgs and return_per_class are mutually exclusive")
        self.avg_of_avgs, self.return_per_class = avg_of_avgs, return_per_class
        self.device = None if device is None else torch.device(device)
        self.knn_func, self.kmeans_func = knn_func, kmeans_func
        if (not (isinstance(k, int) and k > 0)) and (k not in [None, "max_bin_count"]):
            raise ValueError("k must be an integer greater than 0, or None, or 'max_bin_count'")
        self.k = k
        self.label_comparison_fn = label_comparison_fn
        if label_comparison_fn is not None and any(
            m in _CLUSTERING for m in self.get_curr_metrics()
        ):
            raise NotImplementedError("Unsupported: clustering + custom label comparison")

    # -------------------------------------------------------------------------------- PML's API
    @staticmethod
    def _select(
        metrics: Sequence[str], include: Sequence[str], exclude: Sequence[str]
    ) -> list[str]:
        chosen = include if len(include) else metrics
        return [m for m in metrics if m in chosen and m not in exclude]

    def check_primary_metrics(self, include: Sequence[str] = (), exclude: Sequence[str] = ()):
        for met in (include, exclude):
            if not isinstance(met, tuple | list):
                raise TypeError(f"Arguments must be of type tuple, not {type(met)}.")
            if not set(met).issubset(_METRICS):
                raise ValueError(f"Primary metrics must be one or more of: {list(_METRICS)}.")

    def get_curr_metrics(self) -> list[str]:
        return list(self.curr_metrics)

    def requires_clustering(self) -> list[str]:
        return list(_CLUSTERING)

    def requires_knn(self) -> list[str]:
        return list(_RETRIEVAL)

    def description(self) -> str:
        return "avg_of_avgs" if self.avg_of_avgs else ""

    def get_accuracy(
        self,
        query: Any,
        query_labels: Any,
        reference: Any = None,
        reference_labels: Any = None,
        ref_includes_query: bool = False,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
    ) -> dict[str, Any]:
        """PML's metrics of retrieving ``reference`` rows for each ``query`` row (``reference
        is None``: the queries themselves, each excluded from its own neighbours)."""
        if reference is None:
            reference, reference_labels, ref_includes_query = query, query_labels, True
        elif reference_labels is None:
            raise ValueError("reference_labels is required when reference is given")
        query, reference = _tensor(query, self.device), _tensor(reference, self.device)
        query_labels = _tensor(query_labels, query.device)
        reference_labels = _tensor(reference_labels, query.device)
        if len(query) != len(query_labels) or len(reference) != len(reference_labels):
            raise ValueError("embeddings and labels must have the same length")
        q = len(query)
        if ref_includes_query and not (
            torch.allclose(query, reference[:q]) and torch.equal(query_labels, reference_labels[:q])
        ):
            raise ValueError(
                "When ref_includes_query is True, the first len(query) elements of reference "
                "must be equal to query. Likewise, the first len(query_labels) elements of "
                "reference_labels must be equal to query_labels."
            )
        self.curr_metrics = self._select(self.original_metrics, include, exclude)
        # class ids: one per distinct label (a whole row of a 2-D label), in sorted order
        both = torch.cat([query_labels, reference_labels.to(query_labels.dtype)])
        ids = torch.unique(both, dim=0, return_inverse=True)[1]
        query_ids, reference_ids = ids[:q], ids[q:]
        out: dict[str, Any] = {}
        wanted = self.get_curr_metrics()
        if any(m in _CLUSTERING for m in wanted):
            out.update(self._clustering(query, query_labels, query_ids))
        if any(m in _RETRIEVAL for m in wanted):
            queries = (query, query_labels, query_ids)
            references = (reference, reference_labels, reference_ids)
            out.update(self._retrieval(*queries, *references, ref_includes_query))
        return {m: out[m] for m in _METRICS if m in wanted}

    # ----------------------------------------------------------------------------- the metrics
    def _clustering(self, query: Tensor, query_labels: Tensor, ids: Tensor) -> dict[str, float]:
        num_clusters = len(torch.unique(query_labels.flatten()))
        if self.kmeans_func is None:
            scores = clustering_scores(query, ids, num_clusters=num_clusters)
        else:
            clusters = _tensor(self.kmeans_func(query, num_clusters), ids.device).long()
            scores = {
                "AMI": adjusted_mutual_info(ids, clusters),
                "NMI": normalized_mutual_info(ids, clusters),
            }
        return {name: float(value) for name, value in scores.items()}

    def _neighbours(
        self, query: Tensor, reference: Tensor, k: int, exclude: bool
    ) -> tuple[Tensor, Tensor]:
        """``(indices, unranked)``: the ``k`` nearest reference rows of each query and the
        queries ranked among non-finite embeddings (pmlfunc's search only)."""
        distance = self.knn_func
        if isinstance(distance, Compat):
            distance = getattr(distance, "function", distance)
        if distance is None or isinstance(distance, Distance):
            idx, val = knn(query, reference, k=k, distance=distance, exclude_self=exclude)
            return idx, val.isnan().any(1)
        _, idx = distance(query, k, reference, exclude)
        idx = _tensor(idx, query.device).long()
        return idx, torch.zeros(len(query), dtype=torch.bool, device=query.device)

    def _determine_k(self, max_relevant: int, num_reference: int, exclude: bool) -> int:
        self_count = int(exclude)
        max_bin_count = max_relevant + self_count
        if self.k == "max_bin_count":
            return max_bin_count - self_count
        if self.k is None:
            return num_reference - self_count
        assert isinstance(self.k, int)
        at_r = {"r_precision", "mean_average_precision_at_r"} & set(self.get_curr_metrics())
        if self.k < max_bin_count and at_r:
            warnings.warn(
                f"You are computing {at_r}, but the value for k ({self.k}) is less than the max "
                f"bin count ({max_bin_count}) so the values for these metrics will be incorrect. "
                "To fix this, set k='max_bin_count'. If you're looking for MAP@k instead of "
                "MAP@R, then you should use 'mean_average_precision'.",
                stacklevel=4,  # get_accuracy's caller
            )
        return self.k

    def _retrieval(
        self,
        query: Tensor,
        query_labels: Tensor,
        query_ids: Tensor,
        reference: Tensor,
        reference_labels: Tensor,
        reference_ids: Tensor,
        exclude: bool,
    ) -> dict[str, Any]:
        if self.label_comparison_fn is None:
            source: dict[str, Any] = {
                "query_labels": query_ids,
                "reference_labels": reference_ids,
            }
        else:
            pairs = self.label_comparison_fn(query_labels[:, None], reference_labels[None])
            source = {"relevance": torch.as_tensor(pairs).to(torch.uint8)}
        # the relevant reference rows of each query (no neighbour needed: a 1-column probe)
        probe = torch.zeros(len(query), 1, dtype=torch.long, device=query.device)
        counts = neighbor_relevance(probe, **source, exclude_self=exclude).num_relevant
        k = self._determine_k(int(counts.max()), len(reference), exclude)
        idx, unranked = self._neighbours(query, reference, max(k, 1), exclude)
        rel = neighbor_relevance(idx, **source, exclude_self=exclude)
        per_query = pml_per_query(rel.retrieved, rel.num_relevant)
        counted = rel.num_relevant > 0
        return {
            name: self._average(value, counted, unranked, query_ids)
            for name, value in per_query.items()
            if name in self.get_curr_metrics()
        }

    def _average(self, value: Tensor, counted: Tensor, unranked: Tensor, ids: Tensor) -> Any:
        """PML's reduction: the mean over the queries with a relevant row, or (``avg_of_avgs``,
        ``return_per_class``) the mean of each class's mean."""
        value = value.masked_fill(unranked, float("nan"))  # a broken ranking: NaN, counted
        if not (self.avg_of_avgs or self.return_per_class):
            included = counted | unranked  # lone queries left out (all lone: 0 / 0 = NaN)
            return float(torch.where(included, value, 0.0).sum() / included.sum())
        if not bool(counted.any()):
            nan = [float("nan")] * len(torch.unique(ids))
            return nan if self.return_per_class else float("nan")
        classes, which = torch.unique(ids[counted], return_inverse=True)
        values = value[counted]
        sums = torch.zeros(len(classes), dtype=values.dtype, device=values.device)
        sums = sums.index_add(0, which, values)
        per_class = sums / torch.bincount(which, minlength=len(classes))
        if self.return_per_class:
            return per_class.cpu().tolist()
        return float(per_class.mean())
