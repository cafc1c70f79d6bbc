"""CUDA checks: what pmlfunc is built for and only a GPU can prove.

* every loss family, miners, the tiled (``chunk_size=``) and anchor-chunked
  (``pf.chunked.value_and_grad``) paths and a whole training step (encoder, miner, loss,
  optimiser update) captured in a CUDA graph and replayed with new data, equal to the same
  calls run eagerly on that data;
* the safe Euclidean distance in bfloat16 on random, nearby and duplicate rows, values and
  gradients against float64;
* no host synchronisation in a step (``torch.cuda.set_sync_debug_mode("error")``);
* a loss under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs made by
  the compiler), equal to eager.

Every test is marked ``cuda`` (``pytest -m cuda`` selects them; ``pytest -m cuda --collect-only``
lists them anywhere) and is skipped without a CUDA device. ``python -m benchmarks.gpu_check``
runs them first on a GPU machine. Each capture follows PyTorch's recipe: static input tensors,
three warm-up calls on a side stream, one call captured under ``torch.cuda.graph``, then for
each new batch the data is copied into the static inputs and the graph replayed.

``PMLFUNC_SIMULATE_CUDA_GRAPHS=1`` runs the same bodies on CPU with a stand-in for the graph
(a replay re-runs the call and writes its results into the captured output tensors), so that
this file cannot rot on machines without a GPU (``benchmarks.gpu_check --dry-run`` does it); the
sync-debug and compiled tests need the real device and stay skipped.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

import pmlfunc as pf

SIMULATE = os.environ.get("PMLFUNC_SIMULATE_CUDA_GRAPHS") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_graphs = pytest.mark.skipif(
    not (HAS_CUDA or SIMULATE),
    reason="needs a CUDA device (PMLFUNC_SIMULATE_CUDA_GRAPHS=1 runs it on CPU, simulated)",
)

B, D, C = 64, 32, 16  # batch rows (4 per class), embedding size, classes
REPLAYS = 1 if SIMULATE else 3  # new batches replayed after the capture
RTOL, ATOL = 1e-4, 1e-5  # replay vs eager: the same kernels, up to atomics' summation order


# ----------------------------------------------------------------------------------------------
# capture and replay
# ----------------------------------------------------------------------------------------------
class _SimulatedGraph:
    """CPU stand-in for a captured graph: ``replay()`` re-runs the call on the static inputs
    and writes its results into the tensors the capture returned, as a real replay does."""

    def __init__(self, fn: Callable[..., Any], static: tuple[torch.Tensor, ...], out: Any):
        self.fn, self.static, self.out = fn, static, out

    def replay(self) -> None:
        new, _ = tree_flatten(self.fn(*self.static))
        for target, value in zip(tree_flatten(self.out)[0], new, strict=True):
            if isinstance(target, torch.Tensor):
                target.copy_(value)


def capture(fn: Callable[..., Any], *static: torch.Tensor) -> tuple[Any, Any]:
    """``(graph, out)``: ``fn(*static)`` captured after three warm-up calls on a side stream;
    ``graph.replay()`` recomputes ``out`` in place from the current contents of ``static``."""
    if not HAS_CUDA:
        out = fn(*static)
        return _SimulatedGraph(fn, static, out), out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    return graph, out


def assert_same(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        else:
            assert g == w


def replay_equals_eager(
    fn: Callable[..., Any], draws: list[tuple[torch.Tensor, ...]], **tol: float
) -> None:
    """Capture ``fn`` on static copies of ``draws[0]``; for every later draw, copy it into the
    static inputs, replay, and compare the outputs with ``fn`` run eagerly on that draw."""
    static = tuple(t.clone() for t in draws[0])
    graph, out = capture(fn, *static)
    for draw in draws[1:]:
        for target, value in zip(static, draw, strict=True):
            target.copy_(value)
        graph.replay()
        assert_same(out, fn(*draw), **tol)


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def draw(seed: int, rows: int = B, dim: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard-normal embeddings and shuffled labels, ``rows // C`` rows per class."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(rows, dim, generator=g)
    labels = torch.randperm(rows, generator=g) % C
    return emb.to(DEVICE), labels.to(DEVICE)


def draws(count: int = 1 + REPLAYS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [draw(seed) for seed in range(count)]


def seed_tensor(value: int = 17) -> torch.Tensor:
    """A 0-d int64 seed on the device: what a stochastic function takes inside a graph."""
    return torch.full((), value, dtype=torch.int64, device=DEVICE)


def init(make: Callable[..., dict], *args: Any, **kw: Any) -> dict[str, torch.Tensor]:
    """A learnable loss's params, drawn from a fixed CPU generator, on the device."""
    params = make(*args, generator=torch.Generator().manual_seed(1), **kw)
    return {k: v.to(DEVICE) for k, v in params.items()}


