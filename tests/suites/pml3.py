"""The suite of the label losses PML 3 added, which PML 2.9.0 cannot be compared on:
``decoupled_contrastive`` (pmlfunc.losses.softmax) and ``selectively_contrastive_triplet``
(triplets).

A configuration's test class derives from :class:`Pml3Loss` and names it (a key of
:data:`CONFIGS`: the loss, its loop reference, an independent transcription of the paper in
``tests/reference/``, and its hyper-parameters). Each is checked against its reference on uneven and singleton classes, a reference set and mined tuples
(PML's and pmlfunc's), in float32, with ``gradcheck`` and on edge cases.
"""

from __future__ import annotations

import pytest
import torch
from helpers import F64, REF_LABELS, UNEVEN, assert_same, lab, randn, value_and_grads
from pytorch_metric_learning import miners as pml_miners
from reference import softmax, triplets

import pmlfunc.distances as pfd
import pmlfunc.miners as pfm
from pmlfunc.losses import decoupled_contrastive, selectively_contrastive_triplet

REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL_F32 = {"rtol": 2e-4, "atol": 2e-6}
PF_DIST = {"cosine": pfd.cosine, "lp": pfd.lp, "dot": pfd.dot}

# name -> (loss, loop reference, hyper-parameters)
CONFIGS = {
    "decoupled_contrastive": (
        decoupled_contrastive,
        softmax.decoupled_contrastive,
        {"temperature": 0.3},
    ),
    "dclw": (
        decoupled_contrastive,
        softmax.decoupled_contrastive,
        {"temperature": 0.3, "sigma": 0.5},
    ),
    "selectively_contrastive_triplet": (
        selectively_contrastive_triplet,
        triplets.selectively_contrastive_triplet,
        {"temperature": 0.2, "penalty": 0.7},
    ),
    "sct_cutoff": (
        selectively_contrastive_triplet,
        triplets.selectively_contrastive_triplet,
        {"temperature": 0.2, "penalty": 1.3, "hard_cutoff": 0.3},
    ),
}


def clustered(gen, labels, dim, spread=0.6, dtype=F64):
    """Rows near per-class centres: both easy and hard triplets occur."""
    centres = randn(gen, int(labels.max()) + 1, dim)
    return (centres[labels] + spread * randn(gen, len(labels), dim)).to(dtype)


class Pml3Loss:
    """The tests of one configuration: a subclass sets ``name`` (a key of :data:`CONFIGS`)."""

    name: str

    @property
    def hp(self):
        return CONFIGS[self.name][2]

    def call(self, *args, distance=None, **kw):
        """The loss with this configuration's hyper-parameters (and ``distance`` by name)."""
        extra = {} if distance is None else {"distance": PF_DIST[distance]()}
        return CONFIGS[self.name][0](*args, **self.hp, **extra, **kw)

    def ref(self, *args, **kw):
        return CONFIGS[self.name][1](*args, **kw)

    @pytest.mark.parametrize("distance", [None, "lp"])
    @pytest.mark.parametrize(
        "layout",
        [UNEVEN, [0, 1, 0, 1, 1, 0, 0, 1], [5, 5, 1, 7, 7, 3]],
        ids=["uneven", "two", "sing"],
    )
    def test_matches_reference(self, distance, layout, gen):
        labels = lab(layout)
        emb = clustered(gen, labels, 5)
        got = value_and_grads(lambda e: self.call(e, labels, distance=distance), emb)
        want = value_and_grads(
            lambda e: self.ref(e, labels, **self.hp, distance=distance or "cosine"), emb
        )
        assert_same(got, want, **REF_TOL)

    def test_matches_reference_with_ref_set(self, gen):
        labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
        emb, ref_emb = randn(gen, len(UNEVEN), 5), randn(gen, len(REF_LABELS), 5)
        got = value_and_grads(
            lambda e, r: self.call(e, labels, ref_emb=r, ref_labels=ref_labels), emb, ref_emb
        )
        want = value_and_grads(
            lambda e, r: self.ref(e, labels, r, ref_labels, **self.hp), emb, ref_emb
        )
        assert_same(got, want, **REF_TOL)

    @pytest.mark.parametrize("miner", ["pml_pairs", "pml_triplets", "pf_pairs", "pf_triplets"])
    def test_matches_reference_on_mined_tuples(self, miner, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(UNEVEN), 5)
        if miner == "pml_pairs":
            tup = pml_miners.PairMarginMiner(pos_margin=0.3, neg_margin=0.9)(emb, labels)
            given, listed = tup, tup
        elif miner == "pml_triplets":
            tup = pml_miners.TripletMarginMiner(margin=0.4, type_of_triplets="all")(emb, labels)
            given, listed = tup, tup
        elif miner == "pf_pairs":
            given = pfm.pair_margin(emb, labels, pos_margin=0.3, neg_margin=0.9)
            listed = given.to_indices()
        else:
            given = pfm.triplet_margin(
                emb,
                labels,
                margin=0.4,
                tuples_per_anchor=3,
                generator=torch.Generator().manual_seed(1),
            )
            listed = given.to_indices()
        assert len(listed[0]) > 0
        got = value_and_grads(lambda e: self.call(e, labels, indices_tuple=given), emb)
        want = value_and_grads(lambda e: self.ref(e, labels, indices_tuple=listed, **self.hp), emb)
        assert_same(got, want, **REF_TOL)

    def test_float32_and_bfloat16(self, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(UNEVEN), 5)
        got = value_and_grads(lambda e: self.call(e, labels), emb.float())
        want = value_and_grads(lambda e: self.ref(e, labels, **self.hp), emb)
        assert_same(got, want, **TOL_F32)
        half = self.call(emb.to(torch.bfloat16), labels)
        assert half.dtype == torch.float32 and torch.isfinite(half)

    def test_gradcheck(self, gen):
        labels = lab([0, 0, 1, 1, 2])
        emb = randn(gen, 5, 3).requires_grad_()
        assert torch.autograd.gradcheck(lambda e: self.call(e, labels), (emb,))

    @pytest.mark.parametrize(
        "layout",
        [[3, 3, 3, 3], [0, 1, 2, 3], [0, 0, 0, 1], [1]],
        ids=["one_class", "all_distinct", "lone_neg", "single"],
    )
    def test_edge_cases(self, layout, gen):
        labels = lab(layout)
        emb = randn(gen, len(layout), 3)
        emb_dup = torch.cat([emb, emb[:1]])  # a duplicate row (similarity exactly 1)
        labels_dup = torch.cat([labels, labels[:1]])
        for e, y in [(emb, labels), (emb_dup, labels_dup)]:
            got = value_and_grads(lambda x, y=y: self.call(x, y), e)
            assert torch.isfinite(got[0]) and torch.isfinite(got[1][0]).all()
            want = value_and_grads(lambda x, y=y: self.ref(x, y, **self.hp), e)
            assert_same(got, want, rtol=1e-7, atol=1e-9)
