"""Benchmark cases: the one :class:`Case` shape every case file uses, and the registry.

A case is one pytest-benchmark group, ``{name}-b{B}``. Its members are the implementations
compared in it (``pml``, ``pmlfunc``, ``floor``, variants such as ``pmlfunc-full``), each a
:class:`Member` whose ``make(emb, labels)`` returns ``(fn, params)``; its ``kind`` says what
``fn(emb, labels)`` returns: ``"loss"`` (a scalar to differentiate with respect to ``emb`` and
``params``), ``"mine"`` (a miner's result; no backward) or ``"value_and_grad"`` (an
anchor-batched call that returns the loss and its gradient itself).

Case files, each collected by pytest (the normal test run calls every body once, untimed):

- ``bench_core_losses``: the five losses with speed targets (contrastive, all-triplet,
  NT-Xent, SupCon, MultiSimilarity);
- ``bench_other_losses``: every other PML 2.9.0 loss that has a pmlfunc twin;
- ``bench_miners``: miners, mined losses, separate vs reused distance matrices;
- ``bench_proxy_losses``: a proxy loss with its weight gradients;
- ``bench_anchor_batched``: full-batch losses beside ``pf.chunked.value_and_grad``;
- ``bench_tiled``: NT-Xent, CLIP and SigLIP dense beside their tiled path (``chunk_size=``);
- ``bench_retrieval``: ``multiple_negatives_ranking`` with 0, 1 and 7 hard negatives, dense
  and tiled, beside the product's floor;
- ``bench_peers``: the peer libraries (open_clip, sentence-transformers, lightly, optax) beside
  the pmlfunc member doing the same loss and the floor, each checked equal before it is timed
  (optional: ``.[bench-peers]``; a member whose package is absent is skipped with the reason);
- ``bench_matryoshka``: ``pf.transforms.matryoshka`` of NT-Xent and CLIP (one blocked product)
  beside the naive sum of one call a width, tiled and dense (its pytest groups at their own
  batch and widths; its registry cases at the runner's);
- ``bench_chunked_ntxent``: chunked vs full NT-Xent at 8,192 rows and more, with memory (its
  own batch sizes, so not in :func:`registry`);
- ``bench_compile_and_cudagraph``: the pmlfunc and floor members of every registry case,
  compiled or replayed from a CUDA graph (opt-in).

:func:`registry` is what ``benchmarks.run``, ``benchmarks.capacity``,
``benchmarks.profile_loss`` and the compiled members read. The rest of this module is what
the case files share: the suite's settings (``PMLFUNC_BENCH_*``, see ``benchmarks/README.md``),
member builders, the measured step and the pytest parameters of a group.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import pmlfunc as pf

from .. import common as C

KINDS = ("loss", "mine", "value_and_grad")

Fn = Callable[[torch.Tensor, torch.Tensor], Any]  # (embeddings, labels) -> loss, mined, ...
Make = Callable[[torch.Tensor, torch.Tensor], tuple[Fn, list[torch.Tensor]]]


class Skip(Exception):
    """Raised by a member's ``make`` when the member cannot run here (its inputs are too large
    for it, say); ``str()`` is the reason. The pytest bodies that expect it skip with it;
    ``benchmarks.run`` records the entry as skipped with it."""


@dataclass(frozen=True)
class Member:
    """One implementation in a case.

    ``make(emb, labels)`` returns ``(fn, params)``: the measured function and the further
    tensors its backward differentiates (a proxy loss's weights). ``mined`` (mined cases): what
    the member's miner selects, for the untimed validity and parity checks. ``check``: one more
    untimed check, given the inputs. ``tracked_memory``: whether the step's memory is torch
    tensors, which the peak-memory and FLOP counters see (``False`` for a member computing in
    another framework, such as optax under jax: its peak memory and FLOPs are not recorded).
    """

    make: Make
    kind: str = "loss"
    mined: Fn | None = None
    check: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    tracked_memory: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Case:
    """One group: ``name`` (the group is ``{name}-b{B}``), its members in measuring order,
    settings recorded in every entry's ``extra_info``, and whether PML 2.9.0 builds a
    (positive pairs) × (negative pairs) float matrix for it (see :func:`case_batch`).
    ``reference``: the member every other non-floor member must equal, loss and every gradient
    (:func:`reference_mismatch`), before it is timed (the peer cases: the pmlfunc member)."""

    name: str
    members: dict[str, Member]
    extra: dict[str, Any] = field(default_factory=dict)
    pml_pair_matrix: bool = False
    reference: str | None = None


def library(impl: str) -> str:
    """``pmlfunc``, ``pml`` or ``floor``: the part of a member name before any variant."""
    return impl.split("-")[0]


def pml_pair_matrix_gib(case: Case, batch: int, spc: int) -> float:
    """Estimated size of the largest matrix PML 2.9.0 builds for ``case``: the positive-pairs ×
    negative-pairs matrix (:func:`pml_matrix_name`), or PNPLoss's ``B × B × B`` ranks."""
    pos, neg = batch * (spc - 1), batch * (batch - spc)
    if case.pml_pair_matrix:
        return pos * neg * 4 / 2**30  # float32 logits
    if case.name == "mined-triplet":
        return pos * neg / 2**30  # a bool comparison of anchors
    if case.name == "pnp":
        return batch**3 * 4 / 2**30  # every anchor's (B, B) pairwise rank differences
    return 0.0


def pml_matrix_name(case: Case) -> str:
    """What :func:`pml_pair_matrix_gib` measures for ``case``, for the skip reasons."""
    return "B x B x B rank matrix" if case.name == "pnp" else "positive x negative pair matrix"


# Timed runs: a PML member whose pair matrix would exceed this many GiB is skipped before it
# runs (at batch 512 with 4 per class: 1.5 GiB, 15-50 s a step on one thread; finding that out
# by running one step took ~2.5 of the suite's 10 minutes). A PML member skipped this way or
# for its step time (benchmarks.common.PML_MAX_STEP_SECONDS) still has pmlfunc's parity checked
# at the smoke batch (SMOKE_PAIR_MATRIX_BATCH).
PML_MAX_PAIR_MATRIX_GIB_VAR = "PMLFUNC_BENCH_PML_MAX_PAIR_MATRIX_GIB"
PML_MAX_PAIR_MATRIX_GIB = 1.0


def pml_over_budget(case: Case, batch: int) -> str | None:
    """Why a timed run skips ``case``'s PML member at ``batch`` before running it (its pair
    matrix is over :data:`PML_MAX_PAIR_MATRIX_GIB`), or ``None``."""
    raw = os.environ.get(PML_MAX_PAIR_MATRIX_GIB_VAR, "").strip()
    budget = float(raw) if raw else PML_MAX_PAIR_MATRIX_GIB
    gib = pml_pair_matrix_gib(case, batch, SAMPLES_PER_CLASS)
    if gib <= budget:
        return None
    return (
        f"PML 2.9.0 would build a {gib:,.1f} GiB {pml_matrix_name(case)} (> {budget:g} "
        f"GiB, {PML_MAX_PAIR_MATRIX_GIB_VAR}; set it higher to time this member)"
    )


def registry() -> dict[str, Case]:
    """Every case ``benchmarks.run`` measures, by name, in the suite's order."""
    from . import (
        bench_anchor_batched,
        bench_core_losses,
        bench_given_triplets,
        bench_matryoshka,
        bench_miners,
        bench_other_losses,
        bench_peers,
        bench_proxy_losses,
        bench_retrieval,
        bench_tiled,
    )

    modules = (
        bench_core_losses,
        bench_other_losses,
        bench_miners,
        bench_proxy_losses,
        bench_anchor_batched,
        bench_tiled,
        bench_peers,
        bench_given_triplets,
        bench_retrieval,
        bench_matryoshka,
    )
    return {name: case for module in modules for name, case in module.CASES.items()}


def by_name(*cases: Case) -> dict[str, Case]:
    return {case.name: case for case in cases}


# --- members ---------------------------------------------------------------------------------


def plain(factory: Callable[[], Fn], **member: Any) -> Member:
    """A member whose function does not depend on the inputs: ``factory()``, no parameters."""
    return Member(lambda e, y: (factory(), []), **member)


def call(fn: Callable[..., Any], **hyper: Any) -> Member:
    """A member calling ``fn(emb, labels, **hyper)``."""
    return plain(lambda: functools.partial(fn, **hyper))


FLOOR = plain(lambda: C.floor_loss)


def anchor_batched(loss_fn: Callable[..., Any], chunk_size: Callable[[], int], **hyper) -> Member:
    """``pf.chunked.value_and_grad(loss_fn, chunk_size=chunk_size())(emb, labels, **hyper)``;
    the chunk size is read when the member is made (``benchmarks.run --anchor-batch-size``)."""

    def make(emb, labels):
        value_and_grad = pf.chunked.value_and_grad(loss_fn, chunk_size=chunk_size())
        return (lambda e, y: value_and_grad(e.detach(), y, **hyper)), []

    return Member(make, kind="value_and_grad")


def make_step(member: Member, emb: torch.Tensor, labels: torch.Tensor) -> Callable[[], Any]:
    """One measured call of ``member`` on fixed inputs.

    A loss: forward and backward on a fresh graph (``torch.autograd.grad`` with respect to the
    leaf ``emb`` and the member's parameters, so nothing accumulates in ``.grad``), returning
    the detached loss. An anchor-batched member: its value-and-gradient call, returning the
    value. A miner: its call, returning what it mined. Losses leave the embedding gradient in
    ``step.last_grad``.
    """
    fn, params = member.make(emb, labels)
    if member.kind == "mine":
        return functools.partial(fn, emb, labels)
    if member.kind == "value_and_grad":

        def step():
            value, grad = fn(emb, labels)
            step.last_grad = grad  # type: ignore[attr-defined]
            return value

        return step
    if not emb.requires_grad or emb.grad_fn is not None:
        raise ValueError("embeddings must be a leaf tensor with requires_grad=True")

    def step():
        loss = fn(emb, labels)
        grads = torch.autograd.grad(loss, [emb, *params])
        step.last_grad = grads[0]  # type: ignore[attr-defined]
        return loss.detach()

    return step


Result = tuple[torch.Tensor, list[torch.Tensor]]  # a loss and its gradients


def result(member: Member, emb: torch.Tensor, labels: torch.Tensor) -> Result:
    """One untimed step of ``member`` (a loss or value-and-gradient member): its loss and the
    gradients of ``emb`` and the member's parameters (a value-and-gradient member: ``emb``'s),
    detached."""
    fn, params = member.make(emb, labels)
    out = fn(emb, labels)
    if member.kind == "value_and_grad":
        loss, grads = out[0], [out[1]]
    elif member.kind == "loss":
        loss, grads = out, list(torch.autograd.grad(out, [emb, *params]))
    else:
        raise ValueError(f"a {member.kind!r} member has no loss to compare")
    return loss.detach(), [g.detach() for g in grads]


def mismatch(reference: Result, got: Result, rtol: float) -> str | None:
    """How ``got`` differs from ``reference`` (``None``: equal within ``rtol``): the losses
    relative to the reference's, each gradient's largest difference relative to the reference
    gradient's largest entry. No absolute slack: a gradient of ``1e-6`` entries is compared at
    its own scale."""
    (ref_loss, ref_grads), (loss, grads) = reference, got
    if len(ref_grads) != len(grads):
        return f"{len(grads)} gradients, the reference has {len(ref_grads)}"
    a, b = float(ref_loss), float(loss)
    if not abs(a - b) <= rtol * abs(a):  # NaN fails too
        return f"loss {b!r}, the reference's {a!r} (rtol {rtol:g})"
    for i, (r, g) in enumerate(zip(ref_grads, grads, strict=True)):
        if r.shape != g.shape:
            return f"gradient {i} has shape {tuple(g.shape)}, the reference's {tuple(r.shape)}"
        err = float((g.double() - r.double()).abs().max())
        scale = float(r.double().abs().max())
        if not err <= rtol * scale:
            return (
                f"gradient {i}: max |difference| {err:.3g} > rtol {rtol:g} x max |reference| "
                f"{scale:.3g}"
            )
    return None


def reference_rtol(dtype: torch.dtype) -> float:
    """The tolerance of :func:`reference_mismatch` for ``dtype``: float32 rounding (float64:
    tighter; the half types: theirs)."""
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 2e-2)


