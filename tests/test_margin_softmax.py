"""Tests of the margin-softmax (classifier-head) losses in ``pmlfunc.losses.margin_softmax``.

What they prove:
  * a naive float64 reference (tests/reference/margin_softmax.py: loops over samples and classes,
    written from the papers' formulas with ``arccos``/``cos(mθ)``, nothing shared with the
    implementation) on values and gradients with respect to the embeddings and the parameters;
  * PML 2.9.0 parity (values, embedding and weight gradients) in float64 and float32, across
    hyper-parameters, uneven label layouts with absent classes, PML's reducers and miner tuples;
  * ``gradcheck`` on data reaching every branch, ``vmap``, a compiled training step, finite
    gradients at ``|cos| = 1``, low precision, bad input and the inits (on meta too). The
    properties every loss keeps (gradcheck, torch.func.grad over the parameter dict, compile,
    the meta device, a docstring example) are in test_conformance.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import loss_dtype
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import reducers as pml_reducers
from reference import margin_softmax as margin_softmax_ref

from pmlfunc import reducers
from pmlfunc.losses.margin_softmax import (
    arcface,
    arcface_init,
    cosface,
    cosface_init,
    dynamic_arcface,
    dynamic_arcface_init,
    dynamic_arcface_margins,
    large_margin_softmax,
    large_margin_softmax_init,
    sphereface,
    sphereface_init,
    subcenter_arcface,
    subcenter_arcface_init,
)

LOSSES = {
    "large_margin_softmax": (large_margin_softmax, large_margin_softmax_init),
    "sphereface": (sphereface, sphereface_init),
    "cosface": (cosface, cosface_init),
    "arcface": (arcface, arcface_init),
    "subcenter_arcface": (subcenter_arcface, subcenter_arcface_init),
    "dynamic_arcface": (dynamic_arcface, dynamic_arcface_init),
}
SUBCENTER = {"subcenter_arcface", "dynamic_arcface"}
PML_CLASSES = {
    "large_margin_softmax": pml_losses.LargeMarginSoftmaxLoss,
    "sphereface": pml_losses.SphereFaceLoss,
    "cosface": pml_losses.CosFaceLoss,
    "arcface": pml_losses.ArcFaceLoss,
    "subcenter_arcface": pml_losses.SubCenterArcFaceLoss,
}
C, D = 6, 5
# Uneven layout: class 0 four times, 3 twice, 1 and 4 once each; classes 2 and 5 absent.
LABELS = torch.tensor([0, 4, 0, 0, 1, 3, 3, 0, 1, 0])


def default_kwargs(name: str) -> dict:
    if name == "dynamic_arcface":
        return {"margins": torch.linspace(0.1, 0.6, C, dtype=torch.float64)}
    return {}


def make_data(name: str, gen, dtype=torch.float64, k: int = 3, b: int | None = None):
    """Embeddings, labels and weights with every branch of the target functions represented.

    Sub-centres of a class are spread around one class direction, so the embedding placed
    opposite its class (row 1) is far from all of them: θ > π − m (ArcFace's fallback branch).
    Rows 2 and 5 sit near their class (small θ); the rest are random (L-Softmax's k = 0..3).
    """
    labels = LABELS if b is None else torch.randint(0, C, (b,), generator=gen)
    base = torch.randn(C, D, generator=gen, dtype=torch.float64)
    if name in SUBCENTER:
        w = base.unsqueeze(1) + 0.15 * torch.randn(C, k, D, generator=gen, dtype=torch.float64)
    else:
        w = base * (0.5 + torch.rand(C, 1, generator=gen, dtype=torch.float64))
    x = 2.0 * torch.randn(labels.shape[0], D, generator=gen, dtype=torch.float64)
    if b is None:
        x[1] = -1.5 * base[labels[1]] + 0.05 * torch.randn(D, generator=gen, dtype=torch.float64)
        x[2] = 0.7 * base[labels[2]] + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
        x[5] = 3.0 * base[labels[5]] + 0.2 * torch.randn(D, generator=gen, dtype=torch.float64)
    return x.to(dtype), labels, {"weight": w.to(dtype)}


def value_and_grads(fn, x, params):
    x = x.detach().clone().requires_grad_(True)
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    out = fn(x, p)
    gx, gw = torch.autograd.grad(out, (x, p["weight"]))
    return out.detach(), gx, gw


REF_CASES = [
    ("large_margin_softmax", {}),
    ("large_margin_softmax", {"margin": 1}),
    ("large_margin_softmax", {"margin": 2, "scale": 2.5}),
    ("large_margin_softmax", {"margin": 3}),
    ("sphereface", {}),
    ("sphereface", {"margin": 3, "scale": 1.7}),
    ("cosface", {}),
    ("cosface", {"margin": 0.1, "scale": 20.0}),
    ("arcface", {}),
    ("arcface", {"margin": 0.2, "scale": 10.0}),
    ("arcface", {"margin": 1.1}),
    ("subcenter_arcface", {}),
    ("subcenter_arcface", {"margin": 0.3, "scale": 16.0}),
    ("dynamic_arcface", {}),
    ("dynamic_arcface", {"scale": 8.0}),
]


# the whole (B, C) logit matrix, and the class tiles (class_chunk_size: tiles of one class, of a
# size not dividing C, of more classes than there are)
CHUNKS = [None, 1, 4, 64]


@pytest.mark.parametrize("class_chunk_size", CHUNKS)
@pytest.mark.parametrize(("name", "kw"), REF_CASES)
def test_matches_naive_reference(name, kw, class_chunk_size, gen):
    fn = LOSSES[name][0]
    x, labels, params = make_data(name, gen)
    kwargs = {**default_kwargs(name), **kw, "class_chunk_size": class_chunk_size}
    got = value_and_grads(lambda e, p: fn(e, labels, p, **kwargs), x, params)
    ref_kw = dict(kw)
    if name == "dynamic_arcface":
        ref_kw["margins"] = kwargs["margins"]
    want = value_and_grads(
        lambda e, p: margin_softmax_ref.margin_softmax(name, e, labels, p["weight"], **ref_kw),
        x,
        params,
    )
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


def test_test_data_reaches_every_branch(gen):
    """The reference data covers ArcFace's fallback (θ > π − m) and L-Softmax's k = 0..3."""
    for name in ("arcface", "subcenter_arcface"):
        x, labels, params = make_data(name, gen)
        w = params["weight"].reshape(C, -1, D)
        xn, wn = torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(w, dim=2)
        target = torch.einsum("bd,ckd->bck", xn, wn).amax(-1)[torch.arange(len(labels)), labels]
        assert (target < -math.cos(0.5)).any() and (target > -math.cos(0.5)).any()
    x, labels, params = make_data("large_margin_softmax", gen)
    cos = (
        torch.nn.functional.normalize(x, dim=1)
        @ torch.nn.functional.normalize(params["weight"], dim=1).t()
    )
    theta = torch.acos(cos[torch.arange(len(labels)), labels])
    assert set(torch.floor(theta * 4 / math.pi).tolist()) >= {0.0, 1.0, 2.0, 3.0}


# ----------------------------------------------------------------------------------------------
# dynamic margins
# ----------------------------------------------------------------------------------------------
def test_dynamic_margins_formula():
    counts = torch.tensor([1, 2, 7, 16, 100, 12345, 0])
    got = dynamic_arcface_margins(counts.double(), a=0.4, b=0.1, lambda_=0.3)
    want = [0.4 * max(int(n), 1) ** -0.3 + 0.1 for n in counts]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)
    default = dynamic_arcface_margins(counts)
    assert default.dtype == torch.get_default_dtype()
    want = [0.5 * max(int(n), 1) ** -0.25 + 0.05 for n in counts]
    torch.testing.assert_close(default, torch.tensor(want, dtype=default.dtype))
    # tensor hyper-parameters, differentiable
    lam = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    out = dynamic_arcface_margins(counts.double(), lambda_=lam)
    (g,) = torch.autograd.grad(out.sum(), lam)
    want_g = sum(-0.5 * math.log(max(int(n), 1)) * max(int(n), 1) ** -0.25 for n in counts)
    assert abs(float(g) - want_g) < 1e-12


def test_dynamic_with_constant_margins_is_subcenter_arcface(gen):
    x, labels, params = make_data("dynamic_arcface", gen)
    margins = torch.full((C,), 0.37, dtype=torch.float64)
    got = value_and_grads(lambda e, p: dynamic_arcface(e, labels, p, margins=margins), x, params)
    want = value_and_grads(lambda e, p: subcenter_arcface(e, labels, p, margin=0.37), x, params)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-13)


def test_dynamic_margin_gradient(gen):
    """Gradients flow to the margins tensor (e.g. a learnable or scheduled margin)."""
    x, labels, params = make_data("dynamic_arcface", gen)
    margins = torch.linspace(0.1, 0.6, C, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda m: dynamic_arcface(x, labels, params, margins=m, scale=4.0), (margins,)
    )


# ----------------------------------------------------------------------------------------------
# PML 2.9.0 parity
# ----------------------------------------------------------------------------------------------
def pml_loss(name, kw, reducer=None):
    k = dict(kw)
    sub_centers = k.pop("sub_centers", None)
    if "arcface" in name and "margin" in k:
        k["margin"] = math.degrees(k["margin"])
    elif "arcface" in name:
        k["margin"] = math.degrees(0.5)  # our default in radians; PML 2.9.0's is 28.6 degrees
    if sub_centers is not None:
        k["sub_centers"] = sub_centers
    if reducer is not None:
        k["reducer"] = reducer
    return PML_CLASSES[name](num_classes=C, embedding_size=D, **k)


def run_pml(loss, x, labels, weight, indices_tuple=None):
    loss.W.data = weight.detach().reshape(-1, D).t().clone()
    x = x.detach().clone().requires_grad_(True)
    out = loss(x, labels, indices_tuple)
    gx, gw = torch.autograd.grad(out, (x, loss.W))
    return out.detach(), gx, gw.t().reshape(weight.shape)


PARITY_CASES = [
    ("large_margin_softmax", {}),
    ("large_margin_softmax", {"margin": 2, "scale": 3.0}),
    ("large_margin_softmax", {"margin": 5}),
    ("sphereface", {}),
    ("sphereface", {"margin": 1, "scale": 2.0}),
    ("cosface", {}),
    ("cosface", {"margin": 0.2, "scale": 30.0}),
    ("arcface", {}),
    ("arcface", {"margin": 0.3, "scale": 16.0}),
    ("subcenter_arcface", {}),
    ("subcenter_arcface", {"margin": 0.2, "sub_centers": 1}),
    ("subcenter_arcface", {"margin": 0.4, "sub_centers": 4, "scale": 10.0}),
]
TOL = {torch.float64: {"rtol": 1e-7, "atol": 1e-10}, torch.float32: {"rtol": 2e-4, "atol": 2e-6}}


@pytest.mark.parametrize("class_chunk_size", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "kw"), PARITY_CASES)
def test_pml_parity(name, kw, dtype, class_chunk_size, gen):
    fn = LOSSES[name][0]
    k = kw.get("sub_centers", 3)
    x, labels, params = make_data(name, gen, dtype=dtype, k=k)
    ours_kw = {key: v for key, v in kw.items() if key != "sub_centers"}
    ours_kw["class_chunk_size"] = class_chunk_size
    got = value_and_grads(lambda e, p: fn(e, labels, p, **ours_kw), x, params)
    want = run_pml(pml_loss(name, kw), x, labels, params["weight"])
    for g, r in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, r.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("class_chunk_size", [None, 4])
@pytest.mark.parametrize("name", ["large_margin_softmax", "cosface", "subcenter_arcface"])
@pytest.mark.parametrize(
    "reducer",
    ["mean", "sum", "avg_nonzero", "threshold", "class_weighted", "per_anchor"],
)
def test_pml_parity_reducers(name, reducer, class_chunk_size, gen):
    fn = LOSSES[name][0]
    x, labels, params = make_data(name, gen)
    cw = torch.rand(C, generator=gen, dtype=torch.float64)
    ours, theirs = {
        "mean": (reducers.mean(), pml_reducers.MeanReducer()),
        "sum": (reducers.sum(), pml_reducers.SumReducer()),
        "avg_nonzero": (reducers.avg_nonzero(), pml_reducers.AvgNonZeroReducer()),
        "threshold": (reducers.threshold(low=1.0), pml_reducers.ThresholdReducer(low=1.0)),
        "class_weighted": (reducers.class_weighted(cw), pml_reducers.ClassWeightedReducer(cw)),
        "per_anchor": (reducers.per_anchor(), pml_reducers.PerAnchorReducer()),
    }[reducer]
    got = value_and_grads(
        lambda e, p: fn(e, labels, p, reducer=ours, class_chunk_size=class_chunk_size), x, params
    )
    want = run_pml(pml_loss(name, {}, reducer=theirs), x, labels, params["weight"])
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **TOL[torch.float64])


def test_reducer_none_gives_per_sample_terms(gen):
    x, labels, params = make_data("arcface", gen)
    out = arcface(x, labels, params, reducer=reducers.none())
    terms = out["loss"]
    assert terms["kind"] == "element" and terms["losses"].shape == (len(labels),)
    torch.testing.assert_close(terms["losses"].mean(), arcface(x, labels, params))


@pytest.mark.parametrize("class_chunk_size", [None, 4])
@pytest.mark.parametrize("name", ["large_margin_softmax", "arcface", "subcenter_arcface"])
@pytest.mark.parametrize("kind", ["triplets", "pairs", "empty"])
def test_pml_parity_indices_tuple(name, kind, class_chunk_size, gen):
    """Miner output weights each sample by its count over the largest count (PML's weights)."""
    fn = LOSSES[name][0]
    x, labels, params = make_data(name, gen)
    if kind == "triplets":
        t = (torch.tensor([0, 0, 2, 5]), torch.tensor([2, 3, 0, 6]), torch.tensor([1, 4, 4, 1]))
    elif kind == "pairs":
        t = (
            torch.tensor([0, 2]),
            torch.tensor([3, 7]),
            torch.tensor([0, 0, 9]),
            torch.tensor([1, 4, 1]),
        )
    else:
        t = tuple(torch.empty(0, dtype=torch.long) for _ in range(3))
    got = value_and_grads(
        lambda e, p: fn(e, labels, p, indices_tuple=t, class_chunk_size=class_chunk_size),
        x,
        params,
    )
    want = run_pml(pml_loss(name, {}), x, labels, params["weight"], indices_tuple=t)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **TOL[torch.float64])
    if kind == "triplets":
        counts = torch.zeros(len(labels), dtype=torch.float64)
        for v in torch.cat(t):
            counts[v] += 1
        miner = counts / counts.max()
        ref = margin_softmax_ref.margin_softmax(name, x, labels, params["weight"], miner=miner)
        torch.testing.assert_close(got[0], ref, rtol=1e-9, atol=1e-10)


def test_tensor_hyperparameters_equal_numbers(gen):
    for name, kw in [
        ("cosface", {"margin": 0.2, "scale": 30.0}),
        ("arcface", {"margin": 0.3, "scale": 16.0}),
        ("subcenter_arcface", {"margin": 0.3, "scale": 16.0}),
        ("large_margin_softmax", {"scale": 2.0}),
        ("sphereface", {"scale": 2.0}),
    ]:
        fn = LOSSES[name][0]
        x, labels, params = make_data(name, gen)
        tkw = {k: torch.tensor(v, dtype=torch.float32) for k, v in kw.items()}
        torch.testing.assert_close(fn(x, labels, params, **tkw), fn(x, labels, params, **kw))


def test_subcenter_column_order_matches_pml(gen):
    """PML's column c·K + k is weight[c, k]: a PML W built column by column gives equal losses."""
    k = 3
    x, labels, params = make_data("subcenter_arcface", gen, k=k)
    w = params["weight"]
    pml = pml_loss("subcenter_arcface", {"sub_centers": k})
    cols = [w[c, kk] for c in range(C) for kk in range(k)]
    pml.W.data = torch.stack(cols, dim=1).clone()
    torch.testing.assert_close(subcenter_arcface(x, labels, params), pml(x, labels).detach())


# ----------------------------------------------------------------------------------------------
# gradcheck on every branch, vmap, a compiled training step
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LOSSES))
def test_gradcheck_on_every_branch(name, gen):
    fn = LOSSES[name][0]
    x, labels, params = make_data(name, gen)
    kw = default_kwargs(name)
    if name not in ("large_margin_softmax", "sphereface"):
        kw["scale"] = 8.0
    x = x.requires_grad_(True)
    w = params["weight"].requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e, p: fn(e, labels, {"weight": p}, **kw), (x, w))


