"""``pf.transforms.matryoshka`` beside the base loss at full width: time and memory.

One pytest-benchmark group, ``matryoshka-b{B}``, NT-Xent forward + backward at ``B`` rows and
``D`` dimensions (``PMLFUNC_BENCH_MATRYOSHKA_BATCH``, 4,096; ``PMLFUNC_BENCH_MATRYOSHKA_DIM``,
768), four samples per class, float32, one thread:

- ``single``: ``pf.losses.ntxent(emb, labels, chunk_size=256)``, the base loss at full width;
- ``matryoshka``: ``matryoshka(ntxent, (D, D/2, D/4, D/8, D/16))`` with ``chunk_size=256``;
- ``matryoshka-dense``: the same without ``chunk_size`` (the engine's dense path per width).

``extra_info["peak_tensor_mib"]`` is the live-tensor peak of one step
(:func:`pmlfunc.memory.peak_tensor_bytes`). Issue 32's targets: at B = 4,096, D = 768 the
matryoshka step at most 0.65× the naive sum of five calls (the transform *is* that sum today, so
the ratio is 1: its products cost ``Σ d_k / D = 1.94`` full products); at B = 16,384 the tiled
matryoshka's peak at most 5× the single tiled loss's (the widths run one after another, so the
peak is one call's plus the ``B × D`` gradient).

The untimed run (the normal ``pytest``) runs each member at batch
``PMLFUNC_BENCH_SMOKE_MATRYOSHKA_BATCH`` (256) and checks the matryoshka value against the sum
of the five calls written out.

Timed run::

    pytest benchmarks/cases/bench_matryoshka.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
"""

from __future__ import annotations

import torch

import pmlfunc as pf

from .. import common as C

BATCH = C.env_int("PMLFUNC_BENCH_MATRYOSHKA_BATCH", 4096)
DIM = C.env_int("PMLFUNC_BENCH_MATRYOSHKA_DIM", 768)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_MATRYOSHKA_BATCH", 256)
THREADS = C.bench_threads()
CHUNK = 256
MEMBERS = ("single", "matryoshka", "matryoshka-dense")


def widths(dim: int) -> tuple[int, ...]:
    return tuple(dim // 2**k for k in range(5))


def loss_of(impl: str, dim: int):
    if impl == "single":
        return lambda e, y: pf.losses.ntxent(e, y, chunk_size=CHUNK)
    nested = pf.transforms.matryoshka(pf.losses.ntxent, widths(dim))
    chunk = CHUNK if impl == "matryoshka" else None
    return lambda e, y: nested(e, y, chunk_size=chunk)


def pytest_generate_tests(metafunc) -> None:
    C.parametrize_members(metafunc, "matryoshka", MEMBERS, BATCH, SMOKE_BATCH)


def bench_matryoshka(benchmark, request, batch: int, impl: str) -> None:
    emb, labels = C.make_inputs(batch, DIM, dtype=torch.float32, seed=C.SEED)
    fn = loss_of(impl, DIM)

    def step() -> torch.Tensor:
        x = emb.detach().requires_grad_()
        loss = fn(x, labels)
        loss.backward()
        return loss.detach()

    loss, _ = C.measure_tensor_peak(benchmark, request, step, THREADS)
    benchmark.extra_info.update(
        impl=impl, case="matryoshka", batch=batch, dim=DIM, widths=list(widths(DIM)),
        chunk_size=None if impl == "matryoshka-dense" else CHUNK, threads=THREADS,
        loss_value=float(loss),
    )  # fmt: skip
    assert loss.ndim == 0 and torch.isfinite(loss)
    if impl != "single":
        naive = sum(pf.losses.ntxent(emb[:, :d], labels) for d in widths(DIM))
        torch.testing.assert_close(loss, naive, rtol=1e-5, atol=1e-5)
