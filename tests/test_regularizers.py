"""pmlfunc.regularizers and the losses' embedding_regularizer / weight_regularizer, at PML 2.9.0
parity (values and gradients, float64)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import reducers as pml_reducers
from pytorch_metric_learning import regularizers as pml_reg

import pmlfunc as pf
from pmlfunc import regularizers as R

F64 = torch.float64


def _x(rows=12, cols=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=F64, requires_grad=True)


def _reference(name: str, x: torch.Tensor) -> torch.Tensor:
    """Naive float64 loops, from the papers / PML's definitions."""
    rows = [x[i] for i in range(x.shape[0])]
    if name == "lp":
        vals = [r.norm() for r in rows]
    elif name == "zero_mean":
        vals = [r.sum().abs() for r in rows]
    elif name == "center_invariant":
        sq = [(r * r).sum() for r in rows]
        mean = sum(sq) / len(sq)
        vals = [(s - mean) ** 2 / 4 for s in sq]
    elif name == "regular_face":
        unit = [r / r.norm() for r in rows]
        vals = []
        for i, u in enumerate(unit):
            sims = [(u * v).sum() for j, v in enumerate(unit) if j != i]
            vals.append(max(sims, key=lambda t: t.item()))
    elif name == "spherical_embedding":
        norms = [r.norm() for r in rows]
        mu = (sum(norms) / len(norms)).detach()
        vals = [(n - mu) ** 2 for n in norms]
    else:
        raise KeyError(name)
    return sum(vals) / len(vals)


CASES = {
    "lp": (R.lp, pml_reg.LpRegularizer()),
    "zero_mean": (R.zero_mean, pml_reg.ZeroMeanRegularizer()),
    "center_invariant": (R.center_invariant, pml_reg.CenterInvariantRegularizer()),
    "regular_face": (R.regular_face, pml_reg.RegularFaceRegularizer()),
    "spherical_embedding": (R.spherical_embedding, None),  # PML 3 addition
}


