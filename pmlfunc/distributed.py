r"""Distributed training: the global objective, exactly.

Under DDP each rank embeds its own slice of the global batch. A metric loss needs every pair of
the *global* batch, so each rank gathers all the embeddings and computes the same loss ``L`` on
the concatenation (in rank order: the same on every rank). :func:`all_gather` is autograd-aware:
its backward sums, over ranks, the gradients for a rank's own rows. Each of the ``W`` ranks
computes the same ``L``, so every rank's embeddings receive ``W · ∂L/∂x_local``. DDP averages the
parameter gradients over the ranks, which cancels the factor ``W``: the encoder's gradients equal
single-process gradients of ``L`` on the whole batch. No scaling by the world size is needed or
done (PML 2.9.0 gathers without autograd and rescales the loss instead).

Outside an initialised process group (or with one process), every function here is the plain
single-process computation (so the examples here run as they are in a plain process).

    >>> encoder = torch.nn.Linear(16, 4)
    >>> x, labels = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    >>> loss_fn = global_objective(pf.losses.ntxent)
    >>> loss = loss_fn(encoder(x), labels, temperature=0.1)  # the global loss, on every rank
    >>> loss.backward()  # DDP averages: the single-process gradient of the global batch

**Agreement, bounds and failures** (eager calls; ``pmlfunc/_agree.py``). Every entry point's
first collective is one small all-gather in which the ranks agree on what follows: the entry
point and the loss, every argument's dtype, trailing shape and presence (``labels``, ``params``
keys, ``emb_b``), whether it requires grad, the hyper-parameters, and any error a rank's own
checks found. A disagreement raises the same ``ValueError`` on every rank, naming the argument,
the ranks and both values; a rank's own error is raised there and reported on the others; in
both cases no data has moved and the process group stays usable. After the agreement every
wait is bounded by ``timeout`` (:data:`DEFAULT_TIMEOUT`, 300 s, far below gloo's 30 minutes;
``timeout=`` on each entry point): a rank that fails inside an entry point posts its exception
to the process group's store, and the other ranks raise :class:`RankError` naming it and its
exception within a fraction of a second; a rank that never arrives (it died, or is stuck
elsewhere) is named after ``timeout`` seconds. A failure after the agreement leaves the process
group unusable by pmlfunc (transfers may be pending): every later call raises at once. With
NCCL the waits are asynchronous and the bound is the process group's own timeout.

An empty local batch (a rank with 0 rows) takes part in every collective and contributes
nothing; a global batch with no rows is refused on every rank.

Under ``torch.compile`` the agreement is skipped (it is host code) and the gather uses
``torch.distributed._functional_collectives`` (``all_gather_single`` with autograd), which
traces; sizes must then be equal on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import _checks, _global
from . import params as _params
from ._agree import DEFAULT_TIMEOUT, RankError, Session
from .losses._tiled import unpartial
from .reducers import _ClassWeighted, class_weighted

__all__ = [
    "DEFAULT_TIMEOUT",
    "EXCHANGES",
    "RankError",
    "all_gather",
    "class_range",
    "cross_batch_memory",
    "global_objective",
    "is_active",
    "sharded_classes",
    "value_and_grad",
    "world_size",
]


def is_active(group=None) -> bool:
    """Whether a process group with more than one rank is initialised.

    Example:
        >>> is_active()  # a plain process
        False
    """
    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group or dist.group.WORLD) > 1
    )


def world_size(group=None) -> int:
    """The number of ranks (1 outside a process group).

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size(group or dist.group.WORLD) if is_active(group) else 1


def _functional_gather() -> Callable[[Tensor, Any], Tensor] | None:
    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:  # pragma: no cover - very old torch
        return None
    gather = getattr(fc, "all_gather_single_autograd", None) or getattr(
        fc, "all_gather_tensor_autograd", None
    )
    if gather is None:  # pragma: no cover
        return None
    wait = getattr(fc, "wait_tensor", lambda t: t)
    return lambda x, group: wait(gather(x, 0, group))


def _legacy_gather(x: Tensor, group) -> Tensor:  # pragma: no cover - torch without fc
    import torch.distributed.nn.functional as dnf

    return torch.cat(dnf.all_gather(x, group=group), 0)


def _compiled_gather(x: Tensor, group) -> Tensor:
    """Equal-shaped ``x`` from every rank along dim 0, in rank order (traceable)."""
    fn = _functional_gather()
    return (fn or _legacy_gather)(x.contiguous(), group)


class _Gather(torch.autograd.Function):
    """Every rank's rows in rank order (``sizes``: every rank's count; padded to the largest in
    transit), its backward the sum over ranks of the gradients for this rank's rows: both one
    bounded collective of a :class:`~pmlfunc._agree.Session`."""

    @staticmethod
    def forward(x: Tensor, sizes: list[int], session: Session, name: str) -> Tensor:
        return _gather_rows(session, x.detach(), sizes, name)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, sizes, session, name = inputs
        ctx.sizes, ctx.session, ctx.name, ctx.top = sizes, session, name, max(sizes)

    @staticmethod
    def backward(ctx, g: Tensor):
        sizes, session, top = ctx.sizes, ctx.session, ctx.top
        with session.guard(f"the backward of gathering {ctx.name}"):
            if len(set(sizes)) != 1:
                padded = g.new_zeros((len(sizes) * top, *g.shape[1:]))
                offsets = [sum(sizes[:r]) for r in range(len(sizes))]
                for r, n in enumerate(sizes):
                    padded[r * top : r * top + n] = g[offsets[r] : offsets[r] + n]
                g = padded
            where = f"the backward of gathering {ctx.name}"
            mine = session.reduce_scatter_padded(g, top, where)
        return mine[: sizes[session.rank]], None, None, None


def _gather_rows(session: Session, x: Tensor, sizes: list[int], name: str) -> Tensor:
    """Every rank's rows of ``x`` in rank order, padded to the largest count in transit."""
    top = max(sizes)
    padded = session.gather_padded(x, top, f"gathering {name}")
    if len(set(sizes)) == 1:
        return padded
    return torch.cat([padded[r * top : r * top + n] for r, n in enumerate(sizes)], 0)


