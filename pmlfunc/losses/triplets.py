r"""Triplet losses: each term is one (anchor, positive, negative) triplet.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from ..distances import Distance, lp
from ..reducers import Bound, DenseTerms, Reducer, Terms, avg_nonzero
from ..tuples import MinedTriplets, TripletMask, TripletWindow, is_mined, window_cover
from ._common import Batch, LossSpec, register, run, scalar_like

__all__ = ["triplet_margin"]

# Elements of one (chunk, M, M) block of the triplet cube.
_CUBE_BLOCK = 1 << 22


def _ordered_int(x: Tensor) -> Tensor:
    """Integers ordered like the floats ``x`` (IEEE bit trick), with the lowest bit cleared.

    Runs on constants (no gradient), in place on one fresh buffer.
    """
    if x.dtype == torch.float64:
        bits, sign_mask = (x + 0.0).view(torch.int64), 0x7FFFFFFFFFFFFFFF  # + 0.0: no -0.0
    else:
        bits, sign_mask = (x.float() + 0.0).view(torch.int32), 0x7FFFFFFF
    flip = (bits >> (bits.element_size() * 8 - 1)).bitwise_and_(sign_mask)
    return bits.bitwise_xor_(flip).bitwise_and_(~1)


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
    ed = e.detach()
    m = margin.detach() if isinstance(margin, Tensor) else margin
    # multiplicities are non-negative integers: clamping at 1 is a 0/1 indicator (and ~10x
    # faster on CPU than a comparison and a conversion)
    is_pos = pos if binary else pos.clamp_max(1.0)
    is_neg = neg if binary else neg.clamp_max(1.0)
    keys = _ordered_int(
        torch.addcmul(ed, is_pos, torch.as_tensor(m, dtype=e.dtype, device=e.device))
    )
    keys = keys.bitwise_or_(is_neg.to(keys.dtype))
    top = torch.iinfo(keys.dtype).max  # odd: sorts last, reads as "not a positive"
    if binary and diagonal is not None:
        keys.diagonal(offset=diagonal, dim1=-2, dim2=-1).fill_(top)
    elif not binary:  # columns that are neither sort last (by arithmetic: `where` is slower)
        inside = (is_pos + is_neg).to(keys.dtype)
        keys = keys.mul_(inside).add_(inside.neg_().add_(1).mul_(top))
    order = keys.argsort(dim=-1)  # argsort is ~2x faster than sort on CPU for int rows
    if binary:  # the type bit of the sorted keys says which column is which
        wn = keys.gather(-1, order).bitwise_and_(1).to(e.dtype)
        wp = torch.rsub(wn, 1.0)
        if diagonal is not None:  # the anchor's own entry (top) sorts last in every row
            wn[..., -1] = 0.0
            wp[..., -1] = 0.0
    else:
        wp, wn = pos.gather(-1, order), neg.gather(-1, order)
    before = wn.cumsum(-1).sub_(wn)  # negatives strictly before each position
    after = wp.cumsum(-1).neg_().add_(wp.sum(-1, keepdim=True))  # positives strictly after
    coef = wp.mul_(before)
    count = coef.sum(-1)
    coef = coef.sub_(wn.mul_(after))
    coef = _checks.scatter_(torch.zeros_like(ed), order, coef)  # back to column order
    hinge = (e * coef).sum(-1) + count * margin
    return hinge, count


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
    """Whether two matrices came from the same ``(distance, tensors...)``: equal distances and
    the very same tensor objects (then their values are equal, without reading them)."""
    if len(a) != len(b) or not a or a[0] != b[0]:
        return False
    return all(x is y for x, y in zip(a[1:], b[1:], strict=True))


def _select_rows(select, rows):
    """A miner's triplet selection restricted to the anchor ``rows`` of a chunk."""
    if rows is None:
        return select
    r0, r1 = rows
    if isinstance(select, TripletMask):
        return TripletMask(select.mask[r0:r1])
    return select._replace(e=select.e[r0:r1], pos=select.pos[r0:r1], neg=select.neg[r0:r1])


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
        if self.select is not None and self.fast_window and plain and (low is None or zero_low):
            hinge, active, total = _window_hinge_stats(self.e, self.select, self.margin)
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
        m = self.e.shape[-1]
        chunk = max(1, _CUBE_BLOCK // max(1, m * m))
        margin = torch.as_tensor(self.margin, dtype=self.e.dtype, device=self.e.device)
        lo = None if low is None else torch.as_tensor(low, dtype=self.e.dtype, device=self.e.device)
        hi = (
            None
            if high is None
            else torch.as_tensor(high, dtype=self.e.dtype, device=self.e.device)
        )
        s, c = _CubeStats.apply(
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


def triplet_margin(
    embeddings: Tensor,
    labels: Tensor | None = None,
    *,
    margin: float | Tensor = 0.2,
    swap: bool = False,
    smooth_loss: bool = False,
    distance: Distance | None = None,
    reducer: Reducer | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple=None,
    mat: Tensor | None = None,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
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
    O(B·M²) evaluation.

    Args:
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat: as in
            :func:`pmlfunc.losses.contrastive`.
        margin: default ``0.2`` (PML 3's default; PML 2.9.0 used 0.05).
        swap: use the positive–negative distance when it violates the margin more.
        smooth_loss: softplus instead of the hinge.
        distance: default ``lp()``.
        reducer: default ``avg_nonzero()`` over triplets.

    Returns:
        0-d tensor in ``embeddings.dtype``.

    Example:
        >>> emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = triplet_margin(emb, labels, margin=0.2)

    Reference: Weinberger, Saul, "Distance Metric Learning for Large Margin Nearest Neighbor
    Classification", JMLR 2009; Schroff et al., "FaceNet", CVPR 2015 (swap: Balntas et al.,
    "Learning local feature descriptors with triplets and shallow convolutional neural networks",
    BMVC 2016).
    """
    return run(
        TRIPLET_MARGIN,
        embeddings,
        labels,
        ref_emb,
        ref_labels,
        indices_tuple,
        mat,
        distance,
        reducer,
        embedding_regularizer=embedding_regularizer,
        embedding_reg_weight=embedding_reg_weight,
        margin=margin,
        swap=swap,
        smooth_loss=smooth_loss,
    )


def _triplet_margin_terms(batch: Batch, *, margin, swap, smooth_loss) -> dict[str, Terms]:
    margin = _checks.hyper(margin, "margin")
    swap, smooth_loss = bool(swap), bool(smooth_loss)
    sign = batch.distance.sign()
    it = batch.indices_tuple
    if it is not None and not is_mined(it) and len(it) == 3:  # a PML triplet tuple
        a, p, n = (t.long() for t in it)
        it = MinedTriplets(a, p, n, torch.ones(a.shape, device=a.device))
    if isinstance(it, MinedTriplets):
        a, p, n = it.anchors.long(), it.positives.long(), it.negatives.long()
        weights = it.valid
        if batch.rows is not None:  # a chunk: the triplets of its own anchors
            r0, r1 = batch.rows
            weights = weights * ((a >= r0) & (a < r1)).to(weights.dtype)
            a = (a - r0).clamp(0, r1 - r0 - 1)
        # only the listed pairs' distances: O(L·D), not the B × M matrix
        e_ap, e_an = sign * batch.pair_values(a, p), sign * batch.pair_values(a, n)
        if swap:
            if batch.ref_emb is not None:
                e_pn = sign * batch.distance.pairs(batch.ref_emb[p], batch.ref_emb[n])
            else:
                e_pn = sign * batch.pair_values(p, n)
            e_an = torch.minimum(e_an, e_pn)
        x = e_ap - e_an + scalar_like(margin, e_ap)
        losses = F.softplus(x) if smooth_loss else F.relu(x)
        weights = weights.to(losses.dtype)
        terms: Terms = DenseTerms(losses, weights, "triplet", batch.num_anchors, anchor_index=a)
        return {"loss": terms}
    e = sign * batch.mat
    margin = scalar_like(margin, e)
    e_pn = _ref_self(batch, sign) if swap and batch.ref_emb is not None else None
    swap_self = swap and batch.ref_emb is None
    if isinstance(it, (TripletWindow, TripletMask)):
        # the miner's own label masks (the batch's masks hold its pair multiplicities)
        select = _select_rows(it, batch.rows)
        if isinstance(it, TripletWindow):
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


def _triplet_unchunkable(*, swap, **_) -> str | None:
    if swap:
        return "swap=True compares each positive with each negative (rows of other anchors)"
    return None


TRIPLET_MARGIN = LossSpec(
    "triplet_margin", _triplet_margin_terms, lp(), avg_nonzero(), _triplet_unchunkable
)
register(triplet_margin, TRIPLET_MARGIN)


def _ref_self(batch, sign: float) -> Tensor:
    """``e`` between reference rows (for swap with a separate reference set)."""
    return sign * batch.distance.matrix(batch.ref_emb)
