"""Tests for ``pmlfunc.losses.triplets``: ``triplet_margin``, ``margin``,
``selectively_contrastive_triplet``.

Each loss's class runs its suite (tests/suites/: the loop reference, PML 2.9.0 parity, edge
cases, bad input); the tests below it are this family's own: triplet_margin's options and
deviations (see tests/suites/core.py), margin's learnable beta and triplet windows, the
selectively contrastive triplet's two branches. The properties every loss keeps are in
test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    F32,
    F64,
    REF_LABELS,
    UNEVEN,
    assert_same,
    assert_vmap_equals_a_loop,
    lab,
    randn,
    value_and_grads,
)
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from reference import triplets
from suites import core, structured
from suites.core import CoreLoss, assert_near_duplicate_rows_match_float64
from suites.pml3 import Pml3Loss, clustered
from suites.structured import StructuredLoss, assert_no_pair_by_pair_or_triplet_buffers
from tracking import LargestTensor

import pmlfunc as pf
import pmlfunc.reducers as pfr
from pmlfunc.losses import margin, margin_init, selectively_contrastive_triplet, triplet_margin


class TestTripletMargin(CoreLoss):
    name = "triplet_margin"
    hyper = "margin"
    # deviation (b) is about pair losses: one positive and one negative pair make one triplet
    # here, whose hinge may well be 0 (PML's index tuples: test_pml_parity_indices_tuple)
    test_degenerate_pairs_compute_actual_loss = None


class TestMargin(StructuredLoss):
    name = "margin"


class TestSelectivelyContrastiveTriplet(Pml3Loss):
    name = "selectively_contrastive_triplet"


class TestSelectivelyContrastiveTripletWithCutoff(Pml3Loss):
    name = "sct_cutoff"


# ----------------------------------------------------------------------------------------------
# triplet_margin
# ----------------------------------------------------------------------------------------------
def test_triplet_default_margin_is_0_2_not_pml_0_05(gen):
    """Deviation (a): pmlfunc's default margin is 0.2 (PML 3), PML 2.9.0's is 0.05."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    got = triplet_margin(emb, labels)
    torch.testing.assert_close(got, triplet_margin(emb, labels, margin=0.2), rtol=0, atol=0)
    pml_default = pml_losses.TripletMarginLoss()(emb, labels)
    torch.testing.assert_close(pml_default, pml_losses.TripletMarginLoss(margin=0.05)(emb, labels))
    assert not torch.allclose(got, pml_default)


