"""The properties every public loss and miner keeps, checked over one registry of them.

The registry is built against ``pf.losses.__all__`` and ``pf.miners.__all__``: a public name that
is neither registered nor excluded (with the reason) fails
:func:`test_registry_covers_every_public_loss_and_miner`, so a new loss cannot be forgotten.
Each entry knows how to draw small inputs for its function (labels or multi-hot labels, params
from its ``*_init``, the hyper-parameters it requires) and which tensors are differentiated (the
embeddings, a reference set, the params leaves). Every entry is run through:

* ``torch.autograd.gradcheck`` in float64 (losses), and ``gradgradcheck`` (the second
  derivatives; the first-order entries, those of the tiled engine, the class tiles, matryoshka's
  one product and ``pf.chunked.loss``, raise saying so);
* ``torch.func.grad`` equal to autograd's gradient (losses);
* ``torch.compile(fullgraph=True)`` equal to eager: values and gradients of a loss, the
  fixed-shape result of a miner; and the transformed function compiled, the gradient taken
  inside the graph: ``torch.compile(torch.func.grad_and_value(loss))`` equal to eager
  ``torch.func.grad_and_value`` (the tiled NT-Xent failed there only);
* a run on ``device="meta"`` (shapes only: the rule that makes compile and CUDA graphs work);
* an example in the function's docstring (the examples themselves run in test_docstrings.py);
* never a silent wrong number (issue 16): a NaN or inf in any differentiated tensor makes a
  loss non-finite (before, ``supcon``, ``multi_similarity``, ``circle``,
  ``generalized_lifted_structure``, ``nca`` and ``proxy_anchor`` returned 0 over NaN gradients
  and ``fast_ap`` crashed), a miner still returns its usual result; no input is changed in
  place and a second call gives the same bits; with one NaN, +inf or −inf entry in any row of
  a differentiated tensor, a finite loss has finite gradients (npairs returned a finite loss
  over NaN gradients); duplicate rows and singleton classes give finite values and
  gradients; hypothesis checks that permuting the batch, renaming the classes and
  (with a normalising distance) rescaling a row leave every plain batch loss unchanged, with
  the exceptions listed and why (a wide sweep is marked ``slow``);
* the autocast matrix: under ``torch.autocast("cpu", dtype=torch.bfloat16)`` and with bfloat16
  / float16 embeddings every loss is a finite float32 within ``LOW_PRECISION_TOL`` of float64 on
  the same rounded inputs.

A function may have several entries, one per path worth checking: a batch loss that takes a
reference set is registered against the batch itself and against a separate reference set
(``name[ref]``); the losses compiled on mined tuples before are also registered on one
(``name[mined]``), the triplet losses on listed triplets (``name[listed]``), the losses with a
``chunk_size=`` path on the tiled engine (``name[tiled]``, ``name[tiled,ref]``; CLIP's and
SigLIP's ``name[tiled]``, ``name[tiled,labels]``); ``margin[params]`` (learnable betas),
``manifold[meta_classes]`` (given meta-classes) and the bounded miners
(``name[tuples_per_anchor]``) are paths of their own. What is specific to one family (references, PML parity, deviations, variant-specific compile tests) is in
that family's test file.
"""

from __future__ import annotations

import doctest
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
from helpers import compiled_saved_tensors, saved_bool_masks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

import pmlfunc as pf

F64, F32 = torch.float64, torch.float32
B, M, D, C = 8, 6, 4, 5  # batch rows, reference rows, embedding size, classes
LABELS = [0, 0, 1, 1, 1, 2, 3, 3]  # uneven classes and a singleton
REF_LABELS = [0, 1, 1, 4, 3, 2]  # shares some classes, has one the batch lacks
SEED = 17  # the counter-based generator of the stochastic miners and of manifold
# (anchor, positive, negative) triplets of LABELS that leave row 5 (the singleton) out
LISTED = [(0, 1, 2), (2, 3, 6), (4, 2, 0), (6, 7, 1)]

# Public names that are not losses or miners, and why.
EXCLUDED = {
    # the TypedDict documenting the keyword arguments every batch loss shares: not a function
    "BatchInputs": "the shared keyword arguments of the batch losses, documented as a type",
    # params and state constructors: they build a loss's inputs, checked with the loss
    **{
        f"{name}_init": "builds the params dict of a learnable loss"
        for name in (
            "arcface",
            "clip",
            "cosface",
            "dynamic_arcface",
            "ge2e",
            "large_margin_softmax",
            "manifold",
            "margin",
            "multiple_negatives_ranking",
            "normalized_softmax",
            "p2s_grad",
            "proxy_anchor",
            "proxy_nca",
            "siglip",
            "soft_triple",
            "sphereface",
            "subcenter_arcface",
        )
    },
    "dynamic_soft_margin_init_state": "builds the histogram state of dynamic_soft_margin",
    "dino_init": "builds the centre state of dino",
    "tico_init": "builds the covariance state of tico",
    "ibot_patch_init": "builds the centre state of ibot_patch",
    # helpers that compute a loss's inputs, not a loss
    "dynamic_arcface_margins": "computes dynamic_arcface's per-class margins from class counts",
    "manifold_meta_classes": "draws manifold's meta-classes from a seed (manifold's generator=)",
    # a detection at inference (boolean and index outputs, no gradient): test_class_logits.py
    # checks it against PML, compiled and on the meta device
    "subcenter_arcface_outliers": "sub-center ArcFace's outlier detection (no gradient)",
}


# ----------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------
class Draw:
    """Inputs of one call, drawn from a fixed seed in float64 and then moved to ``dtype`` on
    ``device`` (``"meta"``: shapes only)."""

    def __init__(self, dtype: torch.dtype = F64, device: str = "cpu"):
        self.gen = torch.Generator().manual_seed(0)
        self.dtype, self.device = dtype, device
        self.made: list[torch.Tensor] = []  # every tensor drawn: none may be changed by a call

    def _made(self, t: torch.Tensor) -> torch.Tensor:
        self.made.append(t)
        return t

    def randn(self, *shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, dtype=F64)
        return self._made(x.to(self.device, self.dtype))

    def rand(self, *shape: int) -> torch.Tensor:
        x = torch.rand(*shape, generator=self.gen, dtype=F64)
        return self._made(x.to(self.device, self.dtype))

    def labels(self, values: list[int] = LABELS) -> torch.Tensor:
        return self._made(torch.tensor(values).to(self.device))

    def multi_hot(self, rows: int, classes: int) -> torch.Tensor:
        return self._made((torch.rand(rows, classes, generator=self.gen) < 0.4).to(self.device))

    def params(self, init: Callable[..., dict], *args: Any, **kw: Any) -> dict[str, torch.Tensor]:
        """``init(*args, **kw)`` (drawn from this seed where it is random), moved."""
        if "generator" in inspect.signature(init).parameters:
            kw["generator"] = self.gen
        made = init(*args, dtype=F64, **kw).items()
        return {k: self._made(v.to(self.device, self.dtype)) for k, v in made}

    def seed(self, value: int = SEED) -> torch.Tensor:
        return self._made(torch.tensor(value).to(self.device))


@dataclass(frozen=True)
class Call:
    """One call of a registered function: the tensors it is differentiated in (by name:
    ``embeddings``, ``ref_emb``, ``params.<key>``) and ``run(**wrt)``, the function's output."""

    wrt: dict[str, torch.Tensor]
    run: Callable[..., Any]


@dataclass(frozen=True)
class Entry:
    """A registered loss or miner.

    Attributes:
        fn: the public function.
        make: draws one :class:`Call` of it with a :class:`Draw`.
        backend: the ``torch.compile`` backend of its compile check. ``aot_eager`` (full-graph
            capture, functionalisation and the compiled autograd graph, without code
            generation) where inductor's lowering of the counter-based hash of
            ``pmlfunc._random`` costs 18-40 s on a 2-core CPU (the stochastic miners,
            manifold's ``generator=``), and where another entry already has inductor generate
            code for the same ops (:data:`_SHARED`).
        gradcheck: ``torch.autograd.gradcheck`` options where its defaults do not fit.
        constant: ``(names, why)``: the differentiated tensors whose gradient is by design not
            the derivative of the value, held constant by gradcheck.
        hyper: for a plain batch call ``fn(embeddings, labels, **hyper(draw))`` (the first entry
            of :func:`batch`), its hyper-parameters: the invariance properties call ``fn``
            themselves, on permuted, relabelled or rescaled inputs.
    """

    fn: Callable[..., Any]
    make: Callable[[Draw], Call]
    backend: str = "inductor"
    gradcheck: Mapping[str, float] = field(default_factory=dict)
    constant: tuple[tuple[str, ...], str] | None = None
    hyper: Callable[[Draw], dict] | None = None


def _hyper(d: Draw, hp: Mapping[str, Any], drawn: Mapping[str, Callable] | None) -> dict:
    """The hyper-parameters of one call: ``hp`` as given, ``drawn`` made with the draw."""
    return {**hp, **{k: draw(d) for k, draw in (drawn or {}).items()}}


def _accepts_ref(fn: Callable) -> bool:
    spec = getattr(fn, "spec", None)
    return spec is not None and "ref_emb" not in spec.refuses


