"""Adding a regularizer's loss to a loss, as PML's regularizer mixins do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from .. import _checks
from .._ops import scalar_like
from ..reducers import AlreadyReduced

__all__ = ["regularize", "regularize_params"]


def regularize(
    loss: Any,
    x: Tensor,
    regularizer: Callable[[Tensor], Tensor] | None,
    weight: float | Tensor,
    *,
    name: str = "embedding",
) -> Any:
    """``loss + weight · regularizer(x)``, as PML adds a regularizer's (already reduced) loss.

    ``name`` is ``"embedding"`` (``embedding_regularizer`` on the embeddings) or ``"weight"``
    (``weight_regularizer`` on a class-major weight matrix). With the ``none()`` reducer the loss
    is a dict of terms: the regularizer becomes its ``"<name>_reg_loss"`` entry, an
    :class:`~pmlfunc.reducers.AlreadyReduced` term (so ``loss`` and the result are ``Any``: a
    0-d tensor or that dict, as :func:`~pmlfunc.reducers.reduce` returns).
    """
    if regularizer is None:
        return loss
    if not callable(regularizer):
        raise TypeError(
            f"{name}_regularizer must be a function of a tensor (e.g. pf.regularizers.lp), "
            f"got {type(regularizer).__name__}"
        )
    weight = _checks.hyper(weight, f"{name}_reg_weight")
    reg = regularizer(x)
    if not isinstance(reg, Tensor) or reg.ndim != 0:
        raise ValueError(f"{name}_regularizer must return a 0-d tensor")
    term = scalar_like(weight, reg) * reg
    if isinstance(loss, dict):  # none(): an already-reduced entry, in the terms' format
        return {**loss, f"{name}_reg_loss": AlreadyReduced(term).dense()}
    return loss + term.to(loss.dtype)


def regularize_params(
    loss: Any,
    embeddings: Tensor,
    weights: Tensor,
    embedding_regularizer: Callable[[Tensor], Tensor] | None,
    embedding_reg_weight: float | Tensor,
    weight_regularizer: Callable[[Tensor], Tensor] | None,
    weight_reg_weight: float | Tensor,
) -> Any:
    """A learnable loss's two regularizers, as PML's mixins add them: on the embeddings, and on
    the class-major weights flattened to ``(C[·K], D)`` rows (sub-centres one row each)."""
    loss = regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)
    flat = weights.reshape(-1, weights.shape[-1])
    return regularize(loss, flat, weight_regularizer, weight_reg_weight, name="weight")
