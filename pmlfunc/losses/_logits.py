r"""Class logits of the classifier losses, for classification at inference (PML's
``get_logits``) and for anything else that reads a head's scores.

:func:`class_logits` takes the loss itself and the keyword arguments it is trained with, so the
logits are those of the loss as configured (its scale, temperature, distance); each classifier
loss registers, from its own module, a function ``(embeddings, params, labels, hyper) -> (B, C)``
in :data:`CLASS_LOGITS` (``hyper``: the loss's keyword arguments with its defaults filled in).

| loss | logits ``z_ic`` (``labels=None``) | with ``labels`` |
|---|---|---|
| ``arcface``, ``cosface``, ``subcenter_arcface``, ``dynamic_arcface`` | ``s · cos θ_ic`` (sub-centres: the largest) | the target's ``s · ψ(cos θ_{iy_i})`` |
| ``large_margin_softmax`` / ``sphereface`` | ``s · ‖x_i‖ · ‖w_c‖ · cos θ_ic`` / ``s · ‖x_i‖ · cos θ_ic`` | the target's ``ψ`` in place of ``cos`` |
| ``normalized_softmax`` | ``±d(x_i, ŵ_c) / T`` (``+`` for a similarity) | the same |
| ``proxy_nca`` | ``±s · d(x_i, p_c)`` | the same |
| ``soft_triple`` | ``λ · S_ic`` (``S``: the soft maximum over the class's centres) | ``λ · (S_{iy_i} − δ)`` for the target |
| ``proxy_anchor`` | ``±d(x_i, p_c)`` | the same |
| ``p2s_grad`` | ``cos θ_ic`` (its renormalised weights) | the same |

Larger is more likely in every row: a distance enters negated. (PML's ``get_logits`` returns
``ProxyNCALoss``'s and ``ProxyAnchorLoss``'s raw distances, so with its default squared
Euclidean distance the largest is the farthest proxy; ``SoftTripleLoss``'s leaves out ``λ``;
each is a monotone map of the row here otherwise.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from .. import _checks
from .. import params as _params
from ._tiled import unpartial

__all__ = ["CLASS_LOGITS", "class_inputs", "class_logits"]

# loss -> (embeddings, params, labels or None, hyper) -> (B, C) logits; filled by the modules
CLASS_LOGITS: dict[Callable, Callable[[Tensor, Any, Tensor | None, dict], Tensor]] = {}


def class_logits(
    loss: Callable[..., Tensor],
    embeddings: Tensor,
    params: dict[str, Tensor],
    labels: Tensor | None = None,
    **hyper: Any,
) -> Tensor:
    r"""The ``(B, C)`` class logits of a classifier loss: the scores its softmax reads (the
    module table), larger for a more likely class.

    Args:
        loss: a classifier loss (``pf.losses.arcface``, ..., ``pf.losses.p2s_grad``; a
            ``functools.partial`` of one is unwrapped, its keywords used).
        embeddings: ``(B, D)`` float tensor.
        params: the loss's params (from its ``*_init``).
        labels: ``None`` (default) for the logits without a margin, as at inference; ``(B,)``
            class ids for the logits the loss trains on, the target's margin applied.
        **hyper: the loss's keyword arguments as given to it (``scale=``, ``margin=``,
            ``distance=``, ...; its defaults otherwise). Those that only shape training
            (``reducer``, ``indices_tuple``, the regularizers, ``class_chunk_size``) are accepted
            and have no effect: the logits are the ``(B, C)`` matrix.

    Returns:
        ``(B, C)`` tensor in the embeddings' compute dtype (float32 for float16/bfloat16),
        differentiable like the loss.

    Raises:
        ValueError: ``loss`` is not a classifier loss.
        TypeError: a keyword the loss does not take.

    Example:
        >>> params = pf.losses.arcface_init(10, 16, generator=torch.Generator().manual_seed(0))
        >>> emb = torch.randn(4, 16)
        >>> logits = pf.losses.class_logits(pf.losses.arcface, emb, params, scale=30.0)
        >>> logits.shape, bool((logits.argmax(1) < 10).all())
        (torch.Size([4, 10]), True)
    """
    fn, _, given = unpartial(loss, (), hyper)
    entry = CLASS_LOGITS.get(fn)
    if entry is None:
        names = ", ".join(sorted(f.__name__ for f in CLASS_LOGITS))
        raise ValueError(
            f"class_logits takes a classifier loss ({names}), got "
            f"{getattr(fn, '__name__', repr(fn))}"
        )
    keywords = {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    unknown = sorted(set(given) - set(keywords))
    if unknown:
        raise TypeError(f"{fn.__name__} takes no keyword argument {', '.join(unknown)}")
    return entry(embeddings, params, labels, {**keywords, **given})


def class_inputs(
    embeddings: Tensor,
    labels: Tensor | None,
    params: object,
    key: str,
    ndim: int,
    cast: bool,
    optional: bool = True,
) -> tuple[Tensor, Tensor]:
    """The checked ``(embeddings, params[key])`` of a classifier loss, both in the compute dtype
    (out-of-place, autograd-tracked casts; the table as it is without ``cast``: the class tiles
    cast it a tile at a time), and the labels checked against the table's classes, which may
    be absent where ``optional`` (the logits at inference)."""
    _checks.embeddings(embeddings)
    p = _params.check(params, key, embeddings, ndim=ndim)
    if labels is not None or not optional:
        checked = _checks.labels(labels, embeddings.shape[0], embeddings.device)
        _params.class_labels(checked, p.shape[0])
    cd = _checks.compute_dtype(embeddings.dtype)
    return embeddings.to(cd), p.to(cd) if cast else p