def test_vmap_over_batches(gen):
    x, labels, params = make_data("arcface", gen)
    xs = torch.stack([x, x.flip(0), 2 * x])
    ys = torch.stack([labels, labels.flip(0), labels])
    got = torch.vmap(lambda e, y: arcface(e, y, params))(xs, ys)
    want = torch.stack([arcface(e, y, params) for e, y in zip(xs, ys, strict=True)])
    torch.testing.assert_close(got, want)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["large_margin_softmax", "subcenter_arcface"])
def test_compile_training_step(name, gen):
    """A full step (encoder + loss + SGD on the encoder and the loss params), compiled in one
    graph, equals eager after two steps."""
    torch._dynamo.reset()
    fn, init = LOSSES[name]
    encoder = torch.nn.Linear(7, D)
    enc_params = {k: v.detach().clone() for k, v in encoder.named_parameters()}
    loss_params = init(C, D, generator=gen)
    x = torch.randn(12, 7, generator=gen)
    labels = torch.randint(0, C, (12,), generator=gen)

    def objective(ep, lp, inputs, y):
        emb = torch.func.functional_call(encoder, ep, (inputs,))
        return fn(emb, y, lp)

    def step(ep, lp, inputs, y):
        (ge, gl), loss = torch.func.grad_and_value(objective, argnums=(0, 1))(ep, lp, inputs, y)
        ep = {k: v - 0.1 * ge[k] for k, v in ep.items()}
        lp = {k: v - 0.1 * gl[k] for k, v in lp.items()}
        return loss, ep, lp

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for f in (step, compiled):
        ep, lp, losses = enc_params, loss_params, []
        for _ in range(2):
            loss, ep, lp = f(ep, lp, x, labels)
            losses.append(loss)
        results.append((torch.stack(losses), ep, lp))
    (l0, e0, p0), (l1, e1, p1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for a, b in [*zip(e1.values(), e0.values(), strict=True), (p1["weight"], p0["weight"])]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.equal(p0["weight"], loss_params["weight"])  # the step did update the params


# ----------------------------------------------------------------------------------------------
# numerics
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(LOSSES))
def test_finite_gradient_at_unit_cosine(name, dtype, gen):
    """An embedding exactly on its class weight (cos = 1) or exactly opposite (cos = −1)."""
    fn, init = LOSSES[name]
    params = init(C, D, generator=gen, dtype=dtype)
    w = params["weight"].reshape(C, -1, D)
    labels = torch.tensor([0, 1, 2, 3])
    x = torch.stack([w[0, 0], 2.0 * w[1, 0], -w[2, 0], w[3, 0]]).clone()
    if name in SUBCENTER:  # make every sub-centre of class 2 opposite row 2 (cos = −1)
        params = {"weight": params["weight"].clone()}
        params["weight"][2] = w[2, 0]
    kw = default_kwargs(name)
    out, gx, gw = value_and_grads(lambda e, p: fn(e, labels, p, **kw), x, params)
    assert torch.isfinite(out) and torch.isfinite(gx).all() and torch.isfinite(gw).all()


