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
from tracking import DispatchedOps, LargestTensor

import pmlfunc as pf
import pmlfunc.reducers as pfr
from pmlfunc.losses import margin, margin_init, selectively_contrastive_triplet, triplet_margin
from pmlfunc.tuples import MinedTriplets, PackagedTriplets


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


# ----------------------------------------------------------------------------------------------
# triplet_margin and margin on given triplets: the row path (issue 30, item 4)
# ----------------------------------------------------------------------------------------------
ROW, MATRIX = 0.0, 1e30  # ROW_PATH_COST forcing each path


def _given(gen, with_ref: bool, t: int = 9, d: int = 6, dtype=F64, ap_tie: bool = True):
    """Rows and a PML triplet tuple over them with exact ties: triplet 0's positive equals its
    anchor (d_ap = 0; not ``ap_tie``: no such triplet), triplet 1's negative equals its anchor
    (d_an = 0), triplet 2's negative equals its positive (d_pn = 0, what swap reads), triplet
    3 is listed three times and the order is shuffled. Self mode: the rows are packaged
    (3k, 3k+1, 3k+2); with a reference set, anchors index ``emb`` and positives and negatives
    ``ref``."""
    if with_ref:
        emb, ref = randn(gen, t, d, dtype=dtype), randn(gen, 2 * t, d, dtype=dtype)
        a, p, n = torch.arange(t), torch.arange(0, 2 * t, 2), torch.arange(1, 2 * t, 2)
        ref[n[1]], ref[n[2]] = emb[1], ref[p[2]]
        if ap_tie:
            ref[p[0]] = emb[0]
    else:
        emb, ref = randn(gen, 3 * t, d, dtype=dtype), None
        a = torch.arange(0, 3 * t, 3)
        p, n = a + 1, a + 2
        emb[p[0]], emb[n[1]], emb[n[2]] = emb[a[0]], emb[a[1]], emb[p[2]]
    order = torch.cat([torch.randperm(t, generator=gen), torch.tensor([3, 3])])
    return emb, ref, (a[order], p[order], n[order])


def _run_given(monkeypatch, cost, emb, ref, tup, dist, **kw):
    import pmlfunc.losses.triplets as tr

    monkeypatch.setattr(tr, "ROW_PATH_COST", cost)
    labels = torch.arange(emb.shape[0])
    if ref is None:
        return value_and_grads(
            lambda e: triplet_margin(e, labels, distance=dist, indices_tuple=tup, **kw), emb
        )
    ref_labels = torch.arange(ref.shape[0])
    return value_and_grads(
        lambda e, r: triplet_margin(
            e, labels, ref_emb=r, ref_labels=ref_labels, distance=dist, indices_tuple=tup, **kw
        ),
        emb,
        ref,
    )


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("smooth_loss", [False, True], ids=["hinge", "smooth"])
@pytest.mark.parametrize("swap", [False, True], ids=["", "swap"])
@pytest.mark.parametrize("dist", list(core.DISTANCES))
def test_given_triplets_row_path_equals_matrix_path_and_pml(
    dist, swap, smooth_loss, with_ref, monkeypatch, gen
):
    """Every distance, swap, smooth loss, self and reference mode, with zero distances and a
    repeated triplet: values and gradients of the row path equal the matrix path's and PML
    2.9.0's (with a reference set and swap PML reads the query-by-reference matrix at
    ``[p, n]``: deviation (c), checked against the loop reference instead)."""
    # with a reference set, d_ap = 0 makes d_pn = d(ref_p, ref_n) = d(emb_a, ref_n) = d_an: a
    # tie of swap's minimum that the row path keeps exact (torch.minimum splits the gradient,
    # as in PML), where the matrix path reads d_an from the matrix and d_pn from the rows,
    # whose roundings break it either way
    emb, ref, tup = _given(gen, with_ref, ap_tie=not (with_ref and swap))
    pf_dist, pml_dist, ref_dist = core.DISTANCES[dist]
    kw = {"margin": 0.4, "swap": swap, "smooth_loss": smooth_loss}
    row = _run_given(monkeypatch, ROW, emb, ref, tup, pf_dist(), **kw)
    mat = _run_given(monkeypatch, MATRIX, emb, ref, tup, pf_dist(), **kw)
    for g in row[1]:
        assert torch.isfinite(g).all()
    assert_same(row, mat, **core.TOL[F64])
    labels = torch.arange(emb.shape[0])
    ref_labels = None if ref is None else torch.arange(ref.shape[0])
    if with_ref and swap:  # the loop reference's value (its gradient is NaN at d = 0: sqrt)
        want = core.run_ref(
            "triplet_margin",
            emb,
            labels,
            ref=ref,
            ref_labels=ref_labels,
            distance=ref_dist,
            indices_tuple=tup,
            **kw,
        )
        torch.testing.assert_close(row[0], want[0], **core.TOL[F64])
        return
    else:
        want = core.run_pml(
            "triplet_margin",
            emb,
            labels,
            ref=ref,
            ref_labels=ref_labels,
            distance=pml_dist(),
            indices_tuple=tup,
            **kw,
        )
    assert_same(row, want, **core.TOL[F64])


