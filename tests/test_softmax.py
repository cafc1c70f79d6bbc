"""Tests for ``pmlfunc.losses.softmax``: ``ntxent``, ``supcon``, ``decoupled_contrastive``,
``multi_supcon``.

Each loss's class runs its suite (tests/suites/: the loop reference, PML 2.9.0 parity, edge
cases, bad input); the tests below it are this family's own. The PML-3-only losses have no PML
2.9.0 counterpart: their references are independent transcriptions of the formulas (for DCL, also
of the paper's two-view equation); ``multi_supcon`` with one-hot labels is SupCon, so it is
compared with PML's ``SupConLoss``. The properties every loss keeps are in test_conformance.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    F32,
    F64,
    REF_LABELS,
    UNEVEN,
    assert_same,
    assert_vmap_equals_a_loop,
    lab,
    randn,
    value_and_grads,
)
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from reference import softmax
from suites.core import CoreLoss
from suites.pml3 import PF_DIST, Pml3Loss

import pmlfunc as pf
import pmlfunc.miners as pfm
import pmlfunc.reducers as pfr
from pmlfunc.losses import decoupled_contrastive, multi_supcon, ntxent, supcon

REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL = {F64: {"rtol": 1e-9, "atol": 1e-12}, F32: {"rtol": 2e-4, "atol": 2e-6}}


class TestNtxent(CoreLoss):
    name = "ntxent"
    hyper = "temperature"


class TestSupcon(CoreLoss):
    name = "supcon"
    hyper = "temperature"


class TestDecoupledContrastive(Pml3Loss):
    name = "decoupled_contrastive"


class TestDecoupledContrastiveWeighted(Pml3Loss):
    name = "dclw"


def one_hot_multi(labels, num_classes=None):
    return F.one_hot(labels, num_classes).to(torch.int64)


def random_multi_hot(gen, rows, classes, p=0.4):
    return (torch.rand(rows, classes, generator=gen) < p).to(torch.int64)


# ----------------------------------------------------------------------------------------------
# ntxent, supcon
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, -0.5])
@pytest.mark.parametrize("fn", [ntxent, supcon])
def test_nonpositive_temperature_raises(fn, value):
    with pytest.raises(ValueError, match="temperature"):
        fn(torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2]), temperature=value)


_TINY_T_EMB = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
_TINY_T_LABELS = torch.arange(32) // 4


@functools.cache
def _tiny_temperature_reference(reducer: str):
    """The float64 loss and gradient of NT-Xent at τ = 0.005 with float32's ε, checked to have
    positives in the band where ``torch.sigmoid`` flushes to 0 in float32."""
    emb, labels, t = _TINY_T_EMB, _TINY_T_LABELS, 0.005
    unit = F.normalize(emb.double(), dim=-1)
    s = unit @ unit.T / t
    same = labels[:, None] == labels[None]
    lse = s.masked_fill(same, -torch.inf).logsumexp(-1, keepdim=True)
    z = (s - lse)[same & ~torch.eye(len(emb), dtype=torch.bool)]
    assert ((z > -104) & (z < -88.7)).any()
    x64 = emb.double().requires_grad_()
    spec = ("avg_nonzero", {}) if reducer == "batch" else ("mean", {})
    want = softmax.ntxent(x64, labels, temperature=t, reducer=spec, eps=torch.finfo(F32).tiny)
    return want.detach(), torch.autograd.grad(want, x64)[0]


@pytest.mark.parametrize("path", ["engine", "tiled", "batch", "static"])
def test_ntxent_at_tiny_temperatures_keeps_the_sigmoids_subnormal_tail(path):
    """At τ = 0.005 some positives' ``z = S − lse_neg`` fall in (−104, −88.7), where
    ``torch.sigmoid`` returns 0 in float32 but ``σ(z)`` is a subnormal number comparable to
    ``ε = finfo.tiny``: PML's ``−log(σ + ε)`` (and its gradient ``σ/(σ + ε)``) reads it. Float32
    against the float64 formula with float32's ε, on every path: the engine, tiled, the batch
    path (``avg_nonzero``) and the static masked path (inside ``torch.func.grad``)."""
    emb, labels, t = _TINY_T_EMB, _TINY_T_LABELS, 0.005
    want, want_grad = _tiny_temperature_reference("batch" if path == "batch" else "mean")

    kw = {"chunk_size": 16} if path == "tiled" else {}
    if path == "batch":
        kw["reducer"] = pf.reducers.avg_nonzero()

    def loss(e):
        return ntxent(e, labels, temperature=t, **kw)

    if path == "static":
        got, grad = torch.func.grad_and_value(loss)(emb)[::-1]
    else:
        e = emb.clone().requires_grad_()
        got = loss(e)
        (grad,) = torch.autograd.grad(got, e)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    err = (grad.double() - want_grad).norm(dim=1) / want_grad.norm(dim=1)
    assert float(err.max()) < 1e-4  # before: 2.9e-2


# ----------------------------------------------------------------------------------------------
# decoupled_contrastive
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", [None, 0.5])
def test_dcl_paper_two_views(gen, sigma):
    n = 5
    z1, z2 = randn(gen, n, 4), randn(gen, n, 4)
    labels = torch.cat([torch.arange(n), torch.arange(n)])
    got = value_and_grads(
        lambda a, b: decoupled_contrastive(torch.cat([a, b]), labels, temperature=0.2, sigma=sigma),
        z1,
        z2,
    )
    want = value_and_grads(
        lambda a, b: softmax.decoupled_contrastive_two_views(a, b, 0.2, sigma), z1, z2
    )
    assert_same(got, want, **REF_TOL)


def test_dcl_relations(gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    # DCL drops the positive from NT-Xent's denominator: DCL ≤ NT-Xent term by term.
    assert decoupled_contrastive(emb, labels, temperature=0.3) < ntxent(
        emb, labels, temperature=0.3
    )
    # DCLW's weights average 1: with all positive similarities equal, DCLW == DCL.
    n = 4
    z = randn(gen, n, 3)
    two = torch.cat([z, z])  # each sample's two views coincide: every s_ap = 1
    y = torch.cat([torch.arange(n), torch.arange(n)])
    torch.testing.assert_close(
        decoupled_contrastive(two, y, sigma=0.5), decoupled_contrastive(two, y)
    )
    # a tensor temperature and sigma give the same value, and a temperature gradient
    t = torch.tensor(0.3, dtype=F64, requires_grad=True)
    v = decoupled_contrastive(emb, labels, temperature=t, sigma=torch.tensor(0.5, dtype=F64))
    torch.testing.assert_close(v, decoupled_contrastive(emb, labels, temperature=0.3, sigma=0.5))
    (gt,) = torch.autograd.grad(v, t)
    assert torch.isfinite(gt)


def test_dcl_bad_input(gen):
    emb, labels = randn(gen, 4, 3), lab([0, 0, 1, 1])
    with pytest.raises(ValueError, match="temperature"):
        decoupled_contrastive(emb, labels, temperature=0.0)
    with pytest.raises(ValueError, match="sigma"):
        decoupled_contrastive(emb, labels, sigma=-1.0)
    with pytest.raises(ValueError, match="labels"):
        decoupled_contrastive(emb, lab([0, 1]))
    with pytest.raises(TypeError, match="distance"):
        decoupled_contrastive(emb, labels, distance="cosine")


def test_dcl_chunked_value_and_grad(gen):
    """DCL splits over anchors; DCLW's weights average over every positive pair: it does not."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    vg = pf.chunked.value_and_grad(decoupled_contrastive, chunk_size=4)
    v, g = vg(emb, labels, temperature=0.3)
    want = value_and_grads(lambda e: decoupled_contrastive(e, labels, temperature=0.3), emb)
    assert_same((v, [g]), want, **TOL[F64])
    with pytest.raises(ValueError, match="sigma"):
        vg(emb, labels, sigma=0.5)