def test_pml_arcface_gradient_is_not_finite_at_unit_cosine():
    """Why we differ from PML there: its arccos derivative is infinite at cos = 1."""
    w = arcface_init(C, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x, labels = w["weight"][:2].clone(), torch.tensor([0, 1])
    got = value_and_grads(lambda e, p: arcface(e, labels, p), x, w)
    want = run_pml(pml_loss("arcface", {}), x, labels, w["weight"])
    assert all(torch.isfinite(t).all() for t in got)
    assert not torch.isfinite(want[1]).all()
    torch.testing.assert_close(got[0], want[0])  # the values agree


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(LOSSES))
def test_low_precision(name, dtype, gen):
    fn, init = LOSSES[name]
    params = init(C, D, generator=gen)
    before = {k: v.clone() for k, v in params.items()}
    x = torch.randn(10, D, generator=gen).to(dtype).requires_grad_(True)
    labels = torch.randint(0, C, (10,), generator=gen)
    kw = default_kwargs(name)
    p = {k: v.requires_grad_(True) for k, v in params.items()}
    out = fn(x, labels, p, **kw)
    assert out.dtype == loss_dtype(dtype) and torch.isfinite(out)
    out.backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    assert p["weight"].grad.dtype == torch.float32 and torch.isfinite(p["weight"].grad).all()
    for key, v in params.items():
        assert v.dtype == torch.float32 and torch.equal(v.detach(), before[key])
    ref = fn(x.detach().float(), labels, before, **kw)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LOSSES))