@pytest.mark.parametrize("swap", [False, True], ids=["", "swap"])
@pytest.mark.parametrize("dist", ["lp", "lp_sq", "cosine"])
def test_given_triplets_row_path_matches_pml_in_float32(dist, swap, gen):
    """Packaged triplets at the default rule (the row path: 2T·D ≪ B·M) in float32, without
    exact ties (whose float32 rounding PML's matrix breaks its own way): PML's values and
    gradients to float32 rounding."""
    emb = randn(gen, 3 * 40, 16, dtype=F32)
    mined = pf.miners.embeddings_already_packaged_as_triplets(emb)
    pf_dist, pml_dist, _ = core.DISTANCES[dist]
    kw = {"margin": 0.3, "swap": swap}
    got = value_and_grads(
        lambda e: triplet_margin(e, distance=pf_dist(), indices_tuple=mined, **kw), emb
    )
    labels = torch.arange(emb.shape[0])
    want = core.run_pml(
        "triplet_margin", emb, labels, distance=pml_dist(), indices_tuple=mined.to_indices(), **kw
    )
    assert_same(got, want, **core.TOL[F32])


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("swap", [False, True], ids=["", "swap"])
def test_given_triplets_take_the_row_path_when_few(swap, with_ref, gen):
    """66 triplets on 192 rows (2T·D = 1,056 ≪ B·M = 36,864; with a reference set 64 × 128
    rows): no tensor of a quarter of B·M entries, forward or backward; 400 random triplets on
    12 rows (2T·D = 6,400 > 2·B·M = 288) read the matrix: no (2, T, D) tensor of gathered rows.
    Either assertion fails on the other path."""
    d = 8
    emb, ref, tup = _given(gen, with_ref, t=64, d=d, ap_tie=False)
    kw = {"swap": swap}
    if with_ref:
        kw.update(ref_emb=ref.requires_grad_(), ref_labels=torch.arange(ref.shape[0]))
    emb.requires_grad_()
    b, m = emb.shape[0], (emb if ref is None else ref).shape[0]
    with LargestTensor() as rec:
        loss = triplet_margin(emb, torch.arange(b), indices_tuple=tup, **kw)
        torch.autograd.grad(loss, [emb] + ([ref] if with_ref else []))
    assert rec.largest < b * m / 4

    rows = randn(gen, 12, d).requires_grad_()
    g = torch.Generator().manual_seed(1)
    many = tuple(torch.randint(0, 12, (400,), generator=g) for _ in range(3))
    with LargestTensor() as rec:
        loss = triplet_margin(rows, torch.arange(12), indices_tuple=many, swap=swap)
        torch.autograd.grad(loss, rows)
    assert rec.largest < 400 * d


