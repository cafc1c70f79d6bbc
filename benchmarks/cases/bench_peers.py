"""Peer libraries beside pmlfunc: each peer in the group of the pmlfunc member doing the same loss.

Optional: the peers come with ``pip install -e '.[bench-peers]'`` (open-clip-torch,
sentence-transformers, lightly, optax, jax; ``benchmarks/peers.py`` says how their loss code is
loaded without torchvision). A member whose package is absent is skipped with the reason
(``pytest.skip`` here, ``status: skipped`` in ``benchmarks.run``); the pmlfunc and floor
members always run.

Every group but ``peer-mnrl-k7`` has ``N`` rows against ``N`` rows (one ``N × N`` similarity
matrix), so the floor, ``(E @ E.T).sum()`` of the suite's ``N × D`` embeddings, is the same
matmul floor in all; ``peer-mnrl-k7``'s ``N`` queries read ``8N`` documents (their positives and
7 hard negatives each, ``bench_retrieval``'s seeded sets), and its floor is that product
(``bench_retrieval.floor``):

============================  =====================================================  =========================================================
group                          peer                                                   pmlfunc (the reference, checked equal)
============================  =====================================================  =========================================================
``peer-clip``                  open_clip ``ClipLoss()(â, b̂, exp(t))``                 ``pf.losses.clip(a, b, clip_init())`` (dense, no labels)
``peer-siglip``                open_clip ``SigLipLoss()(â, b̂, exp(t), bias)``         ``pf.losses.siglip(a, b, siglip_init())``
``peer-mnrl``                  ST ``MultipleNegativesRankingLoss`` (scale 20)         ``pf.losses.multiple_negatives_ranking(q, d)``;
                                                                                      ``pmlfunc-ntxent``: ``pf.losses.ntxent(q, i, ref_emb=d,
                                                                                      ref_labels=i, temperature=1/20)``
``peer-mnrl-symmetric``        ST MNRL, ``directions=(query_to_doc, doc_to_query)``,   ``multiple_negatives_ranking`` with the same arguments;
                               ``partition_mode="per_direction"``                     ``pmlfunc-clip``: ``pf.losses.clip(q, d, {"logit_scale":
                                                                                      log 20})``
``peer-cached-mnrl``           ST ``CachedMultipleNegativesRankingLoss``'s loss stage  ``multiple_negatives_ranking(q, d, chunk_size=TILE)``
                               (mini-batches of ``TILE`` rows)                        (``pmlfunc-tiled``; ``pmlfunc-ntxent-tiled``: ``ntxent``'s),
                                                                                      and ``pf.chunked.value_and_grad`` of ``ntxent`` at ``TILE``
``peer-mnrl-k7``               ST MNRL with 7 hard-negative columns                   ``pf.losses.multiple_negatives_ranking(q, p, n)`` (dense;
                                                                                      ``pmlfunc-tiled``: ``chunk_size=TILE``)
``peer-lightly-ntxent``        lightly ``NTXentLoss(temperature=0.5)(v0, v1)``        ``pf.losses.ntxent(E, [0..N/2-1, 0..N/2-1], temperature=0.5)``
``peer-optax-ntxent``          ``jax.jit(jax.value_and_grad(optax.losses.ntxent))``    ``pf.losses.ntxent(E, y, temperature=0.07)`` (4 per class)
============================  =====================================================  =========================================================

Details, each matching the peer exactly:

- ``a = E`` and ``b = `` a second seeded set (``benchmarks.common.make_paired``) for the two-set
  losses; ``q = a``, ``d = b`` for MNRL; ``v0, v1 = E[:N/2], E[N/2:]`` for lightly (two views
  of ``N/2`` samples, ``N`` rows). The backward differentiates every set and, for CLIP and
  SigLIP, the parameters.
- open_clip takes features its model has normalised and the scale already exponentiated: the
  peer member calls it with ``F.normalize`` of both sets and ``params["logit_scale"].exp()``
  (and ``params["logit_bias"]``), on parameters equal to pmlfunc's (``clip_init()``,
  ``siglip_init()``), so both compute the same function of the same leaves; pmlfunc normalises
  inside (``normalize=True``). open_clip's SigLIP divides by the batch size, as pmlfunc's
  default reducer does.
- sentence-transformers is measured on its loss stage only, from given embeddings:
  ``MultipleNegativesRankingLoss(model=None, scale=20).compute_loss_from_embeddings([q, d],
  None)`` (cosine similarity, its defaults; the model is only stored). The cached loss stage is
  ``CachedMultipleNegativesRankingLoss.calculate_loss(reps, None, with_backward=True)``: the
  ``TILE``-row mini-batches of detached ``q`` and ``d`` leaves, each mini-batch's loss
  back-propagated right after its forward, the embeddings' gradients collected from the leaves
  (GradCache's step 2; its model has one module, an identity, which the constructor inspects).
  So that it has a backward like the others, that work is wrapped in an autograd Function whose
  backward scales the collected gradients by the cotangent (what ST's backward hook does before
  re-embedding); ``pmlfunc-chunked`` (``pf.chunked.value_and_grad(..., wrt=("embeddings",
  "ref_emb"))``) goes through the same wrapper.
- optax runs under ``jax.jit`` on numpy copies of the same inputs, made when the member is made;
  the measured call is the jitted value-and-gradient and ``block_until_ready``, then the loss and
  gradient as torch tensors (an ``N × D`` copy). It is skipped where its ``N × N × D``
  broadcast (optax's cosine similarity) would exceed ``PMLFUNC_BENCH_OPTAX_MAX_GIB`` (1 GiB).
  XLA is limited to one thread when the suite is (``benchmarks.peers``). Its peak memory and
  FLOPs are not recorded (the counters see torch tensors only).

Before a peer is timed, its loss and every gradient are checked equal to its group's pmlfunc
member (``Case.reference``; relative to the loss and to each gradient's largest entry,
``reference_rtol``: 1e-4 in float32); the untimed run (plain ``pytest``) does the same at the
suite's batch, so it is a regression check of the pairings too. Timed, from the command line::

    python -m benchmarks.run --case peer-clip,peer-siglip,peer-mnrl,peer-mnrl-symmetric,\\
        peer-cached-mnrl,peer-lightly-ntxent,peer-optax-ntxent --batch-size 2048 \\
        --dimensions 512 --repeats 10 --warmup 3 --output /tmp/peers.json

(``docs/benchmarks/peers.md`` has the full command over every size, and its results).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pmlfunc as pf

from .. import common as C
from .. import peers as P
from . import (
    DEVICE,
    FLOOR,
    THREADS,
    Case,
    Member,
    Skip,
    by_name,
    inputs,
    make_step,
    params,
    record,
    reference_mismatch,
    reference_rtol,
)
from .bench_retrieval import _documents
from .bench_retrieval import floor as _retrieval_floor
from .bench_retrieval import mnrl as _pf_retrieval

TILE = C.env_int("PMLFUNC_BENCH_TILE", 256)
ST_SCALE = 20.0  # sentence-transformers' default scale (1 / temperature)
LIGHTLY_TEMPERATURE = 0.5  # lightly's default
OPTAX_MAX_GIB = float(C.env_int("PMLFUNC_BENCH_OPTAX_MAX_GIB", 1))
# XLA's thread count is fixed when jax is first imported; benchmarks.run sets this from
# --threads before any member is made.
OPTAX_THREADS = THREADS


# --- the two sets of the paired losses --------------------------------------------------------


def _paired(emb: torch.Tensor) -> torch.Tensor:
    return C.make_paired(emb).requires_grad_()


def _leaf_params(init: Callable[[], dict[str, torch.Tensor]], emb: torch.Tensor) -> dict:
    return {k: v.to(emb.device).requires_grad_() for k, v in init().items()}


def _rows(emb: torch.Tensor) -> torch.Tensor:
    return torch.arange(emb.shape[0], device=emb.device)


# --- a GradCache-style stage as a loss ---------------------------------------------------------


class _CachedGradients(torch.autograd.Function):
    """``value_and_grads(*tensors)``'s value, with a backward that scales the gradients it
    returned by the cotangent (a cached loss stage; its forward does all the work)."""

    @staticmethod
    def forward(ctx, value_and_grads, *tensors):
        with torch.enable_grad():
            value, grads = value_and_grads(*tensors)
        ctx.save_for_backward(*grads)
        return value.detach()

    @staticmethod
    def backward(ctx, cotangent):
        return (None, *(cotangent * g for g in ctx.saved_tensors))


def _cached(value_and_grads: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., Any]:
    return lambda *tensors: _CachedGradients.apply(value_and_grads, *tensors)


# --- pmlfunc members ---------------------------------------------------------------------------


def _pf_two_set(loss_fn, init, **kw) -> Member:
    def make(emb, labels):
        other, p = _paired(emb), _leaf_params(init, emb)
        return (lambda e, y: loss_fn(e, other, p, **kw)), [other, *p.values()]

    return Member(make)


def _pf_mnrl(**kw) -> Member:
    def make(emb, labels):
        # Two tensors of row indices: under torch.compile the tiled engine rejects one tensor
        # passed as both labels and ref_labels (dynamo: autograd.Function.apply with a
        # duplicate tensor input).
        other, rows, ref_rows = _paired(emb), _rows(emb), _rows(emb)

        def fn(e, y):
            return pf.losses.ntxent(
                e, rows, ref_emb=other, ref_labels=ref_rows, temperature=1.0 / ST_SCALE, **kw
            )

        return fn, [other]

    return Member(make)


def _pf_retrieval_pair(**kw) -> Member:
    """``multiple_negatives_ranking(q, d, **kw)``: the retrieval loss, ST's own loss."""

    def make(emb, labels):
        other = _paired(emb)
        return (lambda e, y: pf.losses.multiple_negatives_ranking(e, other, **kw)), [other]

    return Member(make)