def batch(
    fn: Callable,
    *,
    labels: Callable[[Draw, int], torch.Tensor] | None = None,
    mined: bool = False,
    listed: str | None = None,
    tiled: bool = False,
    backend: str = "inductor",
    gradcheck: Mapping[str, float] | None = None,
    constant: tuple[tuple[str, ...], str] | None = None,
    drawn: Mapping[str, Callable[[Draw], torch.Tensor]] | None = None,
    **hp: Any,
) -> dict[str, Entry]:
    """The entries of a batch loss ``fn(embeddings, labels, **hp)``: on a batch of ``B`` rows;
    against a separate reference set of ``M`` rows (``name[ref]``, both differentiated) when
    the loss takes one; on an ``indices_tuple`` mined from the drawn rows (``name[mined]``)
    when ``mined``; on the triplets of :data:`LISTED` (``name[listed]``: the distances of the
    listed pairs alone, one row left out) when ``listed`` names its compile backend; on the
    tiled engine (``chunk_size=3``: ``name[tiled]`` and, with a
    reference set, ``name[tiled,ref]``) when ``tiled``. ``labels(draw, rows)`` draws other
    labels than :data:`LABELS`; ``drawn`` holds tensor hyper-parameters made on the draw's
    device."""

    def draw_labels(d: Draw, rows: int, values: list[int]) -> torch.Tensor:
        return d.labels(values) if labels is None else labels(d, rows)

    def self_mode(
        d: Draw, mine: bool = False, chunk: int | None = None, listing: bool = False
    ) -> Call:
        emb, y = d.randn(B, D), draw_labels(d, B, LABELS)
        kw = _hyper(d, hp, drawn)
        if mine:
            kw["indices_tuple"] = _pair_margin(emb, y)
        if listing:
            kw["indices_tuple"] = tuple(d.labels(list(v)) for v in zip(*LISTED, strict=True))
        if chunk is not None:
            kw["chunk_size"] = chunk
        return Call({"embeddings": emb}, lambda embeddings: fn(embeddings, y, **kw))

    def ref_mode(d: Draw, chunk: int | None = None) -> Call:
        y, ry = draw_labels(d, B, LABELS), draw_labels(d, M, REF_LABELS)
        wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(M, D)}
        kw = _hyper(d, hp, drawn)
        if chunk is not None:
            kw["chunk_size"] = chunk
        return Call(
            wrt,
            lambda embeddings, ref_emb: fn(embeddings, y, ref_emb=ref_emb, ref_labels=ry, **kw),
        )

    options = {"backend": backend, "gradcheck": gradcheck or {}, "constant": constant}
    name = fn.__name__
    plain = partial(_hyper, hp=hp, drawn=drawn) if labels is None else None
    out = {name: Entry(fn, self_mode, hyper=plain, **options)}
    if _accepts_ref(fn):
        out[f"{name}[ref]"] = Entry(fn, ref_mode, **options)
    if mined:
        out[f"{name}[mined]"] = Entry(fn, lambda d: self_mode(d, mine=True), **options)
    if listed is not None:
        listed_options = {**options, "backend": listed}
        out[f"{name}[listed]"] = Entry(fn, partial(self_mode, listing=True), **listed_options)
    if tiled:
        out[f"{name}[tiled]"] = Entry(fn, partial(self_mode, chunk=3), **options)
        if _accepts_ref(fn):  # inductor generates the engine's code for name[tiled]
            ref_options = {**options, "backend": _SHARED}
            out[f"{name}[tiled,ref]"] = Entry(fn, partial(ref_mode, chunk=3), **ref_options)
    return out


def learnable(
    fn: Callable,
    init: Callable,
    *init_args: Any,
    drawn: Mapping[str, Callable[[Draw], torch.Tensor]] | None = None,
    **hp: Any,
) -> Callable[[Draw], Call]:
    """``fn(embeddings, labels, params, **hp)``, params from ``init(*init_args)`` (their
    leaves differentiated); ``drawn`` holds tensor hyper-parameters drawn on the device."""

    def make(d: Draw) -> Call:
        y = d.labels()
        params = d.params(init, *init_args)
        wrt = {"embeddings": d.randn(B, D), **{f"params.{k}": v for k, v in params.items()}}
        kw = _hyper(d, hp, drawn)

        def run(embeddings, **leaves):
            given = {k.removeprefix("params."): v for k, v in leaves.items()}
            return fn(embeddings, y, given, **kw)

        return Call(wrt, run)

    return make


# p2s_grad's weight gradient by design (gradcheck holds the weights constant)
_P2S_STRAIGHT_THROUGH = (
    ("params.weight",),
    "p2s_grad's weight gradient is straight-through the renormalisation PML does in place "
    "(test_proxies checks it against PML and the reference)",
)


def _logits_entropy(loss: Callable, embeddings, labels, params, **hp):
    """The cross entropy of ``class_logits(loss, ...)`` with the labels (a scalar of them)."""
    logits = pf.losses.class_logits(loss, embeddings, params, labels, **hp)
    return torch.nn.functional.cross_entropy(logits, labels)


def miner(fn: Callable, rows: int = B, **hp: Any) -> Callable[[Draw], Call]:
    """``fn(embeddings, labels, **hp)``; ``generator=True`` passes the seed tensor."""

    def make(d: Draw) -> Call:
        y = d.labels((LABELS * 2)[:rows])
        kw = {k: d.seed() if k == "generator" else v for k, v in hp.items()}
        return Call({"embeddings": d.randn(rows, D)}, lambda embeddings: fn(embeddings, y, **kw))

    return make


def _pair_margin(emb: torch.Tensor, labels: torch.Tensor):
    return pf.miners.pair_margin(emb, labels, pos_margin=0.4, neg_margin=1.0)


def _multi_hot(d: Draw, rows: int) -> torch.Tensor:
    return d.multi_hot(rows, 3)


def _vicreg(d: Draw) -> Call:
    wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(B, D)}
    return Call(wrt, lambda embeddings, ref_emb: pf.losses.vicreg(embeddings, ref_emb))


def _vicregl(d: Draw) -> Call:
    """Two global views (pooled ``(B, 2, D)`` as ``embeddings``, ``3 × 3`` feature maps as
    ``ref_emb``) differentiated; one local view (``2 × 2`` maps, in values bfloat16 holds
    exactly: cast with the embeddings) and the grids drawn and held."""
    grids, local_grids = d.rand(B, 2, 3, 3, 2), d.rand(B, 1, 2, 2, 2)
    local, local_maps = (
        d._made(d.randn(*shape).to(torch.bfloat16).to(d.dtype))
        for shape in ((B, 1, D), (B, 1, 2, 2, D))
    )
    wrt = {"embeddings": d.randn(B, 2, D), "ref_emb": d.randn(B, 2, 3, 3, D)}
    return Call(
        wrt,
        lambda embeddings, ref_emb: pf.losses.vicregl(
            (embeddings, ref_emb),
            grids,
            (local.to(embeddings.dtype), local_maps.to(embeddings.dtype)),
            local_grids,
            num_matches=(4, 2),
        ),
    )


def two_views(fn: Callable, **hp: Any) -> Callable[[Draw], Call]:
    """A self-supervised loss of two row-aligned views ``fn(emb_a, emb_b, **hp)``."""

    def make(d: Draw) -> Call:
        wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(B, D)}
        return Call(wrt, lambda embeddings, ref_emb: fn(embeddings, ref_emb, **hp))

    return make


def _dino(d: Draw) -> Call:
    """The student's views differentiated (``embeddings``, ``(B, 4, D)``); the teacher's two
    views and the centre drawn and held (the loss detaches the teacher: tests/test_self_supervised.py)."""
    teacher = d.randn(B, 2, D)
    state = {"center": d.randn(D)}
    return Call(
        {"embeddings": d.randn(B, 4, D)},
        lambda embeddings: pf.losses.dino(teacher, embeddings, state, teacher_temp=0.5),
    )


def _swav(d: Draw) -> Call:
    """Two low-resolution crops' prototype scores differentiated (``embeddings``,
    ``(B, 2, D)``); the two high-resolution crops' drawn and held, in values bfloat16 holds
    exactly: their codes are computed without a gradient by design (so a numerical gradient
    through them would not match), and tests/test_self_supervised.py checks their gradient
    as predictions against the float64 loops."""
    high = d._made(d.randn(B, 2, D).to(torch.bfloat16).to(d.dtype))
    return Call(
        {"embeddings": d.randn(B, 2, D)},
        lambda embeddings: pf.losses.swav(high.to(embeddings.dtype), embeddings),
    )


def _tico(d: Draw) -> Call:
    """Both views differentiated; the running covariance drawn (a PSD matrix) and held."""
    c = d.randn(D, D)
    state = {"covariance": d._made(c @ c.T / D)}
    wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(B, D)}
    return Call(wrt, lambda embeddings, ref_emb: pf.losses.tico(embeddings, ref_emb, state))


def _mmcr(d: Draw) -> Call:
    """Two views of each sample (``embeddings``, ``(B, 2, D)``) and two momentum views
    (``ref_emb``), both differentiated (the loss does not detach the momentum views)."""
    wrt = {"embeddings": d.randn(B, 2, D), "ref_emb": d.randn(B, 2, D)}
    return Call(wrt, lambda embeddings, ref_emb: pf.losses.mmcr(embeddings, ref_emb, lmda=0.5))


def _koleo(d: Draw) -> Call:
    return Call({"embeddings": d.randn(B, D)}, lambda embeddings: pf.losses.koleo(embeddings))


