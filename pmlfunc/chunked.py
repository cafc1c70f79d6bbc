"""Anchor-chunked value and gradient: full-batch results with O(chunk × M) memory.

A loss that is a sum of per-anchor terms, normalised by a count over the whole batch, can be
evaluated one block of anchors at a time. :func:`value_and_grad` does it in two passes:

1. without gradients, each chunk's share of the reducer's normaliser (the number of non-zero
   terms for ``avg_nonzero()``, of all terms for ``mean()``, ...), summed over the chunks;
2. for each chunk, the chunk's share of the loss given that normaliser, and its gradient by
   ``torch.func.grad_and_value``; the gradients are summed.

The result equals the full-batch loss and gradient to rounding, and no autograd graph larger than
one ``chunk × M`` block of the distance matrix is alive at once. Feed the gradient into an encoder
with ``emb.backward(grad)`` (the GradCache pattern, ``examples/gradcache.py``).

Supported: ``contrastive``, ``triplet_margin`` (not ``swap=True``), ``ntxent``, ``supcon``,
``multi_similarity``, with any distance, ``ref_emb``/``ref_labels``, ``indices_tuple``, and every
reducer except ``none()`` and ``divisor()``. Other losses (proxy and classifier losses are
per-sample already: use ``torch.func`` directly) and ``mat=`` (a chunk computes its own rows)
are rejected with an error that says why.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import _checks
from .distances import Distance
from .losses._common import SPECS, LossSpec, default_reducer, prepare, regularize
from .reducers import Reducer

__all__ = ["value_and_grad"]

_WRT = ("embeddings", "ref_emb")
_INPUTS = ("distance", "reducer", "ref_emb", "ref_labels", "indices_tuple", "mat")


def _spec_of(loss_fn: Callable) -> tuple[LossSpec, Callable, dict[str, Any]]:
    bound: dict[str, Any] = {}
    fn = loss_fn
    while isinstance(fn, functools.partial):
        if fn.args:
            raise ValueError("value_and_grad takes functools.partial with keyword arguments only")
        bound = {**fn.keywords, **bound}
        fn = fn.func
    spec = SPECS.get(fn)
    if spec is None:
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(
            f"{name} does not decompose over anchors, so it cannot be chunked: "
            "value_and_grad supports contrastive, triplet_margin, ntxent, supcon and "
            "multi_similarity (proxy and classifier losses are per-sample: use torch.func directly)"
        )
    return spec, fn, bound


@dataclass
class _SplitCall:
    """A call of a chunkable loss, bound and checked: what splitting it over anchors needs."""

    embeddings: Tensor
    labels: Tensor | None
    inputs: dict[str, Any]  # distance, reducer, ref_emb, ref_labels, indices_tuple, mat
    hyper: dict[str, Any]
    reducer: Reducer
    regularizer: Callable[[Tensor], Tensor] | None = None
    reg_weight: float | Tensor = 1.0


def _split_call(
    spec: LossSpec, signature: inspect.Signature, bound: dict[str, Any], args, kwargs
) -> _SplitCall:
    """Bind a call of ``spec``'s loss; ``ValueError`` when it cannot be split over anchors."""
    call = signature.bind(*args, **{**bound, **kwargs})
    call.apply_defaults()
    given = dict(call.arguments)
    embeddings, labels = given.pop("embeddings"), given.pop("labels")
    inputs = {k: given.pop(k) for k in _INPUTS}
    hyper = given
    regularizer = hyper.pop("embedding_regularizer", None)
    reg_weight = hyper.pop("embedding_reg_weight", 1.0)
    if hyper.pop("chunk_size", None) is not None:
        raise ValueError(
            "chunk_size was also given to the loss: value_and_grad does the chunking itself"
        )
    if inputs["mat"] is not None:
        raise ValueError("mat cannot be chunked: each chunk computes its own rows of the matrix")
    reason = spec.unchunkable(**hyper)
    if reason is not None:
        raise ValueError(f"{spec.name} cannot be chunked with these settings: {reason}")
    reducer: Reducer = default_reducer(inputs["reducer"], spec.default_reducer)
    if not isinstance(reducer, Reducer):
        raise TypeError(f"reducer must be a pmlfunc reducer, got {type(reducer).__name__}")
    if not reducer.chunkable:
        raise ValueError(
            f"reducer {type(reducer).__name__.strip('_')} does not split over anchors "
            "(none() returns the terms, divisor() divides by a loss-specific global count)"
        )
    return _SplitCall(embeddings, labels, inputs, hyper, reducer, regularizer, reg_weight)


