"""PML 2.9.0's regularizers (``pytorch_metric_learning.regularizers``) over
:mod:`pmlfunc.regularizers`: ``reg(x)`` is the regularization value; a loss's
``embedding_regularizer=`` / ``weight_regularizer=`` receives ``.function``.

Example:
    >>> from pmlfunc.compat.pml.regularizers import LpRegularizer
    >>> LpRegularizer()(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    tensor(3.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

from torch import Tensor

from ... import regularizers as _g
from ._base import Compat, required

__all__ = [
    "CenterInvariantRegularizer",
    "LpRegularizer",
    "RegularFaceRegularizer",
    "SparseCentersRegularizer",
    "ZeroMeanRegularizer",
]


class _Regularizer(Compat):
    pure: ClassVar[Callable[..., Tensor]]
    shared = ("reducer",)

    @property
    def function(self) -> Callable[[Tensor], Tensor]:
        """The pmlfunc regularizer with the attributes as they stand (``reg.power = 2`` after
        construction takes effect, as in PML)."""
        return functools.partial(type(self).pure, **self.options())

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x)


class LpRegularizer(_Regularizer):
    pure = _g.lp
    signature = ("p", "power")


class ZeroMeanRegularizer(_Regularizer):
    pure = _g.zero_mean


class CenterInvariantRegularizer(_Regularizer):
    pure = _g.center_invariant


class RegularFaceRegularizer(_Regularizer):
    pure = _g.regular_face


class SparseCentersRegularizer(_Regularizer):
    pure = _g.sparse_centers
    signature = ("num_classes", "centers_per_class")
    defaults = {"num_classes": required(), "centers_per_class": required()}
