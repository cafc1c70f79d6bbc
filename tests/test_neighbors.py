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


def _listing(monkeypatch):
    """The listings ``Batch.listed`` returns from here on (``None``: the static path)."""
    from pmlfunc.losses._batch import Batch

    listed = []
    real = Batch.listed
    monkeypatch.setattr(
        Batch, "listed", lambda self, *a, **k: listed.append(real(self, *a, **k)) or listed[-1]
    )
    return listed


FEW_POSITIVES = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # one positive per row of 16


@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("layout", [FEW_POSITIVES, UNEVEN])
def test_angular_listed_pairs_equal_the_gram_matmul(layout, with_ref, gen, monkeypatch):
    """In CPU eager mode, with few positive pairs, the terms come from the listed pairs (a
    log-sum-exp over the anchor's negatives each; listed from the labels, ``Batch.listed``);
    under a torch.func transform (as under compile or on an accelerator) from the static Gram
    matmul. Both equal PML."""
    emb, labels = data(gen, layout)
    ref, ref_labels = (
        (randn(gen, len(REF_LABELS), D), lab(REF_LABELS)) if with_ref else (None, None)
    )
    listed = _listing(monkeypatch)
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


@pytest.mark.parametrize("case", ["self", "ref", "tuple"])
def test_nca_listed_positives_equal_every_column_masked(case, gen, monkeypatch):
    """In CPU eager mode, with few positives per row, each row's probability (PML's form: its
    softmax summed over the positives) reads their listed columns alone; under a torch.func
    transform every column, masked, in the log-sum-exp form. Both equal PML (float64)."""
    emb, labels = data(gen, FEW_POSITIVES)
    ref, ref_labels = (randn(gen, 16, D), lab(FEW_POSITIVES)) if case == "ref" else (None, None)
    pairs = pml_mined("pairs", emb, labels) if case == "tuple" else None
    kw = {"softmax_scale": 3.0, "indices_tuple": pairs}
    listed = _listing(monkeypatch)
    eager = run_pf("nca", emb, labels, ref, ref_labels, **kw)
    assert listed[-1] is not None  # the listed path
    args = (emb,) if ref is None else (emb, ref)

    def loss(*t):
        extra = {} if ref is None else {"ref_emb": t[1], "ref_labels": ref_labels}
        return nca(t[0], labels, **extra, **kw)

    grads, value = torch.func.grad_and_value(loss, argnums=tuple(range(len(args))))(*args)
    assert listed[-1] is None  # inside the transform: every column
    assert_same(eager, (value, list(grads)), **TOL[F64])
    pml = run_pml("nca", emb, labels, ref, ref_labels, pairs, softmax_scale=3.0)
    assert_same(eager, pml, **TOL[F64])


def _angular_data(gen, scale, with_ref):
    """Rows of norm ``scale`` (float64) around their class's centre, as trained embeddings
    are: 32 rows in 8 classes of 4, or 16 query rows in 4 classes of 4 against 32 references
    in 8 classes of 4; at most 4 positives per row: listed in CPU eager mode. With α = 80° and
    unit rows (or α = 40° and rows of norm 50) the logits ``4t (x̂_a + x̂_p)·x_n`` span ~250
    nats: float32 exponentials underflow unless a pair's sum is shifted by a maximum over its
    negatives."""
    centres = randn(gen, 8, 8)

    def rows(labels):
        x = centres[labels] + 0.5 * randn(gen, len(labels), 8)
        return torch.nn.functional.normalize(x, dim=-1) * scale

    labels = torch.arange(16 if with_ref else 32) // 4
    if not with_ref:
        return rows(labels), labels, None, None
    ref_labels = torch.arange(32) % 8
    return rows(labels), labels, rows(ref_labels), ref_labels


def _angular_f32(emb, labels, ref, ref_labels, alpha, transform=False):
    """pmlfunc's float32 value and gradients, eagerly or under ``torch.func.grad_and_value``
    (the static Gram-matmul path)."""
    args = [emb.float()] if ref is None else [emb.float(), ref.float()]

    def loss(*t):
        extra = {} if ref is None else {"ref_emb": t[1], "ref_labels": ref_labels}
        return angular(t[0], labels, alpha=alpha, **extra)

    if not transform:
        return value_and_grads(loss, *args)
    grads, value = torch.func.grad_and_value(loss, argnums=tuple(range(len(args))))(*args)
    return value, list(grads)


LARGE_LOGITS = [(80.0, 1.0), (40.0, 50.0), (85.0, 1.0)]  # (α, row norm)


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize(("alpha", "scale"), LARGE_LOGITS)
def test_angular_float32_listed_pairs_are_exact_at_large_logits(
    alpha, scale, with_ref, gen, monkeypatch
):
    """Each listed pair's log-sum-exp is shifted by its own maximum over the anchor's negatives:
    float32 equals the float64 loop reference and PML 2.9.0 in float32 (the shared shifts of the
    Gram matmul underflowed: the loss was up to 2x the true one, the gradient ~100 % off)."""
    emb, labels, ref, ref_labels = _angular_data(gen, scale, with_ref)
    listed = _listing(monkeypatch)
    got = _angular_f32(emb, labels, ref, ref_labels, alpha)
    assert listed[-1] is not None  # the listed path
    tol = {"rtol": 1e-4, "atol": 1e-5 * float(got[1][0].abs().max())}
    assert_same(got, run_ref("angular", emb, labels, ref, ref_labels, alpha=alpha), **tol)
    pml = run_pml("angular", emb.float(), labels, ref, ref_labels, alpha=alpha)
    assert_same(got, pml, **tol)


