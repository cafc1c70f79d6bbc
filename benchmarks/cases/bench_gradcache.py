"""A GradCache training step (``pf.chunked.gradcache``) beside the plain full-batch step: time and
memory of encoder + loss, forward and backward.

One pytest-benchmark group, ``gradcache-b{B}``, three members, each accumulating the parameter
gradients of a 2-layer MLP encoder (``Linear(128, H) → GELU → Linear(H, 128)``, ``H`` =
``PMLFUNC_BENCH_GRADCACHE_HIDDEN``, 1,024) under NT-Xent with four samples per class:

- ``full-dense``: ``pf.losses.ntxent(encoder(x), labels).backward()``, the step without any
  chunking (the whole batch's activations and ``B × B`` matrices);
- ``full-tiled``: the same with ``chunk_size=`` (the loss bounded, the activations not);
- ``gradcache``: ``pf.chunked.gradcache(encoder, x, loss, mini_batch=256)`` with the tiled loss:
  the encoder runs twice, one mini-batch of activations alive at a time.

``extra_info["peak_tensor_mib"]`` is the live-tensor peak one step adds
(:func:`pmlfunc.memory.peak_tensor_bytes`, exact and deterministic; parameter gradients
included). Issue 32's target: at B = 4,096 and mini-batch 256, GradCache's peak at most 1/8 of the
full-batch step's, its gradients equal to one backward (float64, 1e-10).

The untimed run (the normal ``pytest``) builds every member at batch
``PMLFUNC_BENCH_SMOKE_GRADCACHE_BATCH`` (512), records the same ``extra_info`` and checks, in
float64, that GradCache's gradients equal the full-batch step's to 1e-10.

Configuration (environment variables): ``PMLFUNC_BENCH_GRADCACHE_BATCH`` (4096),
``PMLFUNC_BENCH_GRADCACHE_HIDDEN`` (1024), ``PMLFUNC_BENCH_GRADCACHE_MINI`` (256),
``PMLFUNC_BENCH_GRADCACHE_CHUNK`` (the loss's tile, 64), ``PMLFUNC_BENCH_THREADS`` (1).

Timed run::

    pytest benchmarks/cases/bench_gradcache.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import pmlfunc as pf

from .. import common as C

BATCH = C.env_int("PMLFUNC_BENCH_GRADCACHE_BATCH", 4096)
HIDDEN = C.env_int("PMLFUNC_BENCH_GRADCACHE_HIDDEN", 1024)
MINI = C.env_int("PMLFUNC_BENCH_GRADCACHE_MINI", 256)
CHUNK = C.env_int("PMLFUNC_BENCH_GRADCACHE_CHUNK", 64)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_GRADCACHE_BATCH", 512)
THREADS = C.bench_threads()
DIM = 128
MEMBERS = ("full-dense", "full-tiled", "gradcache")


def encoder(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(C.SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, DIM)
    ).to(dtype)  # fmt: skip


def inputs(batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(C.SEED)
    return torch.randn(batch, DIM, generator=g, dtype=dtype), C.make_labels(batch)


def step(impl: str, enc: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor) -> Callable:
    """One member's training step (zero the gradients, accumulate them); returns the loss."""
    kw = {"labels": labels, "temperature": C.NTXENT_TEMPERATURE}
    tiled = functools.partial(pf.losses.ntxent, chunk_size=CHUNK, **kw)

    def run() -> torch.Tensor:
        enc.zero_grad(set_to_none=True)
        if impl == "gradcache":
            return pf.chunked.gradcache(enc, x, tiled, mini_batch=MINI)
        loss = (tiled if impl == "full-tiled" else functools.partial(pf.losses.ntxent, **kw))(
            enc(x)
        )
        loss.backward()
        return loss.detach()

    return run


def pytest_generate_tests(metafunc) -> None:
    C.parametrize_members(metafunc, "gradcache", MEMBERS, BATCH, SMOKE_BATCH)


def bench_gradcache(benchmark, request, batch: int, impl: str) -> None:
    enc = encoder()
    x, labels = inputs(batch)
    run = step(impl, enc, x, labels)
    loss, _ = C.measure_tensor_peak(benchmark, request, run, THREADS)
    benchmark.extra_info.update(
        impl=impl,
        case="gradcache",
        batch=batch,
        dim=DIM,
        hidden=HIDDEN,
        mini_batch=MINI if impl == "gradcache" else None,
        chunk_size=None if impl == "full-dense" else CHUNK,
        threads=THREADS,
        loss_value=float(loss),
    )
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in enc.parameters())
    if impl == "gradcache":
        # the claim behind the timing: the same gradients as one backward (float64)
        got, want = encoder(torch.float64), encoder(torch.float64)
        x64, _ = inputs(batch, torch.float64)
        step("gradcache", got, x64, labels)()
        step("full-tiled", want, x64, labels)()
        for a, b in zip(got.parameters(), want.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