@pytest.mark.parametrize("name", list(CASES))
def test_regularizer_matches_reference_and_pml(name):
    ours, theirs = CASES[name]
    x = _x()
    got = ours(x)
    (g_got,) = torch.autograd.grad(got, x)
    want = _reference(name, x)
    (g_want,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    if theirs is not None:
        pml = theirs(x)
        (g_pml,) = torch.autograd.grad(pml, x)
        torch.testing.assert_close(got, pml, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g_got, g_pml, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p,power", [(2, 1), (1, 2), (3, 0.5)])
def test_lp_arguments_and_reducers_match_pml(p, power):
    x = _x()
    torch.testing.assert_close(
        R.lp(x, p=p, power=power), pml_reg.LpRegularizer(p=p, power=power)(x)
    )
    torch.testing.assert_close(
        R.lp(x, reducer=pf.reducers.sum()),
        pml_reg.LpRegularizer(reducer=pml_reducers.SumReducer())(x),
    )


@pytest.mark.parametrize("classes,k", [(4, 3), (2, 2)])
def test_sparse_centers_matches_pml(classes, k):
    x = _x(classes * k, 5)
    got = R.sparse_centers(x, num_classes=classes, centers_per_class=k)
    want = pml_reg.SparseCentersRegularizer(classes, k)(x)
    (g_got,) = torch.autograd.grad(got, x)
    (g_want,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)


def test_spherical_embedding_is_zero_for_equal_norms_and_low_precision_in_float32():
    x = torch.nn.functional.normalize(torch.randn(5, 4), dim=-1) * 3
    assert R.spherical_embedding(x).abs() < 1e-6
    half = torch.randn(6, 4).to(torch.bfloat16)
    out = R.lp(half)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.float(), R.lp(half.float()), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# Losses with regularizers
# ---------------------------------------------------------------------------------------------

EMBEDDING_LOSSES = {
    "contrastive": (pf.losses.contrastive, pml_losses.ContrastiveLoss),
    "triplet_margin": (
        pf.losses.triplet_margin,
        functools.partial(pml_losses.TripletMarginLoss, margin=0.2),
    ),
    "ntxent": (pf.losses.ntxent, pml_losses.NTXentLoss),
    "supcon": (pf.losses.supcon, pml_losses.SupConLoss),
    "multi_similarity": (pf.losses.multi_similarity, pml_losses.MultiSimilarityLoss),
}


@pytest.mark.parametrize("name", list(EMBEDDING_LOSSES))
def test_embedding_regularizer_matches_pml(name):
    ours, theirs = EMBEDDING_LOSSES[name]
    x = _x(16, 6)
    labels = torch.arange(16) // 4
    got = ours(
        x,
        labels,
        embedding_regularizer=functools.partial(R.lp, power=2),
        embedding_reg_weight=0.3,
    )
    want = theirs(embedding_regularizer=pml_reg.LpRegularizer(power=2), embedding_reg_weight=0.3)(
        x, labels
    )
    (g_got,) = torch.autograd.grad(got, x)
    (g_want,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, ours(x, labels))  # the regularizer counted


def test_streaming_and_chunked_paths_add_the_regularizer():
    x = _x(16, 6)
    labels = torch.arange(16) // 4
    full = pf.losses.ntxent(x, labels, embedding_regularizer=R.zero_mean, embedding_reg_weight=0.5)
    (g_full,) = torch.autograd.grad(full, x)
    tiled = pf.losses.ntxent(
        x, labels, chunk_size=5, embedding_regularizer=R.zero_mean, embedding_reg_weight=0.5
    )
    (g_tiled,) = torch.autograd.grad(tiled, x)
    torch.testing.assert_close(tiled, full)
    torch.testing.assert_close(g_tiled, g_full)
    value, grad = pf.chunked.value_and_grad(pf.losses.ntxent, chunk_size=5)(
        x.detach(), labels, embedding_regularizer=R.zero_mean, embedding_reg_weight=0.5
    )
    torch.testing.assert_close(value, full.detach())
    torch.testing.assert_close(grad, g_full)


def test_proxy_loss_weight_and_embedding_regularizers_match_pml():
    x = _x(16, 6)
    labels = torch.arange(16) % 4
    pml = pml_losses.ProxyAnchorLoss(
        4,
        6,
        weight_regularizer=pml_reg.CenterInvariantRegularizer(),
        weight_reg_weight=0.7,
        embedding_regularizer=pml_reg.LpRegularizer(),
        embedding_reg_weight=0.2,
    ).double()
    params = {"proxies": pml.proxies.detach().clone().requires_grad_()}
    got = pf.losses.proxy_anchor(
        x,
        labels,
        params,
        weight_regularizer=R.center_invariant,
        weight_reg_weight=0.7,
        embedding_regularizer=R.lp,
        embedding_reg_weight=0.2,
    )
    want = pml(x, labels)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    g_got = torch.autograd.grad(got, (x, params["proxies"]))
    g_want = torch.autograd.grad(want, (x, pml.proxies))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_margin_softmax_weight_regularizer_matches_pml():
    x = _x(16, 6)
    labels = torch.arange(16) % 4
    pml = pml_losses.CosFaceLoss(4, 6, weight_regularizer=pml_reg.RegularFaceRegularizer()).double()
    params = {"weight": pml.W.detach().t().clone().requires_grad_()}
    got = pf.losses.cosface(x, labels, params, weight_regularizer=R.regular_face)
    want = pml(x, labels)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    (g_got,) = torch.autograd.grad(got, params["weight"])
    (g_want,) = torch.autograd.grad(want, pml.W)
    torch.testing.assert_close(g_got, g_want.t(), rtol=1e-10, atol=1e-12)


def test_soft_triple_with_sparse_centers_matches_pml():
    x = _x(16, 6)
    labels = torch.arange(16) % 4
    pml = pml_losses.SoftTripleLoss(
        4, 6, centers_per_class=3, weight_regularizer=pml_reg.SparseCentersRegularizer(4, 3)
    ).double()
    params = {"weight": pml.fc.detach().t().reshape(4, 3, 6).clone()}
    reg = functools.partial(R.sparse_centers, num_classes=4, centers_per_class=3)
    got = pf.losses.soft_triple(x, labels, params, weight_regularizer=reg)
    torch.testing.assert_close(got, pml(x, labels), rtol=1e-10, atol=1e-12)


@pytest.mark.compile
def test_compiled_loss_with_regularizer_equals_eager():
    x = _x(16, 6).detach()
    labels = torch.arange(16) // 4

    def step(x, labels):
        return pf.losses.contrastive(x, labels, embedding_regularizer=R.spherical_embedding)

    torch.testing.assert_close(torch.compile(step, fullgraph=True)(x, labels), step(x, labels))


def test_meta_device():
    x = torch.randn(8, 4, device="meta")
    for reg in (R.lp, R.zero_mean, R.center_invariant, R.regular_face, R.spherical_embedding):
        assert reg(x).device.type == "meta"
    out = R.sparse_centers(x, num_classes=4, centers_per_class=2)
    assert out.device.type == "meta" and out.shape == ()


def test_none_reducer_keeps_the_regularizer_as_an_entry():
    x = _x(8, 4)
    labels = torch.arange(8) // 2
    out = pf.losses.contrastive(
        x, labels, reducer=pf.reducers.none(), embedding_regularizer=R.lp, embedding_reg_weight=2.0
    )
    entry = out["embedding_reg_loss"]
    assert entry["kind"] == "already_reduced"
    torch.testing.assert_close(entry["losses"], 2.0 * R.lp(x))


def test_errors():
    x = _x(6, 4)
    labels = torch.arange(6) // 2
    with pytest.raises(TypeError, match="embedding_regularizer must be a function"):
        pf.losses.contrastive(x, labels, embedding_regularizer="lp")
    with pytest.raises(ValueError, match="must return a 0-d tensor"):
        pf.losses.contrastive(x, labels, embedding_regularizer=lambda e: e.norm(dim=1))
    with pytest.raises(TypeError, match="embedding_reg_weight"):
        pf.losses.contrastive(x, labels, embedding_regularizer=R.lp, embedding_reg_weight="1")
    with pytest.raises(ValueError, match="centers_per_class must be an int >= 2"):
        R.sparse_centers(x, num_classes=6, centers_per_class=1)
    with pytest.raises(ValueError, match="rows"):
        R.sparse_centers(x, num_classes=4, centers_per_class=2)
    with pytest.raises(ValueError, match="at least 2 rows"):
        R.regular_face(x[:1])
    with pytest.raises(TypeError, match="embeddings must be a torch"):
        R.lp([1.0, 2.0])
    assert math.isfinite(float(R.lp(torch.zeros(3, 2))))