def test_dcl_vmap_equals_a_loop(gen):
    emb, labels = randn(gen, 9, 4), lab([0, 0, 1, 1, 2, 2, 3, 3, 3])
    assert_vmap_equals_a_loop(lambda x: decoupled_contrastive(x, labels, sigma=0.5), emb)


# ----------------------------------------------------------------------------------------------
# multi_supcon
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [0.0, 0.3])
@pytest.mark.parametrize("distance", [None, "lp"])
@pytest.mark.parametrize("reducer", ["avg_nonzero", "mean"])
def test_multi_supcon_reference(gen, threshold, distance, reducer):
    labels = random_multi_hot(gen, 9, 4)
    labels[0] = 0  # an empty label set (J = 0 against everything, itself included)
    labels[1] = 0
    emb = randn(gen, 9, 5)
    red = {"avg_nonzero": pfr.avg_nonzero, "mean": pfr.mean}[reducer]()
    kw = {"temperature": 0.3, "threshold": threshold}
    got = value_and_grads(
        lambda e: multi_supcon(
            e,
            labels,
            **kw,
            reducer=red,
            **({} if distance is None else {"distance": PF_DIST[distance]()}),
        ),
        emb,
    )
    want = value_and_grads(
        lambda e: softmax.multi_supcon(
            e, labels, **kw, distance=distance or "cosine", reducer=reducer
        ),
        emb,
    )
    assert_same(got, want, **REF_TOL)


def test_multi_supcon_ref_set_and_tuples(gen):
    labels, ref_labels = random_multi_hot(gen, 7, 4), random_multi_hot(gen, 6, 4)
    emb, ref_emb = randn(gen, 7, 5), randn(gen, 6, 5)
    got = value_and_grads(
        lambda e, r: multi_supcon(e, labels, ref_emb=r, ref_labels=ref_labels, temperature=0.3),
        emb,
        ref_emb,
    )
    want = value_and_grads(
        lambda e, r: softmax.multi_supcon(e, labels, r, ref_labels, temperature=0.3), emb, ref_emb
    )
    assert_same(got, want, **REF_TOL)
    tup = (lab([0, 0, 2, 3, 0]), lab([1, 1, 4, 5, 1]), lab([1, 2, 4, 6, 0]))  # a repeated triplet
    got = value_and_grads(lambda e: multi_supcon(e, labels, indices_tuple=tup), emb)
    want = value_and_grads(lambda e: softmax.multi_supcon(e, labels, indices_tuple=tup), emb)
    assert_same(got, want, **REF_TOL)


