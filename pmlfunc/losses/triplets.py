r"""Triplet losses: each term is one (anchor, positive, negative) triplet.

| loss | triplet ``(a, p, n)`` costs |
|---|---|
| :func:`triplet_margin` | ``[e_ap − e_an + m]_+`` (or its softplus), every triplet or the given ones |
| :func:`margin` | ``[d_ap − β + α]_+ + [β − d_an + α]_+``, a (learnable) boundary ``β`` |
| :func:`selectively_contrastive_triplet` | one easy-positive / hard-negative triplet per anchor |

All triplets are never enumerated. Write ``e`` for the distance oriented so that smaller means
closer (``e = d``, or ``e = -s`` for a similarity) and ``t_ap = e_ap + m``. The hinge of triplet
``(a, p, n)`` is ``[t_ap − e_an]_+``, so for one anchor

.. math::
    \sum_{p,n} [t_{ap} - e_{an}]_+ = \sum_p \big(t_{ap}\,C_a(t_{ap}) - S_a(t_{ap})\big)

where ``C_a(t)`` and ``S_a(t)`` are the count and the sum of the negatives' ``e_an`` below ``t``.
One sort per row of the merged keys (thresholds of positives, values of negatives) and two prefix
sums give every ``C`` and ``S``: O(B·M log M) time and O(B·M) memory instead of O(B·P·N).

Variants that do not factor this way (``smooth_loss``, ``swap``, a ``threshold`` reducer window)
use an exact anchor-chunked evaluation of the ``(anchor, positive, negative)`` cube inside a
custom autograd function whose backward recomputes each chunk: O(B·M²) time, O(chunk·M²) memory.

``margin`` never builds triplets either: its loss is a positive-pair part plus a negative-pair
part, so each pair enters weighted by the number of triplets that contain it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .. import params as _params
from .._ops import (
    apply,
    argsort_rows,
    masked,
    matmul,
    readable,
    scalar_like,
    scalar_tensor,
    scatter_,
    scatter_rows,
    sparse_rows,
)
from ..distances import cosine, lp
from ..reducers import (
    AlreadyReduced,
    Bound,
    DenseTerms,
    Terms,
    avg_nonzero,
    divisor,
    mean,
)
from ..tuples import (
    MinedTriplets,
    PackagedTriplets,
    TripletMask,
    TripletWindow,
    as_triplets,
    bitcast_ok,
    cube_chunk,
    ordered_bits,
    window_cover,
)
from ._batch import Batch, BatchInputs, batch_loss, spec

__all__ = ["margin", "margin_init", "selectively_contrastive_triplet", "triplet_margin"]


def triplet_margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    margin: float | Tensor = 0.2,
    swap: bool = False,
    smooth_loss: bool = False,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Triplet margin loss over all triplets (or the given ones).

    With ``e`` the distance (a similarity enters as ``-s``) and margin ``m``:

    .. math::
        \ell_{apn} = [e_{ap} - e_{an} + m]_+ \quad(\text{smooth\_loss: } \log(1 + e^{e_{ap} - e_{an} + m}))

    over every triplet with ``label(p) = label(a) ≠ label(n)`` (``p ≠ a`` in self mode), or over
    the triplets of ``indices_tuple`` (PML pairs ``(a1, p, a2, n)`` become the triplets that
    share an anchor, weighted by multiplicity, as in PML). ``swap=True`` replaces ``e_an`` by
    ``min(e_an, e_pn)``.

    All-triplet hinge losses are counted and summed without enumerating triplets (see the module
    docstring); ``smooth_loss``, ``swap`` and ``threshold`` reducers use an exact anchor-chunked
    O(B·M²) evaluation. Given triplets (a PML ``(a, p, n)`` tuple or a miner's
    :class:`~pmlfunc.tuples.MinedTriplets`) are read from their rows, ``O(T·D)`` and no
    ``B × M`` matrix, when they are few against it (:func:`row_path`: ``2T·D/2 ≤ B·M``, or
    ``3T`` pairs with ``swap`` in self mode), as ``F.triplet_margin_loss`` reads them.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        margin: default ``0.2`` (PML 3's default; PML 2.9.0 used 0.05).
        swap: use the positive–negative distance when it violates the margin more.
        smooth_loss: softplus instead of the hinge.
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``lp()``; ``reducer``: default ``avg_nonzero()`` over triplets.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.triplet_margin(emb, labels, margin=0.2)

    Reference: Weinberger, Saul, "Distance Metric Learning for Large Margin Nearest Neighbor
    Classification", JMLR 2009; Schroff et al., "FaceNet", CVPR 2015 (swap: Balntas et al.,
    "Learning local feature descriptors with triplets and shallow convolutional neural networks",
    BMVC 2016).
    """
    return spec(triplet_margin)(
        embeddings, labels, inputs, margin=margin, swap=swap, smooth_loss=smooth_loss
    )


