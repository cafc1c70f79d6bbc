"""PML 2.9.0's reducers (``pytorch_metric_learning.reducers``) over :mod:`pmlfunc.reducers`.

A compat reducer configures a loss (``reducer=ThresholdReducer(low=0)``); ``.function`` is the
pmlfunc reducer it hands over. Calling one on a PML loss dictionary is not provided, nor are
``MultipleReducers`` with different reducers per sub-loss (one reducer reduces every sub-loss
and the results are summed, PML's ``MultipleReducers`` with one default) and
``PerAnchorReducer``'s ``aggregation_func``.

Example:
    >>> from pmlfunc.compat.pml import losses, reducers
    >>> loss_func = losses.TripletMarginLoss(reducer=reducers.ThresholdReducer(low=0.1))
    >>> loss_func.reducer.function
    threshold(low=0.1, high=None)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ... import reducers as _r
from ._base import Compat, required

__all__ = [
    "AvgNonZeroReducer",
    "ClassWeightedReducer",
    "DivisorReducer",
    "DoNothingReducer",
    "MeanReducer",
    "PerAnchorReducer",
    "SumReducer",
    "ThresholdReducer",
]


class _Reducer(Compat):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.function  # noqa: B018 (the arguments checked now)

    @property
    def function(self) -> _r.Reducer:
        """The pmlfunc reducer of the attributes as they stand (``reducer.low = 0.3`` after
        construction takes effect, as in PML)."""
        return self.build(**self.options())

    def build(self, **options: Any) -> _r.Reducer:
        raise NotImplementedError


class MeanReducer(_Reducer):
    def build(self) -> _r.Reducer:
        return _r.mean()


class AvgNonZeroReducer(_Reducer):
    def build(self) -> _r.Reducer:
        return _r.avg_nonzero()


class SumReducer(_Reducer):
    def build(self) -> _r.Reducer:
        return _r.sum()


class DivisorReducer(_Reducer):
    def build(self) -> _r.Reducer:
        return _r.divisor()


class DoNothingReducer(_Reducer):
    def build(self) -> _r.Reducer:
        return _r.none()


class ThresholdReducer(_Reducer):
    signature = ("low", "high")
    defaults = {"low": None, "high": None}

    def build(self, low=None, high=None) -> _r.Reducer:
        return _r.threshold(low=low, high=high)


class ClassWeightedReducer(_Reducer):
    signature = ("weights",)
    defaults = {"weights": required()}

    def build(self, weights: Tensor) -> _r.Reducer:
        return _r.class_weighted(weights)


class PerAnchorReducer(_Reducer):
    signature = ("reducer",)
    defaults = {"reducer": None}

    def build(self, reducer=None) -> _r.Reducer:
        return _r.per_anchor(reducer)
