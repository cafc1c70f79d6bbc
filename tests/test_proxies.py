"""Tests for the proxy / classifier losses of ``pmlfunc.losses.proxies``.

Every loss is checked against
  * a naive float64 loop reference (tests/reference/proxies.py; values, gradients w.r.t.
    embeddings and params);
  * pytorch-metric-learning 2.9.0 (values, embedding and parameter gradients; float64 and float32;
    several label layouts, classes absent from the batch, hyper-parameters, distances, reducers,
    mined index tuples), our parameters copied into PML's parameter in PML's layout;
  * ``torch.func.vmap``, one compiled training step, tensor hyper-parameters, |cos| = 1,
    float16/bfloat16, bad input and the ``*_init`` schemes. The properties every loss keeps
    (gradcheck, torch.func.grad over the params dict, compile, the meta device, a docstring
    example) are in test_conformance.py.

Deliberate deviations from PML 2.9.0 (tested against the reference, not PML):
  (a) ``proxy_anchor`` with ``class_weighted``: PML weights proxy ``c``'s term by the class of
      batch sample ``c`` (``labels[arange(C)]``); pmlfunc weights it by class ``c``.
  (b) ``p2s_grad``: PML renormalises its weight in place; pmlfunc leaves params untouched and
      uses the renormalised weight in the forward with a straight-through gradient (so its weight
      gradient is PML's, not the derivative through the normalisation: gradcheck covers the
      embeddings only, and the weight gradient is compared at the renormalised weight).
  (c) ``p2s_grad`` with a non-default reducer: PML ignores it (already reduced); pmlfunc reduces
      the per-sample terms.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import loss_dtype
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from reference import proxies as proxies_ref

import pmlfunc.distances as pfd
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    normalized_softmax,
    normalized_softmax_init,
    p2s_grad,
    p2s_grad_init,
    proxy_anchor,
    proxy_anchor_init,
    proxy_nca,
    proxy_nca_init,
    soft_triple,
    soft_triple_init,
)

F64, F32 = torch.float64, torch.float32
TOL = {F64: {"rtol": 1e-7, "atol": 1e-10}, F32: {"rtol": 2e-4, "atol": 2e-6}}
REF_TOL = {"rtol": 1e-9, "atol": 1e-12}

C, D, K = 6, 5, 3  # classes, embedding size, SoftTriple centres per class
LAYOUTS = {
    "uneven": [0, 0, 0, 1, 1, 2, 4, 4, 4, 4, 1],  # classes 3 and 5 absent
    "all_same": [2, 2, 2, 2, 2],
    "all_distinct": [5, 0, 3, 1, 4, 2],
    "one_sample": [3],
    "last_class_only_once": [5, 0, 0, 1, 1, 1, 0],
}
UNEVEN = LAYOUTS["uneven"]


def _ns_to_pml(w):
    return w.t()


def _st_to_pml(w):
    return w.reshape(-1, w.shape[-1]).t()


def _st_from_pml(g):
    return g.t().reshape(C, K, D)


SPECS = {
    "proxy_anchor": {
        "fn": proxy_anchor,
        "init": proxy_anchor_init,
        "key": "proxies",
        "pml": lambda **kw: pml_losses.ProxyAnchorLoss(C, D, **kw),
        "attr": "proxies",
        "to_pml": lambda t: t,
        "from_pml": lambda t: t,
        "hp": [{}, {"margin": 0.2, "alpha": 16.0}, {"margin": -0.05, "alpha": 4.0}],
        "distances": ["cosine", "lp", "lp_sq", "dot"],
    },
    "proxy_nca": {
        "fn": proxy_nca,
        "init": proxy_nca_init,
        "key": "proxies",
        "pml": lambda **kw: pml_losses.ProxyNCALoss(C, D, **kw),
        "attr": "proxies",
        "to_pml": lambda t: t,
        "from_pml": lambda t: t,
        "hp": [{}, {"softmax_scale": 5.0}, {"softmax_scale": 0.3}],
        "distances": ["cosine", "lp", "lp_sq", "dot"],
    },
    "normalized_softmax": {
        "fn": normalized_softmax,
        "init": normalized_softmax_init,
        "key": "weight",
        "pml": lambda **kw: pml_losses.NormalizedSoftmaxLoss(C, D, **kw),
        "attr": "W",
        "to_pml": _ns_to_pml,
        "from_pml": _ns_to_pml,
        "hp": [{}, {"temperature": 0.5}, {"temperature": 2.0}],
        "distances": ["cosine", "lp", "lp_sq", "dot"],
    },
    "soft_triple": {
        "fn": soft_triple,
        "init": lambda c, d, **kw: soft_triple_init(c, d, centers_per_class=K, **kw),
        "key": "weight",
        "pml": lambda **kw: pml_losses.SoftTripleLoss(C, D, centers_per_class=K, **kw),
        "attr": "fc",
        "to_pml": _st_to_pml,
        "from_pml": _st_from_pml,
        "hp": [{}, {"la": 10.0, "gamma": 0.3, "margin": 0.05}, {"la": 3.0, "gamma": 1.0}],
        "distances": ["cosine", "dot"],
    },
    "p2s_grad": {
        "fn": p2s_grad,
        "init": p2s_grad_init,
        "key": "weight",
        "pml": lambda **kw: pml_losses.P2SGradLoss(D, C, **kw),
        "attr": "weight",
        "to_pml": lambda t: t.t(),
        "from_pml": lambda t: t.t(),
        "hp": [{}, {}],
        "distances": [],
    },
}
NAMES = list(SPECS)
MINED = ["proxy_anchor", "proxy_nca", "normalized_softmax", "soft_triple"]  # take indices_tuple

DISTANCES = {
    "cosine": (pfd.cosine, pml_distances.CosineSimilarity, "cosine"),
    "lp": (pfd.lp, pml_distances.LpDistance, "lp"),
    "lp_sq": (lambda: pfd.lp(power=2), lambda: pml_distances.LpDistance(power=2), "lp_sq"),
    "dot": (
        pfd.dot,
        lambda: pml_distances.DotProductSimilarity(normalize_embeddings=False),
        "dot",
    ),
}
DEFAULT_DISTANCE = {
    "proxy_anchor": "cosine",
    "proxy_nca": "lp_sq",
    "normalized_softmax": "cosine",
    "soft_triple": "cosine",
    "p2s_grad": None,
}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def lab(values):
    return torch.tensor(values, dtype=torch.int64)


def make(name, gen, labels, dtype=F64, scale=1.0):
    """Embeddings and freshly initialised params (float64 draws, then cast)."""
    spec = SPECS[name]
    emb = torch.randn(len(labels), D, generator=gen, dtype=F64).to(dtype)
    params = spec["init"](C, D, generator=gen, dtype=F64)
    params = {k: (v * scale).to(dtype) for k, v in params.items()}
    return emb, params


def value_and_grads(fn, emb, param):
    """``fn(emb, param)`` and its gradients w.r.t. fresh leaf copies of both."""
    e = emb.detach().clone().requires_grad_(True)
    p = param.detach().clone().requires_grad_(True)
    out = fn(e, p)
    assert out.ndim == 0, f"loss must be 0-d, got shape {tuple(out.shape)}"
    ge, gp = torch.autograd.grad(out, (e, p), allow_unused=True)
    ge = torch.zeros_like(e) if ge is None else ge
    gp = torch.zeros_like(p) if gp is None else gp
    return out.detach(), ge, gp


def assert_same(got, want, **tol):
    for what, a, b in zip(("value", "embedding grad", "param grad"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, what=what: f"{what}: {m}")


def run_pf(name, emb, labels, params, **kw):
    spec = SPECS[name]
    key = spec["key"]
    return value_and_grads(lambda e, p: spec["fn"](e, labels, {key: p}, **kw), emb, params[key])


def run_pml(name, emb, labels, params, *, indices_tuple=None, **kw):
    """PML's loss with our params copied into its parameter (in the embeddings' dtype)."""
    spec = SPECS[name]
    loss_fn = spec["pml"](**kw)
    param = getattr(loss_fn, spec["attr"])
    param.data = spec["to_pml"](params[spec["key"]]).detach().clone().to(emb.dtype).contiguous()
    e = emb.detach().clone().requires_grad_(True)
    out = loss_fn(e, labels, indices_tuple=indices_tuple)
    out.backward()
    return out.detach(), e.grad, spec["from_pml"](param.grad)


def pml_renorm(w):
    """What PML's P2SGrad uses: ``weight.renorm(2, 1, 1e-5).mul(1e5)`` in its (D, C) layout."""
    return w.t().renorm(2, 1, 1e-5).mul(1e5).t()


