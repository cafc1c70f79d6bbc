"""Tests for ``pmlfunc.losses.pair_weighting``: ``multi_similarity``, ``lifted_structure``,
``generalized_lifted_structure``, ``circle``, ``tuplet_margin``.

Each loss's class runs its suite (tests/suites/: the loop reference, PML 2.9.0 parity, edge
cases, bad input); the tests below it are this family's own: its deviations from PML (see
tests/suites/structured.py), circle's detached weights, chunking and memory. The properties every
loss keeps are in test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import F32, F64, REF_LABELS, UNEVEN, assert_same, finite, lab, randn, value_and_grads
from pytorch_metric_learning import distances as pml_d
from pytorch_metric_learning import losses as pml_l
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from reference import pair_weighting
from suites.core import CoreLoss
from suites.structured import (
    HP,
    PF,
    REF_TOL,
    TOL,
    StructuredLoss,
    assert_no_pair_by_pair_or_triplet_buffers,
    run,
    run_pml,
)

import pmlfunc as pf
import pmlfunc.distances as pfd
from pmlfunc.losses import circle, lifted_structure, tuplet_margin


class TestMultiSimilarity(CoreLoss):
    name = "multi_similarity"
    hyper = "alpha"


class TestLiftedStructure(StructuredLoss):
    name = "lifted_structure"
    # deviation (a): with a reference set, see test_lifted_structure_ref_set_deviation
    test_pml_parity_indices_tuple_with_ref_set = None


class TestGeneralizedLiftedStructure(StructuredLoss):
    name = "generalized_lifted_structure"


class TestCircle(StructuredLoss):
    name = "circle"


class TestTupletMargin(StructuredLoss):
    name = "tuplet_margin"


# ----------------------------------------------------------------------------------------------
# lifted_structure
# ----------------------------------------------------------------------------------------------
def test_lifted_structure_ref_set_deviation(gen):
    """Deviation (a): self mode equals PML; with a reference set pmlfunc follows the reference
    (column negatives) and PML's index mix gives a different number."""
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 6), randn(gen, len(ref_labels), 6)
    kw = {"ref": ref, "ref_labels": ref_labels, **HP["lifted_structure"]}
    got = run("pf", "lifted_structure", emb, labels, **kw)
    assert_same(got, run("ref", "lifted_structure", emb, labels, **kw), **REF_TOL)
    pml = run_pml("lifted_structure", emb, labels, **kw)
    assert not torch.allclose(got[0], pml[0])
    # the same rows as a separate set with ref_labels = labels: column p of a symmetric mask is
    # row p, so pmlfunc equals PML's self mode on the pairs other than the diagonal
    it = lmu.get_all_pairs_indices(labels)  # no (i, i) pairs
    sep = lifted_structure(emb, labels, ref_emb=emb, ref_labels=labels, indices_tuple=it)
    torch.testing.assert_close(sep, pml_l.LiftedStructureLoss()(emb, labels), **REF_TOL)


def test_lifted_structure_self_pair_counts_row_once(gen):
    """A listed positive pair (a, a) sees row a's negatives once (PML's ``a2 == a | a2 == p``).
    Cosine similarity: the Lp gradient at d_aa = 0 is NaN in PML and the loop reference."""
    labels = lab([0, 0, 1, 1, 2])
    emb = randn(gen, 5, 4)
    it = (lab([0, 0, 2, 3]), lab([0, 1, 2, 2]), lab([0, 0, 1, 2, 3, 4]), lab([2, 4, 3, 0, 4, 1]))
    kw = {"indices_tuple": it, "neg_margin": 0.0, "pos_margin": 1.0}  # every hinge active
    got = run("pf", "lifted_structure", emb, labels, distance=pfd.cosine(), **kw)
    want = run("ref", "lifted_structure", emb, labels, distance=("cosine", {}), **kw)
    assert_same(got, want, **REF_TOL)
    want = run_pml("lifted_structure", emb, labels, distance=pml_d.CosineSimilarity(), **kw)
    assert_same(got, want, **TOL[F64])


# ----------------------------------------------------------------------------------------------
# circle, tuplet_margin
# ----------------------------------------------------------------------------------------------
def test_circle_gradient_holds_weights_constant(gen):
    """Circle detaches α_p, α_n (PML, paper code), so plain gradcheck does not apply: the
    gradient must equal the gradient of the loss with those weights frozen, which gradcheck
    verifies on a loop version with the weights passed as constants."""
    labels = lab([0, 0, 1, 1, 1, 2, 3, 3])
    emb = randn(gen, 8, 5)
    hp = HP["circle"]

    def frozen(e):
        return pair_weighting.circle_with_frozen_weights(e, labels, emb, **hp)

    assert torch.autograd.gradcheck(frozen, (emb.clone().requires_grad_(True),))
    got = value_and_grads(lambda e: circle(e, labels, **hp), emb)
    want = value_and_grads(frozen, emb)
    assert_same(got, want, **REF_TOL)


