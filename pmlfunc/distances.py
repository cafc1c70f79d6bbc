"""Distances and similarities between rows of two embedding matrices.

Every distance is an immutable, hashable object called as ``d(x, y=None)`` that returns the
``(B, M)`` matrix between the rows of ``x`` (``B × D``) and ``y`` (``M × D``); ``y=None`` means
``y = x`` (the self-distance of a batch). ``d.is_similarity`` tells the direction: ``True`` when a
larger value means closer (cosine, dot), ``False`` for distances (lp, snr).

Float16/bfloat16 inputs are computed in float32 and the matrix is returned in the input dtype.
Losses call :meth:`Distance.matrix` instead, which keeps the float32 result for their reductions.

The Euclidean distance (``lp(p=2)``) is the *safe-matmul* distance of DESIGN.md: the expansion
``‖a‖² + ‖b‖² − 2a·b`` (one matmul), then, per row, the ``exact_budget`` entries with the smallest
``d² / (‖a‖² + ‖b‖²)``—the only entries where the expansion cancels catastrophically—are
recomputed exactly from the differences ``a − b``. Nothing of size ``B × M × D`` is ever
allocated; the backward is two matmuls with a zero (not NaN) gradient at ``d = 0``, the
recomputed entries' gradient again from their differences (the matmuls' ``a Σ w − Σ w b``
cancels there as the expansion does: 0.4–1 % off in float32 for rows 1e-5 apart); the
self-distance diagonal is exactly zero.

Error bound (float32 compute, eps = 2⁻²³): an entry recomputed exactly has the error of a direct
difference, ``|d − d*| ≤ ~D·eps·d*``. Any other entry has ``d² ≥ r·(‖a‖² + ‖b‖²)`` where ``r`` is
the row's ``(exact_budget+1)``-th smallest ratio, and the expansion's absolute error on ``d²`` is at
most ``~2·√D·eps·(‖a‖² + ‖b‖²)``, so ``|d − d*| ≤ √D·eps·(‖a‖² + ‖b‖²) / d*``. Rows with more than
``exact_budget`` near-duplicates keep expansion values for the surplus (clamped at 0). For
float16/bfloat16 inputs the float32 error is far below the output rounding (``2⁻¹¹``/``2⁻⁹``
relative).

On a CPU the recomputed entries are those with ratio below ``NEAR_RATIO`` (¼), at most
``exact_budget`` a row (the smallest), and when no entry is below it no per-row ``topk`` runs
(half a matmul at B = 512): eagerly; under ``torch.compile`` inside the in-place custom
operator ``pmlfunc::exact_entries_`` (the eager code, with the clamp and the tie merge:
:func:`_exact_in_place`); inside ``torch.func`` transforms as the custom operator
``pmlfunc::near_columns``. Every other entry then has ``r ≥ ¼``, where
the expansion's relative error, ``≤ 4·√D·eps``, is of the order of the direct difference's;
the recomputed entries are the same values an accelerator's per-row ``topk`` recomputes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, overload

import numpy as np
import torch
from torch import Tensor

from . import _checks, _ops

__all__ = ["Distance", "cosine", "dot", "lp", "safe_euclidean", "snr"]


# ---------------------------------------------------------------------------------------------
# The safe-matmul Euclidean distance
# ---------------------------------------------------------------------------------------------


TIE_BUDGET = 32  # rows per call that duplicate an earlier row and are made bitwise equal to it


def _ties(x: Tensor) -> Tensor | None:
    """The rows of ``x`` that duplicate an earlier row, and that row: a ``(2, k)`` index tensor
    ``[dup; src]`` with ``k = min(TIE_BUDGET, B − 1)`` (an entry that is no duplicate has
    ``src = dup``: a no-op copy). Rows are sorted by a weighted sum of their values and only
    neighbours with equal sums are compared exactly, the first ``k`` such pairs (``O(B·D +
    B log B + k·D)``, static shapes, no host sync). A group of equal rows maps to its first
    (smallest) index. Rows that are equal but not neighbours after the sort, through a collision
    of the sums of different rows, are left apart.

    ``None`` (nothing to merge) when no two sums are equal and the values can be read for free
    (:func:`~pmlfunc._ops.readable`: CPU, eager): the common case skips the rest, ~20 small
    ops a call."""
    b, d = x.shape[-2:]
    v = x.detach()  # -0.0 == 0.0 below, as in the sums
    h = (v * torch.linspace(1.0, 2.0, d, dtype=v.dtype, device=v.device)).sum(-1)
    if _ops.readable(h) and h.ndim == 1:  # NumPy's sort: a few µs instead of ~20 small ops
        sums = np.sort(h.numpy())
        if not (sums[1:] == sums[:-1]).any():
            return None
    order = h.argsort(stable=True)
    hs = h[order]
    cand = hs[1:] == hs[:-1]  # sorted neighbours with equal sums
    if _ops.readable(cand) and not bool(cand.any()):
        return None
    k = min(TIE_BUDGET, b - 1)
    pos = torch.arange(b, device=x.device)
    # the first k candidates (the sentinel b - 1 clamps to the last pair, a repeat: same values)
    idx = torch.where(cand, pos[:-1], b - 1).topk(k, largest=False).values.clamp_max(b - 2)
    lo, hi = order[idx], order[idx + 1]
    same_k = cand[idx] & (v.index_select(-2, lo) == v.index_select(-2, hi)).all(-1)
    same = torch.zeros_like(cand).index_put_((idx,), same_k)
    start = torch.cat([torch.ones(1, dtype=torch.bool, device=x.device), ~same])
    first = torch.where(start, pos, 0).cummax(0).values  # a sorted group's first position
    return torch.stack([hi, torch.where(same_k, order[first[idx + 1]], hi)])


def _merge_ties_(mat: Tensor, rows: Tensor | None, cols: Tensor | None) -> Tensor:
    """Make the rows (and columns) of ``mat`` that belong to duplicated embeddings bitwise equal
    to their first copy's (``rows``/``cols`` from :func:`_ties`; ``None``: none). In place
    where the transforms allow; returns the matrix."""
    for dim, ties in ((0, rows), (1, cols)):
        if ties is not None:
            mat = _ops.index_copy_(mat, dim, ties[0], mat.index_select(dim, ties[1]))
    return mat


NEAR_RATIO = 0.25  # CPU: entries with a smaller d² / (‖a‖² + ‖b‖²) are recomputed


def _near_columns(key: Tensor, budget: int, threshold: float) -> tuple[Tensor, Tensor | None]:
    """The columns of each row to recompute exactly: ``(index, valid)``, both ``(..., B, k)``.

    On an accelerator, the ``budget`` smallest keys of each row (one ``topk``), all valid
    (``None``). On a CPU, the ``budget`` smallest among the keys below ``threshold``: where no
    key is below it (nothing near anything, the common case) no ``topk`` runs at all (at
    B = 512 it costs half a matmul), and a slot whose key is not below it is not valid. In
    eager mode a direct call; under ``torch.compile`` and ``torch.func`` transforms the same
    function as the custom operator ``pmlfunc::near_columns``."""
    if key.device.type != "cpu":
        return key.topk(budget, dim=-1, largest=False, sorted=False).indices, None
    if _ops.readable(key):
        return _cpu_near_columns(key, budget, threshold)
    return _near_columns_op(key, budget, threshold)


def _cpu_near_columns(key: Tensor, budget: int, threshold: float) -> tuple[Tensor, Tensor]:
    if bool(key.amin() >= threshold):  # nothing near anything (a NaN key reads as near)
        shape = (*key.shape[:-1], budget)
        return key.new_zeros(shape, dtype=torch.long), key.new_zeros(shape, dtype=torch.bool)
    values, index = key.topk(budget, dim=-1, largest=False, sorted=False)
    return index, values < threshold


@torch.library.custom_op("pmlfunc::near_columns", mutates_args=(), device_types="cpu")
def _near_columns_op(key: Tensor, budget: int, threshold: float) -> tuple[Tensor, Tensor]:
    return _cpu_near_columns(key, budget, threshold)


@_near_columns_op.register_fake
def _(key: Tensor, budget: int, threshold: float) -> tuple[Tensor, Tensor]:
    shape = (*key.shape[:-1], budget)
    return key.new_empty(shape, dtype=torch.long), key.new_empty(shape, dtype=torch.bool)


def _near_columns_vmap(info, in_dims, key: Tensor, budget: int, threshold: float):
    # rows along the last dim whatever the leading dims: the batch dim in front, one call
    dim = in_dims[0]
    out = _near_columns_op(key if dim is None else key.movedim(dim, 0), budget, threshold)
    return out, (0, 0)


_near_columns_op.register_vmap(_near_columns_vmap)


def _keep_invalid(exact: Tensor, valid: Tensor | None, buf: Tensor, index: Tensor) -> Tensor:
    """``exact`` on the valid slots, ``buf``'s own entries at ``index`` on the others."""
    return exact if valid is None else torch.where(valid, exact, buf.gather(-1, index))


