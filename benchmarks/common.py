"""Shared input builders and step helpers for the pmlfunc benchmark suite.

Settings follow the reference "Development measurements" protocol
(shared/reference/000_*.txt): standard-normal embeddings from a seeded CPU
generator, balanced contiguous labels (``arange(B) // samples_per_class``, four
per class by default), contrastive ``neg_margin=1.4``, triplet ``margin=0.2``,
NT-Xent ``temperature=0.07``. Used by the case files (``benchmarks.cases``) and
the command-line tools alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

SEED = 17
DEFAULT_BATCH = 512
DEFAULT_DIM = 128
DEFAULT_SAMPLES_PER_CLASS = 4
DEFAULT_DTYPE = torch.float32
DEFAULT_THREADS = 1

# Hyper-parameters shared by every implementation of a case.
CONTRASTIVE_POS_MARGIN = 0.0
CONTRASTIVE_NEG_MARGIN = 1.4
TRIPLET_MARGIN = 0.2
NTXENT_TEMPERATURE = 0.07
SUPCON_TEMPERATURE = 0.1
MS_ALPHA = 2.0
MS_BETA = 50.0
MS_BASE = 0.5


def timing_disabled(config) -> bool:
    """Whether pytest-benchmark will not time this session (the untimed ``pytest`` run), known
    at collection time: pytest-benchmark's own rule (``BenchmarkSession.disabled``)."""
    return bool(config.getoption("benchmark_disable")) and not config.getoption("benchmark_enable")


def parametrize_members(metafunc, case: str, members, batch: int, smoke_batch: int) -> None:
    """Parametrize a case file's body over ``(batch, impl)``: every member at ``batch`` in one
    group ``{case}-b{batch}``, or at ``smoke_batch`` in the untimed run."""
    if "impl" not in metafunc.fixturenames:
        return
    b = smoke_batch if timing_disabled(metafunc.config) else batch
    group = pytest.mark.benchmark(group=f"{case}-b{b}")
    params = [pytest.param(b, impl, id=f"b{b}-{impl}", marks=group) for impl in members]
    metafunc.parametrize(("batch", "impl"), params)


def env_int(name: str, default: int) -> int:
    """Read a positive integer from the environment (``default`` when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = int(raw)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def env_settings() -> tuple[int, int, int, int, torch.dtype, torch.device]:
    """``(batch, dim, samples_per_class, threads, dtype, device)`` of the pytest-benchmark suite,
    from ``PMLFUNC_BENCH_BATCH``, ``_DIM``, ``_SAMPLES_PER_CLASS``, ``_THREADS``, ``_DTYPE`` (a
    torch dtype name) and ``_DEVICE``."""
    dtype = getattr(torch, os.environ.get("PMLFUNC_BENCH_DTYPE", "") or "float32")
    return (
        bench_batch(),
        env_int("PMLFUNC_BENCH_DIM", DEFAULT_DIM),
        env_int("PMLFUNC_BENCH_SAMPLES_PER_CLASS", DEFAULT_SAMPLES_PER_CLASS),
        bench_threads(),
        dtype,
        torch.device(os.environ.get("PMLFUNC_BENCH_DEVICE", "") or "cpu"),
    )


def parity_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance for pmlfunc-vs-PML loss agreement in a benchmark body."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 2e-2


def bench_batch() -> int:
    """Batch size for timed runs: ``PMLFUNC_BENCH_BATCH`` (default 512)."""
    return env_int("PMLFUNC_BENCH_BATCH", DEFAULT_BATCH)


def bench_threads() -> int:
    """Threads for a benchmark body: ``PMLFUNC_BENCH_THREADS`` (default 1)."""
    return env_int("PMLFUNC_BENCH_THREADS", DEFAULT_THREADS)


def make_labels(batch: int, samples_per_class: int = DEFAULT_SAMPLES_PER_CLASS) -> torch.Tensor:
    """Balanced contiguous labels ``arange(batch) // samples_per_class`` (int64)."""
    if batch < 2 * samples_per_class:
        raise ValueError(
            f"batch must hold at least two complete classes: batch={batch}, "
            f"samples_per_class={samples_per_class}"
        )
    return torch.arange(batch, dtype=torch.int64) // samples_per_class