REFS = {  # the float64 loop references (tests/reference/proxies.py)
    "proxy_anchor": proxies_ref.proxy_anchor,
    "proxy_nca": proxies_ref.proxy_nca,
    "normalized_softmax": proxies_ref.normalized_softmax,
    "soft_triple": proxies_ref.soft_triple,
    "p2s_grad": proxies_ref.p2s_grad,
}


def run_ref(name, emb, labels, params, *, dist=None, tup=None, **hp):
    key = SPECS[name]["key"]
    kw = dict(hp)
    if name != "p2s_grad":
        kw["dist"] = dist or DEFAULT_DISTANCE[name]
        kw["tup"] = tup
    param = params[key].to(F64)
    if name == "p2s_grad":
        param = pml_renorm(param)
    return value_and_grads(lambda e, p: REFS[name](e, labels, p, **kw), emb.to(F64), param)


# ----------------------------------------------------------------------------------------------
# 1. naive float64 reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name, layout, gen):
    labels = lab(LAYOUTS[layout])
    emb, params = make(name, gen, labels)
    for hp in SPECS[name]["hp"]:
        got = run_pf(name, emb, labels, params, **hp)
        want = run_ref(name, emb, labels, params, **hp)
        assert_same(got, want, **REF_TOL)


@pytest.mark.parametrize(
    ("name", "dist"),
    [(n, d) for n in NAMES for d in SPECS[n]["distances"] if d != DEFAULT_DISTANCE[n]],
)
def test_matches_reference_other_distances(name, dist, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels)
    hp = SPECS[name]["hp"][1]
    got = run_pf(name, emb, labels, params, distance=DISTANCES[dist][0](), **hp)
    want = run_ref(name, emb, labels, params, dist=dist, **hp)
    assert_same(got, want, **REF_TOL)