def _pf_symmetric() -> Member:
    def make(emb, labels):
        other = _paired(emb)
        p = {"logit_scale": torch.tensor(math.log(ST_SCALE), dtype=emb.dtype, device=emb.device)}
        return (lambda e, y: pf.losses.clip(e, other, p)), [other]

    return Member(make)


def _pf_chunked() -> Member:
    def make(emb, labels):
        other, rows, ref_rows = _paired(emb), _rows(emb), _rows(emb)
        vg = pf.chunked.value_and_grad(
            pf.losses.ntxent, chunk_size=TILE, wrt=("embeddings", "ref_emb")
        )

        def value_and_grads(e, o):
            value, grads = vg(
                e.detach(), rows, ref_emb=o.detach(), ref_labels=ref_rows, temperature=1 / ST_SCALE
            )
            return value, grads

        loss = _cached(value_and_grads)
        return (lambda e, y: loss(e, other)), [other]

    return Member(make)


def _two_views(emb: torch.Tensor) -> torch.Tensor:
    half = emb.shape[0] // 2
    return torch.arange(half, device=emb.device).repeat(2)


def _pf_two_views() -> Member:
    def make(emb, labels):
        views = _two_views(emb)
        return (lambda e, y: pf.losses.ntxent(e, views, temperature=LIGHTLY_TEMPERATURE)), []

    return Member(make)


