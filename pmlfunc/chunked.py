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

What can be chunked is what the losses' specs say (:func:`chunkable` lists them): every batch loss
whose terms belong to its anchors, with any distance, ``ref_emb``/``ref_labels``,
``indices_tuple``, and every reducer except ``none()`` and ``divisor()``. Other losses (proxy and
classifier losses are per-sample already: use ``torch.func`` directly), settings that couple
anchors (``triplet_margin(swap=True)``, ...) and ``mat=`` (a chunk computes its own rows) are
rejected with an error that says why.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor

from . import _checks
from ._ops import inside_transform
from .losses._batch import LossCall, spec_of
from .losses._regularize import regularize

__all__ = ["chunkable", "value_and_grad"]

_WRT = ("embeddings", "ref_emb")


# torch.func.vjp without has_aux: (value, vjp_fn). torch annotates its result as a pair or a
# triple (has_aux=True), so the pair is cast to this.
_VjpPair: TypeAlias = "tuple[Tensor, Callable[[Tensor], tuple[Tensor]]]"


@functools.cache
def chunkable() -> tuple[str, ...]:
    """The names of the losses in :mod:`pmlfunc.losses` that split over anchors (some only
    with certain settings: their errors say which), read from the losses' specs.

    Example:
        >>> "ntxent" in chunkable() and "proxy_anchor" not in chunkable()
        True
    """
    from . import losses

    names = []
    for name in losses.__all__:
        spec, _ = spec_of(getattr(losses, name))
        if spec is not None and spec.unchunkable is None:
            names.append(name)
    return tuple(names)


def _spec(loss_fn: Callable[..., Tensor]):
    spec, bound = spec_of(loss_fn)
    if spec is None:
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        raise ValueError(
            f"{name} does not decompose over anchors, so it cannot be chunked: value_and_grad "
            f"supports {', '.join(chunkable())} (proxy and classifier losses are per-sample: "
            "use torch.func directly)"
        )
    return spec, bound


def split_call(loss_fn: Callable[..., Tensor], args: tuple, kwargs: dict[str, Any]) -> LossCall:
    """A call of ``loss_fn`` checked for splitting over anchor rows (a ``ValueError`` that says
    why when it cannot be split): what :func:`value_and_grad` and
    :mod:`pmlfunc.distributed` compute by rows."""
    spec, bound = _spec(loss_fn)
    kwargs = {**bound, **kwargs}
    if kwargs.pop("chunk_size", None) is not None:
        raise ValueError(
            "chunk_size was also given to the loss: value_and_grad does the chunking itself"
        )
    call = spec.bind_call(args, kwargs)
    reason = call.unchunkable()
    if reason is not None:
        raise ValueError(reason)
    return call


def value_and_grad(
    loss_fn: Callable[..., Tensor],
    chunk_size: int,
    *,
    wrt: str | Sequence[str] = "embeddings",
) -> Callable[..., tuple[Tensor, Any]]:
    r"""Loss and gradient of an anchor-decomposable loss, computed ``chunk_size`` anchors at a time.

    With ``L = Σ_a ℓ_a / N`` (``N`` the reducer's normaliser over the whole batch), each chunk
    ``C`` contributes ``Σ_{a∈C} ℓ_a / N`` and its gradient; only a ``chunk × M`` block of the
    distance matrix and its autograd graph is alive at a time. When one chunk holds the whole
    batch (``chunk_size ≥ B``, eager mode), the whole loss is differentiated by plain autograd.

    Args:
        loss_fn: a chunkable loss (:func:`chunkable` lists them: ``pf.losses.ntxent``, ...), or
            a ``functools.partial`` of one with keyword arguments.
        chunk_size: anchors per chunk (a positive int; need not divide the batch).
        wrt: ``"embeddings"``, ``"ref_emb"`` or both (a sequence): what to differentiate.

    Returns:
        A function with the loss's signature returning ``(loss, grad)``; ``grad`` is a tensor for
        one ``wrt`` name, a tuple in ``wrt`` order for several.

    Example:
        >>> encoder = torch.nn.Linear(16, 4)
        >>> x, labels = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> emb = encoder(x)
        >>> vg = value_and_grad(pf.losses.ntxent, chunk_size=3)
        >>> loss, g = vg(emb.detach(), labels, temperature=0.07)  # the full-batch loss, gradient
        >>> torch.allclose(loss, pf.losses.ntxent(emb, labels, temperature=0.07))
        True
        >>> emb.backward(g)  # into the encoder (GradCache)

    References: Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited
    Setup" (GradCache), RepL4NLP 2021; Cheng et al., "Breaking the Memory Barrier: Near Infinite
    Batch Size Scaling for Contrastive Loss" (Inf-CL), 2024.
    """
    rows_vg = rows_value_and_grad(loss_fn, chunk_size, wrt)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        return rows_vg(None, *args, **kwargs)

    value_and_grad_fn.__doc__ = rows_vg.__doc__
    return value_and_grad_fn


