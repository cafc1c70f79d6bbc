"""Pair masks, index-tuple conversion, reducers (directly, and through the losses against PML
2.9.0 and the loop references), and the all-triplet counting kernels."""

from __future__ import annotations

import functools
import itertools
import re

import pytest
import torch
from helpers import F32, F64, REF_LABELS, UNEVEN, assert_same, lab, randn
from pytorch_metric_learning import reducers as pml_reducers
from suites import core, structured

import pmlfunc as pf
import pmlfunc.reducers as pfr
from pmlfunc.labels import label_masks, tuple_masks
from pmlfunc.losses.triplets import AllTriplets
from pmlfunc.reducers import DenseTerms

LABELS = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4])


def test_label_masks_self_mode_excludes_diagonal_only():
    pos, neg = label_masks(LABELS)
    n = len(LABELS)
    for i, j in itertools.product(range(n), range(n)):
        assert pos[i, j] == float(LABELS[i] == LABELS[j] and i != j)
        assert neg[i, j] == float(LABELS[i] != LABELS[j])


def test_label_masks_reference_set_excludes_nothing():
    ref = LABELS.clone()
    pos, _ = label_masks(LABELS, ref)
    assert torch.all(pos.diagonal() == 1)  # the same rows, but a separate set


@pytest.mark.parametrize(
    "call",
    [
        lambda e, y, r: pf.losses.contrastive(e, y, ref_emb=r, ref_labels=y[:9]),
        lambda e, y, r: pf.miners.pair_margin(e, y, ref_emb=r, ref_labels=y[:9]),
    ],
    ids=["loss", "miner"],
)
def test_a_wrong_length_of_ref_labels_names_ref_labels_and_ref_emb(call):
    """Regression (issue 16): the message named ``embeddings``' row count for ``ref_labels``."""
    emb, labels = torch.randn(16, 4), torch.arange(16) // 4
    with pytest.raises(ValueError, match=r"^ref_labels has length 9 but ref_emb has 10 rows"):
        call(emb, labels, emb[:10].clone())
    with pytest.raises(ValueError, match=r"^labels has length 15 but embeddings has 16 rows"):
        pf.losses.contrastive(emb, labels[:15])


def test_tuple_masks_count_multiplicity():
    a1, p = torch.tensor([0, 0, 1]), torch.tensor([1, 1, 0])
    a2, n = torch.tensor([2]), torch.tensor([3])
    pos, neg = tuple_masks((a1, p, a2, n), (4, 4))
    assert pos[0, 1] == 2 and pos[1, 0] == 1 and pos.sum() == 3
    assert neg[2, 3] == 1 and neg.sum() == 1
    pos3, neg3 = tuple_masks((torch.tensor([0]), torch.tensor([1]), torch.tensor([2])), (3, 3))
    assert pos3[0, 1] == 1 and neg3[0, 2] == 1 and pos3.sum() == neg3.sum() == 1


@pytest.mark.parametrize(
    "bad,err",
    [
        ((torch.tensor([0]), torch.tensor([1])), ValueError),
        ((torch.tensor([0]), torch.tensor([1]), torch.tensor([0.5])), TypeError),
        ((torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([2])), ValueError),
        ((torch.tensor([[0]]), torch.tensor([[1]]), torch.tensor([[2]])), ValueError),
    ],
)
def test_tuple_masks_reject_malformed_tuples(bad, err):
    with pytest.raises(err, match="indices_tuple"):
        tuple_masks(bad, (3, 3))


def _terms():
    g = torch.Generator().manual_seed(0)
    losses = torch.relu(torch.randn(5, 6, generator=g, dtype=torch.float64))
    weights = (torch.rand(5, 6, generator=g) < 0.6).double() * torch.randint(
        1, 3, (5, 6), generator=g
    ).double()
    return losses, weights


