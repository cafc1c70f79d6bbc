"""Shared set-up of every embedding loss: validation, the distance matrix, the pair masks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _checks
from .._inputs import matrix, validate
from ..distances import Distance
from ..labels import PairMasks, any_pairs, check_tuple, pair_masks
from ..reducers import Reducer, Terms, reduce
from ..tuples import is_mined

__all__ = [
    "Batch",
    "LossSpec",
    "cross_entropy",
    "finish",
    "masked_logsumexp",
    "miner_weights",
    "prepare",
    "register",
    "run",
    "validate",
]


@dataclass
class Batch:
    """What a loss needs about its inputs, all in the compute dtype (float32 for fp16/bf16).

    A batch may be a *chunk*: the anchor rows ``rows = (r0, r1)`` of the full batch against the
    whole reference set (:mod:`pmlfunc.chunked`). ``labels`` are then the chunk's anchors' labels,
    ``diagonal`` the column offset of the anchors' own entries in self mode.
    """

    make_mat: Callable[[], Tensor]  # (B, M) distance or similarity matrix, on demand
    make_masks: Callable[[], PairMasks]  # (B, M) positive / negative pair counts, on demand
    labels: Tensor | None  # the anchors' labels
    counts: bool  # masks hold pair multiplicities (from an index tuple), not just 0/1
    distance: Distance
    out_dtype: torch.dtype
    embeddings: Tensor
    ref_emb: Tensor | None  # None in self mode
    all_labels: Tensor | None = None  # every query row's labels (the chunk's batch)
    ref_labels: Tensor | None = None
    indices_tuple: tuple | None = None
    rows: tuple[int, int] | None = None
    source: tuple = ()  # what the matrix came from (distance and tensors), for miner results
    shape: tuple[int, int] = (0, 0)  # (anchors, references) of the matrix
    given_mat: bool = False  # the caller passed mat=
    _mat: Tensor | None = None
    _masks: PairMasks | None = None

    @property
    def mat(self) -> Tensor:
        """The ``(anchors, M)`` matrix, built on first use (a loss that reads only listed
        pairs, such as the triplet loss on a miner's triplets, never builds it)."""
        if self._mat is None:
            self._mat = self.make_mat()
        return self._mat

    def pair_values(self, i: Tensor, j: Tensor) -> Tensor:
        """The matrix entries ``(i_k, j_k)`` (``i`` indexes this batch's anchor rows).

        Without the matrix at hand, and when the pairs are few (``2·L·D ≤ B·M``), they are
        computed from the listed rows only (:meth:`~pmlfunc.distances.Distance.pairs`):
        ``O(L·D)`` for ``L`` pairs instead of the ``O(B·M·D)`` matrix.
        """
        ref = self.embeddings if self.ref_emb is None else self.ref_emb
        # Gathering costs O(L·D) elementwise work (forward and backward); the matrix one matmul
        # and O(B·M): gather only when the pairs are few (batch-hard: L = B).
        few = 2 * i.numel() * ref.shape[-1] <= self.shape[0] * self.shape[1]
        if self._mat is not None or self.given_mat or self.rows is not None or not few:
            return self.mat[i, j]
        return self.distance.pairs(self.embeddings[i], ref[j])

    @property
    def masks(self) -> PairMasks:
        """The pair masks, built on first use (a loss that reads a miner's result directly,
        such as the triplet loss on a window, never builds them)."""
        if self._masks is None:
            self._masks = self.make_masks()
        return self._masks

    @property
    def num_anchors(self) -> int:
        return self.shape[0]

    @property
    def diagonal(self) -> int | None:
        """Column offset of each anchor's own entry (self mode), else ``None``."""
        if self.ref_emb is not None:
            return None
        return 0 if self.rows is None else self.rows[0]

    def binary_masks(self) -> PairMasks:
        """0/1 masks (PML's matrix-based losses set ``mask[a, p] = 1`` once per listed pair)."""
        pos, neg = self.masks
        if not self.counts:  # label masks are 0/1 already
            return self.masks
        return PairMasks((pos > 0).to(pos.dtype), (neg > 0).to(neg.dtype))

    def similarity(self) -> Tensor:
        """The matrix oriented so that larger means closer (negated for distances)."""
        return self.mat if self.distance.is_similarity else -self.mat

    def any_pairs(self) -> tuple[Tensor, Tensor]:
        """Whether the whole batch (not just this chunk) has a positive / a negative pair."""
        return any_pairs(
            self.all_labels, self.ref_labels, self.indices_tuple, self.embeddings.device
        )


@dataclass(frozen=True)
class LossSpec:
    """A loss as :mod:`pmlfunc.chunked` sees it: its terms from a (possibly chunked) batch.

    ``terms(batch, **hyper)`` validates the hyper-parameters and returns the sub-losses' terms;
    ``unchunkable(**hyper)`` returns why a setting cannot be split over anchors (or ``None``).
    """

    name: str
    terms: Callable[..., dict[str, Terms]]
    default_distance: Distance
    default_reducer: Reducer
    unchunkable: Callable[..., str | None] = lambda **hyper: None


SPECS: dict[Callable, LossSpec] = {}


def register(fn: Callable, spec: LossSpec) -> None:
    """Record a public loss function's :class:`LossSpec` (looked up by :mod:`pmlfunc.chunked`)."""
    SPECS[fn] = spec


def run(
    spec: LossSpec,
    embeddings: Tensor,
    labels: Tensor | None,
    ref_emb: Tensor | None,
    ref_labels: Tensor | None,
    indices_tuple,
    mat: Tensor | None,
    distance: Distance | None,
    reducer: Reducer | None,
    *,
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None,
    embedding_reg_weight: float | Tensor = 1.0,
    **hyper,
):
    """A whole-batch loss: validate, build the matrix and masks, reduce the terms, add the
    embedding regularizer."""
    batch = prepare(
        embeddings, labels, ref_emb, ref_labels, indices_tuple, mat, distance, spec.default_distance
    )
    loss = finish(batch, spec.terms(batch, **hyper), default_reducer(reducer, spec.default_reducer))
    return regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)