def test_bad_input(name, gen):
    fn, init = LOSSES[name]
    params = init(C, D, generator=gen)
    kw = default_kwargs(name)
    if "margins" in kw:
        kw["margins"] = kw["margins"].float()
    x = torch.randn(4, D)
    y = torch.tensor([0, 1, 2, 3])
    fn(x, y, params, **kw)  # the valid call works
    with pytest.raises(ValueError, match="'weight'"):
        fn(x, y, {"proxies": params["weight"]}, **kw)
    with pytest.raises(TypeError, match="params"):
        fn(x, y, params["weight"], **kw)
    wrong_ndim = params["weight"][:, 0] if name in SUBCENTER else params["weight"].unsqueeze(1)
    with pytest.raises(ValueError, match="shape"):
        fn(x, y, {"weight": wrong_ndim}, **kw)
    with pytest.raises(ValueError, match="embedding size"):
        fn(torch.randn(4, D + 1), y, params, **kw)
    with pytest.raises(ValueError, match="labels"):
        fn(x, torch.tensor([0, 1, 2, C]), params, **kw)
    with pytest.raises(ValueError, match="labels"):
        fn(x, torch.tensor([0, -1, 2, 3]), params, **kw)
    with pytest.raises(TypeError, match="labels"):
        fn(x, y.float(), params, **kw)
    with pytest.raises(ValueError, match="labels"):
        fn(x, y[:3], params, **kw)
    with pytest.raises(ValueError, match="embeddings"):
        fn(torch.randn(0, D), torch.empty(0, dtype=torch.long), params, **kw)
    with pytest.raises(ValueError, match="scale"):
        fn(x, y, params, scale=0.0, **kw)
    with pytest.raises(TypeError, match="reducer"):
        fn(x, y, params, reducer="mean", **kw)