def test_reducers_against_direct_formulas():
    losses, w = _terms()
    t = DenseTerms(losses, w, "pos_pair", 5)
    labels = torch.tensor([0, 1, 1, 2, 0])
    total, count = (w * losses).sum(), w.sum()
    nz = w * (losses > 0)
    torch.testing.assert_close(pf.reducers.mean()(t), total / count)
    torch.testing.assert_close(pf.reducers.sum()(t), total)
    torch.testing.assert_close(pf.reducers.avg_nonzero()(t), (nz * losses).sum() / nz.sum())
    win = w * ((losses > 0.2) & (losses < 1.0))
    torch.testing.assert_close(pf.reducers.threshold(0.2, 1.0)(t), (win * losses).sum() / win.sum())
    distinct = (w > 0).double()  # per_anchor counts a repeated pair once, as PML does
    per_row = (distinct * losses).sum(1) / distinct.sum(1).clamp_min(1)
    torch.testing.assert_close(pf.reducers.per_anchor()(t), per_row.mean())
    cw = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(
        pf.reducers.class_weighted(cw)(t, labels), (cw[labels][:, None] * w * losses).sum() / count
    )
    out = pf.reducers.none()(t)
    assert out["kind"] == "pos_pair" and out["losses"] is losses


def test_empty_selection_is_zero_with_zero_gradient():
    x = torch.zeros(4, 4, requires_grad=True)
    t = DenseTerms(torch.relu(x - 1), torch.ones(4, 4), "pos_pair", 4)
    out = pf.reducers.avg_nonzero()(t)
    (g,) = torch.autograd.grad(out, x)
    assert out.item() == 0 and torch.all(g == 0)