# (the case, its reference's result) per (id of the case, input shape, dtype, device, labels):
# the case is kept so that its id is not reused by another while the entry lives.
_REFERENCE_RESULTS: dict[tuple, tuple[Case, Result]] = {}


def reference_mismatch(
    case: Case, impl: str, emb: torch.Tensor, labels: torch.Tensor, rtol: float
) -> str | None:
    """How ``impl``'s loss and gradients on ``(emb, labels)`` differ from ``case.reference``'s
    (``None``: equal within ``rtol``, or nothing to compare: no reference, the reference itself,
    the floor). The reference's result is computed once per case, inputs' shape, dtype, device
    and labels (the embeddings are seeded)."""
    if case.reference is None or impl in (case.reference, "floor"):
        return None
    key = (id(case), tuple(emb.shape), emb.dtype, str(emb.device), tuple(labels.tolist()))
    if key not in _REFERENCE_RESULTS:
        _REFERENCE_RESULTS[key] = (case, result(case.members[case.reference], emb, labels))
    bad = mismatch(_REFERENCE_RESULTS[key][1], result(case.members[impl], emb, labels), rtol)
    return None if bad is None else f"{impl} differs from {case.reference}: {bad}"


# --- the suite's settings, inputs and groups -------------------------------------------------

BATCH, DIM, SAMPLES_PER_CLASS, THREADS, DTYPE, DEVICE = C.env_settings()
RTOL = C.parity_rtol(DTYPE)
ATOL = 1e-6

