r"""Losses of two aligned sets (image–text pairs): CLIP's symmetric InfoNCE and SigLIP's pairwise
sigmoid loss, with a learnable logit scale (and bias).

Row ``i`` of ``emb_a`` and row ``i`` of ``emb_b`` are a pair. With ``â``, ``b̂`` the
L2-normalised rows (``normalize=True``), ``t = exp(logit_scale)`` and ``b`` the logit bias (0
when ``params`` has none), every loss here reads the ``N × N`` logits

.. math::
    S_{ij} = t\,\hat a_i \cdot \hat b_j + b.

| loss | per row / pair | PML |
|---|---|---|
| :func:`clip` | ``(R_i[lse_j S_ij − mean_{P(i)} S_ij] + R_j[lse_i S_ij − mean_{P(j)} S_ij]) / 2`` | none |
| :func:`siglip` | ``Σ_ij softplus(−z_ij S_ij) / N``, ``z = +1`` for positives, ``−1`` otherwise | none |

The positives of row ``i`` are ``P(i) = {j : labels_j = labels_i}`` (``labels=None``: only
``j = i``). Both losses run on the tiled engine (:mod:`pmlfunc.losses._tiled`), dense or tiled:
``chunk_size=k`` sets its tile (``O(k·N)`` memory in both passes; without it CLIP takes one
``N × N`` tile, SigLIP tiles of ``2¹⁹`` entries, at least 256 rows), a plain ``loss.backward()``; the forward forms the
gradient where autograd will ask for it (CLIP with ``chunk_size``: its backward recomputes the
tiles), and that gradient is not differentiable again. Float16/bfloat16 embeddings are
computed in float32 and the loss is float32; the logit scale and bias enter in log space, so a
large scale or bias does not overflow.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import _checks
from .. import params as _params
from .._ops import unit_rows
from ..distances import cosine, dot
from ..reducers import Reducer
from ._tiled import EngineCall, builds, run_local, tiled_reducer

__all__ = ["clip", "clip_init", "siglip", "siglip_init"]


def clip(
    emb_a: Tensor,
    emb_b: Tensor,
    params: dict[str, Tensor],
    *,
    labels: Tensor | None = None,
    normalize: bool = True,
    max_logit_scale: float | None = None,
    chunk_size: int | None = None,
    reducer: Reducer | None = None,
    memory: dict[str, Tensor] | None = None,
    anchor_ids: Tensor | None = None,
    positive_ids: Tensor | None = None,
) -> Tensor:
    r"""CLIP's symmetric contrastive loss (InfoNCE in both directions), multi-positive with labels.

    With the logits ``S`` of the module docstring and ``P(i)`` the positives of row ``i``:

    .. math::
        \ell^{a→b}_i = \log \sum_j e^{S_{ij}} - \frac{1}{|P(i)|} \sum_{j \in P(i)} S_{ij},
        \qquad
        \ell^{b→a}_j = \log \sum_i e^{S_{ij}} - \frac{1}{|P(j)|} \sum_{i \in P(j)} S_{ij}

    and ``L = (mean_i ℓ^{a→b}_i + mean_j ℓ^{b→a}_j) / 2``. Without labels ``P(i) = {i}``: the
    cross entropy of CLIP (Radford et al.) and open_clip's ``ClipLoss``. With labels every pair of
    equal labels is a positive, averaged over the row's positives as SupCon does (Khosla et al.),
    in both directions.

    Args:
        emb_a: ``(N, D)`` float tensor, the first set (e.g. images).
        emb_b: ``(N, D)`` float tensor, the second set (e.g. texts), row-aligned with ``emb_a``.
        params: ``{"logit_scale": 0-d, "logit_bias": 0-d (optional)}`` from :func:`clip_init`;
            ``logit_scale`` is in log space (``t = exp(logit_scale)``), as CLIP keeps it.
        labels: ``(N,)`` integer class ids of the pairs, or ``None`` (each pair its own class).
        normalize: L2-normalise the rows first (default ``True``).
        max_logit_scale: if given, ``logit_scale`` is clamped at it before ``exp`` (CLIP and
            open_clip clamp the parameter at ``math.log(100)`` after each step; passing it here
            clamps inside the loss instead, with a zero gradient above the bound).
        chunk_size: if given, the engine's tile (``O(chunk_size × N)`` memory in both passes);
            ``None``: one ``N × N`` tile.
        reducer: ``mean()`` (default) or ``sum()`` over rows and columns (``R`` above).
        memory: ``None`` or a queue of earlier steps' ``emb_b`` rows
            (:func:`pmlfunc.queues.document_queue_init`; with ``queries=True`` their ``emb_a``
            rows too): its filled entries join the candidates, ``ℓ^{a→b}_i``'s sum over ``j``
            the queued ``b`` rows, ``ℓ^{b→a}_j``'s sum over ``i`` the queued ``a`` rows. Then
            ``clip`` is :func:`~pmlfunc.losses.multiple_negatives_ranking` with
            ``directions=("query_to_doc", "doc_to_query")``,
            ``partition_mode="per_direction"`` and this ``memory`` (and ids). Refused with
            ``labels`` and with a ``logit_bias``.
        anchor_ids, positive_ids: ``(N,)`` integer ids of the pairs' ``emb_a`` and ``emb_b``
            rows (dataset ids, stable across steps), or ``None``: a candidate of another pair
            (in the batch or in the queue) whose anchor id or positive id equals the row's is
            left out of its log-sum-exps, as
            :func:`~pmlfunc.losses.multiple_negatives_ranking`'s ids do. Refused with
            ``labels``.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> a, b = torch.randn(8, 16), torch.randn(8, 16)
        >>> loss = pf.losses.clip(a, b, pf.losses.clip_init())
        >>> queue = pf.queues.document_queue_init(64, 16, queries=True)
        >>> loss = pf.losses.clip(a, b, pf.losses.clip_init(), memory=queue)
        >>> queue = pf.queues.document_queue_push(queue, b, queries=a)

    References: Radford et al., "Learning Transferable Visual Models From Natural Language
    Supervision" (CLIP), ICML 2021; Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020.
    """
    return run_local(
        _pair_call(
            "clip", emb_a, emb_b, params, labels, normalize, max_logit_scale, chunk_size, reducer,
            memory=memory, ids=(anchor_ids, positive_ids),
        )
    )  # fmt: skip


def siglip(
    emb_a: Tensor,
    emb_b: Tensor,
    params: dict[str, Tensor],
    *,
    labels: Tensor | None = None,
    normalize: bool = True,
    max_logit_scale: float | None = None,
    chunk_size: int | None = None,
    reducer: Reducer | None = None,
    memory: dict[str, Tensor] | None = None,
    anchor_ids: Tensor | None = None,
    positive_ids: Tensor | None = None,
) -> Tensor:
    r"""SigLIP's pairwise sigmoid loss: every pair a binary classification.

    With the logits ``S`` of the module docstring and ``z_ij = +1`` when ``j ∈ P(i)``, ``−1``
    otherwise:

    .. math::
        L = -\frac{1}{N} \sum_{i,j} \log σ(z_{ij} S_{ij})
          = \frac{1}{N} \sum_{i,j} \mathrm{softplus}(-z_{ij} S_{ij})

    (the paper's normalisation by the batch size ``N``). No softmax, so no row statistics: the
    tiled path is a plain sum over tiles.

    Args:
        emb_a: ``(N, D)`` float tensor, the first set.
        emb_b: ``(N, D)`` float tensor, row-aligned with ``emb_a``.
        params: ``{"logit_scale": 0-d, "logit_bias": 0-d}`` from :func:`siglip_init`
            (``t = exp(logit_scale)``; without ``"logit_bias"``, ``b = 0``).
        labels: ``(N,)`` integer class ids of the pairs, or ``None`` (each pair its own class).
        normalize: L2-normalise the rows first (default ``True``).
        max_logit_scale: if given, ``logit_scale`` is clamped at it before ``exp``.
        chunk_size: if given, the engine's tile (``O(chunk_size × N)`` memory in both passes);
            ``None``: tiles of ``2¹⁹`` entries and at least 256 rows (``2²²`` entries with
            ``memory=`` or ids).
        reducer: ``None`` (default: ``Σ / N``, the paper's), ``mean()`` (``Σ`` over the number
            of pairs summed, ``N²`` without ids or a queue) or ``sum()``.
        memory: ``None`` or a queue of earlier steps' ``emb_b`` rows
            (:func:`pmlfunc.queues.document_queue_init`): each filled entry ``k`` adds the
            negative pairs ``(i, k)`` of every row ``i``, ``softplus(S_ik)``; empty slots add
            nothing. A queue's queries (``queries=True``) are not read (SigLIP's pairs start
            from ``emb_a``'s rows). Refused with ``labels``.
        anchor_ids, positive_ids: ``(N,)`` integer ids of the pairs' ``emb_a`` and ``emb_b``
            rows (dataset ids, stable across steps), or ``None``. A pair ``(i, j)``, ``j ≠ i``,
            whose anchor ids or positive ids are equal (the same query or the same document) is
            left out instead of being a negative, within the batch and against the queue's
            entries (pushed with their ids, :func:`pmlfunc.queues.document_queue_push`).
            Refused with ``labels``.

    With ``memory`` or ids the pairs are those of
    :func:`~pmlfunc.losses.multiple_negatives_ranking`'s candidates (its ``query_to_doc``
    direction with the same ``memory`` and ids), each a sigmoid term: one engine, the same
    masks. Under DDP every rank holds the same queue (:mod:`pmlfunc.queues`).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> a, b = torch.randn(8, 16), torch.randn(8, 16)
        >>> loss = pf.losses.siglip(a, b, pf.losses.siglip_init())
        >>> queue = pf.queues.document_queue_init(64, 16)
        >>> ids = torch.arange(8)
        >>> loss = pf.losses.siglip(a, b, pf.losses.siglip_init(), memory=queue, positive_ids=ids)
        >>> queue = pf.queues.document_queue_push(queue, b, positive_ids=ids)

    Reference: Zhai, Mustafa, Kolesnikov, Beyer, "Sigmoid Loss for Language Image Pre-Training"
    (SigLIP), ICCV 2023.
    """
    return run_local(
        _pair_call(
            "siglip", emb_a, emb_b, params, labels, normalize, max_logit_scale, chunk_size, reducer,
            memory=memory, ids=(anchor_ids, positive_ids),
        )
    )  # fmt: skip


def clip_init(
    logit_scale: float = math.log(1 / 0.07),
    logit_bias: float | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    """Parameters of :func:`clip`: ``{"logit_scale": 0-d}`` (and ``"logit_bias"`` when given).

    ``logit_scale`` is in log space; CLIP initialises it at ``log(1/0.07)`` (a temperature of
    0.07). CLIP has no bias; pass ``logit_bias`` to learn one.

    Example:
        >>> round(float(pf.losses.clip_init()["logit_scale"].exp()), 2)
        14.29
    """
    return _init(logit_scale, logit_bias, dtype, device)


def siglip_init(
    logit_scale: float = math.log(10.0),
    logit_bias: float | None = -10.0,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    """Parameters of :func:`siglip`: ``{"logit_scale": 0-d, "logit_bias": 0-d}``, by default the
    paper's ``t' = log 10`` and ``b = −10`` (``logit_bias=None``: no bias).

    Example:
        >>> {k: round(float(v), 3) for k, v in pf.losses.siglip_init().items()}
        {'logit_scale': 2.303, 'logit_bias': -10.0}
    """
    return _init(logit_scale, logit_bias, dtype, device)


def _init(logit_scale, logit_bias, dtype, device) -> dict[str, Tensor]:
    params = {
        "logit_scale": torch.tensor(
            _checks.number(logit_scale, "logit_scale"), dtype=dtype, device=device
        )
    }
    if logit_bias is not None:
        params["logit_bias"] = torch.tensor(
            _checks.number(logit_bias, "logit_bias"), dtype=dtype, device=device
        )
    return params


def _pair_call(
    name, emb_a, emb_b, params, labels, normalize, max_logit_scale, chunk_size, reducer,
    what=None, memory=None, ids=(None, None),
) -> EngineCall:  # fmt: skip
    """The validated call as the tiled engine runs it: ``â``, ``b̂`` in the compute dtype, the
    scale ``t = exp(logit_scale)`` and bias ``b``; ``what`` names the caller in errors. With a
    ``memory`` queue or ``ids`` it is the retrieval kind's call (:func:`_retrieval_pair_call`)."""
    if memory is not None or any(i is not None for i in ids):
        return _retrieval_pair_call(
            name, emb_a, emb_b, params, labels, normalize, max_logit_scale, chunk_size, reducer,
            what or name, memory, ids,
        )  # fmt: skip
    _checks.paired_rows(emb_a, emb_b, ("emb_a", "emb_b"), name)
    if labels is not None:
        _checks.labels(labels, emb_a.shape[0], emb_a.device, "labels", "emb_a")
    if not isinstance(params, dict) or "logit_scale" not in params:
        raise TypeError(
            f"params must be a dict with a 'logit_scale' entry (from pf.losses.{name}_init()), got "
            f"{params if not isinstance(params, dict) else sorted(params)!r}"
        )
    _params.known_keys(params, ("logit_scale", "logit_bias"))
    cd = _checks.compute_dtype(emb_a.dtype)
    scale = _params.check(params, "logit_scale", emb_a, ndim=0).to(cd)
    if max_logit_scale is not None:
        scale = scale.clamp(max=_checks.number(max_logit_scale, "max_logit_scale"))
    bias = (
        _params.check(params, "logit_bias", emb_a, ndim=0).to(cd)
        if "logit_bias" in params
        else None
    )
    a, b = emb_a.to(cd), emb_b.to(cd)
    if normalize:
        a, b = unit_rows(a), unit_rows(b)  # F.normalize's values, a shorter backward
    red = tiled_reducer(name, reducer, what)
    chunk = None if chunk_size is None else _checks.chunk_size(chunk_size)
    return EngineCall(name, a, b, labels, None, scale.exp(), bias, chunk, red, normalized=normalize)