def test_given_triplets_row_path_rule_at_its_boundary(monkeypatch, gen):
    """The rule is ``pairs · D · ROW_PATH_COST ≤ B · M`` on shapes: with B = M = 16, D = 8 and
    the cost 1/2, 32 triplets (64 pairs) are read from their rows, 33 from the matrix, and 22
    with swap (66 pairs: (a, p), (a, n), (p, n)) from the matrix, 21 from the rows."""
    import pmlfunc.losses.triplets as tr

    calls = []
    original = pf.distances._Lp._indexed_pairs  # what the row path calls (lp(): the default)

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pf.distances._Lp, "_indexed_pairs", spy)
    assert tr.ROW_PATH_COST == 0.5
    emb = randn(gen, 16, 8)
    g = torch.Generator().manual_seed(2)
    for t, swap, row in (
        (32, False, True),
        (33, False, False),
        (21, True, True),
        (22, True, False),
    ):
        calls.clear()
        tup = tuple(torch.randint(0, 16, (t,), generator=g) for _ in range(3))
        triplet_margin(emb, indices_tuple=tup, swap=swap)
        assert bool(calls) == row, (t, swap)


def test_given_triplets_empty_tuple(monkeypatch, gen):
    """No triplet: a zero loss and zero gradients on both paths, as PML."""
    emb = randn(gen, 9, 4)
    empty = (torch.empty(0, dtype=torch.long),) * 3
    for cost in (ROW, MATRIX):
        for swap in (False, True):
            value, (g,) = _run_given(
                monkeypatch, cost, emb, None, empty, pf.distances.lp(), swap=swap
            )
            assert value == 0 and torch.equal(g, torch.zeros_like(g))
    want = core.run_pml("triplet_margin", emb, torch.arange(9), indices_tuple=empty)
    assert want[0] == 0


_ROW_GATHERS = {"index_select", "index_add_", "index_add", "index", "index_put_", "gather"}


@pytest.mark.parametrize("dist", list(core.DISTANCES))
@pytest.mark.parametrize("loss", ["triplet_margin", "margin"])
def test_packaged_triplets_read_the_rows_view_with_the_values_of_their_indices(loss, dist, gen):
    """A miner's packaged triplets (rows 3t, 3t+1, 3t+2) give the values and gradients (float64)
    of the same indices as a plain MinedTriplets, whose rows are gathered, for every distance;
    with the Euclidean distance (p = 2, power 1 or 2) neither pass gathers or scatters a row."""
    emb = randn(gen, 3 * 7, 5)
    emb[3] = emb[4]  # an exact tie (d_ap = 0): the gradient's 0 there, not NaN
    packaged = pf.miners.embeddings_already_packaged_as_triplets(emb)
    assert isinstance(packaged, PackagedTriplets)
    d = core.DISTANCES[dist][0]()

    def run(mined):
        if loss == "margin":
            return lambda e: margin(e, torch.arange(e.shape[0]), indices_tuple=mined, distance=d)
        return lambda e: triplet_margin(e, indices_tuple=mined, distance=d, margin=0.3)

    with DispatchedOps() as rec:
        got = value_and_grads(run(packaged), emb)
    want = value_and_grads(run(MinedTriplets(*packaged)), emb)
    assert_same(got, want, **core.TOL[F64])
    assert torch.isfinite(got[1][0]).all()
    if dist in ("lp", "lp_sq", "lp_raw"):
        assert not _ROW_GATHERS & set(rec.names), rec.names


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dist", ["lp", "lp_raw", "cosine"])
def test_packaged_triplets_propagate_a_non_finite_row(dist, value, gen):
    """On the rows' view a NaN or inf entry in any row (an anchor, a positive, a negative) makes
    the gradient non-finite, never a silent wrong number, and the loss what the indexed path
    gives (NaN or inf, or finite where an infinitely far negative leaves its hinge at 0)."""
    d = core.DISTANCES[dist][0]()
    for row in (0, 4, 8):
        emb = randn(gen, 9, 4)
        emb[row, 1] = value
        packaged = pf.miners.embeddings_already_packaged_as_triplets(emb)
        (loss, (g,)), (want, _) = (
            value_and_grads(lambda e, m=m: triplet_margin(e, indices_tuple=m, distance=d), emb)
            for m in (packaged, MinedTriplets(*packaged))
        )
        assert not torch.isfinite(g).all()
        torch.testing.assert_close(loss, want, equal_nan=True)


