"""The suite of the five core losses: ``contrastive``, ``triplet_margin``, ``ntxent``, ``supcon``,
``multi_similarity``.

A core loss's test class (in the test file of its family module) derives from :class:`CoreLoss`
and names the loss. Each loss is checked against
  * a naive float64 loop reference (``tests/reference/``), values and gradients;
  * pytorch-metric-learning 2.9.0, values and full gradients, float64 and float32, on every
    distance, index tuple and reference set (reducers: tests/test_labels_reducers.py);
  * ``torch.autograd.gradcheck`` on other distances, ``torch.func.vmap``, a tensor
    hyper-parameter under ``torch.compile(fullgraph=True)`` (the properties every loss keeps:
    tests/test_conformance.py);
  * permutation/relabelling invariance, legal edge cases, ``mat=`` and bad input.

Known deliberate deviations from PML 2.9.0 (tested against the reference instead of PML):
  (a) ``triplet_margin``'s default margin is 0.2 (PML 2.9.0: 0.05);
  (b) PML returns 0 when every pair-index list has length <= 1; pmlfunc computes the loss;
  (c) ``swap=True`` with ``ref_emb``: pmlfunc uses ``distance(ref_emb, ref_emb)`` for p-n;
  (d) ``per_anchor`` with a reference set: PML builds a B x B array (PML parity in self mode
      only; a reference set larger than the batch is compared to the loop reference).
Found while writing this suite (PML bug, not a deviation to copy): PML's ``MultiSimilarityLoss``
returns per-anchor losses of shape (B, 1), so ``ClassWeightedReducer`` broadcasts them to (B, B)
and computes mean(loss) * mean(weights[labels]); that combination is compared to the reference.
"""

from __future__ import annotations

import functools

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from reference import pair_weighting, pairs, softmax, triplets

import pmlfunc.distances as pfd
import pmlfunc.losses as pfl

LOSSES = ["contrastive", "triplet_margin", "ntxent", "supcon", "multi_similarity"]

# name -> the float64 loop reference (tests/reference/)
REFERENCE = {
    "contrastive": pairs.contrastive,
    "triplet_margin": triplets.triplet_margin,
    "ntxent": softmax.ntxent,
    "supcon": softmax.supcon,
    "multi_similarity": pair_weighting.multi_similarity,
}
PML_CLASS = {
    "contrastive": pml_losses.ContrastiveLoss,
    "triplet_margin": pml_losses.TripletMarginLoss,
    "ntxent": pml_losses.NTXentLoss,
    "supcon": pml_losses.SupConLoss,
    "multi_similarity": pml_losses.MultiSimilarityLoss,
}

# Non-default hyper-parameters used in comparisons (margin always explicit: deviation (a)).
HP = {
    "contrastive": {"pos_margin": 0.1, "neg_margin": 0.8},
    "triplet_margin": {"margin": 0.2},
    "ntxent": {"temperature": 0.3},
    "supcon": {"temperature": 0.3},
    "multi_similarity": {"alpha": 2.0, "beta": 10.0, "base": 0.5},
}

# Documented defaults (docs/api-core.md); the reference functions use PML's semantics.
DEFAULTS = {
    "contrastive": {"pos_margin": 0.0, "neg_margin": 1.0},
    "triplet_margin": {"margin": 0.2, "swap": False, "smooth_loss": False},
    "ntxent": {"temperature": 0.07},
    "supcon": {"temperature": 0.1},
    "multi_similarity": {"alpha": 2.0, "beta": 50.0, "base": 0.5},
}
DEFAULT_DISTANCE = {
    "contrastive": ("lp", {}),
    "triplet_margin": ("lp", {}),
    "ntxent": ("cosine", {}),
    "supcon": ("cosine", {}),
    "multi_similarity": ("cosine", {}),
}
DEFAULT_REDUCER = {
    "contrastive": ("avg_nonzero", {}),
    "triplet_margin": ("avg_nonzero", {}),
    "ntxent": ("mean", {}),
    "supcon": ("avg_nonzero", {}),
    "multi_similarity": ("mean", {}),
}