def test_reducer_errors():
    with pytest.raises(ValueError, match="at least one"):
        pf.reducers.threshold()
    with pytest.raises(TypeError, match="per_anchor"):
        pf.reducers.per_anchor("mean")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="class_weighted"):
        pf.reducers.class_weighted([1.0, 2.0])  # type: ignore[arg-type]
    emb, labels = torch.randn(6, 3), torch.tensor([0, 0, 1, 1, 2, 2])
    with pytest.raises(TypeError, match="reducer must be a pmlfunc reducer"):
        pf.losses.contrastive(emb, labels, reducer="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisor"):
        pf.losses.contrastive(emb, labels, reducer=pf.reducers.divisor())
    with pytest.raises(ValueError, match="class_weighted"):
        i = (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
        pf.losses.contrastive(
            emb, None, indices_tuple=i, reducer=pf.reducers.class_weighted(torch.ones(3))
        )


@pytest.mark.parametrize("label", [-1, 3])
def test_class_weighted_refuses_a_label_without_a_weight(label):
    """A label outside ``[0, len(weights))`` is an IndexError naming ``labels``: ``-1`` read
    ``weights[-1]`` (PML's reducer indexes the same way) and returned a number."""
    emb, labels = torch.randn(6, 3), torch.tensor([0, 0, 1, 1, 2, label])
    with pytest.raises(IndexError, match=r"labels\[5\] = .*class_weighted's 3 class weights"):
        pf.losses.contrastive(emb, labels, reducer=pf.reducers.class_weighted(torch.ones(3)))


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("margin", [0.0, 0.5])
@pytest.mark.parametrize("ties", [False, True])
def test_sorted_triplet_counting_equals_the_enumerated_cube(margin, ties, binary):
    """The sort-based hinge sums and nonzero counts equal the enumerated triplet cube, including
    exact ties ``e_an == e_ap + m`` (a zero hinge that must not be counted)."""
    g = torch.Generator().manual_seed(1)
    b, m = 9, 11
    if ties:
        e = torch.randint(0, 4, (b, m), generator=g).double() / 2  # many exact ties
    else:
        e = torch.rand(b, m, generator=g, dtype=torch.float64)
    if binary:  # label masks: a reference set of m rows, every column a positive or a negative
        labels, ref_labels = (
            torch.randint(0, 3, (b,), generator=g),
            torch.randint(0, 3, (m,), generator=g),
        )
        pos, neg = label_masks(labels, ref_labels, dtype=torch.float64)
    else:  # pair multiplicities, as from an index tuple, with columns that are neither
        pos = (torch.rand(b, m, generator=g) < 0.3).double()
        pos = pos * torch.randint(1, 3, (b, m), generator=g).double()
        neg = (torch.rand(b, m, generator=g) < 0.5).double() * (pos == 0).double()
    terms = AllTriplets(e.requires_grad_(), pos, neg, margin, False, None, binary=binary)
    s, c = terms.stats(low=0.0)
    x = e[:, :, None] - e[:, None, :] + margin
    w = pos[:, :, None] * neg[:, None, :]
    torch.testing.assert_close(s, (w * x.relu()).sum((1, 2)))
    torch.testing.assert_close(c, (w * (x > 0)).sum((1, 2)))
    s_all, c_all = terms.stats()
    torch.testing.assert_close(s_all, s)  # every hinge term, zeros included
    torch.testing.assert_close(c_all, w.sum((1, 2)))
    # Gradients of the sort path equal those of the cube.
    (g1,) = torch.autograd.grad(s.sum(), e)
    (g2,) = torch.autograd.grad((w * x.relu()).sum(), e)
    torch.testing.assert_close(g1, g2)
    assert torch.count_nonzero(c) > 0 and torch.count_nonzero(w.sum((1, 2)) - c) > 0
    # The chunked cube path (used for windows) agrees too.
    s_w, c_w = terms.stats(low=0.1, high=0.9)
    sel = w * ((x.relu() > 0.1) & (x.relu() < 0.9))
    torch.testing.assert_close(s_w, (sel * x.relu()).sum((1, 2)))
    torch.testing.assert_close(c_w, sel.sum((1, 2)))


@pytest.mark.parametrize("margin", [0.0, 0.3])
def test_sorted_triplet_counting_self_mode_label_masks(margin):
    """Self mode with label masks: the diagonal is neither positive nor negative."""
    g = torch.Generator().manual_seed(2)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4])
    e = torch.randint(0, 4, (11, 11), generator=g).double() / 2
    e = (e + e.T).requires_grad_()
    pos, neg = label_masks(labels, dtype=torch.float64)
    terms = AllTriplets(e, pos, neg, margin, False, None, binary=True, diagonal=0)
    s, c = terms.stats(low=0.0)
    x = e[:, :, None] - e[:, None, :] + margin
    w = pos[:, :, None] * neg[:, None, :]
    torch.testing.assert_close(s, (w * x.relu()).sum((1, 2)))
    torch.testing.assert_close(c, (w * (x > 0)).sum((1, 2)))
    (g1,) = torch.autograd.grad(s.sum(), e)
    (g2,) = torch.autograd.grad((w * x.relu()).sum(), e)
    torch.testing.assert_close(g1, g2)


# ----------------------------------------------------------------------------------------------
# reducers over the core losses (tests/suites/core.py), against PML and the loop references
# ----------------------------------------------------------------------------------------------
def core_reducers(name):
    """name -> (pmlfunc reducer, PML reducer, reference spec)."""
    weights = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0, 1.5], dtype=F64)
    lo, hi = {
        "contrastive": (0.05, 0.6),
        "triplet_margin": (0.05, 0.3),
        "ntxent": (0.5, 2.0),
        "supcon": (1.0, 2.5),
        "multi_similarity": (0.2, 0.8),
    }[name]
    return {
        "mean": (pfr.mean(), pml_reducers.MeanReducer(), ("mean", {})),
        "avg_nonzero": (pfr.avg_nonzero(), pml_reducers.AvgNonZeroReducer(), ("avg_nonzero", {})),
        "sum": (pfr.sum(), pml_reducers.SumReducer(), ("sum", {})),
        "threshold": (
            pfr.threshold(low=lo, high=hi),
            pml_reducers.ThresholdReducer(low=lo, high=hi),
            ("threshold", {"low": lo, "high": hi}),
        ),
        "threshold_low": (
            pfr.threshold(low=lo),
            pml_reducers.ThresholdReducer(low=lo),
            ("threshold", {"low": lo}),
        ),
        "threshold_high": (
            pfr.threshold(high=hi),
            pml_reducers.ThresholdReducer(high=hi),
            ("threshold", {"high": hi}),
        ),
        "per_anchor": (pfr.per_anchor(), pml_reducers.PerAnchorReducer(), ("per_anchor", {})),
        "class_weighted": (
            pfr.class_weighted(weights),
            pml_reducers.ClassWeightedReducer(weights),
            ("class_weighted", {"weights": weights}),
        ),
    }