def _sigreg(d: Draw) -> Call:
    """A seed tensor for the directions (the form compile and CUDA graphs take)."""
    seed = d.seed()
    return Call(
        {"embeddings": d.randn(B, D)},
        lambda embeddings: pf.losses.sigreg(embeddings, generator=seed, num_vectors=16),
    )


def _ibot_patch(d: Draw) -> Call:
    """The student's patches differentiated (``embeddings``, ``(B, 3, D)``); the teacher's, the
    mask (image 0's first patch masked, image 1 none) and the centre drawn and held (the loss
    detaches the teacher: tests/test_self_supervised.py)."""
    teacher = d.randn(B, 3, D)
    mask = torch.tensor([[True, False, True], [False] * 3] + [[True, True, False]] * (B - 2))
    mask = d._made(mask.to(d.device))
    state = {"center": d.randn(D)}
    return Call(
        {"embeddings": d.randn(B, 3, D)},
        lambda embeddings: pf.losses.ibot_patch(teacher, embeddings, mask, state, teacher_temp=0.5),
    )


def _msn(fn: Callable, **hp: Any) -> Callable[[Draw], Call]:
    """MSN's two anchor views (``embeddings``, ``(B, 2, D)``) and the prototypes
    (``prototypes``, ``(C, D)``) differentiated; the targets drawn and held (the loss detaches
    them: tests/test_self_supervised.py), in values bfloat16 holds exactly, cast to the anchors'
    dtype as a model would give them."""

    def make(d: Draw) -> Call:
        targets = d._made(d.randn(B, D).to(torch.bfloat16).to(d.dtype))
        wrt = {"embeddings": d.randn(B, 2, D), "prototypes": d.randn(C, D)}
        return Call(
            wrt,
            lambda embeddings, prototypes: fn(
                embeddings, targets.to(embeddings.dtype), prototypes, temperature=0.5, **hp
            ),
        )

    return make


# the targets' Sinkhorn codes read the prototypes without a gradient (MSN's and lightly's)
_MSN_TARGET_CODES = (
    ("prototypes",),
    "the targets' codes use the prototypes without a gradient by design, so a numerical "
    "gradient through them would not match (tests/test_self_supervised.py checks the "
    "prototypes' gradient against the float64 loops and lightly)",
)


def _wmse(d: Draw) -> Call:
    """Two views of ``2 B`` samples whitened in two sub-batches of ``B = 2 D`` (a seed tensor
    for the permutation)."""
    seed = d.seed()
    return Call(
        {"embeddings": d.randn(2 * B, 2, D)},
        lambda embeddings: pf.losses.wmse(embeddings, generator=seed, w_size=B, eps=0.1),
    )


def _sym_neg_cosine_similarity(d: Draw) -> Call:
    """The predictions ``p0``, ``p1`` differentiated (``embeddings``, ``ref_emb``); the
    projections ``z0``, ``z1`` drawn and held (the loss detaches them: no gradient by design,
    tests/test_self_supervised.py checks it), cast to the predictions' dtype as a model would
    give them."""
    # held in values that bfloat16 and float16 hold exactly: every dtype a run casts them to
    # reads the same projections
    z0, z1 = (d._made(d.randn(B, D).to(torch.bfloat16).to(d.dtype)) for _ in range(2))
    wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(B, D)}
    return Call(
        wrt,
        lambda embeddings, ref_emb: pf.losses.sym_neg_cosine_similarity(
            z0.to(embeddings.dtype), embeddings, z1.to(ref_emb.dtype), ref_emb
        ),
    )


def _queue(d: Draw) -> dict[str, torch.Tensor]:
    """A document queue (:mod:`pmlfunc.queues`) of 6 slots holding 4 entries, queries and
    ids too (anchor id 0 and positive id 1 equal to the retrieval entries' rows'), drawn."""
    queue = pf.queues.document_queue_init(6, D, queries=True, dtype=d.dtype, device=d.device)
    queue = pf.queues.document_queue_push(
        queue, d.randn(4, D), queries=d.randn(4, D), anchor_ids=d.labels([0, 9, 9, 9]),
        positive_ids=d.labels([9, 1, 9, 9]),
    )  # fmt: skip
    return {k: d._made(v) for k, v in queue.items()}


def paired(fn: Callable, init: Callable, memory: bool = False, **hp: Any) -> dict[str, Entry]:
    """A loss of two aligned sets ``fn(emb_a, emb_b, params, **hp)``: dense, tiled
    (``name[tiled]``, ``chunk_size=3``) and with labels on the tiled path
    (``name[tiled,labels]``); both sets and the params leaves differentiated. ``memory``: also
    tiled against a queue of earlier rows with the rows' ids, which mask two of the queue's
    entries (``name[tiled,memory]``, :func:`_queue`; SigLIP with its bias)."""
    sigmoid = fn is L.siglip

    def make(d: Draw, chunk: int | None, labelled: bool, queued: bool = False) -> Call:
        params = d.params(init, logit_bias=None if queued and not sigmoid else 0.5)
        y = d.labels() if labelled else None
        kw = {**hp, "memory": _queue(d)} if queued else hp
        if queued:  # the rows' ids: two of the queue's entries are masked
            rows = list(range(B))
            kw = {**kw, "anchor_ids": d.labels(rows), "positive_ids": d.labels(rows)}
        wrt = {
            "embeddings": d.randn(B, D),
            "ref_emb": d.randn(B, D),
            **{f"params.{k}": v for k, v in params.items()},
        }

        def run(embeddings, ref_emb, **leaves):
            given = {k.removeprefix("params."): v for k, v in leaves.items()}
            return fn(embeddings, ref_emb, given, labels=y, chunk_size=chunk, **kw)

        return Call(wrt, run)

    name = fn.__name__
    entries = {
        name: Entry(fn, partial(make, chunk=None, labelled=False)),
        f"{name}[tiled]": Entry(fn, partial(make, chunk=3, labelled=False)),
        f"{name}[tiled,labels]": Entry(fn, partial(make, chunk=3, labelled=True)),
    }
    if memory:
        make_queued = partial(make, chunk=3, labelled=False, queued=True)
        entries[f"{name}[tiled,memory]"] = Entry(fn, make_queued, backend=_SHARED)
    return entries


def retrieval(fn: Callable) -> dict[str, Entry]:
    """``multiple_negatives_ranking(anchors, positives, negatives, params, ...)``: queries
    (``embeddings``), positives (``ref_emb``) and hard negatives differentiated; dense with the
    default options, tiled with every direction and ids (``name[tiled]``), and tiled with a
    guide's masks and a learnable scale (``name[tiled,guide]``), and tiled with every direction
    and ids against a queue (``name[tiled,memory]``, :func:`_queue`). Hardness weighting detaches its
    term by design (no gradcheck): tests/test_retrieval.py checks it against the reference."""
    all_directions = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

    def make(d: Draw, chunk: int | None, variant: str) -> Call:
        wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(B, D), "negatives": d.randn(B, 2, D)}
        kw: dict[str, Any] = {"chunk_size": chunk}
        if variant in ("ids", "memory"):
            kw["directions"] = all_directions
            kw["anchor_ids"] = d.labels([0, 1, 2, 0, 4, 5, 6, 7])
            kw["positive_ids"] = d.labels([0, 1, 2, 3, 4, 1, 6, 7])
        if variant == "memory":
            kw["memory"] = _queue(d)
        if variant == "guide":
            kw["directions"] = ("query_to_doc", "query_to_query", "doc_to_doc")
            kw["guide"] = (d.randn(B, 3), d.randn(B, 3), d.randn(B, 2, 3))
            kw["margin"] = 0.1
            wrt["params.logit_scale"] = d.params(pf.losses.multiple_negatives_ranking_init, 10.0)[
                "logit_scale"
            ]

        def run(embeddings, ref_emb, negatives, **leaves):
            given = {k.removeprefix("params."): v for k, v in leaves.items()} or None
            return fn(embeddings, ref_emb, negatives, given, **kw)

        return Call(wrt, run)

    name = fn.__name__
    return {
        name: Entry(fn, partial(make, chunk=None, variant="plain")),
        f"{name}[tiled]": Entry(fn, partial(make, chunk=3, variant="ids"), backend=_SHARED),
        f"{name}[tiled,guide]": Entry(fn, partial(make, chunk=3, variant="guide"), backend=_SHARED),
        f"{name}[tiled,memory]": Entry(
            fn, partial(make, chunk=3, variant="memory"), backend=_SHARED
        ),
    }


def scored(
    fn: Callable,
    variant: str,
    *,
    drawn: Mapping[str, Callable[[Draw], torch.Tensor]] | None = None,
    **hp: Any,
) -> Callable[[Draw], Call]:
    """A loss of given scores (``pmlfunc.losses.graded``): the queries or first texts
    (``embeddings``), their partners (``ref_emb``) and, where the loss reads them, ``negatives``
    ``(B, 2, D)`` differentiated; the teacher's or gold scores drawn and held (they are data,
    never differentiated: tests/test_graded.py checks that). ``variant``: ``"margins"`` /
    ``"scores"`` (a teacher's ``(B, 2)`` margins or ``(B, 3)`` scores), ``"labels"`` (gold
    scores with ties: :data:`LABELS`), ``"rand"`` (distinct gold scores), ``"negatives"``
    (``angle``'s n-tuples, no gold); ``drawn`` holds tensor hyper-parameters drawn on the
    device."""

    def make(d: Draw) -> Call:
        wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(B, D)}
        kw = _hyper(d, hp, drawn)
        if variant in ("margins", "scores"):
            wrt["negatives"] = d.randn(B, 2, D)
            given = d.randn(B, 2 if variant == "margins" else 3)
            return Call(wrt, lambda embeddings, ref_emb, negatives: fn(
                embeddings, ref_emb, negatives, given, **kw
            ))  # fmt: skip
        if variant == "negatives":
            wrt["negatives"] = d.randn(B, 2, D)
            return Call(wrt, lambda embeddings, ref_emb, negatives: fn(
                embeddings, ref_emb, negatives=negatives, **kw
            ))  # fmt: skip
        gold = d.labels() if variant == "labels" else d.rand(B)
        return Call(wrt, lambda embeddings, ref_emb: fn(embeddings, ref_emb, gold, **kw))

    return make


