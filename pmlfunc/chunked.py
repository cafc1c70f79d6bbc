"""Anchor-chunked value and gradient: full-batch results with O(chunk × M) memory.

A loss that is a sum of per-anchor terms, normalised by a count over the whole batch, can be
evaluated one block of anchors at a time. :func:`value_and_grad` does it in one pass over the
chunks: each chunk gives its share of the loss *before* the division by the normaliser (the sum
of its selected terms), that share's gradient, and its part of the normaliser (the number of
non-zero terms for ``avg_nonzero()``, of all terms for ``mean()``, ...). After the last chunk
the summed shares and gradients are divided by the summed normaliser: a reducer's value is
linear in its share (:meth:`pmlfunc.reducers.Reducer.divide`), and the normaliser, a count, has
no gradient. In eager mode each chunk is differentiated by plain autograd, inside ``torch.func``
transforms and under ``torch.compile`` by ``torch.func.vjp``. In eager mode a call that the tiled
engine runs (NT-Xent and SupCon with labels) is the engine's, in tiles of ``chunk_size`` rows: one
walk that forms each tile's gradient, the same numbers and memory (:func:`_engine`).

The result equals the full-batch loss and gradient to rounding, and no autograd graph larger than
one ``chunk × M`` block of the distance matrix is alive at once. Feed the gradient into an encoder
with ``emb.backward(grad)``, or let :func:`gradcache` run the whole GradCache step.

What can be chunked is what the losses' specs say (:func:`chunkable` lists them): every batch loss
whose terms belong to its anchors, with any distance, ``ref_emb``/``ref_labels``,
``indices_tuple``, and every reducer except ``none()`` and ``divisor()``. Other losses (proxy and
classifier losses are per-sample already: use ``torch.func`` directly), settings that couple
anchors (``triplet_margin(swap=True)``, ...) and ``mat=`` (a chunk computes its own rows) are
rejected with an error that says why.

:func:`gradcache` is the step around a loss: the encoders run in mini-batches twice (without a
graph, then with one, replaying the random state), the loss once on the cached embeddings, so the
encoders' activations are held for one mini-batch at a time (Gao et al., 2021).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor

from . import _checks
from ._ops import (
    FirstOrder,
    apply,
    first_order_backward,
    inside_transform,
    no_autocast,
    unrecorded,
)
from .losses._batch import LossCall, spec_of
from .losses._regularize import regularize
from .reducers import Reducer

__all__ = ["chunkable", "gradcache", "loss", "value_and_grad"]

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
        wrt: what to differentiate: ``"embeddings"``, ``"ref_emb"``, the name of a
            hyper-parameter the call gives as a floating tensor (``"temperature"``: a learnable
            temperature), or a sequence of these.

    Returns:
        A function with the loss's signature returning ``(loss, grad)``; ``grad`` is a tensor for
        one ``wrt`` name, a tuple in ``wrt`` order for several. Neither carries a graph in eager
        mode, so a tensor hyper-parameter's gradient is returned only when ``wrt`` names it.

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


def loss(loss_fn: Callable[..., Tensor], chunk_size: int) -> Callable[..., Tensor]:
    r"""An anchor-decomposable loss as a chunked loss with a plain ``backward()``.

    The forward runs :func:`value_and_grad` (every chunk's share and gradient, one pass) and
    returns the loss as ``L + Σ_v ⟨∂L/∂v, v − sg(v)⟩`` over the embeddings, the reference set,
    every floating tensor hyper-parameter and a tensor ``embedding_reg_weight`` (whose gradient
    is the regularizer's value): the value is ``L`` exactly (each added term is a
    product with an exact zero) and the gradient reaching each ``v`` is the chunked ``∂L/∂v``.
    So any chunkable loss (triplet, contrastive, multi-similarity, ...) trains through
    ``loss.backward()``, :func:`gradcache` or ``torch.func.grad`` in ``O(chunk × M)`` memory, as
    ``chunk_size=`` does for the tiled engine's losses.

    The gradient is formed in the forward whether or not a backward follows (evaluate a loss
    without it under ``torch.no_grad()`` with the plain function), and it is a first-order
    gradient: differentiating it again (double backward, nested ``torch.func.grad``) raises a
    ``RuntimeError``; the plain loss is differentiable twice.

    Args:
        loss_fn: a chunkable loss (:func:`chunkable`), or a ``functools.partial`` of one.
        chunk_size: anchors per chunk (a positive int).

    Returns:
        A function with the loss's signature returning the 0-d loss.

    Example:
        >>> emb = torch.randn(64, 8, requires_grad=True)
        >>> labels = torch.arange(64) // 4
        >>> out = loss(pf.losses.multi_similarity, chunk_size=16)(emb, labels)
        >>> out.backward()  # the full-batch gradient, 16 anchors at a time
        >>> torch.allclose(out, pf.losses.multi_similarity(emb, labels))
        True
    """
    _spec(loss_fn)
    chunk_size = _checks.chunk_size(chunk_size)

    def chunked_loss(*args: Any, **kwargs: Any) -> Tensor:
        call = split_call(loss_fn, args, kwargs)
        inputs = {"embeddings": call.embeddings}
        if call.ref_emb is not None:
            inputs["ref_emb"] = call.ref_emb
        inputs |= {
            n: v for n, v in call.hyper.items() if isinstance(v, Tensor) and v.is_floating_point()
        }
        if not _traced():  # eager: only what autograd will ask for
            inputs = {n: v for n, v in inputs.items() if v.requires_grad}
        names = tuple(inputs) or ("embeddings",)  # nothing to differentiate: the value alone
        with torch.no_grad() if not _traced() else contextlib.nullcontext():
            value, grads = _chunked(call, chunk_size, names, None)
        out = value.detach()
        if inputs:
            for v, g in zip(inputs.values(), grads if len(names) > 1 else (grads,), strict=True):
                out = out + apply(FirstOrderTerm, v, g.detach().to(v.dtype)).to(out.dtype)
        reg = _reg_weight_term(call)
        return out if reg is None else out + reg.to(out.dtype)

    chunked_loss.__doc__ = (
        f"{getattr(loss_fn, '__name__', 'a loss')} chunked {chunk_size} anchors at a time, "
        "with a plain backward (pmlfunc.chunked.loss)."
    )
    return chunked_loss


def _reg_weight_term(call: LossCall) -> Tensor | None:
    """The gradient of a learnable ``embedding_reg_weight`` (a floating tensor that requires
    grad, or any in traced code) as a :class:`FirstOrderTerm`: ``∂L/∂w = regularizer(x)``,
    the regularizer's value (the chunks' sum already holds ``w · regularizer(x)``); else
    ``None``."""
    w = call.embedding_reg_weight
    learnable = isinstance(w, Tensor) and w.is_floating_point() and (_traced() or w.requires_grad)
    if call.embedding_regularizer is None or not learnable:
        return None
    assert isinstance(w, Tensor)
    with torch.no_grad() if not _traced() else contextlib.nullcontext():
        reg = call.embedding_regularizer(call.embeddings)
    return apply(FirstOrderTerm, w, reg.detach().to(w.dtype))


class FirstOrderTerm(torch.autograd.Function):
    """``⟨g, v − sg(v)⟩``: 0 for finite ``v`` (NaN where ``v`` is not), whose gradient with respect
    to ``v`` is the given ``g`` times the cotangent: how :func:`loss` hands its chunked
    gradient to autograd. The backward scales ``g`` through :class:`_ScaledFirstOrder` where it
    is recorded (``create_graph``, ``torch.func``, compile), so that differentiating the
    gradient again raises instead of silently missing the second-order terms (``g`` is a
    constant to autograd)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(v: Tensor, g: Tensor) -> Tensor:
        # v − sg(v): where dynamo differentiates the traced forward itself (torch.func.grad
        # inside torch.compile) instead of calling backward, this gives the same g
        return (g * (v - v.detach())).sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        v, g = inputs
        ctx.save_for_backward(v, g)

    @staticmethod
    def backward(ctx, cotangent):
        v, g = ctx.saved_tensors
        if unrecorded():
            return g * cotangent, None
        return apply(_ScaledFirstOrder, v, g, cotangent), None