def _squared_differences(gathered: Tensor, x: Tensor) -> Tensor:
    """``Σ (gathered − x)²`` over the last dim, in place on ``gathered`` (a fresh gather of
    rows). (a − b)² = (b − a)²: the same value from either side."""
    diff = gathered.sub_(x)
    return diff.mul_(diff).sum(-1)


def _expansion(
    x: Tensor, y: Tensor, budget: int, self_mode: bool, normalized: bool, ties: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Squared distances by the matmul expansion, with the ``budget`` most cancellation-prone
    entries of each row recomputed exactly from the differences, and those entries' columns
    ``(index, valid)`` (:func:`_exact_entries`: the backward takes the same entries from the
    differences, :func:`_near_correction`). Runs inside a Function's forward (no autograd), so
    it works in place on its own buffers.

    Ties are exact where they decide something: the rows and columns of duplicated embeddings
    are bitwise equal (:func:`_merge_ties_`), the self-matrix has a zero diagonal, and its
    recomputed (near) entries are written to both halves, so that they are symmetric bitwise. The
    other entries of the self-matrix are symmetric to the matmul's rounding (``G_ij`` and
    ``G_ji`` may differ in the last bit; symmetrising them costs a transposed copy of the matrix,
    ~40% of the matmul on CPU)."""
    sq_x = (x * x).sum(-1).unsqueeze(-1)
    sq_y = (y * y).sum(-1).unsqueeze(-2)
    # One B × M buffer, updated in place (every fresh CPU buffer costs page faults).
    d2 = _ops.matmul(x, y.transpose(-1, -2)).mul_(-2.0).add_(sq_x).add_(sq_y)
    n_cols = d2.shape[-1]
    k = min(budget, n_cols - 1 if self_mode else n_cols)
    key = None
    if k > 0:
        # Rank entries by d² / (‖a‖² + ‖b‖²): the relative size of the cancellation error.
        # Unit-norm rows have a constant denominator, so d² itself ranks them (its diagonal is
        # set to +inf here and to 0 below).
        if not normalized:
            key = d2 / (sq_x + sq_y).clamp_min_(torch.finfo(d2.dtype).tiny)
        if self_mode:
            (d2 if key is None else key).diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    threshold = 2.0 * NEAR_RATIO if normalized else NEAR_RATIO
    if _exact_in_place(d2):
        idx, valid = _exact_entries_op(d2, key, x, y, k, threshold, self_mode, ties)
        return d2, idx, valid
    return _exact_entries(d2, key, x, y, k, threshold, self_mode, ties)


def _exact_entries(
    d2: Tensor,
    key: Tensor | None,
    x: Tensor,
    y: Tensor,
    budget: int,
    threshold: float,
    self_mode: bool,
    ties: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The expansion ``d2`` made exact where it matters, in place where the transforms allow:
    each row's near entries (:func:`_near_columns` of ``key``, ``None``: ``d2`` itself; none if
    ``budget`` is 0) recomputed from the differences (in self mode written to both halves:
    symmetric bitwise), negatives clamped to 0, the self-matrix's diagonal 0, and (``ties``)
    the rows and columns of duplicated embeddings bitwise equal (:func:`_merge_ties_`).
    Returns ``(d2, index, valid)``: the recomputed entries' columns, ``(..., B, k)`` (``k = 0``
    with no budget; on an accelerator every slot valid).

    A self-matrix whose near entries were read and found to be none has no duplicated rows (a
    row's copy is at ``d² ≈ 0``, a key far below the threshold): its tie search is skipped
    (~0.2 ms a call at 512 × 128 inside a training step, where its small ops run cold)."""
    nothing_near = False
    if budget > 0:
        idx, valid = _near_columns(d2 if key is None else key, budget, threshold)
        nothing_near = valid is not None and _ops.readable(valid) and not bool(valid.any())
        if not nothing_near:
            # (B, k, D) rows of y: the static per-row budget (index_select: far faster than y[idx])
            near_y = y.index_select(-2, idx.reshape(-1)).view(*idx.shape, y.shape[-1])
            exact = _squared_differences(near_y, x.unsqueeze(-2))
            # a slot that is not valid writes back the value it holds
            d2 = _ops.scatter_(d2, idx, _keep_invalid(exact, valid, d2, idx))
            if self_mode:  # the same entries in the other half
                d2t = d2.transpose(-1, -2)
                d2 = _ops.scatter_(d2t, idx, _keep_invalid(exact, valid, d2t, idx))
                d2 = d2.transpose(-1, -2)
        if valid is None:
            valid = torch.ones_like(idx, dtype=torch.bool)
    else:
        idx = d2.new_zeros((*d2.shape[:-1], 0), dtype=torch.long)
        valid = idx.new_zeros(idx.shape, dtype=torch.bool)
    d2.clamp_min_(0.0)
    if self_mode:
        d2.diagonal(dim1=-2, dim2=-1).fill_(0.0)
    if not ties or (self_mode and nothing_near):
        return d2, idx, valid
    rows = _ties(x)
    return _merge_ties_(d2, rows, rows if self_mode else _ties(y)), idx, valid