def _mega_batch_margin(d: Draw, **hp: Any) -> Call:
    """Anchors (``embeddings``) and their positives (``ref_emb``), the positives near the
    anchors so that both hinges are active for some rows and not for others."""
    a = d.randn(B, D)
    wrt = {"embeddings": a, "ref_emb": d._made(a + 0.7 * d.randn(B, D))}
    return Call(
        wrt, lambda embeddings, ref_emb: pf.losses.mega_batch_margin(embeddings, ref_emb, **hp)
    )


def _dynamic_soft_margin(d: Draw) -> Call:
    state = {"hist": d.rand(10)}
    y = d.labels()
    return Call(
        {"embeddings": d.randn(B, D)},
        lambda embeddings: pf.losses.dynamic_soft_margin(embeddings, y, state, momentum=0.5),
    )


def _manifold(d: Draw, given: bool = False) -> Call:
    """manifold drawing its meta-classes from ``generator=``, or (``given``) on meta-classes
    drawn beforehand and passed as ``indices_tuple``."""
    params = d.params(pf.losses.manifold_init, D, 3)
    seed = d.seed()
    if given:
        kw = {"indices_tuple": pf.losses.manifold_meta_classes(seed, B, 3)}
    else:
        kw = {"generator": seed}

    def run(embeddings, proxies):
        return pf.losses.manifold(embeddings, None, {"proxies": proxies}, margin=0.05, **kw)

    return Call({"embeddings": d.randn(B, D), "proxies": params["proxies"]}, run)


def _margins(d: Draw) -> torch.Tensor:
    return torch.linspace(0.1, 0.6, C, dtype=F64).to(d.device, d.dtype)


def _scalar(value: float) -> Callable[[Draw], torch.Tensor]:
    """A 0-d tensor hyper-parameter on the draw's device."""
    return lambda d: torch.tensor(value, dtype=F64).to(d.device, d.dtype)