@batch_loss(
    triplet_margin,
    distance=lp(),
    reducer=avg_nonzero(),
    unchunkable_with={"swap": "it compares each positive with each negative (other anchors' rows)"},
)
def _triplet_margin_terms(batch: Batch, *, margin, swap, smooth_loss) -> dict[str, Terms]:
    margin = _checks.hyper(margin, "margin")
    swap, smooth_loss = bool(swap), bool(smooth_loss)
    sign = batch.distance.sign()
    listed = as_triplets(batch.indices_tuple)
    if listed is not None:  # only the listed pairs' distances: O(L·D), not the B × M matrix
        t = listed.for_rows(batch.rows)
        a, p, n = t.anchors.long(), t.positives.long(), t.negatives.long()
        packaged = isinstance(t, PackagedTriplets)
        d_ap, d_an, d_pn = listed_distances(batch, a, p, n, swap=swap, packaged=packaged)
        e_ap, e_an = (d_ap, d_an) if sign == 1.0 else (-d_ap, -d_an)  # (no pass for +1)
        if d_pn is not None:  # swap
            e_an = torch.minimum(e_an, d_pn if sign == 1.0 else -d_pn)
        x = e_ap - e_an + scalar_like(margin, e_ap)
        losses = F.softplus(x) if smooth_loss else F.relu(x)
        weights = t.valid.to(losses.dtype)
        # a PML tuple's and packaged triplets' slots are all valid; a miner's result says so in
        # its values, which CPU eager reads for free (the weighted mean's eight ops each way
        # become one)
        unit = batch.rows is None and (
            packaged
            or not isinstance(batch.indices_tuple, MinedTriplets)
            or (readable(weights) and weights.numel() > 0 and float(weights.amin()) == 1.0)
        )
        terms: Terms = DenseTerms(
            losses, weights, "triplet", batch.num_anchors, anchor_index=a, unit_weights=unit
        )
        return {"loss": terms}
    e = sign * batch.mat
    margin = scalar_like(margin, e)
    # swap with a reference set: e between reference rows; in self mode e itself (a flag)
    e_pn = (
        sign * batch.distance.matrix(batch.ref_emb) if swap and batch.ref_emb is not None else None
    )
    swap_self = swap and batch.ref_emb is None
    it = batch.indices_tuple
    if isinstance(it, (TripletWindow, TripletMask)):
        # the miner's own label masks (the batch's masks hold its pair multiplicities)
        select = it.for_rows(batch.rows)
        if isinstance(select, TripletWindow):  # (for_rows keeps the type of it)
            pos, neg = select.pos.to(e.dtype), select.neg.to(e.dtype)
        else:
            pos = neg = torch.ones_like(e)
        fast = (
            isinstance(it, TripletWindow)
            and batch.rows is None
            and _same_source(it.source, batch.source)
        )
        terms = AllTriplets(
            e, pos, neg, margin, smooth_loss, e_pn, swap_self, select=select, fast_window=fast
        )
        return {"loss": terms}
    terms = AllTriplets(
        e,
        batch.masks.pos,
        batch.masks.neg,
        margin,
        smooth_loss,
        e_pn,
        swap_self,
        binary=not batch.counts,
        diagonal=batch.diagonal,
    )
    return {"loss": terms}


# The row path's cost against the matrix's, per listed pair and row element: gathering the two
# rows, their difference and its norm, and the backward's scale and two scattered adds, against
# one entry of the matrix (its share of the product and of the passes over it, both ways).
# Measured (CPU, one thread, float32, all-random triplets of triplet_margin, row path time /
# matrix path time at L·D = r·B·M): B = 512, D = 128: 0.31 (r = 1), 0.49 (2), 1.26 (4);
# D = 512: 0.21 (1), 0.29 (2), 0.33 (4), 0.54 (8), 1.83 (16); B = 2,048, D = 128: 0.25 (1),
# 0.70 (2), 1.18 (4); D = 512: 0.07 (1), 0.31 (2), 0.90 (4), 1.21 (8). The row path is taken
# up to r = 2 (the cost 1/2), where it won every measurement.
ROW_PATH_COST = 0.5


def row_path(batch: Batch, pairs: int) -> bool:
    """Whether ``pairs`` listed distances are computed on their rows (:func:`listed_distances`)
    rather than read from the ``(B, M)`` matrix: when the matrix is not at hand already (no
    ``mat=``, not built by an earlier term, not a chunk of anchor rows) and
    ``pairs · D · ROW_PATH_COST ≤ B · M``. Shapes only: the same choice on every call, traced
    or not."""
    if batch._mat is not None or batch.given_mat or batch.rows is not None:
        return False
    ref = batch.embeddings if batch.ref_emb is None else batch.ref_emb
    return pairs * ref.shape[-1] * ROW_PATH_COST <= batch.shape[0] * batch.shape[1]