# name -> (pmlfunc factory, PML factory, reference spec)
DISTANCES = {
    "lp": (lambda: pfd.lp(), lambda: pml_distances.LpDistance(), ("lp", {})),
    "lp_sq": (
        lambda: pfd.lp(power=2),
        lambda: pml_distances.LpDistance(power=2),
        ("lp", {"power": 2}),
    ),
    "lp_raw": (
        lambda: pfd.lp(normalize=False),
        lambda: pml_distances.LpDistance(normalize_embeddings=False),
        ("lp", {"normalize": False}),
    ),
    "lp_p1": (lambda: pfd.lp(p=1), lambda: pml_distances.LpDistance(p=1), ("lp", {"p": 1})),
    "cosine": (lambda: pfd.cosine(), lambda: pml_distances.CosineSimilarity(), ("cosine", {})),
    "dot": (
        lambda: pfd.dot(),
        lambda: pml_distances.DotProductSimilarity(normalize_embeddings=False),
        ("dot", {}),
    ),
    "snr": (lambda: pfd.snr(), lambda: pml_distances.SNRDistance(), ("snr", {})),
}

LAYOUTS = {
    "uneven": UNEVEN,
    "two_classes": [0, 1, 0, 1, 1, 0, 0, 1],
    "all_same": [2, 2, 2, 2, 2, 2],
    "all_distinct": [0, 1, 2, 3, 4, 5],
    "pairs_and_singletons": [5, 5, 1, 7, 7, 3],
}

REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL = {F64: {"rtol": 1e-7, "atol": 1e-10}, F32: {"rtol": 2e-4, "atol": 2e-6}}


# ----------------------------------------------------------------------------------------------
# runners
# ----------------------------------------------------------------------------------------------
def pf_loss(name):
    return getattr(pfl, name)


def pml_reducer_kwargs(reducer):
    return {} if reducer is None else {"reducer": reducer}


def run_pml(
    name,
    emb,
    labels,
    *,
    ref=None,
    ref_labels=None,
    distance=None,
    reducer=None,
    indices_tuple=None,
    **hp,
):
    loss_fn = PML_CLASS[name](
        **hp, **({} if distance is None else {"distance": distance}), **pml_reducer_kwargs(reducer)
    )
    if ref is None:
        return value_and_grads(lambda e: loss_fn(e, labels, indices_tuple=indices_tuple), emb)
    return value_and_grads(
        lambda e, r: loss_fn(
            e, labels, indices_tuple=indices_tuple, ref_emb=r, ref_labels=ref_labels
        ),
        emb,
        ref,
    )


def run_pf(name, emb, labels, *, ref=None, ref_labels=None, **kw):
    fn = pf_loss(name)
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb)
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb, ref
    )


def run_ref(name, emb, labels, *, ref=None, ref_labels=None, **kw):
    fn = REFERENCE[name]
    emb = emb.to(F64)
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb)
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb, ref.to(F64)
    )


