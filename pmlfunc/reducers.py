"""Reducers: how a loss's per-element, per-pair or per-triplet terms become one number.

A loss describes its unreduced terms as :class:`Terms` objects (one per sub-loss, e.g. the
contrastive ``pos_loss`` and ``neg_loss``); a reducer turns each into a scalar and the loss sums
them, as PML's ``MultipleReducers`` does. Terms never need to be materialised: every reducer is
written over per-anchor sufficient statistics ``(Σ selected losses, # selected terms)`` that a
``Terms`` object computes for a value window ``low < loss < high``. This is what lets the
all-triplet loss count and sum its triplets without enumerating them.

| reducer | result | PML |
|---|---|---|
| ``mean()`` | Σ losses / # terms | ``MeanReducer`` |
| ``avg_nonzero()`` | Σ losses / # terms with loss > 0 | ``AvgNonZeroReducer`` |
| ``sum()`` | Σ losses | ``SumReducer`` |
| ``divisor()`` | Σ losses / the divisor the loss supplies | ``DivisorReducer`` |
| ``threshold(low, high)`` | mean of the losses with low < loss < high | ``ThresholdReducer`` |
| ``per_anchor(reducer)`` | per-anchor mean, then ``reducer`` over anchors | ``PerAnchorReducer`` |
| ``class_weighted(weights)`` | Σ weights[label(anchor)]·loss / # terms | ``ClassWeightedReducer`` |
| ``none()`` | the unreduced terms, as a dict | ``DoNothingReducer`` |

A reducer whose selection is empty returns 0 (with zero gradients), as PML does. A sub-loss that
is one number already (:class:`AlreadyReduced`: a regularizer's loss, VICReg's covariance term) is
added as it is, whatever the reducer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from . import _checks
from ._ops import indicator, matmul, ratio

__all__ = [
    "AlreadyReduced",
    "DenseTerms",
    "Reducer",
    "Terms",
    "avg_nonzero",
    "class_weighted",
    "divisor",
    "elements",
    "mean",
    "none",
    "per_anchor",
    "reduce",
    "sum",
    "threshold",
]

Bound = float | Tensor | None


class Terms:
    """Unreduced loss terms of one sub-loss, grouped by anchor.

    Subclasses implement :meth:`stats`. ``kind`` is PML's reduction type (``"element"``,
    ``"pos_pair"``, ``"neg_pair"``, ``"triplet"``); ``num_anchors`` the number of query rows;
    ``divisor`` what :func:`divisor` divides by (``None`` when the loss supplies none).
    """

    kind: str
    num_anchors: int
    divisor: float | Tensor | None = None

    def stats(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        """Per-anchor ``(sum, count)`` of the terms with ``low < loss < high`` (``None``: no bound),
        each of shape ``(num_anchors,)``; counts include pair multiplicities."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def totals(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        """``(Σ selected losses, # selected terms)`` over all anchors, as 0-d tensors."""
        s, c = self.stats(low, high)
        return s.sum(), c.sum()

    def dense(self) -> dict[str, Any]:
        """The terms materialised: ``{"losses", "weights", "kind"}`` (used by :func:`none`)."""
        raise NotImplementedError


def _window(values: Tensor, low: Bound, high: Bound) -> Tensor | None:
    """The 0/1 float indicator of ``low < values < high`` (``None`` when unbounded), by
    :func:`~pmlfunc._ops.indicator` (``heaviside`` is ~20× slower, and a ``where`` with a
    scattered mask is slow on CPU)."""
    sel = None
    v = values.detach()
    if low is not None:
        sel = indicator(v if _is_zero(low) else v - low)
    if high is not None:
        h = indicator(torch.rsub(v, high))
        sel = h if sel is None else sel.mul_(h)
    return sel


def _is_zero(x: Bound) -> bool:
    return isinstance(x, float) and x == 0.0


@dataclass(frozen=True, eq=False)
class DenseTerms(Terms):
    """Terms held as a tensor: ``(B,)`` per-element, ``(B, M)`` per-pair, or a flat list ``(T,)``
    with ``anchor_index`` giving each term's anchor row.

    ``weights`` (same shape as ``losses``) are term multiplicities: 0 for absent terms.
    """

    losses: Tensor
    weights: Tensor
    kind: str
    num_anchors: int
    anchor_index: Tensor | None = None
    divisor: float | Tensor | None = None
    unit_weights: bool = False  # every weight is 1 (:func:`elements`): a mean is losses.mean()

    @property
    def device(self) -> torch.device:
        return self.losses.device

    def _per_anchor(self, x: Tensor) -> Tensor:
        if self.anchor_index is not None:
            out = torch.zeros(self.num_anchors, dtype=x.dtype, device=x.device)
            return out.index_add(0, self.anchor_index.long(), x)
        return x if x.ndim == 1 else x.sum(-1)

    def _selected(self, low: Bound, high: Bound) -> Tensor:
        sel = _window(self.losses, low, high)
        return self.weights if sel is None else sel.mul_(self.weights)

    def stats(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        w = self._selected(low, high)
        return self._per_anchor(w * self.losses), self._per_anchor(w)

    def totals(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        w = self._selected(low, high)
        return matmul(w.reshape(-1), self.losses.reshape(-1)), w.sum()

    def dense(self) -> dict[str, Any]:
        out = {"losses": self.losses, "weights": self.weights, "kind": self.kind}
        if self.anchor_index is not None:
            out["anchor_index"] = self.anchor_index
        return out


def elements(losses: Tensor, **kwargs: Any) -> DenseTerms:
    """Element terms: one loss per row of ``losses`` (anchors, samples or classes), weight 1.

    Example:
        >>> reduce(mean(), {"loss": elements(torch.tensor([1.0, 3.0]))}, None, torch.float32)
        tensor(2.)
    """
    return DenseTerms(
        losses, torch.ones_like(losses), "element", losses.shape[-1], unit_weights=True, **kwargs
    )


@dataclass(frozen=True, eq=False)
class AlreadyReduced(Terms):
    """A sub-loss that is one number already (0-d ``value``): :func:`reduce` adds it as it is,
    whatever the reducer, and :func:`none` lists it as ``{"losses": value, "weights": 1,
    "kind": "already_reduced"}``. It does not split over anchors.

    Example:
        >>> terms = {"loss": elements(torch.tensor([1.0, 3.0])), "reg": AlreadyReduced(torch.tensor(0.5))}
        >>> reduce(mean(), terms, None, torch.float32)
        tensor(2.5000)
    """

    value: Tensor
    kind: str = "already_reduced"
    num_anchors: int = 0

    @property
    def device(self) -> torch.device:
        return self.value.device

    def stats(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        raise ValueError("an already-reduced term has no per-anchor statistics")

    def dense(self) -> dict[str, Any]:
        return {"losses": self.value, "weights": torch.ones_like(self.value), "kind": self.kind}


class Reducer:
    """Base class of the reducers. ``reducer(terms, labels)`` returns a 0-d tensor.

    Every reducer but :func:`none` and :func:`divisor` splits over anchor chunks: its value is
    ``Σ_chunks partial(chunk, N)`` where the normaliser ``N = Σ_chunks normalizer(chunk)`` is a
    sum over the chunks too; equivalently ``divide(Σ_chunks partial(chunk, 1), N)``, which
    needs no first pass for ``N`` (:mod:`pmlfunc.chunked` relies on it). The plain call is the
    one-chunk case, so both paths share the same code.
    """

    chunkable: bool = True

    def normalizer(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        """This chunk's share of the normaliser (summed over chunks)."""
        raise NotImplementedError

    def partial(self, terms: Terms, labels: Tensor | None, normalizer: Tensor) -> Tensor:
        """This chunk's share of the value, given the whole batch's normaliser."""
        raise NotImplementedError

    def share_and_normalizer(
        self, terms: Terms, labels: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(partial(terms, labels, 1), normalizer(terms, labels))``: this chunk's share
        before the division (see :meth:`divide`) and its part of the normaliser, from one pass
        over the terms where the reducer allows."""
        one = torch.ones((), device=terms.device)
        return self.partial(terms, labels, one), self.normalizer(terms, labels)

    def divide(self, share: Tensor, normalizer: Tensor) -> Tensor:
        """``partial(terms, labels, normalizer)`` from ``share = partial(terms, labels, 1)``:
        a share is its selected terms' (weighted) sum over the normaliser, ``0`` where that is
        0, so a chunk's share and gradient can be taken before the whole batch's normaliser is
        known (:mod:`pmlfunc.chunked`: one pass, not two)."""
        return ratio(share, normalizer)

    def __call__(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        return self.partial(terms, labels, self.normalizer(terms, labels))


@dataclass(frozen=True)
class _Window(Reducer):
    low: Bound = None
    high: Bound = None

    def __repr__(self) -> str:
        if self.low is None and self.high is None:
            return "mean()"
        if self.high is None and _is_zero(self.low):
            return "avg_nonzero()"
        return f"threshold(low={self.low!r}, high={self.high!r})"

    def normalizer(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        return terms.totals(self.low, self.high)[1]

    def partial(self, terms: Terms, labels: Tensor | None, normalizer: Tensor) -> Tensor:
        return ratio(terms.totals(self.low, self.high)[0], normalizer)

    def share_and_normalizer(
        self, terms: Terms, labels: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return terms.totals(self.low, self.high)  # ratio(s, 1) is s

    def __call__(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        if (
            self.low is None
            and self.high is None
            and isinstance(terms, DenseTerms)
            and terms.unit_weights
            and terms.losses.numel() > 0
        ):
            return terms.losses.mean()  # the same number, in one op instead of five
        s, c = terms.totals(self.low, self.high)  # one pass for both
        return ratio(s, c)


@dataclass(frozen=True)
class _Sum(Reducer):
    def __repr__(self) -> str:
        return "sum()"

    def normalizer(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        return torch.zeros((), device=terms.device)

    def partial(self, terms: Terms, labels: Tensor | None, normalizer: Tensor) -> Tensor:
        return terms.totals()[0]

    def divide(self, share: Tensor, normalizer: Tensor) -> Tensor:
        return share  # a sum is not divided


@dataclass(frozen=True)
class _Divisor(Reducer):
    chunkable = False  # the divisor is the loss's own global count, not a sum over anchors

    def __repr__(self) -> str:
        return "divisor()"

    def normalizer(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        if terms.divisor is None:
            raise ValueError(
                "reducer=divisor() needs a loss that supplies a divisor; this loss does not (use sum() or mean())"
            )
        if isinstance(terms.divisor, Tensor):
            return terms.divisor
        return torch.full((), float(terms.divisor), device=terms.device)

    def partial(self, terms: Terms, labels: Tensor | None, normalizer: Tensor) -> Tensor:
        total = terms.totals()[0]
        return ratio(total, normalizer.to(total.dtype))


@dataclass(frozen=True)
class _PerAnchor(Reducer):
    inner: Reducer = field(default_factory=lambda: _Window())

    def __repr__(self) -> str:
        return f"per_anchor({self.inner!r})"

    def _per_anchor(self, terms: Terms) -> Terms:
        if terms.kind == "element":
            return terms
        if isinstance(terms, DenseTerms) and terms.kind in ("pos_pair", "neg_pair"):
            # PML writes each (anchor, other) pair into one cell: repeated pairs count once.
            terms = replace(terms, weights=(terms.weights > 0).to(terms.weights.dtype))
        s, c = terms.stats()
        return elements(ratio(s, c))

    def normalizer(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        return self.inner.normalizer(self._per_anchor(terms), labels)

    def partial(self, terms: Terms, labels: Tensor | None, normalizer: Tensor) -> Tensor:
        return self.inner.partial(self._per_anchor(terms), labels, normalizer)

    def share_and_normalizer(
        self, terms: Terms, labels: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.inner.share_and_normalizer(self._per_anchor(terms), labels)

    def divide(self, share: Tensor, normalizer: Tensor) -> Tensor:
        return self.inner.divide(share, normalizer)

    @property
    def chunkable(self) -> bool:  # type: ignore[override]
        return self.inner.chunkable


@dataclass(frozen=True, eq=False)
class _ClassWeighted(Reducer):
    weights: Tensor

    def __repr__(self) -> str:
        return f"class_weighted(<{self.weights.shape[0]} class weights>)"

    def normalizer(self, terms: Terms, labels: Tensor | None = None) -> Tensor:
        return terms.totals()[1]

    def partial(self, terms: Terms, labels: Tensor | None, normalizer: Tensor) -> Tensor:
        if labels is None:
            raise ValueError("reducer=class_weighted(...) needs labels (the anchors' classes)")
        s, _ = terms.stats()
        n = self.weights.shape[0]
        _checks.in_range(labels, 0, n, "labels", f"for reducer=class_weighted's {n} class weights")
        w = self.weights.to(device=s.device, dtype=s.dtype)[labels.long()]
        return ratio((w * s).sum(), normalizer)


@dataclass(frozen=True)
class _None(Reducer):
    chunkable = False  # it returns the terms themselves

    def __repr__(self) -> str:
        return "none()"

    def __call__(self, terms: Terms, labels: Tensor | None = None):
        return terms.dense()


def mean() -> Reducer:
    """Mean over all terms (PML ``MeanReducer``). Example: ``pf.losses.ntxent(e, y, reducer=mean())``."""
    return _Window()


def avg_nonzero() -> Reducer:
    """Mean over the terms with a positive loss (PML ``AvgNonZeroReducer``):
    ``Σ l / #{l > 0}``. Example: ``pf.losses.contrastive(e, y, reducer=avg_nonzero())``."""
    return _Window(low=0.0)


def sum() -> Reducer:
    """Sum of all terms (PML ``SumReducer``). Example: ``pf.losses.contrastive(e, y, reducer=sum())``."""
    return _Sum()


def divisor() -> Reducer:
    """Sum of all terms divided by the divisor the loss supplies (PML ``DivisorReducer``).

    Example:
        >>> terms = {"loss": elements(torch.tensor([1.0, 3.0]), divisor=4.0)}
        >>> reduce(divisor(), terms, None, torch.float32)
        tensor(1.)
    """
    return _Divisor()


def threshold(low: float | Tensor | None = None, high: float | Tensor | None = None) -> Reducer:
    """Mean of the terms with ``low < loss < high`` (PML ``ThresholdReducer``); at least one bound.

    Example: ``pf.losses.triplet_margin(e, y, reducer=threshold(low=0.1))``.
    """
    if low is None and high is None:
        raise ValueError("threshold() needs at least one of low or high")
    low = None if low is None else _checks.hyper(low, "low")
    high = None if high is None else _checks.hyper(high, "high")
    return _Window(low=low, high=high)


def per_anchor(reducer: Reducer | None = None) -> Reducer:
    """Average each anchor's terms, then reduce the per-anchor values with ``reducer``
    (default ``mean()``) (PML ``PerAnchorReducer``). Anchors without terms count as 0; a pair
    listed several times in an index tuple counts once, as in PML.

    Unlike PML, triplet terms are supported (each anchor's mean over its triplets).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.contrastive(emb, labels, reducer=per_anchor())
    """
    if reducer is None:
        reducer = mean()
    if not isinstance(reducer, Reducer):
        raise TypeError(
            f"per_anchor(reducer=...) must be a pmlfunc reducer, got {type(reducer).__name__}"
        )
    return _PerAnchor(reducer)


def class_weighted(weights: Tensor) -> Reducer:
    """``mean(loss · weights[label(anchor)])`` over all terms (PML ``ClassWeightedReducer``).

    Args:
        weights: ``(num_classes,)`` tensor of per-class weights; a label outside ``[0,
            num_classes)`` is an ``IndexError`` naming ``labels`` (where PML's reducer reads
            ``weights[-1]`` for a label of ``-1``).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> w = torch.tensor([1.0, 2.0, 1.0, 0.5])
        >>> loss = pf.losses.multi_similarity(emb, labels, reducer=class_weighted(w))
    """
    if not isinstance(weights, Tensor) or weights.ndim != 1:
        raise TypeError("class_weighted(weights) needs a 1-D tensor of per-class weights")
    return _ClassWeighted(weights)


def none() -> Reducer:
    """No reduction: the loss returns ``{sub_loss_name: {"losses", "weights", "kind"}}``
    (PML ``DoNothingReducer``). All-triplet terms are materialised as ``(B, M, M)`` here.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> sorted(pf.losses.contrastive(emb, labels, reducer=none()))
        ['neg_loss', 'pos_loss']
    """
    return _None()


def reduce(
    reducer: Reducer | None,
    terms: Mapping[str, Terms],
    labels: Tensor | None,
    out_dtype: torch.dtype,
) -> Any:
    """Reduce every sub-loss with ``reducer`` and sum them (PML's ``MultipleReducers``); the
    result in ``out_dtype`` (a dict of unreduced terms for :func:`none`). ``reducer=None`` is for
    a loss whose every sub-loss is :class:`AlreadyReduced`.

    The result is a 0-d ``Tensor``, or for :func:`none` a ``dict[str, dict[str, Any]]``
    (annotated ``Any``: which one depends on the reducer's value, not its type).

    Example:
        >>> reduce(sum(), {"a": elements(torch.ones(3)), "b": elements(torch.ones(2))}, None,
        ...        torch.float32)
        tensor(5.)
    """
    if reducer is None and not all(isinstance(t, AlreadyReduced) for t in terms.values()):
        raise ValueError("reduce(None, ...) needs every term to be AlreadyReduced")
    if reducer is not None and not isinstance(reducer, Reducer):
        raise TypeError(
            f"reducer must be a pmlfunc reducer (pmlfunc.reducers.mean(), ...), got {type(reducer).__name__}"
        )
    if isinstance(reducer, _None):
        return {name: t.dense() for name, t in terms.items()}
    total: Tensor | None = None
    for t in terms.values():
        if isinstance(t, AlreadyReduced):
            v = t.value
        else:
            assert reducer is not None  # checked above: without one every term is AlreadyReduced
            v = reducer(t, labels)
        total = v if total is None else total + v
    assert total is not None, "reduce needs at least one sub-loss"
    return total.to(out_dtype)