def _exact_in_place(d2: Tensor) -> bool:
    """Whether :func:`_expansion` makes its entries exact through the in-place operator
    ``pmlfunc::exact_entries_`` (:func:`_exact_entries`, run eagerly): a CPU matrix under
    ``torch.compile``, outside ``torch.func`` transforms. The static path's scatters and
    index copies are functionalised there into copies of the whole matrix (four in a
    self-distance), and its ties' search into about twenty small ops, where the eager code
    reads the keys' minimum and the rows' sorted sums and, with nothing near and no duplicate
    (the common case), writes nothing."""
    return d2.device.type == "cpu" and torch.compiler.is_compiling() and not _ops.inside_transform()


def _exact_entries_in_place(*args) -> tuple[Tensor, Tensor]:
    """:func:`_exact_entries` with its arguments as given, ``d2`` (the first) written in place
    (eager, outside transforms: it returns its input), returning the near columns."""
    d2, idx, valid = _exact_entries(*args)
    assert d2.data_ptr() == args[0].data_ptr()
    return idx, valid


def _fake_near_columns(d2: Tensor, key, x, y, budget, *args) -> tuple[Tensor, Tensor]:
    shape = (*d2.shape[:-1], budget)
    return d2.new_empty(shape, dtype=torch.long), d2.new_empty(shape, dtype=torch.bool)


# _exact_entries' arguments, spelled once here as the operator's schema (not re-declared as a
# second annotated signature)
_exact_entries_op = torch.library.custom_op(
    "pmlfunc::exact_entries_",
    _exact_entries_in_place,
    mutates_args=("d2",),
    device_types="cpu",
    schema="(Tensor(a!) d2, Tensor? key, Tensor x, Tensor y, SymInt budget, float threshold, "
    "bool self_mode, bool ties) -> (Tensor, Tensor)",
)
_exact_entries_op.register_fake(_fake_near_columns)


def _euclid_weights(g: Tensor, d: Tensor, squared: bool) -> Tensor:
    """``∂L/∂(d²)·2``: the weight ``w`` with ``∂L/∂x_i = Σ_j w_ij (x_i − y_j)``; 0 (not NaN) at
    ``d = 0`` (duplicates, the diagonal), without a where."""
    if squared:
        return 2.0 * g
    dd = (d * d).clamp_min_(torch.finfo(d.dtype).tiny)
    return (g * d).div_(dd)