def _distinct_betas(num_classes: int, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``margin_init``'s per-class betas, made distinct (a gradient sent to the wrong class
    shows)."""
    beta = pf.losses.margin_init(1.2, num_classes, dtype=dtype)["beta"]
    return {"beta": beta + 0.05 * torch.arange(num_classes, dtype=dtype)}


# Losses whose ops inductor already generates code for in another entry (contrastive,
# multi_similarity, ...): dynamo's full-graph capture and AOT autograd only, ~8 s less each.
def _chunked_loss(fn: Callable, hyper: str, value: float) -> Callable[[Draw], Call]:
    """``pf.chunked.loss(fn, 3)(embeddings, labels, ref_emb=, ref_labels=, hyper=)``, the
    embeddings, the reference set and the tensor hyper-parameter differentiated."""

    def make(d: Draw) -> Call:
        y, ry = d.labels(LABELS), d.labels(REF_LABELS)
        wrt = {"embeddings": d.randn(B, D), "ref_emb": d.randn(M, D), hyper: _scalar(value)(d)}
        chunked = pf.chunked.loss(fn, 3)

        def run(embeddings, ref_emb, **h):
            return chunked(embeddings, y, ref_emb=ref_emb, ref_labels=ry, **h)

        return Call(wrt, run)

    return make


def _matryoshka(d: Draw) -> Call:
    """``matryoshka(ntxent, (4, 2, 1))`` on the tiled engine (``chunk_size=3``)."""
    y = d.labels(LABELS)
    nested = pf.transforms.matryoshka(L.ntxent, (D, 2, 1), (1.0, 0.5, 0.25))
    return Call(
        {"embeddings": d.randn(B, D)}, lambda embeddings: nested(embeddings, y, chunk_size=3)
    )


def _matryoshka_pairs(d: Draw) -> Call:
    """``matryoshka(multi_similarity, (4, 2, 1))`` against a reference set: every width's
    cosine matrix from one blocked product, given to the loss as ``mat=``."""
    y, ry = d.labels(LABELS), d.labels(REF_LABELS)
    nested = pf.transforms.matryoshka(L.multi_similarity, (D, 2, 1), (1.0, 0.5, 0.25))

    def run(embeddings, ref_emb):
        return nested(embeddings, y, ref_emb=ref_emb, ref_labels=ry)

    return Call({"embeddings": d.randn(B, D), "ref_emb": d.randn(M, D)}, run)


def _matryoshka_pair(fn: Callable, init: Callable) -> Callable[[Draw], Call]:
    """``matryoshka(clip or siglip, (4, 2, 1))`` with labels on the tiled engine
    (``chunk_size=3``; CLIP's backward walks the widths' tiles again), both sets and the params
    leaves differentiated."""

    def make(d: Draw) -> Call:
        params = d.params(init, logit_bias=0.5)
        y = d.labels()
        nested = pf.transforms.matryoshka(fn, (D, 2, 1), (1.0, 0.5, 0.25))
        wrt = {
            "embeddings": d.randn(B, D),
            "ref_emb": d.randn(B, D),
            **{f"params.{k}": v for k, v in params.items()},
        }

        def run(embeddings, ref_emb, **leaves):
            given = {k.removeprefix("params."): v for k, v in leaves.items()}
            return nested(embeddings, ref_emb, given, labels=y, chunk_size=3)

        return Call(wrt, run)

    return make


def _adaptive_layers(d: Draw) -> Call:
    """``adaptive_layers(supcon)`` over two layers (the first one as ``embeddings``), the KL
    term on."""
    y = d.labels(LABELS)
    layered = pf.transforms.adaptive_layers(L.supcon, layer_weighting="log", kl_weight=0.5)
    return Call(
        {"embeddings": d.randn(B, D), "last_layer": d.randn(B, D)},
        lambda embeddings, last_layer: layered([embeddings, last_layer], y),
    )


_SHARED = "aot_eager"
_RANKING_GRADCHECK = {"eps": 1e-7, "atol": 1e-6}  # histogram bins: kinks at the bin nodes
L = pf.losses
LOSSES: dict[str, Entry] = {
    # pairs
    **batch(L.contrastive, pos_margin=0.1, neg_margin=0.8),
    **batch(L.signal_to_noise_ratio_contrastive, pos_margin=0.1, neg_margin=0.9, backend=_SHARED),
    **batch(L.intra_pair_variance, pos_eps=0.05, neg_eps=0.02, backend=_SHARED),
    **batch(
        L.threshold_consistent_margin,
        mined=True,
        margin_plus=0.5,
        margin_minus=0.1,
        lambda_plus=0.7,
    ),
    # pair_weighting
    **batch(L.multi_similarity, alpha=2.0, beta=10.0, base=0.5),
    **batch(
        L.circle,
        backend=_SHARED,
        m=0.3,
        gamma=20.0,
        constant=(
            ("embeddings", "ref_emb"),
            "circle detaches its pair weights α_p, α_n (PML, paper code): test_pair_weighting "
            "checks its gradient against the loss with those weights frozen",
        ),
    ),
    **batch(L.lifted_structure, neg_margin=1.2, pos_margin=0.1),
    **batch(L.generalized_lifted_structure, neg_margin=1.2, pos_margin=0.1, backend=_SHARED),
    **batch(L.tuplet_margin, margin=8.0, scale=16.0),
    # triplets
    **batch(L.triplet_margin, listed="inductor", margin=0.2),
    **batch(L.margin, listed=_SHARED, margin=0.25, beta=1.25),
    "margin[params]": Entry(
        L.margin, learnable(L.margin, _distinct_betas, C, nu=0.1, reducer=pf.reducers.mean())
    ),
    **batch(L.selectively_contrastive_triplet, temperature=0.2, penalty=1.3, hard_cutoff=0.3),
    # softmax
    **batch(L.ntxent, tiled=True, temperature=0.3),
    **batch(L.supcon, tiled=True, temperature=0.3),
    **batch(L.decoupled_contrastive, temperature=0.3, sigma=0.5),
    **batch(L.multi_supcon, labels=_multi_hot, temperature=0.5, threshold=0.2),
    # cross_modal: two aligned sets, dense and on the tiled engine
    **paired(L.clip, L.clip_init, memory=True),
    **paired(L.siglip, L.siglip_init, memory=True),
    # retrieval: queries, positives and hard negatives on the tiled engine
    **retrieval(L.multiple_negatives_ranking),
    # graded: given scores (a teacher's margins or scores, gold similarities), never differentiated
    "margin_mse": Entry(L.margin_mse, scored(L.margin_mse, "margins")),
    "margin_mse[scores]": Entry(
        L.margin_mse,
        scored(L.margin_mse, "scores", distance=pf.distances.cosine()),
        backend=_SHARED,
    ),
    "distill_kl_div": Entry(
        L.distill_kl_div,
        scored(L.distill_kl_div, "scores", student_temperature=0.5, teacher_temperature=2.0),
    ),
    "distill_kl_div[cosine]": Entry(
        L.distill_kl_div,
        scored(
            L.distill_kl_div,
            "scores",
            drawn={"temperature": _scalar(0.3)},
            distance=pf.distances.cosine(),
        ),
        backend=_SHARED,
    ),
    "cosent": Entry(L.cosent, scored(L.cosent, "labels", scale=5.0)),
    "cosent[rand]": Entry(
        L.cosent, scored(L.cosent, "rand", drawn={"scale": _scalar(3.0)}), backend=_SHARED
    ),
    "angle": Entry(L.angle, scored(L.angle, "labels", scale=5.0)),
    "angle[negatives]": Entry(L.angle, scored(L.angle, "negatives", scale=3.0), backend=_SHARED),
    # in_batch: the hardest in-batch negative
    "mega_batch_margin": Entry(L.mega_batch_margin, _mega_batch_margin),
    "mega_batch_margin[chunked]": Entry(
        L.mega_batch_margin, partial(_mega_batch_margin, chunk_size=3), backend=_SHARED
    ),
    # pf.chunked.loss: a chunkable loss, 3 anchors at a time, with a plain backward (the
    # reference set and a tensor hyper-parameter differentiated too)
    "multi_similarity[chunked.loss]": Entry(
        L.multi_similarity, _chunked_loss(L.multi_similarity, "alpha", 2.0), backend=_SHARED
    ),
    "contrastive[chunked.loss]": Entry(
        L.contrastive, _chunked_loss(L.contrastive, "neg_margin", 0.7), backend=_SHARED
    ),
    # pf.transforms: matryoshka widths (the tiled path inside), adaptive layers (two layers, KL)
    "ntxent[matryoshka]": Entry(L.ntxent, _matryoshka, backend=_SHARED),
    "clip[matryoshka]": Entry(L.clip, _matryoshka_pair(L.clip, L.clip_init), backend=_SHARED),
    "multi_similarity[matryoshka]": Entry(L.multi_similarity, _matryoshka_pairs, backend=_SHARED),
    "siglip[matryoshka]": Entry(
        L.siglip, _matryoshka_pair(L.siglip, L.siglip_init), backend=_SHARED
    ),
    "supcon[adaptive_layers]": Entry(
        L.supcon,
        _adaptive_layers,
        backend=_SHARED,
        constant=(
            ("last_layer",),
            "the last layer is the KL term's stop-gradient teacher: its gradient is its own "
            "loss's only (test_transforms checks the formula)",
        ),
    ),
    # self_supervised
    "vicreg": Entry(L.vicreg, _vicreg),
    "vicregl": Entry(L.vicregl, _vicregl),
    "barlow_twins": Entry(L.barlow_twins, two_views(L.barlow_twins)),
    "negative_cosine_similarity": Entry(
        L.negative_cosine_similarity, two_views(L.negative_cosine_similarity)
    ),
    "sym_neg_cosine_similarity": Entry(L.sym_neg_cosine_similarity, _sym_neg_cosine_similarity),
    "hypersphere": Entry(L.hypersphere, two_views(L.hypersphere, t=2.0, lam=0.5)),
    "dino": Entry(L.dino, _dino),
    "swav": Entry(L.swav, _swav),
    "tico": Entry(L.tico, _tico),
    "mmcr": Entry(L.mmcr, _mmcr),
    "koleo": Entry(L.koleo, _koleo),
    "sigreg": Entry(L.sigreg, _sigreg),
    "ibot_patch": Entry(L.ibot_patch, _ibot_patch),
    "wmse": Entry(L.wmse, _wmse),
    "msn": Entry(L.msn, _msn(L.msn), constant=_MSN_TARGET_CODES),
    "pmsn": Entry(
        L.pmsn, _msn(L.pmsn, power_law_exponent=0.5), constant=_MSN_TARGET_CODES, backend=_SHARED
    ),
    # neighbors
    **batch(L.nca, mined=True, softmax_scale=2.0),
    **batch(L.npairs, mined=True),
    **batch(L.angular, mined=True, alpha=35.0),
    **batch(L.instance, gamma=8.0),
    **batch(L.ranked_list, margin=0.6, Tn=3.0, Tp=1.5, imbalance=0.3),
    "manifold": Entry(L.manifold, _manifold, backend="aot_eager"),
    "manifold[meta_classes]": Entry(L.manifold, partial(_manifold, given=True)),
    # ranking
    **batch(L.fast_ap, mined=True, num_bins=6, gradcheck=_RANKING_GRADCHECK),
    **batch(L.histogram, mined=True, n_bins=10, gradcheck=_RANKING_GRADCHECK),
    **batch(L.smooth_ap, drawn={"temperature": _scalar(0.3)}),
    **batch(L.pnp, variant="Iu", anneal=0.3),
    "dynamic_soft_margin": Entry(
        L.dynamic_soft_margin, _dynamic_soft_margin, gradcheck=_RANKING_GRADCHECK
    ),
    # proxies
    "proxy_anchor": Entry(
        L.proxy_anchor, learnable(L.proxy_anchor, L.proxy_anchor_init, C, D, alpha=4.0)
    ),
    "proxy_nca": Entry(
        L.proxy_nca, learnable(L.proxy_nca, L.proxy_nca_init, C, D, softmax_scale=5.0)
    ),
    "normalized_softmax": Entry(
        L.normalized_softmax,
        learnable(L.normalized_softmax, L.normalized_softmax_init, C, D, temperature=0.5),
    ),
    "soft_triple": Entry(
        L.soft_triple,
        learnable(
            L.soft_triple,
            partial(L.soft_triple_init, centers_per_class=3),
            C,
            D,
            la=10.0,
            gamma=0.3,
        ),
    ),
    "p2s_grad": Entry(
        L.p2s_grad,
        learnable(L.p2s_grad, L.p2s_grad_init, C, D),
        constant=_P2S_STRAIGHT_THROUGH,
    ),
    # margin_softmax
    "large_margin_softmax": Entry(
        L.large_margin_softmax,
        learnable(L.large_margin_softmax, L.large_margin_softmax_init, C, D),
    ),
    "sphereface": Entry(L.sphereface, learnable(L.sphereface, L.sphereface_init, C, D)),
    "cosface": Entry(L.cosface, learnable(L.cosface, L.cosface_init, C, D, scale=8.0)),
    "arcface": Entry(L.arcface, learnable(L.arcface, L.arcface_init, C, D, scale=8.0)),
    "subcenter_arcface": Entry(
        L.subcenter_arcface,
        learnable(L.subcenter_arcface, L.subcenter_arcface_init, C, D, scale=8.0),
    ),
    "dynamic_arcface": Entry(
        L.dynamic_arcface,
        learnable(
            L.dynamic_arcface, L.dynamic_arcface_init, C, D, scale=8.0, drawn={"margins": _margins}
        ),
    ),
    # the classifier losses over tiles of classes (class_chunk_size=2: tiles of 2, 2 and 1 of
    # the 5 classes; test_class_tiles.py); inductor compiles the sub-centre and the magnitude walk
    "arcface[classes]": Entry(
        L.arcface,
        learnable(L.arcface, L.arcface_init, C, D, scale=8.0, class_chunk_size=2),
        backend=_SHARED,
    ),
    "cosface[classes]": Entry(
        L.cosface,
        learnable(L.cosface, L.cosface_init, C, D, scale=8.0, class_chunk_size=2),
        backend=_SHARED,
    ),
    "sphereface[classes]": Entry(
        L.sphereface,
        learnable(L.sphereface, L.sphereface_init, C, D, class_chunk_size=2),
        backend=_SHARED,
    ),
    "large_margin_softmax[classes]": Entry(
        L.large_margin_softmax,
        learnable(L.large_margin_softmax, L.large_margin_softmax_init, C, D, class_chunk_size=2),
    ),
    "subcenter_arcface[classes]": Entry(
        L.subcenter_arcface,
        learnable(
            L.subcenter_arcface, L.subcenter_arcface_init, C, D, scale=8.0, class_chunk_size=2
        ),
    ),
    "dynamic_arcface[classes]": Entry(
        L.dynamic_arcface,
        learnable(
            L.dynamic_arcface,
            L.dynamic_arcface_init,
            C,
            D,
            scale=8.0,
            drawn={"margins": _margins},
            class_chunk_size=2,
        ),
        backend=_SHARED,
    ),
    "normalized_softmax[classes]": Entry(
        L.normalized_softmax,
        learnable(
            L.normalized_softmax,
            L.normalized_softmax_init,
            C,
            D,
            temperature=0.5,
            class_chunk_size=2,
        ),
        backend=_SHARED,
    ),
    "proxy_nca[classes]": Entry(
        L.proxy_nca,
        learnable(L.proxy_nca, L.proxy_nca_init, C, D, softmax_scale=5.0, class_chunk_size=2),
        backend=_SHARED,
    ),
    "proxy_anchor[classes]": Entry(
        L.proxy_anchor,
        learnable(L.proxy_anchor, L.proxy_anchor_init, C, D, alpha=4.0, class_chunk_size=2),
        backend=_SHARED,
    ),
    "soft_triple[classes]": Entry(
        L.soft_triple,
        learnable(
            L.soft_triple,
            partial(L.soft_triple_init, centers_per_class=3),
            C,
            D,
            la=10.0,
            gamma=0.3,
            class_chunk_size=2,
        ),
        backend=_SHARED,
    ),
    "p2s_grad[classes]": Entry(
        L.p2s_grad,
        learnable(L.p2s_grad, L.p2s_grad_init, C, D, class_chunk_size=2),
        backend=_SHARED,
        constant=_P2S_STRAIGHT_THROUGH,
    ),
    # class logits (B, C), checked through their cross entropy: the margin heads, the soft
    # centres and a distance's
    **{
        f"class_logits[{loss.__name__}]": Entry(
            L.class_logits, learnable(partial(_logits_entropy, loss), init, C, D, **hp)
        )
        for loss, init, hp in (
            (L.arcface, L.arcface_init, {"scale": 8.0}),
            (L.soft_triple, partial(L.soft_triple_init, centers_per_class=3), {"la": 10.0}),
            (L.proxy_nca, L.proxy_nca_init, {"softmax_scale": 5.0}),
        )
    },
    # centroids: params {"w", "b"} from ge2e_init(); LABELS has a singleton class (left out)
    "ge2e": Entry(L.ge2e, learnable(L.ge2e, L.ge2e_init)),
    "ge2e[contrast]": Entry(L.ge2e, learnable(L.ge2e, L.ge2e_init, variant="contrast")),
    "ge2e[num_classes]": Entry(
        L.ge2e, learnable(L.ge2e, L.ge2e_init, num_classes=C), backend=_SHARED
    ),
}
N = pf.miners
_STOCHASTIC = "aot_eager"  # the counter-based hash (see Entry.backend)
MINERS: dict[str, Entry] = {
    "angular": Entry(N.angular, miner(N.angular, angle=30)),
    "angular[tuples_per_anchor]": Entry(
        N.angular,
        miner(N.angular, angle=30, tuples_per_anchor=2, generator=True),
        backend=_STOCHASTIC,
    ),
    "batch_easy_hard": Entry(N.batch_easy_hard, miner(N.batch_easy_hard)),
    "batch_hard": Entry(N.batch_hard, miner(N.batch_hard)),
    "distance_weighted": Entry(
        N.distance_weighted, miner(N.distance_weighted, generator=True), backend=_STOCHASTIC
    ),
    "embeddings_already_packaged_as_triplets": Entry(
        N.embeddings_already_packaged_as_triplets,
        miner(N.embeddings_already_packaged_as_triplets, rows=9),
    ),
    "hdc": Entry(N.hdc, miner(N.hdc, filter_percentage=0.5)),
    "multi_similarity": Entry(N.multi_similarity, miner(N.multi_similarity)),
    "pair_margin": Entry(N.pair_margin, miner(N.pair_margin, pos_margin=0.4, neg_margin=1.0)),
    "pair_margin[tuples_per_anchor]": Entry(
        N.pair_margin,
        miner(N.pair_margin, tuples_per_anchor=3, generator=True),
        backend=_STOCHASTIC,
    ),
    "triplet_margin": Entry(N.triplet_margin, miner(N.triplet_margin, margin=0.3)),
    "triplet_margin[tuples_per_anchor]": Entry(
        N.triplet_margin,
        miner(N.triplet_margin, tuples_per_anchor=3, generator=True),
        backend=_STOCHASTIC,
    ),
    "uniform_histogram": Entry(
        N.uniform_histogram,
        miner(N.uniform_histogram, num_bins=4, generator=True),
        backend=_STOCHASTIC,
    ),
}
EVERYTHING = {
    **{f"losses.{k}": v for k, v in LOSSES.items()},
    **{f"miners.{k}": v for k, v in MINERS.items()},
}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def loss_of(out: Any) -> torch.Tensor:
    """The loss of a loss function's output (``dynamic_soft_margin`` returns its state too)."""
    return out[0] if isinstance(out, tuple) else out