def make_embeddings(
    batch: int,
    dim: int = DEFAULT_DIM,
    *,
    dtype: torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = "cpu",
    seed: int = SEED,
) -> torch.Tensor:
    """Standard-normal ``(batch, dim)`` embeddings drawn from a seeded CPU generator."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    emb = torch.randn(batch, dim, generator=gen, dtype=torch.float32)
    return emb.to(device=device, dtype=dtype)


def make_paired(emb: torch.Tensor) -> torch.Tensor:
    """The paired set of a two-set loss (CLIP, SigLIP) for ``emb``: embeddings of the same
    shape, dtype and device from the next seed, detached."""
    return make_embeddings(
        emb.shape[0], emb.shape[1], dtype=emb.dtype, device=emb.device, seed=SEED + 1
    )


def make_inputs(
    batch: int,
    dim: int = DEFAULT_DIM,
    samples_per_class: int = DEFAULT_SAMPLES_PER_CLASS,
    *,
    dtype: torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = "cpu",
    seed: int = SEED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings (a leaf with ``requires_grad``) and labels for one case."""
    emb = make_embeddings(batch, dim, dtype=dtype, device=device, seed=seed).requires_grad_()
    labels = make_labels(batch, samples_per_class).to(device)
    return emb, labels


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (64-bit): what a process reaches after freeing one


