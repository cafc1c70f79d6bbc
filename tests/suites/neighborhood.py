"""The suite of the neighbourhood losses: ``nca``, ``npairs``, ``angular``, ``instance``,
``ranked_list`` (pmlfunc.losses.neighbors) and ``threshold_consistent_margin`` (pairs).

A loss's test class derives from :class:`NeighborhoodLoss` and names the loss (a key of
:data:`SPECS`). Every loss is checked against
  * a naive float64 loop reference (``tests/reference/``), values and gradients;
  * pytorch-metric-learning 2.9.0 (values and full gradients, float64 and float32) over uneven and
    singleton classes, a reference set, PML-mined pairs/triplets, pmlfunc miner results, a few
    distances and reducers, wherever PML allows them;
  * chunked gradients, legal edge cases and low precision.
A test that does not apply to a loss (PML has no reference set for it, it takes no index tuple,
...) is left out of that loss's class: see :data:`APPLIES`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import (
    F32,
    F64,
    REF_LABELS,
    UNEVEN,
    assert_same,
    lab,
    loss_dtype,
    randn,
    value_and_grads,
)
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from reference import neighbors, pairs

import pmlfunc as pf
import pmlfunc.distances as pfd
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    angular,
    instance,
    nca,
    npairs,
    ranked_list,
    threshold_consistent_margin,
)

TOL = {F64: {"rtol": 1e-9, "atol": 1e-11}, F32: {"rtol": 2e-4, "atol": 2e-6}}
REF_TOL = {"rtol": 1e-9, "atol": 1e-11}
SINGLETONS = [5, 5, 1, 7, 7, 3, 9]
D = 5

DISTANCES = {  # name -> (pmlfunc, PML, reference spec)
    "lp": (pfd.lp, pml_distances.LpDistance, ("lp", {})),
    "lp_sq": (
        lambda: pfd.lp(power=2),
        lambda: pml_distances.LpDistance(power=2),
        ("lp", {"power": 2}),
    ),
    "cosine": (pfd.cosine, pml_distances.CosineSimilarity, ("cosine", {})),
    "dot": (
        pfd.dot,
        lambda: pml_distances.DotProductSimilarity(normalize_embeddings=False),
        ("dot", {}),
    ),
}
REDUCERS = {  # name -> (pmlfunc, PML, reference spec)
    "mean": (pfr.mean, pml_reducers.MeanReducer, ("mean", {})),
    "sum": (pfr.sum, pml_reducers.SumReducer, ("sum", {})),
    "avg_nonzero": (pfr.avg_nonzero, pml_reducers.AvgNonZeroReducer, ("avg_nonzero", {})),
}

# name -> what the tests need: the function, its loop reference, PML's class, hyper-parameters;
# "ref_set": PML parity with a reference set (the reference alone for "ref_reference");
# "tuples": takes an indices_tuple; "distances"/"reducers": compared with PML on them;
# "unchunkable": the error pf.chunked gives it (None: it splits over anchors).
SPECS = {
    "nca": {
        "fn": nca,
        "ref": neighbors.nca,
        "pml": pml_losses.NCALoss,
        "hp": {"softmax_scale": 2.0},
        "ref_set": True,
        "ref_reference": True,
        "tuples": True,
        "distances": ["lp_sq", "lp", "cosine"],
        "reducers": ["sum", "avg_nonzero"],
        "unchunkable": None,
    },
    "npairs": {
        "fn": npairs,
        "ref": neighbors.npairs,
        "pml": pml_losses.NPairsLoss,
        "hp": {},
        "ref_set": False,
        "ref_reference": False,
        "tuples": True,
        "distances": ["cosine", "dot", "lp"],
        "reducers": ["sum"],
        # picks one pair per class over the whole batch: not per anchor
        "unchunkable": "decompose",
    },
    "angular": {
        "fn": angular,
        "ref": neighbors.angular,
        "pml": pml_losses.AngularLoss,
        "hp": {"alpha": 35.0},
        "ref_set": True,
        "ref_reference": True,
        "tuples": True,
        "distances": [],
        "reducers": ["sum", "avg_nonzero"],
        # chunking pre-normalises; angular needs the raw references
        "unchunkable": "unnormalised",
    },
    "instance": {
        "fn": instance,
        "ref": neighbors.instance,
        "pml": pml_losses.InstanceLoss,
        "hp": {"gamma": 8.0},
        "ref_set": False,
        "ref_reference": False,
        "tuples": False,
        "distances": [],
        "reducers": ["sum"],
        "unchunkable": None,
    },
    "ranked_list": {
        "fn": ranked_list,
        "ref": neighbors.ranked_list,
        "pml": pml_losses.RankedListLoss,
        "hp": {"margin": 0.6, "Tn": 3.0, "Tp": 1.5, "imbalance": 0.3},
        "ref_set": False,
        "ref_reference": False,
        "tuples": False,
        "distances": ["lp_sq", "cosine"],
        "reducers": ["sum"],
        "unchunkable": None,
    },
    "threshold_consistent_margin": {
        "fn": threshold_consistent_margin,
        "ref": pairs.threshold_consistent_margin,
        "pml": pml_losses.ThresholdConsistentMarginLoss,
        "hp": {"margin_plus": 0.5, "margin_minus": 0.1, "lambda_plus": 0.7},
        # PML indexes the batch with reference indices (a bug): the reference alone
        "ref_set": False,
        "ref_reference": True,
        "tuples": True,
        "distances": [],
        "reducers": [],  # PML ignores its reducer
        "unchunkable": None,
    },
}


# ----------------------------------------------------------------------------------------------
# runners
# ----------------------------------------------------------------------------------------------
def run_pf(name, emb, labels, ref=None, ref_labels=None, **kw):
    fn = SPECS[name]["fn"]
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb)
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb, ref
    )


def run_ref(name, emb, labels, ref=None, ref_labels=None, **kw):
    fn = SPECS[name]["ref"]
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb.to(F64))
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb.to(F64), ref.to(F64)
    )


def run_pml(name, emb, labels, ref=None, ref_labels=None, indices_tuple=None, **kw):
    loss_fn = SPECS[name]["pml"](**kw)
    if ref is None:
        return value_and_grads(lambda e: loss_fn(e, labels, indices_tuple), emb)
    return value_and_grads(
        lambda e, r: loss_fn(e, labels, indices_tuple, ref_emb=r, ref_labels=ref_labels), emb, ref
    )


def data(gen, layout, dtype=F64, scale=1.0):
    labels = lab(layout)
    return randn(gen, len(labels), D, dtype=dtype) * scale, labels


def pml_mined(kind, emb, labels):
    if kind == "pairs":
        return pml_miners.PairMarginMiner(pos_margin=0.4, neg_margin=1.0)(emb, labels)
    return pml_miners.TripletMarginMiner(margin=0.3)(emb, labels)


def _pf_mined(kind, emb, labels):
    if kind == "pair_margin":
        return pf.miners.pair_margin(emb, labels, pos_margin=0.4, neg_margin=1.0)
    if kind == "batch_hard":
        return pf.miners.batch_hard(emb, labels)
    return pf.miners.triplet_margin(emb, labels, margin=0.3)


# test -> whether it applies to a loss's spec; a subclass leaves out those that do not
APPLIES = {
    "test_reference_set_matches_reference": lambda s: s["ref_reference"],
    "test_pml_parity_reference_set": lambda s: s["ref_set"],
    "test_pml_parity_pml_tuples": lambda s: s["tuples"],
    "test_pml_parity_pmlfunc_miner_results": lambda s: s["tuples"],
    "test_pml_parity_distances": lambda s: s["distances"],
    "test_pml_parity_reducers": lambda s: s["reducers"],
    "test_chunked_with_reference_set": (lambda s: s["ref_reference"] and s["unchunkable"] is None),
    "test_tensor_hyperparameters_match_floats": lambda s: s["hp"],
}


EDGE = {
    "one_class": [3, 3, 3, 3],
    "all_distinct": [0, 1, 2, 3],
    "one_sample": [4],
    "duplicates": [0, 0, 1, 1],
}


# ----------------------------------------------------------------------------------------------
# the suite
# ----------------------------------------------------------------------------------------------
class NeighborhoodLoss:
    """The tests of one neighbourhood loss: a subclass sets ``name`` (a key of :data:`SPECS`)."""

    name: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for test, applies in APPLIES.items():
            if not applies(SPECS[cls.name]):
                setattr(cls, test, None)

    def pytest_generate_tests(self, metafunc):
        """The distances and reducers a loss is compared with PML on are its spec's."""
        for arg, key in (("dist", "distances"), ("red", "reducers")):
            if arg in metafunc.fixturenames:
                metafunc.parametrize(arg, SPECS[self.name][key])

    @property
    def hp(self):
        return SPECS[self.name]["hp"]

    # 1. naive reference -----------------------------------------------------------------------
    @pytest.mark.parametrize("layout", ["uneven", "singletons"])
    def test_matches_reference(self, layout, gen):
        emb, labels = data(gen, UNEVEN if layout == "uneven" else SINGLETONS)
        assert_same(
            run_pf(self.name, emb, labels, **self.hp),
            run_ref(self.name, emb, labels, **self.hp),
            **REF_TOL,
        )

    def test_reference_set_matches_reference(self, gen):
        emb, labels = data(gen, UNEVEN)
        ref, ref_labels = randn(gen, len(REF_LABELS), D), lab(REF_LABELS)
        assert_same(
            run_pf(self.name, emb, labels, ref, ref_labels, **self.hp),
            run_ref(self.name, emb, labels, ref, ref_labels, **self.hp),
            **REF_TOL,
        )

    # 2. PML parity ----------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", [F64, F32])
    @pytest.mark.parametrize("layout", ["uneven", "singletons"])
    def test_pml_parity(self, layout, dtype, gen):
        emb, labels = data(gen, UNEVEN if layout == "uneven" else SINGLETONS, dtype)
        assert_same(
            run_pf(self.name, emb, labels, **self.hp),
            run_pml(self.name, emb, labels, **self.hp),
            **TOL[dtype],
        )

    def test_pml_parity_defaults(self, gen):
        emb, labels = data(gen, UNEVEN)
        hp = {"margin": 0.4, "Tn": 10.0} if self.name == "ranked_list" else {}
        assert_same(
            run_pf(self.name, emb, labels, **hp), run_pml(self.name, emb, labels, **hp), **TOL[F64]
        )

    @pytest.mark.parametrize("dtype", [F64, F32])
    def test_pml_parity_reference_set(self, dtype, gen):
        emb, labels = data(gen, UNEVEN, dtype)
        ref, ref_labels = randn(gen, len(REF_LABELS), D, dtype=dtype), lab(REF_LABELS)
        assert_same(
            run_pf(self.name, emb, labels, ref, ref_labels, **self.hp),
            run_pml(self.name, emb, labels, ref, ref_labels, **self.hp),
            **TOL[dtype],
        )

    @pytest.mark.parametrize("dtype", [F64, F32])
    @pytest.mark.parametrize("kind", ["pairs", "triplets"])
    def test_pml_parity_pml_tuples(self, kind, dtype, gen):
        emb, labels = data(gen, UNEVEN, dtype)
        tup = pml_mined(kind, emb, labels)
        assert len(tup[0]) > 0
        got = run_pf(self.name, emb, labels, indices_tuple=tup, **self.hp)
        want = run_pml(self.name, emb, labels, indices_tuple=tup, **self.hp)
        assert_same(got, want, **TOL[dtype])
        if dtype == F64:
            want = run_ref(self.name, emb, labels, indices_tuple=tup, **self.hp)
            assert_same(got, want, **REF_TOL)

    @pytest.mark.parametrize("dtype", [F64, F32])
    @pytest.mark.parametrize("kind", ["pair_margin", "batch_hard", "triplet_window"])
    def test_pml_parity_pmlfunc_miner_results(self, kind, dtype, gen):
        # (triplet_window with nca checks the triplet-list sample counts of convert_to_weights)
        emb, labels = data(gen, UNEVEN, dtype)
        mined = _pf_mined(kind, emb, labels)
        got = run_pf(self.name, emb, labels, indices_tuple=mined, **self.hp)
        want = run_pml(self.name, emb, labels, indices_tuple=mined.to_indices(), **self.hp)
        assert_same(got, want, **TOL[dtype])

    @pytest.mark.parametrize("dtype", [F64, F32])
    def test_pml_parity_distances(self, dist, dtype, gen):
        emb, labels = data(gen, UNEVEN, dtype)
        pf_d, pml_d, _ = DISTANCES[dist]
        got = run_pf(self.name, emb, labels, distance=pf_d(), **self.hp)
        want = run_pml(self.name, emb, labels, distance=pml_d(), **self.hp)
        assert_same(got, want, **TOL[dtype])

    def test_pml_parity_reducers(self, red, gen):
        emb, labels = data(gen, UNEVEN)
        pf_r, pml_r, _ = REDUCERS[red]
        got = run_pf(self.name, emb, labels, reducer=pf_r(), **self.hp)
        assert_same(got, run_pml(self.name, emb, labels, reducer=pml_r(), **self.hp), **TOL[F64])

    # 3. chunked -------------------------------------------------------------------------------
    def test_chunked_value_and_grad_equals_full(self, gen):
        emb, labels = data(gen, UNEVEN)
        fn, why = SPECS[self.name]["fn"], SPECS[self.name]["unchunkable"]
        if why is not None:
            with pytest.raises(ValueError, match=why):
                pf.chunked.value_and_grad(fn, chunk_size=4)(emb, labels)
            return
        vg = pf.chunked.value_and_grad(functools.partial(fn, **self.hp), chunk_size=4)
        loss, grad = vg(emb, labels)
        want = run_pf(self.name, emb, labels, **self.hp)
        assert_same((loss, [grad]), want, rtol=1e-10, atol=1e-12)

    def test_chunked_with_reference_set(self, gen):
        emb, labels = data(gen, UNEVEN)
        ref, ref_labels = randn(gen, len(REF_LABELS), D), lab(REF_LABELS)
        vg = pf.chunked.value_and_grad(
            functools.partial(SPECS[self.name]["fn"], **self.hp),
            chunk_size=3,
            wrt=("embeddings", "ref_emb"),
        )
        loss, grads = vg(emb, labels, ref_emb=ref, ref_labels=ref_labels)
        want = run_pf(self.name, emb, labels, ref, ref_labels, **self.hp)
        assert_same((loss, list(grads)), want, rtol=1e-10, atol=1e-12)

    # 4. edge cases, low precision, tensor hyper-parameters ------------------------------------
    @pytest.mark.parametrize("edge", list(EDGE))
    def test_edge_cases_finite_and_match_reference(self, edge, gen):
        emb, labels = data(gen, EDGE[edge])
        if edge == "duplicates":
            emb = torch.cat([emb[:1], emb[:1], emb[2:3], emb[2:3]])
        got = run_pf(self.name, emb, labels, **self.hp)
        assert torch.isfinite(got[0]) and torch.isfinite(got[1][0]).all()
        if edge != "duplicates":  # cosine/normalised-Euclidean gradients differ at d = 0
            assert_same(got, run_ref(self.name, emb, labels, **self.hp), **REF_TOL)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_low_precision(self, dtype, gen):
        emb, labels = data(gen, UNEVEN)
        fn = SPECS[self.name]["fn"]
        low = fn(emb.to(dtype), labels, **self.hp)
        full = fn(emb.to(dtype).to(F32), labels, **self.hp)
        assert low.dtype == loss_dtype(dtype)
        torch.testing.assert_close(low.float(), full, rtol=1e-2, atol=1e-2)

    def test_tensor_hyperparameters_match_floats(self, gen):
        emb, labels = data(gen, UNEVEN)
        fn = SPECS[self.name]["fn"]
        as_t = {k: torch.tensor(v, dtype=F64) for k, v in self.hp.items()}
        torch.testing.assert_close(fn(emb, labels, **as_t), fn(emb, labels, **self.hp), **REF_TOL)
