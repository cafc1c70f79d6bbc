r"""Neighbourhood losses: each anchor scored against the rest of the batch (or a reference set).

| loss | PML class | per-row form |
|---|---|---|
| :func:`nca` | ``NCALoss`` | one softmax per row, summed over the positives |
| :func:`npairs` | ``NPairsLoss`` | one pair per class, chosen without ``unique``; a ``(B, B)`` softmax |
| :func:`angular` | ``AngularLoss`` | a log-sum-exp over negatives per (anchor, positive) from Gram matrices |
| :func:`instance` | ``InstanceLoss`` | cross entropy per row, targets by a sort (no ``unique``) |
| :func:`ranked_list` | ``RankedListLoss`` | weighted sums over the selected entries of each row |
| :func:`manifold` | ``ManifoldLoss`` | a random walk over batch + proxies (one ``(B+K)²`` inverse) |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Unpack

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, _random
from .. import params as _params
from .._ops import (
    cross_entropy,
    indicator,
    logaddexp,
    masked_logsumexp,
    matmul,
    readable,
    scalar_like,
    scatter_rows,
)
from ..distances import Distance, _Lp, cosine, lp, resolve
from ..labels import label_masks
from ..reducers import DenseTerms, Reducer, Terms, elements, mean, reduce
from ..tuples import MinedTriplets, is_mined, sample_weights
from ._batch import Batch, BatchInputs, batch_loss, refuse, spec
from ._regularize import regularize

__all__ = [
    "angular",
    "instance",
    "manifold",
    "manifold_init",
    "manifold_meta_classes",
    "nca",
    "npairs",
    "ranked_list",
]

_COSINE = ("cosine() (PML asserts CosineSimilarity)", lambda d: d == cosine())


def nca(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    softmax_scale: float | Tensor = 1,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Neighbourhood component analysis loss: each sample should pick a same-class neighbour.

    With ``z_{ij} = -σ d_{ij}`` (``σ s_{ij}`` for a similarity), the anchor's own entry excluded
    in self mode, and ``P(i)`` the references of ``i``'s class:

    .. math::
        \ell_i = -\log \sum_{j \in P(i)} \frac{e^{z_{ij}}}{\sum_k e^{z_{ik}}}
               = \operatorname{lse}_{k}\, z_{ik} - \operatorname{lse}_{j \in P(i)} z_{ij}

    computed as PML does, one softmax per row summed over the positives (the anchor's own column
    weighted exactly 0 in self mode), in CPU eager mode where no anchor's probability is
    subnormal; there, on accelerators and in traced code by the second form (the positives'
    log-sum-exp over their listed columns alone when they are few), whose gradient stays finite
    where PML's is NaN in every row (``1/p`` overflows). As in PML, an anchor whose probability
    is 0 (it has no positive, or it underflows: below the dtype's smallest subnormal number in
    the second form) is left out of the mean; with ``indices_tuple`` each term is
    multiplied by the anchor's count in the tuple over the largest count (PML's
    ``convert_to_weights``; the tuple does not change the pairs, which come from the labels).

    Unlike PML 2.9.0, which returns NaN (the mean of an empty tensor) when no anchor has a
    positive, the loss is then 0 with zero gradients; and a single query row against a reference
    set is scored (PML returns 0 for any batch of one).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required).
        softmax_scale: ``σ`` (default ``1``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); an
            ``indices_tuple`` only weights the anchors; ``distance``:
            default ``lp(power=2)`` (squared Euclidean between normalised rows); ``reducer``:
            default ``mean()`` over the kept anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.nca(emb, labels, softmax_scale=2.0)

    Reference: Goldberger et al., "Neighbourhood Components Analysis", NeurIPS 2004.
    """
    return spec(nca)(embeddings, labels, inputs, softmax_scale=softmax_scale)