REDUCER_NAMES = [
    "mean",
    "avg_nonzero",
    "sum",
    "threshold",
    "threshold_low",
    "threshold_high",
    "per_anchor",
    "class_weighted",
]


def _reducer_case_skip(name, red):
    if name == "triplet_margin" and red == "per_anchor":
        pytest.skip("PML's PerAnchorReducer does not reduce triplets")
    if name == "multi_similarity" and red == "class_weighted":
        pytest.skip("PML bug: (B, 1) losses broadcast against weights; see the reference test")


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("red", REDUCER_NAMES)
@pytest.mark.parametrize("name", core.LOSSES)
def test_core_losses_pml_parity_reducers(name, red, dtype, gen):
    _reducer_case_skip(name, red)
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8, dtype=dtype)
    pf_red, pml_red, _ = core_reducers(name)[red]
    got = core.run_pf(name, emb, labels, reducer=pf_red, **core.HP[name])
    want = core.run_pml(name, emb, labels, reducer=pml_red, **core.HP[name])
    assert_same(got, want, **core.TOL[dtype])


@pytest.mark.parametrize("red", [r for r in REDUCER_NAMES if r != "per_anchor"])
@pytest.mark.parametrize("name", core.LOSSES)
def test_core_losses_pml_parity_reducers_with_ref_set(name, red, gen):
    _reducer_case_skip(name, red)
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 8), randn(gen, len(ref_labels), 8)
    pf_red, pml_red, _ = core_reducers(name)[red]
    kw = {"ref": ref, "ref_labels": ref_labels, **core.HP[name]}
    got = core.run_pf(name, emb, labels, reducer=pf_red, **kw)
    want = core.run_pml(name, emb, labels, reducer=pml_red, **kw)
    assert_same(got, want, **core.TOL[F64])


@pytest.mark.parametrize("kind", ["pair_subset", "triplet_margin_miner"])
@pytest.mark.parametrize("red", REDUCER_NAMES)
@pytest.mark.parametrize("name", core.LOSSES)
def test_core_losses_pml_parity_reducers_with_indices_tuple(name, red, kind, gen):
    """Mined triplets given to pair losses repeat pairs; each reducer must count them as PML does
    (pair reducers count repeats, PerAnchorReducer writes each pair once)."""
    _reducer_case_skip(name, red)
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8)
    it = core.indices(kind, emb, labels, gen)
    pf_red, pml_red, _ = core_reducers(name)[red]
    got = core.run_pf(name, emb, labels, reducer=pf_red, indices_tuple=it, **core.HP[name])
    want = core.run_pml(name, emb, labels, reducer=pml_red, indices_tuple=it, **core.HP[name])
    if red == "per_anchor" and kind == "triplet_margin_miner" and name in ("contrastive", "ntxent"):
        # PML's value counts a repeated pair once (one B x B cell) but index_put's backward sends
        # the cell's gradient to every copy, so PML's gradient is not the derivative of its value.
        # pmlfunc matches the value; its gradient is checked against finite differences.
        torch.testing.assert_close(got[0], want[0], **core.TOL[F64])
        fn = core.pf_loss(name)
        assert torch.autograd.gradcheck(
            lambda e: fn(e, labels, reducer=pf_red, indices_tuple=it, **core.HP[name]),
            (emb.detach().clone().requires_grad_(),),
        )
        assert not torch.allclose(got[1][0], want[1][0])  # the PML inconsistency is real
        return
    assert_same(got, want, **core.TOL[F64])


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("red", ["class_weighted", "per_anchor", "threshold", "sum"])
@pytest.mark.parametrize("name", core.LOSSES)
def test_core_losses_reducers_match_reference(name, red, with_ref, gen):
    """Reducers against the loop reference, including the cases PML cannot be compared on."""
    if name == "triplet_margin" and red == "per_anchor":
        pytest.skip("per_anchor of triplets is not defined by PML")
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    kw = {}
    if with_ref:
        kw = {"ref": randn(gen, len(REF_LABELS), 6), "ref_labels": lab(REF_LABELS)}
    pf_red, _, ref_red = core_reducers(name)[red]
    got = core.run_pf(name, emb, labels, reducer=pf_red, **kw, **core.HP[name])
    want = core.run_ref(name, emb, labels, reducer=ref_red, **kw, **core.HP[name])
    assert_same(got, want, **core.REF_TOL)