TUPLES = {
    "triplets_with_repeats": (lab([0, 0, 3, 6, 0]), lab([1, 2, 4, 6, 1]), lab([5, 3, 0, 8, 7])),
    "pairs": (lab([0, 3, 9]), lab([1, 4, 10]), lab([2, 2, 5, 7]), lab([5, 6, 0, 8])),
    "empty": (lab([]), lab([]), lab([])),
}


@pytest.mark.parametrize("tup", list(TUPLES))
@pytest.mark.parametrize("name", MINED)
def test_indices_tuple_matches_reference(name, tup, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels)
    hp = SPECS[name]["hp"][1]
    got = run_pf(name, emb, labels, params, indices_tuple=TUPLES[tup], **hp)
    want = run_ref(name, emb, labels, params, tup=TUPLES[tup], **hp)
    assert_same(got, want, **REF_TOL)


# the losses with class_chunk_size (tiles of classes) and the distances it takes (p2s_grad: none)
CLASS_TILED = {
    "proxy_anchor": ("cosine", "dot"),
    "proxy_nca": ("lp_sq", "cosine", "dot"),
    "normalized_softmax": ("cosine", "dot"),
    "soft_triple": ("cosine", "dot"),
    "p2s_grad": (None,),
}


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize(("name", "dist"), [(n, d) for n, ds in CLASS_TILED.items() for d in ds])
def test_class_tiles_match_reference_and_pml(name, dist, chunk, gen):
    """``class_chunk_size`` (tiles of one class, of 3 of the 7, of more than there are) gives
    the float64 reference's value and gradients, and PML's, on every label layout, each
    hyper-parameter set and (the uneven layout, losses that take one) a mined tuple."""
    for layout in LAYOUTS:
        labels = lab(LAYOUTS[layout])
        emb, params = make(name, gen, labels)
        mined = [({}, TUPLES["pairs"])] if layout == "uneven" and name in MINED else []
        for hp, tup in [(h, None) for h in SPECS[name]["hp"]] + mined:
            kw = dict(hp) if tup is None else {"indices_tuple": tup, **hp}
            pml_kw = dict(kw)
            if dist is not None:
                kw["distance"], pml_kw["distance"] = DISTANCES[dist][0](), DISTANCES[dist][1]()
            got = run_pf(name, emb, labels, params, class_chunk_size=chunk, **kw)
            assert_same(
                got, run_ref(name, emb, labels, params, dist=dist, tup=tup, **hp), **REF_TOL
            )
            assert_same(got, run_pml(name, emb, labels, params, **pml_kw), **TOL[F64])


@pytest.mark.parametrize(
    ("name", "dist"), [("proxy_nca", "lp"), ("normalized_softmax", "lp_sq"), ("proxy_anchor", "lp")]
)
def test_class_tiles_refuse_a_distance_that_is_not_a_product(name, dist, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels)
    with pytest.raises(ValueError, match="class_chunk_size needs"):
        SPECS[name]["fn"](emb, labels, params, distance=DISTANCES[dist][0](), class_chunk_size=4)


def test_proxy_nca_drops_underflowing_samples_like_pml(gen):
    """A probability that underflows to 0 leaves its sample out (PML), with finite gradients."""
    labels = lab(UNEVEN)
    emb, params = make("proxy_nca", gen, labels)
    hp = {"softmax_scale": 400.0}
    got = run_pf("proxy_nca", emb, labels, params, **hp)
    want = run_ref("proxy_nca", emb, labels, params, **hp)
    p = torch.softmax(-400.0 * pfd.lp(power=2)(emb, params["proxies"]), 1)
    assert (p.gather(1, labels[:, None]) == 0).any(), "the case must drop a sample"
    assert_same(got, want, **REF_TOL)
    # PML's value agrees; its gradients do not: -log of a subnormal probability loses digits
    # (and its parameter gradient is NaN here: 1/p overflows in the backward).
    torch.testing.assert_close(got[0], run_pml("proxy_nca", emb, labels, params, **hp)[0])
    assert all(torch.isfinite(t).all() for t in got)