def settle_allocator() -> bool:
    """Put the process's allocator in a training process's steady state, before anything is
    measured; ``True`` where glibc's parameters were set.

    A fresh glibc process serves every allocation over 128 KiB (each 512 × 512 matrix) with
    ``mmap`` and returns it on free, so every step pays its page faults again; a process that
    has freed a large block has raised that threshold (up to 32 MiB) and reuses such buffers
    from its heap. glibc also trims the heap's free top back to the OS past twice the threshold:
    after a PML step that allocated hundreds of MiB, the next member's step (timed in the same
    round, ``benchmarks.run``) re-faults its pages, 2-6x slower at batch 128. So: the mmap
    threshold at 32 MiB, and no trimming. Buffers over 32 MiB (PML's pair matrices) are still
    mapped and unmapped by every step, as in training. Elsewhere (no glibc), one 16 MiB buffer
    is allocated and freed, which raises the thresholds where the allocator adapts them."""
    buf = torch.empty(16 * 2**20 // 4).fill_(0.0)
    del buf
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc
        return False
    set_mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    return bool(set_mmap and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


@contextlib.contextmanager
def set_threads(n: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)``; restore the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def synced(step: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``step``, followed on a CUDA device by a synchronisation, so that a timed call covers its
    kernels; elsewhere ``step`` itself."""
    if device.type != "cuda":
        return step

    def call() -> Any:
        out = step()
        torch.cuda.synchronize(device)
        return out

    return call


def compiled(fn: Callable[..., Any], backend: str = "inductor") -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True)`` from a clean dynamo state: each compiled entry is
    cold and independent of the ones before. Without the reset, the members' callables (often
    ``functools.partial`` objects, which dynamo runs through one shared frame guarded on the
    wrapped function) reach dynamo's recompile limit after 8 entries in one process, and
    ``fullgraph=True`` turns that into a hard failure."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def floor_loss(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cost floor: one B×B matmul and its backward, ``(E @ E.T).sum()``."""
    del labels
    return (embeddings @ embeddings.T).sum()


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated tensor memory since the last reset, where cheaply available.

    CUDA only for now; CPU returns ``None`` (a later issue adds a CPU method).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def fill_extra_info(
    extra_info: dict[str, Any],
    embeddings: torch.Tensor,
    *,
    threads: int,
    samples_per_class: int,
    impl: str,
    case: str,
    loss_value: torch.Tensor | None = None,
) -> None:
    """Record the configuration of a measurement in pytest-benchmark's ``extra_info``."""
    extra_info.update(
        case=case,
        impl=impl,
        dtype=str(embeddings.dtype).removeprefix("torch."),
        shape=list(embeddings.shape),
        samples_per_class=samples_per_class,
        threads=threads,
        device=str(embeddings.device),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
    )
    peak = peak_memory_bytes(embeddings.device)
    if peak is not None:
        extra_info["peak_memory_mib"] = round(peak / 2**20, 3)
    if loss_value is not None:
        extra_info["loss"] = float(loss_value)


def step_flops(call: Callable[[], Any]) -> int | None:
    """FLOPs of one call (``torch.utils.flop_counter``: matmuls and the like), or ``None`` when
    the counter cannot follow it (some PML steps register autograd hooks it rejects)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    try:
        with counter:
            call()
    except RuntimeError:
        return None
    return int(counter.get_total_flops())


def step_peak_mib(call: Callable[[], Any], device: torch.device) -> float:
    """Peak memory one call adds, in MiB: on CUDA the allocated memory above the pre-call
    baseline; elsewhere the peak of live tensor storage (``pmlfunc.memory``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    from pmlfunc.memory import TensorMemoryTracker

    with TensorMemoryTracker() as tracker:
        call()
    return tracker.peak / 2**20


# Timed runs: steps slower than SLOW_STEP_S (PML NT-Xent at 512, chunked at 16,384) get
# SLOW_ROUNDS rounds and no extra warmup (the sizing call is the warmup); faster ones get
# ceil(--benchmark-max-time / step) rounds, at least --benchmark-min-rounds.
SLOW_STEP_S = 1.0
SLOW_ROUNDS = 3
MAX_ROUNDS = 2000


def plan_rounds(step_s: float, max_time: float, min_rounds: int) -> tuple[int, int]:
    """(rounds, warmup_rounds) for a step that took ``step_s`` seconds once."""
    if step_s >= SLOW_STEP_S:
        return SLOW_ROUNDS, 0
    rounds = min(MAX_ROUNDS, max(min_rounds, math.ceil(max_time / max(step_s, 1e-9))))
    return rounds, min(10, max(1, rounds // 10))


# Timed runs: a PML member whose first step takes longer is skipped with the reason (PML 2.9.0's
# pair-matrix losses take 15-30 s a step at batch 512: they alone would take most of the suite's
# time). pmlfunc and floor members are always measured. benchmarks.run --max-step-seconds is the
# runner's counterpart.
PML_MAX_STEP_SECONDS_VAR = "PMLFUNC_BENCH_PML_MAX_STEP_SECONDS"
PML_MAX_STEP_SECONDS = 5.0


def _skip_slow_pml(request, step_s: float) -> None:
    """Skip a PML member (the bodies' ``impl`` parameter) whose step took over the budget."""
    callspec = getattr(request.node, "callspec", None)
    impl = callspec.params.get("impl", "") if callspec is not None else ""
    if impl.split("-")[0] != "pml":
        return
    raw = os.environ.get(PML_MAX_STEP_SECONDS_VAR, "").strip()
    budget = float(raw) if raw else PML_MAX_STEP_SECONDS
    if step_s > budget:
        pytest.skip(
            f"PML 2.9.0: one step took {step_s:,.1f} s (> {budget:g} s, "
            f"{PML_MAX_STEP_SECONDS_VAR}; set it higher to time this member)"
        )


def measure(
    benchmark,
    request,
    step,
    device: torch.device | None = None,
    cost_step: Callable[[], Any] | None = None,
    *,
    first: Callable[[Any], None] | None = None,
    costs: bool = True,
):
    """Run ``step`` under pytest-benchmark and return its result.

    Untimed (``--benchmark-disable``): one call. Timed: untimed calls size the run (and warm up
    caches and the allocator; the first call is often slower, so a fast step is sized from a
    second one), then ``benchmark.pedantic`` with one iteration per round, then (``costs``) two
    more calls record ``extra_info["flops"]`` and ``extra_info["peak_added_mib"]``
    (:func:`step_flops`, :func:`step_peak_mib`) of ``cost_step`` (default ``step``; a compiled
    step passes its eager twin, since counting modes do not trace); a body that measures its
    memory itself passes ``costs=False``. ``first`` receives the first call's result, also when
    the member is then skipped for its step time (a parity check can still use its value).
    """
    if benchmark.disabled:
        return benchmark(step)
    start = time.perf_counter()
    out = step()
    step_s = time.perf_counter() - start
    if first is not None:
        first(out)
    _skip_slow_pml(request, step_s)
    if step_s < SLOW_STEP_S:
        start = time.perf_counter()
        step()
        step_s = time.perf_counter() - start
    rounds, warmup = plan_rounds(
        step_s,
        float(request.config.getoption("benchmark_max_time")),
        int(request.config.getoption("benchmark_min_rounds")),
    )
    out = benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=warmup)
    if not costs:
        return out
    # Timed runs only (two more calls): what one step costs besides its time.
    device = device or torch.device("cpu")
    cost_step = cost_step or step
    benchmark.extra_info["flops"] = step_flops(cost_step)
    benchmark.extra_info["peak_added_mib"] = round(step_peak_mib(cost_step, device), 3)
    return out


def measure_tensor_peak(
    benchmark,
    request,
    step: Callable[[], Any],
    threads: int,
    *,
    peak_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[Any, int]:
    """``(result, peak)``: :func:`measure` ``step`` (``costs=False``), then one more call's
    live-tensor peak in bytes (:func:`pmlfunc.memory.peak_tensor_bytes`), both with ``threads``
    threads; the peak, in MiB, recorded as ``extra_info["peak_tensor_mib"]``. ``peak_context``
    makes the context the counted call alone runs in (e.g. a compiler stance: built only then,
    since ``torch.compiler.set_stance(...)`` takes effect when called)."""
    from pmlfunc.memory import peak_tensor_bytes

    with set_threads(threads):
        out = measure(benchmark, request, step, costs=False)
        with peak_context():
            _, peak = peak_tensor_bytes(step)
    benchmark.extra_info["peak_tensor_mib"] = round(peak / 2**20, 1)
    return out, peak