def leaves(call: Call) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_(True) for k, v in call.wrt.items()}


def value_and_grads(run: Callable, call: Call) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """``run``'s output on fresh leaves of ``call.wrt`` and the gradients of its loss."""
    x = leaves(call)
    out = run(**x)
    return out, torch.autograd.grad(loss_of(out), list(x.values()))


# ----------------------------------------------------------------------------------------------
# the properties
# ----------------------------------------------------------------------------------------------
def _public(module) -> dict[str, Any]:
    return {name: getattr(module, name) for name in module.__all__}


def test_registry_covers_every_public_loss_and_miner():
    for module, entries in ((pf.losses, LOSSES), (pf.miners, MINERS)):
        public = _public(module)
        registered = {e.fn for e in entries.values()}
        excluded = EXCLUDED if module is pf.losses else {}
        missing = [n for n, f in public.items() if f not in registered and n not in excluded]
        assert not missing, f"{module.__name__}: neither registered nor excluded: {missing}"
        stale = [n for n in excluded if n not in public]
        assert not stale, f"excluded names that are not public: {stale}"
        both = [n for n, f in public.items() if f in registered and n in excluded]
        assert not both, f"both registered and excluded: {both}"
        foreign = [e.fn.__name__ for e in entries.values() if e.fn not in public.values()]
        assert not foreign, f"{module.__name__}: registered but not public: {foreign}"


@pytest.mark.parametrize("name", list(LOSSES))
def test_gradcheck(name):
    f, inputs = _differentiated(name)
    assert torch.autograd.gradcheck(f, inputs, **LOSSES[name].gradcheck)


def _differentiated(name: str) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    """An entry's loss as a function of its varying differentiated tensors (float64), and
    those tensors; skips an entry with none (held constant, with the reason)."""
    entry = LOSSES[name]
    call = entry.make(Draw(F64))
    held, why = entry.constant or ((), "")
    varying = [k for k in call.wrt if k not in held]
    if not varying:
        pytest.skip(why)
    x = leaves(call)

    def f(*v):
        return loss_of(call.run(**{**x, **dict(zip(varying, v, strict=True))}))

    return f, tuple(x[k] for k in varying)


# The entries whose backward is a first-order Function by design: the tiled engine's losses
# (dense or chunked: CLIP, SigLIP, multiple_negatives_ranking, NT-Xent and SupCon given
# labels) and what wraps them, the class-tiled losses, matryoshka's one-product matrices and
# pf.chunked.loss. Differentiating their gradient again raises a RuntimeError saying so and
# what to call instead; every other loss is differentiable twice.
_TILED_ENGINE = ("ntxent", "supcon", "clip", "siglip", "multiple_negatives_ranking")
_FIRST_ORDER_PATHS = ("classes", "matryoshka", "chunked.loss")


def _first_order(name: str) -> bool:
    base, _, path = name.partition("[")
    return base in _TILED_ENGINE or bool(set(path.rstrip("]").split(",")) & set(_FIRST_ORDER_PATHS))


@pytest.mark.parametrize("name", list(LOSSES))
def test_second_derivatives(name):
    """``torch.autograd.gradgradcheck`` in float64 (the gradient's derivatives against finite
    differences, through a recorded backward), or, for the first-order entries, a
    ``RuntimeError`` saying they are not differentiable twice. ``LABELS``' singleton class
    gives rows with no positive pair and a class of one: there the NaN Hessians were
    (``torch.logaddexp``'s second derivative at an empty row's ``−finfo.max`` in
    multi_similarity, tuplet_margin and proxy_anchor; ``ge2e`` normalising a zero vector),
    and the general batch path's log-sum-exp backward wrote its exponentials in place (a
    double backward of ntxent/supcon with ``mat=``, multi_similarity, circle, lifted
    structure, tuplet margin raised autograd's in-place error); ``pf.chunked.loss`` returned
    no second-order terms without a word."""
    f, inputs = _differentiated(name)
    if _first_order(name):
        with pytest.raises(RuntimeError, match="is not differentiable"):
            torch.autograd.gradgradcheck(f, inputs, **LOSSES[name].gradcheck)
        return
    assert torch.autograd.gradgradcheck(f, inputs, **LOSSES[name].gradcheck)


@pytest.mark.parametrize("listing", ["default", "always"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_func_grad_equals_autograd(name, listing, monkeypatch):
    """Also with every mask's rows listed in eager mode (``pmlfunc._ops.sparse_rows``, taken
    by default only for sparse positives): inside the transform the static path runs, so the
    listed and the dense computations are compared, value and gradient."""
    if listing == "always":
        monkeypatch.setattr(pf._ops, "SPARSE_FRACTION", math.inf)
    call = LOSSES[name].make(Draw(F64))
    names = list(call.wrt)

    def loss(*v):
        value = loss_of(call.run(**dict(zip(names, v, strict=True))))
        return value, value

    got, got_value = torch.func.grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
        *call.wrt.values()
    )
    out, want = value_and_grads(call.run, call)
    torch.testing.assert_close(got_value, loss_of(out).detach(), rtol=1e-12, atol=1e-14)
    for k, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14, msg=lambda m, k=k: f"{k}: {m}")
    assert any(w.abs().max() > 0 for w in want), "every gradient is zero: nothing was compared"


def _without_versions(result: Any) -> Any:
    """A miner's result without its source's version counters (a TripletWindow's: read in
    eager mode only, ``()`` in a compiled graph, which cannot compare them; ``source_of``)."""
    if isinstance(result, pf.tuples.TripletWindow):
        return result._replace(source=result.source[:2])
    return result


def _assert_outputs_equal(got: Any, want: Any, **tol: float) -> None:
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            torch.testing.assert_close(a, b, **tol)
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a, b), f"{a} != {b}"
        else:
            assert a == b