# ----------------------------------------------------------------------------------------------
# one loss per family (every module of pf.losses), each with what it needs
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loss:
    """``call(emb, labels, params)``: a loss (or ``(loss, state)``); ``params()``: its
    learnable tensors, differentiated with the embeddings."""

    call: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], Any]
    params: Callable[[], dict[str, torch.Tensor]] = field(default=dict)


L = pf.losses


def halves(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    """A two-set loss (CLIP, SigLIP) on the two halves of the batch: rows i and B/2 + i pair."""
    return lambda e, y, p: fn(e[: B // 2], e[B // 2 :], p, **kw)


def on_device(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(DEVICE) for k, v in params.items()}


def graded(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    """A distillation loss on the batch's quarters: queries, their positives and two negatives
    a query (the second half); the teacher's scores of the three candidates from the labels."""
    q = B // 4

    def call(e, y, p):
        teacher = y[: 3 * q].reshape(q, 3).to(e.dtype) / C
        return fn(e[:q], e[q : 2 * q], e[2 * q :].reshape(q, 2, -1), teacher, **kw)

    return call


def retrieval(**kw: Any) -> Callable[..., Any]:
    """``multiple_negatives_ranking`` on the batch's quarters: queries, their positives, and two
    hard negatives a query from the second half; every direction, ids from the labels (equal
    labels are duplicates), a learnable scale."""
    q = B // 4

    def call(e, y, p):
        return L.multiple_negatives_ranking(
            e[:q], e[q : 2 * q], e[2 * q :].reshape(q, 2, -1), p, anchor_ids=y[:q],
            directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), **kw,
        )  # fmt: skip

    return call


@functools.cache
def document_queue() -> dict[str, torch.Tensor]:
    """A document queue (:mod:`pmlfunc.queues`) of 48 slots, 20 filled, with queries and ids,
    made once on the device: static tensors of a capture."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(20, D, generator=g).to(DEVICE) for _ in range(2)]
    queue = pf.queues.document_queue_init(48, D, queries=True, device=DEVICE)
    ids = torch.arange(20).to(DEVICE)
    return pf.queues.document_queue_push(queue, rows[0], queries=rows[1], anchor_ids=ids)


def retrieval_queued(**kw: Any) -> Callable[..., Any]:
    """:func:`retrieval` against :func:`document_queue`, the step pushing its queries and
    positives after the loss: ``(loss, the new queue)``."""
    q = B // 4

    def call(e, y, p):
        queue = document_queue()
        loss = L.multiple_negatives_ranking(
            e[:q], e[q : 2 * q], e[2 * q :].reshape(q, 2, -1), p, anchor_ids=y[:q],
            directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            memory=queue, **kw,
        )  # fmt: skip
        pushed = pf.queues.document_queue_push(
            queue, e[q : 2 * q].detach(), queries=e[:q].detach(), anchor_ids=y[:q]
        )
        return loss, pushed

    return call


def pair_queued(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    """``clip``/``siglip`` on the batch's halves against :func:`document_queue`, the rows' ids
    from the labels (equal labels are duplicates, and the queue's first ids meet them), the
    step pushing its second half: ``(loss, the new queue)``."""
    h = B // 2

    def call(e, y, p):
        queue = document_queue()
        loss = fn(e[:h], e[h:], p, memory=queue, anchor_ids=y[:h], positive_ids=y[:h], **kw)
        pushed = pf.queues.document_queue_push(
            queue, e[h:].detach(), queries=e[:h].detach(), anchor_ids=y[:h], positive_ids=y[:h]
        )
        return loss, pushed

    return call


LOSSES: dict[str, Loss] = {
    "pairs.contrastive": Loss(lambda e, y, p: L.contrastive(e, y, neg_margin=1.4)),
    "pairs.threshold_consistent_margin": Loss(lambda e, y, p: L.threshold_consistent_margin(e, y)),
    "pair_weighting.multi_similarity": Loss(
        lambda e, y, p: L.multi_similarity(e, y, alpha=2.0, beta=50.0, base=0.5)
    ),
    "pair_weighting.lifted_structure": Loss(lambda e, y, p: L.lifted_structure(e, y)),
    "triplets.triplet_margin": Loss(lambda e, y, p: L.triplet_margin(e, y, margin=0.2)),
    "triplets.margin": Loss(lambda e, y, p: L.margin(e, y, margin=0.2, beta=1.2)),
    "softmax.ntxent": Loss(lambda e, y, p: L.ntxent(e, y, temperature=0.07)),
    "softmax.supcon": Loss(lambda e, y, p: L.supcon(e, y, temperature=0.1)),
    "self_supervised.vicreg": Loss(lambda e, y, p: L.vicreg(e[: B // 2], e[B // 2 :])),
    "self_supervised.barlow_twins": Loss(lambda e, y, p: L.barlow_twins(e[: B // 2], e[B // 2 :])),
    "self_supervised.koleo": Loss(lambda e, y, p: L.koleo(e)),
    "self_supervised.sigreg": Loss(
        lambda e, y, p: L.sigreg(e, generator=seed_tensor(), num_vectors=64)
    ),
    # the teacher is the student's rows reversed (detached by the loss); a fixed mask
    "self_supervised.ibot_patch": Loss(
        lambda e, y, p: L.ibot_patch(
            e.flip(0).view(16, 4, D),
            e.view(16, 4, D),
            torch.arange(B, device=e.device).view(16, 4) % 3 == 0,
            {"center": torch.zeros(D, device=e.device)},
        )
    ),
    # two sub-batches of 32 (cholesky_ex: no status read on the host)
    "self_supervised.wmse": Loss(
        lambda e, y, p: L.wmse(e.view(B, 2, D // 2), generator=seed_tensor(), w_size=32)
    ),
    # MSN: 32 images of 2 anchor views, the targets the first half's rows reversed (detached
    # by the loss), 16 learnable prototypes; Sinkhorn's 3 rounds are a fixed count
    "self_supervised.msn": Loss(
        lambda e, y, p: L.msn(e.view(B // 2, 2, D), e[: B // 2].flip(0), p["prototypes"]),
        lambda: on_device(
            {"prototypes": torch.randn(C, D, generator=torch.Generator().manual_seed(1))}
        ),
    ),
    # not mmcr: torch's SVD (and eigh) check convergence on the host, a sync no graph can hold
    "neighbors.nca": Loss(lambda e, y, p: L.nca(e, y)),
    "neighbors.manifold": Loss(
        lambda e, y, p: L.manifold(e, None, p, generator=seed_tensor(), margin=0.05),
        lambda: init(L.manifold_init, D, 8),
    ),
    "ranking.fast_ap": Loss(lambda e, y, p: L.fast_ap(e, y)),
    "ranking.smooth_ap": Loss(lambda e, y, p: L.smooth_ap(e, y)),
    "ranking.dynamic_soft_margin": Loss(
        lambda e, y, p: L.dynamic_soft_margin(
            e, y, L.dynamic_soft_margin_init_state(device=DEVICE), momentum=0.5
        )
    ),
    "proxies.proxy_anchor": Loss(
        lambda e, y, p: L.proxy_anchor(e, y, p), lambda: init(L.proxy_anchor_init, C, D)
    ),
    "proxies.soft_triple": Loss(
        lambda e, y, p: L.soft_triple(e, y, p), lambda: init(L.soft_triple_init, C, D)
    ),
    "margin_softmax.arcface": Loss(
        lambda e, y, p: L.arcface(e, y, p), lambda: init(L.arcface_init, C, D)
    ),
    "margin_softmax.cosface": Loss(
        lambda e, y, p: L.cosface(e, y, p), lambda: init(L.cosface_init, C, D)
    ),
    "centroids.ge2e": Loss(lambda e, y, p: L.ge2e(e, y, p), lambda: on_device(L.ge2e_init())),
    "cross_modal.clip": Loss(halves(L.clip), lambda: on_device(L.clip_init())),
    "cross_modal.siglip": Loss(halves(L.siglip), lambda: on_device(L.siglip_init())),
    "retrieval.multiple_negatives_ranking": Loss(
        retrieval(), lambda: on_device(L.multiple_negatives_ranking_init())
    ),
    # given scores: the teacher's from the labels (data, not differentiated); gold with ties
    "graded.margin_mse": Loss(graded(L.margin_mse)),
    "graded.distill_kl_div": Loss(graded(L.distill_kl_div, temperature=2.0)),
    "graded.cosent": Loss(lambda e, y, p: L.cosent(e[: B // 2], e[B // 2 :], y[: B // 2])),
    "graded.angle": Loss(lambda e, y, p: L.angle(e[: B // 2], e[B // 2 :], y[: B // 2])),
    "in_batch.mega_batch_margin": Loss(
        lambda e, y, p: L.mega_batch_margin(e[: B // 2], e[B // 2 :], chunk_size=12)
    ),
}


def loss_step(loss: Loss, names: list[str]) -> Callable[..., Any]:
    """``step(emb, labels, *param_values)`` -> ``(loss, state, gradients)``: forward and
    backward on fresh leaves (``torch.autograd.grad``), so a replay recomputes everything."""

    def step(emb, labels, *values):
        leaves = [t.detach().requires_grad_() for t in (emb, *values)]
        out = loss.call(leaves[0], labels, dict(zip(names, leaves[1:], strict=True)))
        value, state = out if isinstance(out, tuple) else (out, None)
        grads = torch.autograd.grad(value, leaves)
        return value.detach(), state, grads

    return step


def loss_draws(loss: Loss) -> tuple[Callable[..., Any], list[tuple[torch.Tensor, ...]]]:
    params = loss.params()
    names = sorted(params)
    return loss_step(loss, names), [(*d, *(params[k] for k in names)) for d in draws()]


def test_every_loss_family_has_a_captured_loss():
    """Every module of ``pf.losses`` whose losses the package exports has an entry here."""
    families = set()
    for info in pkgutil.iter_modules(pf.losses.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"pmlfunc.losses.{info.name}")
        if set(getattr(module, "__all__", ())) & set(pf.losses.__all__):
            families.add(info.name)
    missing = families - {name.split(".")[0] for name in LOSSES}
    assert not missing, f"add a loss of each of {sorted(missing)} to LOSSES in tests/test_cuda.py"
    for name in LOSSES:
        family, fn = name.split(".")
        module = importlib.import_module(f"pmlfunc.losses.{family}")
        assert getattr(module, fn) is getattr(pf.losses, fn), name


@needs_graphs
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_captured_and_replayed_equals_eager(name):
    step, data = loss_draws(LOSSES[name])
    replay_equals_eager(step, data)


# ----------------------------------------------------------------------------------------------
# miners, mined losses, PML index tuples
# ----------------------------------------------------------------------------------------------
N = pf.miners
MINERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "batch_hard": lambda e, y: N.batch_hard(e, y),
    "pair_margin": lambda e, y: N.pair_margin(e, y, pos_margin=0.2, neg_margin=1.4),
    "multi_similarity": lambda e, y: N.multi_similarity(e, y, epsilon=0.1),
    "triplet_margin": lambda e, y: N.triplet_margin(e, y, margin=0.2),
    "triplet_margin[bounded]": lambda e, y: N.triplet_margin(
        e, y, margin=0.2, tuples_per_anchor=8, generator=seed_tensor()
    ),
    "distance_weighted": lambda e, y: N.distance_weighted(e, y, generator=seed_tensor()),
}


@needs_graphs
@pytest.mark.parametrize("name", list(MINERS))
def test_miner_captured_and_replayed_equals_eager(name):
    mine = MINERS[name]

    def step(emb, labels):
        with torch.no_grad():
            return mine(emb, labels)

    replay_equals_eager(step, draws())


@needs_graphs
@pytest.mark.parametrize("name", ["pair_margin", "batch_hard", "triplet_margin[bounded]"])
def test_mined_loss_captured_and_replayed_equals_eager(name):
    mine = MINERS[name]

    def step(emb, labels):
        x = emb.detach().requires_grad_()
        loss = L.triplet_margin(x, labels, margin=0.2, indices_tuple=mine(x, labels))
        return loss.detach(), torch.autograd.grad(loss, x)

    replay_equals_eager(step, draws())


@needs_graphs
def test_pml_index_tuple_captured_and_replayed_equals_eager():
    """A PML-style ``(anchors, positives, negatives)`` tuple: indices checked on the device
    (``torch._assert_async``), no host sync."""
    g = torch.Generator().manual_seed(3)
    triplets = [torch.randint(0, B, (4 * B,), generator=g).to(DEVICE) for _ in range(3)]
    data = [(*d, *(t.roll(i) for t in triplets)) for i, d in enumerate(draws())]

    def step(emb, labels, a, p, n):
        x = emb.detach().requires_grad_()
        loss = L.triplet_margin(x, labels, margin=0.2, indices_tuple=(a, p, n))
        return loss.detach(), torch.autograd.grad(loss, x)

    replay_equals_eager(step, data)


# ----------------------------------------------------------------------------------------------
# the tiled and the anchor-chunked paths
# ----------------------------------------------------------------------------------------------
NESTED_NTXENT = pf.transforms.matryoshka(L.ntxent, (D, D // 2, D // 8))
NESTED_CLIP = pf.transforms.matryoshka(L.clip, (D, D // 4, D // 8), (1.0, 0.5, 0.5))
TILED = {
    "ntxent": Loss(lambda e, y, p: L.ntxent(e, y, temperature=0.07, chunk_size=24)),
    "supcon": Loss(lambda e, y, p: L.supcon(e, y, temperature=0.1, chunk_size=24)),
    "clip": Loss(halves(L.clip, chunk_size=24), lambda: on_device(L.clip_init())),
    "siglip": Loss(halves(L.siglip, chunk_size=24), lambda: on_device(L.siglip_init())),
    "multiple_negatives_ranking": Loss(
        retrieval(chunk_size=5), lambda: on_device(L.multiple_negatives_ranking_init())
    ),
    "multiple_negatives_ranking[memory]": Loss(
        retrieval_queued(chunk_size=5), lambda: on_device(L.multiple_negatives_ranking_init())
    ),
    "clip[memory]": Loss(pair_queued(L.clip, chunk_size=24), lambda: on_device(L.clip_init())),
    "siglip[memory]": Loss(
        pair_queued(L.siglip, chunk_size=24), lambda: on_device(L.siglip_init())
    ),
    # nested widths from one blocked product: NT-Xent's walk forms its gradient, CLIP's walks twice
    "ntxent[matryoshka]": Loss(
        lambda e, y, p: NESTED_NTXENT(e, y, temperature=0.07, chunk_size=24)
    ),
    "clip[matryoshka]": Loss(halves(NESTED_CLIP, chunk_size=24), lambda: on_device(L.clip_init())),
    # tiles of classes (class_chunk_size): the single-centre, sub-centre and magnitude walks
    "arcface[classes]": Loss(
        lambda e, y, p: L.arcface(e, y, p, class_chunk_size=3), lambda: init(L.arcface_init, C, D)
    ),
    "subcenter_arcface[classes]": Loss(
        lambda e, y, p: L.subcenter_arcface(e, y, p, class_chunk_size=3),
        lambda: init(L.subcenter_arcface_init, C, D),
    ),
    "large_margin_softmax[classes]": Loss(
        lambda e, y, p: L.large_margin_softmax(e, y, p, class_chunk_size=3),
        lambda: init(L.large_margin_softmax_init, C, D),
    ),
    # ... the soft centres, the per-proxy columns and the squares
    "soft_triple[classes]": Loss(
        lambda e, y, p: L.soft_triple(e, y, p, class_chunk_size=3),
        lambda: init(L.soft_triple_init, C, D),
    ),
    "proxy_anchor[classes]": Loss(
        lambda e, y, p: L.proxy_anchor(e, y, p, class_chunk_size=3),
        lambda: init(L.proxy_anchor_init, C, D),
    ),
    "p2s_grad[classes]": Loss(
        lambda e, y, p: L.p2s_grad(e, y, p, class_chunk_size=3), lambda: init(L.p2s_grad_init, C, D)
    ),
}
DENSE = {
    "ntxent": Loss(lambda e, y, p: L.ntxent(e, y, temperature=0.07)),
    "supcon": Loss(lambda e, y, p: L.supcon(e, y, temperature=0.1)),
    "clip": Loss(halves(L.clip), lambda: on_device(L.clip_init())),
    "siglip": Loss(halves(L.siglip), lambda: on_device(L.siglip_init())),
    "multiple_negatives_ranking": Loss(
        retrieval(), lambda: on_device(L.multiple_negatives_ranking_init())
    ),
    "multiple_negatives_ranking[memory]": Loss(
        retrieval_queued(), lambda: on_device(L.multiple_negatives_ranking_init())
    ),
    "clip[memory]": Loss(pair_queued(L.clip), lambda: on_device(L.clip_init())),
    "siglip[memory]": Loss(pair_queued(L.siglip), lambda: on_device(L.siglip_init())),
    "ntxent[matryoshka]": Loss(lambda e, y, p: NESTED_NTXENT(e, y, temperature=0.07)),
    "clip[matryoshka]": Loss(halves(NESTED_CLIP), lambda: on_device(L.clip_init())),
    "arcface[classes]": Loss(
        lambda e, y, p: L.arcface(e, y, p), lambda: init(L.arcface_init, C, D)
    ),
    "subcenter_arcface[classes]": Loss(
        lambda e, y, p: L.subcenter_arcface(e, y, p), lambda: init(L.subcenter_arcface_init, C, D)
    ),
    "large_margin_softmax[classes]": Loss(
        lambda e, y, p: L.large_margin_softmax(e, y, p),
        lambda: init(L.large_margin_softmax_init, C, D),
    ),
    "soft_triple[classes]": Loss(
        lambda e, y, p: L.soft_triple(e, y, p), lambda: init(L.soft_triple_init, C, D)
    ),
    "proxy_anchor[classes]": Loss(
        lambda e, y, p: L.proxy_anchor(e, y, p), lambda: init(L.proxy_anchor_init, C, D)
    ),
    "p2s_grad[classes]": Loss(
        lambda e, y, p: L.p2s_grad(e, y, p), lambda: init(L.p2s_grad_init, C, D)
    ),
}


@needs_graphs
@pytest.mark.parametrize("name", list(TILED))
def test_tiled_loss_captured_equals_eager_and_dense(name):
    tiled, data = loss_draws(TILED[name])
    dense, _ = loss_draws(DENSE[name])
    replay_equals_eager(tiled, data)
    assert_same(tiled(*data[-1]), dense(*data[-1]), rtol=1e-5, atol=1e-6)


CHUNKED = {
    "ntxent": {"temperature": 0.07},
    "triplet_margin": {"margin": 0.2},
    "contrastive": {"neg_margin": 1.4},
}


@needs_graphs
@pytest.mark.parametrize("name", list(CHUNKED))
def test_chunked_value_and_grad_captured_equals_eager_and_full(name):
    fn, hyper = getattr(L, name), CHUNKED[name]
    value_and_grad = pf.chunked.value_and_grad(fn, chunk_size=24)
    full = loss_step(Loss(lambda e, y, p: fn(e, y, **hyper)), [])

    def step(emb, labels):
        return value_and_grad(emb, labels, **hyper)

    data = draws()
    replay_equals_eager(step, data)
    loss, grad = step(*data[-1])
    want, _, (want_grad,) = full(*data[-1])
    assert_same((loss, grad), (want, want_grad), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# a whole training step
# ----------------------------------------------------------------------------------------------
IN_FEATURES, LR = 16, 0.05
STEPS = 2 if SIMULATE else 5


def encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, D)
    )
    return net.to(DEVICE)


def optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3, capturable=HAS_CUDA)


def training_step(net, opt, loss_name: str) -> Callable[..., torch.Tensor]:
    """Encoder, bounded triplet miner (its seed a device tensor), loss, backward, update."""

    def step(x, labels, seed):
        opt.zero_grad(set_to_none=True)  # Python only: in a replay, backward writes the grads
        emb = net(x)
        if loss_name == "triplet_margin":
            mined = N.triplet_margin(emb, labels, margin=0.2, tuples_per_anchor=8, generator=seed)
            loss = L.triplet_margin(emb, labels, margin=0.2, indices_tuple=mined)
        else:
            loss = L.ntxent(emb, labels, temperature=0.1)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def training_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(STEPS):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(B, IN_FEATURES, generator=g)
        labels = torch.randperm(B, generator=g) % C
        out.append((x.to(DEVICE), labels.to(DEVICE), seed_tensor(1000 + i)))
    return out


@needs_graphs
@pytest.mark.parametrize("loss_name", ["triplet_margin", "ntxent"])
@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
def test_training_step_captured_and_replayed_equals_eager(opt_kind, loss_name):
    batches = training_batches()
    eager_net = encoder()
    eager_step = training_step(eager_net, optimizer(opt_kind, eager_net.parameters()), loss_name)
    eager_losses = [eager_step(*batch) for batch in batches]

    net = encoder()
    opt = optimizer(opt_kind, net.parameters())
    start = [p.detach().clone() for p in net.parameters()]
    static = tuple(t.clone() for t in batches[0])
    graph, static_loss = capture(training_step(net, opt, loss_name), *static)
    with torch.no_grad():  # undo the warm-up updates: the same start as the eager run
        for p, s in zip(net.parameters(), start, strict=True):
            p.copy_(s)
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    replayed = []
    for batch in batches:
        for target, value in zip(static, batch, strict=True):
            target.copy_(value)
        graph.replay()
        replayed.append(static_loss.clone())
    assert_same(replayed, eager_losses, rtol=1e-4, atol=1e-5)
    assert_same(list(net.parameters()), list(eager_net.parameters()), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# the safe Euclidean distance in bfloat16
# ----------------------------------------------------------------------------------------------
def _rows(kind: str) -> torch.Tensor:
    """64 × 128 bfloat16 rows: ``random``; ``nearby`` (pairs 1e-3 apart, relative: the
    expansion cancels); ``duplicate`` (every row twice)."""
    g = torch.Generator().manual_seed(4)
    n, dim = 64, 128
    base = torch.randn(n, dim, generator=g)
    half = base[: n // 2]
    if kind == "nearby":
        base = torch.cat([half, half + 1e-3 * torch.randn(n // 2, dim, generator=g)])
    elif kind == "duplicate":
        base = torch.cat([half, half])
    return base.to(DEVICE, torch.bfloat16)


def _direct(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Float64 distances from the differences, with a zero (not NaN) gradient at d = 0."""
    sq = (x[:, None, :] - y[None, :, :]).pow(2).sum(-1)
    return torch.where(sq > 0, sq.clamp_min(1e-300).sqrt(), torch.zeros_like(sq))


@needs_graphs
@pytest.mark.parametrize("self_mode", [True, False], ids=["self", "cross"])
@pytest.mark.parametrize("kind", ["random", "nearby", "duplicate"])
def test_safe_euclidean_bf16_against_float64(kind, self_mode):
    x = _rows(kind).requires_grad_()
    y = None if self_mode else _rows(kind).flip(0).contiguous().requires_grad_()
    d = pf.distances.safe_euclidean(x, y)
    assert d.dtype == torch.bfloat16
    x64 = x.detach().double().requires_grad_()
    y64 = x64 if y is None else y.detach().double().requires_grad_()
    ref = _direct(x64, y64)
    # Values: bfloat16 output rounding (2^-8 relative) plus the expansion's error far from
    # cancellation (tests/test_distances.py states the bound).
    scale = (x64.pow(2).sum(1)[:, None] + y64.pow(2).sum(1)[None]).sqrt().detach()
    err = (d.double() - ref.detach()).abs()
    assert torch.all(err <= (2**-8 + 1e-6) * ref.detach() + 2e-6 * scale), float(err.max())
    # Gradients of a weighted sum: bfloat16 rounding of the result, relative to its size.
    w = torch.rand(d.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    wrt = [x] if y is None else [x, y]
    wrt64 = [x64] if y is None else [x64, y64]
    got = torch.autograd.grad((d.float() * w).sum(), wrt)
    want = torch.autograd.grad((ref * w.double()).sum(), wrt64)
    for g, r in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        assert float((g.double() - r).abs().max()) <= 2**-6 * float(r.abs().max())


# ----------------------------------------------------------------------------------------------
# no host synchronisation in a step
# ----------------------------------------------------------------------------------------------
def _sync_free_steps() -> dict[str, Callable[[], Any]]:
    steps: dict[str, Callable[[], Any]] = {}
    for name, loss in LOSSES.items():
        step, data = loss_draws(loss)
        steps[f"loss:{name}"] = lambda step=step, d=data[0]: step(*d)
    emb, labels = draw(0)
    for name, mine in MINERS.items():
        steps[f"miner:{name}"] = lambda mine=mine: mine(emb, labels)
    for name, loss in TILED.items():  # the tiled calls, their params included
        step, data = loss_draws(loss)
        steps[f"tiled:{name}"] = lambda step=step, d=data[0]: step(*d)
    for name, hyper in CHUNKED.items():
        vg = pf.chunked.value_and_grad(getattr(L, name), chunk_size=24)
        steps[f"chunked:{name}"] = lambda vg=vg, hyper=hyper: vg(emb, labels, **hyper)
    for opt_kind in ("sgd", "adam"):
        net = encoder()
        train = training_step(net, optimizer(opt_kind, net.parameters()), "triplet_margin")
        batch = training_batches()[0]
        steps[f"training_step:{opt_kind}"] = lambda train=train, batch=batch: train(*batch)
    return steps


@needs_cuda
def test_no_host_sync_in_any_step():
    """Every step above, once warmed up, runs under ``set_sync_debug_mode("error")``: a
    synchronising call (``.item()``, ``nonzero``, a blocking copy) would raise."""
    failures = {}
    for name, run in _sync_free_steps().items():
        run()  # warm-up: lazy initialisation (cuBLAS handles, optimiser state) may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        except RuntimeError as err:
            failures[name] = str(err).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not failures, failures


# ----------------------------------------------------------------------------------------------
# CUDA graphs made by the compiler
# ----------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.compile
def test_compiled_reduce_overhead_equals_eager():
    """Inductor's own CUDA graphs (``mode="reduce-overhead"``) for the loss and its backward:
    equal to eager on every draw, and no graph skipped."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(L.ntxent, mode="reduce-overhead", fullgraph=True)
    eager = loss_step(LOSSES["softmax.ntxent"], [])
    problems = []
    for i, (emb, labels) in enumerate(draws()):
        torch.compiler.cudagraph_mark_step_begin()
        x = emb.detach().requires_grad_()
        loss = compiled(x, labels, temperature=0.07)
        (grad,) = torch.autograd.grad(loss, x)
        want, _, (want_grad,) = eager(emb, labels)
        try:
            assert_same((loss.detach().clone(), grad.clone()), (want, want_grad))
        except AssertionError as err:
            problems.append(f"draw {i}: " + " ".join(str(err).split())[:300])
    skips = counters["inductor"]["cudagraph_skips"]
    if skips:
        problems.append(f"inductor skipped CUDA graphs {skips} time(s)")
    assert not problems, problems
