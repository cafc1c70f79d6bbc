"""Core loss benchmarks: pmlfunc vs pytorch-metric-learning 2.9.0 vs a matmul floor.

One pytest-benchmark group per case (``{case}-b{B}``), three implementations each:

- ``pmlfunc``: ``pf.losses.<loss>`` with the case's hyper-parameters;
- ``pml``: ``pytorch_metric_learning.losses.<Loss>Loss`` with the same settings;
- ``floor``: ``(E @ E.T).sum()``, the cost of one B×B matmul forward+backward, the
  least any full-batch pair loss can do.

Each measured call is one forward+backward step on a fresh graph (see
``benchmarks.common.make_step``). Every body also asserts a finite loss and gradient
and, for pmlfunc vs PML, that the two losses agree (rtol 1e-3), so the plain test run
(``--benchmark-disable``, one call per body) doubles as a regression check.

Configuration (environment variables):

- ``PMLFUNC_BENCH_BATCH`` (512), ``PMLFUNC_BENCH_DIM`` (128),
  ``PMLFUNC_BENCH_SAMPLES_PER_CLASS`` (4), ``PMLFUNC_BENCH_THREADS`` (1),
  ``PMLFUNC_BENCH_DTYPE`` (float32), ``PMLFUNC_BENCH_DEVICE`` (cpu);
- ``PMLFUNC_BENCH_SMOKE_NTXENT_BATCH`` (128): batch of the ntxent group when timing is
  disabled, see ``SMOKE_NTXENT_BATCH`` below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

from .. import common as C

BATCH, DIM, SAMPLES_PER_CLASS, THREADS, DTYPE, DEVICE = C.env_settings()

# With --benchmark-disable (the normal test run) every body runs once. PML 2.9.0 NT-Xent
# materialises a (positive pairs) x (negative pairs) matrix: at batch 512 with 4 per class
# that is 1,536 x 260,096 entries, ~15-25 s and ~7 GB of RAM per forward+backward on one
# thread. That alone would take half of the ~60 s budget of the whole untimed run, so the
# untimed (smoke) run uses this smaller batch for the ntxent group (all three
# implementations, so its parity check still compares like with like). Timed runs always
# use PMLFUNC_BENCH_BATCH.
SMOKE_NTXENT_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_NTXENT_BATCH", 128)

RTOL = C.parity_rtol(DTYPE)
ATOL = 1e-6

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    name: str
    pmlfunc: Callable[[], Loss]
    pml: Callable[[], Loss]


def _pml_dynamic_soft_margin() -> Loss:
    """PML's module keeps its histogram's autograd graph (a second backward fails): detach it
    between steps, as a training loop would have to."""
    module = pml_losses.DynamicSoftMarginLoss()

    def loss(e, y):
        module.hist_ = module.hist_.detach()
        return module(e, y)

    return loss


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case(
            "contrastive",
            lambda: (
                lambda e, y: pf.losses.contrastive(
                    e, y, pos_margin=C.CONTRASTIVE_POS_MARGIN, neg_margin=C.CONTRASTIVE_NEG_MARGIN
                )
            ),
            lambda: pml_losses.ContrastiveLoss(
                pos_margin=C.CONTRASTIVE_POS_MARGIN, neg_margin=C.CONTRASTIVE_NEG_MARGIN
            ),
        ),
        # All triplets from the labels (no miner, no indices_tuple).
        Case(
            "all-triplet",
            lambda: lambda e, y: pf.losses.triplet_margin(e, y, margin=C.TRIPLET_MARGIN),
            lambda: pml_losses.TripletMarginLoss(margin=C.TRIPLET_MARGIN),
        ),
        Case(
            "ntxent",
            lambda: lambda e, y: pf.losses.ntxent(e, y, temperature=C.NTXENT_TEMPERATURE),
            lambda: pml_losses.NTXentLoss(temperature=C.NTXENT_TEMPERATURE),
        ),
        Case(
            "supcon",
            lambda: lambda e, y: pf.losses.supcon(e, y, temperature=C.SUPCON_TEMPERATURE),
            lambda: pml_losses.SupConLoss(temperature=C.SUPCON_TEMPERATURE),
        ),
        Case(
            "multi_similarity",
            lambda: (
                lambda e, y: pf.losses.multi_similarity(
                    e, y, alpha=C.MS_ALPHA, beta=C.MS_BETA, base=C.MS_BASE
                )
            ),
            lambda: pml_losses.MultiSimilarityLoss(
                alpha=C.MS_ALPHA, beta=C.MS_BETA, base=C.MS_BASE
            ),
        ),
        # Issue 4's losses, PML defaults unless stated.
        *(
            Case(name, (lambda n=name, h=hyper: lambda e, y: getattr(pf.losses, n)(e, y, **h)), pml)
            for name, hyper, pml in (
                ("lifted_structure", {}, lambda: pml_losses.LiftedStructureLoss()),
                (
                    "generalized_lifted_structure",
                    {},
                    lambda: pml_losses.GeneralizedLiftedStructureLoss(),
                ),
                ("circle", {}, lambda: pml_losses.CircleLoss()),
                ("intra_pair_variance", {}, lambda: pml_losses.IntraPairVarianceLoss()),
                ("tuplet_margin", {}, lambda: pml_losses.TupletMarginLoss()),
                (
                    "signal_to_noise_ratio_contrastive",
                    {},
                    lambda: pml_losses.SignalToNoiseRatioContrastiveLoss(),
                ),
                ("margin", {}, lambda: pml_losses.MarginLoss()),
                ("fast_ap", {}, lambda: pml_losses.FastAPLoss()),
                ("histogram", {}, lambda: pml_losses.HistogramLoss()),
                ("pnp", {}, lambda: pml_losses.PNPLoss()),
                ("nca", {}, lambda: pml_losses.NCALoss()),
                ("npairs", {}, lambda: pml_losses.NPairsLoss()),
                ("angular", {}, lambda: pml_losses.AngularLoss()),
                ("instance", {}, lambda: pml_losses.InstanceLoss()),
                (
                    "ranked_list",
                    {"margin": 0.4, "Tn": 10.0},
                    lambda: pml_losses.RankedListLoss(margin=0.4, Tn=10.0),
                ),
                (
                    "threshold_consistent_margin",
                    {},
                    lambda: pml_losses.ThresholdConsistentMarginLoss(),
                ),
            )
        ),
        Case(  # two views: the batch and the same rows rolled by one
            "vicreg",
            lambda: lambda e, y: pf.losses.vicreg(e, e.roll(1, 0)),
            lambda: lambda e, y: pml_losses.VICRegLoss()(e, ref_emb=e.roll(1, 0)),
        ),
        Case(  # its state is explicit: the benchmark measures one step from a fresh state
            "dynamic_soft_margin",
            lambda: lambda e, y: pf.losses.dynamic_soft_margin(e, y)[0],
            lambda: _pml_dynamic_soft_margin(),
        ),
    )
}
# PML builds a (positive pairs) x (negative pairs) matrix for these: the untimed run uses
# SMOKE_NTXENT_BATCH for them (timed runs always use PMLFUNC_BENCH_BATCH).
PML_PAIR_MATRIX_CASES = frozenset({"ntxent", "lifted_structure", "tuplet_margin"})
IMPLS = ("pml", "pmlfunc", "floor")  # pml first: its timed step also serves as the reference


def make_loss(case: str, impl: str) -> Loss:
    if impl == "floor":
        return C.floor_loss
    return getattr(CASES[case], impl)()


def case_batch(case: str, disabled: bool) -> int:
    if disabled and case in PML_PAIR_MATRIX_CASES:
        return min(BATCH, SMOKE_NTXENT_BATCH)
    return BATCH


# Loss values per (case, impl, batch), shared between bodies so that each parity check
# reuses a value another body already computed instead of running PML again.
_LOSS_CACHE: dict[tuple[str, str, int], float] = {}


def loss_value(case: str, impl: str, batch: int) -> float:
    key = (case, impl, batch)
    if key not in _LOSS_CACHE:
        emb, labels = C.make_inputs(
            batch, DIM, SAMPLES_PER_CLASS, dtype=DTYPE, device=DEVICE, seed=C.SEED
        )
        with torch.no_grad():
            _LOSS_CACHE[key] = float(make_loss(case, impl)(emb, labels))
    return _LOSS_CACHE[key]


def _params() -> list:
    return [
        pytest.param(
            case,
            impl,
            id=f"{case}-{impl}",
            marks=pytest.mark.benchmark(group=f"{case}-b{BATCH}"),
        )
        for case in CASES
        for impl in IMPLS
    ]


@pytest.mark.parametrize(("case", "impl"), _params())
def bench_loss(benchmark, request, case: str, impl: str) -> None:
    batch = case_batch(case, benchmark.disabled)
    emb, labels = C.make_inputs(
        batch, DIM, SAMPLES_PER_CLASS, dtype=DTYPE, device=DEVICE, seed=C.SEED
    )
    base_step = C.make_step(make_loss(case, impl), emb, labels)
    step = base_step
    if DEVICE.type == "cuda":

        def step() -> torch.Tensor:
            out = base_step()
            torch.cuda.synchronize(DEVICE)
            return out

    with C.set_threads(THREADS):
        C.reset_peak_memory(DEVICE)
        loss = C.measure(benchmark, request, step, DEVICE)
        grad = base_step.last_grad  # type: ignore[attr-defined]
        C.fill_extra_info(
            benchmark.extra_info,
            emb,
            threads=THREADS,
            samples_per_class=SAMPLES_PER_CLASS,
            impl=impl,
            case=case,
            loss_value=loss,
        )

        assert loss.ndim == 0, f"{case}/{impl}: loss is not a scalar: shape {tuple(loss.shape)}"
        assert torch.isfinite(loss), f"{case}/{impl}: non-finite loss {loss}"
        assert torch.isfinite(grad).all(), f"{case}/{impl}: non-finite gradient"
        assert grad.shape == emb.shape

        value = float(loss)
        _LOSS_CACHE[(case, impl, batch)] = value
        if impl in ("pmlfunc", "pml"):
            other = "pml" if impl == "pmlfunc" else "pmlfunc"
            ref = loss_value(case, other, batch)
            assert math.isclose(value, ref, rel_tol=RTOL, abs_tol=ATOL), (
                f"{case} at batch {batch}: pmlfunc and PML disagree: {impl}={value!r}, "
                f"{other}={ref!r} (rtol={RTOL})"
            )