def test_proxy_anchor_divisor_counts_proxies_with_positives(gen):
    """pos_loss / #{proxies with a positive}, neg_loss / C, checked through reducer=none()."""
    labels = lab(UNEVEN)
    emb, params = make("proxy_anchor", gen, labels)
    terms = proxy_anchor(emb, labels, params, reducer=pfr.none())
    total = proxy_anchor(emb, labels, params)
    pos, neg = terms["pos_loss"]["losses"], terms["neg_loss"]["losses"]
    assert pos.shape == neg.shape == (C,)
    assert (pos[[3, 5]] == 0).all()  # classes absent from the batch
    torch.testing.assert_close(total, pos.sum() / 4 + neg.sum() / C, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------------------------
# 2. PML 2.9.0 parity
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_pml_parity(name, layout, dtype, gen):
    labels = lab(LAYOUTS[layout])
    emb, params = make(name, gen, labels, dtype)
    for hp in SPECS[name]["hp"]:
        got = run_pf(name, emb, labels, params, **hp)
        want = run_pml(name, emb, labels, params, **hp)
        assert_same(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize(("name", "dist"), [(n, d) for n in NAMES for d in SPECS[n]["distances"]])
def test_pml_parity_distances(name, dist, dtype, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels, dtype)
    pf_dist, pml_dist, _ = DISTANCES[dist]
    hp = SPECS[name]["hp"][1]
    got = run_pf(name, emb, labels, params, distance=pf_dist(), **hp)
    want = run_pml(name, emb, labels, params, distance=pml_dist(), **hp)
    assert_same(got, want, **TOL[dtype])


def _mined(kind, emb, labels):
    if kind == "multi_similarity_miner":
        return pml_miners.MultiSimilarityMiner(epsilon=0.5)(emb, labels)
    if kind == "triplet_margin_miner":
        return pml_miners.TripletMarginMiner(margin=0.5, type_of_triplets="all")(emb, labels)
    if kind == "all_triplets":
        return lmu.get_all_triplets_indices(labels)
    return TUPLES[kind]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "kind", ["multi_similarity_miner", "triplet_margin_miner", "all_triplets", *TUPLES]
)
@pytest.mark.parametrize("name", MINED)
def test_pml_parity_indices_tuple(name, kind, dtype, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels, dtype)
    tup = _mined(kind, emb, labels)
    assert kind == "empty" or len(tup[0]) > 0
    hp = SPECS[name]["hp"][1]
    got = run_pf(name, emb, labels, params, indices_tuple=tup, **hp)
    want = run_pml(name, emb, labels, params, indices_tuple=tup, **hp)
    assert_same(got, want, **TOL[dtype])


CLASS_WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5], dtype=F64)
REDUCERS = {
    "mean": (pfr.mean, pml_reducers.MeanReducer),
    "sum": (pfr.sum, pml_reducers.SumReducer),
    "avg_nonzero": (pfr.avg_nonzero, pml_reducers.AvgNonZeroReducer),
    "threshold": (
        lambda: pfr.threshold(low=0.5),
        lambda: pml_reducers.ThresholdReducer(low=0.5),
    ),
    "divisor": (pfr.divisor, pml_reducers.DivisorReducer),
    "class_weighted": (
        lambda: pfr.class_weighted(CLASS_WEIGHTS),
        lambda: pml_reducers.ClassWeightedReducer(CLASS_WEIGHTS),
    ),
    "per_anchor": (pfr.per_anchor, pml_reducers.PerAnchorReducer),
}


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    ("name", "red"),
    [
        (n, r)
        for n in MINED
        for r in REDUCERS
        if (r == "divisor") == (n == "proxy_anchor")
        and not (n == "proxy_anchor" and r == "class_weighted")  # deviation (a)
    ]
    + [("proxy_anchor", r) for r in ("mean", "sum", "avg_nonzero", "threshold", "per_anchor")],
)
def test_pml_parity_reducers(name, red, dtype, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels, dtype)
    pf_red, pml_red = REDUCERS[red]
    hp = SPECS[name]["hp"][1]
    got = run_pf(name, emb, labels, params, reducer=pf_red(), **hp)
    want = run_pml(name, emb, labels, params, reducer=pml_red(), **hp)
    assert_same(got, want, **TOL[dtype])


def test_proxy_anchor_class_weighted_weights_each_proxy_by_its_class(gen):
    """Deviation (a): proxy c's two terms are weighted by CLASS_WEIGHTS[c]."""
    labels = lab(UNEVEN)
    emb, params = make("proxy_anchor", gen, labels)
    terms = proxy_anchor(emb, labels, params, reducer=pfr.none())
    got = proxy_anchor(emb, labels, params, reducer=pfr.class_weighted(CLASS_WEIGHTS))
    want = sum((terms[k]["losses"] * CLASS_WEIGHTS).mean() for k in ("pos_loss", "neg_loss"))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("scale", [1.0, 2.5, 0.1])
def test_p2s_grad_pml_parity_with_non_unit_weights(scale, dtype, gen):
    """PML renormalises in place before every call: any weight norm gives PML's value and
    PML's gradient (the gradient w.r.t. the renormalised weight), and our params stay as given."""
    labels = lab(UNEVEN)
    emb, params = make("p2s_grad", gen, labels, dtype, scale=scale)
    before = params["weight"].clone()
    got = run_pf("p2s_grad", emb, labels, params)
    want = run_pml("p2s_grad", emb, labels, params)
    assert_same(got, want, **TOL[dtype])
    assert torch.equal(params["weight"], before)