class _ScaledFirstOrder(FirstOrder):
    """``g · cotangent`` as a Function of ``v`` (:class:`FirstOrderTerm`'s recorded backward):
    a second differentiation raises."""

    @staticmethod
    def forward(v: Tensor, g: Tensor, cotangent: Tensor) -> Tensor:
        return g * cotangent

    backward = staticmethod(
        first_order_backward(
            "pmlfunc.chunked.loss's gradient (formed chunk by chunk in the forward)",
            "differentiate the plain loss",
        )
    )


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
    if not names or any(not isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"wrt must name one or more of {_WRT} or tensor hyper-parameters (no repeats), "
            f"got {wrt!r}"
        )

    def fn(anchor_rows: tuple[int, int] | None, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        call = split_call(loss_fn, args, kwargs)
        if "ref_emb" in names and call.ref_emb is None:
            raise ValueError("wrt includes 'ref_emb' but no ref_emb was given")
        _check_hyper_wrt(call, names)
        return _chunked(call, chunk_size, names, anchor_rows)

    fn.__doc__ = f"Chunked value and gradient of {getattr(loss_fn, '__name__', 'a loss')} " + (
        f"(chunk_size={chunk_size}, wrt={names})."
    )
    return fn


def _check_hyper_wrt(call: LossCall, names: tuple[str, ...]) -> None:
    """Every ``wrt`` name besides the embeddings' is a hyper-parameter of the loss given as a
    floating tensor."""
    for n in names:
        if n in _WRT:
            continue
        if n not in call.hyper:
            raise ValueError(
                f"wrt names {n!r}, which is neither {' nor '.join(map(repr, _WRT))} nor a "
                f"hyper-parameter of {call.spec.name} (its hyper-parameters: "
                f"{', '.join(sorted(call.hyper)) or 'none'})"
            )
        value = call.hyper[n]
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            raise TypeError(
                f"wrt names {n!r}, so it must be given as a floating tensor (a learnable "
                f"parameter), got {type(value).__name__} {value!r}"
            )


def _with_hyper(call: LossCall, names: Sequence[str], values: Sequence[Tensor]) -> LossCall:
    """The call with the named hyper-parameters replaced (by differentiable leaves)."""
    if not names:
        return call
    return dataclasses.replace(call, hyper={**call.hyper, **dict(zip(names, values, strict=True))})


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
            with no_autocast(cotangent):  # (the backward in its recorded dtypes, see eager)
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
        # autocast off: the user's autocast region would cast the backward's products (a CPU
        # backward runs on this thread) where the forward recorded them in float32
        with no_autocast(cotangent):
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


def _whole(
    call: LossCall, names: tuple[str, ...], loss_of: Callable[[LossCall], Tensor] = LossCall.loss
) -> tuple[Tensor, Any]:
    """One chunk holds every anchor: the whole loss and its gradient by plain autograd (eager
    mode), through the loss's own whole-batch path (the same value and gradient; at batch 128
    and 512 on one CPU thread, ~1.2-1.3x faster than one chunk of the chunked path: the
    self-similarity's backward takes both sides from one product). ``loss_of``: the loss of
    the call on the leaves (:func:`_engine`'s: the tiled engine)."""
    x = call.embeddings.detach().requires_grad_(True)
    ref = None if call.ref_emb is None else call.ref_emb.detach().requires_grad_(True)
    hyper = [n for n in names if n not in _WRT]
    leaves = {n: call.hyper[n].detach().requires_grad_(True) for n in hyper}
    leaves["embeddings"] = x
    if ref is not None:
        leaves["ref_emb"] = ref
    with torch.enable_grad():
        whole = _with_hyper(call, hyper, [leaves[n] for n in hyper])
        loss = loss_of(dataclasses.replace(whole, embeddings=x, ref_emb=ref))
        wrt = [leaves[n] for n in names]
        with no_autocast(loss):  # (as _vjp's)
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    out = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt, strict=True))
    return loss.detach(), (out[0] if len(names) == 1 else out)