def _gather(session: Session, x: Tensor, sizes: list[int], name: str) -> Tensor:
    """Every rank's ``x`` in rank order: differentiable when ``x`` requires grad (bounded)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Gather.apply(x, sizes, session, name)
    return _gather_rows(session, x, sizes, name)


def _check_batch(x: object, name: str) -> None:
    """A batch of rows: a tensor with a batch dimension (0 rows allowed on one rank)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")


def _check_rows(x: Tensor, name: str, rows_of: Tensor, of: str) -> None:
    _check_batch(x, name)
    if x.shape[0] != rows_of.shape[0]:
        raise ValueError(
            f"{name} must have one row per row of {of} ({rows_of.shape[0]}), got shape "
            f"{tuple(x.shape)}"
        )


def _local(checks: Callable[[], None]) -> BaseException | None:
    """A rank's own checks, their error kept for the agreement (raised there on every rank)."""
    try:
        checks()
    except (ValueError, TypeError, IndexError) as err:
        return err
    return None


def _refuse_empty(sizes: Sequence[int], what: str, name: str) -> None:
    """The same error on every rank (they agreed on ``sizes``) for a global batch of no rows."""
    if sum(sizes) == 0:
        raise ValueError(f"{what}: {name} has no rows on any rank; at least one row is required")


def _agree_on_batch(session: Session, arguments: Mapping[str, Any], who: str) -> list[int]:
    """The checks of an entry point of ``(embeddings, labels, ...)`` (its ``arguments`` by name,
    those two first), then the agreement: every rank's batch size, a global batch without rows
    refused on every rank."""
    embeddings, labels = list(arguments.values())[:2]

    def checks() -> None:
        if arguments.get("indices_tuple") is not None:
            raise ValueError(
                f"indices_tuple refers to local rows and cannot be used with {who}: mine on "
                "the gathered batch (wrap a function that calls the miner and the loss)"
            )
        _check_batch(embeddings, "embeddings")
        if labels is None:
            raise ValueError(f"labels is required by {who}")
        _check_rows(labels, "labels", embeddings, "embeddings")

    batch = tuple(arguments)[:2]
    device = embeddings.device if isinstance(embeddings, Tensor) else None
    agreed = session.agree(arguments, batch=batch, error=_local(checks), device=device)
    _refuse_empty(agreed[batch[0]], session.what, "embeddings")
    return agreed[batch[0]]


def _named(loss_fn: Callable, args: tuple, kwargs: Mapping) -> dict[str, Any]:
    """A call's arguments by name, through ``functools.partial`` layers and ``**kwargs`` (the
    positional ones first, in order); by position where the signature does not bind them."""
    fn, a, kw = unpartial(loss_fn, args, kwargs)
    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*a, **kw)
    except (TypeError, ValueError):
        return {**{f"args[{i}]": v for i, v in enumerate(a)}, **kw}
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for k, v in bound.arguments.items():
        kind = sig.parameters[k].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(v)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{k}[{i}]": x for i, x in enumerate(v)})
        else:
            out[k] = v
    return out


def _name(loss_fn: Callable) -> str:
    fn = unpartial(loss_fn)[0]
    return getattr(fn, "__name__", type(fn).__name__)