def test_bad_hyperparameters(gen):
    x, y = torch.randn(4, D), torch.tensor([0, 1, 2, 3])
    p = large_margin_softmax_init(C, D, generator=gen)
    for f in (large_margin_softmax, sphereface):
        with pytest.raises(ValueError, match="margin"):
            f(x, y, p, margin=2.5)
        with pytest.raises(ValueError, match="margin"):
            f(x, y, p, margin=0)
        with pytest.raises(TypeError, match="margin"):
            f(x, y, p, margin=torch.tensor(4))
    assert torch.equal(large_margin_softmax(x, y, p, margin=4.0), large_margin_softmax(x, y, p))
    with pytest.raises(TypeError, match="margin"):
        arcface(x, y, p, margin="0.5")
    with pytest.raises(ValueError, match="margin"):
        cosface(x, y, p, margin=torch.zeros(2))
    sp = dynamic_arcface_init(C, D, generator=gen)
    with pytest.raises(TypeError, match="margins"):
        dynamic_arcface(x, y, sp, margins=0.5)
    with pytest.raises(TypeError, match="margins"):
        dynamic_arcface(x, y, sp, margins=torch.ones(C, dtype=torch.long))
    with pytest.raises(ValueError, match="margins"):
        dynamic_arcface(x, y, sp, margins=torch.ones(C + 1))
    with pytest.raises(ValueError, match="margins"):
        dynamic_arcface(x, y, sp, margins=torch.ones(C, device="meta"))
    with pytest.raises(ValueError, match="indices_tuple"):
        arcface(x, y, p, indices_tuple=(torch.tensor([0]), torch.tensor([1])))
    with pytest.raises(ValueError, match="class_counts"):
        dynamic_arcface_margins(torch.ones(2, 2))
    with pytest.raises(TypeError, match="class_counts"):
        dynamic_arcface_margins([1, 2])
    with pytest.raises(ValueError, match="sub_centers"):
        subcenter_arcface_init(C, D, sub_centers=0)
    with pytest.raises(ValueError, match="sizes"):
        arcface_init(0, D)