def test_p2s_grad_other_reducers_reduce_per_sample_terms(gen):
    """Deviation (c): per-sample terms mean_c(cos − onehot)²; mean() is PML's MSE."""
    labels = lab(UNEVEN)
    emb, params = make("p2s_grad", gen, labels)
    terms = p2s_grad(emb, labels, params, reducer=pfr.none())["loss"]["losses"]
    assert terms.shape == (len(labels),)
    torch.testing.assert_close(p2s_grad(emb, labels, params, reducer=pfr.sum()), terms.sum())
    torch.testing.assert_close(p2s_grad(emb, labels, params), terms.mean())


# ----------------------------------------------------------------------------------------------
# 3. the straight-through weight gradient, torch.func.vmap, tensor hyper-parameters
# ----------------------------------------------------------------------------------------------
def test_p2s_grad_weight_gradient_is_straight_through(gen):
    """Deviation (b): d loss / d w equals the true gradient w.r.t. the renormalised weight."""
    labels = lab(UNEVEN)
    emb, params = make("p2s_grad", gen, labels, scale=3.0)
    w = params["weight"]
    w_hat = pml_renorm(w).requires_grad_(True)
    (g_true,) = torch.autograd.grad(proxies_ref.p2s_grad(emb, labels, w_hat), w_hat)
    _, _, g = run_pf("p2s_grad", emb, labels, params)
    torch.testing.assert_close(g, g_true, **REF_TOL)
    # and the embedding gradient is the true one: gradcheck with the weight fixed
    e = emb.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: p2s_grad(e, labels, params), (e,))


def _p2s_composite(emb, labels, w):
    """p2s_grad written in autograd ops (the straight-through renormalisation, the clamp and
    the one-hot target): what its autograd Function's first and second derivatives must be."""
    from pmlfunc._ops import renorm_rows

    w_hat = (w - w.detach()) + renorm_rows(w.detach())
    norm = torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp_min(1e-12)
    cos = (emb @ w_hat.t() / norm).clamp(-1.0, 1.0)
    err = cos - torch.nn.functional.one_hot(labels, w.shape[0]).to(cos.dtype)
    return (err * err).mean()


def test_p2s_grad_second_derivatives_equal_autograd_of_the_composite(gen):
    """The backward formed in the forward is recomputed in differentiable ops where a higher
    derivative may follow: Hessian-vector products by autograd (create_graph=True) and the
    full Hessian by torch.func.jacrev twice equal the composite's, also for an embedding
    parallel to a weight row (cos = 1 − 4e-8, the renormalisation's 1e-7)."""
    labels = lab(UNEVEN)
    emb, params = make("p2s_grad", gen, labels, scale=2.5)
    emb[0] = 3.0 * params["weight"][labels[0]]
    w = params["weight"]

    def ours(e, w):
        return p2s_grad(e, labels, {"weight": w})

    def hvp(f):
        e, p = emb.clone().requires_grad_(), w.clone().requires_grad_()
        ge, gp = torch.autograd.grad(f(e, p), (e, p), create_graph=True)
        return torch.autograd.grad((ge * ge).sum() + (gp**3).sum(), (e, p))

    def composite(e, w):
        return _p2s_composite(e, labels, w)

    for a, b in zip(hvp(ours), hvp(composite), strict=True):
        torch.testing.assert_close(a, b, **REF_TOL)
    hess = torch.func.jacrev(torch.func.jacrev(ours, argnums=(0, 1)), argnums=(0, 1))
    want = torch.func.jacrev(torch.func.jacrev(composite, argnums=(0, 1)), argnums=(0, 1))
    for row_a, row_b in zip(hess(emb, w), want(emb, w), strict=True):
        for a, b in zip(row_a, row_b, strict=True):
            torch.testing.assert_close(a, b, **REF_TOL)
    first = value_and_grads(ours, emb, w)
    assert_same(first, value_and_grads(composite, emb, w), **REF_TOL)


