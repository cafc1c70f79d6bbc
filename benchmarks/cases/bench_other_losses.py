"""The other PML 2.9.0 losses with a pmlfunc twin: pmlfunc vs PML vs the floor, no targets.

One group per loss (``{loss}-b{B}``), PML's defaults unless stated, members and checks as in
``bench_core_losses`` (``pml``, ``pmlfunc``, ``floor``; pmlfunc and PML agree, rtol 1e-3):
lifted-structure, generalized lifted-structure, circle, intra-pair-variance, tuplet-margin,
signal-to-noise-ratio contrastive, margin, FastAP, histogram, PNP, NCA, N-pairs, angular,
instance, ranked-list (``margin=0.4, Tn=10``), threshold-consistent margin, VICReg (two views:
the batch and the same rows rolled by one) and dynamic soft margin (one step from a fresh
state). PML builds a (positive pairs) × (negative pairs) matrix for lifted-structure and
tuplet-margin, so the untimed run uses ``PMLFUNC_BENCH_SMOKE_NTXENT_BATCH`` (128) for them.
"""

from __future__ import annotations

import pytest
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

from . import Fn, by_name, params, plain
from ._bodies import loss_vs_pml, same_settings, twins


def _pml_dynamic_soft_margin() -> Fn:
    """PML's module keeps its histogram's autograd graph (a second backward fails): detach it
    between steps, as a training loop would have to."""
    module = pml_losses.DynamicSoftMarginLoss()

    def loss(e, y):
        module.hist_ = module.hist_.detach()
        return module(e, y)

    return loss


CASES = by_name(
    *same_settings(
        [
            ("lifted_structure", pf.losses.lifted_structure, pml_losses.LiftedStructureLoss, {}),
            (
                "generalized_lifted_structure",
                pf.losses.generalized_lifted_structure,
                pml_losses.GeneralizedLiftedStructureLoss,
                {},
            ),
            ("circle", pf.losses.circle, pml_losses.CircleLoss, {}),
            (
                "intra_pair_variance",
                pf.losses.intra_pair_variance,
                pml_losses.IntraPairVarianceLoss,
                {},
            ),
            ("tuplet_margin", pf.losses.tuplet_margin, pml_losses.TupletMarginLoss, {}),
            (
                "signal_to_noise_ratio_contrastive",
                pf.losses.signal_to_noise_ratio_contrastive,
                pml_losses.SignalToNoiseRatioContrastiveLoss,
                {},
            ),
            ("margin", pf.losses.margin, pml_losses.MarginLoss, {}),
            ("fast_ap", pf.losses.fast_ap, pml_losses.FastAPLoss, {}),
            ("histogram", pf.losses.histogram, pml_losses.HistogramLoss, {}),
            ("pnp", pf.losses.pnp, pml_losses.PNPLoss, {}),
            ("nca", pf.losses.nca, pml_losses.NCALoss, {}),
            ("npairs", pf.losses.npairs, pml_losses.NPairsLoss, {}),
            ("angular", pf.losses.angular, pml_losses.AngularLoss, {}),
            ("instance", pf.losses.instance, pml_losses.InstanceLoss, {}),
            (
                "ranked_list",
                pf.losses.ranked_list,
                pml_losses.RankedListLoss,
                {"margin": 0.4, "Tn": 10.0},
            ),
            (
                "threshold_consistent_margin",
                pf.losses.threshold_consistent_margin,
                pml_losses.ThresholdConsistentMarginLoss,
                {},
            ),
        ],
        pml_pair_matrix={"lifted_structure", "tuplet_margin"},
    ),
    twins(
        "vicreg",
        plain(lambda: lambda e, y: pf.losses.vicreg(e, e.roll(1, 0))),
        lambda: lambda e, y: pml_losses.VICRegLoss()(e, ref_emb=e.roll(1, 0)),
    ),
    twins(
        "dynamic_soft_margin",
        plain(lambda: lambda e, y: pf.losses.dynamic_soft_margin(e, y)[0]),
        _pml_dynamic_soft_margin,
    ),
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_loss(benchmark, request, case: str, impl: str) -> None:
    loss_vs_pml(benchmark, request, CASES[case], impl)
