"""The suite of the losses that combine an anchor's pairs in a structure (log-sum-exps,
variances, margins): ``lifted_structure``, ``generalized_lifted_structure``, ``circle``,
``tuplet_margin`` (pmlfunc.losses.pair_weighting), ``intra_pair_variance``,
``signal_to_noise_ratio_contrastive`` (pairs) and ``margin`` (triplets).

A structured loss's test class derives from :class:`StructuredLoss` and names the loss by its key
in :data:`PF`. Each loss is checked against a naive float64 loop reference
(``tests/reference/``), against PML 2.9.0 (values and full gradients, float64 and float32; its
reducers in tests/test_labels_reducers.py), on edge cases, low precision and bad input.

Deliberate deviations from PML (tested against the loop reference):
  (a) ``lifted_structure`` with a separate reference set: the positive's negatives are its
      column's negative pairs (PML compares a reference index with query indices);
  (b) ``tuplet_margin`` at ``|cos| >= 1`` (duplicates): finite value and zero gradient (PML NaN);
  (c) PML returns 0 when every pair list has length <= 1; pmlfunc computes the loss;
  (d) PML's ``MarginLoss`` stores beta in float32: float64 parity uses a float32-exact beta.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    EDGE_LAYOUTS,
    F32,
    F64,
    REF_LABELS,
    UNEVEN,
    assert_same,
    finite,
    lab,
    loss_dtype,
    randn,
    value_and_grads,
)
from pytorch_metric_learning import distances as pml_d
from pytorch_metric_learning import losses as pml_l
from pytorch_metric_learning import miners as pml_m
from pytorch_metric_learning import reducers as pml_r
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from reference import pair_weighting, pairs, triplets
from tracking import LargestTensor

import pmlfunc as pf
import pmlfunc.distances as pfd
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    circle,
    generalized_lifted_structure,
    intra_pair_variance,
    lifted_structure,
    margin,
    signal_to_noise_ratio_contrastive,
    tuplet_margin,
)

LAYOUTS = {
    "uneven": UNEVEN,
    "two_classes": [0, 1, 0, 1, 1, 0, 0, 1],
    "pairs_and_singletons": [5, 5, 1, 7, 7, 3],
}
REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL = {F64: {"rtol": 1e-9, "atol": 1e-12}, F32: {"rtol": 2e-4, "atol": 2e-6}}

PF = {
    "lifted_structure": lifted_structure,
    "generalized_lifted_structure": generalized_lifted_structure,
    "circle": circle,
    "intra_pair_variance": intra_pair_variance,
    "tuplet_margin": tuplet_margin,
    "snr_contrastive": signal_to_noise_ratio_contrastive,
    "margin": margin,
}
REF = {
    "lifted_structure": pair_weighting.lifted_structure,
    "generalized_lifted_structure": pair_weighting.generalized_lifted_structure,
    "circle": pair_weighting.circle,
    "intra_pair_variance": pairs.intra_pair_variance,
    "tuplet_margin": pair_weighting.tuplet_margin,
    "snr_contrastive": pairs.signal_to_noise_ratio_contrastive,
    "margin": triplets.margin,
}
PML = {
    "lifted_structure": pml_l.LiftedStructureLoss,
    "generalized_lifted_structure": pml_l.GeneralizedLiftedStructureLoss,
    "circle": pml_l.CircleLoss,
    "intra_pair_variance": pml_l.IntraPairVarianceLoss,
    "tuplet_margin": pml_l.TupletMarginLoss,
    "snr_contrastive": pml_l.SignalToNoiseRatioContrastiveLoss,
    "margin": pml_l.MarginLoss,
}
HP = {
    "lifted_structure": {"neg_margin": 1.2, "pos_margin": 0.1},
    "generalized_lifted_structure": {"neg_margin": 1.2, "pos_margin": 0.1},
    "circle": {"m": 0.3, "gamma": 20.0},
    "intra_pair_variance": {"pos_eps": 0.05, "neg_eps": 0.02},
    "tuplet_margin": {"margin": 8.0, "scale": 16.0},
    "snr_contrastive": {"pos_margin": 0.1, "neg_margin": 0.9},
    "margin": {"margin": 0.25, "beta": 1.25},  # (d): 1.25 is exact in float32
}
NAMES = list(PF)
# name -> (pmlfunc factory, PML factory, reference spec)
DISTANCES = {
    "lp": (pfd.lp, pml_d.LpDistance, ("lp", {})),
    "lp_sq": (lambda: pfd.lp(power=2), lambda: pml_d.LpDistance(power=2), ("lp", {"power": 2})),
    "cosine": (pfd.cosine, pml_d.CosineSimilarity, ("cosine", {})),
    "dot": (
        pfd.dot,
        lambda: pml_d.DotProductSimilarity(normalize_embeddings=False),
        ("dot", {}),
    ),
    "snr": (pfd.snr, pml_d.SNRDistance, ("snr", {})),
}
ALLOWED = {
    "lifted_structure": ["lp", "cosine", "lp_sq"],
    "generalized_lifted_structure": ["lp", "cosine", "lp_sq"],
    "circle": ["cosine"],
    "intra_pair_variance": ["cosine", "lp", "dot"],
    "tuplet_margin": ["cosine"],
    "snr_contrastive": ["snr"],
    "margin": ["lp", "cosine", "lp_sq"],
}


# ----------------------------------------------------------------------------------------------
# runners
# ----------------------------------------------------------------------------------------------
def run(impl, name, emb, labels, *, ref=None, ref_labels=None, **kw):
    """Value and gradients of a pmlfunc (``impl="pf"``) or reference (``"ref"``) call."""
    fn = PF[name] if impl == "pf" else REF[name]
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb)
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb, ref
    )


def run_pml(name, emb, labels, *, ref=None, ref_labels=None, indices_tuple=None, **kw):
    loss_fn = PML[name](**kw)
    if ref is None:
        return value_and_grads(lambda e: loss_fn(e, labels, indices_tuple), emb)
    return value_and_grads(lambda e, r: loss_fn(e, labels, indices_tuple, r, ref_labels), emb, ref)


def dist_kw(name, dist, impl):
    """``distance=`` for pmlfunc / PML / the reference (nothing for the default one)."""
    pf_f, pml_f, ref_spec = DISTANCES[dist]
    return {"distance": {"pf": pf_f, "pml": pml_f}[impl]() if impl != "ref" else ref_spec}


def _subset(labels, gen, ref_labels=None):
    a1, p, a2, n = lmu.get_all_pairs_indices(labels, ref_labels)
    keep_p = torch.randperm(len(a1), generator=gen)[: max(2, len(a1) // 2)]
    keep_n = torch.randperm(len(a2), generator=gen)[: max(2, len(a2) // 3)]
    return a1[keep_p], p[keep_p], a2[keep_n], n[keep_n]


def pml_tuple(kind, emb, labels, ref=None, ref_labels=None):
    """An index tuple of ``kind``: a PML miner's (``pml_*``) or a pmlfunc miner's (``pf_*``)."""
    e = emb.detach().to(F64)
    r = None if ref is None else ref.detach().to(F64)
    if kind == "pml_pairs":
        return pml_m.PairMarginMiner(pos_margin=0.3, neg_margin=1.2)(e, labels, r, ref_labels)
    if kind == "pml_triplets":
        return pml_m.TripletMarginMiner(margin=0.4)(e, labels, r, ref_labels)
    if kind == "pf_pairs":
        return pf.miners.pair_margin(
            e, labels, pos_margin=0.3, neg_margin=1.2, ref_emb=r, ref_labels=ref_labels
        )
    if kind == "pf_batch_hard":
        return pf.miners.batch_hard(e, labels)
    if kind == "pf_window":
        return pf.miners.triplet_margin(e, labels, margin=0.4, ref_emb=r, ref_labels=ref_labels)
    raise ValueError(kind)


TUPLE_KINDS = ["pml_pairs", "pml_triplets", "pf_pairs", "pf_batch_hard", "pf_window"]


def reducers():
    """name -> (pmlfunc reducer, PML reducer)."""
    w = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0], dtype=F64)
    return {
        "mean": (pfr.mean(), pml_r.MeanReducer()),
        "sum": (pfr.sum(), pml_r.SumReducer()),
        "avg_nonzero": (pfr.avg_nonzero(), pml_r.AvgNonZeroReducer()),
        "threshold": (pfr.threshold(0.05, 0.6), pml_r.ThresholdReducer(0.05, 0.6)),
        "class_weighted": (pfr.class_weighted(w), pml_r.ClassWeightedReducer(w)),
        "per_anchor": (pfr.per_anchor(), pml_r.PerAnchorReducer()),
        "divisor": (pfr.divisor(), pml_r.DivisorReducer()),
    }


def assert_no_pair_by_pair_or_triplet_buffers(name, gen, ref=False, **kw):
    """Per-row forms: no tensor larger than two (B, M) blocks is ever created (the Lp kernel's
    exact-recompute gather is B × 8 × D = 3072 here; PML's P × N matrix would hold
    144 × 2112 entries, the triplets 6336)."""
    b, m = 48, 48
    labels = torch.arange(b) // 4
    emb = randn(gen, b, 8).requires_grad_(True)
    if ref:
        kw.update(ref_emb=randn(gen, m, 8).requires_grad_(True), ref_labels=torch.arange(m) // 4)
    with LargestTensor() as rec:
        loss = PF[name](emb, labels, **kw)
        loss.backward()
    assert torch.isfinite(loss)
    assert rec.largest <= 2 * b * m, rec.largest


# ----------------------------------------------------------------------------------------------
# the suite
# ----------------------------------------------------------------------------------------------
class StructuredLoss:
    """The tests of one structured loss: a subclass sets ``name`` (a key of :data:`PF`)."""

    name: str

    # 1. naive float64 reference ---------------------------------------------------------------
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_matches_reference(self, layout, gen):
        name = self.name
        labels = lab(LAYOUTS[layout])
        emb = randn(gen, len(labels), 5)
        for dist in ALLOWED[name][:2]:
            got = run("pf", name, emb, labels, **dist_kw(name, dist, "pf"), **HP[name])
            want = run("ref", name, emb, labels, **dist_kw(name, dist, "ref"), **HP[name])
            assert_same(got, want, **REF_TOL)

    def test_matches_reference_with_ref_set(self, gen):
        labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
        emb, ref = randn(gen, len(labels), 5), randn(gen, len(ref_labels), 5)
        kw = {"ref": ref, "ref_labels": ref_labels, **HP[self.name]}
        assert_same(
            run("pf", self.name, emb, labels, **kw),
            run("ref", self.name, emb, labels, **kw),
            **REF_TOL,
        )

    def test_defaults_match_reference(self, gen):
        """Called with (embeddings, labels) only: PML's defaults (reference defaults are
        PML's)."""
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 5)
        kw = {"beta": 1.2} if self.name == "margin" else {}
        assert_same(
            run("pf", self.name, emb, labels), run("ref", self.name, emb, labels, **kw), **REF_TOL
        )

    @pytest.mark.parametrize("kind", ["pairs", "triplets"])
    def test_matches_reference_with_indices_tuple(self, kind, gen):
        """Repeated pairs (triplets list (a, p) once per negative) must count as in PML."""
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 5)
        if kind == "pairs":
            it = _subset(labels, gen)
        else:
            a, p, n = lmu.get_all_triplets_indices(labels)
            keep = torch.randperm(len(a), generator=gen)[:40]
            it = (a[keep], p[keep], n[keep])
        kw = {"indices_tuple": it, **HP[self.name]}
        assert_same(
            run("pf", self.name, emb, labels, **kw),
            run("ref", self.name, emb, labels, **kw),
            **REF_TOL,
        )

    # 2. PML 2.9.0 parity ----------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
    @pytest.mark.parametrize("mode", ["uneven", "singletons", "ref"])
    def test_pml_parity(self, mode, dtype, gen):
        name = self.name
        if name == "lifted_structure" and mode == "ref":
            pytest.skip("deviation (a): see test_lifted_structure_ref_set_deviation")
        labels = lab([0, 1, 1, 2, 3, 3, 3, 4, 5, 5] if mode == "singletons" else UNEVEN)
        emb = randn(gen, len(labels), 8, dtype=dtype)
        kw = {}
        if mode == "ref":
            kw = {"ref": randn(gen, len(REF_LABELS), 8, dtype=dtype), "ref_labels": lab(REF_LABELS)}
        for dist in ALLOWED[name][:2]:
            got = run("pf", name, emb, labels, **dist_kw(name, dist, "pf"), **kw, **HP[name])
            want = run_pml(name, emb, labels, **dist_kw(name, dist, "pml"), **kw, **HP[name])
            assert_same(got, want, **TOL[dtype])

    @pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
    @pytest.mark.parametrize("kind", TUPLE_KINDS)
    def test_pml_parity_indices_tuple(self, kind, dtype, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 8, dtype=dtype)
        it = pml_tuple(kind, emb, labels)
        pml_it = it.to_indices() if kind.startswith("pf") else it
        assert all(len(x) > 1 for x in pml_it), "keep clear of deviation (c)"
        got = run("pf", self.name, emb, labels, indices_tuple=it, **HP[self.name])
        want = run_pml(self.name, emb, labels, indices_tuple=pml_it, **HP[self.name])
        assert_same(got, want, **TOL[dtype])

    @pytest.mark.parametrize("kind", ["pml_pairs", "pml_triplets", "pf_pairs", "pf_window"])
    def test_pml_parity_indices_tuple_with_ref_set(self, kind, gen):
        labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
        emb, ref = randn(gen, len(labels), 8), randn(gen, len(ref_labels), 8)
        it = pml_tuple(kind, emb, labels, ref, ref_labels)
        pml_it = it.to_indices() if kind.startswith("pf") else it
        kw = {"ref": ref, "ref_labels": ref_labels, **HP[self.name]}
        got = run("pf", self.name, emb, labels, indices_tuple=it, **kw)
        want = run_pml(self.name, emb, labels, indices_tuple=pml_it, **kw)
        assert_same(got, want, **TOL[F64])

    # 3. tensor hyper-parameters ---------------------------------------------------------------
    def test_tensor_hyperparameters_equal_numbers_and_get_gradients(self, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 6)
        hp = HP[self.name]
        value = PF[self.name](emb, labels, **hp)
        keys = list(hp)
        vals = [torch.tensor(float(hp[k]), dtype=F64, requires_grad=True) for k in keys]
        out = PF[self.name](emb, labels, **dict(zip(keys, vals, strict=True)))
        torch.testing.assert_close(out, value, rtol=1e-12, atol=1e-14)
        grads = torch.autograd.grad(out, vals, allow_unused=True)
        assert any(g is not None and g.abs() > 0 for g in grads)

    # 4. edge cases ----------------------------------------------------------------------------
    @pytest.mark.parametrize("layout", list(EDGE_LAYOUTS))
    def test_edge_layouts(self, layout, gen):
        labels = lab(EDGE_LAYOUTS[layout])
        emb = randn(gen, len(labels), 4)
        got = finite(lambda e: PF[self.name](e, labels, **HP[self.name]), emb)
        assert_same(got, run("ref", self.name, emb, labels, **HP[self.name]), **REF_TOL)

    def test_duplicate_rows_finite(self, gen):
        """Identical rows in one class and across classes: d = 0, cos = 1 (deviation (b))."""
        base = randn(gen, 4, 6)
        emb = torch.cat([base, base[:2], base[1:3]])
        labels = lab([0, 1, 2, 3, 0, 1, 5, 2])
        value, _ = finite(lambda e: PF[self.name](e, labels, **HP[self.name]), emb)
        want = REF[self.name](emb, labels, **HP[self.name])
        torch.testing.assert_close(value, want, rtol=1e-7, atol=1e-9)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
    def test_low_precision(self, dtype, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 16, dtype=dtype)
        value, (g,) = finite(lambda e: PF[self.name](e, labels, **HP[self.name]), emb)
        assert value.dtype == loss_dtype(dtype) and g.dtype == dtype
        want = PF[self.name](emb.to(F64), labels, **HP[self.name])
        torch.testing.assert_close(value.to(F64), want, rtol=5e-2, atol=1e-2)

    # 5. bad input -----------------------------------------------------------------------------
    def test_bad_input_raises_naming_argument(self):
        e, y = torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2])
        fn = PF[self.name]
        with pytest.raises(ValueError, match="embeddings"):
            fn(torch.randn(6), y)
        with pytest.raises(ValueError, match="labels"):
            fn(e, y[:5])
        with pytest.raises(TypeError, match="labels"):
            fn(e, y.float())
        with pytest.raises(ValueError, match="ref_labels"):
            fn(e, y, ref_emb=torch.randn(5, 4))
        with pytest.raises(TypeError, match="reducer"):
            fn(e, y, reducer="mean")
        with pytest.raises(ValueError, match="mat"):
            fn(e, y, mat=torch.randn(6, 5))
        key = next(iter(HP[self.name]))
        with pytest.raises(TypeError, match=key):
            fn(e, y, **{key: "x"})
        with pytest.raises(ValueError, match=key):
            fn(e, y, **{key: torch.ones(2)})