def _near_correction(
    w: Tensor, x: Tensor, y: Tensor, idx: Tensor, valid: Tensor, self_mode: bool
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """The weights ``w`` with the forward's recomputed entries (``(idx, valid)``,
    :func:`_exact_entries`) zeroed, and those entries' gradient from the differences: a pair
    ``(Σ_k c_ik (x_i − y_{j_k}), the same terms added into y's rows)``, the first to add to
    ``x``'s gradient, the second to subtract from ``y``'s (``None``: no entry to correct).
    The two matmuls' ``x_i Σ_j w_ij − Σ_j w_ij y_j`` cancels where ``y_j`` is near ``x_i``:
    its error is ``~eps·w_ij·‖x_i‖``, against a gradient of size ``w_ij·d_ij`` (0.4–1 %
    relative for rows 1e-5 apart in float32); the differences have none. In self mode both
    halves' entries are taken (the forward wrote each near entry to both), each weight once.

    Nothing to do (no budget; in eager CPU mode, no valid slot: nothing near anything) costs
    nothing. In place on ``w`` (the backward's own buffer) outside transforms and when no graph
    is recorded (a double backward records these ops)."""
    if idx.shape[-1] == 0 or (_ops.readable(valid) and not bool(valid.any())):
        return w, None
    in_place = not torch.is_grad_enabled() and (
        torch.compiler.is_compiling() or not _ops.inside_transform()
    )
    scatter = Tensor.scatter_ if in_place else Tensor.scatter
    zero = torch.zeros((), dtype=w.dtype, device=w.device)

    def take(buf: Tensor) -> tuple[Tensor, Tensor]:
        # the valid slots' weights, and the buffer with them zeroed (the others written back)
        held = buf.gather(-1, idx)
        return torch.where(valid, held, zero), scatter(buf, -1, idx, torch.where(valid, zero, held))

    c, w = take(w)
    if self_mode:  # (j, i) of every listed (i, j); a pair listed both ways was zeroed above
        c_t, w_t = take(w.transpose(-1, -2))
        c, w = c + c_t, w_t.transpose(-1, -2)
    near = y.index_select(-2, idx.reshape(-1)).view(*idx.shape, y.shape[-1])
    v = (x.unsqueeze(-2) - near) * c.unsqueeze(-1)  # (B, k, D): c_ik (x_i − y_{j_k})
    into = torch.zeros_like(y).index_add(-2, idx.reshape(-1), v.reshape(-1, v.shape[-1]))
    return w, (v.sum(-2), into)


def _euclid_backward(
    g: Tensor, d: Tensor, x: Tensor, y: Tensor, near: tuple[Tensor, Tensor], squared: bool
) -> tuple[Tensor, Tensor]:
    """Gradients of ``d_ij = ‖x_i − y_j‖`` (or its square) w.r.t. ``x`` and ``y``: two matmuls,
    the forward's recomputed entries from their differences (:func:`_near_correction`)."""
    w, exact = _near_correction(_euclid_weights(g, d, squared), x, y, *near, self_mode=False)
    grad_x = x * w.sum(-1, keepdim=True) - _ops.matmul(w, y)
    grad_y = y * w.sum(-2).unsqueeze(-1) - _ops.matmul(w.transpose(-1, -2), x)
    if exact is not None:
        grad_x, grad_y = grad_x + exact[0], grad_y - exact[1]
    return grad_x, grad_y


def _euclid_backward_self(
    g: Tensor, d: Tensor, x: Tensor, near: tuple[Tensor, Tensor], squared: bool
) -> Tensor:
    """The gradient of ``d_ij = ‖x_i − x_j‖`` (or its square) w.r.t. ``x``, both sides summed:
    ``x·(Σ_j w_ij + Σ_j w_ji) − (w + wᵀ) x`` (:func:`~pmlfunc._ops.self_product_grad`), the
    forward's recomputed entries from their differences (:func:`_near_correction`)."""
    w, exact = _near_correction(_euclid_weights(g, d, squared), x, x, *near, self_mode=True)
    grad = x * (w.sum(-1) + w.sum(-2)).unsqueeze(-1) - _ops.self_product_grad(w, x)
    return grad if exact is None else grad + (exact[0] - exact[1])


class _SafeEuclidean(torch.autograd.Function):
    """``‖x_i − y_j‖`` (or its square) for two separate sets, and the columns its forward
    recomputed exactly (``(index, valid)``, not differentiable: :func:`_exact_entries`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, y: Tensor, squared: bool, budget: int, normalized: bool, ties: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        d2, idx, valid = _expansion(x, y, budget, self_mode=False, normalized=normalized, ties=ties)
        return _ops.fresh(d2 if squared else d2.sqrt_()), idx, valid

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, squared, _, _, _ = inputs
        ctx.squared = squared
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(x, y, *output)

    @staticmethod
    def backward(ctx, g, *_):
        x, y, d, idx, valid = ctx.saved_tensors
        grad_x, grad_y = _euclid_backward(g, d, x, y, (idx, valid), ctx.squared)
        return grad_x, grad_y, None, None, None, None


class _SafeEuclideanSelf(torch.autograd.Function):
    """``‖x_i − x_j‖`` (or its square) of a batch with itself; exact-zero diagonal. Also returns
    the columns its forward recomputed exactly, as :class:`_SafeEuclidean`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, squared: bool, budget: int, normalized: bool, ties: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        d2, idx, valid = _expansion(x, x, budget, self_mode=True, normalized=normalized, ties=ties)
        return _ops.fresh(d2 if squared else d2.sqrt_()), idx, valid

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, squared, _, _, _ = inputs
        ctx.squared = squared
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(x, *output)

    @staticmethod
    def backward(ctx, g, *_):
        x, d, idx, valid = ctx.saved_tensors
        return _euclid_backward_self(g, d, x, (idx, valid), ctx.squared), None, None, None, None


class _TiedMatmul(torch.autograd.Function):
    """The matmul similarity ``x yᵀ`` (``y=None``: ``scale · x xᵀ``) with the rows and columns
    of duplicated embeddings made bitwise equal (:func:`_merge_ties_`, in place on the product's
    own buffer: no copy of the matrix). That changes values by rounding only (the function is
    the same), so the backward is the matmul's: each entry's gradient goes to the rows it was
    computed from (an autograd ``index_copy_`` would move it to the first copy's row instead).
    In self mode both sides' gradients come from one product where that is cheaper
    (:func:`~pmlfunc._ops.self_product_grad`), and ``scale`` (a number or a 0-d tensor, folded
    into the rows; ``None``: 1) is an input of its own so that it does not split the two sides
    apart. The backward is written in differentiable ops: higher derivatives work."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor,
        y: Tensor | None,
        rows: Tensor | None,
        cols: Tensor | None,
        scale: float | Tensor | None = None,
    ) -> Tensor:
        # y is None in self mode (compile rejects one tensor given twice); rows / cols None: no
        # ties on that side. A cross product takes no scale (its caller folds it into x).
        xs = x if scale is None else x * scale
        mat = _ops.matmul(xs, (x if y is None else y).transpose(-1, -2))
        return _ops.fresh(_merge_ties_(mat, rows, rows if y is None else cols))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, _, _, scale = inputs
        ctx.scale = None if isinstance(scale, Tensor) else scale
        ctx.save_for_backward(x, y, scale if isinstance(scale, Tensor) else None)

    @staticmethod
    def backward(ctx, g):
        x, y, scale_t = ctx.saved_tensors
        if y is None:  # x on both sides: gₓ = scale·(g + gᵀ) x
            scale = scale_t if scale_t is not None else ctx.scale
            if not ctx.needs_input_grad[4]:  # the scale on g, before the products
                return _ops.self_product_grad(g, x, scale), None, None, None, None
            h = _ops.self_product_grad(g, x)
            # ∂/∂scale = Σ g_ij x_i·x_j = ½ Σ (h ⊙ x)
            return h * scale, None, None, None, 0.5 * (h * x).sum()
        gx = _ops.matmul(g, y) if ctx.needs_input_grad[0] else None
        gy = _ops.matmul(g.transpose(-1, -2), x) if ctx.needs_input_grad[1] else None
        return gx, gy, None, None, None


# ---------------------------------------------------------------------------------------------
# Listed row pairs: d(x_{i_k}, y_{j_k}) without the matrix
# ---------------------------------------------------------------------------------------------


def _scatter_rows(
    x: Tensor,
    y: Tensor | None,
    i: Tensor,
    j: Tensor,
    gi: Tensor | None,
    gj: Tensor | None,
    alpha: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``x`` and ``y`` from those of their gathered rows: ``alpha·gi`` of
    ``x[i]`` (``(L, D)``, or ``(K, L, D)``: ``x[i]`` used ``K`` times) and ``gj`` of ``y[j]``
    (``(*j.shape, D)``; ``None``: no gradient). One zero buffer per input, the rows added into
    it (``y is None``: both sides into ``x``'s buffer); a ``(K, L, D)`` ``gi`` is added
    one ``(L, D)`` block at a time (on a CPU cheaper than summing the blocks first).

    In place on the fresh buffers where the transforms allow; out of place inside ``torch.func``
    transforms, whose batched ``index`` or ``src`` cannot be added into an unbatched buffer in
    place (as :func:`~pmlfunc._ops.scatter_`)."""
    in_place = torch.compiler.is_compiling() or not _ops.inside_transform()
    add = Tensor.index_add_ if in_place else Tensor.index_add
    gx = torch.zeros_like(x)
    if gi is not None:
        for block in gi.unbind(0) if gi.ndim > 2 else (gi,):
            gx = add(gx, 0, i, block, alpha=alpha)
    gy = gx if y is None else torch.zeros_like(y)
    if gj is not None:
        gy = add(gy, 0, j.reshape(-1), gj.reshape(-1, gj.shape[-1]))
    return (gy, None) if y is None else (gx, gy)


def _gather(x: Tensor, y: Tensor | None, i: Tensor, j: Tensor) -> tuple[Tensor, Tensor]:
    """``(x[i], y[j])``, ``(L, D)`` and ``(*j.shape, D)`` (``y=None``: ``x[j]``), by
    ``index_select`` (far faster than advanced indexing on a CPU)."""
    src = x if y is None else y
    return x.index_select(0, i), src.index_select(0, j.reshape(-1)).view(*j.shape, src.shape[-1])


class _GatherRows(torch.autograd.Function):
    """``(x[i], y[j])`` (``y=None``: ``x[j]``) as one node whose backward adds both gathered
    gradients into one zero buffer per input: autograd's ``x[i]`` and ``x[j]`` fill a zero
    buffer of ``x``'s shape each, then add them (on a CPU a fresh buffer's page faults cost
    more than the gather itself). Written in differentiable ops: higher derivatives work."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, y: Tensor | None, i: Tensor, j: Tensor) -> tuple[Tensor, Tensor]:
        return _gather(x, y, i, j)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, i, j = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, y, i, j)

    @staticmethod
    def backward(ctx, gu, gv):
        x, y, i, j = ctx.saved_tensors
        gx, gy = _scatter_rows(x, y, i, j, gu, gv)
        return gx, gy, None, None


class _ListedEuclidean(torch.autograd.Function):
    """``(‖x_i − y_j‖, y_j − x_i)`` of listed row pairs (``squared``: the squared norm), with
    ``i`` of shape ``(L,)`` and ``j`` of shape ``(L,)`` or ``(K, L)`` (each ``x_{i_l}`` against
    ``K`` rows ``y_{j_{k,l}}``: an anchor's row is gathered once for its positive and its
    negative); ``y=None``: ``y = x``.

    The row differences are an output of their own (differentiable, usually unused) so that
    the backward reads them instead of gathering again; it scales them by ``∂L/∂d / d`` (0, not
    NaN, at ``d = 0``: :func:`_euclid_weights`) and adds them into one zero buffer per input:
    ``O(K·L·D)`` each way, no matrix. Written in differentiable ops: higher derivatives work."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, y: Tensor | None, i: Tensor, j: Tensor, squared: bool
    ) -> tuple[Tensor, Tensor]:
        xi, yj = _gather(x, y, i, j)
        diff = yj.sub_(xi)  # in place on the fresh gather
        d = (diff * diff).sum(-1) if squared else torch.linalg.vector_norm(diff, dim=-1)
        return d, _ops.fresh(diff)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, i, j, squared = inputs
        ctx.squared = squared
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, y, i, j, *output)

    @staticmethod
    def backward(ctx, g, g_diff):
        x, y, i, j, d, diff = ctx.saved_tensors
        rows = _difference_grads(g, g_diff, d, diff, ctx.squared)
        if rows is None:  # neither output reached the loss
            return None, None, None, None, None
        # ∂/∂y_j = rows, ∂/∂x_i = −rows (summed over the K partners of x_i)
        gx, gy = _scatter_rows(x, y, i, j, rows, rows, -1.0)
        return gx, gy, None, None, None