def listed_distances(
    batch: Batch,
    a: Tensor,
    p: Tensor,
    n: Tensor,
    *,
    swap: bool = False,
    packaged: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(d_ap, d_an, d_pn)`` of ``T`` listed triplets (``d_pn`` with ``swap`` only, else
    ``None``), the matrix's entries (unoriented: a similarity is ``s``).

    On the row path (:func:`row_path`, for the ``2T`` pairs, ``3T`` with ``swap`` in self mode)
    from the listed rows only: the rows normalised once (:meth:`Batch._unit_rows`) and the pairs
    gathered in one call of :meth:`~pmlfunc.distances.Distance.indexed_pairs` (each anchor's
    row once for its two pairs), ``O(T·D)`` each way and one zero buffer of the batch's shape
    in the backward. ``packaged`` triplets (:class:`~pmlfunc.tuples.PackagedTriplets`: rows
    ``(3t, 3t+1, 3t+2)`` of ``3T`` rows, no reference set, no ``swap``) are read from the
    ``(T, 3, D)`` view of the rows instead, gathering nothing
    (:meth:`~pmlfunc.distances.Distance._packaged_pairs`). Otherwise one gather from the
    matrix. With a reference set, ``d_pn`` is
    between reference rows (``distance(ref_emb, ref_emb)[p, n]``; PML indexes the
    query-by-reference matrix at ``[p, n]``, a documented difference), always from the rows:
    no matrix holds it."""
    t = a.shape[0]
    self_swap = swap and batch.ref_emb is None
    on_rows = row_path(batch, 3 * t if self_swap else 2 * t)
    if on_rows and packaged and not swap and batch.ref_emb is None:
        # (the batch's inputs are checked: the distance's own part, without its checks)
        x, _, plain = batch._unit_rows()
        if x.shape[0] == 3 * t:
            rows = x.view(t, 3, x.shape[-1])
            d_ap, d_an = _guarded(batch, plain._packaged_pairs(rows)).unbind(-1)
            return d_ap, d_an, None
    if self_swap:  # (a, p), (a, n), (p, n): three lists of pairs
        i, j = torch.cat([a, a, p]), torch.cat([p, n, n])
    else:  # each anchor against its positive and its negative
        i, j = a, torch.stack([p, n])
    if on_rows:
        x, ref, plain = batch._unit_rows()
        values = _guarded(
            batch, plain._indexed_pairs(x, None if batch.ref_emb is None else ref, i, j)
        )
        d_pn = None
        if swap and batch.ref_emb is not None:
            d_pn = _guarded(batch, plain._indexed_pairs(ref, None, p, n))
    else:
        values = batch.mat[i, j]
        d_pn = None
        if swap and batch.ref_emb is not None:
            d_pn = batch.distance.indexed_pairs(batch.ref_emb, p, n)
    if self_swap:
        d_ap, d_an, d_pn = values.view(3, t).unbind(0)
        return d_ap, d_an, d_pn
    d_ap, d_an = values.unbind(0)  # one node each way (two selects: three)
    return d_ap, d_an, d_pn


def _guarded(batch: Batch, values: Tensor) -> Tensor:
    """Distances gathered from the normalised rows plus the batch's NaN guard (``Batch._guard``:
    a constant 0, NaN for a non-finite row), without a pass when it is the number 0."""
    return values + batch._guard if isinstance(batch._guard, Tensor) else values


def _sorted_hinge_stats(
    e: Tensor, pos: Tensor, neg: Tensor, margin: float | Tensor, binary: bool, diagonal: int | None
) -> tuple[Tensor, Tensor]:
    """Per-anchor ``(Σ_{p,n} w_p w_n [t_ap − e_an]_+, #{w_p w_n : t_ap > e_an})`` by one merged sort.

    Each column of a row is a positive (key ``t_ap = e_ap + m``), a negative (key ``e_an``) or
    neither (sorted last). With ``C_p`` the negatives sorted before positive ``p`` and ``P_n`` the
    positives sorted after negative ``n``,

        Σ_{p,n} [t_ap − e_an]_+ = Σ_p (e_ap + m)·C_p − Σ_n e_an·P_n = Σ_j e_aj·c_aj + m·count_a,

    a dot product of ``e`` with a constant coefficient matrix ``c``: the sort, the counts and ``c``
    carry no gradient, and the backward is ``c`` itself. Keys are ordered integers whose lowest
    bit puts a positive before a negative of equal value, so a negative counts for a positive
    exactly when ``e_an < t_ap`` (to one ulp), as the hinge's ``> 0`` does.

    ``binary``: 0/1 masks from labels, where every column is a positive or a negative except the
    anchors' own entries in self mode (at column offset ``diagonal``); the masks are then read
    back from the sorted keys' type bit.
    """
    listed = sparse_rows(pos, cost=8.0)  # K comparisons per column against a sort's ~30 passes
    if listed is not None:
        return _listed_hinge_stats(e, pos, neg, margin, listed)
    ed = e.detach()
    m = margin.detach() if isinstance(margin, Tensor) else margin
    # multiplicities are non-negative integers: clamping at 1 is a 0/1 indicator (and ~10x
    # faster on CPU than a comparison and a conversion)
    is_pos = pos if binary else pos.clamp_max(1.0)
    is_neg = neg if binary else neg.clamp_max(1.0)
    values = torch.addcmul(ed, is_pos, scalar_tensor(m, e))  # t_ap on positives, e_an elsewhere
    if bitcast_ok():
        order, wp, wn = _merged_order_bits(values, is_pos, is_neg, binary, diagonal)
    else:
        order, wp, wn = _merged_order_floats(values, is_pos, is_neg, binary, diagonal)
    if not binary:
        wp, wn = pos.gather(-1, order), neg.gather(-1, order)
    assert wp is not None and wn is not None  # binary: both sorts give the type bits' weights
    before = wn.cumsum(-1).sub_(wn)  # negatives strictly before each position
    after = wp.cumsum(-1).neg_().add_(wp.sum(-1, keepdim=True))  # positives strictly after
    coef = wp.mul_(before)
    count = coef.sum(-1)
    coef = coef.sub_(wn.mul_(after))
    coef = scatter_(torch.zeros_like(ed), order, coef)  # back to column order
    hinge = (e * coef).sum(-1) + count * margin
    return hinge, count


def _listed_hinge_stats(
    e: Tensor, pos: Tensor, neg: Tensor, margin: float | Tensor, listed: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """:func:`_sorted_hinge_stats` for at most ``K`` listed positives per anchor (CPU eager,
    :func:`~pmlfunc._ops.sparse_rows`): no sort. With ``below[a, k, n] = [e_an < t_ak]``,
    ``C_k = Σ_n w_n·below`` (the negatives counted for positive ``k``) and
    ``P_n = Σ_k w_k·below`` (the positives negative ``n`` counts for), the same coefficients:
    ``w_k·C_k`` on the positives, ``−w_n·P_n`` on the negatives."""
    idx, valid = listed
    ed = e.detach()
    m = margin.detach() if isinstance(margin, Tensor) else margin
    wp = pos.gather(-1, idx) * valid  # (B, K) multiplicities, 0 on the padding
    t = ed.gather(-1, idx) + m  # t_ap = e_ap + m
    counted = torch.empty_like(wp)  # C_k
    p_neg = torch.zeros_like(ed)  # P_n
    for k in range(idx.shape[-1]):  # one (B, M) block at a time (K is small)
        below = (ed < t[:, k : k + 1]).to(ed.dtype)
        counted[:, k] = matmul(below.unsqueeze(-2), neg.unsqueeze(-1))[:, 0, 0]
        p_neg.addcmul_(below, wp[:, k : k + 1])
    c_pos = wp * counted  # w_k·C_k
    coef = scatter_rows(c_pos, listed, ed).sub_(neg * p_neg)
    count = c_pos.sum(-1)
    return (e * coef).sum(-1) + count * margin, count


def _merged_order_bits(
    values: Tensor, is_pos: Tensor, is_neg: Tensor, binary: bool, diagonal: int | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(order, wp, wn)`` of :func:`_sorted_hinge_stats` by one integer sort: keys ordered like
    the floats with the lowest bit cleared for a type bit (0: positive, 1: negative), so a
    positive sorts before a negative of equal value; columns that are neither sort last."""
    keys = ordered_bits(values).bitwise_and_(~1).bitwise_or_(is_neg.to(torch.int32))
    top = torch.iinfo(keys.dtype).max  # odd: sorts last, reads as "not a positive"
    if binary and diagonal is not None:
        keys.diagonal(offset=diagonal, dim1=-2, dim2=-1).fill_(top)
    elif not binary:  # columns that are neither sort last (by arithmetic: `where` is slower)
        inside = (is_pos + is_neg).to(keys.dtype)
        keys = keys.mul_(inside).add_(inside.neg_().add_(1).mul_(top))
    order = argsort_rows(keys)
    if not binary:
        return order, None, None
    # the type bit of the sorted keys says which column is which
    wn = keys.gather(-1, order).bitwise_and_(1).to(values.dtype)
    wp = torch.rsub(wn, 1.0)
    if diagonal is not None:  # the anchor's own entry (top) sorts last in every row
        wn[..., -1] = 0.0
        wp[..., -1] = 0.0
    return order, wp, wn


def _merged_order_floats(values, is_pos, is_neg, binary, diagonal):
    """The same order from the floats, where :func:`~pmlfunc.tuples.ordered_bits` cannot run
    (``vmap`` on an older PyTorch): a stable sort by type (positive, negative, neither), then a
    stable sort by value, so a positive still sorts before a negative of equal value."""
    kind = 2.0 - 2.0 * is_pos - is_neg  # 0 positive, 1 negative, 2 neither
    if binary and diagonal is not None:
        kind = kind.clone()
        kind.diagonal(offset=diagonal, dim1=-2, dim2=-1).fill_(2.0)
    values = torch.where(kind > 1.5, torch.inf, values)  # neither sorts last
    by_kind = kind.argsort(dim=-1, stable=True)
    order = by_kind.gather(-1, values.gather(-1, by_kind).argsort(dim=-1, stable=True))
    sorted_kind = kind.gather(-1, order)
    wp = (sorted_kind == 0.0).to(values.dtype)
    wn = (sorted_kind == 1.0).to(values.dtype)
    return order, wp, wn


class _CubeStats(torch.autograd.Function):
    """Per-anchor ``(Σ selected f(x), # selected)`` over the triplet cube
    ``x[a, p, n] = e_ap − g[a, p, n] + m`` with ``g = e_an`` (or ``min(e_an, e_pn)`` with swap)
    and ``f = relu`` or ``softplus``, terms weighted ``pos[a, p]·neg[a, n]`` and selected by
    ``low < f(x) < high``. Anchor-chunked; the backward recomputes each chunk.

    ``swap_self`` means ``e_pn = e`` (self mode); it is a flag because compile rejects a Function
    given the same tensor twice. ``select`` (a miner's :class:`~pmlfunc.tuples.TripletWindow` or
    :class:`~pmlfunc.tuples.TripletMask`, or ``None``) keeps only the triplets it selected."""

    generate_vmap_rule = True

    @staticmethod
    def _block(e, pos, neg, e_pn, margin, lo, hi, smooth, start, stop, select=None):
        ea = e[start:stop]  # e_pn: None, or the (M, M) positive-to-negative matrix
        an = ea.unsqueeze(-2)
        pick_an = None
        if e_pn is not None:
            pick_an = an <= e_pn
            g = torch.where(pick_an, an, e_pn)
        else:
            g = an
        x = ea.unsqueeze(-1) - g + margin
        f = F.softplus(x) if smooth else F.relu(x)
        w = pos[start:stop].unsqueeze(-1) * neg[start:stop].unsqueeze(-2)
        if select is not None:
            w = w * select.select(start, min(stop, e.shape[-2])).to(w.dtype)
        if lo is not None:
            w = w * (f > lo).to(w.dtype)
        if hi is not None:
            w = w * (f < hi).to(w.dtype)
        return x, f, w, pick_an

    @staticmethod
    def forward(e, pos, neg, e_pn, margin, lo, hi, smooth, swap_self, chunk, select):
        if swap_self:
            e_pn = e
        sums, counts = [], []
        for start in range(0, e.shape[-2], chunk):
            _, f, w, _ = _CubeStats._block(
                e, pos, neg, e_pn, margin, lo, hi, smooth, start, start + chunk, select
            )
            sums.append((w * f).sum((-1, -2)))
            counts.append(w.sum((-1, -2)))
        return torch.cat(sums, -1), torch.cat(counts, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        e, pos, neg, e_pn, margin, lo, hi, smooth, swap_self, chunk, select = inputs
        ctx.save_for_backward(e, pos, neg, e_pn, margin, lo, hi)
        ctx.smooth, ctx.swap_self, ctx.chunk, ctx.select = smooth, swap_self, chunk, select
        ctx.set_materialize_grads(True)

    @staticmethod
    def backward(ctx, g_sum, _g_count):
        e, pos, neg, e_pn, margin, lo, hi = ctx.saved_tensors
        if ctx.swap_self:
            e_pn = e
        grad_pn = None if e_pn is None else torch.zeros_like(e_pn)
        grad_m = torch.zeros_like(margin)
        rows = []
        for start in range(0, e.shape[-2], ctx.chunk):
            stop = start + ctx.chunk
            x, _, w, pick_an = _CubeStats._block(
                e, pos, neg, e_pn, margin, lo, hi, ctx.smooth, start, stop, ctx.select
            )
            df = torch.sigmoid(x) if ctx.smooth else (x > 0).to(x.dtype)
            gx = g_sum[start:stop].unsqueeze(-1).unsqueeze(-1) * w * df
            row = gx.sum(-1)  # d/d e_ap
            if pick_an is None:
                row = row - gx.sum(-2)  # d/d e_an
            else:
                sel = pick_an.to(gx.dtype)
                row = row - (gx * sel).sum(-2)
                grad_pn = grad_pn - (gx * (1 - sel)).sum(0)
            rows.append(row)
            grad_m = grad_m + gx.sum()
        grad_e = torch.cat(rows, -2)
        if ctx.swap_self:
            assert grad_pn is not None  # swap_self: e_pn is e
            grad_e, grad_pn = grad_e + grad_pn, None
        return grad_e, None, None, grad_pn, grad_m, None, None, None, None, None, None


def _window_hinge_stats(
    e: Tensor, window: TripletWindow, margin: float | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Per anchor ``(Σ hinge, # hinge > 0, # triplets)`` over a miner's window, by one sort.

    With ``[first_p, stop_p)`` the sorted negatives in positive ``p``'s window that the hinge
    reaches (``e_an < e_ap + m``), ``Σ_{p,n} (e_ap + m − e_an) = Σ_j e_aj·c_aj + m·count_a``
    with ``c_ap = stop_p − first_p`` and ``c_an = −#{p : n ∈ [first_p, stop_p)}``: a dot product
    of ``e`` with constants, as in :func:`_sorted_hinge_stats`.
    """
    m = margin.detach() if isinstance(margin, Tensor) else margin
    found = window.search(m)
    coef = found.count.to(e.dtype) - window_cover(found).to(e.dtype)
    active = found.count.sum(-1).to(e.dtype)
    hinge = (e * coef).sum(-1) + active * margin
    return hinge, active, found.window_count.sum(-1).to(e.dtype)


def _same_source(a: tuple, b: tuple) -> bool:
    """Whether two matrices came from the same source (:func:`~pmlfunc.tuples.source_of`):
    equal distances, the very same tensor objects, not written in place in between (their
    version counters; under ``torch.compile`` the objects alone). Then their values are equal,
    without reading them."""
    if not a or not b or a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    return all(x is y for x, y in zip(a[1], b[1], strict=True)) and a[2] == b[2]


@dataclass(frozen=True, eq=False)
class AllTriplets(Terms):
    """All triplets ``(a, p, n)`` with pair weights ``pos[a, p]·neg[a, n]``, never enumerated;
    with ``select``, only those a miner's window or mask selected."""

    e: Tensor  # (B, M), smaller = closer
    pos: Tensor
    neg: Tensor
    margin: float | Tensor
    smooth: bool
    e_pn: Tensor | None  # (M, M) reference-to-reference, for swap with a reference set
    swap_self: bool = False  # swap in self mode: e_pn is e itself
    binary: bool = False  # pos/neg are 0/1 masks (from labels), not multiplicities
    diagonal: int | None = None  # self mode: column offset of each anchor's own entry (neither)
    select: TripletWindow | TripletMask | None = None
    fast_window: bool = False  # select is a window on this very matrix: sort it once
    kind: str = "triplet"

    @property
    def num_anchors(self) -> int:  # type: ignore[override]
        return self.e.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.e.device

    def _total_count(self) -> Tensor:
        return self.pos.sum(-1) * self.neg.sum(-1)

    def stats(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        plain = not self.smooth and not self.swap_self and self.e_pn is None and high is None
        zero_low = isinstance(low, float) and low == 0.0
        window = self.select if isinstance(self.select, TripletWindow) else None
        if self.fast_window and window is not None and plain and (low is None or zero_low):
            hinge, active, total = _window_hinge_stats(self.e, window, self.margin)
            return hinge, (active if zero_low else total)
        if self.select is None and plain and low is None:
            hinge, _ = _sorted_hinge_stats(
                self.e, self.pos, self.neg, self.margin, self.binary, self.diagonal
            )
            return hinge, self._total_count()
        if self.select is None and plain and zero_low:
            return _sorted_hinge_stats(
                self.e, self.pos, self.neg, self.margin, self.binary, self.diagonal
            )
        chunk = cube_chunk(self.e.shape[-1], self.e.device)
        margin = scalar_tensor(self.margin, self.e)
        lo = None if low is None else scalar_tensor(low, self.e)
        hi = None if high is None else scalar_tensor(high, self.e)
        s, c = apply(
            _CubeStats,
            self.e,
            self.pos,
            self.neg,
            self.e_pn,
            margin,
            lo,
            hi,
            self.smooth,
            self.swap_self,
            chunk,
            self.select,
        )
        if low is None and high is None and self.select is None:
            c = self._total_count()
        return s, c

    def dense(self) -> dict[str, Any]:
        an = self.e.unsqueeze(-2)
        e_pn = self.e if self.swap_self else self.e_pn
        g = an if e_pn is None else torch.minimum(an, e_pn)
        x = self.e.unsqueeze(-1) - g + self.margin
        losses = F.softplus(x) if self.smooth else F.relu(x)
        weights = self.pos.unsqueeze(-1) * self.neg.unsqueeze(-2)
        if self.select is not None:
            weights = weights * self.select.select(0, self.e.shape[-2]).to(weights.dtype)
        return {"losses": losses, "weights": weights, "kind": self.kind}


def margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
    *,
    margin: float | Tensor = 0.2,
    nu: float | Tensor = 0.0,
    beta: float | Tensor = 1.2,
    triplets_per_anchor: str = "all",
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Margin loss: positives inside, negatives outside a (learnable) boundary ``β``.

    For every triplet ``(a, p, n)``, with distance ``d`` (a similarity flips the signs, as PML's
    ``distance.margin``), margin ``α`` and boundary ``β_a``:

    .. math::
        \ell_{apn} = [d_{ap} - β_a + α]_+ + [β_a - d_{an} + α]_+

    The default ``divisor()`` reducer divides the sum over triplets by the number of non-zero
    parts, ``#{[d_ap − β + α]_+ > 0} + #{[β − d_an + α]_+ > 0}`` over triplets (PML's divisor).
    Triplets are never built: the positive part depends on ``(a, p)`` only and the negative part
    on ``(a, n)`` only, so each pair enters weighted by the number of triplets holding it
    (``O(B·M)``; a ``threshold``/``avg_nonzero`` window is counted per anchor by one sort of
    the negative parts and a binary search per positive, ``O(B·M log M)``). Given pairs
    ``(a1, p, a2, n)`` form the triplets that share an anchor (PML's ``convert_to_triplets``);
    given triplets are used as listed.

    Learnable ``β`` (PML's ``learn_beta=True``): pass ``params`` from :func:`margin_init`.
    ``params["beta"]`` of shape ``(1,)`` is one boundary, and ``ν·β`` is added to the loss (an
    already-reduced sub-loss ``beta_reg_loss``);
    of shape ``(C,)`` (PML's ``num_classes=C``) the anchor's class picks ``β_a``, and the
    sub-loss ``beta_reg_loss`` of per-triplet terms ``ν·β_a`` is reduced like the margin loss
    (default: divided by the same divisor). Without ``params`` (``learn_beta=False``), ``β`` is
    the fixed ``beta`` and there is no regularisation term. As in PML, no triplet at all gives 0
    (regularisation included). PML keeps ``β`` in a float32 tensor (so its ``1.2`` is
    ``1.2000000477`` against float64 inputs); pmlfunc uses the number given.

    ``triplets_per_anchor`` must be ``"all"`` when triplets come from the labels (PML's random
    sampling needs an explicit generator; use a miner such as ``pf.miners.triplet_margin`` with
    ``tuples_per_anchor`` instead). Not chunkable with ``params`` or the default ``divisor()``.

    A :class:`~pmlfunc.tuples.TripletWindow` or :class:`~pmlfunc.tuples.TripletMask` miner
    result as ``indices_tuple`` works with the ``divisor()``, ``mean()``, ``sum()``,
    ``class_weighted`` and ``per_anchor`` reducers.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        params: ``{"beta": (1,) or (C,)}`` from :func:`margin_init`, or ``None`` (fixed ``beta``).
        margin: ``α`` (default ``0.2``).
        nu: regularisation weight ``ν`` of a learnable ``β`` (default ``0``).
        beta: the fixed boundary when ``params`` is ``None`` (default ``1.2``).
        triplets_per_anchor: ``"all"`` (default; the only supported value without a tuple).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``lp()``; ``reducer``: default ``divisor()``.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> params = pf.losses.margin_init(beta=1.2, num_classes=4)
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.margin(emb, labels, params, margin=0.2, nu=0.01)

    Reference: Wu et al., "Sampling Matters in Deep Embedding Learning", ICCV 2017.
    """
    return _MARGIN(  # the hyper-parameter ``margin`` shadows the function's own name here
        embeddings,
        labels,
        inputs,
        params=params,
        margin=margin,
        nu=nu,
        beta=beta,
        triplets_per_anchor=triplets_per_anchor,
    )


def margin_init(
    beta: float = 1.2,
    num_classes: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    r"""Parameters of :func:`margin` with a learnable boundary: ``{"beta": (C,)}``.

    PML's ``initialize_beta``: one value ``beta`` (``num_classes=None``, shape ``(1,)``) or one
    per class (shape ``(num_classes,)``), all equal to ``beta``.

    Example:
        >>> pf.losses.margin_init(1.2, num_classes=3)["beta"]
        tensor([1.2000, 1.2000, 1.2000])
    """
    beta = _checks.number(beta, "beta")
    size = 1 if num_classes is None else _checks.integer(num_classes, "num_classes")
    return {"beta": torch.full((size,), beta, dtype=dtype, device=device)}


def _beta_param(params: object, embeddings: Tensor) -> Tensor:
    if not isinstance(params, dict):
        raise TypeError(
            f"params must be a dict of tensors (from margin_init), got {type(params).__name__}"
        )
    if "beta" not in params:
        raise ValueError(f"params has no 'beta' entry (keys: {sorted(params)})")
    b = params["beta"]
    if not isinstance(b, Tensor) or not b.dtype.is_floating_point:
        raise TypeError("params['beta'] must be a floating-point tensor")
    if b.ndim != 1 or b.shape[0] == 0:
        raise ValueError(
            f"params['beta'] must have shape (1,) or (num_classes,), got {tuple(b.shape)}"
        )
    if b.device != embeddings.device:
        raise ValueError(
            f"params['beta'] is on {b.device} but embeddings are on {embeddings.device}"
        )
    return b


@batch_loss(
    margin,
    distance=lp(),
    reducer=divisor(),
    unchunkable_with={
        "params": "a learnable beta adds an already-reduced (or divisor-scaled) regularisation term"
    },
)
def _margin_terms(
    batch: Batch, *, params, margin, nu, beta, triplets_per_anchor
) -> dict[str, Terms]:
    """The margin loss's terms and, for a learnable ``β``, its regularisation ``ν·β``."""
    if triplets_per_anchor != "all" and batch.indices_tuple is None:
        raise ValueError(
            f'triplets_per_anchor must be "all" (got {triplets_per_anchor!r}); for a random '
            "subset of triplets pass a miner's result (e.g. pf.miners.triplet_margin(..., "
            "tuples_per_anchor=k)) as indices_tuple"
        )
    alpha = _checks.hyper(margin, "margin")
    nu = _checks.hyper(nu, "nu")
    s = batch.distance.sign()
    beta_v, per_class = _boundary(batch, params, beta)
    listed = as_triplets(batch.indices_tuple)
    if listed is not None:
        t = listed.for_rows(batch.rows)
        a, p, n = t.anchors.long(), t.positives.long(), t.negatives.long()
        d_ap, d_an, _ = listed_distances(batch, a, p, n, packaged=isinstance(t, PackagedTriplets))
        w = t.valid.to(d_ap.dtype)
        b_t = beta_v[a] if per_class else beta_v
        pos_l, neg_l = _margin_parts(d_ap, d_an, b_t, alpha, s)
        div = matmul(w, (pos_l > 0).to(w.dtype)) + matmul(w, (neg_l > 0).to(w.dtype))
        rows = batch.num_anchors
        terms: dict[str, Terms] = {
            "margin_loss": DenseTerms(
                pos_l + neg_l, w, "triplet", rows, anchor_index=a, divisor=div
            )
        }
        if params is not None and per_class:
            reg = b_t * scalar_like(nu, b_t)
            terms["beta_reg_loss"] = DenseTerms(
                reg, w, "element", rows, anchor_index=a, divisor=div
            )
        any_triplet = w.sum() > 0
    else:
        d, it = batch.mat, batch.indices_tuple
        pos, neg = batch.masks
        b_col = beta_v.unsqueeze(-1) if per_class else beta_v
        pos_l, neg_l = _margin_parts(d, d, b_col, alpha, s)
        product = not isinstance(it, (TripletWindow, TripletMask))
        if product:  # labels, pairs (a1, p, a2, n), MinedPairs: all (a, p) × (a, n)
            n_pos, n_neg = pos.sum(-1), neg.sum(-1)
            wp, wn, total = pos * n_neg.unsqueeze(-1), neg * n_pos.unsqueeze(-1), n_pos * n_neg
        else:  # a triplet selection: its pair counts are the triplet multiplicities
            wp, wn, total = pos, neg, pos.sum(-1)
        div = matmul(wp.reshape(-1), (pos_l > 0).to(wp.dtype).reshape(-1))
        div = div + matmul(wn.reshape(-1), (neg_l > 0).to(wn.dtype).reshape(-1))
        select = None if product else it
        terms = {"margin_loss": _MarginTerms(pos_l, neg_l, pos, neg, wp, wn, total, select, div)}
        if params is not None and per_class:
            reg = beta_v * scalar_like(nu, beta_v)
            terms["beta_reg_loss"] = DenseTerms(
                reg, total, "element", batch.num_anchors, divisor=div
            )
        any_triplet = total.sum() > 0
    if params is not None and not per_class:  # one boundary: ν·β, already reduced
        reg = beta_v * scalar_like(nu, beta_v)
        terms["beta_reg_loss"] = AlreadyReduced(
            torch.where(any_triplet, reg, torch.zeros_like(reg))
        )
    return terms


_MARGIN = spec(margin)


def _boundary(batch: Batch, params, beta) -> tuple[Any, bool]:
    """``(β, per_class)``: the fixed ``beta`` (no ``params``), the one learnable value, or
    ``(B,)`` per anchor row, its class's value (``per_class``).

    ``β`` is a number or a tensor, a tensor whenever learnable (``params``) or per class, which
    the terms rely on (hence ``Any``: a type cannot tie it to ``params``)."""
    if params is None:
        beta_v = _checks.hyper(beta, "beta")
        if isinstance(beta_v, Tensor):
            beta_v = beta_v.to(dtype=batch.dtype, device=batch.embeddings.device)
        return beta_v, False
    b = _beta_param(params, batch.embeddings).to(batch.dtype)
    if b.shape[0] == 1:
        return b[0], False
    if batch.labels is None or batch.all_labels is None:  # (both or neither)
        raise ValueError("params['beta'] with one value per class needs labels")
    _params.class_labels(batch.all_labels, b.shape[0])
    return b[batch.labels.long()], True


def _margin_parts(d_ap, d_an, beta_, alpha, s: float) -> tuple[Tensor, Tensor]:
    """``([s(d_ap − β) + α]_+, [s(β − d_an) + α]_+)`` (PML's ``distance.margin``)."""
    m = scalar_like(alpha, d_ap)
    pos_l = F.relu(s * (d_ap - beta_) + m)
    neg_l = F.relu(s * (beta_ - d_an) + m)
    return pos_l, neg_l


@dataclass(frozen=True, eq=False)
class _MarginTerms(Terms):
    """Margin-loss triplets ``(a, p, n)`` with loss ``u_ap + v_an``, never enumerated.

    ``wp``/``wn`` are the pairs' triplet multiplicities and ``total`` each anchor's number of
    triplets. ``select is None``: the triplets are all ``(a, p) × (a, n)`` with weights
    ``pos_ap·neg_an`` (a product, so a value window is counted by sorting); otherwise a miner's
    triplet selection (no value windows)."""

    u: Tensor  # (B, M) positive parts
    v: Tensor  # (B, M) negative parts
    pos: Tensor
    neg: Tensor
    wp: Tensor
    wn: Tensor
    total: Tensor
    select: Any
    divisor: Tensor | None = None
    kind: str = "triplet"

    @property
    def num_anchors(self) -> int:  # type: ignore[override]
        return self.u.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.u.device

    def stats(self, low: Bound = None, high: Bound = None) -> tuple[Tensor, Tensor]:
        if low is None and high is None:
            return (self.wp * self.u).sum(-1) + (self.wn * self.v).sum(-1), self.total
        if self.select is not None:
            raise ValueError(
                "margin with a TripletWindow/TripletMask miner result supports the divisor(), "
                "mean(), sum(), class_weighted() and per_anchor() reducers, not a value window "
                "(avg_nonzero/threshold); pass tuples_per_anchor to the miner instead"
            )
        return _pair_sum_window(self.u, self.pos, self.v, self.neg, low, high)

    def dense(self) -> dict[str, Any]:
        losses = self.u.unsqueeze(-1) + self.v.unsqueeze(-2)
        if self.select is None:
            weights = self.pos.unsqueeze(-1) * self.neg.unsqueeze(-2)
        else:
            weights = self.select.select(0, self.u.shape[-2]).to(losses.dtype)
        return {"losses": losses, "weights": weights, "kind": self.kind}


def _pair_sum_window(
    u: Tensor, cu: Tensor, v: Tensor, cv: Tensor, low: Bound, high: Bound
) -> tuple[Tensor, Tensor]:
    r"""Per row ``(Σ_{p,n} cu_p cv_n (u_p + v_n), Σ cu_p cv_n)`` over ``low < u_p + v_n < high``.

    One sort of each row's ``v``, prefix sums of ``cv`` and ``cv·v``, and a binary search per
    ``p`` for ``low − u_p < v_n < high − u_p``: ``O(B·M log M)``, never the ``(B, M, M)`` cube.
    The sort and the search carry no gradient; the values flow through the gathered sums.
    """
    vs, order = v.detach().sort(-1)
    cvs = cv.gather(-1, order)
    vals = v.gather(-1, order)
    zero = torch.zeros_like(cvs[..., :1])
    cum_w = torch.cat([zero, cvs.cumsum(-1)], -1)
    cum_s = torch.cat([zero, (cvs * vals).cumsum(-1)], -1)
    ud = u.detach()
    m = v.shape[-1]
    if low is None:
        lo = torch.zeros_like(ud, dtype=torch.long)
    else:
        lo = torch.searchsorted(vs, torch.rsub(ud, low).contiguous(), right=True)
    if high is None:
        hi = torch.full_like(ud, m, dtype=torch.long)
    else:
        hi = torch.searchsorted(vs, torch.rsub(ud, high).contiguous(), right=False)
    hi = torch.maximum(hi, lo)
    cnt = cum_w.gather(-1, hi) - cum_w.gather(-1, lo)
    sv = cum_s.gather(-1, hi) - cum_s.gather(-1, lo)
    count = (cu * cnt).sum(-1)
    total = (cu * (u * cnt + sv)).sum(-1)
    return total, count


def selectively_contrastive_triplet(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: float | Tensor = 0.1,
    penalty: float | Tensor = 1.0,
    hard_cutoff: float | Tensor | None = None,
    **inputs: Unpack[BatchInputs],
) -> Tensor:
    r"""Selectively contrastive triplet loss: hard negatives are only pushed away.

    Per anchor ``a``, with similarity ``s`` (a distance enters as ``-d``): the easiest positive
    ``p = argmax_{p ∈ P(a)} s_ap`` and the hardest negative ``n = argmax_{n ∈ N(a)} s_an`` form
    one triplet (the selection is not differentiated), whose loss is

    .. math::
        \ell_a = \begin{cases}
            λ\, s_{an} & \text{if } s_{an} > s_{ap}\ (\text{or } s_{an} > c) \\
            -\log \dfrac{e^{s_{ap}/τ}}{e^{s_{ap}/τ} + e^{s_{an}/τ}}
                = \log\big(1 + e^{(s_{an} - s_{ap})/τ}\big) & \text{otherwise}
        \end{cases}

    with ``λ = penalty``, ``τ = temperature`` and the optional cut-off ``c = hard_cutoff``. The
    first case (the paper's selectively contrastive ``L_SC``) lowers only the hard negative's similarity and
    leaves the positive alone; the second is the NCA triplet loss. Anchors without a positive or
    a negative have no triplet. The default reducer averages over the anchors that have one,
    which is the authors' ``(L_easy + λ·L_hard) / (N_easy + N_hard)``.

    Differences from the authors' code (``SCTLoss``): their ``0.8`` cut-off is ``hard_cutoff=0.8``
    here (the paper's rule, ``None``, is the default); they skip positives with ``s > 0.9999``
    (duplicate images) and triplets whose mined similarity is exactly ±1; here every positive
    and every triplet counts (drop duplicates from the batch, or pass an ``indices_tuple``).
    An ``indices_tuple`` restricts the candidate positives and negatives to the listed pairs.

    Args:
        embeddings: ``(B, D)`` float tensor.
        labels: ``(B,)`` integer class ids (may be ``None`` when ``indices_tuple`` is given).
        temperature: ``τ > 0`` of the NCA term (default ``0.1``, the authors').
        penalty: ``λ``, the weight of the hard-negative term (default ``1``).
        hard_cutoff: also treat a triplet as hard when ``s_an > hard_cutoff`` (default ``None``).
        **inputs: the shared inputs (:class:`~pmlfunc.losses.BatchInputs`); ``distance``:
            default ``cosine()``; ``reducer``: default ``mean()`` over anchors with a triplet.

    Returns:
        0-d tensor: float32 for float16/bfloat16 embeddings, else their dtype.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = pf.losses.selectively_contrastive_triplet(emb, labels, penalty=1.0)

    Reference: Xuan, Stylianou, Liu, Pless, "Hard Negative Examples are Hard, but Useful",
    ECCV 2020.
    """
    return spec(selectively_contrastive_triplet)(
        embeddings,
        labels,
        inputs,
        temperature=temperature,
        penalty=penalty,
        hard_cutoff=hard_cutoff,
    )


@batch_loss(selectively_contrastive_triplet, distance=cosine(), reducer=mean())
def _sct_terms(batch: Batch, *, temperature, penalty, hard_cutoff) -> dict[str, Terms]:
    temperature = _checks.hyper(temperature, "temperature", positive=True)
    penalty = _checks.hyper(penalty, "penalty")
    if hard_cutoff is not None:
        hard_cutoff = _checks.hyper(hard_cutoff, "hard_cutoff")
    s = batch.similarity()
    pos, neg = batch.masks
    keep_p, keep_n = (pos > 0).to(s.dtype), (neg > 0).to(s.dtype)
    sd = s.detach()
    ip = masked(sd, keep_p).argmax(-1, keepdim=True)
    i_n = masked(sd, keep_n).argmax(-1, keepdim=True)
    s_ap = s.gather(-1, ip).squeeze(-1)
    s_an = s.gather(-1, i_n).squeeze(-1)
    valid = keep_p.amax(-1) * keep_n.amax(-1)
    hard = s_an.detach() > s_ap.detach()
    if hard_cutoff is not None:
        hard = hard | (s_an.detach() > scalar_like(hard_cutoff, s))
    nca = F.softplus((s_an - s_ap) / scalar_like(temperature, s))
    losses = torch.where(hard, scalar_like(penalty, s) * s_an, nca)
    return {"loss": DenseTerms(losses, valid, "triplet", batch.num_anchors)}