def regularize_params(
    loss,
    embeddings: Tensor,
    weights: Tensor,
    embedding_regularizer: Callable[[Tensor], Tensor] | None,
    embedding_reg_weight: float | Tensor,
    weight_regularizer: Callable[[Tensor], Tensor] | None,
    weight_reg_weight: float | Tensor,
):
    """A learnable loss's two regularizers, as PML's mixins add them: on the embeddings, and on
    the class-major weights flattened to ``(C[·K], D)`` rows (sub-centres one row each)."""
    loss = regularize(loss, embeddings, embedding_regularizer, embedding_reg_weight)
    flat = weights.reshape(-1, weights.shape[-1])
    return regularize(loss, flat, weight_regularizer, weight_reg_weight, name="weight")


def regularize(
    loss,
    x: Tensor,
    regularizer: Callable[[Tensor], Tensor] | None,
    weight: float | Tensor,
    *,
    name: str = "embedding",
):
    """``loss + weight · regularizer(x)``, as PML adds a regularizer's (already reduced) loss.

    ``name`` is ``"embedding"`` (``embedding_regularizer`` on the embeddings) or ``"weight"``
    (``weight_regularizer`` on a class-major weight matrix). With the ``none()`` reducer the loss
    is a dict of terms: the regularizer becomes its ``"<name>_reg_loss"`` entry, ``{"losses":
    w·reg, "weights": 1, "kind": "already_reduced"}``.
    """
    if regularizer is None:
        return loss
    if not callable(regularizer):
        raise TypeError(
            f"{name}_regularizer must be a function of a tensor (e.g. pf.regularizers.lp), "
            f"got {type(regularizer).__name__}"
        )
    weight = _checks.hyper(weight, f"{name}_reg_weight")
    reg = regularizer(x)
    if not isinstance(reg, Tensor) or reg.ndim != 0:
        raise ValueError(f"{name}_regularizer must return a 0-d tensor")
    term = scalar_like(weight, reg) * reg
    if isinstance(loss, dict):  # none(): an already-reduced entry, in the terms' format
        entry = {"losses": term, "weights": torch.ones_like(term), "kind": "already_reduced"}
        return {**loss, f"{name}_reg_loss": entry}
    return loss + term.to(loss.dtype)