# In the normal test run (``pytest``: --benchmark-disable, set by the root conftest.py) every
# body runs once. PML 2.9.0 NT-Xent
# materialises a (positive pairs) x (negative pairs) matrix: at batch 512 with 4 per class
# that is 1,536 x 260,096 entries, ~15-25 s and ~7 GB of RAM per forward+backward on one
# thread. That alone would take half of the ~60 s budget of the whole untimed run, so the
# untimed (smoke) run uses this smaller batch for every case with such a matrix (all its
# members, so its parity check still compares like with like). Timed runs always use
# PMLFUNC_BENCH_BATCH.
SMOKE_PAIR_MATRIX_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_NTXENT_BATCH", 128)


def case_batch(case: Case, disabled: bool) -> int:
    """The batch a body of ``case`` runs at (``disabled``: the untimed run)."""
    if disabled and case.pml_pair_matrix:
        return min(BATCH, SMOKE_PAIR_MATRIX_BATCH)
    return BATCH


def inputs(batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The suite's embeddings (a leaf with ``requires_grad``) and labels at ``batch``."""
    return C.make_inputs(batch, DIM, SAMPLES_PER_CLASS, dtype=DTYPE, device=DEVICE, seed=C.SEED)


def params(cases: Iterable[Case]) -> list:
    """pytest parameters ``(case name, member name)`` of ``cases``, each in its group."""
    return [
        pytest.param(
            case.name,
            impl,
            id=f"{case.name}-{impl}",
            marks=pytest.mark.benchmark(group=f"{case.name}-b{BATCH}"),
        )
        for case in cases
        for impl in case.members
    ]


def record(benchmark, emb: torch.Tensor, case: Case, impl: str, loss=None, **more: Any) -> None:
    """Fill a body's ``extra_info``: the configuration, the loss, the case's settings, ``more``."""
    C.fill_extra_info(
        benchmark.extra_info,
        emb,
        threads=THREADS,
        samples_per_class=SAMPLES_PER_CLASS,
        impl=impl,
        case=case.name,
        loss_value=loss,
    )
    benchmark.extra_info.update(case.extra, **more)