_ENGINE_KINDS = ("ntxent", "supcon")


def _engine(call: LossCall, names: tuple[str, ...], chunk_size: int) -> tuple[Tensor, Any] | None:
    """The call's value and gradient by the tiled engine in tiles of ``chunk_size`` rows
    (:func:`pmlfunc.losses._tiled.tiled_loss`), where the engine runs it (NT-Xent and SupCon
    with labels, no ``indices_tuple``, ``cosine()`` or ``dot()``, a reducer it supports:
    :func:`~pmlfunc.losses._tiled.dense_runs`) in eager mode, else ``None``. The same numbers
    and the same ``O(chunk × M)`` memory as the chunks, in one walk that forms each tile's
    gradient as it goes (three products a tile, no masks with few positives), where each
    chunk's autograd graph kept its masked softmax for a backward."""
    from .losses import _tiled

    kind = call.spec.name
    if (
        kind not in _ENGINE_KINDS
        or _traced()
        or not _tiled.dense_runs(kind, call.labels, call.inputs())
    ):
        return None

    def loss_of(c: LossCall) -> Tensor:
        t = c.hyper["temperature"]
        return _tiled.run_local(
            _tiled.softmax_call(kind, c.embeddings, c.labels, t, chunk_size, c.inputs())
        )

    return _whole(call, names, loss_of)


