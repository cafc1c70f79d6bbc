r"""How a batch loss is written: its shared keyword arguments, its :class:`Batch`, its spec.

A *batch loss* scores a batch of embeddings against itself (or a reference set) through a
``B × M`` matrix. It is written in two parts:

1. the public function: the signature (its own hyper-parameters, keyword-only, and the shared
   ``**inputs`` of :class:`BatchInputs`), the docstring, and one call of its spec::

       def contrastive(embeddings, labels=None, *, pos_margin=0.0, neg_margin=1.0, **inputs):
           '''...'''
           return spec(contrastive)(embeddings, labels, inputs, pos_margin=pos_margin,
                                    neg_margin=neg_margin)

2. the terms, the math: a function of a :class:`Batch` and the hyper-parameters that returns the
   unreduced :class:`~pmlfunc.reducers.Terms` of each sub-loss, made the spec of the public
   function by :func:`batch_loss`::

       @batch_loss(contrastive, distance=lp(), reducer=avg_nonzero())
       def _contrastive_terms(batch, *, pos_margin, neg_margin): ...

The spec (:class:`BatchLoss`, attached as ``contrastive.spec`` and read by :func:`spec`, which
gives it its type) validates the shared inputs,
builds the batch, reduces the terms and adds the embedding regularizer: every batch loss does
these the same way. :mod:`pmlfunc.chunked` and :mod:`pmlfunc.distributed` call the same terms on
a block of anchor rows (``Batch.rows``), which is why a spec also says whether, and why not, its
loss splits over anchors.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import Tensor

from .. import _checks
from .._inputs import matrix, validate
from .._ops import label_rows, sparse_rows
from ..distances import Distance, resolve
from ..labels import PairMasks, any_pairs, label_masks, pair_masks
from ..reducers import Reducer, Terms, reduce
from ..tuples import source_of
from ._regularize import regularize

__all__ = [
    "SHARED",
    "Batch",
    "BatchInputs",
    "BatchLoss",
    "batch_loss",
    "check_shared",
    "prepare",
    "refuse",
    "regularized",
    "spec",
    "spec_of",
]


class BatchInputs(TypedDict, total=False):
    """The keyword arguments every batch loss takes besides its own hyper-parameters.

    Attributes:
        distance: the ``(B, M)`` matrix's distance or similarity (``pf.distances.lp()``,
            ``cosine()``, ``dot()``, ``snr()``); each loss documents its default.
        reducer: how the terms become one number (``pf.reducers.mean()``, ``avg_nonzero()``,
            ...); each loss documents its default. ``none()`` returns the unreduced terms.
        ref_emb: a separate ``(M, D)`` reference set: every query row is compared with every
            reference row and nothing is excluded. Default: the batch itself, without the
            diagonal (the reference-set rule).
        ref_labels: the ``(M,)`` labels of ``ref_emb`` (required with ``ref_emb`` unless an
            ``indices_tuple`` gives the pairs).
        indices_tuple: which pairs or triplets count: PML's ``(a1, p, a2, n)`` pairs or
            ``(a, p, n)`` triplets, or a :mod:`pmlfunc.miners` result. Default: every pair the
            labels define.
        mat: the precomputed ``(B, M)`` matrix of ``distance`` (one matrix for a miner and
            several losses); the loss's gradient flows through it.
        embedding_regularizer: a function of the ``(B, D)`` embeddings returning a 0-d loss
            (``pf.regularizers.lp``, ...), added with weight ``embedding_reg_weight``
            (default ``1``).
        embedding_reg_weight: the regularizer's weight, a number or a 0-d tensor.
    """

    distance: Distance | None
    reducer: Reducer | None
    ref_emb: Tensor | None
    ref_labels: Tensor | None
    indices_tuple: Any
    mat: Tensor | None
    embedding_regularizer: Callable[[Tensor], Tensor] | None
    embedding_reg_weight: float | Tensor


SHARED: tuple[str, ...] = tuple(BatchInputs.__annotations__)


def check_shared(name: str, inputs: Mapping) -> Mapping:
    """``inputs`` itself when every key is a :class:`BatchInputs` name, else the ``TypeError``
    Python raises for an unexpected keyword argument of ``name``."""
    for k in inputs:
        if k not in SHARED:
            raise TypeError(f"{name}() got an unexpected keyword argument {k!r}")
    return inputs


def refuse(name: str, given: Mapping, refused: tuple[str, ...]) -> None:
    """A ``ValueError`` for the first input in ``refused`` that ``given`` sets: a loss that
    does not take it (PML raises for it too)."""
    for arg in refused:
        if given.get(arg) is not None:
            raise ValueError(f"{name} does not support {arg} (neither does PML)")


def regularized(loss: Any, embeddings: Tensor, inputs: Mapping) -> Any:
    """``loss`` plus the embedding regularizer that ``inputs`` names (if any)."""
    return regularize(
        loss,
        embeddings,
        inputs.get("embedding_regularizer"),
        inputs.get("embedding_reg_weight", 1.0),
    )


@dataclass
class Batch:
    """What a loss's terms need about their inputs, all in the compute dtype (float32 for
    fp16/bf16). The matrix and the masks are built on first use.

    A batch may be a *chunk*: the anchor rows ``rows = (r0, r1)`` of the full batch against the
    whole reference set (:mod:`pmlfunc.chunked`, :mod:`pmlfunc.distributed`). ``labels`` are then
    the chunk's anchors' labels, ``all_labels`` every query row's.
    """

    make_mat: Callable[..., Tensor]  # (anchors, M) matrix on demand; scale= multiplies it
    make_masks: Callable[[], PairMasks]  # (anchors, M) positive / negative pair counts
    labels: Tensor | None  # the anchors' labels
    counts: bool  # masks hold pair multiplicities (from an index tuple), not just 0/1
    distance: Distance
    out_dtype: torch.dtype  # the loss's: the compute dtype (float32 for float16/bfloat16)
    embeddings: Tensor
    ref_emb: Tensor | None  # None in self mode
    all_labels: Tensor | None = None  # every query row's labels
    ref_labels: Tensor | None = None
    indices_tuple: Any = None
    rows: tuple[int, int] | None = None
    source: tuple = ()  # what the matrix came from (distance and tensors), for miner results
    shape: tuple[int, int] = (0, 0)  # (anchors, references) of the matrix
    given_mat: bool = False  # the caller passed mat=
    _mat: Tensor | None = None
    _masks: PairMasks | None = None
    _unit: tuple[Tensor, Tensor] | None = None  # the rows as the distance normalises them
    # Added to what is gathered from _unit: 0 when every normalised row is finite, else NaN, a
    # constant (no gradient). A non-finite row that no gathered pair reads still gets a NaN
    # gradient through the normalisation of every row (its zero cotangent times NaN), so the
    # loss reports it instead of a finite value over NaN gradients (unit rows are bounded:
    # their sum overflows for no finite input). Rows gathered as they are need none: an unread
    # row's gradient is exactly 0.
    _guard: Tensor | float = 0.0

    @property
    def mat(self) -> Tensor:
        """The ``(anchors, M)`` matrix, built on first use (a loss that reads only listed
        pairs, such as the triplet loss on a miner's triplets, never builds it)."""
        if self._mat is None:
            self._mat = self.make_mat()
        return self._mat

    @property
    def masks(self) -> PairMasks:
        """The pair masks, built on first use (a loss that reads a miner's result directly,
        such as the triplet loss on a window, never builds them)."""
        if self._masks is None:
            self._masks = self.make_masks()
        return self._masks

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return _checks.compute_dtype(self.embeddings.dtype)

    @property
    def num_anchors(self) -> int:
        return self.shape[0]

    @property
    def diagonal(self) -> int | None:
        """Column offset of each anchor's own entry (self mode), else ``None``."""
        if self.ref_emb is not None:
            return None
        return 0 if self.rows is None else self.rows[0]

    def pair_values(self, i: Tensor, j: Tensor) -> Tensor:
        """The matrix entries ``(i_k, j_k)`` (``i`` indexes this batch's anchor rows).

        Without the matrix at hand, and when the pairs are few (``L·D ≤ B·M``), they are
        computed from the listed rows only (:meth:`~pmlfunc.distances.Distance.pairs`):
        ``O(L·D)`` for ``L`` pairs instead of the ``O(B·M·D)`` matrix.
        """
        ref = self.embeddings if self.ref_emb is None else self.ref_emb
        # Gathering costs O(L·D) elementwise work (forward and backward); the matrix one matmul
        # and O(B·M) passes plus the exact-budget search of a Euclidean distance: gather when
        # L·D ≤ B·M (batch-hard at B = D = 128: 1.21 -> 1.06 ms a step on one CPU thread).
        few = i.numel() * ref.shape[-1] <= self.shape[0] * self.shape[1]
        if self._mat is not None or self.given_mat or self.rows is not None or not few:
            return self.mat[i, j]
        x, ref, plain = self._unit_rows()
        return plain.pairs(x[i], ref[j]) + self._guard

    def _unit_rows(self) -> tuple[Tensor, Tensor, Distance]:
        """The rows and reference rows as the distance normalises them (each row once, in the
        compute dtype; cached), and the distance without its normalisation: listed pairs and
        blocks gather from them instead of normalising every gathered row."""
        normalize, plain = self.distance.split_normalization()
        if self._unit is None:
            x = normalize(self.embeddings.to(self.dtype))
            y = x if self.ref_emb is None else normalize(self.ref_emb.to(self.dtype))
            self._unit = (x, y)
            if plain is not self.distance:  # the rows were normalised: see _guard
                guard = x.detach().sum() * 0.0
                self._guard = guard if y is x else guard + y.detach().sum() * 0.0
        return *self._unit, plain

    def block(self, i: Tensor, j: Tensor) -> Tensor:
        """The ``(len(i), len(j))`` block of the matrix: anchor rows ``i``, reference columns
        ``j``. Without the matrix at hand it is the distance between those rows alone (no
        exact ties: for a loss smooth in it), ``O(len(i)·len(j)·D)`` instead of ``O(B·M·D)``."""
        if self._mat is not None or self.given_mat or self.rows is not None:
            return self.mat.index_select(0, i).index_select(1, j)
        x, ref, plain = self._unit_rows()
        block = plain.matrix(x.index_select(0, i), ref.index_select(0, j), ties=False)
        return block + self._guard

    def keep(self, w: Tensor) -> Tensor | None:
        """The 0/1 indicator of ``w > 0`` when the masks hold pair counts (``None`` for 0/1
        masks): the ``keep`` argument of :func:`~pmlfunc._ops.masked_logsumexp`."""
        return (w > 0).to(w.dtype) if self.counts else None

    def binary_masks(self) -> PairMasks:
        """0/1 masks (PML's matrix-based losses set ``mask[a, p] = 1`` once per listed pair)."""
        pos, neg = self.masks
        if not self.counts:  # label masks are 0/1 already
            return self.masks
        return PairMasks((pos > 0).to(pos.dtype), (neg > 0).to(neg.dtype))

    def listed(
        self, pos: Tensor, cost: float = 1.0, compiled: bool = False
    ) -> tuple[Tensor, Tensor] | None:
        """Each anchor's positive columns of ``pos`` (this batch's positive mask, counts or
        0/1) as :func:`~pmlfunc._ops.sparse_rows` lists them, or ``None`` for the dense path.
        Where the mask comes from the labels alone (no ``indices_tuple``, not a chunk), from
        the labels (:func:`~pmlfunc._ops.label_rows`: no pass over the mask; ``compiled``:
        a listing under ``torch.compile`` too)."""
        labels, ref = self.labels, None if self.ref_emb is None else self.ref_labels
        if self.indices_tuple is not None or self.rows is not None or labels is None:
            return sparse_rows(pos, cost)
        if self.ref_emb is not None and ref is None:
            return sparse_rows(pos, cost)
        return label_rows(labels, ref, cost, compiled)

    def label_masks(self) -> PairMasks:
        """0/1 masks of this batch's rows from the labels, whatever ``indices_tuple`` says: for
        losses whose pairs always come from the labels (a tuple only weights their terms, or
        picks their positive pairs), as in PML."""
        if self.indices_tuple is None:
            return self.masks
        if self.ref_emb is not None and self.ref_labels is None:
            raise ValueError("ref_emb was given without ref_labels: this loss needs both")
        ref_labels = None if self.ref_emb is None else self.ref_labels
        assert self.all_labels is not None  # the losses that call this need labels (needs_labels)
        return label_masks(self.all_labels, ref_labels, dtype=self.dtype, rows=self.rows)

    def similarity(self) -> Tensor:
        """The matrix oriented so that larger means closer (negated for distances)."""
        return self.mat if self.distance.is_similarity else -self.mat

    def scaled_similarity(self, scale: float | Tensor) -> Tensor:
        """``scale · similarity()``, a fresh tensor (callers may write into it). Unless the
        matrix was built already or given (``mat=``), the scale goes into the matrix's own
        computation (into the rows before a matmul similarity's product): no pass over the
        ``B × M`` matrix to scale it, forward or backward. Not cached: a loss that also reads
        :attr:`mat` builds the matrix twice."""
        if isinstance(scale, Tensor):
            scale = scale.to(dtype=self.dtype, device=self.embeddings.device)
        signed = scale if self.distance.is_similarity else -scale
        if self._mat is not None:
            return self._mat * signed
        return self.make_mat(scale=signed)

    def any_pairs(self) -> tuple[Tensor, Tensor]:
        """Whether the whole batch (not just this chunk) has a positive / a negative pair."""
        return any_pairs(
            self.all_labels, self.ref_labels, self.indices_tuple, self.embeddings.device
        )


def prepare(
    embeddings: Tensor,
    labels: Tensor | None,
    *,
    distance: Distance,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    indices_tuple: Any = None,
    mat: Tensor | None = None,
    rows: tuple[int, int] | None = None,
    anchors: Tensor | None = None,
    ties: bool = True,
) -> Batch:
    """Validate a loss's inputs (shapes, dtypes, devices) and return its :class:`Batch`: for the
    anchor ``rows`` only when given (a chunk's rows against the whole reference set; ``anchors``
    may carry those rows as a tensor of their own, so that their gradient is taken
    separately). ``ties=False``: the matrix without exact ties (``Distance.matrix``)."""
    indices_tuple = validate(
        embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels, indices_tuple=indices_tuple
    )
    b = embeddings.shape[0]
    m = b if ref_emb is None else ref_emb.shape[0]
    r0, r1 = (0, b) if rows is None else rows
    cd = _checks.compute_dtype(embeddings.dtype)
    source = source_of(distance, (mat,) if mat is not None else (embeddings, ref_emb))
    given = mat is not None
    if given:  # checked now, so that a bad mat fails at the call
        mat = matrix(embeddings, ref_emb, mat, distance, rows, anchors)

    def make_mat(scale: float | Tensor | None = None) -> Tensor:
        if mat is not None:  # given
            return mat if scale is None else mat * scale
        return matrix(embeddings, ref_emb, None, distance, rows, anchors, ties=ties, scale=scale)

    def make_masks() -> PairMasks:
        ref = None if ref_emb is None else ref_labels
        return pair_masks(
            labels, ref, indices_tuple, (b, m), dtype=cd, device=embeddings.device, rows=rows
        )

    return Batch(
        make_mat,
        make_masks,
        None if labels is None else labels[r0:r1],
        indices_tuple is not None,
        distance,
        cd,  # the loss's dtype: float32 for float16/bfloat16 inputs (DESIGN rule 5)
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


_REQUIRED = inspect.Parameter.empty


@dataclass
class LossCall:
    """One call of a batch loss, checked: everything computing it needs, whole or by rows."""

    spec: BatchLoss
    embeddings: Tensor
    labels: Tensor | None
    distance: Distance
    reducer: Reducer | None  # None: the loss is already reduced
    hyper: dict[str, Any]
    ref_emb: Tensor | None = None
    ref_labels: Tensor | None = None
    indices_tuple: Any = None
    mat: Tensor | None = None
    embedding_regularizer: Callable[[Tensor], Tensor] | None = None
    embedding_reg_weight: float | Tensor = 1.0

    def batch(
        self,
        rows: tuple[int, int] | None = None,
        *,
        embeddings: Tensor | None = None,
        ref_emb: Tensor | None = None,
        anchors: Tensor | None = None,
        distance: Distance | None = None,
    ) -> Batch:
        """The batch of this call (its anchor ``rows`` only, when given). A chunked caller
        passes the embeddings it normalised once and the distance without its normalisation."""
        return prepare(
            self.embeddings if embeddings is None else embeddings,
            self.labels,
            distance=self.distance if distance is None else distance,
            ref_emb=self.ref_emb if ref_emb is None else ref_emb,
            ref_labels=self.ref_labels,
            indices_tuple=self.indices_tuple,
            mat=self.mat,
            rows=rows,
            anchors=anchors,
            ties=self.spec.exact_ties,
        )

    def inputs(self) -> dict[str, Any]:
        """The call's keyword inputs other than its hyper-parameters, as the public loss names
        them (``ref_emb=``, ``distance=``, ...)."""
        return {
            "ref_emb": self.ref_emb, "ref_labels": self.ref_labels,
            "indices_tuple": self.indices_tuple, "mat": self.mat, "distance": self.distance,
            "reducer": self.reducer, "embedding_regularizer": self.embedding_regularizer,
            "embedding_reg_weight": self.embedding_reg_weight,
        }  # fmt: skip

    def terms(self, batch: Batch) -> dict[str, Terms]:
        return self.spec.terms(batch, **self.hyper)

    def loss(self) -> Any:
        """The whole-batch loss: terms, reducer, regularizer. A 0-d tensor, or the terms' dict
        for ``reducer=none()`` (hence ``Any``, as :func:`~pmlfunc.reducers.reduce`)."""
        batch = self.batch()
        loss = reduce(self.reducer, self.terms(batch), batch.labels, batch.out_dtype)
        return regularize(
            loss, self.embeddings, self.embedding_regularizer, self.embedding_reg_weight
        )

    def unchunkable(self) -> str | None:
        """Why this call cannot be split over anchor rows (``None`` when it can)."""
        if self.mat is not None:
            return "mat cannot be chunked: each chunk computes its own rows of the matrix"
        reason = self.spec.unchunkable
        for name, why in self.spec.unchunkable_with.items():
            if reason is None and not _is_default(self.hyper[name], self.spec.defaults[name]):
                reason = f"{name}={self.hyper[name]!r}: {why}"
        if reason is not None:
            return (
                f"{self.spec.name} cannot be chunked: it does not decompose over anchors ({reason})"
            )
        if self.reducer is None or not self.reducer.chunkable:
            return (
                f"reducer {self.reducer!r} does not split over anchors (none() returns the "
                "terms, divisor() divides by a loss-specific global count)"
            )
        return None


@dataclass(frozen=True)
class BatchLoss:
    """The spec of a batch loss (see the module docstring): its terms, defaults and rules.

    Attributes:
        name: the public function's name.
        terms: ``terms(batch, **hyper) -> {sub_loss: Terms}``; validates its hyper-parameters.
        distance: the default distance.
        reducer: the default reducer; ``None`` for a loss that is already reduced (its terms are
            :class:`~pmlfunc.reducers.AlreadyReduced`, and a reducer is refused, as PML ignores
            one).
        defaults: the terms' hyper-parameters with the public function's defaults (``_REQUIRED``
            for none), read once from its signature: the one place defaults are written.
        own: the public function's other parameters (``chunk_size``: a path the public function
            takes itself) with their defaults; elsewhere they must keep them.
        positional: the hyper-parameters the public function takes positionally after
            ``labels`` (``params``).
        unchunkable: why the loss never splits over anchors (``None``: it does).
        unchunkable_with: hyper-parameters that stop it splitting when set (not left at their
            default), each with the reason.
        refuses: shared inputs the loss does not take (a ``ValueError``, as PML raises).
        needs_labels: labels are required (an ``indices_tuple`` alone is not enough).
        distance_rule: ``(what, predicate)``: a given distance must satisfy ``predicate``.
        exact_ties: the matrix has exact ties (``Distance.matrix``); ``False`` for a loss smooth
            in its matrix, where the duplicates' rounding decides nothing (saves their search).
    """

    name: str
    terms: Callable[..., dict[str, Terms]]
    distance: Distance
    reducer: Reducer | None
    defaults: Mapping[str, Any]
    own: Mapping[str, Any] = field(default_factory=dict)
    positional: tuple[str, ...] = ()
    unchunkable: str | None = None
    unchunkable_with: Mapping[str, str] = field(default_factory=dict)
    refuses: tuple[str, ...] = ()
    needs_labels: bool = False
    distance_rule: tuple[str, Callable[[Distance], bool]] | None = None
    exact_ties: bool = True

    def __call__(
        self, embeddings: Tensor, labels: Tensor | None, inputs: Mapping, **hyper: Any
    ) -> Any:
        """The loss of one call from the public function: ``inputs`` its ``**inputs``."""
        return self.bind(embeddings, labels, inputs, hyper).loss()

    def bind(
        self, embeddings: Tensor, labels: Tensor | None, inputs: Mapping, hyper: Mapping
    ) -> LossCall:
        """Check a call's shared ``inputs`` and ``hyper``-parameters (the given ones; the others
        take their defaults) and return it as a :class:`LossCall`."""
        check_shared(self.name, inputs)
        for k in hyper:
            if k not in self.defaults and k not in self.own:
                raise TypeError(f"{self.name}() got an unexpected keyword argument {k!r}")
        for k, default in self.own.items():
            if k in hyper and hyper[k] is not default:
                raise ValueError(f"{self.name}: {k}={hyper[k]!r} is not supported here")
        refuse(self.name, inputs, self.refuses)
        if self.needs_labels and labels is None:
            raise ValueError(f"{self.name} needs labels (PML requires them for this loss)")
        given = inputs.get("distance")
        distance = resolve(given, self.distance)
        if given is not None and self.distance_rule is not None:
            what, ok = self.distance_rule
            if not ok(distance):
                raise ValueError(
                    f"{self.name} needs distance={what} (PML asserts it), got {given!r}"
                )
        reducer = inputs.get("reducer")
        if self.reducer is None and reducer is not None:
            raise ValueError(
                f"{self.name} returns an already-reduced value (as in PML, which ignores its "
                "reducer); reducer must be None"
            )
        reducer = self.reducer if reducer is None else reducer
        if reducer is not None and not isinstance(reducer, Reducer):
            raise TypeError(
                "reducer must be a pmlfunc reducer (pmlfunc.reducers.mean(), ...), got "
                f"{type(reducer).__name__}"
            )
        values = {k: hyper.get(k, v) for k, v in self.defaults.items()}
        missing = [k for k, v in values.items() if v is _REQUIRED]
        if missing:
            raise TypeError(f"{self.name}() missing required keyword argument {missing[0]!r}")
        shared = {k: v for k, v in inputs.items() if k not in ("distance", "reducer")}
        return LossCall(self, embeddings, labels, distance, reducer, values, **shared)

    def bind_call(self, args: tuple, kwargs: Mapping) -> LossCall:
        """Bind a call written as a user writes it, ``loss(embeddings, labels, *positional,
        **kwargs)`` with shared inputs and hyper-parameters mixed (:mod:`pmlfunc.chunked`,
        :mod:`pmlfunc.distributed`)."""
        names = ("embeddings", "labels", *self.positional)
        if len(args) > len(names):
            raise TypeError(f"{self.name}() takes at most {len(names)} positional arguments")
        values = dict(zip(names, args, strict=False))
        hyper: dict[str, Any] = {}
        inputs: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k in values:
                raise TypeError(f"{self.name}() got multiple values for argument {k!r}")
            target = inputs if k in SHARED else values if k in names else hyper
            target[k] = v
        if "embeddings" not in values:
            raise TypeError(f"{self.name}() missing required argument 'embeddings'")
        embeddings, labels = values.pop("embeddings"), values.pop("labels", None)
        return self.bind(embeddings, labels, inputs, {**values, **hyper})


def batch_loss(
    fn: Callable[..., Any],
    *,
    distance: Distance,
    reducer: Reducer | None,
    unchunkable: str | None = None,
    unchunkable_with: Mapping[str, str] | None = None,
    refuses: tuple[str, ...] = (),
    needs_labels: bool = False,
    distance_rule: tuple[str, Callable[[Distance], bool]] | None = None,
    exact_ties: bool = True,
) -> Callable[[Callable[..., dict[str, Terms]]], Callable[..., dict[str, Terms]]]:
    """Decorate a terms function: it becomes the spec of the public loss ``fn``
    (``fn.spec``, a :class:`BatchLoss`). Every keyword-only parameter of the terms function
    must be a parameter of ``fn``, whose signature holds the defaults."""

    def attach(terms: Callable[..., dict[str, Terms]]) -> Callable[..., dict[str, Terms]]:
        params = list(inspect.signature(fn).parameters.values())[2:]
        public = {p.name: p.default for p in params if p.kind != p.VAR_KEYWORD}
        wanted = [
            p.name for p in inspect.signature(terms).parameters.values() if p.kind == p.KEYWORD_ONLY
        ]
        missing = [k for k in wanted if k not in public]
        if missing:
            raise TypeError(f"{terms.__name__} takes {missing}, which {fn.__name__} lacks")
        fn.spec = BatchLoss(  # type: ignore[attr-defined]  # a function attribute (see spec)
            fn.__name__,
            terms,
            distance,
            reducer,
            defaults={k: public[k] for k in wanted},
            own={k: v for k, v in public.items() if k not in wanted},
            positional=tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD),
            unchunkable=unchunkable,
            unchunkable_with=dict(unchunkable_with or {}),
            refuses=refuses,
            needs_labels=needs_labels,
            distance_rule=distance_rule,
            exact_ties=exact_ties,
        )
        return terms

    return attach


def spec(loss_fn: Callable[..., Any]) -> BatchLoss:
    """The :class:`BatchLoss` that :func:`batch_loss` attached to the public loss ``loss_fn`` as
    its ``spec`` attribute (read here, where a type checker learns its type)."""
    return loss_fn.spec  # type: ignore[attr-defined]  # a function attribute, set by batch_loss


def _is_default(value: Any, default: Any) -> bool:
    """Whether a hyper-parameter is left at its default (Python values compared by value; a
    tensor is never its default)."""
    if value is default:
        return True
    plain = (bool, int, float, str, type(None))
    return isinstance(value, plain) and isinstance(default, plain) and value == default


def spec_of(loss_fn: Callable[..., Any]) -> tuple[BatchLoss | None, dict[str, Any]]:
    """The spec of a loss given directly or as a ``functools.partial`` with keyword arguments,
    and those bound keyword arguments; ``(None, {})`` for anything that is not a batch loss."""
    bound: dict[str, Any] = {}
    fn = loss_fn
    while isinstance(fn, functools.partial):
        if fn.args:
            raise ValueError("a functools.partial of a loss may bind keyword arguments only")
        bound = {**fn.keywords, **bound}
        fn = fn.func
    spec = getattr(fn, "spec", None)
    return (spec, bound) if isinstance(spec, BatchLoss) else (None, {})
