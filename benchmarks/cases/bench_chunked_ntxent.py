"""Anchor-chunked NT-Xent (``pf.chunked.value_and_grad``) beside the full batch: time and memory.

One pytest-benchmark group per batch, ``chunked-ntxent-b{B}``, with up to two members (one
:class:`benchmarks.cases.Case`; not in the registry ``benchmarks.run`` reads, since it runs at its
own batch sizes and measures memory in a subprocess; ``bench_anchor_batched`` times the same
calls at the suite's batch):

- ``chunked``: ``pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size=256)(emb, labels,
  temperature=0.07)``, the loss and its gradient with respect to the embeddings;
- ``full``: ``pf.losses.ntxent`` + ``torch.autograd.grad`` on the whole batch, only where it fits
  (batch <= ``PMLFUNC_BENCH_CHUNKED_FULL_MAX``, 8192: at 16,384 its B x B matrices need several
  GiB).

Inputs as in ``bench_core_losses`` (``benchmarks.common``): seeded standard-normal embeddings, four
samples per class, 128 dimensions, float32, one thread. ``extra_info`` records, besides the usual
configuration, the peak memory one step adds, measured twice (``pmlfunc.memory``):
``peak_rss_added_mib`` in a fresh subprocess (resident-set high-water mark, with allocator
overhead; not distorted by this process's heap) and ``peak_tensor_mib`` in this process (live
tensor storage, exact).

The untimed run (the normal ``pytest``, which the repository's ``conftest.py`` runs with ``--benchmark-disable``) runs each body once at batch
``PMLFUNC_BENCH_SMOKE_CHUNKED_BATCH`` (512) instead, checks that the chunked loss and gradient
equal the full batch's, and still fills ``extra_info`` (a few seconds in all).

Configuration (environment variables): ``PMLFUNC_BENCH_CHUNKED_BATCHES`` ("8192,16384"),
``PMLFUNC_BENCH_CHUNKED_CHUNK`` (256), ``PMLFUNC_BENCH_CHUNKED_FULL_MAX`` (8192),
``PMLFUNC_BENCH_SMOKE_CHUNKED_BATCH`` (512), ``PMLFUNC_BENCH_DIM`` (128),
``PMLFUNC_BENCH_THREADS`` (1).

Timed run::

    pytest benchmarks/cases/bench_chunked_ntxent.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,mean,rounds
"""

from __future__ import annotations

import os

import pytest
import torch

import pmlfunc as pf

from .. import common as C
from ..memory_report import rss_added_bytes, tensor_peak
from . import Case, anchor_batched, call, make_step

DIM = C.env_int("PMLFUNC_BENCH_DIM", C.DEFAULT_DIM)
THREADS = C.env_int("PMLFUNC_BENCH_THREADS", C.DEFAULT_THREADS)
CHUNK = C.env_int("PMLFUNC_BENCH_CHUNKED_CHUNK", 256)
FULL_MAX = C.env_int("PMLFUNC_BENCH_CHUNKED_FULL_MAX", 8192)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_CHUNKED_BATCH", 512)
DTYPE = torch.float32
MIB = 2**20


CASE = Case(
    "chunked-ntxent",
    {
        "chunked": anchor_batched(
            pf.losses.ntxent, lambda: CHUNK, temperature=C.NTXENT_TEMPERATURE
        ),
        "full": call(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE),
    },
)


def _batches() -> list[int]:
    raw = os.environ.get("PMLFUNC_BENCH_CHUNKED_BATCHES", "").strip() or "8192,16384"
    batches = [int(b) for b in raw.split(",") if b.strip()]
    if not batches or min(batches) <= 0:
        raise ValueError(f"PMLFUNC_BENCH_CHUNKED_BATCHES must list positive ints, got {raw!r}")
    return batches


def pytest_generate_tests(metafunc) -> None:
    """Timed: every configured batch; untimed: the smoke batch only (no duplicate cases)."""
    if "batch" not in metafunc.fixturenames:
        return
    batches = [SMOKE_BATCH] if C.timing_disabled(metafunc.config) else _batches()
    params = [
        pytest.param(
            batch,
            impl,
            id=f"b{batch}-{impl}",
            marks=[pytest.mark.benchmark(group=f"{CASE.name}-b{batch}")]
            + (
                [pytest.mark.skip(reason=f"full batch above {FULL_MAX}: B x B matrices need GiBs")]
                if impl == "full" and batch > FULL_MAX
                else []
            ),
        )
        for batch in batches
        for impl in CASE.members
    ]
    metafunc.parametrize(("batch", "impl"), params)


def bench_chunked_ntxent(benchmark, request, batch: int, impl: str) -> None:
    if benchmark.disabled:
        batch = min(batch, SMOKE_BATCH)
    emb, labels = C.make_inputs(batch, DIM, dtype=DTYPE, seed=C.SEED)
    step = make_step(CASE.members[impl], emb, labels)
    with C.set_threads(THREADS):
        loss = C.measure(benchmark, request, step, costs=False)  # its memory: below
    grad = step.last_grad  # type: ignore[attr-defined]

    C.fill_extra_info(
        benchmark.extra_info,
        emb,
        threads=THREADS,
        samples_per_class=C.DEFAULT_SAMPLES_PER_CLASS,
        impl=impl,
        case=CASE.name,
        loss_value=loss,
    )
    benchmark.extra_info["chunk_size"] = CHUNK if impl == "chunked" else None
    # Memory, after timing (neither measurement runs inside a timed round): a fresh process for
    # the RSS high-water mark, this process for live tensor bytes.
    opts = dict(dim=DIM, chunk_size=CHUNK, threads=THREADS, dtype=DTYPE)
    rss = rss_added_bytes(impl, batch, **opts)
    tensors = tensor_peak(impl, batch, **opts).peak
    benchmark.extra_info["peak_rss_added_mib"] = round(rss / MIB, 1)
    benchmark.extra_info["peak_tensor_mib"] = round(tensors / MIB, 1)

    assert loss.ndim == 0 and torch.isfinite(loss), f"{impl}: bad loss {loss}"
    assert grad.shape == emb.shape and torch.isfinite(grad).all(), f"{impl}: bad gradient"
    assert tensors > 0 and rss >= 0
    if benchmark.disabled and impl == "chunked":
        # The smoke run doubles as a regression check: chunked equals the full batch.
        full = make_step(CASE.members["full"], emb, labels)
        ref_loss = full()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, full.last_grad, rtol=1e-4, atol=1e-7)