# With one-hot labels J is 0/1 and the loss is SupCon: PML 2.9.0 parity through SupConLoss.
SUPCON_CASES = {
    "uneven": (UNEVEN, None),
    "singletons": ([5, 5, 1, 7, 7, 3], None),
    "ref_set": (UNEVEN, REF_LABELS),
    "pml_pairs": (UNEVEN, "pml_pairs"),
    "pml_triplets": (UNEVEN, "pml_triplets"),
    "pf_pairs": (UNEVEN, "pf_pairs"),
}


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("case", list(SUPCON_CASES))
@pytest.mark.parametrize("distance", ["cosine", "lp"])
def test_multi_supcon_one_hot_is_pml_supcon(gen, dtype, case, distance):
    layout, extra = SUPCON_CASES[case]
    labels = lab(layout)
    emb = randn(gen, len(layout), 5, dtype=dtype)
    pml_dist = {
        "cosine": pml_distances.CosineSimilarity,
        "lp": pml_distances.LpDistance,
    }[distance]()
    pml = pml_losses.SupConLoss(temperature=0.3, distance=pml_dist)
    kw = {"temperature": 0.3, "distance": PF_DIST[distance]()}
    c = int(max(layout + (REF_LABELS if extra == REF_LABELS else []))) + 1
    if extra == REF_LABELS:
        ref_labels = lab(REF_LABELS)
        ref_emb = randn(gen, len(REF_LABELS), 5, dtype=dtype)
        got = value_and_grads(
            lambda e, r: multi_supcon(
                e,
                one_hot_multi(labels, c),
                ref_emb=r,
                ref_labels=one_hot_multi(ref_labels, c),
                **kw,
            ),
            emb,
            ref_emb,
        )
        want = value_and_grads(
            lambda e, r: pml(e, labels, ref_emb=r, ref_labels=ref_labels), emb, ref_emb
        )
    else:
        given = listed = None
        if extra == "pml_pairs":
            given = listed = pml_miners.PairMarginMiner(0.3, 0.9)(emb, labels)
        elif extra == "pml_triplets":
            given = listed = pml_miners.TripletMarginMiner(0.4)(emb, labels)
        elif extra == "pf_pairs":
            given = pfm.pair_margin(emb, labels, pos_margin=0.3, neg_margin=0.9)
            listed = given.to_indices()
        got = value_and_grads(
            lambda e: multi_supcon(e, one_hot_multi(labels, c), indices_tuple=given, **kw), emb
        )
        want = value_and_grads(lambda e: pml(e, labels, indices_tuple=listed), emb)
    assert_same(got, want, **TOL[dtype])


def test_multi_supcon_edge_cases(gen):
    # no positives (all label sets disjoint or empty), one shared set (no negatives),
    # all empty, a single row, bool and float labels, low precision
    x = randn(gen, 4, 3)
    for y in [
        torch.eye(4, dtype=torch.int64),
        torch.ones(4, 2, dtype=torch.int64),
        torch.zeros(4, 2, dtype=torch.int64),
    ]:
        v, (g,) = value_and_grads(lambda e, y=y: multi_supcon(e, y), x)
        assert v == 0 and (g == 0).all()
    v, (g,) = value_and_grads(lambda e: multi_supcon(e, torch.ones(1, 2)), x[:1])
    assert v == 0 and torch.isfinite(g).all()
    y = random_multi_hot(gen, 4, 3)
    torch.testing.assert_close(multi_supcon(x, y.bool()), multi_supcon(x, y.double()))
    half = multi_supcon(x.to(torch.float16), y)
    assert half.dtype == torch.float32 and torch.isfinite(half)


def test_multi_supcon_vmap_equals_a_loop(gen):
    emb, multi = randn(gen, 9, 4), random_multi_hot(gen, 9, 3)
    assert_vmap_equals_a_loop(lambda x: multi_supcon(x, multi), emb)


def test_multi_supcon_bad_input(gen):
    emb = randn(gen, 4, 3)
    y = random_multi_hot(gen, 4, 3)
    with pytest.raises(ValueError, match="2-D multi-hot"):
        multi_supcon(emb, lab([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="rows"):
        multi_supcon(emb, y[:3])
    with pytest.raises(TypeError, match="labels"):
        multi_supcon(emb, [[1, 0]] * 4)
    with pytest.raises(ValueError, match="ref_labels"):
        multi_supcon(emb, y, ref_emb=emb)
    with pytest.raises(ValueError, match="classes"):
        multi_supcon(emb, y, ref_emb=emb, ref_labels=y[:, :2])
    with pytest.raises(ValueError, match="ref_emb"):
        multi_supcon(emb, y, ref_labels=y)
    with pytest.raises(ValueError, match="temperature"):
        multi_supcon(emb, y, temperature=-1.0)
    with pytest.raises(ValueError, match="mat"):
        multi_supcon(emb, y, mat=torch.zeros(3, 3, dtype=F64))
