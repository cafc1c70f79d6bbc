"""Anchor-chunked value and gradient: full-batch results with O(chunk × M) memory.

A loss that is a sum of per-anchor terms, normalised by a count over the whole batch, can be
evaluated one block of anchors at a time. :func:`value_and_grad` does it in one pass over the
chunks: each chunk gives its share of the loss *before* the division by the normaliser (the sum
of its selected terms), that share's gradient, and its part of the normaliser (the number of
non-zero terms for ``avg_nonzero()``, of all terms for ``mean()``, ...). After the last chunk
the summed shares and gradients are divided by the summed normaliser: a reducer's value is
linear in its share (:meth:`pmlfunc.reducers.Reducer.divide`), and the normaliser, a count, has
no gradient. In eager mode each chunk is differentiated by plain autograd, inside ``torch.func``
transforms and under ``torch.compile`` by ``torch.func.vjp``.

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
import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor

from . import _checks
from ._ops import inside_transform
from .losses._batch import LossCall, spec_of
from .losses._regularize import regularize
from .reducers import Reducer

__all__ = ["chunkable", "value_and_grad"]

_WRT = ("embeddings", "ref_emb")


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


# ``pullback(i, cotangent)``: the gradient of output ``i`` with respect to every primal.
_Pullback: TypeAlias = "Callable[[int, Tensor], tuple[Tensor, ...]]"
_VjpAux: TypeAlias = "tuple[Any, Callable[..., tuple[Tensor, ...]], Any]"


def _vjp(fn: Callable[..., Any], primals: tuple[Tensor, ...]) -> tuple[Any, Any, _Pullback]:
    """``(out, aux, pullback)`` for ``out, aux = fn(*primals)``, ``out`` a tuple of tensors;
    ``pullback(i, cotangent)`` is the gradient of ``out[i]`` with respect to each primal (zeros
    where it does not depend on one), called at most once per ``i``, in order.

    Traced (``torch.compile``, inside a ``torch.func`` transform): ``torch.func.vjp``. Eager:
    autograd on detached leaves (the results carry no graph). That skips a transform's cost per
    call (chunked NT-Xent at B = 512, chunk 128, on one CPU thread: 11 ms a step through
    ``torch.func``, 6.8 ms through autograd) and lets eager ops take their shortcuts that read
    values on the host.
    """
    if _traced():
        # torch annotates the result as a pair or (has_aux=True) a triple
        out, vjp_fn, aux = cast(_VjpAux, torch.func.vjp(fn, *primals, has_aux=True))

        def traced(i: int, cotangent: Tensor) -> tuple[Tensor, ...]:
            # torch.func.vjp takes a cotangent for every output: zeros for the others
            return vjp_fn(
                tuple(cotangent if j == i else torch.zeros_like(o) for j, o in enumerate(out))
            )

        return out, aux, traced
    leaves = tuple(p.detach().requires_grad_(True) for p in primals)
    with torch.enable_grad():
        out, aux = fn(*leaves)

    def eager(i: int, cotangent: Tensor) -> tuple[Tensor, ...]:
        if not out[i].requires_grad:  # an output that depends on no primal
            return tuple(torch.zeros_like(x) for x in leaves)
        grads = torch.autograd.grad(
            out[i], leaves, cotangent, retain_graph=i < len(out) - 1, allow_unused=True
        )
        return tuple(
            torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)
        )

    return tuple(o.detach() for o in out), aux, eager


def _pieces(
    batch_size: int, chunk_size: int, anchor_rows: tuple[int, int] | None
) -> list[tuple[int, int, bool]]:
    """The anchor row blocks ``(r0, r1, mine)`` in order: chunks of at most ``chunk_size`` rows,
    also cut at the bounds of ``anchor_rows``; ``mine``: inside ``anchor_rows`` (its share and
    gradient are wanted; every block's part of the normaliser is)."""
    a0, a1 = (0, batch_size) if anchor_rows is None else anchor_rows
    cuts = sorted({*range(0, batch_size, chunk_size), a0, a1, batch_size})
    return [(r0, r1, a0 <= r0 and r1 <= a1) for r0, r1 in itertools.pairwise(cuts)]


def _whole(call: LossCall, names: tuple[str, ...]) -> tuple[Tensor, Any]:
    """One chunk holds every anchor: the whole loss and its gradient by plain autograd (eager
    mode), through the loss's own whole-batch path (the same value and gradient; at batch 128
    and 512 on one CPU thread, ~1.2-1.3x faster than one chunk of the chunked path: the
    self-similarity's backward takes both sides from one product)."""
    x = call.embeddings.detach().requires_grad_(True)
    ref = None if call.ref_emb is None else call.ref_emb.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = dataclasses.replace(call, embeddings=x, ref_emb=ref).loss()
        wrt = [x if n == "embeddings" or ref is None else ref for n in names]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    out = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt, strict=True))
    return loss.detach(), (out[0] if len(names) == 1 else out)