@dataclasses.dataclass
class _Sums:
    """Per sub-loss, summed over the chunks: the undivided shares, the normalisers and the
    shares' gradients with respect to each differentiated input (``grads[name][k]``: the
    normalised embeddings, the reference set, a hyper-parameter)."""

    shares: list[Tensor] = dataclasses.field(default_factory=list)
    norms: list[Tensor] = dataclasses.field(default_factory=list)
    grads: dict[str, list[Tensor]] = dataclasses.field(default_factory=dict)

    def add_norms(self, parts: Sequence[Tensor]) -> None:
        self.norms = (
            [*parts] if not self.norms else [a + b for a, b in zip(self.norms, parts, strict=True)]
        )

    def add(self, name: str, k: int, g: Tensor, rows: tuple[int, int] | None = None) -> None:
        """``grads[name][k] += g`` (on ``rows`` only when given). In place on the buffer, but
        inside ``torch.func`` transforms, where ``g`` may be batched and the buffer (shaped as
        an unbatched input: a ``vmap`` over a hyper-parameter alone) not: out of place."""
        buf = self.grads[name][k]
        if torch.compiler.is_compiling() or not inside_transform():
            (buf if rows is None else buf[rows[0] : rows[1]]).add_(g)
        elif rows is None:
            self.grads[name][k] = buf + g
        else:
            r0, r1 = rows
            self.grads[name][k] = buf.slice_scatter(buf[r0:r1] + g, 0, r0, r1)

    def divided(self, reducer: Reducer, zero: Tensor) -> Tensor:
        """The loss: ``Σ_k divide(shares[k], norms[k])`` (``zero`` when nothing was summed)."""
        for s, n in zip(self.shares, self.norms, strict=False):
            zero = zero + reducer.divide(s, n)
        return zero

    def gradient(self, reducer: Reducer, name: str, like: Tensor) -> Tensor:
        """``Σ_k grads[name][k] · divide(1, norms[k])``: the loss's gradient (zeros when
        nothing was summed)."""
        out = None
        for g, n in zip(self.grads.get(name, ()), self.norms, strict=False):
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
    engine = None if anchor_rows is not None else _engine(call, names, chunk_size)
    if engine is not None:
        return engine
    if anchor_rows is None and batch_size <= chunk_size and not _traced():
        return _whole(call, names)
    want_x, want_ref = "embeddings" in names, "ref_emb" in names
    hyper = [n for n in names if n not in _WRT]
    hyper_values = tuple(call.hyper[n] for n in hyper)
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

    def shares(
        rows: tuple[int, int], anchors: Tensor, x: Tensor, ref: Tensor | None, h: Sequence[Tensor]
    ):
        """Each sub-loss's undivided share, and (no graph) its part of the normaliser."""
        c = _with_hyper(call, hyper, h)
        batch = c.batch(rows, embeddings=x, ref_emb=ref, anchors=anchors, distance=rest)
        pairs = [reducer.share_and_normalizer(t, batch.labels) for t in c.terms(batch).values()]
        return tuple(s for s, _ in pairs), tuple(n.detach() for _, n in pairs)

    # A chunk differentiates its anchor rows (a tensor of their own) and the whole batch (as
    # references) in self mode, else the reference set when its gradient is wanted; then the
    # hyper-parameters in wrt.
    chunk: Callable[..., Any]
    if ref_hat is None:
        refs: tuple[Tensor, ...] = (x_hat,)
        chunk = lambda rows, a, x, *h: shares(rows, a, x, None, h)  # noqa: E731
    elif want_ref:
        refs = (ref_hat,)
        chunk = lambda rows, a, ref, *h: shares(rows, a, x_hat, ref, h)  # noqa: E731
    else:
        refs = ()
        chunk = lambda rows, a, *h: shares(rows, a, x_hat, ref_hat, h)  # noqa: E731
    sums = _Sums()
    for r0, r1, mine in _pieces(batch_size, chunk_size, anchor_rows):
        if not mine:  # anchors of another rank: their part of the normaliser only
            with torch.no_grad():
                sums.add_norms(shares((r0, r1), x_hat[r0:r1], x_hat, ref_hat, ())[1])
            continue
        primals = (x_hat[r0:r1], *refs, *hyper_values)
        out, parts, pullback = _vjp(functools.partial(chunk, (r0, r1)), primals)
        sums.add_norms(parts)
        first = not sums.shares
        if first:  # the first chunk of mine: one buffer per sub-loss and differentiated input
            sums.shares = list(out)
            like = {"embeddings": x_hat, **dict(zip(hyper, hyper_values, strict=True))}
            if ref_hat is not None:
                like["ref_emb"] = ref_hat
            sums.grads = {n: [torch.zeros_like(like[n]) for _ in out] for n in names}
        for k, o in enumerate(out):
            if not first:
                sums.shares[k] = sums.shares[k] + o
            grads = pullback(k, one)
            if want_x:
                sums.add("embeddings", k, grads[0], (r0, r1))
                if ref_hat is None:
                    sums.add("embeddings", k, grads[1])
            if want_ref:
                sums.add("ref_emb", k, grads[1])
            for j, n in enumerate(hyper):
                sums.add(n, k, grads[1 + len(refs) + j])
    total = sums.divided(reducer, torch.zeros((), dtype=cd, device=embeddings.device))
    grad_x = x_back(0, sums.gradient(reducer, "embeddings", x_hat))[0] if want_x else None
    total, grad_x = _regularized(call, total, grad_x)
    grad_ref = None
    if want_ref and ref_back is not None and ref_hat is not None:
        grad_ref = ref_back(0, sums.gradient(reducer, "ref_emb", ref_hat))[0]
    got = {"embeddings": grad_x, "ref_emb": grad_ref}
    got |= {n: sums.gradient(reducer, n, v) for n, v in zip(hyper, hyper_values, strict=True)}
    results = [got[n] for n in names]
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


