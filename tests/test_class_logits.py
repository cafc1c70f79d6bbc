"""The classifier losses' class logits (``pf.losses.class_logits``) and sub-center ArcFace's
outliers: the logits the loss trains on are the ones its cross entropy reads (the loss is
their cross entropy, float64), the logits without labels are PML 2.9.0's ``get_logits`` (or the
documented monotone map of it), and the outliers are PML's ``get_outliers``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf
import pmlfunc.losses as pfl

F64 = torch.float64
B, C, D, K = 9, 6, 5, 3


def _draw(init, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=F64)
    labels = torch.randint(0, C, (B,), generator=g)
    return x, labels, init(C, D, generator=g, dtype=F64, **kw)


# name -> (init kwargs, hyper-parameters, PML class and kwargs, PML attribute, to PML's layout,
#          PML's get_logits -> ours)
CASES = {
    "arcface": ({}, {"scale": 8.0}, pml_losses.ArcFaceLoss, {"scale": 8.0}, "W", None),
    "cosface": ({}, {"scale": 8.0, "margin": 0.2}, pml_losses.CosFaceLoss, {"scale": 8.0}, "W", None),
    "sphereface": ({}, {"scale": 2.0}, pml_losses.SphereFaceLoss, {"scale": 2.0}, "W", None),
    "large_margin_softmax": (
        {}, {"scale": 2.0, "margin": 3}, pml_losses.LargeMarginSoftmaxLoss,
        {"scale": 2.0, "margin": 3}, "W", None,
    ),
    "subcenter_arcface": (
        {"sub_centers": K}, {"scale": 8.0}, pml_losses.SubCenterArcFaceLoss,
        {"scale": 8.0, "sub_centers": K}, "W", None,
    ),
    "normalized_softmax": (
        {}, {"temperature": 0.3}, pml_losses.NormalizedSoftmaxLoss, {"temperature": 0.3}, "W",
        None,
    ),
    "soft_triple": (
        {"centers_per_class": K}, {"la": 6.0, "gamma": 0.2, "margin": 0.05},
        pml_losses.SoftTripleLoss, {"la": 6.0, "gamma": 0.2, "centers_per_class": K}, "fc",
        lambda z: 6.0 * z,  # PML leaves out λ
    ),
    "proxy_anchor": ({}, {}, pml_losses.ProxyAnchorLoss, {}, "proxies", None),
    "proxy_nca": (
        {}, {"softmax_scale": 3.0}, pml_losses.ProxyNCALoss, {"softmax_scale": 3.0}, "proxies",
        lambda d: -3.0 * d,  # PML returns the (squared Euclidean) distances themselves
    ),
}  # fmt: skip
KEY = {"proxy_anchor": "proxies", "proxy_nca": "proxies"}
SOFTMAX = [n for n in CASES if n != "proxy_anchor"] + ["dynamic_arcface"]


def _params(name, seed=0):
    init_kw = CASES[name][0] if name in CASES else {"sub_centers": K}
    return _draw(getattr(pfl, f"{name}_init"), seed, **init_kw)


def _hyper(name):
    if name == "dynamic_arcface":
        return {"margins": torch.linspace(0.1, 0.6, C, dtype=F64), "scale": 8.0}
    return CASES[name][1]


@pytest.mark.parametrize("name", SOFTMAX)
def test_the_loss_is_the_cross_entropy_of_its_logits_with_labels(name):
    """With labels, the logits carry the target's margin: their mean cross entropy is the loss
    (value and gradients, float64)."""
    x, labels, params = _params(name)
    key = KEY.get(name, "weight")
    fn = getattr(pfl, name)
    got, want = [], []
    for out, into in ((got, True), (want, False)):
        xx = x.clone().requires_grad_(True)
        w = params[key].clone().requires_grad_(True)
        if into:
            logits = pfl.class_logits(fn, xx, {key: w}, labels, **_hyper(name))
            value = F.cross_entropy(logits, labels)
        else:
            value = fn(xx, labels, {key: w}, **_hyper(name))
        out.extend([value, *torch.autograd.grad(value, (xx, w))])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_without_labels_the_logits_are_pmls_get_logits(name):
    """At inference (no labels, no margin) the logits equal PML's ``get_logits`` with the same
    weights, up to the documented map for soft_triple (λ) and proxy_nca (a negated, scaled
    distance), float64."""
    _, _, pml_cls, pml_kw, attr, mapping = CASES[name]
    x, _, params = _params(name)
    key = KEY.get(name, "weight")
    table = params[key]
    pml = pml_cls(num_classes=C, embedding_size=D, **pml_kw).to(F64)
    pml_table = table if attr == "proxies" else table.reshape(-1, D).t()
    getattr(pml, attr).data = pml_table.clone().contiguous()
    want = pml.get_logits(x)
    got = pfl.class_logits(getattr(pfl, name), x, params, **_hyper(name))
    torch.testing.assert_close(got, want if mapping is None else mapping(want), rtol=1e-10, atol=0)
    assert got.shape == (B, C)


def test_p2s_grad_logits_are_the_clamped_cosines_to_the_renormalised_weights():
    x, labels, params = _draw(pfl.p2s_grad_init)
    w = params["weight"]
    w_hat = w.t().renorm(2, 1, 1e-5).mul(1e5).t()  # PML's renormalisation
    want = (F.normalize(x, dim=1) @ w_hat.t()).clamp(-1, 1)
    got = pfl.class_logits(pfl.p2s_grad, x, params)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pfl.class_logits(pfl.p2s_grad, x, params, labels), got)


def test_the_margin_changes_only_the_target_logit():
    x, labels, params = _params("arcface")
    plain = pfl.class_logits(pfl.arcface, x, params, scale=8.0)
    marked = pfl.class_logits(pfl.arcface, x, params, labels, scale=8.0)
    target = F.one_hot(labels, C).bool()
    assert (marked[~target] == plain[~target]).all()
    assert (marked[target] < plain[target]).all()  # cos(θ + m) < cos θ here


def test_the_loss_keywords_are_accepted_and_a_partial_is_unwrapped():
    """The training-only keywords (reducer, class_chunk_size, ...) are accepted with no effect,
    and a partial's keywords are the loss's."""
    x, _, params = _params("cosface")
    loss = functools.partial(pfl.cosface, scale=5.0, class_chunk_size=2)
    got = pfl.class_logits(loss, x, params, reducer=pf.reducers.mean())
    torch.testing.assert_close(got, pfl.class_logits(pfl.cosface, x, params, scale=5.0))


def test_class_logits_refuses_a_loss_without_classes_and_an_unknown_keyword():
    x, labels, params = _params("arcface")
    with pytest.raises(ValueError, match="class_logits takes a classifier loss"):
        pfl.class_logits(pfl.triplet_margin, x, params)
    with pytest.raises(TypeError, match="arcface takes no keyword argument temperature"):
        pfl.class_logits(pfl.arcface, x, params, temperature=0.1)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 6\)"):
        pfl.class_logits(pfl.arcface, x, params, labels + C)


def test_nan_embeddings_give_nan_logits():
    x, _, params = _params("normalized_softmax")
    x[2, 0] = float("nan")
    got = pfl.class_logits(pfl.normalized_softmax, x, params)
    assert got[2].isnan().all() and not got[[0, 1, 3]].isnan().any()


# ---------------------------------------------------------------------------------------------
# sub-center ArcFace's outliers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("degrees", [30.0, 75.0, 89.0])
def test_outliers_and_dominant_centres_are_pmls(degrees):
    """PML's ``get_outliers`` (a loop over the classes): the same outlier rows and, for every
    class with rows, the same dominant sub-centre; ``-1`` for a class without rows."""
    g = torch.Generator().manual_seed(3)
    params = pfl.subcenter_arcface_init(C, D, sub_centers=K, generator=g, dtype=F64)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 4, 4, 4])  # classes 3 and 5 without rows
    x = params["weight"][labels, 0] + 1.0 * torch.randn(len(labels), D, generator=g, dtype=F64)
    pml = pml_losses.SubCenterArcFaceLoss(num_classes=C, embedding_size=D, sub_centers=K).to(F64)
    pml.W.data = params["weight"].reshape(-1, D).t().clone().contiguous()
    want_outliers, want_centres = pml.get_outliers(x, labels, threshold=degrees)
    outliers, dominant = pfl.subcenter_arcface_outliers(
        x, labels, params, threshold=torch.deg2rad(torch.tensor(degrees)).item()
    )
    assert sorted(outliers.nonzero().flatten().tolist()) == sorted(want_outliers.tolist())
    assert 0 < int(outliers.sum()) < len(labels) or degrees != 75.0
    has_rows = torch.zeros(C, dtype=torch.bool).index_fill_(0, labels, True)
    assert (dominant[~has_rows] == -1).all()
    got_centres = params["weight"][has_rows.nonzero().flatten(), dominant[has_rows]]
    torch.testing.assert_close(got_centres, want_centres.t()[has_rows], rtol=0, atol=0)


def test_outliers_under_autocast_are_the_float32_ones():
    """The cosines in float32 also inside ``torch.autocast`` (a bfloat16 product flipped 3 of
    4,096 decisions)."""
    g = torch.Generator().manual_seed(0)
    params = pfl.subcenter_arcface_init(8, 64, sub_centers=3, generator=g)
    x, labels = torch.randn(4096, 64, generator=g), torch.randint(0, 8, (4096,), generator=g)
    want = pfl.subcenter_arcface_outliers(x, labels, params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pfl.subcenter_arcface_outliers(x, labels, params)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_outliers_refuse_bad_labels():
    params = pfl.subcenter_arcface_init(C, D)
    with pytest.raises(ValueError, match="labels"):
        pfl.subcenter_arcface_outliers(torch.randn(2, D), torch.tensor([0, C]), params)


def test_outliers_compile_without_a_graph_break_and_run_on_meta():
    params = pfl.subcenter_arcface_init(C, D, sub_centers=K, generator=torch.Generator())
    x, labels = torch.randn(B, D), torch.randint(0, C, (B,))
    compiled = torch.compile(pfl.subcenter_arcface_outliers, fullgraph=True, backend="aot_eager")
    for got, want in zip(
        compiled(x, labels, params), pfl.subcenter_arcface_outliers(x, labels, params), strict=True
    ):
        assert torch.equal(got, want)
    meta = {"weight": params["weight"].to("meta")}
    outliers, dominant = pfl.subcenter_arcface_outliers(x.to("meta"), labels.to("meta"), meta)
    assert outliers.shape == (B,) and outliers.dtype == torch.bool and dominant.shape == (C,)