def all_gather(x: Tensor, *, group=None, name: str = "x", timeout: float | None = None) -> Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order, differentiable.

    The backward gives each rank the sum over ranks of the gradients for its own rows. In eager
    mode the ranks agree first (module docstring): a different dtype or trailing shape (embedding
    width) raises ``ValueError`` on every rank, and different batch sizes (0 rows included) are
    handled by padding to the largest and dropping the padding; every wait is bounded by
    ``timeout`` seconds. Under ``torch.compile`` that agreement is skipped and sizes must be
    equal. Outside a process group, returns ``x``.

    Example:
        >>> emb = torch.randn(8, 4)
        >>> all_gather(emb).shape  # (sum of per-rank batch sizes, D); one process: emb itself
        torch.Size([8, 4])
    """
    _check_batch(x, name)
    if not is_active(group):
        return x
    if torch.compiler.is_compiling():
        return _compiled_gather(x, group or dist.group.WORLD)
    session = Session(group, f"all_gather({name})", timeout)
    sizes = session.agree({name: x}, batch=(name,), device=x.device)[name]
    with session.guard(f"gathering {name}"):
        return _gather(session, x, sizes, name)


EXCHANGES = ("gather", "ring")


def global_objective(
    loss_fn: Callable[..., Tensor],
    *,
    group=None,
    exchange: str = "gather",
    timeout: float | None = None,
) -> Callable[..., Tensor]:
    r"""Wrap a pmlfunc loss so that, under DDP, it is the loss of the whole global batch.

    Two exchanges compute the same ``L`` (the same value on every rank); with DDP's gradient
    averaging the encoder's gradients equal single-process gradients of the loss on the
    concatenated batch (module docstring).

    ``exchange="gather"`` (default), any loss: gathers the embeddings (with autograd) and labels
    from every rank and computes ``loss(all_emb, all_labels, *rest, **kw)``. Per rank, memory
    grows with the global batch (its rows, and a local × global matrix).

    - ``params`` (proxy and classifier losses, CLIP's logit scale) pass through: each rank
      computes the full-batch parameter gradient. Registered in the DDP module they are
      averaged (unchanged); as separate tensors they are already the single-process gradient.
    - ``ref_emb``/``ref_labels`` pass through ungathered: they must be the same on every rank
      (e.g. a cross-batch memory filled with gathered batches).
    - ``indices_tuple`` is refused: a miner's indices refer to local rows. Mine on the gathered
      batch inside the loss function instead.
    - Unequal per-rank batch sizes are handled (eager; see :func:`all_gather`), an empty one
      included.
    - Work is split: a loss that decomposes over anchors (:func:`pmlfunc.chunked.chunkable`,
      given directly or as a ``functools.partial``) computes only this rank's anchor rows
      against the gathered batch (``B_local × B_global``), with the reducers' normalisers summed
      over the ranks. Other losses and settings (proxy and classifier losses, a lambda,
      ``swap=True``, an embedding regularizer) compute the whole loss on every rank.
    - :func:`pmlfunc.losses.clip` and :func:`pmlfunc.losses.siglip` gather both sets (and
      ``labels=``): row ``i`` of the gathered ``emb_a`` still pairs with row ``i`` of ``emb_b``.
      :func:`pmlfunc.losses.multiple_negatives_ranking` likewise gathers its queries, positives,
      hard negatives, ids and guide rows in rank order (unequal sizes too: no rank offset is
      assumed), so every rank's rows see every rank's documents as in-batch negatives.

    Losses of batch statistics (:func:`~pmlfunc.losses.barlow_twins`; ``pmlfunc/_global.py``)
    are not gathered: each rank calls the loss on its own rows and every sum over rows in it (the
    mean, the variance, the ``D × D`` cross-correlation) is all-reduced with autograd, so the
    statistics are the global batch's and per-rank memory does not grow with the world size.
    Eager only (the waits are on the host); unequal and empty ranks work.

    ``exchange="ring"``, for :func:`~pmlfunc.losses.clip`, :func:`~pmlfunc.losses.siglip`,
    :func:`~pmlfunc.losses.ntxent`, :func:`~pmlfunc.losses.supcon` and
    :func:`~pmlfunc.losses.multiple_negatives_ranking` (dense, or tiled with ``chunk_size``):
    each rank keeps its rows and the other ranks' blocks (embeddings and labels; for
    ``multiple_negatives_ranking`` a rank's documents, queries where a direction reads them,
    with their hard negatives, ids and guide rows) pass around the ring one at a time, through
    the tiled engine (``pmlfunc/_ring.py``). Every option of ``multiple_negatives_ranking``
    runs on it; its ids must mean the same on every rank (dataset ids, not local positions).
    Per rank, memory is ``O(B_local · D + B_local × B_local)`` (``chunk_size × B_local`` tiled),
    flat in the world size; no tensor with the global batch's rows is made. Eager only (point to
    point sends), unequal local batch sizes work; these losses' engine restrictions hold (labels
    for NT-Xent/SupCon, ``cosine()``/``dot()``), and ``ref_emb`` and an embedding regularizer
    are refused (use the gather). Outside an initialised process group it is the plain loss.

    Every eager call starts with the ranks' agreement and bounds each wait by ``timeout``
    seconds (default :data:`DEFAULT_TIMEOUT`); see the module docstring for what is checked and
    what a failing rank makes the others raise.

    Example:
        >>> encoder = torch.nn.Linear(16, 4)
        >>> x, y = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = global_objective(pf.losses.supcon)(encoder(x), y, temperature=0.1)
        >>> ring = global_objective(pf.losses.clip, exchange="ring")
        >>> loss = ring(encoder(x), torch.randn(8, 4), pf.losses.clip_init())
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if timeout is not None:
        Session.check_timeout(timeout)
    if unpartial(loss_fn)[0] in _global.STATISTICS:
        if exchange == "ring":
            raise ValueError(
                f"{_name(loss_fn)} is a function of batch statistics, which global_objective "
                "all-reduces (no gather): use exchange='gather' (the default)"
            )
        return _tagged(_statistics_objective(loss_fn, group, timeout), group, timeout)
    if exchange == "ring":
        return _tagged(_ring_objective(loss_fn, group, timeout), group, timeout)
    if _aligned_rows(loss_fn) is not None:
        return _tagged(_pair_objective(loss_fn, group, timeout), group, timeout)
    what = f"global_objective({_name(loss_fn)})"

    @functools.wraps(loss_fn)
    def wrapped(embeddings: Tensor, labels: Tensor | None = None, *args: Any, **kwargs: Any):
        if not is_active(group):
            return loss_fn(embeddings, labels, *args, **kwargs)
        if torch.compiler.is_compiling():  # equal sizes, the functional gather
            if labels is None:
                raise ValueError("labels is required by global_objective")
            g_group = group or dist.group.WORLD
            all_emb = _compiled_gather(embeddings, g_group)
            return loss_fn(all_emb, _compiled_gather(labels, g_group), *args, **kwargs)

        session = Session(group, what, timeout)
        arguments = _named(loss_fn, (embeddings, labels, *args), kwargs)
        sizes = _agree_on_batch(session, arguments, "global_objective")
        assert labels is not None  # the agreement raised otherwise
        with session.guard("computing the loss"):
            all_emb = _gather(session, embeddings, sizes, "embeddings")
            all_labels = _gather(session, labels, sizes, "labels")
            r0 = sum(sizes[: session.rank])
            split = _anchor_split(loss_fn, all_emb, all_labels, args, kwargs)
            if split is None:  # not decomposable over anchors: every rank computes all of it
                return loss_fn(all_emb, all_labels, *args, **kwargs)
            return split((r0, r0 + sizes[session.rank]), session)

    return _tagged(wrapped, group, timeout)


def _tagged(objective: Callable[..., Tensor], group, timeout) -> Callable[..., Tensor]:
    """``objective`` with its process group and timeout recorded (:func:`objective_options`)."""
    objective.__pmlfunc_global__ = (group, timeout)  # type: ignore[attr-defined]
    return objective