def _difference_grads(
    g: Tensor | None, g_diff: Tensor | None, d: Tensor, diff: Tensor, squared: bool
) -> Tensor | None:
    """The gradient of row differences ``diff = y − x`` from those of their norms ``d`` (or
    squares) and of the differences themselves (either ``None``: did not reach the loss):
    ``diff · ∂L/∂d / d + g_diff``, 0 (not NaN) at ``d = 0``."""
    if g is None:
        return g_diff
    rows = diff * _euclid_weights(g, d, squared).unsqueeze(-1)
    return rows if g_diff is None else rows + g_diff


class _PackagedEuclidean(torch.autograd.Function):
    """``(‖x_{t,k} − x_{t,0}‖, x_{t,k} − x_{t,0})`` for ``k = 1, 2`` of packaged rows ``x``
    ``(T, 3, D)`` (``squared``: the squared norm): each triplet's anchor against its positive
    and its negative, both ``(T, 2)`` distances from one subtraction of strided views (no
    gather). The backward writes the three rows' gradients as one concatenation, ``(−Σ_k r_k,
    r_1, r_2)``: no zero buffer and no scattered add (:class:`_ListedEuclidean` otherwise).
    Written in differentiable ops: higher derivatives work."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, squared: bool) -> tuple[Tensor, Tensor]:
        diff = x[..., 1:, :] - x[..., :1, :]
        d = (diff * diff).sum(-1) if squared else torch.linalg.vector_norm(diff, dim=-1)
        return d, diff

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.squared = inputs[1]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*output)

    @staticmethod
    def backward(ctx, g, g_diff):
        d, diff = ctx.saved_tensors
        rows = _difference_grads(g, g_diff, d, diff, ctx.squared)
        if rows is None:
            return None, None
        return torch.cat([rows.sum(-2, keepdim=True).neg_(), rows], dim=-2), None


def safe_euclidean(
    x: Tensor, y: Tensor | None = None, *, squared: bool = False, exact_budget: int = 8
) -> Tensor:
    """Pairwise Euclidean distances ``‖x_i − y_j‖₂`` (``squared=True``: ``‖x_i − y_j‖₂²``).

    The matmul expansion with the ``exact_budget`` most cancellation-prone entries of every row
    recomputed from the differences (see the module docstring for the error bound). Computed in
    float32 for float16/bfloat16 inputs and returned in that precision. ``y=None`` is the
    self-distance of ``x`` with an exact-zero diagonal.

    Example:
        >>> x = torch.randn(4, 3)
        >>> safe_euclidean(x).diagonal()
        tensor([0., 0., 0., 0.])
    """
    _checks.embeddings(x, "x")  # (as a Distance checks its inputs)
    if y is not None:
        _checks.embeddings(y, "y")
        _checks.same_space(x, y, "y", "x")
    exact_budget = _checks.integer(exact_budget, "exact_budget", minimum=0)
    out_dtype = x.dtype
    cd = _checks.compute_dtype(out_dtype)
    xc = x.to(cd)
    if y is None:
        d = _ops.apply(_SafeEuclideanSelf, xc, squared, int(exact_budget), False, True)[0]
    else:
        d = _ops.apply(_SafeEuclidean, xc, y.to(cd), squared, int(exact_budget), False, True)[0]
    return d.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Distance objects
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Distance:
    """Base class: a frozen (immutable, hashable) description of a distance."""

    is_similarity: ClassVar[bool] = False
    kind: ClassVar[str] = ""  # the family, "lp", "dot" or "snr": what a loss that needs one checks

    def __call__(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """The ``(B, M)`` matrix between the rows of ``x`` and ``y`` (``y=None``: ``x`` itself)."""
        return self.matrix(x, y).to(x.dtype)

    def matrix(
        self,
        x: Tensor,
        y: Tensor | None = None,
        *,
        ties: bool = True,
        scale: float | Tensor | None = None,
    ) -> Tensor:
        """Like ``__call__`` but returns float32 for float16/bfloat16 inputs (losses reduce in it).

        ``ties=False`` skips making duplicated rows' entries bitwise equal (the exact ties of
        the module docstring): for a caller whose result is a smooth function of the matrix,
        where a rounding difference between duplicates decides nothing (proxy losses).

        ``scale``: return ``scale · matrix`` (a number or a 0-d tensor, which may be learnable).
        A matmul similarity (:func:`dot`, :func:`cosine`) folds it into the rows of ``x`` before
        the product, which saves a pass over the ``B × M`` result in both directions; the others
        multiply once."""
        _checks.embeddings(x, "x")
        if y is not None:
            _checks.embeddings(y, "y")
            _checks.same_space(x, y, "y", "x")
        cd = _checks.compute_dtype(x.dtype)
        x = x.to(cd)
        return self._scaled(x, None if y is None else y.to(cd), ties, _as(scale, x))

    def pairs(self, x: Tensor, y: Tensor) -> Tensor:
        """Row-aligned distances ``d(x_i, y_i)`` of two ``(L, D)`` tensors, shape ``(L,)``, in the
        compute dtype: what a loss needs when it reads ``L`` listed pairs, not the whole matrix.

        Computed from differences (exact, no cancellation); the gradient of a Euclidean
        distance is 0, not NaN, at ``x_i = y_i``.
        """
        if x.ndim != 2 or x.shape != y.shape:
            raise ValueError(
                f"pairs needs two (L, D) tensors of equal shape, got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        cd = _checks.compute_dtype(x.dtype)
        return self._pairs(x.to(cd), y.to(cd))

    def _pairs(self, x: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def indexed_pairs(self, x: Tensor, i: Tensor, j: Tensor, y: Tensor | None = None) -> Tensor:
        """Distances ``d(x_{i_l}, y_{j_l})`` of ``L`` listed row pairs, in the compute dtype;
        ``y=None`` means ``y = x`` (pairs within one batch). ``j`` may also be ``(K, L)``: each
        row ``x_{i_l}`` against ``K`` rows ``y_{j_{k,l}}`` (a triplet's anchor against its
        positive and its negative), result ``(K, L)``.

        The values of :meth:`pairs` of the gathered rows, ``self.pairs(x[i], y[j])``, for
        ``O(K·L·D)`` work each way and no ``B × M`` matrix. The rows are gathered inside one
        autograd node whose backward adds every row's gradient into one zero buffer per input
        (autograd's ``x[i]`` fills one per gather); the Euclidean distance (``p = 2``, ``power``
        1 or 2) writes its backward out: the row differences scaled by ``∂L/∂d / d``, 0 (not
        NaN) at ``d = 0``.

        Args:
            x: ``(B, D)`` rows.
            i: ``(L,)`` integer indices into ``x``.
            j: ``(L,)`` or ``(K, L)`` integer indices into ``y`` (``x`` when ``y`` is ``None``).
            y: ``(M, D)`` rows, or ``None``.

        Returns:
            ``j.shape`` distances.

        Example:
            >>> x = torch.eye(3)
            >>> lp(normalize=False).indexed_pairs(x, torch.tensor([0, 1]), torch.tensor([1, 1]))
            tensor([1.4142, 0.0000])
        """
        _checks.embeddings(x, "x")
        if y is not None:
            _checks.embeddings(y, "y")
            _checks.same_space(x, y, "y", "x")
        for name, t in (("i", i), ("j", j)):
            if not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be an int32 or int64 index tensor")
        if i.ndim != 1 or j.ndim not in (1, 2) or j.shape[-1] != i.shape[0]:
            raise ValueError(
                f"i must be (L,) and j (L,) or (K, L) indices, got {tuple(i.shape)} and "
                f"{tuple(j.shape)}"
            )
        cd = _checks.compute_dtype(x.dtype)
        return self._indexed_pairs(x.to(cd), None if y is None else y.to(cd), i, j)

    def _indexed_pairs(self, x: Tensor, y: Tensor | None, i: Tensor, j: Tensor) -> Tensor:
        u, v = _ops.apply(_GatherRows, x, y, i, j)
        return self._pairs(u, v)

    def _packaged_pairs(self, x: Tensor) -> Tensor:
        """``(T, 2)`` distances of packaged rows ``x`` ``(T, 3, D)``: each triplet's anchor
        ``x[t, 0]`` against ``x[t, 1]`` and ``x[t, 2]`` (:class:`~pmlfunc.tuples.PackagedTriplets`),
        from strided views of the rows (:meth:`indexed_pairs` would gather them)."""
        return self._pairs(x[..., :1, :], x[..., 1:, :])

    def rows(
        self,
        anchors: Tensor,
        x: Tensor,
        *,
        ties: bool = True,
        scale: float | Tensor | None = None,
    ) -> Tensor:
        """Rows of the self-distance matrix ``self.matrix(x)`` for ``anchors``, a block of ``x``'s
        own rows (:mod:`pmlfunc.chunked`): each anchor's own entry is treated as on the diagonal
        (exactly zero for Euclidean distances). In the compute dtype; ``scale`` as in
        :meth:`matrix`."""
        _checks.embeddings(anchors, "anchors")
        _checks.embeddings(x, "x")
        cd = _checks.compute_dtype(x.dtype)
        x = x.to(cd)
        return self._compute_rows(anchors.to(cd), x, ties, _as(scale, x))

    def split_normalization(self) -> tuple[Callable[[Tensor], Tensor], Distance]:
        """``(normalize, rest)`` with ``self(x, y) == rest(normalize(x), normalize(y))``: lets a
        caller normalise a batch once and reuse it (:mod:`pmlfunc.chunked`)."""
        return (lambda x: x), self

    def _compute(self, x: Tensor, y: Tensor | None, ties: bool = True) -> Tensor:
        raise NotImplementedError

    def _scaled(
        self, x: Tensor, y: Tensor | None, ties: bool, scale: float | Tensor | None
    ) -> Tensor:
        """``scale · _compute(x, y)``: one more pass (a matmul similarity folds it in)."""
        mat = self._compute(x, y, ties)
        return mat if scale is None else mat * scale

    def _compute_rows(
        self, anchors: Tensor, x: Tensor, ties: bool, scale: float | Tensor | None
    ) -> Tensor:
        return self._scaled(anchors, x, ties, scale)

    def sign(self) -> float:
        """``+1`` for distances, ``-1`` for similarities: ``sign * (a - b)`` is PML's ``margin(a, b)``."""
        return -1.0 if self.is_similarity else 1.0