def value_and_grad(
    loss_fn: Callable[..., Tensor],
    chunk_size: int,
    *,
    wrt: str | Sequence[str] = "embeddings",
) -> Callable[..., tuple[Tensor, Any]]:
    r"""Loss and gradient of an anchor-decomposable loss, computed ``chunk_size`` anchors at a time.

    With ``L = Σ_a ℓ_a / N`` (``N`` the reducer's normaliser over the whole batch), each chunk
    ``C`` contributes ``Σ_{a∈C} ℓ_a / N`` and its gradient; only a ``chunk × M`` block of the
    distance matrix and its autograd graph is alive at a time.

    Args:
        loss_fn: a chunkable loss (``pf.losses.ntxent``, ...), or a ``functools.partial`` of one
            with keyword arguments.
        chunk_size: anchors per chunk (a positive int; need not divide the batch).
        wrt: ``"embeddings"``, ``"ref_emb"`` or both (a sequence): what to differentiate.

    Returns:
        A function with the loss's signature returning ``(loss, grad)``; ``grad`` is a tensor for
        one ``wrt`` name, a tuple in ``wrt`` order for several.

    Example:
        >>> vg = value_and_grad(pf.losses.ntxent, chunk_size=256)
        >>> loss, g = vg(emb, labels, temperature=0.07)  # == ntxent(emb, labels) and its gradient
        >>> emb_with_grad.backward(g)  # into the encoder (GradCache)

    References: Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited
    Setup" (GradCache), RepL4NLP 2021; Cheng et al., "Breaking the Memory Barrier: Near Infinite
    Batch Size Scaling for Contrastive Loss" (Inf-CL), 2024.
    """
    run = _value_and_grad(loss_fn, chunk_size, wrt)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        return run(None, *args, **kwargs)

    value_and_grad_fn.__doc__ = run.__doc__
    return value_and_grad_fn