@pytest.mark.parametrize("name", ["contrastive", "ntxent", "supcon", "multi_similarity"])
def test_per_anchor_with_larger_ref_set_matches_reference(name, gen):
    """Deviation (d): PML's PerAnchorReducer indexes a B x B array (it fails when M > B);
    pmlfunc averages each query row over its pairs with the reference set."""
    labels = lab([0, 0, 1, 2, 2])
    ref_labels = lab([0, 1, 1, 2, 3, 0, 2, 4, 1])
    emb, ref = randn(gen, 5, 6), randn(gen, 9, 6)
    kw = {"ref": ref, "ref_labels": ref_labels, **core.HP[name]}
    got = core.run_pf(name, emb, labels, reducer=pfr.per_anchor(), **kw)
    want = core.run_ref(name, emb, labels, reducer=("per_anchor", {}), **kw)
    assert_same(got, want, **core.REF_TOL)


# ----------------------------------------------------------------------------------------------
# reducers over the structured losses (tests/suites/structured.py), against PML and the loop
# references
# ----------------------------------------------------------------------------------------------
# PML's matrix/log-sum-exp losses return (N, 1)-shaped losses: ClassWeightedReducer broadcasts
# them against (N,) weights and PerAnchorReducer fails; those cases use the loop reference.
PML_COLUMN_LOSSES = {"lifted_structure", "generalized_lifted_structure", "circle", "tuplet_margin"}


@pytest.mark.parametrize("red", list(structured.reducers()))
@pytest.mark.parametrize("name", structured.NAMES)
def test_structured_losses_pml_parity_reducers(name, red, gen):
    if red == "divisor" and name != "margin":
        pytest.skip("only margin supplies a divisor")
    if red == "per_anchor" and name == "margin":
        pytest.skip("PML's PerAnchorReducer does not reduce triplets")
    labels, hp = lab(UNEVEN), structured.HP[name]
    emb = randn(gen, len(labels), 8)
    pf_red, pml_red = structured.reducers()[red]
    for it in (None, structured.pml_tuple("pml_triplets", emb, labels)):
        got = structured.run("pf", name, emb, labels, reducer=pf_red, indices_tuple=it, **hp)
        if red in ("class_weighted", "per_anchor") and name in PML_COLUMN_LOSSES:
            ref_red = (red, {"weights": pf_red.weights} if red == "class_weighted" else {})
            want = structured.run("ref", name, emb, labels, reducer=ref_red, indices_tuple=it, **hp)
            assert_same(got, want, **structured.REF_TOL)
            continue
        want = structured.run_pml(name, emb, labels, reducer=pml_red, indices_tuple=it, **hp)
        if red == "per_anchor" and it is not None:
            # PML's value counts a repeated pair once (one B x B cell), but index_put's backward
            # sends the cell's gradient to every copy: pmlfunc matches the value, and its
            # gradient is the derivative of that value (gradcheck).
            torch.testing.assert_close(got[0], want[0], **structured.TOL[F64])
            assert torch.autograd.gradcheck(
                lambda e, it=it: structured.PF[name](
                    e, labels, reducer=pf_red, indices_tuple=it, **hp
                ),
                (emb.clone().requires_grad_(True),),
            )
            continue
        assert_same(got, want, **structured.TOL[F64])


