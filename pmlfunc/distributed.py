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

Feature detection: the gather uses ``torch.distributed._functional_collectives``
(``all_gather_single`` with autograd, which also traces under ``torch.compile``) when the
installed torch has it, else ``torch.distributed.nn.functional.all_gather``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .losses._tiled import unpartial

__all__ = [
    "EXCHANGES",
    "all_gather",
    "cross_batch_memory",
    "global_objective",
    "is_active",
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


def _gather_equal(x: Tensor, group) -> Tensor:
    """Concatenate equal-shaped ``x`` from every rank along dim 0, in rank order."""
    fn = _functional_gather()
    return (fn or _legacy_gather)(x.contiguous(), group)


_MAX_NDIM = 8


def _shapes(x: Tensor, group) -> list[tuple[int, ...]]:
    """Every rank's ``x.shape`` (eager: one tiny all-gather and a host read)."""
    if x.ndim > _MAX_NDIM:
        raise ValueError(f"all_gather supports up to {_MAX_NDIM} dimensions, got {x.ndim}")
    code = [x.ndim, *x.shape] + [-1] * (_MAX_NDIM - x.ndim)
    mine = torch.tensor(code, dtype=torch.int64, device=_comm_device(x, group))
    out = [torch.zeros_like(mine) for _ in range(world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [tuple(t.tolist()[1 : 1 + int(t[0])]) for t in out]


def _comm_device(x: Tensor, group) -> torch.device:
    backend = dist.get_backend(group or dist.group.WORLD)
    return torch.device("cpu") if backend == "gloo" else x.device


def all_gather(x: Tensor, *, group=None, name: str = "x") -> Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order, differentiable.

    The backward gives each rank the sum over ranks of the gradients for its own rows. In eager
    mode the ranks' shapes are compared first (one tiny all-gather): a different trailing shape
    (embedding width) raises ``ValueError`` on every rank, and different batch sizes are handled
    by padding to the largest and dropping the padding. Under ``torch.compile`` that check is
    skipped and sizes must be equal. Outside a process group, returns ``x``.

    Example:
        >>> emb = torch.randn(8, 4)
        >>> all_gather(emb).shape  # (sum of per-rank batch sizes, D); one process: emb itself
        torch.Size([8, 4])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")
    if not is_active(group):
        return x
    group = group or dist.group.WORLD
    if torch.compiler.is_compiling():
        return _gather_equal(x, group)
    return _gather_sized(x, _batch_sizes(x, group, name), group)


def _batch_sizes(x: Tensor, group, name: str) -> list[int]:
    """Every rank's batch size, after checking that the other dimensions agree (eager)."""
    shapes = _shapes(x, group)
    if len({s[1:] for s in shapes}) != 1 or len({len(s) for s in shapes}) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise ValueError(
            f"{name} must have the same shape on every rank apart from the batch size; got {detail}"
        )
    return [s[0] for s in shapes]


def _gather_sized(x: Tensor, sizes: list[int], group) -> Tensor:
    """:func:`all_gather` given every rank's batch size (padded when they differ)."""
    if len(set(sizes)) == 1:
        return _gather_equal(x, group)
    top = max(sizes)
    pad = x.new_zeros((top - x.shape[0], *x.shape[1:]))
    padded = _gather_equal(torch.cat([x, pad], 0), group)
    return torch.cat([padded[r * top : r * top + n] for r, n in enumerate(sizes)], 0)


def _gather_batch(
    embeddings: Tensor, labels: Tensor, group
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """Gathered embeddings and labels and this rank's rows in them: one shape exchange (eager;
    under compile, equal sizes are assumed)."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"labels must have shape ({embeddings.shape[0]},) to match embeddings, got {tuple(labels.shape)}"
        )
    if torch.compiler.is_compiling():
        sizes = [embeddings.shape[0]] * world_size(group)
    else:
        sizes = _batch_sizes(embeddings, group, "embeddings")
    rank = dist.get_rank(group)
    r0 = sum(sizes[:rank])
    return (
        _gather_sized(embeddings, sizes, group),
        _gather_sized(labels, sizes, group),
        (r0, r0 + sizes[rank]),
    )


EXCHANGES = ("gather", "ring")


def global_objective(
    loss_fn: Callable[..., Tensor], *, group=None, exchange: str = "gather"
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
    - Unequal per-rank batch sizes are handled (eager; see :func:`all_gather`).
    - Work is split: a loss that decomposes over anchors (:func:`pmlfunc.chunked.chunkable`,
      given directly or as a ``functools.partial``) computes only this rank's anchor rows
      against the gathered batch (``B_local × B_global``), with the reducers' normalisers summed
      over the ranks. Other losses and settings (proxy and classifier losses, a lambda,
      ``swap=True``, an embedding regularizer) compute the whole loss on every rank.
    - :func:`pmlfunc.losses.clip` and :func:`pmlfunc.losses.siglip` gather both sets (and
      ``labels=``): row ``i`` of the gathered ``emb_a`` still pairs with row ``i`` of ``emb_b``.

    ``exchange="ring"``, for :func:`~pmlfunc.losses.clip`, :func:`~pmlfunc.losses.siglip`,
    :func:`~pmlfunc.losses.ntxent` and :func:`~pmlfunc.losses.supcon` (dense, or tiled with
    ``chunk_size``): each rank keeps its rows and the other ranks' blocks (embeddings and
    labels) pass around the ring one at a time, through the tiled engine (``pmlfunc/_ring.py``).
    Per rank, memory is ``O(B_local · D + B_local × B_local)`` (``chunk_size × B_local`` tiled),
    flat in the world size; no tensor with the global batch's rows is made. Eager only (point to
    point sends), unequal local batch sizes work; these losses' engine restrictions hold (labels
    for NT-Xent/SupCon, ``cosine()``/``dot()``), and ``ref_emb`` and an embedding regularizer
    are refused (use the gather). Outside an initialised process group it is the plain loss.

    Example:
        >>> encoder = torch.nn.Linear(16, 4)
        >>> x, y = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = global_objective(pf.losses.supcon)(encoder(x), y, temperature=0.1)
        >>> ring = global_objective(pf.losses.clip, exchange="ring")
        >>> loss = ring(encoder(x), torch.randn(8, 4), pf.losses.clip_init())
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange == "ring":
        return _ring_objective(loss_fn, group)
    if _is_pair_loss(loss_fn):
        return _pair_objective(loss_fn, group)

    @functools.wraps(loss_fn)
    def wrapped(embeddings: Tensor, labels: Tensor | None = None, *args: Any, **kwargs: Any):
        if not is_active(group):
            return loss_fn(embeddings, labels, *args, **kwargs)
        if kwargs.get("indices_tuple") is not None:
            raise ValueError(
                "indices_tuple refers to local rows and cannot be used with global_objective: "
                "mine on the gathered batch (wrap a function that calls the miner and the loss)"
            )
        if labels is None:
            raise ValueError("labels is required by global_objective")
        g_group = group or dist.group.WORLD
        all_emb, all_labels, rows = _gather_batch(embeddings, labels, g_group)
        split = _anchor_split(loss_fn, all_emb, all_labels, args, kwargs)
        if split is None:  # not decomposable over anchors: every rank computes all of it
            return loss_fn(all_emb, all_labels, *args, **kwargs)
        return split(rows, g_group)

    return wrapped


def _ring_objective(loss_fn, group):
    """``global_objective(loss_fn, exchange="ring")``."""
    from ._ring import ring_loss
    from .losses._tiled import builder_of, engine_call

    name = getattr(unpartial(loss_fn)[0], "__name__", "the loss")
    what = f"{name} with exchange='ring'"
    builder_of(loss_fn, "exchange='ring'")  # refuse any other loss now, not at the first step

    @functools.wraps(loss_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Tensor:
        if not is_active(group):
            return loss_fn(*args, **kwargs)
        call = engine_call(loss_fn, args, kwargs, what)
        if call.kind in ("ntxent", "supcon") and call.y is not None:
            raise ValueError(
                f"{what} circulates the batch itself: ref_emb is not supported "
                "(use exchange='gather', which passes it through)"
            )
        if call.finish is not None:
            raise ValueError(
                f"{what} does not support embedding_regularizer (a term of the "
                "whole batch): use exchange='gather'"
            )
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"{what} runs eagerly (point-to-point sends); under "
                "torch.compile use exchange='gather'"
            )
        return ring_loss(call, group or dist.group.WORLD)

    return wrapped


def _is_pair_loss(loss_fn) -> bool:
    """Whether ``loss_fn`` takes two aligned sets ``(emb_a, emb_b, ...)`` (CLIP, SigLIP)."""
    try:
        params = inspect.signature(unpartial(loss_fn)[0]).parameters
    except (TypeError, ValueError):
        return False
    return list(params)[:2] == ["emb_a", "emb_b"]


def _pair_objective(loss_fn, group):
    """``global_objective`` (gather) of a loss of two aligned sets: both sets and their labels
    gathered in rank order, the whole loss on every rank."""
    fn = unpartial(loss_fn)[0]

    @functools.wraps(loss_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Tensor:
        if not is_active(group):
            return loss_fn(*args, **kwargs)
        g_group = group or dist.group.WORLD
        f, a, kw = unpartial(loss_fn, args, kwargs)
        bound = inspect.signature(fn).bind(*a, **kw)
        sizes = _batch_sizes(bound.arguments["emb_a"], g_group, "emb_a")
        for key in ("emb_a", "emb_b", "labels"):
            if bound.arguments.get(key) is not None:
                bound.arguments[key] = _gather_sized(bound.arguments[key], sizes, g_group)
        return f(*bound.args, **bound.kwargs)

    return wrapped


def _anchor_split(loss_fn, all_emb, all_labels, args, kwargs):
    """For a loss that decomposes over anchors: a function of ``(rows, group)`` computing the
    global loss from this rank's anchor ``rows`` only; ``None`` for any other loss or setting.

    Each rank builds only its rows of the matrix (``B_local × B_global``), the reducers'
    normalisers are summed over the ranks (one all-reduce, no graph), and the returned value is
    the global loss ``L`` on every rank, carrying the gradient of ``W`` times the rank's share:
    ``W·ℓ_r + stop_gradient(L − W·ℓ_r)``. Summed over ranks by the gather's backward, the
    embeddings receive ``W·∂L/∂x``, the same as when every rank computes all of ``L``.
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

    def share(rows: tuple[int, int], group) -> Tensor:
        batch = call.batch(rows)
        terms = call.terms(batch)
        names = sorted(terms)
        with torch.no_grad():  # normalisers (counts) of every sub-loss, summed over the ranks
            local = [reducer.normalizer(terms[n], batch.labels) for n in names]
            flat = torch.cat([x.reshape(-1).to(torch.float64) for x in local])
        dist.all_reduce(flat, group=group)
        norms = flat.split([x.numel() for x in local])
        parts = [
            reducer.partial(
                terms[n], batch.labels, norms[i].view(local[i].shape).to(local[i].dtype)
            )
            for i, n in enumerate(names)
        ]
        mine = torch.stack(parts).sum()
        total = mine.detach().clone()
        dist.all_reduce(total, group=group)
        w = dist.get_world_size(group)
        return w * mine + (total - w * mine).detach()  # in the compute dtype, as the loss

    return share


def value_and_grad(
    loss_fn: Callable[..., Tensor], chunk_size: int, *, group=None
) -> Callable[..., tuple[Tensor, Tensor]]:
    r"""Anchor-chunked :func:`pmlfunc.chunked.value_and_grad` of the global objective, with the
    anchors split over the ranks.

    Each rank gathers the batch (no autograd graph), computes its *own* anchors' share of the
    global loss against the gathered references, chunk by chunk, and the shares and their
    gradients are summed over the ranks (one all-reduce each). Returns ``(L, g)`` with ``L`` the
    global loss and ``g = W · ∂L/∂x_local``: what ``emb.backward(g)`` should receive so that DDP's
    averaging yields the single-process gradient, the same convention as :func:`global_objective`.
    Outside a process group it is :func:`pmlfunc.chunked.value_and_grad` (``W = 1``).

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

    def vg(embeddings: Tensor, labels: Tensor | None = None, *args: Any, **kwargs: Any):
        if not is_active(group):
            return rows_vg(None, embeddings, labels, *args, **kwargs)
        if kwargs.get("indices_tuple") is not None:
            raise ValueError("indices_tuple refers to local rows and cannot be used across ranks")
        if labels is None:
            raise ValueError("labels is required by distributed.value_and_grad")
        g_group = group or dist.group.WORLD
        with torch.no_grad():
            all_emb, all_labels, (r0, r1) = _gather_batch(embeddings.detach(), labels, g_group)
        value, grad = rows_vg((r0, r1), all_emb, all_labels, *args, **kwargs)
        value, grad = value.detach().clone(), grad.contiguous()
        dist.all_reduce(value, group=g_group)
        dist.all_reduce(grad, group=g_group)
        return value, grad[r0:r1] * world_size(g_group)

    return vg


def cross_batch_memory(
    loss_fn: Callable[..., Tensor],
    embeddings: Tensor,
    labels: Tensor,
    memory: dict[str, Tensor],
    *,
    group=None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    r""":func:`pmlfunc.wrappers.cross_batch_memory` of the global batch: the memory stays
    identical on every rank.

    Each step gathers the batch in rank order (embeddings with autograd), enqueues the *gathered*
    batch and computes the loss of every gathered anchor against the memory, so every rank
    writes the same rows to the same slots and holds the same memory (PML's gather order
    differs by rank, so its per-rank memories diverge). Gradients follow the
    :func:`global_objective` convention: after DDP's averaging, the single-process gradient.
    Outside a process group it is the plain wrapper.

    Example:
        >>> model = torch.nn.Linear(16, 4)
        >>> x, y = torch.randn(8, 16), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> memory = pf.wrappers.cross_batch_memory_init(32, 4)
        >>> loss, memory = cross_batch_memory(pf.losses.contrastive, model(x), y, memory)
    """
    from .wrappers import cross_batch_memory as local_memory

    if not is_active(group):
        return local_memory(loss_fn, embeddings, labels, memory, **kwargs)
    g_group = group or dist.group.WORLD
    all_emb, all_labels, _ = _gather_batch(embeddings, labels, g_group)
    return local_memory(loss_fn, all_emb, all_labels, memory, **kwargs)
