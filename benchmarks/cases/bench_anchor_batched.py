"""Proxy loss and anchor-batched losses: pmlfunc vs PML 2.9.0 vs the matmul floor.

Groups (``{case}-b{B}``), as in the reference protocol (``shared/reference/000_*``):

- ``proxy``: normalized-softmax with its weight gradients (``temperature=0.1``, one class per
  ``samples_per_class`` rows): ``pf.losses.normalized_softmax(e, y, params)`` vs PML's
  ``NormalizedSoftmaxLoss`` with the same initial weights (PML's layout transposed); the
  backward takes the gradients of the embeddings and the weights.
- ``anchor-batched-ntxent`` and ``anchor-batched-triplet``: the full-batch loss and backward
  (``pmlfunc-full``, ``pml``) beside ``pf.chunked.value_and_grad(loss, chunk_size)``
  (``pmlfunc-anchor-batched``; the forward does all the work, as in the reference), chunk
  ``PMLFUNC_BENCH_ANCHOR_BATCH`` (256).

The untimed run (``--benchmark-disable``) executes every body once and checks that the losses
agree (rtol 1e-3) and, for the anchor-batched members, that the gradient equals the full one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

from .. import common as C

BATCH, DIM, SAMPLES_PER_CLASS, THREADS, DTYPE, DEVICE = C.env_settings()
ANCHOR_BATCH = C.env_int("PMLFUNC_BENCH_ANCHOR_BATCH", 256)
PROXY_TEMPERATURE = 0.1
RTOL = C.parity_rtol(DTYPE)

Fn = Callable[[torch.Tensor, torch.Tensor], Any]


@dataclass(frozen=True)
class Member:
    """One implementation: ``make(emb, labels)`` returns ``(fn, params)``: ``fn(emb, labels)``
    is the loss (``kind="loss"``) or ``(loss, grad)`` (``kind="value_and_grad"``); ``params``
    are further tensors the backward differentiates (the proxy weights)."""

    make: Callable[[torch.Tensor, torch.Tensor], tuple[Fn, list[torch.Tensor]]]
    kind: str = "loss"


@dataclass(frozen=True)
class Case:
    name: str
    members: dict[str, Member]
    extra: dict[str, Any] = field(default_factory=dict)


def _plain(factory: Callable[[], Fn]) -> Member:
    return Member(lambda e, y: (factory(), []))


FLOOR = _plain(lambda: C.floor_loss)


def _proxy_weights(emb: torch.Tensor, labels: torch.Tensor) -> torch.nn.Module:
    num_classes = int(labels.max()) + 1 if labels.numel() else 1
    torch.manual_seed(C.SEED)  # PML draws its weights from the global generator
    return pml_losses.NormalizedSoftmaxLoss(
        num_classes, emb.shape[1], temperature=PROXY_TEMPERATURE
    ).to(device=emb.device, dtype=emb.dtype)


def _pf_proxy(emb, labels):
    pml = _proxy_weights(emb, labels)
    params = {"weight": pml.W.detach().t().contiguous().requires_grad_()}

    def loss(e, y):
        return pf.losses.normalized_softmax(e, y, params, temperature=PROXY_TEMPERATURE)

    return loss, [params["weight"]]


def _pml_proxy(emb, labels):
    pml = _proxy_weights(emb, labels)
    return (lambda e, y: pml(e, y)), [pml.W]


def _anchor_batched(loss_fn: Callable[..., torch.Tensor], **hyper) -> Member:
    def make(emb, labels):
        vg = pf.chunked.value_and_grad(loss_fn, chunk_size=ANCHOR_BATCH)
        return (lambda e, y: vg(e.detach(), y, **hyper)), []

    return Member(make, kind="value_and_grad")


def _full(loss_fn: Callable[..., torch.Tensor], **hyper) -> Member:
    return _plain(lambda: lambda e, y: loss_fn(e, y, **hyper))


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case(
            "proxy",
            {"pml": Member(_pml_proxy), "pmlfunc": Member(_pf_proxy), "floor": FLOOR},
            extra={"temperature": PROXY_TEMPERATURE},
        ),
        Case(
            "anchor-batched-ntxent",
            {
                "pml": _plain(lambda: pml_losses.NTXentLoss(temperature=C.NTXENT_TEMPERATURE)),
                "pmlfunc-full": _full(pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE),
                "pmlfunc-anchor-batched": _anchor_batched(
                    pf.losses.ntxent, temperature=C.NTXENT_TEMPERATURE
                ),
                "floor": FLOOR,
            },
            extra={"anchor_batch_size": ANCHOR_BATCH},
        ),
        Case(
            "anchor-batched-triplet",
            {
                "pml": _plain(lambda: pml_losses.TripletMarginLoss(margin=C.TRIPLET_MARGIN)),
                "pmlfunc-full": _full(pf.losses.triplet_margin, margin=C.TRIPLET_MARGIN),
                "pmlfunc-anchor-batched": _anchor_batched(
                    pf.losses.triplet_margin, margin=C.TRIPLET_MARGIN
                ),
                "floor": FLOOR,
            },
            extra={"anchor_batch_size": ANCHOR_BATCH},
        ),
    )
}

# PML's NT-Xent compares every positive pair with every negative pair: in the untimed run the
# anchor-batched-ntxent group uses a batch where that stays small (as bench_core's ntxent).
SMOKE_NTXENT_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_NTXENT_BATCH", 128)


def make_step(member: Member, emb: torch.Tensor, labels: torch.Tensor) -> Callable[[], Any]:
    """One measured call: forward and backward on a fresh graph (gradients returned, never
    accumulated), or the value-and-gradient call of an anchor-batched member."""
    fn, params = member.make(emb, labels)
    if member.kind == "value_and_grad":

        def step():
            value, grad = fn(emb, labels)
            step.last_grad = grad  # type: ignore[attr-defined]
            return value

        return step

    def step():
        loss = fn(emb, labels)
        grads = torch.autograd.grad(loss, [emb, *params])
        step.last_grad = grads[0]  # type: ignore[attr-defined]
        return loss.detach()

    return step


def _params() -> list:
    return [
        pytest.param(
            case.name,
            impl,
            id=f"{case.name}-{impl}",
            marks=pytest.mark.benchmark(group=f"{case.name}-b{BATCH}"),
        )
        for case in CASES.values()
        for impl in case.members
    ]


_RESULTS: dict[tuple[str, str], tuple[float, torch.Tensor]] = {}


@pytest.mark.parametrize(("case", "impl"), _params())
def bench_extra(benchmark, request, case: str, impl: str) -> None:
    spec = CASES[case]
    batch = BATCH
    if benchmark.disabled and case == "anchor-batched-ntxent":
        batch = min(BATCH, SMOKE_NTXENT_BATCH)
    emb, labels = C.make_inputs(
        batch, DIM, SAMPLES_PER_CLASS, dtype=DTYPE, device=DEVICE, seed=C.SEED
    )
    step = make_step(spec.members[impl], emb, labels)
    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        out = C.measure(benchmark, request, step, DEVICE)
        C.fill_extra_info(
            benchmark.extra_info,
            emb,
            threads=THREADS,
            samples_per_class=SAMPLES_PER_CLASS,
            impl=impl,
            case=case,
            loss_value=out,
        )
        benchmark.extra_info.update(spec.extra)
    grad = step.last_grad  # type: ignore[attr-defined]
    assert out.ndim == 0 and torch.isfinite(out), f"{case}/{impl}: loss {out}"
    assert torch.isfinite(grad).all() and grad.shape == emb.shape, f"{case}/{impl}: gradient"
    if impl == "floor":
        return
    _RESULTS[(case, impl)] = (float(out), grad.detach())
    others = [(k, v) for k, v in _RESULTS.items() if k[0] == case and k[1] != impl]
    for (_, other), (value, other_grad) in others:
        assert math.isclose(float(out), value, rel_tol=RTOL, abs_tol=1e-6), (
            f"{case}: {impl}={float(out)!r} vs {other}={value!r}"
        )
        if {impl, other} == {"pmlfunc-full", "pmlfunc-anchor-batched"}:
            torch.testing.assert_close(grad, other_grad, rtol=1e-4, atol=1e-6)