@pytest.mark.parametrize("smooth_loss", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dist", ["lp", "cosine", "snr"])
def test_triplet_swap_smooth_matches_reference(dist, swap, smooth_loss, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    pf_dist, _, ref_dist = core.DISTANCES[dist]
    kw = {"margin": 0.3, "swap": swap, "smooth_loss": smooth_loss}
    got = core.run_pf("triplet_margin", emb, labels, distance=pf_dist(), **kw)
    want = core.run_ref("triplet_margin", emb, labels, distance=ref_dist, **kw)
    assert_same(got, want, **core.REF_TOL)


@pytest.mark.parametrize("dist", ["lp", "cosine"])
def test_triplet_swap_with_ref_set_uses_ref_ref_distance(dist, gen):
    """Deviation (c): with ref_emb, the p-n distance is distance(ref_emb, ref_emb)[p, n]."""
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 6), randn(gen, len(ref_labels), 6)
    pf_dist, _, ref_dist = core.DISTANCES[dist]
    kw = {"ref": ref, "ref_labels": ref_labels, "margin": 0.5}
    got = core.run_pf("triplet_margin", emb, labels, distance=pf_dist(), swap=True, **kw)
    want = core.run_ref("triplet_margin", emb, labels, distance=ref_dist, swap=True, **kw)
    assert_same(got, want, **core.REF_TOL)
    no_swap = core.run_ref("triplet_margin", emb, labels, distance=ref_dist, **kw)
    assert not torch.allclose(want[0], no_swap[0]), "swap must matter for this data"


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("smooth_loss", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dist", ["lp", "cosine"])
def test_pml_parity_triplet_options(dist, swap, smooth_loss, dtype, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8, dtype=dtype)
    pf_dist, pml_dist, _ = core.DISTANCES[dist]
    kw = {"margin": 0.3, "swap": swap, "smooth_loss": smooth_loss}
    got = core.run_pf("triplet_margin", emb, labels, distance=pf_dist(), **kw)
    want = core.run_pml("triplet_margin", emb, labels, distance=pml_dist(), **kw)
    assert_same(got, want, **core.TOL[dtype])


def test_triplet_near_duplicate_rows_float32(gen):
    assert_near_duplicate_rows_match_float64("triplet_margin", gen, margin=0.1)


@pytest.mark.compile
def test_compile_fullgraph_triplet_swap_self_mode(gen):
    """Self mode with swap=True (p-n distances from the same batch) also compiles in one graph."""
    torch._dynamo.reset()
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6, dtype=F32)

    def f(e):
        return triplet_margin(e, labels, margin=0.5, swap=True)

    got = value_and_grads(torch.compile(f, fullgraph=True), emb)
    want = value_and_grads(f, emb)
    assert_same(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_triplet_loss_on_a_short_triplet_list_never_builds_the_matrix():
    """Batch-hard gives B triplets: the loss reads their 2B distances, not the B × B matrix
    (and gives the same value and gradient as the matrix path, i.e. as PML)."""
    b, d = 64, 8
    emb = torch.randn(b, d, dtype=F64, requires_grad=True)
    labels = torch.arange(b) // 4
    mined = pf.miners.batch_hard(emb, labels)
    with LargestTensor() as rec:
        loss = triplet_margin(emb, labels, indices_tuple=mined)
        (g,) = torch.autograd.grad(loss, emb)
    assert rec.largest < b * b  # only (L,) and (L, D) tensors
    want = pml_losses.TripletMarginLoss(margin=0.2)(emb, labels, mined.to_indices())
    (g_want,) = torch.autograd.grad(want, emb)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(g, g_want)


# ----------------------------------------------------------------------------------------------
# margin
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nu", [0.0, 0.1])
@pytest.mark.parametrize("num_classes", [None, 5])
def test_margin_learnable_beta_matches_pml(num_classes, nu, gen):
    """params from margin_init = PML's learn_beta=True (and num_classes): value, gradients of
    the embeddings and of beta."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8)
    params = margin_init(1.25, num_classes, dtype=F64)
    params["beta"] = params["beta"] + 0.05 * torch.arange(params["beta"].shape[0], dtype=F64)
    for red in ("divisor", "mean"):
        pf_red, pml_red = structured.reducers()[red]
        got = value_and_grads(
            lambda e, b, r=pf_red: margin(e, labels, {"beta": b}, nu=nu, margin=0.25, reducer=r),
            emb,
            params["beta"],
        )
        pml = pml_losses.MarginLoss(
            margin=0.25, nu=nu, learn_beta=True, num_classes=num_classes, reducer=pml_red
        ).double()
        pml.beta.data = params["beta"].clone()
        e = emb.clone().requires_grad_(True)
        out = pml(e, labels).reshape(())
        want = (out.detach(), list(torch.autograd.grad(out, [e, pml.beta])))
        assert_same(got, want, **structured.TOL[F64])
        ref = value_and_grads(
            lambda e, b, r=red: triplets.margin(
                e, labels, {"beta": b}, nu=nu, margin=0.25, reducer=(r, {})
            ),
            emb,
            params["beta"],
        )
        assert_same(got, ref, **structured.REF_TOL)
        assert got[1][1].abs().sum() > 0


@pytest.mark.parametrize("kind", [None, "pml_triplets", "pf_window"])
def test_chunked_margin(kind, gen):
    """margin splits over anchors with a chunkable reducer (not the default divisor())."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    it = None if kind is None else structured.pml_tuple(kind, emb, labels)
    kw = {"reducer": pfr.mean(), "indices_tuple": it, **structured.HP["margin"]}
    loss, g = pf.chunked.value_and_grad(margin, chunk_size=4)(emb, labels, **kw)
    want = value_and_grads(lambda e: margin(e, labels, **kw), emb)
    assert_same((loss, [g]), want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="divisor"):
        pf.chunked.value_and_grad(margin, chunk_size=4)(emb, labels)
    with pytest.raises(ValueError, match="beta"):
        pf.chunked.value_and_grad(margin, chunk_size=4)(
            emb, labels, margin_init(), reducer=pfr.mean()
        )


def test_margin_window_reducers_with_triplet_window(gen):
    """A TripletWindow supports the window-free reducers; value windows raise clearly."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8)
    window = pf.miners.triplet_margin(emb, labels, margin=0.4)
    hp = structured.HP["margin"]
    for red in ("mean", "sum", "class_weighted"):
        pf_red, pml_red = structured.reducers()[red]
        got = structured.run(
            "pf", "margin", emb, labels, reducer=pf_red, indices_tuple=window, **hp
        )
        want = structured.run_pml(
            "margin", emb, labels, reducer=pml_red, indices_tuple=window.to_indices(), **hp
        )
        assert_same(got, want, **structured.TOL[F64])
    with pytest.raises(ValueError, match="TripletWindow"):
        margin(emb, labels, indices_tuple=window, reducer=pfr.avg_nonzero())


def test_margin_bad_params_and_options():
    e, y = torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2])
    with pytest.raises(TypeError, match="params"):
        margin(e, y, [1.2])
    with pytest.raises(ValueError, match="beta"):
        margin(e, y, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="beta"):
        margin(e, y, {"beta": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="labels"):
        margin(e, y, margin_init(num_classes=2))  # label 2 out of range
    with pytest.raises(ValueError, match="triplets_per_anchor"):
        margin(e, y, triplets_per_anchor=10)
    with pytest.raises(ValueError, match="num_classes"):
        margin_init(num_classes=0)
    with pytest.raises(ValueError, match="labels"):
        margin(e, None, margin_init(num_classes=3), indices_tuple=lmu.get_all_pairs_indices(y))


@pytest.mark.parametrize("reducer", [pfr.avg_nonzero(), pfr.threshold(0.1, 0.5)], ids=repr)
def test_margin_builds_no_triplet_buffers(reducer, gen):
    assert_no_pair_by_pair_or_triplet_buffers("margin", gen, reducer=reducer)


# ----------------------------------------------------------------------------------------------
# selectively_contrastive_triplet
# ----------------------------------------------------------------------------------------------
def test_sct_cases_and_authors_form(gen):
    # Both branches occur, and the default reducer is (L_easy + λ L_hard) / (N_easy + N_hard)
    # computed from the authors' formulation (easy positive, hard negative, log-softmax / 0.1).
    labels = lab(UNEVEN)
    emb = clustered(gen, labels, 3)
    e = F.normalize(emb, dim=1)
    s = e @ e.t()
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(UNEVEN), dtype=torch.bool)
    s_pos = s.masked_fill(~same | eye, -2).max(1)
    s_neg = s.masked_fill(same, -2).max(1)
    valid = (s_pos.values > -2) & (s_neg.values > -2)
    pos, neg = s_pos.values, s_neg.values
    hard = (neg > pos) & valid
    easy = (neg <= pos) & valid
    assert hard.any() and easy.any()
    trip = torch.stack([pos, neg], 1)
    easy_loss = -F.log_softmax(trip[easy] / 0.1, dim=1)[:, 0].sum()
    want = (easy_loss + 0.5 * neg[hard].sum()) / (hard.sum() + easy.sum())
    torch.testing.assert_close(selectively_contrastive_triplet(emb, labels, penalty=0.5), want)


def test_sct_chunked_value_and_grad(gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    v, g = pf.chunked.value_and_grad(selectively_contrastive_triplet, chunk_size=4)(
        emb, labels, penalty=0.5
    )
    want = value_and_grads(lambda e: selectively_contrastive_triplet(e, labels, penalty=0.5), emb)
    assert_same((v, [g]), want, rtol=1e-9, atol=1e-12)


def test_sct_vmap_equals_a_loop(gen):
    emb, labels = randn(gen, 9, 4), lab([0, 0, 1, 1, 2, 2, 3, 3, 3])

    assert_vmap_equals_a_loop(
        lambda x: selectively_contrastive_triplet(x, labels, hard_cutoff=0.2), emb
    )


def test_sct_bad_input(gen):
    emb, labels = randn(gen, 4, 3), lab([0, 0, 1, 1])
    with pytest.raises(ValueError, match="temperature"):
        selectively_contrastive_triplet(emb, labels, temperature=0.0)
    with pytest.raises(TypeError, match="penalty"):
        selectively_contrastive_triplet(emb, labels, penalty=None)
    with pytest.raises(ValueError, match="hard_cutoff"):
        selectively_contrastive_triplet(emb, labels, hard_cutoff=torch.ones(2))
    with pytest.raises(ValueError, match="labels and indices_tuple"):
        selectively_contrastive_triplet(emb)


@pytest.mark.parametrize("mined", [False, True])
@pytest.mark.parametrize("margin_", [0.2, 1.5])
def test_all_triplets_with_few_positives_per_anchor_match_pml(mined, margin_, gen):
    """Two samples per class in a batch of 64: each anchor's one positive is compared with
    every column (no sort, CPU eager) — the same value and gradient as PML's enumeration."""
    import pmlfunc.losses.triplets as tr

    labels = torch.arange(64) // 2
    emb = randn(gen, 64, 8)
    assert tr.sparse_rows((labels[:, None] == labels[None]).fill_diagonal_(False), 8.0) is not None
    pairs = pf.miners.pair_margin(emb, labels, pos_margin=0.0, neg_margin=1.5) if mined else None
    pml_pairs = lmu.get_all_pairs_indices(labels) if not mined else pairs.to_indices()
    got = value_and_grads(
        lambda e: triplet_margin(e, labels, margin=margin_, indices_tuple=pairs), emb
    )
    pml = pml_losses.TripletMarginLoss(margin=margin_)
    want = value_and_grads(lambda e: pml(e, labels, pml_pairs), emb)
    assert_same(got, want, **core.TOL[F64])