def test_packaged_triplets_not_over_their_own_rows_are_read_by_index(gen):
    """Packaged triplets the strided view cannot serve give their indices' values all the same:
    over more rows than they cover (a miner's 9 rows in a batch of 12), with swap, with a
    reference set; a packaged result whose fields are replaced (or cut to a chunk of anchors)
    is a plain MinedTriplets, its indices no longer known packaged; over fewer rows than they
    cover, an IndexError naming the field."""
    emb, ref = randn(gen, 12, 5), randn(gen, 12, 5)
    packaged = pf.miners.embeddings_already_packaged_as_triplets(emb[:9])
    plain = MinedTriplets(*packaged)
    for rows, kw in ((emb, {}), (emb[:9], {"swap": True}), (emb[:9], {"ref_emb": ref})):
        got, want = (
            value_and_grads(
                lambda e, m=mined, kw=kw: triplet_margin(e, indices_tuple=m, margin=2.0, **kw),
                rows,
            )
            for mined in (packaged, plain)
        )
        assert_same(got, want, **core.TOL[F64])
    holed = packaged._replace(valid=torch.tensor([1.0, 0.0, 1.0], dtype=F64))
    assert type(holed) is MinedTriplets and type(packaged.for_rows((0, 4))) is MinedTriplets
    with pytest.raises(IndexError, match=r"indices_tuple\.anchors"):
        triplet_margin(emb[:6], indices_tuple=packaged)


def test_packaged_triplets_rebuilt_from_their_fields_are_plain_mined_triplets(gen):
    """Only the miner makes PackagedTriplets: a tree map (torch's and optree's), a copy, a
    pickle, the constructor and ``_make`` rebuild plain MinedTriplets, read by index. A flipped
    order's per-triplet losses follow the flip (read as the packaged rows they would come back
    in the rows' order, a silent wrong pairing of losses and anchors)."""
    import copy
    import pickle

    import optree
    from torch.utils._pytree import tree_map

    emb = randn(gen, 12, 5)
    packaged = pf.miners.embeddings_already_packaged_as_triplets(emb)
    flip = lambda f: f.flip(0)  # noqa: E731
    rebuilt = {
        "torch tree_map": tree_map(flip, packaged),
        "optree tree_map": optree.tree_map(flip, packaged, namespace="torch"),
        "copy": copy.copy(packaged),
        "deepcopy": copy.deepcopy(packaged),
        "pickle": pickle.loads(pickle.dumps(packaged)),
        "constructor": PackagedTriplets(*packaged),
        "_make": PackagedTriplets._make(packaged),
    }
    for how, mined in rebuilt.items():
        assert type(mined) is MinedTriplets, how
    flipped = rebuilt["torch tree_map"]
    got = triplet_margin(emb, indices_tuple=flipped, margin=2.0, reducer=pfr.none())["loss"]
    want = triplet_margin(emb, indices_tuple=packaged, margin=2.0, reducer=pfr.none())["loss"]
    torch.testing.assert_close(got["losses"], want["losses"].flip(0), rtol=0, atol=0)
    torch.testing.assert_close(got["anchor_index"], packaged.anchors.flip(0))


def test_packaged_euclidean_has_second_derivatives():
    """The packaged rows' Euclidean distances (plain and squared) pass gradcheck and
    gradgradcheck in float64: the backward is written in differentiable ops."""
    x = torch.randn(4, 3, 5, dtype=F64, requires_grad=True)
    for d in (pf.distances.lp(normalize=False), pf.distances.lp(power=2)):
        torch.autograd.gradcheck(d._packaged_pairs, (x,))
        torch.autograd.gradgradcheck(d._packaged_pairs, (x,))


