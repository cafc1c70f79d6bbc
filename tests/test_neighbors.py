"""Tests for ``pmlfunc.losses.neighbors``: ``nca``, ``npairs``, ``angular``, ``instance``,
``ranked_list``, ``manifold``.

Each loss's class runs the neighbourhood suite (tests/suites/neighborhood.py: the loop reference,
PML 2.9.0 parity, chunked gradients, edge cases, low precision); the tests below it are this
family's own. The properties every loss keeps are in test_conformance.py.

Deliberate deviations from PML 2.9.0 (tested against the reference, not PML):
  (a) ``nca``: PML returns NaN (mean of nothing) when no anchor has a positive; pmlfunc 0.
      PML returns 0 for any batch of one, also against a reference set; pmlfunc scores it.
  (b) ``threshold_consistent_margin`` with ``ref_emb`` (tests/test_pairs.py): PML indexes the
      batch with reference indices (a bug); pmlfunc uses the reference rows.
  (c) ``manifold``: PML inverts in float32 even for float64 input (float64 parity is to ~1e-8);
      its random meta-classes come from the global RNG, pmlfunc's from ``generator=``
      (parity with PML on given meta-classes; the random path against the reference with the
      same draws); ``lambdaC=inf`` gives the context loss alone (PML: inf·loss).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F32, F64, REF_LABELS, UNEVEN, assert_same, lab, randn, value_and_grads
from pytorch_metric_learning import losses as pml_losses
from reference import neighbors
from suites.neighborhood import (
    REF_TOL,
    TOL,
    D,
    NeighborhoodLoss,
    data,
    pml_mined,
    run_pf,
    run_pml,
    run_ref,
)

import pmlfunc.distances as pfd
from pmlfunc.losses import (
    angular,
    instance,
    manifold,
    manifold_init,
    manifold_meta_classes,
    nca,
    npairs,
    ranked_list,
)


class TestNca(NeighborhoodLoss):
    name = "nca"


class TestNpairs(NeighborhoodLoss):
    name = "npairs"


class TestAngular(NeighborhoodLoss):
    name = "angular"


class TestInstance(NeighborhoodLoss):
    name = "instance"


class TestRankedList(NeighborhoodLoss):
    name = "ranked_list"


# ----------------------------------------------------------------------------------------------
# nca, angular
# ----------------------------------------------------------------------------------------------
def test_nca_without_any_positive_is_zero_not_nan(gen):
    """Deviation (a): PML gives NaN; pmlfunc and the reference give 0 with zero gradients."""
    emb, labels = data(gen, [0, 1, 2, 3, 4])
    pml_v, _ = run_pml("nca", emb, labels)
    assert torch.isnan(pml_v)
    got = run_pf("nca", emb, labels)
    assert_same(got, run_ref("nca", emb, labels), **REF_TOL)
    assert got[0] == 0 and torch.count_nonzero(got[1][0]) == 0


def test_nca_drops_underflowing_anchors_like_pml(gen):
    emb, labels = data(gen, UNEVEN)
    for dtype in (F64, F32):
        e = emb.to(dtype)
        assert_same(
            run_pf("nca", e, labels, softmax_scale=400.0),
            run_pml("nca", e, labels, softmax_scale=400.0),
            **TOL[dtype],
        )


@pytest.mark.parametrize("alpha", [20.0, 60.0])
def test_angular_unnormalised_negatives_and_other_angles(alpha, gen):
    """PML uses the references as given in the negative term: so does pmlfunc."""
    emb, labels = data(gen, UNEVEN, scale=2.0)
    got = run_pf("angular", emb, labels, alpha=alpha)
    assert_same(got, run_ref("angular", emb, labels, alpha=alpha), **REF_TOL)
    assert_same(got, run_pml("angular", emb, labels, alpha=alpha), **TOL[F64])


FEW_POSITIVES = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # one positive per row of 16


@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("layout", [FEW_POSITIVES, UNEVEN])
def test_angular_listed_pairs_equal_the_gram_matmul(layout, with_ref, gen, monkeypatch):
    """In CPU eager mode, with few positive pairs, the terms come from the listed pairs (one row
    dot product each; listed from the labels, ``Batch.listed``); under a torch.func transform
    (as under compile or on an accelerator) from the static Gram matmul. Both equal PML."""
    from pmlfunc.losses._batch import Batch

    emb, labels = data(gen, layout)
    ref, ref_labels = (
        (randn(gen, len(REF_LABELS), D), lab(REF_LABELS)) if with_ref else (None, None)
    )
    listed = []
    real = Batch.listed
    monkeypatch.setattr(
        Batch, "listed", lambda self, *a, **k: listed.append(real(self, *a, **k)) or listed[-1]
    )
    eager = run_pf("angular", emb, labels, ref, ref_labels)
    other = labels if ref is None else ref_labels
    same = labels[:, None] == other[None, :]
    if ref is None:
        same.fill_diagonal_(False)
    few = 8 * int(same.sum(-1).max()) <= same.shape[-1]  # positives per row: listed
    assert (listed[-1] is not None) == few
    args = (emb,) if ref is None else (emb, ref)

    def loss(*t):
        return angular(
            t[0], labels, **({} if ref is None else {"ref_emb": t[1]}), ref_labels=ref_labels
        )

    grads, value = torch.func.grad_and_value(loss, argnums=tuple(range(len(args))))(*args)
    assert listed[-1] is None  # inside the transform: the static path
    assert_same(eager, (value, list(grads)), **TOL[F64])
    assert_same(eager, run_pml("angular", emb, labels, ref, ref_labels), **TOL[F64])


# ----------------------------------------------------------------------------------------------
# manifold (params, randomness)
# ----------------------------------------------------------------------------------------------
K = 4
META = [0, 1, 2, 3, 1, 2, 0, 3, 3]


def _manifold_pml(dtype, params, **hp):
    loss = pml_losses.ManifoldLoss(D, K=K, **hp).to(dtype)
    loss.proxies.data.copy_(params["proxies"])
    return loss


@pytest.mark.parametrize("hp", [{}, {"lambdaC": 0.3, "alpha": 0.6, "margin": 0.05}])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_manifold_pml_parity(hp, dtype, gen):
    emb = randn(gen, len(META), D, dtype=dtype)
    params = manifold_init(D, K, generator=gen, dtype=dtype)
    meta = lab(META)
    pml = _manifold_pml(dtype, params, **hp)
    e = emb.clone().requires_grad_(True)
    out = pml(e, indices_tuple=meta)
    out.backward()
    want = (out.detach(), [e.grad, pml.proxies.grad])
    got = value_and_grads(
        lambda e, p: manifold(e, None, {"proxies": p}, indices_tuple=meta, **hp),
        emb,
        params["proxies"],
    )
    tol = TOL[F32] if dtype == F32 else {"rtol": 1e-6, "atol": 1e-8}  # deviation (c)
    assert_same(got, want, **tol)


@pytest.mark.parametrize("lam", [1.0, math.inf, 0.0])
def test_manifold_matches_reference_with_its_random_draws(lam, gen):
    emb = randn(gen, len(META) + 2, D)
    params = manifold_init(D, K, generator=gen, dtype=F64)
    seed = torch.tensor(1234)
    meta = manifold_meta_classes(seed, emb.shape[0], K)
    assert sorted(set(meta.tolist())) == list(range(K))
    got = value_and_grads(
        lambda e, p: manifold(e, None, {"proxies": p}, generator=seed, lambdaC=lam),
        emb,
        params["proxies"],
    )
    want = value_and_grads(
        lambda e, p: neighbors.manifold(e, p, meta, lambdaC=lam), emb, params["proxies"]
    )
    assert_same(got, want, **REF_TOL)


def test_manifold_generator_reproducible_and_init_matches_pml():
    emb = torch.randn(10, D, generator=torch.Generator().manual_seed(5))
    params = manifold_init(D, K, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(3)
    assert torch.equal(pml_losses.ManifoldLoss(D, K=K).proxies.data, params["proxies"])
    a = manifold(emb, None, params, generator=torch.Generator().manual_seed(7))
    b = manifold(emb, None, params, generator=torch.Generator().manual_seed(7))
    c = manifold(emb, None, params, generator=torch.tensor(7))
    assert torch.equal(a, b) and torch.isfinite(c)


def test_manifold_init_on_meta():
    params = manifold_init(D, 3, device="meta")
    assert params["proxies"].device.type == "meta" and params["proxies"].shape == (3, D)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
def test_bad_input(gen):
    emb, labels = data(gen, UNEVEN)
    ref, ref_labels = randn(gen, 8, D), lab(REF_LABELS)
    with pytest.raises(ValueError, match="labels"):
        nca(emb, None, indices_tuple=pml_mined("pairs", emb, labels))
    for fn in (npairs, instance, lambda *a, **k: ranked_list(*a, margin=0.4, Tn=1.0, **k)):
        with pytest.raises(ValueError, match="ref_emb"):
            fn(emb, labels, ref_emb=ref, ref_labels=ref_labels)
    for fn in (instance, lambda *a, **k: ranked_list(*a, margin=0.4, Tn=1.0, **k)):
        with pytest.raises(ValueError, match="indices_tuple"):
            fn(emb, labels, indices_tuple=pml_mined("pairs", emb, labels))
    with pytest.raises(ValueError, match="distance"):
        angular(emb, labels, distance=pfd.cosine())
    with pytest.raises(ValueError, match="distance"):
        angular(emb, labels, distance=pfd.lp(power=2))
    with pytest.raises(ValueError, match="distance"):
        instance(emb, labels, distance=pfd.lp())
    with pytest.raises(ValueError, match="imbalance"):
        ranked_list(emb, labels, margin=0.4, Tn=1.0, imbalance=1.5)
    with pytest.raises(TypeError, match="margin"):
        ranked_list(emb, labels, margin="x", Tn=1.0)
    with pytest.raises(TypeError):
        ranked_list(emb, labels, margin=0.4)  # Tn is required, as in PML
    with pytest.raises(ValueError, match="softmax_scale"):
        nca(emb, labels, softmax_scale=torch.ones(2))
    with pytest.raises(ValueError, match="labels"):
        npairs(emb, labels[:-1])
    with pytest.raises(TypeError, match="embeddings"):
        instance(emb.long(), labels)
    params = manifold_init(D, K)
    with pytest.raises(ValueError, match="generator"):
        manifold(emb, None, params)
    with pytest.raises(ValueError, match="labels"):
        manifold(emb, labels, params, generator=torch.tensor(0))
    with pytest.raises(ValueError, match="lambdaC"):
        manifold(emb, None, params, lambdaC=-1.0, generator=torch.tensor(0))
    with pytest.raises(ValueError, match="number of proxies"):
        manifold(emb[:3], None, params, generator=torch.tensor(0))
    with pytest.raises(ValueError, match="meta-classes"):
        manifold(emb, None, params, indices_tuple=lab([0, 1]))
    with pytest.raises(ValueError, match="embedding size"):
        manifold(emb, None, manifold_init(D + 1, K), generator=torch.tensor(0))
    with pytest.raises(ValueError, match="num_proxies"):
        manifold_init(D, 0)


def test_instance_gradient_with_denormal_softmax_entries_is_the_scaled_one():
    # γ = 64 puts softmax entries below float32's normal range; the scale goes on ∂S before
    # the products: the gradient still equals float64's to float32 rounding
    gen = torch.Generator().manual_seed(1)
    emb = torch.randn(900, 16, generator=gen)
    labels = torch.randint(0, 300, (900,), generator=gen)
    tiny = torch.finfo(torch.float32).tiny
    x = torch.nn.functional.normalize(emb, dim=-1)
    z = (64 * x @ x.T).requires_grad_()
    target = torch.unique(labels, return_inverse=True)[1]
    torch.nn.functional.cross_entropy(z, target).backward()
    assert ((z.grad != 0) & (z.grad.abs() < tiny)).any()  # the case this covers
    e32 = emb.clone().requires_grad_()
    instance(e32, labels, gamma=64).backward()
    e64 = emb.double().requires_grad_()
    instance(e64, labels, gamma=64).backward()
    torch.testing.assert_close(e32.grad, e64.grad.float(), rtol=1e-4, atol=1e-7)