@pytest.mark.compile
@pytest.mark.parametrize("name", list(EVERYTHING))
def test_compile_fullgraph_equals_eager(name):
    """One compiled function per entry, called once: its output (a loss's value and extra
    outputs, a miner's fixed-shape result) and a loss's gradients equal eager's."""
    entry = EVERYTHING[name]
    call = entry.make(Draw(F32))
    torch._dynamo.reset()
    compiled = torch.compile(call.run, fullgraph=True, backend=entry.backend)
    if name.startswith("miners."):
        got, want = (_without_versions(r) for r in (compiled(**call.wrt), call.run(**call.wrt)))
        _assert_outputs_equal(got, want)
    else:
        got, got_grads = value_and_grads(compiled, call)
        want, want_grads = value_and_grads(call.run, call)
        _assert_outputs_equal((got, got_grads), (want, want_grads), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


# The gradient taken inside the compiled function: dynamo traces torch.func's levels and each
# autograd.Function's forward and backward into one graph (the tiled NT-Xent failed there and
# not when differentiated outside). That tracing, functionalisation and the graph are what this
# adds to test_compile_fullgraph_equals_eager, whose inductor already generates code for the
# same forward and backward ops: so aot_eager, ~1 s an entry instead of 5-10 s with inductor
# (test_tiled.py compiles the engine's losses with inductor).
_TRANSFORMED_BACKEND = "aot_eager"


@pytest.mark.compile
@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_func_grad_and_value_equals_eager(name):
    """``torch.compile(torch.func.grad_and_value(loss, argnums=every differentiated tensor),
    fullgraph=True)`` gives eager ``torch.func.grad_and_value``'s gradients and value."""
    call = LOSSES[name].make(Draw(F32))
    names = list(call.wrt)

    def loss(*v):
        return loss_of(call.run(**dict(zip(names, v, strict=True))))

    transformed = torch.func.grad_and_value(loss, argnums=tuple(range(len(names))))
    torch._dynamo.reset()
    compiled = torch.compile(transformed, fullgraph=True, backend=_TRANSFORMED_BACKEND)
    got, want = compiled(*call.wrt.values()), transformed(*call.wrt.values())
    _assert_outputs_equal(got, want, rtol=1e-5, atol=1e-6)
    assert any(w.abs().max() > 0 for w in want[0]), "every gradient is zero: nothing was compared"
    torch._dynamo.reset()


# The core losses, and those whose compiled training graphs saved a (B, M) boolean mask for
# their backward (3-10 ms each at B = 512 on a CPU, where the float forms cost 0.2 ms): a
# comparison's mask, a diagonal or a triangle built from index comparisons, the conditions of a
# ``where`` and of ``logaddexp``. The partitioner's choice depends on the sizes (at this
# registry's 8 rows it saves masks it recomputes from 16 rows on), so the check runs at 32.
_SAVED_MASK_CASES = {
    name: getattr(pf.losses, name)
    for name in (
        "contrastive",
        "triplet_margin",
        "ntxent",
        "supcon",
        "multi_similarity",
        "threshold_consistent_margin",
        "lifted_structure",
        "histogram",
        "angular",
        "pnp",
        "smooth_ap",
    )
}


@pytest.mark.compile
@pytest.mark.parametrize("name", list(_SAVED_MASK_CASES))
def test_compiled_training_graph_saves_no_bool_mask(name):
    """A loss compiled with its backward (32 rows, 4 per class) saves no (B, M) bool mask."""
    rows = 32
    emb = torch.randn(rows, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    labels = torch.arange(rows) // 4
    torch._dynamo.reset()
    compiled = torch.compile(_SAVED_MASK_CASES[name], fullgraph=True)
    with compiled_saved_tensors() as saved:
        torch.autograd.grad(compiled(emb, labels), emb)
    assert saved, "no training graph was partitioned: the partitioner hook moved"
    assert not saved_bool_masks(saved, rows)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(EVERYTHING))
def test_runs_on_meta(name):
    """Inputs on the meta device: a loss gives a 0-d loss of the embeddings' dtype and
    gradients of every differentiated tensor's shape; a miner a result on meta."""
    call = EVERYTHING[name].make(Draw(F32, "meta"))
    if name.startswith("miners."):
        tensors = [t for t in tree_flatten(call.run(**call.wrt))[0] if isinstance(t, torch.Tensor)]
        assert tensors and all(t.device.type == "meta" for t in tensors)
        return
    x = leaves(call)
    loss = loss_of(call.run(**x))
    assert loss.device.type == "meta" and loss.shape == () and loss.dtype == F32
    grads = torch.autograd.grad(loss, list(x.values()))
    for (k, v), g in zip(x.items(), grads, strict=True):
        assert g.shape == v.shape and g.device.type == "meta", k


def _documented() -> dict[str, Callable]:
    """Every public function of ``pf.losses`` and ``pf.miners`` (registered or excluded)."""
    out = {}
    for module in (pf.losses, pf.miners):
        for name, obj in _public(module).items():
            if inspect.isfunction(obj):
                out[f"{module.__name__.rsplit('.', 1)[1]}.{name}"] = obj
    return out


@pytest.mark.parametrize("name", list(_documented()))
def test_docstring_has_an_example(name):
    fn = _documented()[name]
    examples = [t for t in doctest.DocTestFinder().find(fn, name) if t.examples]
    assert examples, f"{name} has no example in its docstring"


# ----------------------------------------------------------------------------------------------
# never a silent wrong number: non-finite inputs, no mutation, determinism, invariances
# ----------------------------------------------------------------------------------------------
def _with(call: Call, key: str, value: float) -> dict[str, torch.Tensor]:
    """``call.wrt`` with the first entry of ``key`` set to ``value`` (the others copied)."""
    wrt = {k: v.detach().clone() for k, v in call.wrt.items()}
    wrt[key].view(-1)[0] = value
    return wrt


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_non_finite_input_makes_the_loss_non_finite(name, value):
    """NaN or +inf in any differentiated tensor (embeddings, reference set, params) reaches a
    term, so the loss is NaN or inf: never a finite number over NaN gradients. (A logit scale
    of −inf is a legal limit, a scale of 0, and is not tried.)"""
    call = LOSSES[name].make(Draw(F64))
    for key in call.wrt:
        loss = loss_of(call.run(**_with(call, key, value)))
        assert not torch.isfinite(loss), f"{key}[0] = {value}: loss {float(loss)}"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_finite_loss_has_finite_gradients_whatever_entry_is_non_finite(name, value):
    """One non-finite entry, the first of each row of each differentiated tensor in turn: when
    the loss stays finite, every gradient is finite; a non-finite gradient comes with a
    non-finite loss, never unreported (npairs returned 1.12 over the NaN gradients of a row it
    does not pair, through the normalisation of every row)."""
    call = LOSSES[name].make(Draw(F64))
    for key, t in call.wrt.items():
        rows = t.shape[0] if t.ndim else 1
        for row in range(rows):
            wrt = {k: v.detach().clone() for k, v in call.wrt.items()}
            wrt[key].view(-1)[row * (t.numel() // rows)] = value
            out, grads = value_and_grads(call.run, Call(wrt, call.run))
            if torch.isfinite(loss_of(out)):
                for k, g in zip(wrt, grads, strict=True):
                    bad = int((~torch.isfinite(g)).sum())
                    assert not bad, (
                        f"{key}[{row}, 0] = {value}: loss {float(loss_of(out))}, "
                        f"{bad} non-finite entries in the gradient of {k}"
                    )


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("name", list(MINERS))
def test_a_miner_on_non_finite_embeddings_returns_its_usual_result(name, value):
    """A non-finite row compares false with every threshold: the miner still returns a result
    of the usual structure and shapes (no crash inside torch), which a loss then propagates."""
    call = MINERS[name].make(Draw(F64))
    clean, spec = tree_flatten(call.run(**call.wrt))
    got, got_spec = tree_flatten(call.run(**_with(call, "embeddings", value)))
    assert got_spec == spec
    for a, b in zip(got, clean, strict=True):
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype


def _assert_bitwise(got: Any, want: Any) -> None:
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{a} != {b}"
        else:
            assert a == b


@pytest.mark.parametrize("name", list(EVERYTHING))
def test_no_input_is_changed_and_a_second_call_is_bitwise_identical(name):
    """Every tensor the call was drawn from (embeddings, labels, params, seeds) keeps its
    version counter and its values; a second call returns the same bits, gradients included."""
    d = Draw(F64)
    call = EVERYTHING[name].make(d)
    before = [(t, t._version, t.clone()) for t in d.made]
    if name.startswith("miners."):
        first, second = call.run(**call.wrt), call.run(**call.wrt)
    else:
        first, second = value_and_grads(call.run, call), value_and_grads(call.run, call)
    _assert_bitwise(second, first)
    for t, version, values in before:
        assert t._version == version and torch.equal(t, values), "an input was changed"


@pytest.mark.parametrize("name", list(LOSSES))
def test_duplicate_rows_and_singleton_classes_give_finite_values_and_gradients(name):
    """Row 1 a copy of row 0 (same class), row 2 a copy of row 0 under another class, and a
    singleton class (LABELS): zero distances and ties, whose gradients stay finite."""
    call = LOSSES[name].make(Draw(F64))
    wrt = {k: v.detach().clone() for k, v in call.wrt.items()}
    wrt["embeddings"][1:3] = wrt["embeddings"][0]
    value, grads = value_and_grads(call.run, Call(wrt, call.run))
    assert torch.isfinite(loss_of(value)), float(loss_of(value))
    for k, g in zip(wrt, grads, strict=True):
        assert torch.isfinite(g).all(), k


# The invariances, over every plain batch loss (``Entry.hyper``), with the exceptions and why.
_INSTANCE = (
    "PML's form: row i's target is column c_i, the rank of its label among the distinct "
    "labels, so the batch order and the label values pick the target"
)
ORDER_DEPENDENT = {
    "npairs": "keeps the first positive of each label, as PML does: the batch order picks it",
    "instance": _INSTANCE,
}
NOT_RELABEL_INVARIANT = {"instance": _INSTANCE}
NOT_SCALE_INVARIANT = {"angular": "its negative term uses the unnormalised references (PML)"}
PLAIN = {k: e for k, e in LOSSES.items() if e.hyper is not None}
TOL = {"rtol": 1e-9, "atol": 1e-12}
SWEEP = settings(max_examples=6, deadline=None, derandomize=True)


def _plain_loss(entry: Entry, emb: torch.Tensor, labels: torch.Tensor, d: Draw) -> torch.Tensor:
    return loss_of(entry.fn(emb, labels, **entry.hyper(d)))


def _plain_inputs() -> tuple[Draw, torch.Tensor, torch.Tensor]:
    d = Draw(F64)
    return d, d.randn(B, D), d.labels()


@pytest.mark.parametrize("name", list(PLAIN))
@SWEEP
@given(perm=st.permutations(range(B)))
def test_permuting_the_batch_with_its_labels_leaves_the_loss_unchanged(name, perm):
    if name in ORDER_DEPENDENT:
        pytest.skip(ORDER_DEPENDENT[name])
    d, emb, labels = _plain_inputs()
    p = torch.tensor(perm)
    want = _plain_loss(PLAIN[name], emb, labels, d)
    torch.testing.assert_close(_plain_loss(PLAIN[name], emb[p], labels[p], d), want, **TOL)


@pytest.mark.parametrize("name", list(PLAIN))
@SWEEP
@given(classes=st.permutations(range(10)), shift=st.integers(0, 1000))
def test_renaming_the_classes_leaves_the_loss_unchanged(name, classes, shift):
    if name in NOT_RELABEL_INVARIANT:
        pytest.skip(NOT_RELABEL_INVARIANT[name])
    d, emb, labels = _plain_inputs()
    renamed = torch.tensor(classes)[labels] + shift
    want = _plain_loss(PLAIN[name], emb, labels, d)
    torch.testing.assert_close(_plain_loss(PLAIN[name], emb, renamed, d), want, **TOL)


NORMALIZED = {k: e for k, e in PLAIN.items() if e.fn.spec.distance.normalize}


@pytest.mark.parametrize("name", list(NORMALIZED))
@SWEEP
@given(row=st.integers(0, B - 1), factor=st.floats(0.05, 20.0))
def test_with_a_normalizing_distance_rescaling_a_row_leaves_the_loss_unchanged(name, row, factor):
    if name in NOT_SCALE_INVARIANT:
        pytest.skip(NOT_SCALE_INVARIANT[name])
    d, emb, labels = _plain_inputs()
    scaled = emb.clone()
    scaled[row] *= factor
    want = _plain_loss(NORMALIZED[name], emb, labels, d)
    torch.testing.assert_close(_plain_loss(NORMALIZED[name], scaled, labels, d), want, **TOL)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(PLAIN)),
    perm=st.permutations(range(B)),
    classes=st.permutations(range(10)),
    row=st.integers(0, B - 1),
    factor=st.floats(0.05, 20.0),
)
def test_the_invariances_hold_over_a_wide_random_sweep(name, perm, classes, row, factor):
    """The three invariances at once, over random losses and draws (slow: CI runs it)."""
    entry = PLAIN[name]
    d, emb, labels = _plain_inputs()
    want = _plain_loss(entry, emb, labels, d)
    p = torch.tensor(perm)
    if name not in ORDER_DEPENDENT:
        torch.testing.assert_close(_plain_loss(entry, emb[p], labels[p], d), want, **TOL)
    if name not in NOT_RELABEL_INVARIANT:
        renamed = torch.tensor(classes)[labels]
        torch.testing.assert_close(_plain_loss(entry, emb, renamed, d), want, **TOL)
    if name in NORMALIZED and name not in NOT_SCALE_INVARIANT:
        scaled = emb.clone()
        scaled[row] *= factor
        torch.testing.assert_close(_plain_loss(entry, scaled, labels, d), want, **TOL)


# The autocast matrix: mixed precision as a training step sees it. The loss is computed in
# float32 (statistics, accumulators, log-space forms) whatever the inputs, so it stays within
# LOW_PRECISION_TOL of float64 evaluated on the same (rounded) inputs.
LOW_PRECISION_TOL = {"rtol": 1e-5, "atol": 1e-5}
LOW_PRECISION_MODES = ("autocast-bf16", "bfloat16", "float16")


@pytest.mark.parametrize("mode", LOW_PRECISION_MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_low_precision_gives_a_finite_float32_loss_close_to_float64(name, mode):
    """``mode``: float32 inputs under ``torch.autocast("cpu", dtype=torch.bfloat16)``, or the
    embeddings (and reference set, hard negatives) in bfloat16 / float16 with float32 params, as
    under AMP."""
    call = LOSSES[name].make(Draw(F32))
    wrt = {k: v.detach().clone() for k, v in call.wrt.items()}
    if mode != "autocast-bf16":
        for k in ("embeddings", "ref_emb", "negatives"):
            if k in wrt:
                wrt[k] = wrt[k].to(getattr(torch, mode))
    want = loss_of(call.run(**{k: v.to(F64) for k, v in wrt.items()}))
    x = {k: v.requires_grad_() for k, v in wrt.items()}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast-bf16")
    with autocast:
        got = loss_of(call.run(**x))
        grads = torch.autograd.grad(got, list(x.values()))
    assert got.dtype == F32 and torch.isfinite(got)
    torch.testing.assert_close(got.double(), want, **LOW_PRECISION_TOL)
    for (k, v), g in zip(x.items(), grads, strict=True):
        assert g.dtype == v.dtype and torch.isfinite(g).all(), k


@pytest.mark.parametrize("name", list(LOSSES))
def test_autocast_changes_neither_the_loss_nor_its_gradients(name):
    """Float32 inputs under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the backward
    outside it (as ``GradScaler`` steps): the loss and every gradient are the float32 call's,
    to float32 rounding. pmlfunc's products run with autocast off, also a backward it runs
    inside its forward (the first-order and chunked paths), which the user's autocast region
    would otherwise cast to bfloat16 (2e-3 off, silently)."""
    call = LOSSES[name].make(Draw(F32))

    def run(enabled: bool):
        x = {k: v.detach().clone().requires_grad_() for k, v in call.wrt.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = loss_of(call.run(**x))
        return loss, torch.autograd.grad(loss, list(x.values()))

    (want, want_grads), (got, got_grads) = run(False), run(True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# defaults: PML 2.9.0's, but where the docs' table of deliberate differences says otherwise
# ----------------------------------------------------------------------------------------------
# (function, parameter) -> why the default differs from PML 2.9.0's constructor (docs/losses.md)
DELIBERATE_DEFAULTS = {
    ("arcface", "margin"): "radians (0.5 = PML's 28.6 degrees)",
    ("subcenter_arcface", "margin"): "radians (0.5 = PML's 28.6 degrees)",
    ("triplet_margin", "margin"): "PML 3's 0.2 (PML 2.9.0: 0.05)",
    ("soft_triple", "centers_per_class"): "read from the params' shape (PML's 10 sizes them)",
}


def _pml_defaults() -> list[tuple[str, str, Any, Any]]:
    """``(function, parameter, pmlfunc default, PML default)`` for every scalar keyword of a
    public loss or miner that PML's class of the same name also takes."""
    from pytorch_metric_learning import losses as pml_losses
    from pytorch_metric_learning import miners as pml_miners

    rows = []
    for module, pml, suffix in ((pf.losses, pml_losses, "loss"), (pf.miners, pml_miners, "miner")):
        classes = {n.lower(): c for n, c in vars(pml).items() if inspect.isclass(c)}
        for name in module.__all__:
            cls = classes.get(name.replace("_", "") + suffix)
            if cls is None:
                continue
            theirs = inspect.signature(cls.__init__).parameters
            for p in inspect.signature(getattr(module, name)).parameters.values():
                other = theirs.get(p.name)
                if other is None or other.default is inspect.Parameter.empty:
                    continue
                if p.default is None or isinstance(p.default, (bool, int, float, str)):
                    rows.append((name, p.name, p.default, other.default))
    return rows


def test_every_scalar_default_is_pmls_unless_listed_as_deliberate():
    rows = _pml_defaults()
    assert len(rows) > 80  # the scan found the losses' and miners' hyper-parameters
    differ = {(f, p): (ours, theirs) for f, p, ours, theirs in rows if ours != theirs}
    assert set(differ) == set(DELIBERATE_DEFAULTS), differ
    for (fn, param), (ours, theirs) in differ.items():
        if param == "margin" and "arcface" in fn:  # the same margin, in radians
            assert ours == pytest.approx(math.radians(theirs), abs=1e-3)