@dataclasses.dataclass
class _Sums:
    """Per sub-loss, summed over the chunks: the undivided shares, the normalisers and the
    shares' gradients with respect to the normalised embeddings (``g_x``) and reference set
    (``g_ref``); a list stays empty when nothing is summed into it."""

    shares: list[Tensor] = dataclasses.field(default_factory=list)
    norms: list[Tensor] = dataclasses.field(default_factory=list)
    g_x: list[Tensor] = dataclasses.field(default_factory=list)
    g_ref: list[Tensor] = dataclasses.field(default_factory=list)

    def add_norms(self, parts: Sequence[Tensor]) -> None:
        self.norms = (
            [*parts] if not self.norms else [a + b for a, b in zip(self.norms, parts, strict=True)]
        )

    def divided(self, reducer: Reducer, zero: Tensor) -> Tensor:
        """The loss: ``Σ_k divide(shares[k], norms[k])`` (``zero`` when nothing was summed)."""
        for s, n in zip(self.shares, self.norms, strict=False):
            zero = zero + reducer.divide(s, n)
        return zero

    def gradient(self, reducer: Reducer, grads: list[Tensor], like: Tensor) -> Tensor:
        """``Σ_k grads[k] · divide(1, norms[k])``: the loss's gradient (zeros when empty)."""
        out = None
        for g, n in zip(grads, self.norms, strict=False):
            g = g * reducer.divide(torch.ones_like(n), n).to(g.dtype)
            out = g if out is None else out + g
        return torch.zeros_like(like) if out is None else out