# ----------------------------------------------------------------------------------------------
# initialisation
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LOSSES))
def test_init(name):
    _, init = LOSSES[name]
    kw = {"sub_centers": 4} if name in SUBCENTER else {}
    shape = (C, 4, D) if name in SUBCENTER else (C, D)
    a = init(C, D, generator=torch.Generator().manual_seed(1), **kw)
    b = init(C, D, generator=torch.Generator().manual_seed(1), **kw)
    c = init(C, D, generator=torch.Generator().manual_seed(2), **kw)
    assert set(a) == {"weight"} and a["weight"].shape == shape
    assert a["weight"].dtype == torch.float32 and a["weight"].is_contiguous()
    assert torch.equal(a["weight"], b["weight"]) and not torch.equal(a["weight"], c["weight"])
    d = init(C, D, dtype=torch.float64, **kw)
    assert d["weight"].dtype == torch.float64 and d["weight"].shape == shape
    if name in SUBCENTER:
        assert init(C, D)["weight"].shape == (C, 3, D)  # PML's default sub_centers=3
    assert init(C, D, device="meta", **kw)["weight"].device.type == "meta"


@pytest.mark.parametrize("name", list(PML_CLASSES))
def test_init_equals_pml_draw(name):
    """Drawn in PML's (D, C) / (D, C·K) layout: the same seed gives PML's exact initial W."""
    _, init = LOSSES[name]
    kw = {"sub_centers": 2} if name in SUBCENTER else {}
    torch.manual_seed(123)
    pml = PML_CLASSES[name](num_classes=C, embedding_size=D, **kw)
    ours = init(C, D, generator=torch.Generator().manual_seed(123), **kw)["weight"]
    torch.testing.assert_close(ours.reshape(-1, D).t(), pml.W.detach(), rtol=0, atol=0)


def test_init_distribution():
    """N(0, 1), as PML's ``torch.nn.init.normal_``."""
    w = arcface_init(400, 256, generator=torch.Generator().manual_seed(0))["weight"]
    assert abs(float(w.mean())) < 0.01 and abs(float(w.std()) - 1.0) < 0.01
