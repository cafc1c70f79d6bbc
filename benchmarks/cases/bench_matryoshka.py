"""``pf.transforms.matryoshka`` against the naive sum of one call a width: time and memory.

Three pytest-benchmark groups, ``matryoshka-ntxent-b{B}``, ``matryoshka-clip-b{B}`` and
``matryoshka-multi_similarity-b{B}``, forward + backward at ``B`` rows and ``D`` dimensions
(``PMLFUNC_BENCH_MATRYOSHKA_BATCH``, 4,096; ``PMLFUNC_BENCH_MATRYOSHKA_DIM``, 768), widths ``(D,
D/2, D/4, D/8, D/16)``, float32, one thread. NT-Xent and multi-similarity: four samples per class;
CLIP: two aligned sets (the second from the next seed), a learnable ``logit_scale``. Members:

- ``single``: the base loss at full width, ``chunk_size=256``;
- ``naive``: the sum of the five calls on the prefixes, written out, ``chunk_size=256``;
- ``matryoshka``: ``matryoshka(loss, widths)`` with ``chunk_size=256``: one walk over the
  tiles, every width's logits from one blocked product (``pmlfunc.losses._tiled.run_nested``);
- ``naive-dense``, ``matryoshka-dense``: the same without ``chunk_size`` (the engine's dense path).

Multi-similarity, a pair loss on ``cosine()`` with no tiled path, has ``single``, ``naive-dense``
and ``matryoshka-dense`` (every width's matrix from one blocked product, given as ``mat=``:
``pmlfunc.losses._tiled.prefix_matrices``).

Every member but ``single`` is checked equal to the float64 naive sum before it is timed.
``extra_info["peak_tensor_mib"]`` is the live-tensor peak of one step
(:func:`pmlfunc.memory.peak_tensor_bytes`). Issue 32's targets: at B = 4,096, D = 768 the
matryoshka step at most 0.65× the naive sum, dense and tiled; at B = 16,384 the tiled
matryoshka's peak at most 5× the single tiled loss's (it holds a tile a width: ``O(K × chunk ×
B)``).

The untimed run (the normal ``pytest``) runs each member at batch
``PMLFUNC_BENCH_SMOKE_MATRYOSHKA_BATCH`` (256) with the same equality checks.

Timed run::

    pytest benchmarks/cases/bench_matryoshka.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds

Interleaved rounds in one process (pytest-benchmark times each member in its own block, and
this machine drifts between blocks): the cases ``matryoshka-ntxent`` and ``matryoshka-clip`` of
:func:`benchmarks.cases.registry` hold the members ``pmlfunc-naive``, ``pmlfunc-matryoshka``,
``pmlfunc-naive-dense``, ``pmlfunc-matryoshka-dense`` and ``floor`` at the runner's batch and
dimensions (widths ``D, D/2, ..., D/16``), each checked equal to ``pmlfunc-naive-dense`` (loss
and every gradient, float32 rounding) before ``benchmarks.run`` times them one step each a
round::

    python -m benchmarks.run --case matryoshka-ntxent --batch-size 4096 --dimensions 768 \
        --repeats 5 --warmup 1
"""

from __future__ import annotations

import functools

import pytest
import torch

import pmlfunc as pf

from .. import common as C
from . import FLOOR, Case, Member, by_name

BATCH = C.env_int("PMLFUNC_BENCH_MATRYOSHKA_BATCH", 4096)
DIM = C.env_int("PMLFUNC_BENCH_MATRYOSHKA_DIM", 768)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_MATRYOSHKA_BATCH", 256)
THREADS = C.bench_threads()
CHUNK = 256
LOSSES = ("ntxent", "clip", "multi_similarity")
MEMBERS = ("single", "naive", "matryoshka", "naive-dense", "matryoshka-dense")
PAIR_LOSSES = ("multi_similarity",)  # dense only: no chunk_size=