def prepare(
    embeddings: Tensor,
    labels: Tensor | None,
    ref_emb: Tensor | None,
    ref_labels: Tensor | None,
    indices_tuple,
    mat: Tensor | None,
    distance: Distance | None,
    default_distance: Distance,
    rows: tuple[int, int] | None = None,
    anchors: Tensor | None = None,
) -> Batch:
    """Validate a loss's inputs and build its matrix and masks (for anchor ``rows`` only, when
    given: the chunk's rows against the whole reference set; ``anchors`` may carry those rows
    as a tensor of their own, so that their gradient is taken separately)."""
    distance = validate(
        embeddings, labels, ref_emb, ref_labels, indices_tuple, distance, default_distance
    )
    b = embeddings.shape[0]
    m = b if ref_emb is None else ref_emb.shape[0]
    r0, r1 = (0, b) if rows is None else rows
    cd = _checks.compute_dtype(embeddings.dtype)
    source = (distance, mat) if mat is not None else (distance, embeddings, ref_emb)
    given = mat is not None
    if given:  # checked now, so that a bad mat fails at the call
        mat = matrix(embeddings, ref_emb, mat, distance, rows, anchors)

    def make_mat() -> Tensor:
        return mat if given else matrix(embeddings, ref_emb, None, distance, rows, anchors)

    def make_masks() -> PairMasks:
        return pair_masks(
            labels,
            None if ref_emb is None else ref_labels,
            indices_tuple,
            (b, m),
            dtype=cd,
            device=embeddings.device,
            rows=rows,
        )

    return Batch(
        make_mat,
        make_masks,
        None if labels is None else labels[r0:r1],
        indices_tuple is not None,
        distance,
        embeddings.dtype,
        embeddings,
        ref_emb,
        all_labels=labels,
        ref_labels=ref_labels,
        indices_tuple=indices_tuple,
        rows=rows,
        source=source,
        shape=(r1 - r0, m),
        given_mat=given,
    )


def default_reducer(reducer: Reducer | None, default: Reducer) -> Reducer:
    return default if reducer is None else reducer


def finish(batch: Batch, terms: dict[str, Terms], reducer: Reducer):
    """Reduce the terms (summing sub-losses) and return the loss in the input dtype."""
    return reduce(reducer, terms, batch.labels, batch.out_dtype)