@batch_loss(
    nca,
    distance=lp(power=2, exact_budget=0),  # a softmax over d²: exact near entries decide nothing
    reducer=mean(),
    needs_labels=True,
    exact_ties=False,
)
def _nca_terms(batch: Batch, *, softmax_scale) -> dict[str, Terms]:
    softmax_scale = _checks.hyper(softmax_scale, "softmax_scale")
    pos, _ = batch.label_masks()  # PML: the tuple weights the anchors, labels give the pairs
    z = batch.scaled_similarity(softmax_scale)  # a fresh tensor: the fill below is ours
    if batch.diagonal is not None:  # the anchor's own column: weight exactly 0 in the softmax
        z.diagonal(batch.diagonal).fill_(torch.finfo(z.dtype).min)
    listed = batch.listed(pos)  # in CPU eager mode, with few positives: their columns alone
    p = None
    if readable(z):  # PML's form, one fused softmax a row, where no p is subnormal (below)
        soft = torch.softmax(z, dim=-1)
        if listed is None:
            p = (soft * pos).sum(-1)
        else:
            p = (soft.gather(-1, listed[0]) * listed[1].to(z.dtype)).sum(-1)
        if bool(((p > 0) & (p < torch.finfo(p.dtype).tiny)).any()):
            p = None
    if p is not None:
        keep = p.detach() != 0  # PML drops anchors whose p is exactly 0
        losses = torch.where(keep, -torch.where(keep, p, torch.ones_like(p)).log(), 0.0)
    else:
        # −log p = lse_k z_ik − lse_{j ∈ P(i)} z_ij: finite gradients where p is subnormal (PML's
        # 1/p overflows to inf there: inf·0 = NaN in the softmax's backward, in every row); one
        # more pass of exponentials, so only there, on accelerators and in traced code
        if listed is None:
            lse_pos = masked_logsumexp(z, pos)
        else:
            lse_pos = masked_logsumexp(z.gather(-1, listed[0]), listed[1].to(z.dtype))
        log_p = lse_pos - torch.logsumexp(z, dim=-1)
        # left out as by PML: no positive (lse_pos = −finfo.max), or p below the dtype's
        # smallest subnormal (it rounds to 0); a NaN row is kept (its loss is NaN)
        finfo = torch.finfo(z.dtype)
        keep = ~(log_p.detach() < math.log(finfo.tiny * finfo.eps))
        losses = torch.where(keep, -log_p, 0.0)
    b = batch.embeddings.shape[0]
    mw = sample_weights(
        batch.indices_tuple, b, z.dtype, z.device, anchors_only=batch.ref_emb is not None
    )
    if mw is not None:
        r0, r1 = (0, b) if batch.rows is None else batch.rows
        losses = losses * mw[r0:r1]
    return {"loss": DenseTerms(losses, keep.to(z.dtype), "element", batch.num_anchors)}


def npairs(
    embeddings: Tensor,
    labels: Tensor | None = None,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Multi-class N-pair loss: one (anchor, positive) pair per class, the other classes'
    positives as negatives.

    PML's choice of pairs, without ``unique``: of the positive pairs in order (row-major from the
    labels; the tuple's order for an ``indices_tuple``), the first one whose anchor has a given
    label. With those ``K`` pairs ``(a_k, p_k)`` and similarity ``s`` (a distance enters as
    ``-d``):

    .. math::
        \ell_k = -\log \frac{e^{s(a_k, p_k)}}{\sum_{k'=1}^{K} e^{s(a_k, p_{k'})}}

    computed in ``B/2`` fixed slots (a class with a pair has two members; ``B`` with an
    ``indices_tuple``), empty ones weighted 0: a ``(B/2, B/2)`` matrix of the chosen rows only,
    whatever the number of classes, no host sync.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required, as in PML).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``ref_emb``
            and ``ref_labels`` (a ``ValueError``, as in PML); an ``indices_tuple`` gives the
            candidate positive pairs; ``distance``:
            default ``cosine()``: PML 2.9.0's default ``DotProductSimilarity()`` normalises both
            sides, which is the cosine (use ``dot()`` for the paper's raw inner product, PML's
            ``DotProductSimilarity(normalize_embeddings=False)``); ``reducer``: default
            ``mean()`` over the chosen pairs.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.npairs(emb, labels)

    Reference: Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss Objective",
    NeurIPS 2016.
    """
    return spec(npairs)(embeddings, labels, inputs)


@batch_loss(
    npairs,
    distance=cosine(),
    reducer=mean(),
    refuses=("ref_emb", "ref_labels"),
    needs_labels=True,
    unchunkable="each class's pair is chosen over the whole batch",
)
def _npairs_terms(batch: Batch) -> dict[str, Terms]:
    b = batch.embeddings.shape[0]
    assert batch.labels is not None  # needs_labels
    anchor_slot, pos_slot, occupied = _npairs_slots(batch, batch.labels)
    idx = torch.arange(b, device=occupied.device)
    used: Tensor | None = None
    if readable(occupied) and bool(occupied.any()):
        sel = occupied.nonzero().squeeze(1)  # the occupied slots alone: nothing to mask
    else:
        # The occupied slots first, in k static slots: from labels a class with a pair has two
        # members, so at most b // 2 classes do (a given tuple may pair a row with itself: b).
        k = max(1, b // 2) if batch.indices_tuple is None else b
        sel = torch.where(occupied, idx, b).topk(k, largest=False).values
        used = sel < b
        sel = sel.clamp_max(b - 1)
    anchors, positives = anchor_slot[sel], pos_slot[sel]
    d = batch.block(anchors, positives)  # (k, k): the chosen pairs' rows only
    s = d if batch.distance.is_similarity else -d
    target = idx[: sel.numel()]
    if used is None:
        losses = cross_entropy(s, target)
        weight = torch.ones_like(losses)
    else:
        weight = used.to(s.dtype)
        # empty slots' columns out of every softmax: −finfo.max, finite (an all-empty row's
        # gradient stays finite), and its rows weighted 0
        s = s.masked_fill(~used, -torch.finfo(s.dtype).max)
        losses = torch.where(used, cross_entropy(s, target), 0.0)
    return {"loss": DenseTerms(losses, weight, "element", b, anchor_index=anchors)}


def _npairs_slots(batch: Batch, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(anchor, positive, occupied)`` per slot: each class's chosen pair, PML's
    ``convert_to_pos_pairs_with_unique_labels``. From the labels sorted stably (``O(B log B)``,
    no ``B × B`` comparison): slot ``j`` is sorted position ``j``, and a class's first position
    holds its pair (its first member with its second: the first positive pair row-major), in
    label order as PML's ``unique`` puts them."""
    b = labels.shape[0]
    dev = labels.device
    idx = torch.arange(b, device=dev)
    order = labels.argsort(stable=True)
    ls = labels[order]
    same_next = ls[1:] == ls[:-1]
    start = torch.cat([torch.ones(1, dtype=torch.bool, device=dev), ~same_next])
    t = batch.indices_tuple
    if t is None:
        has_next = torch.cat([same_next, torch.zeros(1, dtype=torch.bool, device=dev)])
        return order, order[(idx + 1).clamp_max(b - 1)], start & has_next
    # the first batch index of each sample's class
    rep = torch.empty_like(order).scatter_(
        0, order, order[torch.where(start, idx, 0).cummax(0).values]
    )
    big = torch.full((), b, device=dev, dtype=idx.dtype)
    if isinstance(t, MinedTriplets):
        a, p, valid = t.anchors.long(), t.positives.long(), t.valid > 0
    elif is_mined(t):  # pair multiplicities: each row's first positive column, row-major
        pos = t.pair_masks((b, b), torch.float32)[0] > 0
        a = idx
        p = torch.where(pos, idx, big).amin(1).clamp_max(b - 1)
        valid = pos.any(1)
    else:
        a, p = t[0].long().to(dev), t[1].long().to(dev)
        valid = torch.ones(a.shape, dtype=torch.bool, device=dev)
    n = a.shape[0]
    if n == 0:  # a static case: no candidate pair
        return idx, idx, torch.zeros(b, dtype=torch.bool, device=dev)
    listed = torch.arange(n, device=dev)
    cand = torch.where(valid, listed, torch.full_like(listed, n))
    first = torch.full((b,), n, dtype=listed.dtype, device=dev)
    first = first.scatter_reduce(0, rep[a], cand, reduce="amin")
    occupied = first < n
    k = first.clamp_max(n - 1)
    return a[k], p[k], occupied