def widths(dim: int) -> tuple[int, ...]:
    return tuple(dim // 2**k for k in range(5))


def pytest_generate_tests(metafunc) -> None:
    """Every member at ``BATCH`` (``SMOKE_BATCH`` untimed), a group a loss."""
    if "impl" not in metafunc.fixturenames:
        return
    b = SMOKE_BATCH if C.timing_disabled(metafunc.config) else BATCH
    params = [
        pytest.param(
            loss,
            b,
            impl,
            id=f"{loss}-b{b}-{impl}",
            marks=pytest.mark.benchmark(group=f"matryoshka-{loss}-b{b}"),
        )
        for loss in LOSSES
        for impl in MEMBERS
        if loss not in PAIR_LOSSES or impl in ("single", "naive-dense", "matryoshka-dense")
    ]
    metafunc.parametrize(("loss", "batch", "impl"), params)


def _inputs(loss: str, batch: int, dtype: torch.dtype):
    """``(leaves, call)``: the tensors a step differentiates and ``call(loss_fn, *leaves)``."""
    emb, labels = C.make_inputs(batch, DIM, dtype=dtype, seed=C.SEED)
    if loss != "clip":
        return [emb], lambda fn, e: fn(e, labels)
    return [emb, *_clip_leaves(emb)], lambda fn, a, b, t: fn(a, b, {"logit_scale": t})


def _clip_leaves(emb: torch.Tensor) -> list[torch.Tensor]:
    """CLIP's other leaves for the set ``emb``: its paired set (``benchmarks.common.make_paired``)
    and a learnable ``logit_scale``, both requiring gradients."""
    scale = pf.losses.clip_init(dtype=emb.dtype)["logit_scale"].to(emb.device)
    return [C.make_paired(emb).requires_grad_(), scale.requires_grad_()]


def _member(loss: str, impl: str, dim: int = DIM):
    """``impl``'s loss function at embedding width ``dim``: the positional arguments of
    ``loss`` (CLIP: two sets and its params)."""
    base = getattr(pf.losses, loss)
    chunk = None if impl.endswith("dense") else CHUNK
    fn = base if loss in PAIR_LOSSES else functools.partial(base, chunk_size=chunk)
    if impl.startswith("matryoshka"):
        return pf.transforms.matryoshka(fn, widths(dim))
    if impl == "single":
        return fn
    cut = (0, 1) if loss == "clip" else (0,)  # the embedding arguments' positions

    def naive(*args):
        total = None
        for d in widths(dim):
            part = fn(*(a[:, :d] if i in cut else a for i, a in enumerate(args)))
            total = part if total is None else total + part
        return total

    return naive


def bench_matryoshka(benchmark, request, loss: str, batch: int, impl: str) -> None:
    leaves, call = _inputs(loss, batch, torch.float32)
    fn = _member(loss, impl)

    def step() -> torch.Tensor:
        xs = [t.detach().requires_grad_() for t in leaves]
        value = call(fn, *xs)
        value.backward()
        return value.detach()

    if impl != "single":  # equal to the naive sum in float64, value and gradients
        leaves64, call64 = _inputs(loss, batch, torch.float64)
        xs = [t.detach().requires_grad_() for t in leaves64]
        want = call64(_member(loss, "naive"), *xs)
        want_grads = torch.autograd.grad(want, xs)
        xs = [t.detach().requires_grad_() for t in leaves]
        got = call(fn, *xs)
        for g, w in zip(torch.autograd.grad(got, xs), want_grads, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    value, _ = C.measure_tensor_peak(benchmark, request, step, THREADS)
    benchmark.extra_info.update(
        impl=impl, case=f"matryoshka-{loss}", batch=batch, dim=DIM, widths=list(widths(DIM)),
        chunk_size=None if impl.endswith("dense") else CHUNK, threads=THREADS,
        loss_value=float(value),
    )  # fmt: skip
    assert value.ndim == 0 and torch.isfinite(value)


def _case_member(loss: str, impl: str) -> Member:
    """``impl`` as a registry member: NT-Xent on the runner's embeddings and labels, CLIP on
    them and their paired set (``benchmarks.common.make_paired``) with a learnable scale."""

    def make(emb, labels):
        fn = _member(loss, impl, emb.shape[1])
        if loss != "clip":
            return fn, []
        other, scale = leaves = _clip_leaves(emb)
        return (lambda e, y: fn(e, other, {"logit_scale": scale})), leaves

    return Member(make)


ROUND_MEMBERS = ("naive", "matryoshka", "naive-dense", "matryoshka-dense")
CASES = by_name(
    *(
        Case(
            f"matryoshka-{loss}",
            {**{f"pmlfunc-{m}": _case_member(loss, m) for m in ROUND_MEMBERS}, "floor": FLOOR},
            extra={"chunk_size": CHUNK, "widths": "D, D/2, D/4, D/8, D/16"},
            reference="pmlfunc-naive-dense",
        )
        for loss in ("ntxent", "clip")
    )
)
