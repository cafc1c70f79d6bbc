"""Core loss benchmarks: the five losses with speed targets, pmlfunc vs PML 2.9.0 vs the floor.

One pytest-benchmark group per case (``{case}-b{B}``): ``contrastive``, ``all-triplet`` (every
valid triplet from the labels, no miner), ``ntxent``, ``supcon``, ``multi_similarity``, with
the hyper-parameters of ``benchmarks.common``. Three members each:

- ``pml``: ``pytorch_metric_learning.losses.<Loss>Loss`` with the case's settings;
- ``pmlfunc``: ``pf.losses.<loss>`` with the same settings;
- ``floor``: ``(E @ E.T).sum()``, the cost of one B×B matmul forward+backward, the least any
  full-batch pair loss can do.

Each measured call is one forward+backward step on a fresh graph
(``benchmarks.cases.make_step``); every body also checks that pmlfunc and PML agree (rtol 1e-3,
``benchmarks.cases._bodies.loss_vs_pml``). ``python -m benchmarks.ratios`` compares a timed
run of this file with the targets. The untimed run uses batch
``PMLFUNC_BENCH_SMOKE_NTXENT_BATCH`` (128) for ``ntxent`` (``benchmarks.cases.case_batch``).
"""

from __future__ import annotations

import pytest
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

from .. import common as C
from . import by_name, params
from ._bodies import loss_vs_pml, same_settings

CASES = by_name(
    *same_settings(
        [
            (
                "contrastive",
                pf.losses.contrastive,
                pml_losses.ContrastiveLoss,
                {"pos_margin": C.CONTRASTIVE_POS_MARGIN, "neg_margin": C.CONTRASTIVE_NEG_MARGIN},
            ),
            # every valid triplet from the labels (no miner, no indices_tuple)
            (
                "all-triplet",
                pf.losses.triplet_margin,
                pml_losses.TripletMarginLoss,
                {"margin": C.TRIPLET_MARGIN},
            ),
            (
                "ntxent",
                pf.losses.ntxent,
                pml_losses.NTXentLoss,
                {"temperature": C.NTXENT_TEMPERATURE},
            ),
            (
                "supcon",
                pf.losses.supcon,
                pml_losses.SupConLoss,
                {"temperature": C.SUPCON_TEMPERATURE},
            ),
            (
                "multi_similarity",
                pf.losses.multi_similarity,
                pml_losses.MultiSimilarityLoss,
                {"alpha": C.MS_ALPHA, "beta": C.MS_BETA, "base": C.MS_BASE},
            ),
        ],
        pml_pair_matrix={"ntxent"},
    )
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_loss(benchmark, request, case: str, impl: str) -> None:
    loss_vs_pml(benchmark, request, CASES[case], impl)