@pytest.mark.parametrize("swap", [False, True], ids=["rows-view", "swap"])
def test_given_triplets_row_path_on_meta_compiled_and_under_torch_func(swap, gen):
    """The row path (self mode, packaged triplets: their rows' view, and with swap their
    indices) runs on device="meta", compiles in one graph and equals autograd under
    torch.func.grad and vmap."""
    emb = randn(gen, 3 * 8, 6, dtype=F32)

    def loss(e):
        mined = pf.miners.embeddings_already_packaged_as_triplets(e)
        return triplet_margin(e, indices_tuple=mined, swap=swap, margin=0.5)

    meta = torch.randn(3 * 8, 6, device="meta", requires_grad=True)
    out = loss(meta)
    (g,) = torch.autograd.grad(out, meta)
    assert out.device.type == "meta" and out.shape == () and g.shape == meta.shape
    torch._dynamo.reset()
    assert_same(
        value_and_grads(torch.compile(loss, fullgraph=True), emb),
        value_and_grads(loss, emb),
        rtol=1e-5,
        atol=1e-6,
    )
    torch._dynamo.reset()
    torch.testing.assert_close(torch.func.grad(loss)(emb), value_and_grads(loss, emb)[1][0])
    assert_vmap_equals_a_loop(loss, emb)
    assert_vmap_equals_a_loop(torch.func.grad(loss), emb)


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("learnable", [False, True])
def test_margin_given_triplets_row_path_equals_matrix_path(learnable, with_ref, monkeypatch, gen):
    """margin on listed triplets reads them from their rows as well: the same values and
    gradients (of the embeddings and a learnable beta) as the matrix path."""
    import pmlfunc.losses.triplets as tr

    emb, ref, tup = _given(gen, with_ref)
    params = margin_init(1.0) if learnable else None
    inputs = (emb,) if ref is None else (emb, ref)
    extra = () if params is None else (params["beta"],)

    def run(cost):
        monkeypatch.setattr(tr, "ROW_PATH_COST", cost)

        def fn(e, *rest):
            kw = {}
            if ref is not None:
                kw = {"ref_emb": rest[0], "ref_labels": torch.arange(ref.shape[0])}
            p = None if params is None else {"beta": rest[-1]}
            labels = torch.arange(e.shape[0])
            return margin(e, labels, p, indices_tuple=tup, nu=0.1, **kw)

        return value_and_grads(fn, *inputs, *extra)

    assert_same(run(ROW), run(MATRIX), **core.TOL[F64])


def test_given_triplets_mean_over_a_miners_valid_slots(gen):
    """mean() over a miner's triplets is the mean over its valid slots: with every slot valid
    (CPU eager reads it and takes the unweighted mean) and with an invalid one (weighted), the
    same value and gradient as the static weighted path under torch.func.grad."""
    emb = randn(gen, 3 * 6, 5)
    packaged = pf.miners.embeddings_already_packaged_as_triplets(emb)
    holed = packaged._replace(valid=packaged.valid * (torch.arange(6) != 2).to(F64))
    for mined, slots in ((packaged, 6), (holed, 5)):

        def loss(e, mined=mined):
            return triplet_margin(e, indices_tuple=mined, reducer=pfr.mean(), margin=2.0)

        value, (g,) = value_and_grads(loss, emb)
        terms = triplet_margin(emb, indices_tuple=mined, reducer=pfr.none(), margin=2.0)
        terms = terms["loss"]
        assert int((terms["weights"] > 0).sum()) == slots
        want = (terms["losses"] * terms["weights"]).sum() / slots
        torch.testing.assert_close(value, want, **core.TOL[F64])
        grads, static = torch.func.grad_and_value(loss)(emb)
        torch.testing.assert_close(value, static, **core.TOL[F64])
        torch.testing.assert_close(g, grads, **core.TOL[F64])