def objective_options(fn: object) -> tuple[Any, float | None] | None:
    """``(group, timeout)`` of a :func:`global_objective` (or a ``functools.partial`` of one),
    else ``None``: how a transform that adds terms of its own outside the loss (the KL of
    :func:`pmlfunc.transforms.adaptive_layers`) sums them over the same ranks."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__pmlfunc_global__", None)


class _AllReduce(torch.autograd.Function):
    """``x`` summed over the ranks; its backward the cotangent summed over the ranks. Every rank
    computes the same loss from the sums, so each rank's rows receive ``W · ∂L/∂x``, as under
    the gather (module docstring). Both one bounded collective of a
    :class:`~pmlfunc._agree.Session`."""

    @staticmethod
    def forward(x: Tensor, session: Session, name: str) -> Tensor:
        out = x.detach().clone(memory_format=torch.contiguous_format)
        return session.all_reduce(out, f"summing {name}")

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.session, ctx.name = inputs

    @staticmethod
    def backward(ctx, g: Tensor):
        where = f"the backward of summing {ctx.name}"
        with ctx.session.guard(where):
            g = ctx.session.all_reduce(g.clone(memory_format=torch.contiguous_format), where)
        return g, None, None


def _statistics_objective(loss_fn, group, timeout):
    """``global_objective`` of a loss of batch statistics (:mod:`pmlfunc._global`): each rank
    calls it on its own rows, every sum over rows (:func:`pmlfunc._global.total`) all-reduced
    with autograd; no rank holds the global batch."""
    batch = _global.STATISTICS[unpartial(loss_fn)[0]]
    what = f"global_objective({_name(loss_fn)})"

    def statistics(*args: Any, **kwargs: Any) -> Tensor:
        session = Session(group, what, timeout)
        arguments = _named(loss_fn, args, kwargs)

        def checks() -> None:
            _check_batch(arguments.get(batch[0]), batch[0])
            for key in batch[1:]:  # an optional one left out (None) the agreement compares
                if arguments.get(key) is not None:
                    _check_rows(arguments[key], key, arguments[batch[0]], batch[0])

        error = _local(checks)
        first = arguments.get(batch[0])
        device = first.device if isinstance(first, Tensor) else None
        sizes = session.agree(arguments, batch=batch, error=error, device=device)
        _refuse_empty(sizes[batch[0]], what, batch[0])
        count = iter(range(1, 1 << 30))

        def summed(t: Tensor) -> Tensor:
            return _AllReduce.apply(t, session, f"statistic {next(count)} of {what}")

        with session.guard("computing the loss"), _global.summing(summed):
            return loss_fn(*args, **kwargs)

    return _eager_when_active(
        loss_fn,
        statistics,
        group,
        f"pmlfunc: {what} runs eagerly (its all-reduces wait on the host); under "
        "torch.compile(fullgraph=True) compile the loss's callers, not the objective",
    )


def _ring_objective(loss_fn, group, timeout):
    """``global_objective(loss_fn, exchange="ring")``."""
    from ._ring import ring_loss
    from .losses._tiled import builder_of

    what = f"global_objective({_name(loss_fn)}, exchange='ring')"
    builder_of(loss_fn, "exchange='ring'")  # refuse any other loss now, not at the first step
    batch = _aligned_rows(loss_fn) or ("embeddings", "labels")

    def ring(*args: Any, **kwargs: Any) -> Tensor:
        calls: list[Any] = []

        def checks() -> None:
            call = _engine_call(loss_fn, args, kwargs, what, batch)  # (call, its queue)
            if call[0].kind in ("ntxent", "supcon") and call[0].y is not None:
                raise ValueError(
                    f"{what} circulates the batch itself: ref_emb is not supported "
                    "(use exchange='gather', which passes it through)"
                )
            if call[0].finish is not None:
                raise ValueError(
                    f"{what} does not support embedding_regularizer (a term of the "
                    "whole batch): use exchange='gather'"
                )
            calls.append(call)

        session = Session(group, what, timeout)
        arguments = _unpack_guide(_named(loss_fn, args, kwargs))
        error = _local(checks)
        first = next((v for v in arguments.values() if isinstance(v, Tensor)), None)
        device = first.device if first is not None else None
        sizes = session.agree(arguments, batch=batch, error=error, device=device)
        _refuse_empty(sizes[batch[0]], what, batch[0])
        call, queue = calls[0]
        return ring_loss(call, queue, session, sizes[batch[0]])

    return _eager_when_active(
        loss_fn,
        ring,
        group,
        f"pmlfunc: {what} runs eagerly (point-to-point sends and waits on the host); "
        "under torch.compile(fullgraph=True) use exchange='gather'",
    )


def class_range(num_classes: int, *, group=None) -> tuple[int, int]:
    """This rank's classes ``[start, stop)`` of ``num_classes`` split as evenly as possible over
    the ranks in rank order (the first ``num_classes mod W`` ranks hold one more), for
    :func:`sharded_classes`: make this rank's part of the table with the loss's ``*_init``
    of ``stop − start`` classes. ``(0, num_classes)`` outside a process group.

    Example:
        >>> class_range(10)  # one process: every class
        (0, 10)
    """
    num_classes = _checks.integer(num_classes, "num_classes")
    if not is_active(group):
        return 0, num_classes
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    base, extra = divmod(num_classes, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def sharded_classes(
    loss_fn: Callable[..., Tensor],
    *,
    group=None,
    timeout: float | None = None,
    sample_rate: float | None = None,
    sparse_grad: bool = False,
) -> Callable[..., Tensor]:
    r"""A classifier loss over a class table sharded across the ranks (model parallel; Partial
    FC's layout): ``f(embeddings, labels, params, **kwargs)`` on every rank, with this rank's
    batch rows, their *global* class ids and this rank's rows of the table.

    The losses with ``class_chunk_size=`` (``pmlfunc.losses._tiled.CLASS_TILED``:
    :func:`~pmlfunc.losses.arcface`, :func:`~pmlfunc.losses.cosface`, ...,
    :func:`~pmlfunc.losses.normalized_softmax`, :func:`~pmlfunc.losses.proxy_nca`,
    :func:`~pmlfunc.losses.soft_triple`, :func:`~pmlfunc.losses.p2s_grad`,
    :func:`~pmlfunc.losses.proxy_anchor`). Rank ``r`` holds classes ``[o_r, o_r + C_r)``, in
    rank order (``C_r`` may differ, 0 included; :func:`class_range` splits evenly). The
    embeddings and labels are gathered (``B × D``, small); each rank walks its own classes in
    tiles of ``class_chunk_size`` (default: its whole shard as one tile) for every gathered row,
    and the ranks' partial statistics (the other classes' log-sum-exp, the target logit's
    cosine) are combined by all-reduces, so the loss, the same on every rank, is the one-process
    loss over the whole table. Per rank, memory is the shard, its gradient and ``B_global ×
    class_chunk_size`` tiles: ``∝ C / W``. ``proxy_anchor``'s statistics are per proxy, complete
    on the rank that holds it: each rank reduces its own proxies' terms and the results are
    summed (its reducer ``divisor()``, the default, or ``sum()``).

    Gradients: this rank's shard gets exactly ``∂L/∂W_r`` (its classes' only: keep the table
    out of DDP's averaging, e.g. a separate module and optimizer on each rank); the embeddings
    get ``W · ∂L/∂x_local`` and the loss's replicated hyper-parameters (a tensor ``scale``,
    ``margins``) ``∂L/∂θ``, as under :func:`global_objective`, so DDP's averaging of the encoder
    gives the single-process gradient. Eager only (collectives wait on the host); the ranks
    agree on the call first (module docstring), ``indices_tuple`` is refused (local rows).
    Outside an initialised process group it is ``loss_fn`` itself (``params`` the whole table).

    ``sample_rate`` (an approximation, Partial FC's): each call keeps every class that is some
    row's label and each other class with probability ``sample_rate``, drawn from the call's
    ``generator=`` (required, a ``torch.Generator`` seeded alike on every rank: one uniform draw
    per class of the whole table, so the classes kept do not depend on the world size; the
    ranks check that their generators agree). The loss is the loss over the classes kept (the
    softmax's negatives subsampled: a biased estimate of the full loss, cheaper by about
    ``1 / sample_rate`` at millions of classes). The classes not kept get a zero gradient in
    the shard's ``(C_r, K, D)`` gradient (an optimizer with momentum or weight decay still
    moves them: use plain SGD on the table, or mask its update). ``sparse_grad=True`` (with
    ``sample_rate``) makes the shard's gradient a sparse COO tensor of the kept rows only, for
    ``torch.optim.SparseAdam`` or plain ``SGD``, which then touch nothing else. Eager also in
    one process (the kept count is data-dependent).

    Example:
        >>> start, stop = class_range(1000)
        >>> params = pf.losses.arcface_init(stop - start, 16)  # this rank's classes
        >>> loss_fn = sharded_classes(pf.losses.arcface)
        >>> loss = loss_fn(torch.randn(8, 16), torch.randint(0, 1000, (8,)), params,
        ...                class_chunk_size=256)
    """
    from .losses._tiled import CLASS_TILED

    fn = unpartial(loss_fn)[0]
    if fn not in CLASS_TILED:
        names = sorted(getattr(f, "__name__", str(f)) for f in CLASS_TILED)
        raise ValueError(
            f"sharded_classes takes a loss with class tiles ({', '.join(names)}), got "
            f"{_name(loss_fn)}"
        )
    if timeout is not None:
        Session.check_timeout(timeout)
    if sample_rate is not None:
        sample_rate = _checks.number(sample_rate, "sample_rate", positive=True)
        if sample_rate > 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if sparse_grad and sample_rate is None:
        raise ValueError("sparse_grad=True is for sampled classes: give sample_rate too")
    key = CLASS_TILED[fn]
    what = f"sharded_classes({_name(loss_fn)})"

    def sharded(embeddings: Tensor, labels: Tensor, params: Any, **kwargs: Any) -> Tensor:
        generator = _sampling_generator(kwargs, sample_rate, what)
        if kwargs.get("weight_regularizer") is not None and (
            generator is not None or is_active(group)
        ):
            raise ValueError(
                f"{what}: weight_regularizer= reads the whole class table, and a sharded or "
                "sampled call holds part of it (each rank's regularizer of its own rows gave "
                "every rank another loss); add the regularizer of the full table yourself"
            )
        if not is_active(group):
            if generator is None:
                return loss_fn(embeddings, labels, params, **kwargs)
            table = params[key] if isinstance(params, Mapping) else None
            if not isinstance(table, Tensor):
                raise TypeError(f"params must be a dict with the table's {key!r} rows")
            _check_rows(labels, "labels", embeddings, "embeddings")
            _params.class_labels(labels, table.shape[0])
            kept = _kept_classes(table.shape[0], labels, sample_rate, generator)
            sampled = _sampled(params, key, labels, kwargs, kept, 0, sparse=sparse_grad)
            params, labels, kwargs, _, _ = sampled
            return loss_fn(embeddings, labels, params, **kwargs)
        session = Session(group, what, timeout)
        arguments = _named(loss_fn, (embeddings, labels, params), kwargs)
        table = params.get(key) if isinstance(params, Mapping) else None
        arguments["params"] = table  # a batch argument: every rank's number of classes
        if generator is not None:  # the ranks' generators must agree: their state's digest
            arguments["generator"] = _digest(generator)

        def checks() -> None:
            if arguments.get("indices_tuple") is not None:
                raise ValueError(
                    f"indices_tuple refers to local rows and cannot be used with {what}"
                )
            _check_batch(embeddings, "embeddings")
            _check_rows(labels, "labels", embeddings, "embeddings")
            if not isinstance(table, Tensor):
                raise TypeError(f"params must be a dict with this rank's {key!r} rows")
            _check_batch(table, f"params[{key!r}]")

        device = embeddings.device if isinstance(embeddings, Tensor) else None
        batch = ("embeddings", "labels", "params")
        sizes = session.agree(arguments, batch=batch, error=_local(checks), device=device)
        _refuse_empty(sizes["embeddings"], what, "embeddings")
        classes = sizes["params"]
        if sum(classes) == 0:
            raise ValueError(f"{what}: params[{key!r}] has no classes on any rank")
        offset, num_classes = sum(classes[: session.rank]), sum(classes)
        with session.guard("computing the loss"):
            all_emb = _gather(session, embeddings, sizes["embeddings"], "embeddings")
            all_labels = _gather(session, labels, sizes["embeddings"], "labels")
            mine = classes[session.rank]
            if generator is not None:
                _params.class_labels(all_labels, num_classes)
                kept = _kept_classes(num_classes, all_labels, sample_rate, generator)
                params, all_labels, kwargs, offset, num_classes = _sampled(
                    params, key, all_labels, kwargs, kept, offset, mine, sparse=sparse_grad
                )
                mine = params[key].shape[0]
            if kwargs.get("class_chunk_size") is None:
                kwargs["class_chunk_size"] = max(1, mine)
            shard = _global.ClassShard(
                offset=offset,
                num_classes=num_classes,
                sum_=session.all_reduce,
                max_=functools.partial(_all_max, session),
                guard=session.guard,
            )
            with _global.sharding(shard):
                return loss_fn(all_emb, all_labels, params, **kwargs)

    reason = (
        f"pmlfunc: {what} runs eagerly (its all-reduces wait on the host; a sampled class "
        "count is data-dependent); under torch.compile(fullgraph=True) compile the loss's "
        "callers, not the sharded loss"
    )
    if sample_rate is None:  # in one process: the loss itself, which compiles
        return _eager_when_active(loss_fn, sharded, group, reason)
    return _eager_only(sharded, reason)


# the losses' arguments that hold one entry per class of the table (sliced when sampling)
_PER_CLASS = ("margins",)


def _sampling_generator(kwargs: dict, sample_rate: float | None, what: str):
    """``kwargs``' ``generator`` (removed from them), required when sampling, refused when not."""
    generator = kwargs.pop("generator", None)
    if sample_rate is None:
        if generator is not None:
            raise ValueError(f"{what}: generator= is for sampling classes (sample_rate=)")
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{what} with sample_rate needs generator=, a torch.Generator seeded alike on every "
            f"rank; got {type(generator).__name__}"
        )
    return generator


