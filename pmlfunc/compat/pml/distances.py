"""PML 2.9.0's distances (``pytorch_metric_learning.distances``) over
:mod:`pmlfunc.distances`.

``dist(query_emb, ref_emb=None)`` is the ``(B, M)`` matrix; ``.function`` is the pmlfunc
:class:`~pmlfunc.distances.Distance` a loss or miner receives. PML's keyword arguments
``normalize_embeddings``, ``p`` and ``power`` are taken where pmlfunc has them; ``is_inverted``
is the class's own (a similarity or a distance) and cannot be changed.

Example:
    >>> from pmlfunc.compat.pml.distances import LpDistance
    >>> LpDistance(normalize_embeddings=False)(torch.tensor([[0.0, 0.0], [3.0, 4.0]]))
    tensor([[0., 5.],
            [5., 0.]])
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ... import distances as _d
from ._base import Compat

__all__ = ["CosineSimilarity", "DotProductSimilarity", "LpDistance", "SNRDistance"]


class _Distance(Compat):
    signature = ()
    shared = ("normalize_embeddings", "p", "power")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.function  # noqa: B018 (the arguments checked now)

    @property
    def function(self) -> _d.Distance:
        """The pmlfunc distance of the attributes as they stand (``dist.power = 2`` after
        construction takes effect, as PML reads its attributes at every call)."""
        return self.build(**self.options())

    def build(self, **options: Any) -> _d.Distance:
        raise NotImplementedError

    def forward(self, query_emb: Tensor, ref_emb: Tensor | None = None) -> Tensor:
        return self.function(query_emb, ref_emb)


def _only_defaults(name: str, options: dict, **allowed: Any) -> None:
    for key, value in options.items():
        if key not in allowed or value != allowed[key]:
            raise ValueError(
                f"{name}({key}={value!r}) is not provided: pmlfunc's "
                f"{name} takes {', '.join(f'{k}={v!r}' for k, v in allowed.items()) or 'nothing'}"
            )


class LpDistance(_Distance):
    """``‖x_i − y_j‖_p^power`` (PML's defaults: ``normalize_embeddings=True, p=2, power=1``)."""

    def build(self, normalize_embeddings=True, p=2, power=1) -> _d.Distance:
        return _d.lp(p=p, power=power, normalize=normalize_embeddings)


class CosineSimilarity(_Distance):
    """The cosine of normalised rows (``normalize_embeddings=False`` is PML's plain dot
    product)."""

    def build(self, normalize_embeddings=True, **rest) -> _d.Distance:
        _only_defaults("CosineSimilarity", rest, p=2, power=1)
        return _d.cosine() if normalize_embeddings else _d.dot(normalize=False)


class DotProductSimilarity(_Distance):
    """``x · y``; PML 2.9.0 normalises the rows by default (``normalize_embeddings=True``),
    where pmlfunc's :func:`~pmlfunc.distances.dot` does not."""

    def build(self, normalize_embeddings=True, **rest) -> _d.Distance:
        _only_defaults("DotProductSimilarity", rest, p=2, power=1)
        return _d.dot(normalize=normalize_embeddings)


class SNRDistance(_Distance):
    """Signal-to-noise ratio distance ``Var(x − y) / Var(x)``."""

    def build(self, **rest) -> _d.Distance:
        _only_defaults("SNRDistance", rest, normalize_embeddings=True, p=2, power=1)
        return _d.snr()
