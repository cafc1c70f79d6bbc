"""Ranking and histogram losses: FastAP, Histogram, Smooth-AP, PNP, Dynamic Soft Margin.

These losses score a whole ranking or a whole distribution, so none of them splits over anchor
rows (:mod:`pmlfunc.chunked`). Nothing of size ``B × M × M`` lives at once:

- ``fast_ap`` and ``histogram`` bin each matrix entry into its two neighbouring histogram nodes
  (the triangular kernel is non-zero there only): ``O(B·M)`` memory, where PML builds a
  ``(bins + 1) × B × B`` pulse tensor.
- ``smooth_ap`` and ``pnp`` need ``Σ_k σ((s_ak − s_aj)/τ)`` for the pairs ``(a, j)`` they score
  (``j`` a positive of ``a``, or ``a`` itself); a sigmoid has no prefix-sum form, so the
  ``K × M`` block of each anchor is computed in anchor chunks by a custom autograd function
  whose backward recomputes the chunk: ``O(B·K·M)`` time, ``O(chunk·K·M)`` memory, with ``K``
  the listed positives per anchor on a CPU in eager mode (:func:`~pmlfunc._ops.sparse_rows`)
  and ``K = M`` on the static path (PML keeps several ``B × B × B`` tensors alive).
- ``dynamic_soft_margin`` never enumerates triplets: per anchor the negatives are sorted once and
  every (anchor, positive) pair finds, by binary search, the negatives that fall in each
  histogram bin of ``d_ap − d_an``; counts and prefix sums give the histogram and the loss:
  ``O(B·M·(bins + log M))`` instead of ``O(B·P·N)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._inputs import matrix
from .._ops import (
    apply,
    argsort_rows,
    bin_floor,
    einsum,
    indicator,
    matmul,
    ratio,
    scalar_like,
    sparse_rows,
)
from ..distances import Distance, _Lp, cosine, lp, resolve
from ..labels import PairMasks
from ..reducers import AlreadyReduced, DenseTerms, Reducer, Terms, mean
from ..tuples import (
    TripletMask,
    TripletWindow,
    as_triplets,
    cube_chunk,
    ordered_keys,
    sample_weights,
)
from ._batch import Batch, BatchInputs, batch_loss, prepare, spec
from ._regularize import regularize

__all__ = [
    "dynamic_soft_margin",
    "dynamic_soft_margin_init_state",
    "fast_ap",
    "histogram",
    "pnp",
    "smooth_ap",
]

_L2 = ("lp(p=2, normalize=True, power=...)", lambda d: d.kind == "lp" and d.p == 2 and d.normalize)
_WHOLE_ROWS = "it ranks each anchor's row against the labels of the whole batch"


class _SigmoidRanks(torch.autograd.Function):
    r"""``R[q, a, l] = Σ_k W[q, a, k] · σ((s_ak − s_aj) / τ)`` with ``j = cols[a, l]``: for every
    ``(a, j)`` when ``cols`` is ``None``, else for each anchor's listed columns only.

    ``clamp`` (or ``None``) bounds ``(s_ak − s_aj) / τ`` to ``[−clamp, clamp]`` before the
    sigmoid, with a zero derivative outside (PNP's temperature-controlled sigmoid). Anchors are
    processed in chunks of ``chunk`` rows, forward and (recomputing) backward, so only a
    ``chunk × K × M`` block exists at a time (``K``: ``M``, or the listed columns per anchor).
    ``W`` holds constant 0/1 weights (no gradient); ``tau`` may be a 0-d tensor and then gets
    its gradient.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(s: Tensor, w: Tensor, tau, clamp, chunk: int, cols: Tensor | None) -> Tensor:
        out = []
        for r0 in range(0, s.shape[-2], chunk):
            z = _SigmoidRanks._scaled_differences(s, tau, cols, r0, r0 + chunk)
            if clamp is not None:
                z.clamp_(-clamp, clamp)
            out.append(einsum("ajk,qak->qaj", z.sigmoid_(), w[:, r0 : r0 + chunk]))
        return torch.cat(out, dim=-2)

    @staticmethod
    def _scaled_differences(s: Tensor, tau, cols: Tensor | None, r0: int, r1: int) -> Tensor:
        """``z[a, l, k] = (s_ak − s_aj) / τ``, ``j = cols[a, l]``, for the anchors ``r0:r1``."""
        rows = s[r0:r1]
        targets = rows if cols is None else rows.gather(-1, cols[r0:r1])
        return (rows.unsqueeze(-2) - targets.unsqueeze(-1)) / tau

    @staticmethod
    def setup_context(ctx, inputs, output):
        s, w, tau, clamp, chunk, cols = inputs
        ctx.clamp, ctx.chunk = clamp, chunk
        ctx.tau_is_tensor = isinstance(tau, Tensor)
        if ctx.tau_is_tensor:
            ctx.save_for_backward(s, w, cols, tau)
        else:
            ctx.tau = tau
            ctx.save_for_backward(s, w, cols)

    @staticmethod
    def backward(ctx, g):
        if ctx.tau_is_tensor:
            s, w, cols, tau = ctx.saved_tensors
        else:
            (s, w, cols), tau = ctx.saved_tensors, ctx.tau
        want_tau = ctx.tau_is_tensor and ctx.needs_input_grad[2]
        grads, grad_tau = [], None
        for r0 in range(0, s.shape[-2], ctx.chunk):
            r1 = r0 + ctx.chunk
            z = _SigmoidRanks._scaled_differences(s, tau, cols, r0, r1)
            if ctx.clamp is None:
                sig = z.sigmoid()
                slope = sig * (1 - sig)  # σ'
            else:  # σ' inside the clamp, 0 outside
                zc = z.clamp(-ctx.clamp, ctx.clamp)
                slope = torch.ops.aten.sigmoid_backward((zc == z).to(z.dtype), zc.sigmoid())
            # R[q,a,l] = Σ_k w[q,a,k] σ(z[a,l,k]), z = (s_ak − s_aj)/τ: with g/τ on each (q,a,l),
            # s_ak gets Σ_q w[q,a,k] Σ_l (g/τ)[q,a,l] σ'[a,l,k]; s_aj its (a,l) row's sum, negated.
            gt = g[:, r0:r1] / tau
            w_rows = w[:, r0:r1]
            to_rows = (w_rows * einsum("qal,alk->qak", gt, slope)).sum(0)
            to_targets = (gt * einsum("alk,qak->qal", slope, w_rows)).sum(0)
            if cols is None:
                grads.append(to_rows - to_targets)
            else:
                grads.append(to_rows.scatter_add(-1, cols[r0:r1], -to_targets))
            if want_tau:  # ∂z/∂τ = −z/τ (the 1/τ is in gt)
                part = -(gt * einsum("alk,qak->qal", slope * z, w_rows)).sum()
                grad_tau = part if grad_tau is None else grad_tau + part
        return torch.cat(grads, dim=-2), None, grad_tau, None, None, None


def sigmoid_ranks(
    s: Tensor, w: Tensor, tau, clamp: float | None = None, cols: Tensor | None = None
) -> Tensor:
    r"""``R[q, a, l] = Σ_k w[q, a, k] σ((s_ak − s_aj)/τ)``, ``j = cols[a, l]`` (every column
    ``j = l`` when ``cols`` is ``None``), in anchor chunks (see :class:`_SigmoidRanks`): ``s``
    is ``(B, M)``, ``w`` ``(Q, B, M)`` constant weights, ``cols`` a ``(B, K)`` index (each
    anchor's listed columns, :func:`~pmlfunc._ops.sparse_rows`), the result ``(Q, B, M)`` or
    ``(Q, B, K)``. Time ``O(B·K·M)``, memory ``O(chunk·K·M)`` in both directions."""
    width = None if cols is None else cols.shape[-1]
    chunk = cube_chunk(s.shape[-1], s.device, width)
    return apply(_SigmoidRanks, s, w.detach(), scalar_like(tau, s), clamp, chunk, cols)


def fast_ap(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    num_bins: int = 10,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""FastAP: one minus a histogram-binned average precision per anchor.

    Distances ``d`` (in ``[0, 2^{power}]`` for unit rows) are soft-assigned to ``K + 1`` nodes
    ``z_e = e·Δ``, ``Δ = 2^{power}/K``, by the triangular kernel ``δ(d, e) = [1 − |d − z_e|/Δ]_+``.
    Per anchor ``a`` with positives ``P_a`` and negatives ``N_a``:

    .. math::
        h^+_e = \sum_{p \in P_a} δ(d_{ap}, e),\quad h_e = h^+_e + \sum_{n \in N_a} δ(d_{an}, e),
        \quad \ell_a = w_a \Big(1 - \frac{1}{|P_a|}\sum_e \frac{h^+_e H^+_e}{H_e}\Big)

    with cumulative ``H^+_e = Σ_{e' ≤ e} h^+_{e'}``, ``H_e = Σ_{e' ≤ e} h_{e'}``; ``w_a`` is the
    miner weight (the anchor's count in ``indices_tuple`` over the largest count; 1 without one).
    Anchors without positives are left out. Each distance touches two nodes only, so the
    histograms are built by a scatter from the ``B × M`` matrix (PML builds a
    ``(K + 1) × B × B`` tensor).

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required: pairs always come from the labels).
        num_bins: ``K`` (default ``10``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`): ``ref_emb`` and
            ``ref_labels`` a reference set to rank (PML does not support one); an
            ``indices_tuple`` only weights the anchors (PML's ``convert_to_weights``); ``distance``:
            default ``lp(power=2)``; must be ``lp(p=2, normalize=True)`` (any power);
            ``reducer``: default ``mean()`` over the anchors with positives.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.fast_ap(emb, labels, num_bins=10)

    Reference: Cakir et al., "Deep Metric Learning to Rank", CVPR 2019.
    """
    return spec(fast_ap)(embeddings, labels, inputs, num_bins=num_bins)


@batch_loss(
    fast_ap,
    distance=lp(power=2),
    reducer=mean(),
    needs_labels=True,
    distance_rule=_L2,
    unchunkable=_WHOLE_ROWS,
)
def _fast_ap_terms(batch: Batch, *, num_bins) -> dict[str, Terms]:
    num_bins = _checks.integer(num_bins, "num_bins")
    d = batch.mat
    pos, neg = batch.label_masks()
    delta = 2.0 ** cast(_Lp, batch.distance).power / num_bins  # (_L2 admits lp() only)
    # Triangular kernel: node floor(t) and the next one (t = d/Δ), exactly PML's pulses there.
    t = d / delta
    low = bin_floor(t, 0, num_bins - 1)
    w_low = F.relu(1 - (t - low).abs())
    w_high = F.relu(1 - (t - low - 1).abs())
    idx = low.long()

    def hist(mask: Tensor) -> Tensor:
        out = torch.zeros(d.shape[0], num_bins + 1, dtype=d.dtype, device=d.device)
        return out.scatter_add(-1, idx, w_low * mask).scatter_add(-1, idx + 1, w_high * mask)

    h_pos, h_neg = hist(pos), hist(neg)
    cum_pos = torch.cumsum(h_pos, -1)
    cum_all = torch.cumsum(h_pos + h_neg, -1)
    prod = h_pos * cum_pos
    safe = (prod != 0) & (cum_all != 0)  # NaN stays NaN: a non-finite input is never "empty"
    ap_sum = torch.where(safe, prod / torch.where(safe, cum_all, 1.0), 0.0).sum(-1)
    n_pos = pos.sum(-1)
    losses = 1 - ap_sum / n_pos.clamp_min(1)
    mw = sample_weights(batch.indices_tuple, d.shape[0], d.dtype, d.device)
    if mw is not None:
        losses = losses * mw
    has_pos = (n_pos > 0).to(d.dtype)
    return {"loss": DenseTerms(losses, has_pos, "element", d.shape[0])}


def histogram(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    n_bins: int | None = None,
    delta: float | None = None,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Histogram loss: the probability that a random negative pair is more similar than a random
    positive pair, estimated from soft histograms.

    The distinct (unordered) positive pairs ``S^+`` and negative pairs ``S^-`` of the batch's
    triplets (all triplets from the labels, or those of ``indices_tuple``; PML's
    ``convert_to_triplets`` then ``filter_pairs``) are binned on the nodes ``t_r = −1 + rΔ``,
    ``r = 0..R`` (``R = 2/Δ``) by linear interpolation:

    .. math::
        p^±_r = \frac{1}{|S^±|}\sum_{(i,j) \in S^±} [1 - |s_{ij} - t_r|/Δ]_+,\qquad
        L = \sum_r p^-_r \sum_{q \le r} p^+_q

    Pairs are held as upper-triangular ``B × B`` masks (no index lists, no ``unique``). A
    similarity of exactly 1 (duplicates, rounding) falls on the last node; PML indexes past the
    end there and raises.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` with an ``indices_tuple``).
        n_bins: number of bins ``R`` (default ``100`` when ``delta`` is not given).
        delta: bin width ``Δ``, dividing 2 (nodes short of +1 would extrapolate: a
            "probability" above 1; a ``ValueError``, where PML fails); if both are given,
            ``delta == 2 / n_bins`` is required.
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``ref_emb`` and
            ``ref_labels`` (as in PML); ``distance``:
            default ``cosine()``: a similarity in ``[−1, 1]`` (``cosine()`` or ``dot(normalize=True)``;
            any other distance is a ``ValueError``, where its values fell outside the bins and
            gave a "probability" of 16 or 104); ``reducer``: must be
            ``None``: the loss is already reduced (PML ignores any reducer).

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype (0 when there is no triplet).

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.histogram(emb, labels, n_bins=50)

    Reference: Ustinova and Lempitsky, "Learning Deep Embeddings with Histogram Loss",
    NeurIPS 2016.
    """
    return spec(histogram)(embeddings, labels, inputs, n_bins=n_bins, delta=delta)


@batch_loss(
    histogram,
    distance=cosine(),
    reducer=None,
    refuses=("ref_emb", "ref_labels"),
    unchunkable="it is one distribution over the whole batch's pairs",
)
def _histogram_terms(batch: Batch, *, n_bins, delta) -> dict[str, Terms]:
    if n_bins is not None:
        n_bins = _checks.integer(n_bins, "n_bins")
    if delta is not None:
        delta = _checks.number(delta, "delta", positive=True)
        if n_bins is not None and delta != 2 / n_bins:
            raise ValueError(
                f"delta and n_bins must satisfy delta = 2/n_bins, got {delta}, {n_bins}"
            )
    if delta is None:
        delta = 2 / (100 if n_bins is None else n_bins)
    dist = batch.distance
    if not (dist.is_similarity and getattr(dist, "normalize", False)):
        raise ValueError(
            "histogram's bins cover similarities in [-1, 1]: distance must be cosine() or "
            f"dot(normalize=True), got {dist!r}"
        )
    bins = 2 / delta
    if abs(bins - round(bins)) > 1e-9 * bins:  # nodes short of +1 would extrapolate (PML: fails)
        raise ValueError(
            f"delta must divide 2 (the nodes -1, -1 + delta, ..., 1; delta = 2/n_bins), got {delta}"
        )
    size = round(1 + bins)
    if size < 2:
        raise ValueError(f"delta={delta} gives fewer than two histogram nodes")
    s = batch.mat
    pos, neg = (indicator(m) for m in batch.masks)  # 0/1 floats (no bool masks to save)
    # convert_to_triplets: a listed pair is in a triplet when its anchor has a pair of the other
    # kind (true for label triplets and for mined pairs sharing an anchor).
    pos, neg = pos * neg.amax(-1, keepdim=True), neg * pos.amax(-1, keepdim=True)
    b, m = pos.shape
    rows, cols = torch.arange(b, device=s.device), torch.arange(m, device=s.device)
    upper = indicator((cols - rows.unsqueeze(-1)).to(s.dtype), strict=False)  # j ≥ i
    pos_u = torch.maximum(pos, pos.t()) * upper  # filter_pairs: sorted, unique pairs
    neg_u = torch.maximum(neg, neg.t()) * upper
    t = (s + 1) / delta
    r = bin_floor(t, 0, size - 2)
    a = t - r  # weight of node r + 1
    idx = r.long().reshape(-1)
    a, b = a.reshape(-1), (1 - a).reshape(-1)

    def density(mask: Tensor) -> Tensor:
        m = mask.reshape(-1)
        out = torch.zeros(size, dtype=s.dtype, device=s.device)
        out = out.scatter_add(0, idx + 1, a * m).scatter_add(0, idx, b * m)
        return out / m.sum().clamp_min(1)

    loss = (density(neg_u) * torch.cumsum(density(pos_u), 0)).sum()
    return {"loss": AlreadyReduced(loss)}


def smooth_ap(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.01,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Smooth-AP: one minus a sigmoid-relaxed average precision per anchor.

    With similarity ``s`` (a distance enters as ``−d``), ``σ_τ(x) = σ(x/τ)`` and ``G_a`` the
    samples sharing the anchor's label, the anchor itself included (as in the paper's and PML's
    code):

    .. math::
        \ell_a = w_a\Big(1 - \frac{1}{|G_a|}\sum_{l \in G_a}
            \frac{1 + \sum_{k \in G_a, k \ne l} σ_τ(s_{ak} - s_{al})}
                 {1 + \sum_{k \ne l} σ_τ(s_{ak} - s_{al})}\Big)

    ``w_a`` is the miner weight (PML's ``convert_to_weights``). The sums run over the
    ``|G_a| × M`` block of each anchor (``M × M`` on the static path: accelerators, compile), in
    anchor chunks with a recomputing backward (``O(chunk·|G_a|·M)`` memory; PML keeps several
    ``B × B × B`` tensors).

    PML 2.9.0 requires every class to have the same number ``m`` of samples (it raises
    otherwise) and, beyond that, silently groups the batch into consecutive blocks of
    ``C = #classes`` rows: it is right only for class-sorted batches with ``m == C``. pmlfunc
    uses the labels (any layout, any class sizes) and equals PML where PML is right.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required).
        temperature: ``τ`` (default ``0.01``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``ref_emb`` and
            ``ref_labels`` (as in PML); an ``indices_tuple`` only weights the anchors (PML's
            ``convert_to_weights``); ``distance``:
            default ``cosine()`` (PML accepts only cosine); ``reducer``: default ``mean()`` over
            anchors.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(9, 4), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
        >>> loss = pf.losses.smooth_ap(emb, labels, temperature=0.01)

    Reference: Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale Image
    Retrieval", ECCV 2020.
    """
    return spec(smooth_ap)(embeddings, labels, inputs, temperature=temperature)


@batch_loss(
    smooth_ap,
    distance=cosine(),
    reducer=mean(),
    refuses=("ref_emb", "ref_labels"),
    needs_labels=True,
    unchunkable=_WHOLE_ROWS,
)
def _smooth_ap_terms(batch: Batch, *, temperature) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    s = batch.similarity()
    pos, _ = batch.label_masks()
    group = pos.diagonal_scatter(pos.diagonal() + 1.0)  # G_a, self included
    weights = torch.stack([group, torch.ones_like(group)])
    listed = sparse_rows(group)  # the ranks of G_a's members only (CPU eager, small classes)
    if listed is None:
        ranks, in_group = sigmoid_ranks(s, weights, temperature), group
    else:
        idx, valid = listed
        ranks = sigmoid_ranks(s, weights, temperature, cols=idx)
        in_group = valid.to(s.dtype)
    # The k = l term is σ(0) = 1/2 in both sums (l ∈ G_a): remove it.
    rank_pos, rank_all = ranks[0] + 0.5, ranks[1] + 0.5
    ap = (in_group * rank_pos / rank_all).sum(-1) / group.sum(-1)
    losses = 1 - ap
    mw = sample_weights(batch.indices_tuple, s.shape[0], s.dtype, s.device)
    if mw is not None:
        losses = losses * mw
    return {"ap_loss": DenseTerms(losses, torch.ones_like(losses), "element", s.shape[0])}


_PNP_VARIANTS = ("Ds", "Dq", "Iu", "Ib", "O")


def pnp(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    b: float | Tensor = 2,
    alpha: float | Tensor = 1,
    anneal: float | Tensor = 0.01,
    variant: str = "O",
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""PNP loss: penalise, for each positive, the (smoothed) number of negatives ranked above it.

    With similarity ``s`` (a distance enters as ``−d``) and PML's clamped sigmoid
    ``σ_τ(x) = 1/(1 + e^{\mathrm{clamp}(−x/τ, −50, 50)})``, per anchor ``a`` with positives
    ``P_a`` (the anchor itself included) and negatives ``N_a``:

    .. math::
        r_{aj} = \sum_{k \in N_a} σ_τ(s_{ak} - s_{aj}),\qquad
        \ell_a = \frac{1}{|P_a|}\sum_{j \in P_a} f(r_{aj})

    ``f`` by ``variant``: ``"O"`` ``r``; ``"Ds"`` ``log(1 + r)``; ``"Dq"`` ``1 − (1 + r)^{−α}``
    (the ``1 −`` applied per anchor: the same mean); ``"Iu"`` ``(1 + r) log(1 + r)``; ``"Ib"``
    ``(b r − log(1 + b r))/b²``. Anchors without another positive are left out. The sums run over
    each anchor's ``P_a × M`` block (``M × M`` on the static path: accelerators, compile) in
    anchor chunks with a recomputing backward.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (required).
        b: the ``"Ib"`` slope (default ``2``).
        alpha: the ``"Dq"`` exponent (default ``1``).
        anneal: the temperature ``τ`` (default ``0.01``).
        variant: one of ``"Ds", "Dq", "Iu", "Ib", "O"`` (default ``"O"``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`) but ``ref_emb``,
            ``ref_labels`` and ``indices_tuple`` (as in PML); ``distance``:
            default ``cosine()`` (PML accepts only cosine); ``reducer``: default ``mean()`` over
            the anchors with positives, which is PML's (already-reduced) value; another reducer
            sees those per-anchor terms.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.pnp(emb, labels, variant="Dq")

    Reference: Li et al., "Rethinking the Optimization of Average Precision: Only Penalizing
    Negative Instances before Positive Ones is Enough", AAAI 2022.
    """
    return spec(pnp)(embeddings, labels, inputs, b=b, alpha=alpha, anneal=anneal, variant=variant)


@batch_loss(
    pnp,
    distance=cosine(),
    reducer=mean(),
    refuses=("ref_emb", "ref_labels", "indices_tuple"),
    needs_labels=True,
    unchunkable=_WHOLE_ROWS,
)
def _pnp_terms(batch: Batch, *, b, alpha, anneal, variant) -> dict[str, Terms]:
    if variant not in _PNP_VARIANTS:
        raise ValueError(f"variant={variant!r} but must be one of {list(_PNP_VARIANTS)}")
    b = _checks.hyper(b, "b", positive=True)
    alpha = _checks.hyper(alpha, "alpha")
    anneal = _checks.hyper(anneal, "anneal", positive=True)
    s = batch.similarity()
    pos, neg = batch.label_masks()
    has_pos = (pos.sum(-1) > 0).to(s.dtype)
    # PML: I_pos[a, a] = 1 for anchors with positives (diagonal_scatter: no (B, B) bool mask
    # for a compiled backward to save, see _ops.indicator)
    pos = pos.diagonal_scatter(pos.diagonal() + has_pos)
    count = pos.sum(-1)
    listed = sparse_rows(pos)  # the ranks of the positives only (CPU eager, small classes)
    if listed is None:
        rk = sigmoid_ranks(s, neg.unsqueeze(0), anneal, clamp=50.0)[0]
    else:
        idx, valid = listed
        rk = sigmoid_ranks(s, neg.unsqueeze(0), anneal, clamp=50.0, cols=idx)[0]
        pos = pos.gather(-1, idx) * valid
    if variant == "Ds":
        rk = torch.log1p(rk)
    elif variant == "Dq":
        rk = 1 / (1 + rk) ** scalar_like(alpha, rk)
    elif variant == "Iu":
        rk = (1 + rk) * torch.log1p(rk)
    elif variant == "Ib":
        bb = scalar_like(b, rk)
        rk = (bb * rk - torch.log1p(bb * rk)) / bb**2
    losses = (rk * pos).sum(-1) / count.clamp_min(1)
    if variant == "Dq":
        losses = 1 - losses
    return {"loss": DenseTerms(losses, has_pos, "element", s.shape[0])}


# ---------------------------------------------------------------------------------------------
# Dynamic Soft Margin
# ---------------------------------------------------------------------------------------------
def dynamic_soft_margin_init_state(
    num_bins: int = 10, *, dtype: torch.dtype = torch.float32, device=None
) -> dict[str, Tensor]:
    """The initial state of :func:`dynamic_soft_margin`: ``{"hist": zeros(num_bins)}`` (PML's
    ``hist_`` buffer; an all-zero histogram means "no batch seen yet").

    Example:
        >>> pf.losses.dynamic_soft_margin_init_state(10)["hist"].shape
        torch.Size([10])
    """
    num_bins = _checks.integer(num_bins, "num_bins", minimum=2)
    return {"hist": torch.zeros(num_bins, dtype=dtype, device=device)}


def _dsm_state(state: object, num_bins: int, like: Tensor) -> Tensor:
    if state is None:  # in the compute dtype: a running histogram kept in bf16 loses its tail
        return torch.zeros(num_bins, dtype=_checks.compute_dtype(like.dtype), device=like.device)
    if not isinstance(state, dict) or not isinstance(state.get("hist"), Tensor):
        raise TypeError(
            "state must be a dict {'hist': Tensor} from dynamic_soft_margin_init_state(...)"
        )
    hist = state["hist"]
    if tuple(hist.shape) != (num_bins,) or not hist.dtype.is_floating_point:
        raise ValueError(
            f"state['hist'] must be a float tensor of shape ({num_bins},) (num_bins), got "
            f"{hist.dtype} {tuple(hist.shape)}"
        )
    if hist.device != like.device:
        raise ValueError(f"state['hist'] is on {hist.device} but embeddings are on {like.device}")
    return hist


def _dsm_list(v: Tensor, w: Tensor, lo, delta, k: int):
    """Histogram and loss parts of explicitly listed values ``v = d_ap − d_an`` (weights ``w``)."""
    t = (v - lo) / delta
    tc = t.clamp(0, k - 1)
    i0 = bin_floor(tc, 0, k - 2)
    a = tc - i0
    i0 = i0.long()
    zero = torch.zeros(k, dtype=v.dtype, device=v.device)
    hist = zero.scatter_add(0, i0, w * (1 - a)).scatter_add(0, i0 + 1, w * a)
    seg = bin_floor(t, 0, k - 1).long()
    return hist, w.sum(), lambda cdf: (w * cdf[seg] * v).sum()


def _dsm_product(d: Tensor, pos: Tensor, neg: Tensor, lo, delta, k: int):
    """The same over every triplet ``(a, p, n)`` with weight ``pos[a, p] · neg[a, n]``, without
    enumerating them: one sort of each anchor's negatives, then for every (anchor, positive)
    the negatives with ``t = (d_ap − d_an − lo)/Δ ≥ j`` by binary search (``t ≥ j`` iff
    ``d_an ≤ d_ap − lo − jΔ``): their count ``N_j`` and sum of ``d_an`` ``S_j`` from prefix sums.

    Both the histogram and the loss are linear in the per-segment counts and sums, so they are
    written in the cumulative ``N_j``, ``S_j`` directly (summation by parts) and every
    ``(a, p)`` sum is taken once, as a contraction of the ``(B·M, K)`` tables with the weights
    ``pos`` and ``pos · d``: no per-segment ``(B, M, K + 1)`` tensors in either pass. Where
    the positives can be listed (:func:`~pmlfunc._ops.sparse_rows`), only their columns are
    searched and contracted: ``(B, P_max, K)`` instead of ``(B, M, K)``."""
    b = d.shape[0]
    key = torch.where(neg > 0, d.detach(), torch.finfo(d.dtype).max)
    order = argsort_rows(ordered_keys(key))  # ordered integers: the vectorised sort on CPU
    keys = key.gather(-1, order)
    dn, wn = d.gather(-1, order), neg.gather(-1, order)
    zero = d.new_zeros(b, 1)
    ccount = torch.cat([zero, wn.cumsum(-1)], -1)  # (B, M + 1)
    csum = torch.cat([zero, (wn * dn).cumsum(-1)], -1)
    listed = sparse_rows(pos)
    if listed is not None:  # only each anchor's positive columns (CPU eager, few positives)
        idx, valid = listed
        d_p, pos = d.gather(-1, idx), pos.gather(-1, idx) * valid
    else:  # every column (static shapes)
        d_p = d
    m = d_p.shape[-1]
    steps = torch.arange(k, dtype=d.dtype, device=d.device)
    bounds = d_p.detach().unsqueeze(-1) - lo - delta * steps  # (B, M, K): c_j = d_ap − lo − jΔ
    # Columns that are no positive weigh 0: a constant query makes their searches cheap
    # (predictable branches, one cache line), ~5× faster than searching their real bounds.
    bounds = torch.where((pos > 0).unsqueeze(-1), bounds, -torch.inf)
    at = torch.searchsorted(keys.contiguous(), bounds.detach().reshape(b, m * k), right=True)
    n_ge = ccount.gather(-1, at).view(b * m, k)  # N_j: negatives with t ≥ j
    s_ge = csum.gather(-1, at).view(b * m, k)  # S_j: their sum of d_an
    pos_d = pos * d_p
    a_n, d_n = matmul(torch.stack([pos, pos_d]).view(2, b * m), n_ge).unbind(0)  # Σ pos·N, ·d·N
    s_n = matmul(pos.reshape(1, b * m), s_ge)[0]  # Σ pos·S
    n_pos = pos.sum(-1)
    total = (n_pos * ccount[:, -1]).sum()  # Σ pos·N_total: the weight of every triplet
    d_tot = (pos_d.sum(-1) * ccount[:, -1]).sum()  # Σ pos·d·N_total
    s_tot = (n_pos * csum[:, -1]).sum()  # Σ pos·S_total

    def segments(tot: Tensor, ge: Tensor) -> Tensor:
        """Per segment (``t < 0``, ``[0, 1)``, ..., ``[K−2, K−1)``, ``t ≥ K−1``) from the
        cumulative values: ``(K + 1,)``."""
        return torch.cat([(tot - ge[0]).unsqueeze(0), ge[:-1] - ge[1:], ge[-1:]])

    cnt, ssum = segments(total, a_n), segments(s_tot, s_n)
    u_cnt = (segments(d_tot, d_n) - lo * cnt) / delta  # Σ pos·u·count, u = (d_ap − lo)/Δ
    inner = torch.arange(k - 1, dtype=d.dtype, device=d.device)
    # Σ over [j, j + 1) of (t − j): the share of node j + 1; the rest goes to node j.
    alpha = u_cnt[1:k] - inner * cnt[1:k] - ssum[1:k] / delta
    hist = F.pad(cnt[1:k] - alpha, (0, 1)) + F.pad(alpha, (1, 0))
    hist = hist + torch.cat([cnt[:1], cnt.new_zeros(k - 2), cnt[k:]])  # t < 0, t ≥ K − 1

    def loss_sum(cdf: Tensor) -> Tensor:
        # Σ pos Σ_segments (count·d_ap − sum)·cdf_segment, by parts: the cdf's steps meet N, S.
        step = cdf[1:] - cdf[:-1]
        return (d_tot - s_tot) * cdf[0] + (step * (d_n[1:] - s_n[1:])).sum()

    return hist, total, loss_sum


def dynamic_soft_margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    state: dict[str, Tensor] | None = None,
    *,
    min_val: float | Tensor = -2.0,
    num_bins: int = 10,
    momentum: float | Tensor = 0.01,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Dynamic Soft Margin loss: triplet differences weighted by their running CDF.

    Each triplet gives ``v = d_ap − d_an``. A ``K``-bin histogram over ``[min_val, −min_val]``
    (bin width ``Δ = 2|min_val|/K``, linear interpolation between the two nearest nodes) is
    updated with momentum ``μ`` (``μ = 1`` on the first batch, when the histogram is all zero)
    and renormalised; with its cumulative sum ``F``:

    .. math::
        h \leftarrow \frac{(1 - μ)h + μ \hat h}{\lVert (1 - μ)h + μ \hat h \rVert_1},\qquad
        L = \frac{1}{T}\sum_{(a,p,n)} F\big[\lfloor (v_{apn} - \mathrm{min\_val})/Δ \rfloor\big]
            \, v_{apn}

    Triplets: all from the labels (with a reference set: every query against every reference),
    or those of ``indices_tuple`` (pairs sharing an anchor, as PML's ``convert_to_triplets``).
    Without labels and tuple, row ``i`` of ``embeddings`` matches row ``i`` of ``ref_emb`` (or of
    the batch): ``d_pos = d_ii`` and ``d_neg`` the smallest other entry of row or column ``i``.
    All-triplet sets are never enumerated (see :func:`_dsm_product`).

    The running histogram is explicit state: pass the returned ``state`` to the next call. It is
    returned detached; within one call the gradient also flows through this batch's histogram
    contribution, as in PML. PML's module keeps the graph in its ``hist_`` buffer, so its second
    ``backward`` fails; values at ``K``-bin edges where PML indexes out of range (``v`` beyond
    ``min_val + (K−1)Δ`` raises, ``v < min_val`` wraps around) are clamped into the first/last
    bin here. Without labels and ``B ≠ M``, PML pads with ``|B − M|`` zero terms; pmlfunc uses
    the ``min(B, M)`` matched rows only.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids, or ``None`` (matched rows, see above).
        state: ``{"hist": (K,)}`` from :func:`dynamic_soft_margin_init_state` (``None``: a
            fresh one, in the compute dtype: float32 for float16/bfloat16 embeddings). The
            returned state keeps the dtype of the state given.
        min_val: lower end of the histogram range (default ``-2.0``).
        num_bins: ``K`` (default ``10``; at least 2).
        momentum: ``μ`` (default ``0.01``).
        distance: default ``lp()``; must be ``lp(p=2, normalize=True)``.
        reducer: must be ``None``: the value is the mean over triplets (PML ignores reducers).
        ref_emb, ref_labels: a separate reference set.
        indices_tuple: PML pairs or triplets, ``MinedPairs`` or ``MinedTriplets``.
        mat: a precomputed ``(B, M)`` matrix of ``distance``.

    Returns:
        ``(loss, new_state)``: a 0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype (0 without triplets; the
        state is then unchanged) and the updated state (the input state's dtype).

    Example:
        >>> state = pf.losses.dynamic_soft_margin_init_state(10)
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss, state = pf.losses.dynamic_soft_margin(emb, labels, state)

    Reference: Zhang and Rusinkiewicz, "Learning Local Descriptors with a CDF-Based Dynamic
    Soft Margin", ICCV 2019.
    """
    k = _checks.integer(num_bins, "num_bins", minimum=2)
    min_val = _checks.hyper(min_val, "min_val")
    momentum = _checks.hyper(momentum, "momentum")
    distance = resolve(distance, lp())
    if not _L2[1](distance):
        raise ValueError(f"dynamic_soft_margin needs distance={_L2[0]}, got {distance!r}")
    if reducer is not None:
        raise ValueError(
            "dynamic_soft_margin returns an already-reduced value (as in PML, which ignores its "
            "reducer); reducer must be None"
        )
    if isinstance(indices_tuple, (TripletWindow, TripletMask)):
        raise ValueError(
            "dynamic_soft_margin takes MinedPairs or MinedTriplets as indices_tuple; pass "
            "tuples_per_anchor to the miner (or result.to_indices() in eager mode)"
        )
    parts: tuple[Tensor, Tensor] | None  # listed values and their weights, or
    product: PairMasks | None  # the masks of all (a, p) × (a, n)
    if labels is None and indices_tuple is None:
        d, parts, product = _dsm_matched(embeddings, ref_emb, ref_labels, mat, distance)
    else:
        batch = prepare(
            embeddings,
            labels,
            distance=distance,
            ref_emb=ref_emb,
            ref_labels=ref_labels,
            indices_tuple=indices_tuple,
            mat=mat,
        )
        d, parts, product = batch.mat, None, batch.masks
        triplets = as_triplets(batch.indices_tuple)
        if triplets is not None:
            a, p, n = triplets.anchors.long(), triplets.positives.long(), triplets.negatives.long()
            parts, product = (d[a, p] - d[a, n], triplets.valid.to(d.dtype)), None
    hist_in = _dsm_state(state, k, embeddings)
    hist_old = hist_in.to(d.dtype)
    lo = scalar_like(min_val, d)
    delta = 2 * (lo.abs() if isinstance(lo, Tensor) else abs(lo)) / k
    if product is not None:
        h_batch, total, loss_sum = _dsm_product(d, product.pos, product.neg, lo, delta, k)
    else:
        assert parts is not None  # without a product: the listed values and their weights
        h_batch, total, loss_sum = _dsm_list(*parts, lo, delta, k)
    one = torch.ones((), dtype=d.dtype, device=d.device)
    mu = torch.where(hist_old.sum() != 0, one * scalar_like(momentum, d), one)
    new = (1 - mu) * hist_old + mu * h_batch
    norm = new.sum()
    new = ratio(new, norm.expand_as(new))
    new = torch.where(total > 0, new, hist_old)
    loss = ratio(loss_sum(torch.cumsum(new, 0)), total)
    loss = regularize(
        loss.to(_checks.compute_dtype(embeddings.dtype)),
        embeddings,
        embedding_regularizer,
        embedding_reg_weight,
    )
    return loss, {"hist": new.detach().to(hist_in.dtype)}


def _dsm_matched(
    embeddings, ref_emb, ref_labels, mat, distance
) -> tuple[Tensor, tuple[Tensor, Tensor], None]:
    """Without labels or tuple, row ``i`` matches row ``i``: ``v_i = d_ii − min(other entries of
    row or column i)`` for the ``min(B, M)`` matched rows, as listed values with weights."""
    _checks.embeddings(embeddings)
    if ref_emb is not None:
        _checks.embeddings(ref_emb, "ref_emb")
        _checks.same_space(embeddings, ref_emb)
    if ref_labels is not None:
        raise ValueError("ref_labels was given without labels")
    d = matrix(embeddings, ref_emb, mat, distance)
    r, c = d.shape
    n = min(r, c)
    diag = torch.eye(r, c, dtype=torch.bool, device=d.device)
    off = torch.where(diag, torch.inf, d)
    d_neg = torch.minimum(off.amin(-1)[:n], off.amin(-2)[:n])
    ok = torch.isfinite(d_neg)  # a 1 × 1 matrix has no negative
    v = torch.where(ok, d.diagonal()[:n] - torch.where(ok, d_neg, 0.0), 0.0)
    return d, (v, ok.to(d.dtype)), None