def test_angular_float32_dense_batch_in_eager_mode_falls_back_to_exact_pairs(monkeypatch):
    """A batch with many positives per anchor (16 rows, 4 classes: not listed) takes the Gram
    matmul; at PML's default α = 40° with raw norms up to 280 some pairs' sums fall below
    float32's normal range there, even with the factors' headroom (norms 10–70 made the loss
    99.62 against 98.79 before it, gradients 42 % off). In CPU eager mode such a batch is
    recomputed on its listed pairs: float32 equals float64 and PML."""
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(16) % 4
    norms = torch.linspace(30, 250, 16, dtype=F64).unsqueeze(1) / 6**0.5
    emb = torch.randn(16, 6, generator=g, dtype=F64) * norms
    listed = _listing(monkeypatch)
    got = _angular_f32(emb, labels, None, None, 40.0)
    assert listed[0] is None and listed[-1] is not None  # dense first, then the exact pairs
    tol = {"rtol": 1e-5, "atol": 1e-5 * float(got[1][0].abs().max())}
    assert_same(got, run_ref("angular", emb, labels, None, None, alpha=40.0), **tol)
    assert_same(got, run_pml("angular", emb.float(), labels, None, None, alpha=40.0), **tol)


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize(("alpha", "scale"), LARGE_LOGITS[:2])
def test_angular_float32_static_path_shifts_by_the_negatives_maximum(
    alpha, scale, with_ref, gen, monkeypatch
):
    """The static path (under ``torch.func`` transforms, compile and on accelerators) keeps the
    Gram matmul, each side shifted by its maximum over the pair's negatives (not over every
    column, the positive's own and its class included, which pushed the negatives' exponentials
    below float32's range): float32 equals the float64 loop reference where a pair's largest
    term is within ~87 nats of the shifts (here: these batches)."""
    emb, labels, ref, ref_labels = _angular_data(gen, scale, with_ref)
    listed = _listing(monkeypatch)
    got = _angular_f32(emb, labels, ref, ref_labels, alpha, transform=True)
    assert listed[-1] is None  # the static path
    tol = {"rtol": 1e-4, "atol": 1e-5 * float(got[1][0].abs().max())}
    assert_same(got, run_ref("angular", emb, labels, ref, ref_labels, alpha=alpha), **tol)


def test_angular_listed_anchor_without_negatives_adds_zero_with_zero_gradient(gen, monkeypatch):
    """A listed pair whose anchor has no negative (every reference shares its label; the tuple
    lists the pairs) adds log(1 + 0) = 0 with finite, zero gradients: its masked log-sum-exp is
    ``−finfo.max``, not a NaN from an empty maximum."""
    emb, labels = randn(gen, 6, 8), lab([0, 0, 0, 1, 1, 1])
    ref, ref_labels = randn(gen, 32, 8), lab([1] * 32)
    # anchors 0-2 (label 0): every reference is a negative; 3-5 (label 1): none is
    pairs = (lab([0, 1, 3, 4]), lab([2, 5, 31, 30]), lab([0, 3]), lab([31, 0]))
    listed = _listing(monkeypatch)
    got = run_pf("angular", emb, labels, ref, ref_labels, indices_tuple=pairs)
    assert listed[-1] is not None  # the listed path (four pairs)
    assert all(torch.isfinite(g).all() for g in got[1])
    assert torch.count_nonzero(got[1][0][3:]) == 0  # the anchors without negatives
    want = run_ref("angular", emb, labels, ref, ref_labels, indices_tuple=pairs)
    assert_same(got, want, **REF_TOL)
    assert_same(got, run_pml("angular", emb, labels, ref, ref_labels, pairs), **TOL[F64])


def _nca_subnormal_case():
    """128 rows in 32 random classes with σ = 64: one anchor's probability is subnormal in
    float32 (~1e-42: −log p ≈ 96, finite), so 1/p overflows."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(128, 32, generator=g), torch.randint(0, 32, (128,), generator=g)


@pytest.mark.parametrize("transform", [False, True], ids=["eager", "func_grad"])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_nca_subnormal_probability_keeps_a_finite_gradient(dtype, transform):
    """−log p as −lse_{j ∈ P(i)} log_softmax(z_i)_j: where p is subnormal in float32 the loss
    and its gradient equal float64's (PML's form −log Σ softmax gave NaN in all 4096 gradient
    entries: 1/p = inf, inf·0 = NaN in the softmax's backward), eagerly (the positives listed)
    and under ``torch.func.grad`` (every column masked)."""
    x, labels = _nca_subnormal_case()
    xd = x.to(dtype)
    z = -64.0 * pfd.lp(power=2)(xd.float())
    z.fill_diagonal_(torch.finfo(F32).min)
    p = (torch.softmax(z, -1) * (labels[:, None] == labels[None]).float()).sum(-1)
    assert ((p > 0) & (p < torch.finfo(F32).tiny)).any()  # the case this covers

    def loss(e):
        return nca(e, labels, softmax_scale=64.0)

    if transform:
        g, value = torch.func.grad_and_value(loss)(xd)
        got = (value, [g])
    else:
        got = value_and_grads(loss, xd)
    assert torch.isfinite(got[0]) and torch.isfinite(got[1][0]).all()
    want = value_and_grads(loss, xd.double())  # float64 of the same (rounded) inputs
    rtol = 1e-4 if dtype == F32 else 2e-2  # bfloat16: the gradient is rounded to 8 bits
    assert_same(got, want, rtol=rtol, atol=rtol * float(want[1][0].abs().max()))
    if dtype == F32:  # the value is PML 2.9.0's (its gradient is NaN)
        torch.testing.assert_close(got[0], run_pml("nca", xd, labels, softmax_scale=64.0)[0])


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