def _pf_ntxent() -> Member:
    return Member(
        lambda emb, labels: (
            (lambda e, y: pf.losses.ntxent(e, y, temperature=C.NTXENT_TEMPERATURE)),
            [],
        )
    )


# --- peer members ------------------------------------------------------------------------------


def _open_clip(cls: str, init, bias: bool) -> Member:
    def make(emb, labels):
        loss = getattr(P.open_clip_loss(), cls)()
        other, p = _paired(emb), _leaf_params(init, emb)

        def fn(e, y):
            args = [F.normalize(e, dim=-1), F.normalize(other, dim=-1), p["logit_scale"].exp()]
            return loss(*args, *([p["logit_bias"]] if bias else []))

        return fn, [other, *p.values()]

    return Member(make)


def _st_mnrl(**kw) -> Member:
    def make(emb, labels):
        st = P.sentence_transformers_losses()
        loss = st.MultipleNegativesRankingLoss(None, scale=ST_SCALE, **kw)
        other = _paired(emb)
        return (lambda e, y: loss.compute_loss_from_embeddings([e, other], None)), [other]

    return Member(make)


SYMMETRIC = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}


def _st_cached() -> Member:
    def make(emb, labels):
        st = P.sentence_transformers_losses()
        model = torch.nn.Sequential(torch.nn.Identity())  # inspected by the constructor only
        cached = st.CachedMultipleNegativesRankingLoss(model, scale=ST_SCALE, mini_batch_size=TILE)
        other = _paired(emb)

        def value_and_grads(e, o):
            reps = [[c.detach().requires_grad_() for c in t.split(TILE)] for t in (e, o)]
            value = cached.calculate_loss(reps, None, with_backward=True)
            grads = [torch.cat([c.grad for c in column]) for column in reps]
            return value, grads

        loss = _cached(value_and_grads)
        return (lambda e, y: loss(e, other)), [other]

    return Member(make)