def _digest(generator: torch.Generator) -> int:
    """A number that differs, in all likelihood, between two generators' states."""
    import hashlib

    raw = generator.get_state().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=7).digest(), "little")


def _kept_classes(num_classes: int, labels: Tensor, rate, generator: torch.Generator) -> Tensor:
    """Which classes a sampled call keeps: every label's, and each other with probability
    ``rate`` (one uniform draw per class of the whole table, from ``generator``)."""
    draw = torch.rand(num_classes, generator=generator, device=generator.device)
    kept = draw.to(labels.device) < rate
    return kept.index_fill_(0, labels.long(), True)


def _sampled(
    params, key, labels, kwargs, kept: Tensor, offset: int, rows: int | None = None, sparse=False
):
    """The call over the kept classes only: this rank's kept rows of the table (a gather: the
    gradient reaches the table's rows kept, zero elsewhere, or with ``sparse`` a sparse COO
    gradient of those rows only), the labels renumbered among the kept classes, the per-class
    arguments sliced, and this rank's offset and the total count among them."""
    rows = params[key].shape[0] if rows is None else rows
    mine = kept[offset : offset + rows].nonzero().squeeze(-1).to(params[key].device)
    table = params[key]
    picked = _SparseRows.apply(table, mine) if sparse else table.index_select(0, mine)
    sub = {**params, key: picked}
    order = torch.cumsum(kept, 0) - 1
    kwargs = dict(kwargs)
    for name in _PER_CLASS:
        if isinstance(kwargs.get(name), Tensor):
            kwargs[name] = kwargs[name][kept.to(kwargs[name].device)]
    reducer = kwargs.get("reducer")
    if isinstance(reducer, _ClassWeighted):  # its weights are read by the renumbered labels
        kwargs["reducer"] = class_weighted(reducer.weights[kept.to(reducer.weights.device)])
    return sub, order[labels.long()], kwargs, int(kept[:offset].sum()), int(kept.sum())