def _value_and_grad(
    loss_fn: Callable[..., Tensor], chunk_size: int, wrt: str | Sequence[str]
) -> Callable[..., tuple[Tensor, Any]]:
    """:func:`value_and_grad`, whose function takes the anchor rows to differentiate first:
    ``run(anchor_rows, *args, **kwargs)``. ``anchor_rows = (r0, r1)`` gives the share of the
    anchors ``r0 ≤ a < r1`` in the whole loss (normalised over the whole batch) and its gradient
    with respect to every row (:mod:`pmlfunc.distributed` splits anchors over ranks); ``None``
    gives the whole loss."""
    spec, fn, bound = _spec_of(loss_fn)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    names = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    if not names or any(n not in _WRT for n in names) or len(set(names)) != len(names):
        raise ValueError(f"wrt must name one or both of {_WRT} (no repeats), got {wrt!r}")
    signature = inspect.signature(fn)

    def run(anchor_rows: tuple[int, int] | None, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        split = _split_call(spec, signature, bound, args, kwargs)
        embeddings, labels, inputs, hyper, reducer = (
            split.embeddings,
            split.labels,
            split.inputs,
            split.hyper,
            split.reducer,
        )
        ref_emb = inputs["ref_emb"]
        if "ref_emb" in names and ref_emb is None:
            raise ValueError("wrt includes 'ref_emb' but no ref_emb was given")
        _checks.embeddings(embeddings)
        batch_size = embeddings.shape[0]
        chunks = [(r, min(r + chunk_size, batch_size)) for r in range(0, batch_size, chunk_size)]
        a0, a1 = (0, batch_size) if anchor_rows is None else anchor_rows
        mine = [(max(r0, a0), min(r1, a1)) for r0, r1 in chunks if max(r0, a0) < min(r1, a1)]
        distance = inputs["distance"]
        distance = spec.default_distance if distance is None else distance
        if not isinstance(distance, Distance):
            raise TypeError(f"distance must be a pmlfunc distance, got {type(distance).__name__}")
        # Normalise once, outside the chunks; its backward runs once at the end.
        normalize, rest = distance.split_normalization()
        cd = _checks.compute_dtype(embeddings.dtype)

        def prep(x: Tensor) -> Tensor:
            return normalize(x.to(cd))

        x_hat, x_vjp = torch.func.vjp(prep, embeddings)
        ref_hat, ref_vjp = (None, None) if ref_emb is None else torch.func.vjp(prep, ref_emb)
        self_mode = ref_emb is None

        def terms_of(anchors: Tensor, x: Tensor, ref: Tensor | None, rows: tuple[int, int]):
            batch = prepare(
                x,
                labels,
                ref,
                inputs["ref_labels"],
                inputs["indices_tuple"],
                None,
                rest,
                spec.default_distance,
                rows=rows,
                anchors=anchors,
            )
            return batch, spec.terms(batch, **hyper)

        # Pass 1: the normalisers of every sub-loss, summed over the chunks (no graph).
        norms: dict[str, Tensor] = {}
        with torch.no_grad():
            for r0, r1 in chunks:
                batch, terms = terms_of(x_hat[r0:r1], x_hat, ref_hat, (r0, r1))
                for name, t in terms.items():
                    n = reducer.normalizer(t, batch.labels)
                    norms[name] = n if name not in norms else norms[name] + n

        # Pass 2: each chunk's share of the value and its gradient, with respect to its own
        # anchor rows, the whole batch (as references, in self mode) and the reference set.
        def chunk_value(anchors, x, ref, rows):
            batch, terms = terms_of(anchors, x, ref, rows)
            parts = [reducer.partial(t, batch.labels, norms[name]) for name, t in terms.items()]
            return torch.stack(parts).sum()

        want_x, want_ref = "embeddings" in names, "ref_emb" in names
        argnums = (0, 1) if self_mode else ((0, 2) if want_ref else (0,))
        grad_and_value = torch.func.grad_and_value(chunk_value, argnums=argnums)
        g_x = torch.zeros_like(x_hat) if want_x else None
        g_ref = torch.zeros_like(ref_hat) if want_ref else None
        total = x_hat.new_zeros(()) if not mine else None
        for r0, r1 in mine:
            grads, v = grad_and_value(x_hat[r0:r1], x_hat, ref_hat, (r0, r1))
            total = v if total is None else total + v
            if want_x:
                g_x[r0:r1] += grads[0]
                if self_mode:
                    g_x += grads[1]
            if want_ref:
                g_ref += grads[1]
        results = []
        if want_x:
            results.append(x_vjp(g_x)[0])
        if split.regularizer is not None:  # on the raw embeddings, once: its own gradient
            reg_grad, reg = torch.func.grad_and_value(
                lambda x: regularize(x.new_zeros(()), x, split.regularizer, split.reg_weight)
            )(embeddings)
            total = total + reg.to(total.dtype)
            if want_x:
                results[0] = results[0] + reg_grad
        if want_ref:
            results.append(ref_vjp(g_ref)[0])
        results = [results[0 if n == "embeddings" or not want_x else 1] for n in names]
        out = total.to(embeddings.dtype)
        return out, (results[0] if len(names) == 1 else tuple(results))

    run.__doc__ = (
        f"Chunked value and gradient of {spec.name} (chunk_size={chunk_size}, wrt={names})."
    )
    return run