def rows_value_and_grad(
    loss_fn: Callable[..., Tensor], chunk_size: int, wrt: str | Sequence[str]
) -> Callable[..., tuple[Tensor, Any]]:
    """:func:`value_and_grad`, whose function takes the anchor rows to differentiate first:
    ``fn(anchor_rows, *args, **kwargs)``. ``anchor_rows = (r0, r1)`` gives the share of the
    anchors ``r0 ≤ a < r1`` in the whole loss (normalised over the whole batch) and its gradient
    with respect to every row (:mod:`pmlfunc.distributed` splits anchors over ranks); ``None``
    gives the whole loss."""
    _spec(loss_fn)  # a loss that never splits fails here, not at the first call
    chunk_size = _checks.chunk_size(chunk_size)
    names = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    if not names or any(n not in _WRT for n in names) or len(set(names)) != len(names):
        raise ValueError(f"wrt must name one or both of {_WRT} (no repeats), got {wrt!r}")

    def fn(anchor_rows: tuple[int, int] | None, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        call = split_call(loss_fn, args, kwargs)
        if "ref_emb" in names and call.ref_emb is None:
            raise ValueError("wrt includes 'ref_emb' but no ref_emb was given")
        return _chunked(call, chunk_size, names, anchor_rows)

    fn.__doc__ = f"Chunked value and gradient of {getattr(loss_fn, '__name__', 'a loss')} " + (
        f"(chunk_size={chunk_size}, wrt={names})."
    )
    return fn


def _traced() -> bool:
    return torch.compiler.is_compiling() or inside_transform()


def _whole(call: LossCall, names: tuple[str, ...]) -> tuple[Tensor, Any]:
    """One chunk holds every anchor: the whole loss and its gradient by plain autograd (eager
    mode), without the normaliser pass and the ``torch.func`` transforms of the chunked path
    (the same value and gradient; at batch 128, ~2.5x faster)."""
    x = call.embeddings.detach().requires_grad_(True)
    ref = None if call.ref_emb is None else call.ref_emb.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = dataclasses.replace(call, embeddings=x, ref_emb=ref).loss()
        wrt = [x if n == "embeddings" or ref is None else ref for n in names]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    out = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt, strict=True))
    return loss.detach(), (out[0] if len(names) == 1 else out)


def _chunked(
    call: LossCall, chunk_size: int, names: tuple[str, ...], anchor_rows: tuple[int, int] | None
) -> tuple[Tensor, Any]:
    """The two passes of :func:`value_and_grad` over one checked call."""
    embeddings, ref_emb, reducer = call.embeddings, call.ref_emb, call.reducer
    assert reducer is not None  # split_call refuses a call without one (unchunkable)
    _checks.embeddings(embeddings)
    batch_size = embeddings.shape[0]
    chunks = [(r, min(r + chunk_size, batch_size)) for r in range(0, batch_size, chunk_size)]
    if anchor_rows is None and len(chunks) == 1 and not _traced():
        return _whole(call, names)
    a0, a1 = (0, batch_size) if anchor_rows is None else anchor_rows
    mine = [(max(r0, a0), min(r1, a1)) for r0, r1 in chunks if max(r0, a0) < min(r1, a1)]
    # Normalise once, outside the chunks; its backward runs once at the end.
    normalize, rest = call.distance.split_normalization()
    cd = _checks.compute_dtype(embeddings.dtype)

    def prep(x: Tensor) -> Tensor:
        return normalize(x.to(cd))

    x_hat, x_vjp = cast(_VjpPair, torch.func.vjp(prep, embeddings))
    ref_hat, ref_vjp = (
        (None, None) if ref_emb is None else cast(_VjpPair, torch.func.vjp(prep, ref_emb))
    )
    self_mode = ref_emb is None

    def terms_of(anchors: Tensor, x: Tensor, ref: Tensor | None, rows: tuple[int, int]):
        batch = call.batch(rows, embeddings=x, ref_emb=ref, anchors=anchors, distance=rest)
        return batch, call.terms(batch)

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
    # (want_ref implies a ref_emb: value_and_grad checks it)
    g_ref = torch.zeros_like(ref_hat) if want_ref and ref_hat is not None else None
    total = x_hat.new_zeros(()) if not mine else None
    for r0, r1 in mine:
        grads, v = grad_and_value(x_hat[r0:r1], x_hat, ref_hat, (r0, r1))
        total = v if total is None else total + v
        if g_x is not None:
            g_x[r0:r1] += grads[0]
            if self_mode:
                g_x += grads[1]
        if g_ref is not None:
            g_ref += grads[1]
    assert total is not None  # mine is not empty when total starts as None
    results = []
    if g_x is not None:
        results.append(x_vjp(g_x)[0])
    if call.embedding_regularizer is not None:  # on the raw embeddings, once: its own gradient
        reg_grad, reg = torch.func.grad_and_value(
            lambda x: regularize(
                x.new_zeros(()), x, call.embedding_regularizer, call.embedding_reg_weight
            )
        )(embeddings)
        total = total + reg.to(total.dtype)
        if want_x:
            results[0] = results[0] + reg_grad
    if g_ref is not None and ref_vjp is not None:
        results.append(ref_vjp(g_ref)[0])
    results = [results[0 if n == "embeddings" or not want_x else 1] for n in names]
    out = total.to(cd)  # the loss's dtype: float32 for float16/bfloat16 embeddings
    return out, (results[0] if len(names) == 1 else tuple(results))