def _retrieval_pair_call(
    name, emb_a, emb_b, params, labels, normalize, max_logit_scale, chunk_size, reducer, what,
    memory, ids,
) -> EngineCall:  # fmt: skip
    """CLIP or SigLIP against a queue or with ids as the retrieval kind's call
    (``emb_a`` the queries; :func:`~pmlfunc.losses.multiple_negatives_ranking`): CLIP's
    symmetric InfoNCE with per-direction log-sum-exps is ``query_to_doc`` + ``doc_to_query``,
    which reads a queue's documents and queries; SigLIP is ``query_to_doc``'s candidates, each
    a sigmoid pair (``Retrieval.sigmoid``), which reads its documents."""
    from .retrieval import _retrieval_call

    given = "memory=" if memory is not None else "anchor_ids/positive_ids"
    if labels is not None:
        raise ValueError(
            f"{what} with {given} does not take labels: a queued row has no label; mask "
            "duplicates by anchor_ids/positive_ids"
        )
    if not isinstance(params, dict) or "logit_scale" not in params:
        raise TypeError(
            f"params must be a dict with a 'logit_scale' entry (from pf.losses.{name}_init()), "
            f"got {params if not isinstance(params, dict) else sorted(params)!r}"
        )
    distance = cosine() if normalize else dot()
    if name == "siglip":
        return _retrieval_call(
            emb_a, emb_b, None, params, 1.0, distance, ("query_to_doc",), "joint", None, 0.0,
            ids[0], ids[1], None, "absolute", 0.0, max_logit_scale, chunk_size, reducer, memory,
            what=what, sigmoid=True,
        )  # fmt: skip
    if "logit_bias" in params:
        raise ValueError(f"{what} with {given} has no logit_bias (params holds one)")
    return _retrieval_call(
        emb_a, emb_b, None, params, 1.0, distance, ("query_to_doc", "doc_to_query"),
        "per_direction", None, 0.0, ids[0], ids[1], None, "absolute", 0.0, max_logit_scale,
        chunk_size, reducer, memory, what=what,
    )  # fmt: skip


def _engine_call(kind: str, a, what: str | None) -> EngineCall:
    """``clip``/``siglip``'s bound arguments ``a`` as the engine's call (the ring's)."""
    return _pair_call(
        kind, a["emb_a"], a["emb_b"], a["params"], a["labels"], a["normalize"],
        a["max_logit_scale"], a["chunk_size"], a["reducer"], what, a.get("memory"),
        (a.get("anchor_ids"), a.get("positive_ids")),
    )  # fmt: skip


builds(clip)(functools.partial(_engine_call, "clip"))
builds(siglip)(functools.partial(_engine_call, "siglip"))