def test_p2s_grad_clamped_cosines_pass_no_gradient_like_autograd():
    """Embeddings parallel to another class's unit weight: in float32 some cosines round
    above 1 and are clamped. The clamp passes no gradient there (inclusive at ±1, as
    torch.clamp's): the weight gradient, where a clamped entry's error 1 would otherwise add
    2/(B·C)·x̂, equals autograd's through the composite, and the value and embedding gradient
    too."""
    from pmlfunc._ops import renorm_rows

    g = torch.Generator().manual_seed(0)
    w = p2s_grad_init(6, 64, generator=g)["weight"]
    w_hat = renorm_rows(w)
    emb = torch.randn(6, 1, generator=g).abs() * 10 * w_hat  # row i parallel to ŵ_i
    labels = (torch.arange(6) + 1) % 6  # ... and labelled with another class
    cos = emb @ w_hat.t() / torch.linalg.vector_norm(emb, dim=-1, keepdim=True)
    assert (cos > 1).any(), "the case must clamp a cosine"
    got = value_and_grads(lambda e, p: p2s_grad(e, labels, {"weight": p}), emb, w)
    want = value_and_grads(lambda e, p: _p2s_composite(e, labels, p), emb, w)
    assert_same(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scale", [1.0, torch.tensor(3.0, dtype=F64)], ids=["1", "tensor3"])
def test_proxy_nca_default_distance_is_one_product_of_unit_rows(scale, gen):
    """With the default squared Euclidean distance of unit rows, −σ‖x̂ − p̂‖² = 2σ x̂·p̂ − 2σ:
    the logits proxy_nca takes (one product) give the loss and gradients of the distance's
    own matrix, a per-row constant apart, to float64 rounding; so does another exact budget."""
    labels = lab(UNEVEN)
    emb, params = make("proxy_nca", gen, labels, scale=2.0)

    def by_matrix(e, p):
        z = -scale * pfd.lp(power=2).matrix(e, p)
        return -torch.log_softmax(z, -1).gather(1, labels[:, None]).mean()

    want = value_and_grads(by_matrix, emb, params["proxies"])
    for dist in (None, pfd.lp(power=2, exact_budget=0)):
        got = run_pf("proxy_nca", emb, labels, params, softmax_scale=scale, distance=dist)
        assert_same(got, want, **REF_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_independent_problems(name, gen):
    labels = lab(UNEVEN)
    spec = SPECS[name]
    embs, ps = zip(*(make(name, gen, labels) for _ in range(3)), strict=True)
    emb = torch.stack(embs)
    params = {spec["key"]: torch.stack([p[spec["key"]] for p in ps])}
    out = torch.func.vmap(lambda e, p: spec["fn"](e, labels, p))(emb, params)
    for k in range(3):
        torch.testing.assert_close(out[k], spec["fn"](embs[k], labels, ps[k]), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "p2s_grad"])
def test_tensor_hyperparameters_match_floats_and_get_gradients(name, gen):
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels)
    hp = SPECS[name]["hp"][1]
    thp = {k: torch.tensor(v, dtype=F64, requires_grad=True) for k, v in hp.items()}
    out = SPECS[name]["fn"](emb, labels, params, **thp)
    torch.testing.assert_close(
        out, SPECS[name]["fn"](emb, labels, params, **hp), rtol=1e-12, atol=0
    )
    grads = torch.autograd.grad(out, list(thp.values()))
    assert all(torch.isfinite(g) and g != 0 for g in grads)