@dataclass(frozen=True)
class _Normalizing(Distance):
    """A distance whose rows are L_p-normalised first when ``normalize``."""

    normalize: bool = True

    @property
    def norm_p(self) -> float:
        return 2.0

    @overload
    def _normalized(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]: ...
    @overload
    def _normalized(self, x: Tensor, y: Tensor | None) -> tuple[Tensor, Tensor | None]: ...
    def _normalized(self, x: Tensor, y: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if not self.normalize:
            return x, y
        x = _ops.unit_rows(x, self.norm_p)
        return x, None if y is None else _ops.unit_rows(y, self.norm_p)

    def split_normalization(self) -> tuple[Callable[[Tensor], Tensor], Distance]:
        if not self.normalize:
            return (lambda x: x), self
        p = self.norm_p
        return (lambda x: _ops.unit_rows(x, p)), replace(self, normalize=False)


@dataclass(frozen=True)
class _Budgeted(_Normalizing):
    """A distance built on the safe Euclidean kernel, with its per-row exact budget."""

    exact_budget: int = 8

    def _compute_rows(
        self, anchors: Tensor, x: Tensor, ties: bool, scale: float | Tensor | None
    ) -> Tensor:
        # The cross path recomputes the anchors' own (zero) entries exactly: one more budget slot
        # keeps the other entries' treatment identical to the self path.
        wider = replace(self, exact_budget=self.exact_budget + 1)
        return wider._scaled(anchors, x, ties, scale)


@dataclass(frozen=True)
class _Lp(_Budgeted):
    kind: ClassVar[str] = "lp"
    p: float = 2.0
    power: float = 1.0

    @property
    def norm_p(self) -> float:
        return self.p

    def _compute(self, x: Tensor, y: Tensor | None, ties: bool = True) -> Tensor:
        x, y = self._normalized(x, y)
        if self.p == 2:
            squared, budget = self.power == 2, self.exact_budget
            if y is None:
                mat = _ops.apply(_SafeEuclideanSelf, x, squared, budget, self.normalize, ties)[0]
            else:
                mat = _ops.apply(_SafeEuclidean, x, y, squared, budget, self.normalize, ties)[0]
            if squared:
                return mat
        else:
            mat = torch.cdist(x, x if y is None else y, p=self.p)
        if self.power != 1:
            mat = _powered(mat, self.power)
        return mat

    def _indexed_pairs(self, x: Tensor, y: Tensor | None, i: Tensor, j: Tensor) -> Tensor:
        if self.p != 2 or self.power not in (1, 2):
            return super()._indexed_pairs(x, y, i, j)
        x, y = self._normalized(x, y)
        d, _ = _ops.apply(_ListedEuclidean, x, y, i, j, self.power == 2)
        return d

    def _packaged_pairs(self, x: Tensor) -> Tensor:
        if self.p != 2 or self.power not in (1, 2):
            return super()._packaged_pairs(x)
        d, _ = _ops.apply(_PackagedEuclidean, self._normalized(x, None)[0], self.power == 2)
        return d

    def _pairs(self, x: Tensor, y: Tensor) -> Tensor:
        x, y = self._normalized(x, y)
        diff = x - y
        if self.p == 2 and self.power == 2:
            return (diff * diff).sum(-1)
        d = torch.linalg.vector_norm(diff, self.p, dim=-1)  # its gradient at 0 is 0
        return d if self.power == 1 else _powered(d, self.power)


def _powered(d: Tensor, power: float) -> Tensor:
    """``d ** power``; for ``power < 1`` with a zero gradient where ``d = 0`` (``power ·
    d^(power − 1)`` is infinite there, and a self distance's diagonal made every gradient NaN
    under a finite loss; ``torch.cdist``'s backward, PML's, gives 0). NaN stays NaN."""
    if power >= 1:
        return d**power
    zero = d == 0
    return torch.where(zero, 0.0, torch.where(zero, 1.0, d) ** power)


def lp(
    p: float = 2, power: float = 1, normalize: bool = True, *, exact_budget: int = 8
) -> Distance:
    """Minkowski distance ``‖x̂_i − ŷ_j‖_p ** power`` (PML ``LpDistance``).

    Args:
        p: the norm's order (``p >= 1``); ``p=2`` uses the safe-matmul Euclidean distance, other
            values ``torch.cdist``. Rows are normalised with the same ``p``.
        power: exponent applied to the distance; ``power=2`` with ``p=2`` is computed directly
            as the squared distance (no square root, smooth at 0).
        normalize: L_p-normalise rows first (PML's ``normalize_embeddings=True``).
        exact_budget: per-row number of entries recomputed exactly (``p=2`` only).

    Example:
        >>> d = lp()
        >>> d(torch.eye(2)).round(decimals=4)
        tensor([[0.0000, 1.4142],
                [1.4142, 0.0000]])
    """
    p = float(p)
    if not p >= 1:
        raise ValueError(f"p must be >= 1, got {p}")
    power = float(power)
    if not power > 0:
        raise ValueError(f"power must be > 0, got {power}")
    exact_budget = _checks.integer(exact_budget, "exact_budget", minimum=0)
    return _Lp(p=p, power=power, normalize=bool(normalize), exact_budget=exact_budget)


@dataclass(frozen=True)
class _Dot(_Normalizing):
    normalize: bool = False
    is_similarity: ClassVar[bool] = True
    kind: ClassVar[str] = "dot"

    def _compute(self, x: Tensor, y: Tensor | None, ties: bool = True) -> Tensor:
        return self._scaled(x, y, ties, None)

    def _scaled(
        self, x: Tensor, y: Tensor | None, ties: bool, scale: float | Tensor | None
    ) -> Tensor:
        x, y = self._normalized(x, y)
        rows = _ties(x) if ties else None  # of the unscaled rows: the same, whatever the scale
        if y is None:  # one product for both sides' gradients, the scale folded into the rows
            return _ops.apply(_TiedMatmul, x, None, rows, None, scale)
        xs = x if scale is None else x * scale
        if not ties:
            return _ops.matmul(xs, y.transpose(-1, -2))
        return _ops.apply(_TiedMatmul, xs, y, rows, _ties(y), None)

    def _pairs(self, x: Tensor, y: Tensor) -> Tensor:
        x, y = self._normalized(x, y)
        return (x * y).sum(-1)


def dot(normalize: bool = False) -> Distance:
    """Dot-product similarity ``x_i · y_j`` (PML ``DotProductSimilarity``).

    ``normalize`` defaults to ``False`` (PML 3's choice; PML 2.9.0 normalised by default).

    Example:
        >>> dot()(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]]))
        tensor([[11.]])
    """
    return _Dot(normalize=bool(normalize))


def cosine() -> Distance:
    """Cosine similarity ``x_i · y_j / (‖x_i‖ ‖y_j‖)`` (PML ``CosineSimilarity``).

    Example:
        >>> cosine()(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])).round(decimals=4)
        tensor([[0.7071]])
    """
    return _Dot(normalize=True)


@dataclass(frozen=True)
class _SNR(_Budgeted):
    kind: ClassVar[str] = "snr"

    def _compute(self, x: Tensor, y: Tensor | None, ties: bool = True) -> Tensor:
        if x.shape[-1] < 2:
            raise ValueError("snr() needs embedding size >= 2 (an unbiased variance over features)")
        x, y = self._normalized(x, y)
        # Var(x − y) = ‖(x − x̄) − (y − ȳ)‖² / (D − 1): a squared Euclidean distance of centred rows.
        xc = x - x.mean(-1, keepdim=True)
        if y is None:
            sq = _ops.apply(_SafeEuclideanSelf, xc, True, self.exact_budget, False, ties)[0]
        else:
            yc = y - y.mean(-1, keepdim=True)
            sq = _ops.apply(_SafeEuclidean, xc, yc, True, self.exact_budget, False, ties)[0]
        var_x = (xc * xc).sum(-1, keepdim=True)  # (D − 1)·Var(x_i); the (D − 1) factors cancel
        return sq / var_x

    def _pairs(self, x: Tensor, y: Tensor) -> Tensor:
        if x.shape[-1] < 2:
            raise ValueError("snr() needs embedding size >= 2 (an unbiased variance over features)")
        x, y = self._normalized(x, y)
        xc = x - x.mean(-1, keepdim=True)
        diff = xc - (y - y.mean(-1, keepdim=True))
        return (diff * diff).sum(-1) / (xc * xc).sum(-1)


def snr() -> Distance:
    """Signal-to-noise-ratio distance ``Var(x̂_i − ŷ_j) / Var(x̂_i)`` (PML ``SNRDistance``).

    Computed as a squared Euclidean distance between centred rows: no ``B × M × D`` buffer.

    Reference: Yuan et al., "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric
    Learning", CVPR 2019.

    Example:
        >>> snr()(torch.randn(3, 8)).diagonal()
        tensor([0., 0., 0.])
    """
    return _SNR()


def _as(scale: float | Tensor | None, like: Tensor) -> float | Tensor | None:
    """A ``scale`` argument in ``like``'s dtype and device (numbers and ``None`` as they are)."""
    return scale.to(dtype=like.dtype, device=like.device) if isinstance(scale, Tensor) else scale


def resolve(distance: object, default: Distance) -> Distance:
    """The distance a function uses: ``default`` when ``distance`` is ``None``, ``distance``
    itself when it is a :class:`Distance`, else a ``TypeError`` naming the argument."""
    if distance is None:
        return default
    if not isinstance(distance, Distance):
        raise TypeError(
            "distance must be a pmlfunc distance (pmlfunc.distances.lp(), cosine(), ...), "
            f"got {type(distance).__name__}"
        )
    return distance