# --- GradCache ----------------------------------------------------------------------------------

Encoder: TypeAlias = Callable[..., Tensor]
# One mini-batch of an encoder's input: its rows, positional and keyword arguments.
_Piece: TypeAlias = tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]


def gradcache(
    encoders: Encoder | Sequence[Encoder],
    inputs: Any,
    loss_fn: Callable[..., Tensor],
    *,
    mini_batch: int,
    replay_rng: bool = True,
) -> Tensor:
    r"""One GradCache step: ``loss_fn(*[encoder(input) ...]).backward()``, with the encoders'
    activations held for one mini-batch at a time.

    The three passes (Gao et al., 2021):

    1. every encoder embeds its input ``mini_batch`` rows at a time without autograd; the random
       state (CPU and every CUDA device) is recorded before each mini-batch;
    2. ``loss_fn`` runs once on the cached embeddings, as leaves: ``backward()`` gives the
       embeddings' gradient ``∂L/∂e`` and accumulates into the ``.grad`` of every tensor the loss
       itself trains (a learnable temperature or logit scale it closes over);
    3. every mini-batch is embedded again with autograd from its recorded random state (dropout
       draws the same masks) and ``e.backward(∂L/∂e[rows])`` pushes the cached gradient into the
       encoder's parameters.

    The parameters' ``.grad`` then equal those of one backward through the pass-1 forward (the
    encoders on the same mini-batches and random draws, the loss on all the rows at once), and
    accumulate as ``loss.backward()`` does: zero them before, step the optimizer after. An
    encoder with a ``no_sync()`` method (``DistributedDataParallel``) runs every mini-batch but
    its last one under it, so its gradients are all-reduced once per step; an encoder used by
    several towers (one model for queries and documents) is synchronised on its last mini-batch
    of all.

    Memory: one mini-batch of activations per encoder at a time, the ``B × D`` embeddings and
    their gradient, and what the loss itself holds: give it ``chunk_size=`` (the tiled engine,
    O(chunk × B)) or use :func:`value_and_grad` inside ``loss_fn`` for a chunkable batch loss.
    The encoders run twice (about 1.3-1.5x a plain step's time).

    Args:
        encoders: a callable ``input -> embeddings`` (an ``nn.Module``, a ``DistributedDataParallel``
            module, ``functools.partial(torch.func.functional_call, module, params)``), or a
            sequence of them, one per tower.
        inputs: each encoder's input: a tensor (``encoder(x)``), a tuple or list
            (``encoder(*x)``) or a mapping (``encoder(**x)``, a tokenizer's output). Every
            tensor in it is split along its first dimension, the batch; other values are passed
            whole to each mini-batch. A sequence of these, one per encoder, when ``encoders`` is
            a sequence. Towers may have different batch sizes.
        loss_fn: ``loss_fn(emb_0, emb_1, ...) -> 0-d tensor``, one embeddings tensor per encoder
            in order; close over labels and the loss's params (``lambda e: pf.losses.ntxent(e,
            labels)``, ``lambda a, b: pf.losses.clip(a, b, params, chunk_size=1024)``).
        mini_batch: rows per encoder call (a positive int; need not divide the batch).
        replay_rng: record and replay the random state per mini-batch (default). Without it a
            stochastic encoder (dropout) draws new masks in pass 3 and the gradients are not those
            of any one forward.

    Returns:
        The loss (detached, from pass 2).

    Raises:
        TypeError: an encoder's output is not a floating tensor, an input holds no tensor, the
            loss is not a 0-d floating tensor.
        ValueError: encoders and inputs differ in number, an input's tensors disagree on the batch
            size, an encoder's output has a different number of rows. An empty batch runs
            (an empty rank under DDP takes part in the sync); the loss decides whether it is
            an error.

    Not covered: an encoder whose rows are not independent (BatchNorm in training mode: its
    statistics and running averages see mini-batches, and the running averages are updated
    twice), randomness from an explicit ``torch.Generator`` or another device type than CPU and
    CUDA (not replayed). The step is an eager driver: compile the encoders and the loss, not it.

    Example:
        >>> encoder = torch.nn.Sequential(
        ...     torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 8))
        >>> x, labels = torch.randn(64, 16), torch.arange(64) // 4
        >>> loss = gradcache(encoder, x, lambda e: pf.losses.ntxent(e, labels), mini_batch=16)
        >>> all(p.grad is not None for p in encoder.parameters())
        True

    References: Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited
    Setup" (GradCache), RepL4NLP 2021.
    """
    towers = _towers(encoders, inputs)
    mini_batch = _checks.integer(mini_batch, "mini_batch")
    plans = [_mini_batches(inp, mini_batch, where) for where, _, inp in towers]

    # (1) embeddings without a graph, the random state before each mini-batch
    states: list[list[_RandomState | None]] = []
    cached: list[Tensor] = []
    with torch.no_grad():
        for (where, encoder, _), pieces in zip(towers, plans, strict=True):
            states.append([])
            outs = []
            for rows, args, kwargs in pieces:
                states[-1].append(_RandomState.capture() if replay_rng else None)
                outs.append(_embedding(encoder(*args, **kwargs), rows, where))
            cached.append(torch.cat(outs) if len(outs) > 1 else outs[0])

    # (2) the loss on the cached embeddings: their gradient, and the loss's own params' .grad
    leaves = [e.detach().requires_grad_(True) for e in cached]
    with torch.enable_grad():
        loss = loss_fn(*leaves)
    if not (isinstance(loss, Tensor) and loss.ndim == 0 and loss.is_floating_point()):
        raise TypeError(
            "loss_fn must return a 0-d floating tensor (the reduced loss), got "
            + (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, Tensor)
                else type(loss).__name__
            )
        )
    if loss.requires_grad:
        loss.backward()

    # (3) each mini-batch again, with a graph, from its recorded random state
    last = {
        id(encoder): (t, len(pieces) - 1)
        for t, ((_, encoder, _), pieces) in enumerate(zip(towers, plans, strict=True))
    }
    for t, ((where, encoder, _), pieces) in enumerate(zip(towers, plans, strict=True)):
        if not _trains(encoder):
            continue
        # a tower the loss did not read (or an empty rank's) still runs pass 3: under DDP every
        # rank must reach the synchronised backward
        grad = leaves[t].grad
        if grad is None:
            grad = torch.zeros_like(leaves[t])
        for c, (rows, args, kwargs) in enumerate(pieces):
            state = states[t][c]
            unsynced = (t, c) != last[id(encoder)]
            with (
                encoder.no_sync()
                if unsynced and hasattr(encoder, "no_sync")
                else contextlib.nullcontext(),
                state.replayed() if state is not None else contextlib.nullcontext(),
            ):
                out = _embedding(encoder(*args, **kwargs), rows, where)
                if out.requires_grad:
                    out.backward(grad[rows[0] : rows[1]])
    return loss.detach()


