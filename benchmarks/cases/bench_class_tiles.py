"""Classifier losses over many classes: the dense ``(B, C)`` logits against tiles of classes
(``class_chunk_size=``), beside the matmul floor and PML.

One pytest-benchmark group per class count, ``classes-c{C}`` (``PMLFUNC_BENCH_CLASSES``, a comma
list, default ``10000,100000,1000000``): ``B`` rows (``PMLFUNC_BENCH_CLASSES_BATCH``, 512), ``D``
dimensions (``PMLFUNC_BENCH_CLASSES_DIM``, 128), float32, one thread, forward + backward into the
embeddings and the weights (``torch.autograd.grad``: the step returns both gradients):

- ``{loss}-dense`` and ``{loss}-tiled`` (``class_chunk_size=8192``, ``PMLFUNC_BENCH_CLASS_CHUNK``)
  for ``arcface``, ``cosface``, ``normalized_softmax``, ``proxy_anchor`` (the per-proxy column
  walk) and ``p2s_grad`` (the sum-of-squares walk);
- ``floor``: ``(x Wᵀ).sum()`` and its backward, the three ``B × D × C`` products any of them
  costs;
- ``arcface-pml``: PML 2.9.0's ``ArcFaceLoss`` (dense), up to ``C = 100,000``
  (``PMLFUNC_BENCH_CLASSES_PML_MAX``);
- ``normalized_softmax-cce``: Apple's Cut Cross-Entropy (a peer, ``benchmarks/peers.py``;
  skipped with the reason when ``cut-cross-entropy`` is not installed),
  ``linear_cross_entropy(F.normalize(x) / T, F.normalize(W), labels)`` with the ``normalized_softmax``
  members' temperature ``T``: the same loss. Here (CPU) that is CCE's ``"torch_compile"`` impl, a
  ``torch.compile(fullgraph=True, dynamic=True)`` of the dense logits and ``F.cross_entropy``
  (CCE's own memory-efficient ``"cce"`` impl is Triton, CUDA only: ``benchmarks/class_tiles.py``
  times it on a GPU). Every run first checks its value and both gradients against pmlfunc's dense
  ``normalized_softmax`` (which also compiles it, outside the timing). Its ``peak_tensor_mib`` is
  that of the same body run eagerly (``torch.compiler.set_stance("force_eager")``: Inductor's
  buffers are invisible to the count, and the count's dispatch mode cannot run under
  ``fullgraph=True``), ``extra_info["peak_counted"]`` says so.

``extra_info``: ``peak_tensor_mib``, one step's live-tensor peak
(:func:`pmlfunc.memory.peak_tensor_bytes`), and ``beyond_grads_mib``, that peak less the two
gradients the step returns (the ``C × D`` weight gradient and the ``B × D`` embedding one): what
the loss adds beyond the weights and their gradient. The untimed run (the normal ``pytest``)
runs every member at ``C = 2,000`` with tiles of 256 classes and checks each tiled member's value
and gradients against its dense twin.

Timed run::

    pytest benchmarks/cases/bench_class_tiles.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F

import pmlfunc as pf

from .. import common as C
from .. import peers

BATCH = C.env_int("PMLFUNC_BENCH_CLASSES_BATCH", 512)
DIM = C.env_int("PMLFUNC_BENCH_CLASSES_DIM", 128)
CHUNK = C.env_int("PMLFUNC_BENCH_CLASS_CHUNK", 8192)
PML_MAX = C.env_int("PMLFUNC_BENCH_CLASSES_PML_MAX", 100_000)
THREADS = C.bench_threads()
SMOKE_CLASSES, SMOKE_CHUNK = 2_000, 256
LOSSES = {
    "arcface": (pf.losses.arcface, pf.losses.arcface_init, {"margin": 0.5, "scale": 64.0}),
    "cosface": (pf.losses.cosface, pf.losses.cosface_init, {"margin": 0.35, "scale": 64.0}),
    "normalized_softmax": (
        pf.losses.normalized_softmax,
        pf.losses.normalized_softmax_init,
        {"temperature": 0.05},
    ),
    # the per-proxy column walk and the sum-of-squares walk
    "proxy_anchor": (pf.losses.proxy_anchor, pf.losses.proxy_anchor_init, {}),
    "p2s_grad": (pf.losses.p2s_grad, pf.losses.p2s_grad_init, {}),
}
KEYS = {"proxy_anchor": "proxies"}  # the table's key in params (default "weight")
CCE = "normalized_softmax-cce"  # Cut Cross-Entropy on the normalized_softmax logits
MEMBERS = (
    "floor",
    *(f"{n}-{p}" for n in LOSSES for p in ("dense", "tiled")),
    CCE,
    "arcface-pml",
)
MIB = 2**20


def class_counts() -> list[int]:
    raw = os.environ.get("PMLFUNC_BENCH_CLASSES", "").strip() or "10000,100000,1000000"
    return [int(v) for v in raw.split(",")]


def pytest_generate_tests(metafunc) -> None:
    if "impl" not in metafunc.fixturenames:
        return
    smoke = C.timing_disabled(metafunc.config)
    params = []
    for c in [SMOKE_CLASSES] if smoke else class_counts():
        group = pytest.mark.benchmark(group=f"classes-c{c}")
        for impl in MEMBERS:
            if impl == "arcface-pml" and c > PML_MAX:
                continue
            params.append(pytest.param(c, impl, id=f"c{c}-{impl}", marks=group))
    metafunc.parametrize(("classes", "impl"), params)


def member(impl: str, labels: torch.Tensor, chunk: int, w0: torch.Tensor):
    """``(f, weight)``: the member's loss ``f(x, weight)`` of embeddings ``x`` against the class
    weights, and the weights it differentiates (``w0``; PML's ``W``, its transpose)."""
    if impl == "floor":
        return (lambda x, w: (x @ w.t()).sum()), w0
    name, path = impl.rsplit("-", 1)
    fn, _, hp = LOSSES[name]
    if path == "pml":
        from pytorch_metric_learning import losses as pml_losses

        head = pml_losses.ArcFaceLoss(
            w0.shape[0], w0.shape[1], margin=math.degrees(hp["margin"]), scale=hp["scale"]
        )
        head.W.data = w0.t().clone()
        return (lambda x, w: head(x, labels)), head.W
    if path == "cce":  # CE of normalize(x) normalize(W)ᵀ / T: normalized_softmax's logits
        cce, cce_impl, t = peers.cut_cross_entropy(), peers.cce_impl("cpu"), hp["temperature"]
        return (
            lambda x, w: cce.linear_cross_entropy(
                F.normalize(x) / t, F.normalize(w), labels, cce_impl
            )
        ), w0
    kw = {"class_chunk_size": chunk} if path == "tiled" else {}
    key = KEYS.get(name, "weight")
    return (lambda x, w: fn(x, labels, {key: w}, **hp, **kw)), w0


def bench_class_tiles(benchmark, request, classes: int, impl: str) -> None:
    if impl == CCE and (reason := peers.unavailable("cut_cross_entropy")) is not None:
        pytest.skip(reason)
    smoke = classes == SMOKE_CLASSES and C.timing_disabled(request.config)
    chunk = SMOKE_CHUNK if smoke else CHUNK
    g = torch.Generator().manual_seed(C.SEED)
    x0 = torch.randn(BATCH, DIM, generator=g)
    labels = torch.randint(0, classes, (BATCH,), generator=g)
    fn, weight = member(
        impl, labels, chunk, pf.losses.arcface_init(classes, DIM, generator=g)["weight"]
    )

    def step() -> tuple[torch.Tensor, ...]:
        x = x0.detach().requires_grad_()
        w = weight if weight.is_leaf and weight.requires_grad else weight.detach().requires_grad_()
        loss = fn(x, w)
        return (loss.detach(), *torch.autograd.grad(loss, (x, w)))

    if impl == CCE:  # the same loss as pmlfunc's (this call also compiles it, untimed)
        with C.set_threads(THREADS):
            benchmark.extra_info.update(_check_cce(step, x0, labels, weight))
    # CCE's peak: its body run eagerly (the count cannot see Inductor's buffers)
    eager = functools.partial(torch.compiler.set_stance, "force_eager")
    out, peak = C.measure_tensor_peak(
        benchmark, request, step, THREADS,
        peak_context=eager if impl == CCE else contextlib.nullcontext,
    )  # fmt: skip
    grads = (x0.numel() + weight.numel()) * x0.element_size()
    benchmark.extra_info.update(
        impl=impl, case="classes", batch=BATCH, dim=DIM, classes=classes, threads=THREADS,
        class_chunk_size=chunk if impl.endswith("tiled") else None, loss_value=float(out[0]),
        beyond_grads_mib=round((peak - grads) / MIB, 1),
    )  # fmt: skip
    assert all(torch.isfinite(t).all() for t in out)
    if smoke and impl.endswith("tiled"):  # the tiled member gives its dense twin's numbers
        x, w = x0.detach().requires_grad_(), weight.detach().requires_grad_()
        dense = member(impl.replace("tiled", "dense"), labels, chunk, weight)[0](x, w)
        want = (dense.detach(), *torch.autograd.grad(dense, (x, w)))
        for a, b in zip(out, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _check_cce(step, x0: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> dict:
    """Check the CCE member's value and both gradients (``step()``) against pmlfunc's dense
    ``normalized_softmax`` on the same inputs (float32 rounding: each gradient to 1e-4 of its
    largest entry, which at ``C = 10⁵`` is far below the plain 1e-5); its ``extra_info``."""
    t = LOSSES["normalized_softmax"][2]["temperature"]
    x, w = x0.detach().requires_grad_(), weight.detach().requires_grad_()
    dense = pf.losses.normalized_softmax(x, labels, {"weight": w}, temperature=t)
    want = (dense.detach(), *torch.autograd.grad(dense, (x, w)))
    for a, b in zip(step(), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    cce = peers.cut_cross_entropy()
    return {
        "cce_impl": peers.cce_impl("cpu"),
        "cce_source": cce.source,
        "cce_version": peers.version("cut_cross_entropy"),
        "peak_counted": "eager: the compiled body run without Inductor (force_eager)",
    }