class _SparseRows(torch.autograd.Function):
    """``table.index_select(0, rows)`` whose gradient is a sparse COO tensor of those rows."""

    @staticmethod
    def forward(ctx, table: Tensor, rows: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        ctx.shape = table.shape
        return table.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        # the rows are distinct and increasing (a nonzero()): already coalesced
        indices = rows.unsqueeze(0)
        sparse = torch.sparse_coo_tensor(
            indices, grad, ctx.shape, is_coalesced=True, check_invariants=False
        )
        return sparse, None


def _all_max(session: Session, t: Tensor, where: str) -> Tensor:
    return session.all_reduce(t, where, dist.ReduceOp.MAX)


def _eager_when_active(loss_fn: Callable, fn: Callable, group, reason: str) -> Callable:
    """``loss_fn`` outside an initialised process group, else ``fn`` excluded from
    ``torch.compile`` with ``reason`` (:func:`_eager_only`): dynamo never traces host waits; under
    compile the call is a graph break that runs eagerly, and with ``fullgraph=True`` dynamo's
    error gives this reason."""
    eager = _eager_only(fn, reason)

    @functools.wraps(loss_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Tensor:
        if not is_active(group):
            return loss_fn(*args, **kwargs)
        return eager(*args, **kwargs)

    return wrapped


def _eager_only(fn: Callable, reason: str) -> Callable:
    """``fn`` excluded from ``torch.compile`` with ``reason`` (where this torch takes one)."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(fn, reason=reason)
    return torch.compiler.disable(fn)  # pragma: no cover - torch without the reason


def _engine_call(loss_fn, args: tuple, kwargs: Mapping, what: str, batch: Sequence[str]):
    """The ring's :class:`~pmlfunc.losses._tiled.EngineCall` of this rank's rows. An empty rank
    has one borrowed row (zeros) in each batch argument (a guide's rows included) while the
    loss checks and prepares the call, dropped from the prepared tensors after: the checks
    refuse an empty batch, and the rows are prepared one by one (cast, normalised), so the call
    of 0 rows is exact and its rows still reach the embeddings (its backward joins the
    ring's). Returned with its document queue apart (:func:`pmlfunc._ring.split_queue`: the
    queue does not travel, nor lose its rows here)."""
    from ._ring import split_queue
    from .losses._tiled import engine_call

    fn, a, kw = unpartial(loss_fn, args, kwargs)
    bound = inspect.signature(fn).bind(*a, **kw)
    first = bound.arguments.get(batch[0])
    if not isinstance(first, Tensor) or first.ndim == 0 or first.shape[0] > 0:
        return split_queue(engine_call(loss_fn, args, kwargs, what))

    def borrow(v):
        if isinstance(v, Tensor) and v.ndim:
            return torch.cat([v, v.new_zeros((1, *v.shape[1:]))])
        return v

    for name in batch:
        if name in bound.arguments:
            bound.arguments[name] = borrow(bound.arguments[name])
    if isinstance(bound.arguments.get("guide"), (tuple, list)):
        bound.arguments["guide"] = tuple(borrow(g) for g in bound.arguments["guide"])
    call, queue = split_queue(engine_call(fn, bound.args, bound.kwargs, what))
    parts = {k: getattr(call, k) for k in ("x", "y", "rows", "cols")}
    empty = {k: _no_rows(v) for k, v in parts.items() if v is not None}
    return dataclasses.replace(call, **empty), queue


def _no_rows(v):
    """``v`` (a tensor, or a tuple of the retrieval kind's metadata) with no rows; a 0-d
    tensor (a hyper-parameter) as it is."""
    if isinstance(v, tuple):
        return tuple(_no_rows(t) for t in v)
    return v[:0] if v.ndim else v


_PAIR_BATCH = ("emb_a", "emb_b", "labels", "anchor_ids", "positive_ids")


def _aligned_rows(loss_fn) -> tuple[str, ...] | None:
    """The row-aligned arguments of a loss of aligned sets, gathered together (row ``i`` of
    each still belongs with row ``i`` of the others); ``None`` for any other loss. CLIP and
    SigLIP take ``(emb_a, emb_b, labels)`` (SigLIP also its ids); ``multiple_negatives_ranking`` its queries,
    positives, hard negatives, ids and the guide's rows (``guide[i]``)."""
    try:
        params = list(inspect.signature(unpartial(loss_fn)[0]).parameters)
    except (TypeError, ValueError):
        return None
    if params[:2] == ["emb_a", "emb_b"]:
        return _PAIR_BATCH
    if params[:3] == ["anchors", "positives", "negatives"]:
        guide = tuple(f"guide[{i}]" for i in range(3))
        return ("anchors", "positives", "negatives", "anchor_ids", "positive_ids", *guide)
    return None


def _unpack_guide(arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with a ``guide`` sequence as ``guide[0]``, ``guide[1]``, ... (each a batch
    argument of its own)."""
    guide = arguments.pop("guide", None)
    if isinstance(guide, (tuple, list)):
        arguments.update({f"guide[{i}]": g for i, g in enumerate(guide)})
    elif guide is not None:
        arguments["guide"] = guide
    return arguments


def _pair_objective(loss_fn, group, timeout):
    """``global_objective`` (gather) of a loss of aligned sets (:func:`_aligned_rows`): its
    row-aligned arguments gathered in rank order, the whole loss on every rank."""
    fn = unpartial(loss_fn)[0]
    what = f"global_objective({_name(loss_fn)})"
    batch = _aligned_rows(loss_fn)
    assert batch is not None  # global_objective sends only these here
    first = batch[0]

    def gathered(arguments: dict[str, Any], gather: Callable[[Tensor, str], Tensor]) -> None:
        """Every batch argument of ``arguments`` gathered in place (``guide`` by element)."""
        flat = _unpack_guide(arguments)
        for key in batch:
            if flat.get(key) is not None:
                flat[key] = gather(flat[key], key)
        if "guide[0]" in flat:
            flat["guide"] = tuple(
                flat.pop(f"guide[{i}]") for i in range(3) if f"guide[{i}]" in flat
            )

    @functools.wraps(loss_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Tensor:
        if not is_active(group):
            return loss_fn(*args, **kwargs)
        f, a, kw = unpartial(loss_fn, args, kwargs)
        if torch.compiler.is_compiling():
            bound = inspect.signature(fn).bind(*a, **kw)
            g_group = group or dist.group.WORLD
            gathered(bound.arguments, lambda t, _: _compiled_gather(t, g_group))
            return f(*bound.args, **bound.kwargs)
        bound_args: list[inspect.BoundArguments] = []

        def checks() -> None:
            bound = inspect.signature(fn).bind(*a, **kw)
            rows = bound.arguments.get(first)
            _check_batch(rows, first)
            assert isinstance(rows, Tensor)  # _check_batch raised otherwise
            flat = _unpack_guide(dict(bound.arguments))
            for key in batch[1:]:
                if flat.get(key) is not None:
                    _check_rows(flat[key], key, rows, first)
            bound_args.append(bound)

        session = Session(group, what, timeout)
        arguments = _unpack_guide(_named(loss_fn, args, kwargs))
        error = _local(checks)
        rows = arguments.get(first)
        device = rows.device if isinstance(rows, Tensor) else None
        sizes = session.agree(arguments, batch=batch, error=error, device=device)
        _refuse_empty(sizes[first], what, first)
        bound = bound_args[0]
        with session.guard("computing the loss"):
            gathered(bound.arguments, lambda t, key: _gather(session, t, sizes[first], key))
            return f(*bound.args, **bound.kwargs)

    return wrapped


def _anchor_split(loss_fn, all_emb, all_labels, args, kwargs):
    """For a loss that decomposes over anchors: a function of ``(rows, session)`` computing the
    global loss from this rank's anchor ``rows`` only; ``None`` for any other loss or setting.

    Each rank builds only its rows of the matrix (``B_local × B_global``), the reducers'
    normalisers are summed over the ranks (one all-reduce, no graph), and the returned value is
    the global loss ``L`` on every rank, carrying the gradient of ``W`` times the rank's share:
    ``W·ℓ_r + stop_gradient(L − W·ℓ_r)``. Summed over ranks by the gather's backward, the
    embeddings receive ``W·∂L/∂x``, the same as when every rank computes all of ``L``.

    A rank without rows takes part in both all-reduces with zeros (the normalisers' layout
    from one borrowed row) and a share of ``0`` that still reaches the gathered embeddings, so
    that its backward joins the gather's.
    """
    from .chunked import split_call

    try:
        call = split_call(loss_fn, (all_emb, all_labels, *args), kwargs)
    except (ValueError, TypeError):
        return None
    if call.embedding_regularizer is not None:  # a regularizer of the whole batch: compute it whole
        return None
    reducer = call.reducer
    assert reducer is not None  # split_call refuses a call without one (unchunkable)

    def share(rows: tuple[int, int], session: Session) -> Tensor:
        empty = rows[0] == rows[1]
        batch = call.batch((0, 1) if empty else rows)
        terms = call.terms(batch)
        names = sorted(terms)
        with torch.no_grad():  # normalisers (counts) of every sub-loss, summed over the ranks
            local = [reducer.normalizer(terms[n], batch.labels) for n in names]
            if empty:
                local = [torch.zeros_like(x) for x in local]
            flat = torch.cat([x.reshape(-1).to(torch.float64) for x in local])
        session.all_reduce(flat, "summing the reducers' normalisers")
        norms = flat.split([x.numel() for x in local])
        if empty:
            cd = _checks.compute_dtype(all_emb.dtype)
            mine = all_emb[:0].sum().to(cd)
        else:
            parts = [
                reducer.partial(
                    terms[n], batch.labels, norms[i].view(local[i].shape).to(local[i].dtype)
                )
                for i, n in enumerate(names)
            ]
            mine = torch.stack(parts).sum()
        total = mine.detach().clone()
        session.all_reduce(total, "summing the ranks' shares of the loss")
        w = session.world
        return w * mine + (total - w * mine).detach()  # in the compute dtype, as the loss

    return share


def value_and_grad(
    loss_fn: Callable[..., Tensor],
    chunk_size: int,
    *,
    group=None,
    timeout: float | None = None,
) -> Callable[..., tuple[Tensor, Tensor]]:
    r"""Anchor-chunked :func:`pmlfunc.chunked.value_and_grad` of the global objective, with the
    anchors split over the ranks.

    Each rank gathers the batch (no autograd graph), computes its *own* anchors' share of the
    global loss against the gathered references, chunk by chunk, and the shares and their
    gradients are summed over the ranks (one all-reduce each). Returns ``(L, g)`` with ``L`` the
    global loss and ``g = W · ∂L/∂x_local``: what ``emb.backward(g)`` should receive so that DDP's
    averaging yields the single-process gradient, the same convention as :func:`global_objective`.
    Outside a process group it is :func:`pmlfunc.chunked.value_and_grad` (``W = 1``). A rank
    with no rows takes part and receives a ``(0, D)`` gradient. The ranks agree first and every
    wait is bounded by ``timeout`` seconds, as in :func:`global_objective`.

    ``ref_emb``/``ref_labels`` pass through ungathered (the same on every rank); the gradient is
    with respect to ``embeddings`` only.

    Example:
        >>> encoder = torch.nn.Linear(16, 4)
        >>> x, labels = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> emb = encoder(x)
        >>> vg = value_and_grad(pf.losses.ntxent, chunk_size=3)
        >>> loss, g = vg(emb.detach(), labels, temperature=0.1)
        >>> emb.backward(g)  # then DDP averages
    """
    from .chunked import rows_value_and_grad

    rows_vg = rows_value_and_grad(loss_fn, chunk_size, "embeddings")
    if timeout is not None:
        Session.check_timeout(timeout)
    what = f"distributed.value_and_grad({_name(loss_fn)})"

    def vg(embeddings: Tensor, labels: Tensor | None = None, *args: Any, **kwargs: Any):
        if not is_active(group):
            return rows_vg(None, embeddings, labels, *args, **kwargs)

        session = Session(group, what, timeout)
        detached = embeddings.detach() if isinstance(embeddings, Tensor) else embeddings
        arguments = _named(loss_fn, (detached, labels, *args), kwargs)
        sizes = _agree_on_batch(session, arguments, "distributed.value_and_grad")
        assert labels is not None  # the agreement raised otherwise
        with session.guard("computing the chunked value and gradient"):
            all_emb = _gather(session, embeddings.detach(), sizes, "embeddings")
            all_labels = _gather(session, labels, sizes, "labels")
            r0 = sum(sizes[: session.rank])
            r1 = r0 + sizes[session.rank]
            value, grad = rows_vg((r0, r1), all_emb, all_labels, *args, **kwargs)
            value, grad = value.detach().clone(), grad.contiguous()
            session.all_reduce(value, "summing the ranks' shares of the loss")
            session.all_reduce(grad, "summing the ranks' gradients")
        return value, grad[r0:r1] * session.world

    return vg


def cross_batch_memory(
    loss_fn: Callable[..., Tensor],
    embeddings: Tensor,
    labels: Tensor,
    memory: dict[str, Tensor],
    *,
    group=None,
    timeout: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    r""":func:`pmlfunc.wrappers.cross_batch_memory` of the global batch: the memory stays
    identical on every rank.

    Each step gathers the batch in rank order (embeddings with autograd), enqueues the *gathered*
    batch and computes the loss of every gathered anchor against the memory, so every rank
    writes the same rows to the same slots and holds the same memory (PML's gather order
    differs by rank, so its per-rank memories diverge). Gradients follow the
    :func:`global_objective` convention: after DDP's averaging, the single-process gradient.
    The ranks agree first (the memory's keys, dtypes and shapes included) and every wait is
    bounded by ``timeout`` seconds. Outside a process group it is the plain wrapper.

    Example:
        >>> model = torch.nn.Linear(16, 4)
        >>> x, y = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> memory = pf.wrappers.cross_batch_memory_init(32, 4)
        >>> loss, memory = cross_batch_memory(pf.losses.contrastive, model(x), y, memory)
    """
    from .wrappers import cross_batch_memory as local_memory

    if not is_active(group):
        return local_memory(loss_fn, embeddings, labels, memory, **kwargs)
    what = f"distributed.cross_batch_memory({_name(loss_fn)})"
    session = Session(group, what, timeout)
    arguments = {"embeddings": embeddings, "labels": labels, "loss_fn": loss_fn, "memory": memory}
    arguments.update(kwargs)
    sizes = _agree_on_batch(session, arguments, "distributed.cross_batch_memory")
    with session.guard("computing the loss against the memory"):
        all_emb = _gather(session, embeddings, sizes, "embeddings")
        all_labels = _gather(session, labels, sizes, "labels")
        return local_memory(loss_fn, all_emb, all_labels, memory, **kwargs)