def _towers(encoders: Encoder | Sequence[Encoder], inputs: Any) -> list[tuple[str, Encoder, Any]]:
    """``(name in errors, encoder, input)`` per tower: one for a callable ``encoders``."""
    if callable(encoders):
        return [("encoders", encoders, inputs)]
    if not isinstance(encoders, (tuple, list)) or not encoders:
        raise TypeError(
            "encoders must be a callable or a non-empty tuple/list of callables, got "
            f"{type(encoders).__name__}"
        )
    for t, encoder in enumerate(encoders):
        if not callable(encoder):
            raise TypeError(f"encoders[{t}] must be callable, got {type(encoder).__name__}")
    if not isinstance(inputs, (tuple, list)) or len(inputs) != len(encoders):
        raise ValueError(
            f"inputs must be a tuple/list with one input per encoder ({len(encoders)}), got "
            + (f"{len(inputs)}" if isinstance(inputs, (tuple, list)) else type(inputs).__name__)
        )
    return [(f"encoders[{t}]", e, x) for t, (e, x) in enumerate(zip(encoders, inputs, strict=True))]


def _mini_batches(inp: Any, mini_batch: int, where: str) -> list[_Piece]:
    """The encoder's input cut into mini-batches of rows: each tensor along its first dimension;
    other values passed whole."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    if isinstance(inp, Tensor):
        args, kwargs = (inp,), {}
    elif isinstance(inp, Mapping):
        args, kwargs = (), dict(inp)
    elif isinstance(inp, (tuple, list)):
        args, kwargs = tuple(inp), {}
    else:
        raise TypeError(
            f"the input of {where} must be a tensor, a tuple/list of arguments or a mapping of "
            f"keyword arguments, got {type(inp).__name__}"
        )
    shapes = [tuple(v.shape) for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
    if not shapes:
        raise TypeError(f"the input of {where} holds no tensor to split into mini-batches")
    sizes = {s[0] if s else None for s in shapes}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"the tensors in the input of {where} must share their first dimension (the batch), "
            f"got shapes {shapes}"
        )
    (n,) = cast(set[int], sizes)
    if n == 0:  # an empty rank under DDP still runs its encoder and takes part in the sync
        return [((0, 0), args, kwargs)]

    def cut(v: Any, r0: int, r1: int) -> Any:
        return v[r0:r1] if isinstance(v, Tensor) else v

    return [
        (
            (r0, r1),
            tuple(cut(v, r0, r1) for v in args),
            {k: cut(v, r0, r1) for k, v in kwargs.items()},
        )
        for r0, r1 in ((r0, min(n, r0 + mini_batch)) for r0 in range(0, n, mini_batch))
    ]


def _embedding(out: Any, rows: tuple[int, int], where: str) -> Tensor:
    if not (isinstance(out, Tensor) and out.is_floating_point() and out.ndim >= 1):
        raise TypeError(
            f"{where} must return a floating tensor of embeddings, one row per input row, got "
            + (
                f"{out.dtype} of shape {tuple(out.shape)}"
                if isinstance(out, Tensor)
                else type(out).__name__
            )
        )
    if out.shape[0] != rows[1] - rows[0]:
        raise ValueError(
            f"{where} returned {out.shape[0]} rows for a mini-batch of {rows[1] - rows[0]} "
            "(its first dimension must be the batch)"
        )
    return out


def _trains(encoder: Encoder) -> bool:
    """False for a module none of whose parameters require a gradient (a frozen tower: pass 3
    is skipped); True for any other callable."""
    if isinstance(encoder, torch.nn.Module):
        return any(p.requires_grad for p in encoder.parameters())
    return True


@dataclasses.dataclass(frozen=True)
class _RandomState:
    """The global random state before a mini-batch's forward: the CPU generator's and, once
    CUDA is initialised, every CUDA device's."""

    cpu: Tensor
    cuda: list[Tensor]

    @staticmethod
    def capture() -> _RandomState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return _RandomState(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """The block runs from this state; the state from before it is restored after (a
        replay consumes no random numbers)."""
        with torch.random.fork_rng(devices=range(len(self.cuda))):
            torch.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.cuda)
            yield