def indices(kind, emb, labels, gen, ref=None, ref_labels=None):
    """A PML index tuple of ``kind``: all pairs, a random subset, or a PML miner's result."""
    if kind == "all_pairs":
        return lmu.get_all_pairs_indices(labels, ref_labels)
    if kind == "pair_subset":
        a1, p, a2, n = lmu.get_all_pairs_indices(labels, ref_labels)
        keep_p = torch.randperm(len(a1), generator=gen)[: max(2, len(a1) // 2)]
        keep_n = torch.randperm(len(a2), generator=gen)[: max(2, len(a2) // 3)]
        return a1[keep_p], p[keep_p], a2[keep_n], n[keep_n]
    if kind == "triplet_margin_miner":
        miner = pml_miners.TripletMarginMiner(margin=0.3)
        return miner(
            emb.detach().to(F64), labels, None if ref is None else ref.detach().to(F64), ref_labels
        )
    if kind == "batch_hard":
        return pml_miners.BatchHardMiner()(emb.detach().to(F64), labels)
    raise ValueError(kind)


def assert_near_duplicate_rows_match_float64(name, gen, **hp):
    """Rows 1e-3 apart: the ||a||^2 + ||b||^2 - 2ab expansion alone would lose every digit in
    float32; values and gradients must still match float64 on the same inputs."""
    base = randn(gen, 5, 16)
    emb = torch.cat([base, base + 1e-3 * randn(gen, 5, 16)]).to(F32)
    labels = lab([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    for dist in ("lp", "lp_raw"):
        pf_dist, _, ref_dist = DISTANCES[dist]
        got = run_pf(name, emb, labels, distance=pf_dist(), **hp)
        want = run_ref(name, emb, labels, distance=ref_dist, **hp)
        assert got[0].dtype == F32
        assert_same((got[0].to(F64), [g.to(F64) for g in got[1]]), want, rtol=2e-3, atol=1e-5)


INDEX_KINDS = ["all_pairs", "pair_subset", "triplet_margin_miner", "batch_hard"]


def _bad_cases():
    e = torch.randn(6, 4)
    y = lab([0, 0, 1, 1, 2, 2])
    r = torch.randn(5, 4)
    ry = lab([0, 1, 2, 0, 1])
    return {
        "emb_1d": ((torch.randn(6), y), {}, ValueError, ("embeddings",)),
        "emb_3d": ((torch.randn(6, 4, 2), y), {}, ValueError, ("embeddings",)),
        "labels_2d": ((e, y[:, None]), {}, ValueError, ("labels",)),
        "labels_len": ((e, y[:5]), {}, ValueError, ("labels",)),
        "labels_float": ((e, y.float()), {}, TypeError, ("labels",)),
        "ref_emb_without_ref_labels": (
            (e, y),
            {"ref_emb": r},
            (ValueError, TypeError),
            ("ref_labels",),
        ),
        "ref_emb_width": (
            (e, y),
            {"ref_emb": torch.randn(5, 3), "ref_labels": ry},
            ValueError,
            ("ref_emb",),
        ),
        "ref_labels_len": (
            (e, y),
            {"ref_emb": r, "ref_labels": ry[:4]},
            ValueError,
            ("ref_labels",),
        ),
        "no_labels_no_indices": (
            (e, None),
            {},
            (ValueError, TypeError),
            ("labels", "indices_tuple"),
        ),
        "empty_batch": ((torch.randn(0, 4), lab([])), {}, ValueError, ("embeddings",)),
        "mat_shape": ((e, y), {"mat": torch.randn(6, 5)}, ValueError, ("mat",)),
        "mat_shape_ref": (
            (e, y),
            {"ref_emb": r, "ref_labels": ry, "mat": torch.randn(6, 6)},
            ValueError,
            ("mat",),
        ),
        "reducer_object": ((e, y), {"reducer": object()}, TypeError, ("reducer",)),
        "reducer_string": ((e, y), {"reducer": "mean"}, TypeError, ("reducer",)),
        "pml_reducer": ((e, y), {"reducer": pml_reducers.MeanReducer()}, TypeError, ("reducer",)),
    }


@st.composite
def problems(draw):
    b = draw(st.integers(2, 8))
    labels = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    perm = draw(st.permutations(range(b)))
    new_values = draw(st.lists(st.integers(0, 10**9), min_size=4, max_size=4, unique=True))
    seed = draw(st.integers(0, 2**31 - 1))
    return labels, perm, new_values, seed


# ----------------------------------------------------------------------------------------------
# the suite
# ----------------------------------------------------------------------------------------------
class CoreLoss:
    """The tests of one core loss: a subclass sets ``name`` (one of :data:`LOSSES`) and
    ``hyper``, the hyper-parameter given as a 0-d tensor to the compiled loss."""

    name: str
    hyper: str

    # 1. naive float64 reference ---------------------------------------------------------------
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    @pytest.mark.parametrize("dist", list(DISTANCES))
    def test_matches_reference(self, dist, layout, gen):
        labels = lab(LAYOUTS[layout])
        emb = randn(gen, len(labels), 6)
        pf_dist, _, ref_dist = DISTANCES[dist]
        got = run_pf(self.name, emb, labels, distance=pf_dist(), **HP[self.name])
        want = run_ref(self.name, emb, labels, distance=ref_dist, **HP[self.name])
        assert_same(got, want, **REF_TOL)

    @pytest.mark.parametrize("dist", list(DISTANCES))
    def test_matches_reference_with_ref_set(self, dist, gen):
        labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
        emb, ref = randn(gen, len(labels), 6), randn(gen, len(ref_labels), 6)
        pf_dist, _, ref_dist = DISTANCES[dist]
        kw = {"ref": ref, "ref_labels": ref_labels, **HP[self.name]}
        got = run_pf(self.name, emb, labels, distance=pf_dist(), **kw)
        want = run_ref(self.name, emb, labels, distance=ref_dist, **kw)
        assert_same(got, want, **REF_TOL)

    @pytest.mark.parametrize("layout", ["uneven", "two_classes", "pairs_and_singletons"])
    def test_defaults_match_documented_defaults(self, layout, gen):
        """Called with nothing but (embeddings, labels), each loss uses the documented defaults."""
        name = self.name
        labels = lab(LAYOUTS[layout])
        emb = randn(gen, len(labels), 6)
        got = run_pf(name, emb, labels)
        want = run_ref(
            name,
            emb,
            labels,
            distance=DEFAULT_DISTANCE[name],
            reducer=DEFAULT_REDUCER[name],
            **DEFAULTS[name],
        )
        assert_same(got, want, **REF_TOL)

    def test_degenerate_pairs_compute_actual_loss(self, gen):
        """Deviation (b): one positive and one negative pair. PML returns 0; pmlfunc the real
        loss."""
        name = self.name
        emb = randn(gen, 3, 6)
        labels = lab([0, 0, 1])
        it = (lab([0]), lab([1]), lab([0]), lab([2]))
        got = run_pf(name, emb, labels, indices_tuple=it, **HP[name])
        want = run_ref(name, emb, labels, indices_tuple=it, **HP[name])
        assert want[0].abs() > 1e-3, "reference loss should be non-trivial here"
        assert_same(got, want, **REF_TOL)
        # same situation from labels with a reference set: query 1 row, ref 2 rows
        ref, ref_labels = randn(gen, 2, 6), lab([0, 1])
        got = run_pf(name, emb[:1], labels[:1], ref=ref, ref_labels=ref_labels, **HP[name])
        want = run_ref(name, emb[:1], labels[:1], ref=ref, ref_labels=ref_labels, **HP[name])
        assert want[0].abs() > 1e-3
        assert_same(got, want, **REF_TOL)

    def test_hyperparameters_as_tensors_match_reference_and_get_gradients(self, gen):
        name = self.name
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 6)
        keys = [k for k, v in HP[name].items() if isinstance(v, float)]
        vals = [torch.tensor(HP[name][k], dtype=F64) for k in keys]

        def call(fn):
            return lambda e, *hp: fn(e, labels, **dict(zip(keys, hp, strict=True)))

        got = value_and_grads(call(pf_loss(name)), emb, *vals)
        want = value_and_grads(call(REFERENCE[name]), emb, *vals)
        assert_same(got, want, **REF_TOL)
        # a Python number gives the same value
        torch.testing.assert_close(
            pf_loss(name)(emb, labels, **HP[name]), got[0], rtol=0, atol=1e-15
        )

    # 2. PML 2.9.0 parity ----------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
    @pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
    @pytest.mark.parametrize("dist", list(DISTANCES))
    def test_pml_parity_distances(self, dist, with_ref, dtype, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 8, dtype=dtype)
        kw = {}
        if with_ref:
            kw = {"ref": randn(gen, len(REF_LABELS), 8, dtype=dtype), "ref_labels": lab(REF_LABELS)}
        pf_dist, pml_dist, _ = DISTANCES[dist]
        got = run_pf(self.name, emb, labels, distance=pf_dist(), **kw, **HP[self.name])
        want = run_pml(self.name, emb, labels, distance=pml_dist(), **kw, **HP[self.name])
        assert_same(got, want, **TOL[dtype])

    @pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
    @pytest.mark.parametrize("kind", INDEX_KINDS)
    def test_pml_parity_indices_tuple(self, kind, dtype, gen):
        name = self.name
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 8, dtype=dtype)
        it = indices(kind, emb, labels, gen)
        assert all(len(x) > 1 for x in it), "keep clear of deviation (b)"
        got = run_pf(name, emb, labels, indices_tuple=it, **HP[name])
        want = run_pml(name, emb, labels, indices_tuple=it, **HP[name])
        assert_same(got, want, **TOL[dtype])
        # labels are not needed once pairs are given
        got_none = run_pf(name, emb, None, indices_tuple=it, **HP[name])
        assert_same(got_none, want, **TOL[dtype])

    @pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
    @pytest.mark.parametrize("kind", ["all_pairs", "pair_subset", "triplet_margin_miner"])
    def test_pml_parity_indices_tuple_with_ref_set(self, kind, dtype, gen):
        name = self.name
        labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
        emb = randn(gen, len(labels), 8, dtype=dtype)
        ref = randn(gen, len(ref_labels), 8, dtype=dtype)
        it = indices(kind, emb, labels, gen, ref, ref_labels)
        assert all(len(x) > 1 for x in it)
        kw = {"ref": ref, "ref_labels": ref_labels, "indices_tuple": it, **HP[name]}
        assert_same(run_pf(name, emb, labels, **kw), run_pml(name, emb, labels, **kw), **TOL[dtype])

    # 3. gradcheck, torch.func, torch.compile --------------------------------------------------
    @pytest.mark.parametrize("dist", ["lp_sq", "dot", "snr"])
    def test_gradcheck_other_distances(self, dist, gen):
        labels = lab([0, 0, 1, 1, 1, 2, 3, 3])
        emb = randn(gen, 8, 5).requires_grad_(True)
        d = DISTANCES[dist][0]()
        assert torch.autograd.gradcheck(
            lambda e: pf_loss(self.name)(e, labels, distance=d, **HP[self.name]), (emb,)
        )

    def test_vmap_over_independent_problems(self, gen):
        labels = torch.stack(
            [
                lab([0, 0, 1, 1, 1, 2, 3, 3]),
                lab([4, 1, 1, 4, 4, 4, 0, 2]),
                lab([0, 1, 0, 1, 0, 1, 0, 1]),
            ]
        )
        emb = randn(gen, 3, 8, 6)
        fn = functools.partial(pf_loss(self.name), **HP[self.name])
        values = torch.func.vmap(fn)(emb, labels)
        grads = torch.func.vmap(torch.func.grad(fn))(emb, labels)
        assert values.shape == (3,) and grads.shape == emb.shape
        for k in range(3):
            v, (g,) = value_and_grads(lambda e, k=k: fn(e, labels[k]), emb[k])
            torch.testing.assert_close(values[k], v, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-14)
        assert not torch.allclose(values[0], values[1])

    def test_vmap_with_shared_labels_and_batched_cotangent(self, gen):
        """Only the embeddings batched (labels shared), and vmap over the cotangent of a vjp: the
        unbatched masks meet batched values inside the custom autograd functions."""
        labels = lab(UNEVEN)
        emb = randn(gen, 3, len(labels), 6)
        fn = functools.partial(pf_loss(self.name), **HP[self.name])
        values = torch.func.vmap(fn, in_dims=(0, None))(emb, labels)
        grads = torch.func.vmap(torch.func.grad(fn), in_dims=(0, None))(emb, labels)
        for k in range(3):
            v, (g,) = value_and_grads(lambda e, k=k: fn(e, labels), emb[k])
            torch.testing.assert_close(values[k], v, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-14)
        _, vjp = torch.func.vjp(lambda e: fn(e, labels), emb[0])
        cot = torch.tensor([1.0, -2.0, 0.5], dtype=emb.dtype)
        (batched,) = torch.func.vmap(vjp)(cot)
        (_, (g0,)) = value_and_grads(lambda e: fn(e, labels), emb[0])
        torch.testing.assert_close(batched, cot[:, None, None] * g0, rtol=1e-10, atol=1e-12)

    @pytest.mark.compile
    def test_compile_tensor_hyperparameter_does_not_recompile(self, gen):
        from torch._dynamo.testing import CompileCounter

        torch._dynamo.reset()
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 6, dtype=F32)
        counter = CompileCounter()

        def f(e, t):
            return pf_loss(self.name)(e, labels, **{self.hyper: t})

        compiled = torch.compile(f, fullgraph=True, backend=counter)
        outs = []
        for value in (0.1, 0.25, 0.5):
            t = torch.tensor(value)
            out = compiled(emb, t)
            torch.testing.assert_close(out, f(emb, t), rtol=1e-5, atol=1e-6)
            outs.append(out)
        assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
        assert not torch.allclose(outs[0], outs[2]), "the hyper-parameter must reach the graph"
        torch._dynamo.reset()

    # 4. invariances (hypothesis) --------------------------------------------------------------
    # one test run by each core loss's class: a different executor per class, on purpose
    @settings(
        max_examples=25, deadline=None, suppress_health_check=[HealthCheck.differing_executors]
    )
    @given(problem=problems())
    def test_invariant_to_permutation_and_relabelling(self, problem):
        labels, perm, new_values, seed = problem
        g = torch.Generator().manual_seed(seed)
        emb = torch.randn(len(labels), 5, generator=g, dtype=F64)
        labels = lab(labels)
        perm = lab(perm)
        fn = functools.partial(pf_loss(self.name), **HP[self.name])
        base = fn(emb, labels)
        assert torch.isfinite(base)
        torch.testing.assert_close(fn(emb[perm], labels[perm]), base, rtol=1e-10, atol=1e-12)
        relabelled = lab(new_values)[labels]
        torch.testing.assert_close(fn(emb, relabelled), base, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fn(emb[perm], relabelled[perm]), base, rtol=1e-10, atol=1e-12)

    # 5. legal edge cases ----------------------------------------------------------------------
    @pytest.mark.parametrize("layout", list(EDGE_LAYOUTS))
    def test_edge_layouts_finite_and_match_reference(self, layout, gen):
        labels = lab(EDGE_LAYOUTS[layout])
        emb = randn(gen, len(labels), 4)
        fn = pf_loss(self.name)
        got = finite(lambda e: fn(e, labels, **HP[self.name]), emb)
        want = run_ref(self.name, emb, labels, **HP[self.name])
        assert_same(got, want, **REF_TOL)

    @pytest.mark.parametrize("dist", ["lp", "lp_sq", "cosine", "snr"])
    def test_duplicate_rows_finite(self, dist, gen):
        """Identical embeddings (d = 0 for Lp) in the same class and across classes."""
        base = randn(gen, 4, 6)
        emb = torch.cat([base, base[:2], base[1:3]])  # rows 4,5 copy 0,1; rows 6,7 copy 1,2
        labels = lab([0, 1, 2, 3, 0, 1, 5, 2])  # 0~4 and 1~5 positives; 1~6, 2~7 cross-class
        pf_dist, _, ref_dist = DISTANCES[dist]
        fn = pf_loss(self.name)
        value, _ = finite(lambda e: fn(e, labels, distance=pf_dist(), **HP[self.name]), emb)
        want = REFERENCE[self.name](emb, labels, distance=ref_dist, **HP[self.name])
        torch.testing.assert_close(value, want, rtol=1e-7, atol=1e-9)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
    @pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
    def test_low_precision(self, dtype, with_ref, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 16, dtype=dtype)
        fn = pf_loss(self.name)
        hp = dict(HP[self.name])
        tensors, ref_kw = [emb], {}
        if with_ref:
            ref = randn(gen, len(REF_LABELS), 16, dtype=dtype)
            tensors.append(ref)
            ref_kw = {"ref": ref, "ref_labels": lab(REF_LABELS)}

        def f(e, *r):
            if r:
                return fn(e, labels, ref_emb=r[0], ref_labels=lab(REF_LABELS), **hp)
            return fn(e, labels, **hp)

        value, grads = finite(f, *tensors)
        assert value.dtype == loss_dtype(dtype)
        assert all(g.dtype == dtype for g in grads)
        # close to float64 on the same (rounded) inputs
        want, _ = run_ref(self.name, emb, labels, **ref_kw, **hp)
        torch.testing.assert_close(value.to(F64), want, rtol=5e-2, atol=1e-2)

    # 6. bad input -----------------------------------------------------------------------------
    @pytest.mark.parametrize("case", list(_bad_cases()))
    def test_bad_input_raises_naming_argument(self, case):
        args, kw, exc, names = _bad_cases()[case]
        with pytest.raises(exc) as info:
            pf_loss(self.name)(*args, **kw)
        msg = str(info.value)
        assert any(n in msg for n in names), f"message {msg!r} names none of {names}"

    # 7. mat=, purity --------------------------------------------------------------------------
    @pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
    @pytest.mark.parametrize("dist", ["lp", "cosine", "snr"])
    def test_mat_equals_internal(self, dist, with_ref, gen):
        labels = lab(UNEVEN)
        emb = randn(gen, len(labels), 6)
        d = DISTANCES[dist][0]()
        fn = pf_loss(self.name)
        if with_ref:
            ref, ref_labels = randn(gen, len(REF_LABELS), 6), lab(REF_LABELS)
            kw = {"ref_labels": ref_labels, "distance": d, **HP[self.name]}
            got = value_and_grads(
                lambda e, r: fn(e, labels, ref_emb=r, mat=d(e, r), **kw), emb, ref
            )
            want = value_and_grads(lambda e, r: fn(e, labels, ref_emb=r, **kw), emb, ref)
        else:
            kw = {"distance": d, **HP[self.name]}
            got = value_and_grads(lambda e: fn(e, labels, mat=d(e), **kw), emb)
            want = value_and_grads(lambda e: fn(e, labels, **kw), emb)
        assert_same(got, want, rtol=1e-12, atol=1e-14)

    def test_inputs_not_modified_and_int32_labels(self, gen):
        """Pure function: inputs are left untouched; int32 labels give the int64 result."""
        labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
        emb, ref = randn(gen, len(labels), 6), randn(gen, len(ref_labels), 6)
        copies = [t.clone() for t in (emb, labels, ref, ref_labels)]
        it = lmu.get_all_pairs_indices(labels, ref_labels)
        it_copies = [t.clone() for t in it]
        fn = functools.partial(pf_loss(self.name), **HP[self.name])
        out = fn(emb, labels, ref_emb=ref, ref_labels=ref_labels, indices_tuple=it)
        for t, c in zip((emb, labels, ref, ref_labels, *it), copies + it_copies, strict=True):
            assert torch.equal(t, c)
        out32 = fn(emb, labels.int(), ref_emb=ref, ref_labels=ref_labels.int())
        out64 = fn(emb, labels, ref_emb=ref, ref_labels=ref_labels)
        torch.testing.assert_close(out32, out64, rtol=0, atol=0)
        torch.testing.assert_close(out, out64, rtol=1e-12, atol=1e-14)