# ----------------------------------------------------------------------------------------------
# 4. one compiled training step for the whole family
# ----------------------------------------------------------------------------------------------
@pytest.mark.compile
def test_compile_fullgraph_training_step_equals_eager(gen):
    """nn.Linear encoder + the sum of all five losses, SGD on the encoder and every params dict,
    written with torch.func.grad; two compiled steps equal two eager steps."""
    torch._dynamo.reset()
    encoder = torch.nn.Linear(4, D)
    enc0 = {k: v.detach().clone() for k, v in encoder.named_parameters()}
    loss0 = {n: SPECS[n]["init"](C, D, generator=gen) for n in NAMES}
    x = torch.randn(len(UNEVEN), 4, generator=gen)
    y = lab(UNEVEN)  # classes 3 and 5 absent: the proxy-anchor divisor is a tensor count
    lr = 0.05

    def total(enc, loss_params, x, y):
        emb = torch.func.functional_call(encoder, enc, (x,))
        return sum(SPECS[n]["fn"](emb, y, loss_params[n]) for n in NAMES)

    def step(enc, loss_params, x, y):
        g_enc, g_loss = torch.func.grad(total, argnums=(0, 1))(enc, loss_params, x, y)
        new_enc = {k: v - lr * g_enc[k] for k, v in enc.items()}
        new_loss = {
            n: {k: v - lr * g_loss[n][k] for k, v in p.items()} for n, p in loss_params.items()
        }
        return total(enc, loss_params, x, y), new_enc, new_loss

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        enc, lp = enc0, loss0
        values = []
        for _ in range(2):
            v, enc, lp = fn(enc, lp, x, y)
            values.append(v)
        results.append((torch.stack(values), enc, lp))
    (v_e, enc_e, lp_e), (v_c, enc_c, lp_c) = results
    torch.testing.assert_close(v_c, v_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(enc_c, enc_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_c, lp_e, rtol=1e-5, atol=1e-6)
    assert not torch.equal(lp_e["proxy_anchor"]["proxies"], loss0["proxy_anchor"]["proxies"])
    torch._dynamo.reset()


@pytest.mark.compile
def test_compile_tensor_hyperparameters_do_not_recompile(gen):
    """0-d tensor hyper-parameters of every loss enter one graph, compiled once."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    labels = lab(UNEVEN)
    embs = {n: make(n, gen, labels, F32) for n in NAMES}
    counter = CompileCounter()

    hyper = {
        "proxy_anchor": "alpha",
        "proxy_nca": "softmax_scale",
        "normalized_softmax": "temperature",
        "soft_triple": "la",
    }

    def f(t):
        return torch.stack(
            [SPECS[n]["fn"](embs[n][0], labels, embs[n][1], **{h: t}) for n, h in hyper.items()]
        )

    compiled = torch.compile(f, fullgraph=True, backend=counter)
    outs = []
    for value in (2.0, 5.0, 9.0):
        t = torch.tensor(value)
        outs.append(compiled(t))
        torch.testing.assert_close(outs[-1], f(t), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    assert (outs[0] != outs[2]).all(), "every hyper-parameter must reach the graph"
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# 5. params made on meta, |cos| = 1, low precision
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_init_on_meta(name):
    """``*_init(device="meta")`` makes the params on meta (the loss on meta:
    test_conformance.py)."""
    params = SPECS[name]["init"](C, D, device="meta")
    assert all(v.device.type == "meta" for v in params.values())


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_finite_gradients_at_unit_cosine(name, dtype, gen):
    """Embeddings exactly equal to (and opposite to) their class weight: |cos| = 1."""
    spec = SPECS[name]
    labels = lab([0, 0, 1, 2, 3])
    _, params = make(name, gen, labels, dtype)
    w = params[spec["key"]]
    rows = w[:, 0] if w.ndim == 3 else w  # SoftTriple: centre 0 of each class
    emb = rows[labels].clone()
    emb[1] = -emb[1]
    for dist in [None, *(DISTANCES[d][0]() for d in spec["distances"])]:
        kw = {} if dist is None else {"distance": dist}
        v, ge, gp = run_pf(name, emb, labels, params, **kw)
        assert torch.isfinite(v) and torch.isfinite(ge).all() and torch.isfinite(gp).all(), dist


@pytest.mark.parametrize("name", NAMES)
def test_zero_and_duplicate_embeddings_are_finite(name, gen):
    spec = SPECS[name]
    labels = lab([0, 1, 1, 3])
    emb, params = make(name, gen, labels, F32)
    emb[0] = 0.0
    emb[2] = emb[1]
    for dist in [None, *(DISTANCES[d][0]() for d in spec["distances"])]:
        kw = {} if dist is None else {"distance": dist}
        v, ge, gp = run_pf(name, emb, labels, params, **kw)
        assert torch.isfinite(v) and torch.isfinite(ge).all() and torch.isfinite(gp).all(), dist


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision_embeddings(name, dtype, gen):
    spec = SPECS[name]
    labels = lab(UNEVEN)
    emb = torch.randn(len(labels), D, generator=gen).to(dtype).requires_grad_(True)
    params = {k: v.requires_grad_(True) for k, v in spec["init"](C, D, generator=gen).items()}
    before = {k: v.detach().clone() for k, v in params.items()}
    out = spec["fn"](emb, labels, params)
    assert out.dtype == loss_dtype(dtype) and torch.isfinite(out)
    out.backward()
    p = params[spec["key"]]
    assert p.dtype == F32 and torch.equal(p.detach(), before[spec["key"]])
    assert p.grad.dtype == F32 and torch.isfinite(p.grad).all()
    assert emb.grad.dtype == dtype and torch.isfinite(emb.grad).all()
    # close to the float32 computation of the rounded embeddings
    want = spec["fn"](emb.detach().float(), labels, before)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", NAMES)
def test_params_in_another_dtype_are_not_cast_in_place(name, gen):
    """float64 params with float32 embeddings: computed in float32, params untouched,
    gradients in float64."""
    spec = SPECS[name]
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels, F32)
    p64 = params[spec["key"]].to(F64).requires_grad_(True)
    before = p64.detach().clone()
    out = spec["fn"](emb, labels, {spec["key"]: p64})
    out.backward()
    assert out.dtype == F32 and p64.dtype == F64 and p64.grad.dtype == F64
    assert torch.equal(p64.detach(), before)


# ----------------------------------------------------------------------------------------------
# 6. bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_bad_input(name, gen):
    spec = SPECS[name]
    fn, key = spec["fn"], spec["key"]
    labels = lab(UNEVEN)
    emb, params = make(name, gen, labels)
    p = params[key]
    with pytest.raises(ValueError, match=key):
        fn(emb, labels, {"other": p})
    with pytest.raises(TypeError, match="params"):
        fn(emb, labels, p)
    with pytest.raises(ValueError, match="shape"):
        fn(emb, labels, {key: p.reshape(-1)})
    with pytest.raises(ValueError, match="embedding size"):
        fn(emb[:, :-1], labels, params)
    with pytest.raises(TypeError, match="floating point"):
        fn(emb, labels, {key: p.long()})
    with pytest.raises(ValueError, match="labels"):
        fn(emb, lab([*UNEVEN[:-1], C]), params)
    with pytest.raises(ValueError, match="labels"):
        fn(emb, lab([*UNEVEN[:-1], -1]), params)
    with pytest.raises(TypeError, match="labels"):
        fn(emb, labels.double(), params)
    with pytest.raises(TypeError, match="labels"):
        fn(emb, None, params)
    with pytest.raises(ValueError, match="labels"):
        fn(emb, labels[:-1], params)
    with pytest.raises(ValueError, match="empty"):
        fn(emb[:0], labels[:0], params)
    with pytest.raises(TypeError, match="embeddings"):
        fn(emb.long(), labels, params)
    with pytest.raises(TypeError, match="reducer"):
        fn(emb, labels, params, reducer="mean")
    if name != "p2s_grad":
        with pytest.raises(TypeError, match="distance"):
            fn(emb, labels, params, distance="cosine")
        with pytest.raises(ValueError, match="indices_tuple"):
            fn(emb, labels, params, indices_tuple=(lab([0]), lab([1])))


def test_bad_hyperparameters(gen):
    labels = lab(UNEVEN)
    emb, params = make("normalized_softmax", gen, labels)
    with pytest.raises(ValueError, match="temperature"):
        normalized_softmax(emb, labels, params, temperature=0.0)
    with pytest.raises(TypeError, match="margin"):
        proxy_anchor(emb, labels, {"proxies": params["weight"]}, margin="0.1")
    with pytest.raises(ValueError, match="alpha"):
        proxy_anchor(emb, labels, {"proxies": params["weight"]}, alpha=torch.ones(2))
    emb, params = make("soft_triple", gen, labels)
    with pytest.raises(ValueError, match="gamma"):
        soft_triple(emb, labels, params, gamma=-1.0)
    with pytest.raises(ValueError, match="centers_per_class"):
        soft_triple(emb, labels, params, centers_per_class=K + 1)
    soft_triple(emb, labels, params, centers_per_class=K)  # agreeing value is fine
    with pytest.raises(ValueError, match="similarity"):
        soft_triple(emb, labels, params, distance=pfd.lp())
    with pytest.raises(ValueError, match="shape"):
        soft_triple(emb, labels, {"weight": params["weight"][:, 0]})


# ----------------------------------------------------------------------------------------------
# 7. *_init
# ----------------------------------------------------------------------------------------------
PML_INIT = {  # PML's own initial parameter, in our layout, under the global seed
    "proxy_anchor": lambda c, d: pml_losses.ProxyAnchorLoss(c, d).proxies.data,
    "proxy_nca": lambda c, d: pml_losses.ProxyNCALoss(c, d).proxies.data,
    "normalized_softmax": lambda c, d: pml_losses.NormalizedSoftmaxLoss(c, d).W.data.t(),
    "soft_triple": lambda c, d: (
        pml_losses.SoftTripleLoss(c, d, centers_per_class=K).fc.data.t().reshape(c, K, d)
    ),
    "p2s_grad": lambda c, d: pml_losses.P2SGradLoss(d, c).weight.data.t(),
}


@pytest.mark.parametrize("name", NAMES)
def test_init_shapes_dtype_reproducible_and_equal_to_pml(name):
    spec = SPECS[name]
    c, d = 9, 7
    shape = (c, K, d) if name == "soft_triple" else (c, d)
    a = spec["init"](c, d, generator=torch.Generator().manual_seed(5))
    b = spec["init"](c, d, generator=torch.Generator().manual_seed(5))
    other = spec["init"](c, d, generator=torch.Generator().manual_seed(6))
    assert list(a) == [spec["key"]]
    w = a[spec["key"]]
    assert w.shape == shape and w.dtype == F32 and w.is_contiguous()
    assert torch.equal(w, b[spec["key"]]) and not torch.equal(w, other[spec["key"]])
    assert spec["init"](c, d, dtype=F64)[spec["key"]].dtype == F64
    # Same seed, same values as PML's own initialisation (its layout converted to ours).
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(5)
        pml_w = PML_INIT[name](c, d)
    finally:
        torch.random.set_rng_state(state)
    assert torch.equal(w, pml_w)
    # every dtype: drawn in float32 and cast (p2s_grad's drew a float64 table of its own)
    w64 = spec["init"](c, d, generator=torch.Generator().manual_seed(5), dtype=F64)
    assert torch.equal(w64[spec["key"]], pml_w.to(F64))


def test_init_distributions():
    g = torch.Generator().manual_seed(0)
    c, d = 400, 300
    w = proxy_anchor_init(c, d, generator=g)["proxies"]  # kaiming_normal_ fan_out: std √(2/C)
    assert abs(w.std().item() / math.sqrt(2.0 / c) - 1) < 0.01 and abs(w.mean().item()) < 3e-3
    for init, key in [(proxy_nca_init, "proxies"), (normalized_softmax_init, "weight")]:
        w = init(c, d, generator=g)[key]  # N(0, 1)
        assert abs(w.std().item() - 1) < 0.01 and abs(w.mean().item()) < 0.01
    w = soft_triple_init(c, d, centers_per_class=5, generator=g)["weight"]
    bound = 1 / math.sqrt(c * 5)  # kaiming_uniform_(a=√5), fan_in of PML's (D, C·K) = C·K
    assert w.abs().max() <= bound and w.abs().max() > 0.999 * bound
    assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.01
    w = p2s_grad_init(c, d, generator=g)["weight"]
    torch.testing.assert_close(w.norm(dim=1), torch.ones(c), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_init_bad_sizes(name):
    with pytest.raises(ValueError, match="num_classes"):
        SPECS[name]["init"](0, 4)
    with pytest.raises(TypeError, match="embedding_size"):
        SPECS[name]["init"](3, 2.5)
    if name == "soft_triple":
        with pytest.raises(ValueError, match="centers_per_class"):
            soft_triple_init(3, 4, centers_per_class=0)