def _chunked(
    call: LossCall, chunk_size: int, names: tuple[str, ...], anchor_rows: tuple[int, int] | None
) -> tuple[Tensor, Any]:
    """:func:`value_and_grad` of one checked call, in one pass over the chunks (the module
    docstring says how). A chunk outside ``anchor_rows`` gives its part of the normaliser only,
    without gradients."""
    embeddings, ref_emb, reducer = call.embeddings, call.ref_emb, call.reducer
    assert reducer is not None  # split_call refuses a call without one (unchunkable)
    _checks.embeddings(embeddings)
    batch_size = embeddings.shape[0]
    if anchor_rows is None and batch_size <= chunk_size and not _traced():
        return _whole(call, names)
    want_x, want_ref = "embeddings" in names, "ref_emb" in names
    # Normalise once, outside the chunks; its backward runs once at the end.
    normalize, rest = call.distance.split_normalization()
    cd = _checks.compute_dtype(embeddings.dtype)
    one = torch.ones((), dtype=cd, device=embeddings.device)

    def prep(x: Tensor) -> tuple[tuple[Tensor], tuple[()]]:
        return (normalize(x.to(cd)),), ()

    (x_hat,), _, x_back = _vjp(prep, (embeddings,))
    ref_hat, ref_back = None, None
    if ref_emb is not None:
        (ref_hat,), _, ref_back = _vjp(prep, (ref_emb,))

    def shares(rows: tuple[int, int], anchors: Tensor, x: Tensor, ref: Tensor | None):
        """Each sub-loss's undivided share, and (no graph) its part of the normaliser."""
        batch = call.batch(rows, embeddings=x, ref_emb=ref, anchors=anchors, distance=rest)
        pairs = [reducer.share_and_normalizer(t, batch.labels) for t in call.terms(batch).values()]
        return tuple(s for s, _ in pairs), tuple(n.detach() for _, n in pairs)

    # A chunk differentiates its anchor rows (a tensor of their own) and the whole batch (as
    # references) in self mode, else the reference set when its gradient is wanted.
    chunk: Callable[..., Any]
    if ref_hat is None:
        refs: tuple[Tensor, ...] = (x_hat,)
        chunk = lambda rows, a, x: shares(rows, a, x, None)  # noqa: E731
    elif want_ref:
        refs = (ref_hat,)
        chunk = lambda rows, a, ref: shares(rows, a, x_hat, ref)  # noqa: E731
    else:
        refs = ()
        chunk = lambda rows, a: shares(rows, a, x_hat, ref_hat)  # noqa: E731
    sums = _Sums()
    for r0, r1, mine in _pieces(batch_size, chunk_size, anchor_rows):
        if not mine:  # anchors of another rank: their part of the normaliser only
            with torch.no_grad():
                sums.add_norms(shares((r0, r1), x_hat[r0:r1], x_hat, ref_hat)[1])
            continue
        out, parts, pullback = _vjp(functools.partial(chunk, (r0, r1)), (x_hat[r0:r1], *refs))
        sums.add_norms(parts)
        first = not sums.shares
        if first:  # the first chunk of mine: one buffer per sub-loss
            sums.shares = list(out)
            sums.g_x = [torch.zeros_like(x_hat) for _ in out] if want_x else []
            sums.g_ref = [torch.zeros_like(r) for _ in out for r in refs] if want_ref else []
        for k, o in enumerate(out):
            if not first:
                sums.shares[k] = sums.shares[k] + o
            grads = pullback(k, one)
            if want_x:
                sums.g_x[k][r0:r1] += grads[0]
                if ref_hat is None:
                    sums.g_x[k] += grads[1]
            if want_ref:
                sums.g_ref[k] += grads[1]
    total = sums.divided(reducer, torch.zeros((), dtype=cd, device=embeddings.device))
    grad_x = x_back(0, sums.gradient(reducer, sums.g_x, x_hat))[0] if want_x else None
    total, grad_x = _regularized(call, total, grad_x)
    grad_ref = None
    if want_ref and ref_back is not None and ref_hat is not None:
        grad_ref = ref_back(0, sums.gradient(reducer, sums.g_ref, ref_hat))[0]
    results = [grad_x if n == "embeddings" else grad_ref for n in names]
    out_value = total.to(cd)  # the loss's dtype: float32 for float16/bfloat16 embeddings
    return out_value, (results[0] if len(names) == 1 else tuple(results))


def _regularized(
    call: LossCall, total: Tensor, grad_x: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """The loss and embedding gradient with the call's embedding regularizer added: a term of
    the raw embeddings, taken once with its own gradient."""
    if call.embedding_regularizer is None:
        return total, grad_x

    def reg_fn(x: Tensor) -> tuple[tuple[Tensor], tuple[()]]:
        zero = x.new_zeros(())
        return (regularize(zero, x, call.embedding_regularizer, call.embedding_reg_weight),), ()

    (reg,), _, reg_back = _vjp(reg_fn, (call.embeddings,))
    total = total + reg.to(total.dtype)
    if grad_x is not None:
        grad_x = grad_x + reg_back(0, torch.ones_like(reg))[0]
    return total, grad_x
