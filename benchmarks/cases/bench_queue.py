"""A document queue (``pf.queues``) as extra negatives: the retrieval loss against ``S`` queued
documents beside the batch alone and beside the plain-torch way of doing it.

One pytest-benchmark group, ``queue-b{B}``: ``B`` queries and their positives
(``PMLFUNC_BENCH_QUEUE_BATCH``, 512), ``D`` dimensions (``PMLFUNC_BENCH_QUEUE_DIM``, 256), a full
queue of ``S`` documents (``PMLFUNC_BENCH_QUEUE_SIZE``, 16,384), cosine similarity, scale 20,
float32, one thread, forward + backward:

- ``batch``: ``multiple_negatives_ranking(q, p, chunk_size=256)``, in-batch negatives only;
- ``queue``: the same with ``memory=queue`` (``B + S`` candidates a query);
- ``torch-dense``: what a training script writes without the library (MoCo's form):
  ``F.cross_entropy(20 · q̂ [p̂; k̂]ᵀ, arange(B))`` over the normalised batch and queue
  concatenated (the queue detached).

``extra_info["peak_tensor_mib"]`` is one step's live-tensor peak
(:func:`pmlfunc.memory.peak_tensor_bytes`). The untimed run (the normal ``pytest``) runs each
member at batch ``PMLFUNC_BENCH_SMOKE_QUEUE_BATCH`` (64) against a queue of 256 and checks the
queue member's value against ``torch-dense``.

Timed run::

    pytest benchmarks/cases/bench_queue.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pmlfunc as pf

from .. import common as C

BATCH = C.env_int("PMLFUNC_BENCH_QUEUE_BATCH", 512)
DIM = C.env_int("PMLFUNC_BENCH_QUEUE_DIM", 256)
SIZE = C.env_int("PMLFUNC_BENCH_QUEUE_SIZE", 16384)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_QUEUE_BATCH", 64)
SMOKE_SIZE = 256
THREADS = C.bench_threads()
CHUNK = 256
SCALE = 20.0
MEMBERS = ("batch", "queue", "torch-dense")


def pytest_generate_tests(metafunc) -> None:
    C.parametrize_members(metafunc, "queue", MEMBERS, BATCH, SMOKE_BATCH)


def full_queue(size: int, dim: int) -> dict[str, torch.Tensor]:
    docs = torch.randn(size, dim, generator=torch.Generator().manual_seed(C.SEED + 1))
    return pf.queues.document_queue_push(pf.queues.document_queue_init(size, dim), docs)


def loss_of(impl: str, queue: dict[str, torch.Tensor]):
    if impl == "torch-dense":

        def dense(q, p):
            docs = torch.cat([F.normalize(p, dim=-1), F.normalize(queue["documents"], dim=-1)])
            logits = SCALE * F.normalize(q, dim=-1) @ docs.T
            return F.cross_entropy(logits, torch.arange(q.shape[0]))

        return dense
    memory = queue if impl == "queue" else None
    return lambda q, p: pf.losses.multiple_negatives_ranking(
        q, p, scale=SCALE, chunk_size=CHUNK, memory=memory
    )


def bench_queue(benchmark, request, batch: int, impl: str) -> None:
    size = SIZE if batch == BATCH else SMOKE_SIZE
    g = torch.Generator().manual_seed(C.SEED)
    q0, p0 = torch.randn(2, batch, DIM, generator=g)
    queue = full_queue(size, DIM)
    fn = loss_of(impl, queue)

    def step() -> torch.Tensor:
        q, p = q0.detach().requires_grad_(), p0.detach().requires_grad_()
        loss = fn(q, p)
        loss.backward()
        return loss.detach()

    loss, _ = C.measure_tensor_peak(benchmark, request, step, THREADS)
    benchmark.extra_info.update(
        impl=impl, case="queue", batch=batch, dim=DIM, queue=size, chunk_size=CHUNK,
        threads=THREADS, loss_value=float(loss),
    )  # fmt: skip
    assert loss.ndim == 0 and torch.isfinite(loss)
    if impl == "queue":
        torch.testing.assert_close(
            loss, loss_of("torch-dense", queue)(q0, p0), rtol=1e-5, atol=1e-5
        )
