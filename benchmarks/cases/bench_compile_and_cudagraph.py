"""Compiled and CUDA-graph members of every group: the pmlfunc and floor members of every case
of the registry (``benchmarks.cases.registry``) under ``torch.compile(fullgraph=True)`` or replayed from a captured CUDA
graph, in the same ``{case}-b{B}`` groups as their eager bodies.

Opt-in, because compiling every case takes about ten minutes on a small CPU::

    PMLFUNC_BENCH_MODES=compile,cudagraph pytest benchmarks \\
        --benchmark-only --benchmark-group-by=group

- ``compile``: member ``<impl>-compile``; ``extra_info["first_step_ms"]`` is the first call,
  compilation included, reported apart from the timed steps. An unsupported operation fails
  the body (no eager fallback).
- ``cudagraph``: member ``<impl>-cudagraph``; forward and backward captured once and replayed.
  Skipped, with the reason, without CUDA, and for anchor-batched members (their chunk loop runs
  in Python).

Without ``PMLFUNC_BENCH_MODES`` the module contributes one skipped placeholder saying so; the
compile path itself is exercised by ``tests/test_benchmark_tools.py`` through
``benchmarks.run --mode compile``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from .. import common as C
from ..run import _graphed, _one_step, _Step
from . import BATCH, DEVICE, THREADS, inputs, library, record, registry

MODES = tuple(
    m for m in (os.environ.get("PMLFUNC_BENCH_MODES", "") or "").split(",") if m and m != "eager"
)
if any(m not in ("compile", "cudagraph") for m in MODES):
    raise ValueError(f"PMLFUNC_BENCH_MODES lists compile and/or cudagraph, got {MODES}")


def _params() -> list:
    if not MODES:
        return [
            pytest.param(
                None,
                None,
                None,
                id="modes-off",
                marks=pytest.mark.skip(
                    reason="set PMLFUNC_BENCH_MODES=compile,cudagraph to add compiled and "
                    "CUDA-graph members to every group"
                ),
            )
        ]
    return [
        pytest.param(
            case.name,
            impl,
            mode,
            id=f"{case.name}-{impl}-{mode}",
            marks=pytest.mark.benchmark(group=f"{case.name}-b{BATCH}"),
        )
        for mode in MODES
        for case in registry().values()
        for impl in case.members
        if library(impl) in ("pmlfunc", "floor")
    ]


@pytest.mark.parametrize(("case", "impl", "mode"), _params())
def bench_mode(benchmark, request, case: str, impl: str, mode: str) -> None:
    spec = registry()[case]
    member = spec.members[impl]
    if mode == "cudagraph" and DEVICE.type != "cuda":
        pytest.skip("CUDA-graph capture needs CUDA")
    if mode == "cudagraph" and member.kind == "value_and_grad":
        pytest.skip("anchor-batched steps loop over chunks in Python: capture the loss instead")
    emb, labels = inputs()
    if member.kind == "mine":
        emb = emb.detach()
    fn, params = member.make(emb, labels)
    step = _Step(member, fn, params, emb, labels)
    eager = _Step(member, fn, params, emb, labels)  # FLOPs and memory are counted on it
    with C.set_threads(THREADS):
        if mode == "compile":
            step.fn = C.compiled(fn)
            start = time.perf_counter()
            out = step.forward()
            step.check(out, step.backward(out))
            benchmark.extra_info["first_step_ms"] = (time.perf_counter() - start) * 1e3
            call = _one_step(step)
        else:
            replay, _ = _graphed(step, DEVICE)

            def call():
                replay()
                torch.cuda.synchronize(DEVICE)

        C.measure(benchmark, request, call, DEVICE, cost_step=_one_step(eager))
        record(benchmark, emb, spec, f"{impl}-{mode}", mode=mode)