def angular(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    alpha: float | Tensor = 40,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Angular loss: the angle at the negative of the triangle (anchor, positive, negative).

    With ``t = tan²α``, unit anchors and positives ``x̂_a``, ``x̂_p`` and references ``x_n``
    (PML uses the references as given, not normalised, in this term), one term per positive pair:

    .. math::
        \ell_{ap} = \log\Big(1 + \sum_{n \in N(a)}
            e^{4t\,(\hat x_a + \hat x_p)^\top x_n - 2(1 + t)\,\hat x_a^\top \hat x_p}\Big)

    over the negatives ``N(a)`` of the anchor by label (also with an ``indices_tuple``, whose
    positive pairs are the terms; as in PML). PML builds a ``(pairs × M)`` tensor (100 GB in its
    issue #329); here, with ``u_an = 4t x̂_a·x_n`` and ``v_pn = 4t x̂_p·x_n``, two ways:

    - In CPU eager mode, when no anchor has positives in more than an eighth of the columns,
      each anchor's positive columns are listed and every pair's log-sum-exp of
      ``u_an + v_pn`` over ``N(a)`` is taken as such (``O(B·K·M)`` memory for at most ``K``
      positives per anchor): exact whatever the values, as PML.
    - Elsewhere (on an accelerator, under ``torch.compile`` and ``torch.func`` transforms, with
      many positives per anchor: the static path) from Gram matrices:
      ``Σ_n e^{u_an + v_pn} = (A Bᵀ)_{ap}`` with ``A = [n ∈ N(a)]·e^{u_an − max_n u_an + H}``
      and ``B = [n ∈ N(p)]·e^{v_pn − max_n v_pn + H}``, the maxima over the negatives
      (``N(p) = N(a)`` for a same-label pair; with an ``indices_tuple``, whose pairs need not
      share a label, ``B`` is unmasked and shifted by the maximum over every column) and a
      headroom ``H`` (≈ 18 in float32 at M = 512, 175 in float64: a second derivative's
      ``w²`` stays finite): one matmul, ``O(B·M + M²)`` memory. The largest product is below
      ``e^{2H}`` where the ``n`` that maximises ``u_an`` and the one that maximises ``v_pn``
      differ; when every product of a pair is below ~``e^{-87}`` (float32) the sum leaves the
      normal range. In CPU eager mode such a batch is then recomputed on its listed pairs
      (exact); on the static path the pair's log-sum-exp is read as that threshold plus the
      shifts: an overestimate of the term by up to the gap, with no gradient through its
      log-sum-exp. That takes ``8t·max‖x_n‖ ≳ 87 + 2H``, e.g. α = 40° with raw norms above
      ~22 in float32 (α ≳ 80° with unit rows), and negatives near the anchor and the positive
      but far apart.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required).
        alpha: the angle α in degrees (default ``40``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); a ``mat`` is the
            ``lp()`` distance matrix (the cosines are ``1 − d²/2``); ``distance``:
            ``lp()`` only (PML asserts ``LpDistance(p=2, power=1, normalize=True)``);
            ``reducer``: default ``mean()`` over positive pairs.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.angular(emb, labels, alpha=45)

    Reference: Wang et al., "Deep Metric Learning with Angular Loss", ICCV 2017.
    """
    return spec(angular)(embeddings, labels, inputs, alpha=alpha)


@batch_loss(
    angular,
    distance=lp(),
    reducer=mean(),
    needs_labels=True,
    distance_rule=(
        "lp() (p=2, power=1, normalize=True)",
        lambda d: isinstance(d, _Lp) and d.p == 2 and d.power == 1 and d.normalize,
    ),
    # chunking normalises the batch once up front; the negative term needs the raw references
    unchunkable="its negative term uses the unnormalised references",
)
def _angular_terms(batch: Batch, *, alpha) -> dict[str, Terms]:
    alpha = _checks.hyper(alpha, "alpha")
    _, neg = batch.label_masks()
    pos = batch.masks.pos
    cd = batch.dtype
    x = batch.embeddings.to(cd)
    ref = x if batch.ref_emb is None else batch.ref_emb.to(cd)
    ref_norm = torch.linalg.vector_norm(ref, dim=-1)
    ref_hat = F.normalize(ref, dim=-1)
    if batch.given_mat:  # the normalised Euclidean distances: cos = 1 − d²/2
        cos_ar = 1.0 - 0.5 * batch.mat.square()
    else:  # x̂_a · x̂_r directly, as PML's dot products (no distance to invert)
        x_hat = ref_hat if batch.ref_emb is None else F.normalize(x, dim=-1)
        cos_ar = matmul(x_hat, ref_hat.transpose(-1, -2))
    t: float | Tensor
    if isinstance(alpha, Tensor):
        t = torch.tan(torch.deg2rad(alpha.to(torch.float64))).square().to(cd)
    else:
        t = math.tan(math.radians(alpha)) ** 2
    u = (4 * t) * (cos_ar * ref_norm)  # 4t x̂_a·x_n, (rows, M)
    # 4t x̂_p·x_n, (M, M): u itself in self mode (anchors are the references)
    v = u if batch.ref_emb is None else (4 * t) * matmul(ref_hat, ref.transpose(-1, -2))
    listed = batch.listed(pos)  # the labels' listing where pos is theirs
    if listed is None:
        # every entry by one matmul (the static path): Σ_n [n ∈ N(a)] e^{u_an + v_pn − shifts}
        # = (A Bᵀ)_{ap}, each factor shifted to a headroom H below the maximum over the
        # negatives it sums: the products span e^{2H} more above the subnormal floor, and w²
        # (a second derivative's) stays finite: M²·e^{4H} below finfo.max (H ≈ 18 in float32
        # at M = 512, 175 in float64)
        room = max(
            0.0, 0.5 * (0.5 * math.log(torch.finfo(cd).max) - math.log(u.shape[-1] + 1.0)) - 1.0
        )
        a, u_shift, has_neg = _exp_below_max(u, neg, room)
        if batch.indices_tuple is not None:  # the tuple's pairs need not share a label
            v_shift = v.amax(-1, keepdim=True).detach() - room  # every column: no overflow
            b = torch.exp(v - v_shift)
        elif batch.ref_emb is None:  # N(p) = N(a) for a same-label pair, and v = u: B = A
            b, v_shift = a, u_shift
        else:  # N(a) = the references of another label than p's: p's negatives among them
            assert batch.ref_labels is not None  # needs_labels: ref_emb comes with ref_labels
            b, v_shift, _ = _exp_below_max(v, label_masks(batch.ref_labels, dtype=cd).neg, room)
        w = matmul(a, b.transpose(-1, -2))
        keep = has_neg.to(cd) * indicator(pos)
        tiny = torch.finfo(cd).tiny
        # in CPU eager mode a kept pair whose sum fell below the normal range (the maximising
        # negatives of u_a and v_p far apart: a gap of ~2H + 87 nats) is taken exactly instead
        if not (readable(w) and bool(((w < tiny) & (keep > 0)).any())):
            lse = torch.log(w.clamp_min(tiny)) + u_shift + v_shift.transpose(-1, -2)
            return _angular_loss(batch, _angular_term(lse, cos_ar, keep, t), pos)
        listed = batch.listed(pos, cost=0.0)
        assert listed is not None  # readable: always listed at no cost bound
    # each anchor's positive columns: an exact log-sum-exp per pair
    idx, valid = listed
    rows, k = idx.shape
    # z_akn = u_an + v_pn for the anchor's k-th positive p: (rows, K, M), over N(a) only
    z = v.index_select(0, idx.reshape(-1)).view(rows, k, -1) + u.unsqueeze(-2)
    lse = masked_logsumexp(z, neg.unsqueeze(-2))  # −finfo.max without a negative: loss 0
    term = _angular_term(lse, cos_ar.gather(-1, idx), valid.to(cd), t, twice=True)
    return _angular_loss(batch, scatter_rows(term, listed, cos_ar), pos)


def _exp_below_max(x: Tensor, mask: Tensor, room: float) -> tuple[Tensor, Tensor, Tensor]:
    """``([mask]·e^{x − shift}, shift, has_any)`` with ``shift = max − room``, the maximum
    (detached, ``(R, 1)``) over each row's masked entries, 0 for a row without any
    (``has_any`` false; a NaN row has: it stays NaN); the entries off the mask are exactly 0
    (their exponent is never taken above ``room``)."""
    low = torch.finfo(x.dtype).min
    x_max = torch.where(mask > 0, x, low).amax(-1, keepdim=True)
    has_any = ~(x_max <= low)
    shift = torch.where(has_any, x_max - room, 0.0).detach()
    return mask * torch.exp(torch.where(mask > 0, x - shift, -100.0)), shift, has_any


def _angular_loss(batch: Batch, losses: Tensor, pos: Tensor) -> dict[str, Terms]:
    """The ``(rows, M)`` pair terms weighted by the positive pairs (0 when an
    ``indices_tuple`` lists no pair of a kind, as in PML)."""
    weights = pos
    if batch.indices_tuple is not None:  # PML: 0 when the tuple lists no pair of a kind
        has_p, has_n = batch.any_pairs()
        weights = weights * (has_p & has_n).to(pos.dtype)
    return {"loss": DenseTerms(losses, weights, "pos_pair", batch.num_anchors)}


def _angular_term(
    lse: Tensor,
    cos_ap: Tensor,
    keep: Tensor,
    t: float | Tensor,
    *,
    twice: bool = False,
) -> Tensor:
    """``log(1 + e^f)`` with ``f = lse − 2(1 + t) x̂_a·x̂_p`` (``lse`` the log-sum-exp over the
    anchor's negatives), times the 0/1 float ``keep`` (not a ``where``: no bool mask for a
    compiled backward to save, see :func:`~pmlfunc._ops.indicator`; ``f`` is finite off
    ``keep`` for finite inputs), for whole matrices or listed pairs alike. ``twice``: ``lse``
    may be ``−finfo.max`` (:func:`~pmlfunc._ops.logaddexp`)."""
    f = lse - (2 * (1 + t)) * cos_ap
    return logaddexp(f, f.new_zeros(()), twice=twice) * keep


def instance(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    gamma: float | Tensor = 64,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Instance loss (PML's form): cross entropy of the scaled cosine-similarity rows.

    With ``c_i`` the rank of ``labels_i`` among the distinct labels (PML's
    ``unique(return_inverse=True)``, computed here by a sort: no host sync) and scale ``γ``:

    .. math::
        \ell_i = -\log \frac{e^{γ s_{i c_i}}}{\sum_{j=1}^{B} e^{γ s_{ij}}}

    over every column, the anchor's own included: as in PML, the target is *column* ``c_i`` of the
    batch's similarity matrix (with distinct labels ``0..B−1`` in order, each sample's own).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required).
        gamma: ``γ`` (default ``64``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``ref_emb``,
            ``ref_labels`` and ``indices_tuple`` (a ``ValueError``, as in PML); ``distance``:
            ``cosine()`` only (PML asserts ``CosineSimilarity``); ``reducer``: default
            ``mean()`` over the samples.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.instance(emb, labels, gamma=32)

    Reference: Zheng et al., "Dual-Path Convolutional Image-Text Embeddings with Instance
    Loss", ACM TOMM 2020.
    """
    return spec(instance)(embeddings, labels, inputs, gamma=gamma)


@batch_loss(
    instance,
    distance=cosine(),
    reducer=mean(),
    refuses=("ref_emb", "ref_labels", "indices_tuple"),
    needs_labels=True,
    distance_rule=_COSINE,
    exact_ties=False,
)
def _instance_terms(batch: Batch, *, gamma) -> dict[str, Terms]:
    gamma = _checks.hyper(gamma, "gamma")
    z = batch.scaled_similarity(gamma)
    assert batch.all_labels is not None  # needs_labels
    target = _dense_rank(batch.all_labels)
    if batch.rows is not None:
        target = target[batch.rows[0] : batch.rows[1]]
    return {"loss": elements(cross_entropy(z, target))}


def _dense_rank(labels: Tensor) -> Tensor:
    """Each label's rank among the distinct labels (``unique(return_inverse=True)[1]``; that
    itself where the values can be read, :func:`~pmlfunc._ops.readable`: one op, not five)."""
    if readable(labels):
        return torch.unique(labels, return_inverse=True)[1]
    s, order = labels.sort()
    rank = F.pad((s[1:] != s[:-1]).cumsum(0), (1, 0))  # of the sorted labels
    return torch.empty_like(rank).scatter_(0, order, rank)


def ranked_list(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    margin: float | Tensor,
    Tn: float | Tensor,
    imbalance: float | Tensor = 0.5,
    alpha: float | Tensor | None = None,
    Tp: float | Tensor = 0,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Ranked list loss: positives beyond ``α − m`` and negatives within ``α``, each weighted.

    Per anchor ``i`` with distances ``d`` (the rule is applied to the matrix as given, also for a
    similarity, as PML does), ``P*`` the positives with ``d > α − m`` and ``N*`` the negatives
    with ``d < α`` (entries with ``d ≤ 0`` never count, as in PML), ``M`` columns:

    .. math::
        L_P = \frac{\sum_{j \in P^*} w_j (d_{ij} - (α - m))}{\sum_{j \in P^*} w_j + 10^{-5} M},
        \quad w_j = e^{T_p (d_{ij} - (α - m))}

    .. math::
        L_N = \frac{\sum_{j \in N^*} w_j (α - d_{ij})}{\sum_{j \in N^*} w_j + 10^{-5} M},
        \quad w_j = e^{T_n (α - d_{ij})}

    and ``ℓ_i = (1 − λ) L_P + λ L_N`` with ``λ = imbalance``. The weights are differentiated
    too, as in PML.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required).
        margin: ``m`` (required, as in PML).
        Tn: negative temperature ``T_n`` (required, as in PML).
        imbalance: ``λ`` in ``[0, 1]`` (default ``0.5``).
        alpha: ``α`` (default ``None``: ``1 + m/2``).
        Tp: positive temperature ``T_p`` (default ``0``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``ref_emb``,
            ``ref_labels`` and ``indices_tuple`` (a ``ValueError``, as in PML); ``distance``:
            default ``lp()``; ``reducer``: default ``mean()`` over anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.ranked_list(emb, labels, margin=0.4, Tn=10.0)

    Reference: Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019.
    """
    return spec(ranked_list)(
        embeddings, labels, inputs, margin=margin, Tn=Tn, imbalance=imbalance, alpha=alpha, Tp=Tp
    )


@batch_loss(
    ranked_list,
    distance=lp(),
    reducer=mean(),
    refuses=("ref_emb", "ref_labels", "indices_tuple"),
    needs_labels=True,
)
def _ranked_list_terms(batch: Batch, *, margin, Tn, imbalance, alpha, Tp) -> dict[str, Terms]:
    margin = _checks.hyper(margin, "margin")
    Tn = _checks.hyper(Tn, "Tn")
    Tp = _checks.hyper(Tp, "Tp")
    imbalance = _checks.hyper(imbalance, "imbalance")
    if isinstance(imbalance, float) and not 0.0 <= imbalance <= 1.0:
        raise ValueError(f"imbalance must be in [0, 1], got {imbalance}")
    alpha = 1 + margin / 2 if alpha is None else _checks.hyper(alpha, "alpha")
    d = batch.mat
    margin, Tn, Tp, imbalance, alpha = (
        scalar_like(v, d) for v in (margin, Tn, Tp, imbalance, alpha)
    )
    pos, neg = batch.masks
    low = alpha - margin
    above = (d > 0).to(d.dtype)
    sel_p = pos * (d > low).to(d.dtype) * above
    sel_n = neg * (d < alpha).to(d.dtype) * above
    gap_p, gap_n = d - low, alpha - d
    w_p = sel_p * torch.exp(torch.where(sel_p > 0, Tp * gap_p, 0.0))
    w_n = sel_n * torch.exp(torch.where(sel_n > 0, Tn * gap_n, 0.0))
    pad = 1e-5 * batch.shape[1]  # PML: sum(w + 1e-5) over every column
    loss_p = (w_p * gap_p).sum(-1) / (w_p.sum(-1) + pad)
    loss_n = (w_n * gap_n).sum(-1) / (w_n.sum(-1) + pad)
    return {"loss": elements((1 - imbalance) * loss_p + imbalance * loss_n)}


def manifold(
    embeddings: Tensor,
    labels: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
    *,
    lambdaC: float | Tensor = 1.0,
    alpha: float | Tensor = 0.8,
    margin: float | Tensor = 5e-4,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple: Tensor | None = None,
    generator: torch.Generator | Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> Tensor:
    r"""Manifold (ensemble manifold similarity with hard proxies) loss.

    With the batch's ``N`` embeddings and the ``K`` proxies stacked (``n = N + K`` nodes), the
    affinities ``S_{ij} = e^{2 \max(s_{ij}, 0)}`` (``S_{ii} = 0``), ``\bar S = D^{-1/2} S D^{-1/2}``
    and the random-walk similarity ``F = (1 − α)(I − α\bar S)^{-1}``, each sample ``i`` with
    meta-class (proxy) ``c_i``:

    .. math::
        \ell^{int}_i = \log\Big(1 + \sum_{k \ne c_i,\; x_{ik} \ge 0} e^{x_{ik}}\Big),
        \quad x_{ik} = F_{ik} - F_{ic_i} + m

    over the proxy columns ``k`` of ``F``, and ``ℓ^{ctx}_i`` the same with
    ``x_{ik} = \cos(F_i, F_k) - \cos(F_i, F_{c_i}) + m`` (cosines of whole rows of ``F``).
    ``L = mean(ℓ^{int}) + λ_C mean(ℓ^{ctx})``. With ``lambdaC=math.inf`` only the context loss
    is used (PML 2.9.0 multiplies it by ``inf``).

    Meta-classes: ``indices_tuple`` (PML's convention: an ``(N,)`` integer tensor of proxy
    indices), else drawn from ``generator`` (required then) as PML does: every proxy once plus
    ``N − K`` uniform draws, shuffled (needs ``N ≥ K``); the draws are counter-based
    (``pmlfunc._random``), not PML's global RNG, so only the distribution matches PML.

    The inverse is taken in the compute dtype (PML 2.9.0 inverts in float32 even for float64
    input). PML returns an already-reduced value and ignores its reducer: here ``ℓ^{int}`` and
    ``λ_C ℓ^{ctx}`` are per-sample terms whose default reducer ``mean()`` gives ``L``.

    Args:
        embeddings: ``(N, D)`` float tensor.
        labels: must be ``None`` (PML: labels are not supported).
        params: ``{"proxies": (K, D)}`` from :func:`manifold_init`.
        lambdaC: ``λ_C ≥ 0`` (default ``1``).
        alpha: random-walk parameter ``α`` in ``(0, 1)`` (default ``0.8``).
        margin: ``m`` (default ``5e-4``).
        distance: default ``cosine()``.
        reducer: default ``mean()`` (see above).
        ref_emb, ref_labels: not supported (``ValueError``, as in PML).
        indices_tuple: optional ``(N,)`` meta-class indices in ``[0, K)``.
        generator: a ``torch.Generator`` or a 0-d integer seed tensor, for the meta-classes.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = pf.losses.manifold_init(4, num_proxies=3, generator=torch.Generator().manual_seed(0))
        >>> emb = torch.randn(8, 4)
        >>> loss = pf.losses.manifold(emb, None, params, generator=torch.Generator().manual_seed(1))

    Reference: Aziere and Todorovic, "Ensemble Deep Manifold Similarity Learning using Hard
    Proxies", CVPR 2019.
    """
    refuse("manifold", {"ref_emb": ref_emb, "ref_labels": ref_labels}, ("ref_emb", "ref_labels"))
    if labels is not None:
        raise ValueError("manifold does not take labels (PML: labels are not supported)")
    _checks.embeddings(embeddings)
    proxies = _params.check(params, "proxies", embeddings)
    lam = _checks.hyper(lambdaC, "lambdaC", nonnegative=True)
    alpha = _checks.hyper(alpha, "alpha")
    margin = _checks.hyper(margin, "margin")
    distance = resolve(distance, cosine())
    n, k = embeddings.shape[0], proxies.shape[0]
    meta = _meta_classes(indices_tuple, generator, n, k, embeddings.device)
    cd = _checks.compute_dtype(embeddings.dtype)
    nodes = torch.cat([embeddings.to(cd), proxies.to(cd)])
    s = torch.exp(distance.matrix(nodes).clamp_min(0.0) / 0.5)
    eye = torch.eye(n + k, dtype=cd, device=s.device)
    s = s - s * eye
    d_inv_half = s.sum(-1).pow(-0.5)
    s_bar = d_inv_half.unsqueeze(-1) * s * d_inv_half
    a = scalar_like(alpha, s)
    # inv_ex: linalg.inv reads its error code on the host (a sync that CUDA-graph capture
    # refuses); eye − a·s_bar is invertible for 0 ≤ a < 1 (s_bar's spectral radius is ≤ 1)
    f = (1 - a) * torch.linalg.inv_ex(eye - a * s_bar)[0]
    f_e, f_p = f[:n], f[n:]
    own = F.one_hot(meta, k).to(cd)
    m = scalar_like(margin, s)
    terms: dict[str, Terms] = {}
    if not (isinstance(lam, float) and lam == math.inf):
        terms["loss_int"] = elements(_manifold_part(f_e[:, n:], own, m))
    eps = 1e-8  # F.cosine_similarity's
    e_hat = f_e / torch.linalg.vector_norm(f_e, dim=-1, keepdim=True).clamp_min(eps)
    p_hat = f_p / torch.linalg.vector_norm(f_p, dim=-1, keepdim=True).clamp_min(eps)
    ctx = _manifold_part(matmul(e_hat, p_hat.transpose(-1, -2)), own, m)
    if isinstance(lam, float) and lam == math.inf:
        terms["loss_ctx"] = elements(ctx)
    else:
        terms["loss_ctx"] = elements(scalar_like(lam, ctx) * ctx)
    loss = reduce(
        mean() if reducer is None else reducer, terms, None, _checks.compute_dtype(embeddings.dtype)
    )
    return regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)


def _manifold_part(x: Tensor, own: Tensor, margin: float | Tensor) -> Tensor:
    """Per row ``log(1 + Σ_{k ≠ own, x_k − x_own + m ≥ 0} e^{x_k − x_own + m})``."""
    z = x - (x * own).sum(-1, keepdim=True) + margin
    keep = (1.0 - own) * (z.detach() >= 0).to(z.dtype)
    return torch.logaddexp(masked_logsumexp(z, keep), z.new_zeros(()))


def _meta_classes(indices_tuple, generator, n: int, k: int, device) -> Tensor:
    """The ``(N,)`` meta-class of each sample: given, or drawn as PML does (see :func:`manifold`)."""
    if indices_tuple is not None:
        t = indices_tuple
        if not isinstance(t, Tensor):
            raise TypeError(
                "manifold's indices_tuple is the (N,) tensor of meta-classes (PML's convention), "
                f"got {type(t).__name__}"
            )
        if tuple(t.shape) != (n,):
            raise ValueError(
                f"indices_tuple (meta-classes) must have shape ({n},), got {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"indices_tuple is on {t.device} but embeddings are on {device}")
        return _checks.index(t, k, "indices_tuple (meta-classes, one per proxy)").long()
    if n < k:
        raise ValueError(
            f"manifold draws every proxy at least once: needs batch size >= number of proxies, "
            f"got {n} < {k} (or pass indices_tuple)"
        )
    seed = _random.seed_tensor(generator, device)
    return manifold_meta_classes(seed, n, k)


def manifold_meta_classes(seed: Tensor, n: int, k: int) -> Tensor:
    """The meta-classes :func:`manifold` draws from a 0-d int64 ``seed``: ``arange(K)`` and
    ``N − K`` uniform proxy indices, shuffled (PML's scheme, counter-based draws).

    Example:
        >>> meta = pf.losses.manifold_meta_classes(torch.tensor(7), 6, 3)
        >>> sorted(set(meta.tolist())), meta.shape  # every proxy at least once
        ([0, 1, 2], torch.Size([6]))
    """
    draws = _random.uniform(seed, 0, (n - k,)).mul(k).floor().long().clamp_max(k - 1)
    meta = torch.cat([torch.arange(k, device=seed.device), draws])
    perm = _random.uniform(seed, 1, (n,)).argsort()
    return meta[perm]


def manifold_init(
    embedding_size: int,
    num_proxies: int = 50,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`manifold`: ``{"proxies": (K, D)}`` with ``N(0, 1)`` entries (PML's
    ``ManifoldLoss(l, K=50)``: ``torch.randn(K, l)``; same seed, same values).

    Example:
        >>> pf.losses.manifold_init(4, num_proxies=3)["proxies"].shape
        torch.Size([3, 4])
    """
    shape = (
        _checks.integer(num_proxies, "num_proxies"),
        _checks.integer(embedding_size, "embedding_size"),
    )
    return {"proxies": _params.init_normal(shape, generator=generator, dtype=dtype, device=device)}