def _masked(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` on kept entries, ``−finfo.max`` elsewhere (a fresh buffer, by arithmetic)."""
    return torch.addcmul((keep - 1.0).mul_(torch.finfo(x.dtype).max), x, keep)


def _exp_shifted_(buf: Tensor, shift: Tensor, weights: Tensor) -> Tensor:
    """In place on a :func:`_masked` buffer: ``w · exp(max(buf − shift, −80))``.

    Masked entries (``−finfo.max``) give 0. Exponents are clamped at −80 (e⁻⁸⁰ ≈ 2e-35 is far
    below any dtype's precision relative to the row maximum's e⁰) because CPU ``exp`` of
    arguments that underflow is ~35× slower than of ordinary ones.
    """
    return buf.sub_(shift).clamp_min_(-80.0).exp_().mul_(weights)


class _MaskedLogSumExp(torch.autograd.Function):
    """Row-wise ``log Σ_j w_j e^{x_j}`` over kept entries, as one autograd node.

    The forward keeps only the per-row result (plus the inputs); the backward recomputes the
    softmax weights. Two ``B × M`` buffers in each direction instead of the half-dozen
    temporaries of the composed ops (each a fresh allocation, page faults included).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weights: Tensor, keep: Tensor | None) -> Tensor:
        if keep is None:  # 0/1 weights (a flag: compile rejects one tensor given twice)
            keep = weights
        low = -torch.finfo(x.dtype).max
        buf = _masked(x, keep)
        shift = buf.amax(-1, keepdim=True)
        has_any = shift > low
        shift = torch.where(has_any, shift, 0.0)
        s = _exp_shifted_(buf, shift, weights).sum(-1, keepdim=True)
        lse = torch.where(has_any, torch.log(torch.where(has_any, s, 1.0)) + shift, low)
        return lse.squeeze(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weights, keep = inputs
        ctx.save_for_backward(x, weights, keep, output)

    @staticmethod
    def backward(ctx, g):
        x, weights, keep, lse = ctx.saved_tensors
        if keep is None:
            keep = weights
        # d lse_i / d x_ij = w_ij e^{x_ij − lse_i} (the masked softmax); empty rows give 0.
        soft = _exp_shifted_(_masked(x, keep), lse.unsqueeze(-1), weights)
        return soft * g.unsqueeze(-1), None, None


def masked_logsumexp(x: Tensor, weights: Tensor, keep: Tensor | None = None) -> Tensor:
    """``log Σ_j w_j exp(x_j)`` along the last dim over the entries with ``w_j > 0``.

    ``keep`` is the 0/1 float indicator of ``w > 0``; pass it when it differs from ``weights``
    (pair counts). Rows with nothing kept get ``finfo.min``, a finite stand-in for −∞ that keeps
    every gradient finite (``logaddexp`` with it returns the other operand). Masks enter by
    arithmetic, not ``where``: on CPU a ``where`` with a scattered mask is ~25× slower.
    """
    return _MaskedLogSumExp.apply(x, weights, keep)


def signed(sign: float, x: Tensor) -> Tensor:
    """``sign * x`` without a pass over ``x`` when ``sign == 1``."""
    return x if sign == 1.0 else -x


def shift(x: Tensor, value: float | Tensor) -> Tensor:
    """``x - value`` without a pass over ``x`` when ``value`` is the Python number 0."""
    if isinstance(value, float) and value == 0.0:
        return x
    return x - scalar_like(value, x)


def rshift(value: float | Tensor, x: Tensor) -> Tensor:
    """``value - x`` in one pass."""
    return torch.rsub(x, scalar_like(value, x))


def scalar_like(value: float | Tensor, ref: Tensor) -> float | Tensor:
    """A hyper-parameter ready to combine with ``ref``: tensors are cast to its dtype/device."""
    if isinstance(value, Tensor):
        return value.to(dtype=ref.dtype, device=ref.device)
    return value


def miner_weights(
    indices_tuple, batch_size: int, dtype: torch.dtype, device, *, anchors_only: bool = False
) -> Tensor | None:
    """PML's ``lmu.convert_to_weights`` without ``unique``: each sample's count in the tuple over
    the largest count (0 for samples not listed). ``None`` means all ones (no tuple, or a tuple of
    empty index tensors: a static decision on shapes; a fixed-shape miner result that selected
    nothing gives all ones too, by a ``where``). ``anchors_only`` counts only the anchors
    (PML's ``using_ref=True``). Counted with ``index_add``: no host sync."""
    if indices_tuple is None:
        return None
    if is_mined(indices_tuple):
        counts = indices_tuple.sample_counts(batch_size, dtype, anchors_only).to(device)
        top = counts.amax()
        return torch.where(top > 0, counts / top.clamp_min(1.0), 1.0)
    t = check_tuple(indices_tuple)
    if all(x.shape[0] == 0 for x in t):
        return None
    if anchors_only:
        t = (t[0],) if len(t) == 3 else (t[0], t[2])
    idx = torch.cat([x.reshape(-1).to(device=device, dtype=torch.long) for x in t])
    counts = torch.zeros(batch_size, dtype=dtype, device=device)
    counts = counts.index_add(0, idx, torch.ones(idx.shape, dtype=dtype, device=device))
    return counts / counts.amax().clamp_min(1.0)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-row ``logsumexp(logits) − logits[label]`` (``CrossEntropyLoss(reduction="none")``)."""
    return torch.logsumexp(logits, -1) - logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