def _st_retrieval(k: int) -> Member:
    """ST ``MultipleNegativesRankingLoss`` on the columns ``[q, p, n_1, ..., n_k]``: the same
    positives and hard negatives as ``bench_retrieval.mnrl``'s (scale 20 and cosine, both
    defaults)."""

    def make(emb, labels):
        st = P.sentence_transformers_losses()
        loss = st.MultipleNegativesRankingLoss(None, scale=ST_SCALE)
        pos, neg = _documents(emb, k)
        return (lambda e, y: loss.compute_loss_from_embeddings([e, pos, *neg.unbind(1)], None)), [
            pos,
            neg,
        ]

    return Member(make)


def _lightly() -> Member:
    def make(emb, labels):
        loss = P.lightly_ntxent().NTXentLoss(temperature=LIGHTLY_TEMPERATURE)
        half = emb.shape[0] // 2
        return (lambda e, y: loss(e[:half], e[half:])), []

    return Member(make)


def optax_broadcast_gib(batch: int, dim: int, itemsize: int = 4) -> float:
    """The size of optax's ``N × N × D`` cosine-similarity broadcast, GiB."""
    return batch * batch * dim * itemsize / 2**30


def _optax() -> Member:
    def make(emb, labels):
        gib = optax_broadcast_gib(emb.shape[0], emb.shape[1], emb.element_size())
        if gib > OPTAX_MAX_GIB:
            raise Skip(
                f"optax.losses.ntxent broadcasts an N x N x D = {gib:,.0f} GiB tensor (> "
                f"{OPTAX_MAX_GIB:g} GiB, PMLFUNC_BENCH_OPTAX_MAX_GIB)"
            )
        mod = P.optax_ntxent(OPTAX_THREADS)
        jax = mod.jax
        t = C.NTXENT_TEMPERATURE
        vg = jax.jit(jax.value_and_grad(lambda x, y: mod.ntxent(x, y, temperature=t)))
        x = jax.numpy.asarray(emb.detach().cpu().numpy())
        y = jax.numpy.asarray(labels.cpu().numpy())

        def fn(e, labels_):
            value, grad = vg(x, y)
            grad.block_until_ready()
            return (
                torch.tensor(float(value), dtype=emb.dtype),
                torch.from_numpy(np.array(grad)).to(emb.device),
            )

        return fn, []

    return Member(make, kind="value_and_grad", tracked_memory=False)