@pytest.mark.parametrize(
    ("reducer", "text"),
    [
        (pfr.mean(), "mean()"),
        (pfr.avg_nonzero(), "avg_nonzero()"),
        (pfr.threshold(low=0.0), "avg_nonzero()"),  # loss > 0 is avg_nonzero's window
        (pfr.threshold(low=0.0, high=1.0), "threshold(low=0.0, high=1.0)"),
        (pfr.threshold(high=1.0), "threshold(low=None, high=1.0)"),
        (pfr.threshold(low=0.5), "threshold(low=0.5, high=None)"),
        (pfr.sum(), "sum()"),
        (pfr.none(), "none()"),
        (pfr.per_anchor(), "per_anchor(mean())"),
        (pfr.per_anchor(pfr.avg_nonzero()), "per_anchor(avg_nonzero())"),
        (pfr.class_weighted(torch.ones(3)), "class_weighted(<3 class weights>)"),
    ],
)
def test_a_reducers_repr_names_what_it_computes(reducer, text):
    """The repr is what the docs show and what the tiled engine reads (_tiled.tiled_reducer):
    a window that is a plain mean or avg_nonzero says so."""
    assert repr(reducer) == text


@pytest.mark.parametrize("reducer", [pfr.none(), pfr.divisor()], ids=repr)
def test_a_reducer_that_does_not_sum_over_anchors_is_refused_by_the_chunked_gradient(reducer):
    """none() returns the terms, divisor() divides by the loss's own global count: neither is a
    sum of per-chunk shares, so pf.chunked says so instead of computing another number."""
    emb, labels = torch.randn(8, 4), torch.arange(8) % 2
    loss = functools.partial(pf.losses.contrastive, reducer=reducer)
    with pytest.raises(ValueError, match=rf"reducer {re.escape(repr(reducer))} does not split"):
        pf.chunked.value_and_grad(loss, chunk_size=4)(emb, labels)
    for r in (pfr.mean(), pfr.avg_nonzero(), pfr.sum(), pfr.threshold(low=0.1), pfr.per_anchor()):
        assert r.chunkable, r


def test_per_anchor_counts_a_repeated_triplet_as_often_as_it_is_listed():
    """Pairs: PML writes each (anchor, other) into one cell, so a repeated pair counts once.
    Triplets (which PML's PerAnchorReducer refuses): an anchor's mean over its listed triplets,
    repeats included, then the mean over every row (0 for a row that anchors nothing)."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(6, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    a, p, n = torch.tensor([0, 0, 0, 3]), torch.tensor([1, 1, 2, 4]), torch.tensor([3, 3, 4, 0])
    got = pf.losses.triplet_margin(
        emb, labels, margin=0.5, indices_tuple=(a, p, n), reducer=pfr.per_anchor()
    )
    unit = torch.nn.functional.normalize(emb, dim=-1)
    d = torch.cdist(unit, unit)
    terms = (d[a, p] - d[a, n] + 0.5).clamp_min(0.0)
    per_row = torch.zeros(6, dtype=torch.float64)
    for row in (0, 3):
        per_row[row] = terms[a == row].mean()
    torch.testing.assert_close(got, per_row.mean(), rtol=1e-12, atol=1e-12)
    assert terms[0] > 0  # the repeated triplet is active: counting it once would differ
