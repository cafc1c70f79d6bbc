"""Tests for ``pmlfunc.losses.pairs``: ``contrastive``, ``signal_to_noise_ratio_contrastive``,
``intra_pair_variance``, ``threshold_consistent_margin``.

Each loss's class runs its suite (tests/suites/: the loop reference, PML 2.9.0 parity, edge
cases, bad input); the tests below it are this family's own. The properties every loss keeps
(gradcheck, torch.func, compile, meta device, a docstring example) are in test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import F64, UNEVEN, finite, lab, randn
from reference import pairs
from suites.core import CoreLoss, assert_near_duplicate_rows_match_float64
from suites.neighborhood import SPECS, NeighborhoodLoss, data
from suites.structured import StructuredLoss

import pmlfunc.distances as pfd
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    contrastive,
    signal_to_noise_ratio_contrastive,
    threshold_consistent_margin,
)


class TestContrastive(CoreLoss):
    name = "contrastive"
    hyper = "pos_margin"


class TestSignalToNoiseRatioContrastive(StructuredLoss):
    name = "snr_contrastive"


class TestIntraPairVariance(StructuredLoss):
    name = "intra_pair_variance"


class TestThresholdConsistentMargin(NeighborhoodLoss):
    name = "threshold_consistent_margin"


# ----------------------------------------------------------------------------------------------
# contrastive
# ----------------------------------------------------------------------------------------------
def test_contrastive_near_duplicate_rows_float32(gen):
    assert_near_duplicate_rows_match_float64("contrastive", gen, pos_margin=0.0, neg_margin=1.5)


def test_lp_gradient_at_zero_distance_is_zero():
    """Two identical rows, one positive pair: contrastive with pos_margin=0 has loss 0 and grad 0."""
    emb = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], dtype=F64)
    value, (grad,) = finite(
        lambda e: contrastive(e, lab([0, 0]), pos_margin=0.0, neg_margin=1.0), emb
    )
    assert value == 0
    assert (grad == 0).all()


def test_mat_is_used_instead_of_recomputing(gen):
    """A different matrix must change the result: the loss really reads ``mat``."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    d = pfd.lp()
    base = contrastive(emb, labels, mat=d(emb))
    scaled = contrastive(emb, labels, mat=0.5 * d(emb))
    assert not torch.allclose(base, scaled)
    want = pairs.contrastive(
        0.5 * emb / emb.norm(dim=1, keepdim=True), labels, distance=("lp", {"normalize": False})
    )
    torch.testing.assert_close(scaled, want, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# signal_to_noise_ratio_contrastive, threshold_consistent_margin
# ----------------------------------------------------------------------------------------------
def test_snr_contrastive_needs_the_snr_distance():
    with pytest.raises(ValueError, match="distance"):
        signal_to_noise_ratio_contrastive(
            torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2]), distance=pfd.lp()
        )


def test_tcm_other_reducer_acts_on_selected_pair_terms(gen):
    emb, labels = data(gen, UNEVEN)
    hp = SPECS["threshold_consistent_margin"]["hp"]
    total = threshold_consistent_margin(emb, labels, reducer=pfr.sum(), **hp)
    mat = pfd.cosine()(emb)
    same = labels[:, None] == labels[None, :]
    off = ~torch.eye(len(labels), dtype=torch.bool)
    pos = (same & off & (mat <= 0.5)).to(F64)
    neg = (~same & (mat >= 0.1)).to(F64)
    want = 0.7 * (pos * (0.5 - mat)).sum() + (neg * (mat - 0.1)).sum()
    torch.testing.assert_close(total, want, rtol=1e-9, atol=1e-11)


def test_tcm_needs_cosine():
    with pytest.raises(ValueError, match="distance"):
        threshold_consistent_margin(torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2]), distance=pfd.dot())