# --- the cases ---------------------------------------------------------------------------------


def _case(name: str, peer: str, members: dict[str, Member], reference: str = "pmlfunc") -> Case:
    return Case(
        name,
        {**members, "floor": FLOOR},
        extra={"peer": peer, "peer_version": P.version(peer), "reference": reference},
        reference=reference,
    )


CASES = by_name(
    _case(
        "peer-clip",
        "open_clip",
        {
            "pmlfunc": _pf_two_set(pf.losses.clip, pf.losses.clip_init),
            "open_clip": _open_clip("ClipLoss", pf.losses.clip_init, bias=False),
        },
    ),
    _case(
        "peer-siglip",
        "open_clip",
        {
            "pmlfunc": _pf_two_set(pf.losses.siglip, pf.losses.siglip_init),
            "open_clip": _open_clip("SigLipLoss", pf.losses.siglip_init, bias=True),
        },
    ),
    _case(
        "peer-mnrl",
        "sentence_transformers",
        {
            "pmlfunc": _pf_retrieval_pair(),
            "pmlfunc-ntxent": _pf_mnrl(),
            "sentence_transformers": _st_mnrl(),
        },
    ),
    _case(
        "peer-mnrl-symmetric",
        "sentence_transformers",
        {
            "pmlfunc": _pf_retrieval_pair(**SYMMETRIC),
            "pmlfunc-clip": _pf_symmetric(),
            "sentence_transformers": _st_mnrl(**SYMMETRIC),
        },
    ),
    _case(
        "peer-cached-mnrl",
        "sentence_transformers",
        {
            "pmlfunc-tiled": _pf_retrieval_pair(chunk_size=TILE),
            "pmlfunc-ntxent-tiled": _pf_mnrl(chunk_size=TILE),
            "pmlfunc-chunked": _pf_chunked(),
            "sentence_transformers": _st_cached(),
        },
        reference="pmlfunc-tiled",
    ),
    Case(
        "peer-mnrl-k7",
        {
            "pmlfunc": _pf_retrieval(7),
            "pmlfunc-tiled": _pf_retrieval(7, chunk_size=TILE),
            "sentence_transformers": _st_retrieval(7),
            "floor": _retrieval_floor(7),
        },
        extra={
            "peer": "sentence_transformers",
            "peer_version": P.version("sentence_transformers"),
            "reference": "pmlfunc",
            "negatives": 7,
        },
        reference="pmlfunc",
    ),
    _case("peer-lightly-ntxent", "lightly", {"pmlfunc": _pf_two_views(), "lightly": _lightly()}),
    _case("peer-optax-ntxent", "optax", {"pmlfunc": _pf_ntxent(), "optax": _optax()}),
)
for _c in CASES.values():
    _c.extra["chunk_size"] = TILE


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_peers(benchmark, request, case: str, impl: str) -> None:
    """One member: skipped with the reason when its package is absent; a peer is first checked
    equal to its group's pmlfunc member (loss and every gradient), then measured."""
    spec = CASES[case]
    member = spec.members[impl]
    emb, labels = inputs()
    try:
        step = make_step(member, emb, labels)
        with C.set_threads(THREADS):
            bad = reference_mismatch(spec, impl, emb, labels, reference_rtol(emb.dtype))
    except (P.PeerUnavailable, Skip) as err:
        pytest.skip(str(err))
    assert bad is None, f"{case} at batch {emb.shape[0]}: {bad}"
    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        out = C.measure(benchmark, request, step, DEVICE, costs=member.tracked_memory)
        record(benchmark, emb, spec, impl, out)
    grad = step.last_grad  # type: ignore[attr-defined]
    assert out.ndim == 0 and torch.isfinite(out), f"{case}/{impl}: loss {out}"
    assert torch.isfinite(grad).all() and grad.shape == emb.shape, f"{case}/{impl}: gradient"