def test_tuplet_margin_cosine_of_one_is_not_nan():
    """Deviation (b): PML gives NaN gradients for parallel rows; pmlfunc a finite value
    equal to PML's and a finite gradient."""
    emb = torch.tensor([[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.2, 1.0, 0.5]], dtype=F32)
    labels = lab([0, 0, 1])
    value, _ = finite(lambda e: tuplet_margin(e, labels), emb)
    pml_value, (pml_grad,) = value_and_grads(lambda e: pml_l.TupletMarginLoss()(e, labels), emb)
    assert torch.isfinite(pml_value) and not torch.isfinite(pml_grad).all()
    torch.testing.assert_close(value, pml_value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("beta", [0.1, torch.tensor(0.3, dtype=F64)])
def test_tuplet_margin_shifted_cosine_is_the_angle_form(beta):
    """cos(arccos(s) − β) by the sine of the angle: the same values and derivatives as the
    angle form on (−1, 1), ±cos β with a zero gradient at and beyond ±1 (rounding past ±1
    happens for duplicate rows)."""
    from pmlfunc.losses.pair_weighting import _cos_minus

    s = torch.tensor([-1.2, -1.0, -0.999999, -0.5, 0.0, 0.3, 0.999, 1.0, 1.0 + 1e-7], dtype=F64)
    s.requires_grad_(True)
    got = _cos_minus(s, beta)
    (grad,) = torch.autograd.grad(got.sum(), s)
    b = torch.as_tensor(beta, dtype=F64)
    inside = s.detach().abs() < 1
    x = s.detach()[inside].clone().requires_grad_(True)
    want = torch.cos(torch.acos(x) - b)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(got[inside].detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad[inside], want_grad, rtol=1e-6, atol=1e-9)
    edge = torch.cos(torch.acos(s.detach()[~inside].clamp(-1, 1)) - b)
    torch.testing.assert_close(got[~inside].detach(), edge, rtol=1e-12, atol=1e-12)
    assert torch.equal(grad[~inside], torch.zeros_like(grad[~inside]))


@pytest.mark.parametrize(
    ("name", "wrong"),
    [("circle", pfd.lp()), ("circle", pfd.dot()), ("tuplet_margin", pfd.lp())],
)
def test_wrong_distance_raises(name, wrong):
    with pytest.raises(ValueError, match="distance"):
        PF[name](torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2]), distance=wrong)


def test_positive_hyperparameters():
    e, y = torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="gamma"):
        circle(e, y, gamma=0.0)
    with pytest.raises(ValueError, match="scale"):
        tuplet_margin(e, y, scale=-1.0)


# ----------------------------------------------------------------------------------------------
# chunking and memory
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["generalized_lifted_structure", "circle", "tuplet_margin"])
def test_chunked_value_and_grad(name, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    loss, g = pf.chunked.value_and_grad(PF[name], chunk_size=3)(emb, labels, **HP[name])
    want = value_and_grads(lambda e: PF[name](e, labels, **HP[name]), emb)
    assert_same((loss, [g]), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "ref"),
    [("lifted_structure", False), ("lifted_structure", True), ("tuplet_margin", False)],
)
def test_no_pair_by_pair_or_triplet_buffers(name, ref, gen):
    assert_no_pair_by_pair_or_triplet_buffers(name, gen, ref=ref)


@pytest.mark.compile
@pytest.mark.parametrize("loss", [lifted_structure, tuplet_margin])
def test_compiled_listing_of_label_positives_equals_eager_across_sizes_and_reference_sets(loss):
    """Compiled, these losses list each anchor's positives from the labels with a run-time
    width (``pmlfunc::label_rows``): batches of three sizes (the graph turns dynamic in the
    rows), with and without a reference set holding labels the queries lack, give eager's
    value and gradient."""
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    for rows, refs in ((24, 30), (16, 40), (20, 50)):
        emb = torch.randn(rows, 8, generator=gen, dtype=F64)
        ref = torch.randn(refs, 8, generator=gen, dtype=F64)
        labels = torch.randint(0, 5, (rows,), generator=gen)
        ref_labels = torch.randint(0, 7, (refs,), generator=gen)
        for kwargs in ({}, {"ref_emb": ref, "ref_labels": ref_labels}):
            want = value_and_grads(lambda e, y=labels, kw=kwargs: loss(e, y, **kw), emb)
            got = value_and_grads(lambda e, y=labels, kw=kwargs: compiled(e, y, **kw), emb)
            assert_same(got, want, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()
