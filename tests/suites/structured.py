"""Tests for ``pmlfunc.losses.structured``: lifted structure, generalized lifted structure,
circle, intra-pair variance, tuplet margin, SNR contrastive and margin losses.

Each loss is checked against a naive float64 loop reference written here (loops over pairs,
triplets and anchors from PML 2.9.0's semantics; distances and reducers from ``reference.py``),
against PML 2.9.0 (values and full gradients, float64 and float32), with gradcheck,
``torch.compile(fullgraph=True)``, the meta device, edge cases and bad input.

Deliberate deviations from PML (tested against the loop reference):
  (a) ``lifted_structure`` with a separate reference set: the positive's negatives are its
      column's negative pairs (PML compares a reference index with query indices);
  (b) ``tuplet_margin`` at ``|cos| >= 1`` (duplicates): finite value and zero gradient (PML NaN);
  (c) PML returns 0 when every pair list has length <= 1; pmlfunc computes the loss;
  (d) PML's ``MarginLoss`` stores beta in float32: float64 parity uses a float32-exact beta.
"""

from __future__ import annotations

import math

import pytest
import reference as R
import torch
from pytorch_metric_learning import distances as pml_d
from pytorch_metric_learning import losses as pml_l
from pytorch_metric_learning import miners as pml_m
from pytorch_metric_learning import reducers as pml_r
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

import pmlfunc as pf
import pmlfunc.distances as pfd
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    circle,
    generalized_lifted_structure,
    intra_pair_variance,
    lifted_structure,
    margin,
    margin_init,
    signal_to_noise_ratio_contrastive,
    tuplet_margin,
)

F64, F32 = torch.float64, torch.float32
UNEVEN = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]
REF_LABELS = [0, 1, 1, 5, 3, 3, 0, 2]
LAYOUTS = {
    "uneven": UNEVEN,
    "two_classes": [0, 1, 0, 1, 1, 0, 0, 1],
    "pairs_and_singletons": [5, 5, 1, 7, 7, 3],
}
REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL = {F64: {"rtol": 1e-9, "atol": 1e-12}, F32: {"rtol": 2e-4, "atol": 2e-6}}


# ----------------------------------------------------------------------------------------------
# naive float64 references (loops; nothing from pmlfunc)
# ----------------------------------------------------------------------------------------------
def _zero(emb):
    return (emb * 0).sum()


def _lse(xs):
    """log Σ e^x over a list of 0-d tensors; PML's logsumexp of an empty set is 0."""
    if not xs:
        return None
    top = max(float(x.detach()) for x in xs)
    return top + torch.log(sum(torch.exp(x - top) for x in xs))


def _setup(emb, labels, ref_emb, ref_labels, distance, indices_tuple):
    self_mode = ref_emb is None
    ref = emb if self_mode else ref_emb
    rl = labels if self_mode else ref_labels
    mat = R.distance_matrix(emb, ref, distance)
    pos, neg = R.pairs(labels, rl, self_mode, indices_tuple)
    return self_mode, mat, pos, neg


def _reduce_pairs(losses, pairs, kind, reducer, emb, labels):
    return R.reduce(
        losses, [a for a, _ in pairs], [o for _, o in pairs], kind, reducer, emb, labels, len(emb)
    )


def ref_lifted_structure(
    emb,
    labels=None,
    *,
    neg_margin=1.0,
    pos_margin=0.0,
    distance=("lp", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    self_mode, mat, pos, neg = _setup(emb, labels, ref_emb, ref_labels, distance, indices_tuple)
    if not neg:
        return _zero(emb)
    losses = []
    for a, p in pos:
        if self_mode:  # negative pairs whose anchor is a or p (PML)
            chosen = [(i, n) for i, n in neg if i == a or i == p]
        else:  # deviation (a): the anchor's row and the positive's column
            chosen = [(i, n) for i, n in neg if i == a] + [(i, n) for i, n in neg if n == p]
        lse = _lse([R.pml_margin(neg_margin, mat[i][n], distance) for i, n in chosen])
        x = (0.0 if lse is None else lse) + R.pml_margin(mat[a][p], pos_margin, distance)
        losses.append(torch.relu(x) ** 2 / 2)
    return _reduce_pairs(losses, pos, "pos_pair", reducer, emb, labels)


def ref_generalized_lifted_structure(
    emb,
    labels=None,
    *,
    neg_margin=1.0,
    pos_margin=0.0,
    distance=("lp", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    _, mat, pos, neg = _setup(emb, labels, ref_emb, ref_labels, distance, indices_tuple)
    pos, neg = set(pos), set(neg)  # matrix-based: a listed pair counts once
    losses = []
    for a in range(len(emb)):
        lp = _lse([R.pml_margin(mat[i][j], pos_margin, distance) for i, j in pos if i == a])
        ln = _lse([R.pml_margin(neg_margin, mat[i][j], distance) for i, j in neg if i == a])
        losses.append(
            torch.relu(_zero(emb) + (0.0 if lp is None else lp) + (0.0 if ln is None else ln))
        )
    return R.reduce(losses, list(range(len(emb))), None, "element", reducer, emb, labels, len(emb))


def ref_circle(
    emb,
    labels=None,
    *,
    m=0.4,
    gamma=80.0,
    distance=("cosine", {}),
    reducer=("avg_nonzero", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    _, mat, pos, neg = _setup(emb, labels, ref_emb, ref_labels, distance, indices_tuple)
    pos, neg = set(pos), set(neg)
    losses = []
    for a in range(len(emb)):
        sp = [mat[i][j] for i, j in sorted(pos) if i == a]
        sn = [mat[i][j] for i, j in sorted(neg) if i == a]
        if not sp or not sn:
            losses.append(_zero(emb))
            continue
        lp = _lse([-gamma * torch.relu(1 + m - s.detach()) * (s - (1 - m)) for s in sp])
        ln = _lse([gamma * torch.relu(s.detach() + m) * (s - m) for s in sn])
        losses.append(torch.nn.functional.softplus(lp + ln))
    return R.reduce(losses, list(range(len(emb))), None, "element", reducer, emb, labels, len(emb))


def ref_intra_pair_variance(
    emb,
    labels=None,
    *,
    pos_eps=0.01,
    neg_eps=0.01,
    distance=("cosine", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    _, mat, pos, neg = _setup(emb, labels, ref_emb, ref_labels, distance, indices_tuple)
    sim = R.is_similarity(distance)
    out = _zero(emb)
    for pairs, eps, kind, up in (
        (pos, pos_eps, "pos_pair", sim),
        (neg, neg_eps, "neg_pair", not sim),
    ):
        if not pairs:
            continue
        vals = [mat[a][j] for a, j in pairs]
        mu = sum(vals) / len(vals)
        var = [((1 - eps) * mu - v) if up else (v - (1 + eps) * mu) for v in vals]
        out = out + _reduce_pairs(
            [torch.relu(x) ** 2 for x in var], pairs, kind, reducer, emb, labels
        )
    return out


def ref_tuplet_margin(
    emb,
    labels=None,
    *,
    margin=5.73,
    scale=64.0,
    distance=("cosine", {}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    _, mat, pos, neg = _setup(emb, labels, ref_emb, ref_labels, distance, indices_tuple)
    beta = math.radians(margin)
    losses = []
    for a, p in pos:
        shifted = torch.cos(torch.acos(mat[a][p].clamp(-1, 1)) - beta)
        xs = [scale * (mat[i][n] - shifted) for i, n in neg if i == a]
        lse = _lse([*xs, _zero(emb)])  # log(1 + Σ)
        losses.append(lse)
    return _reduce_pairs(losses, pos, "pos_pair", reducer, emb, labels)


def ref_snr_contrastive(emb, labels=None, *, distance=("snr", {}), **kw):
    return R.contrastive(emb, labels, distance=distance, **kw)


def ref_margin(
    emb,
    labels=None,
    params=None,
    *,
    margin=0.2,
    nu=0.0,
    beta=1.2,
    distance=("lp", {}),
    reducer=("divisor", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    self_mode = ref_emb is None
    ref = emb if self_mode else ref_emb
    rl = labels if self_mode else ref_labels
    mat = R.distance_matrix(emb, ref, distance)
    trips = R.triplets(labels, rl, self_mode, indices_tuple)
    if not trips:
        return _zero(emb)
    b_vec = None if params is None else params["beta"]

    def beta_of(a):
        if b_vec is None:
            return beta
        return b_vec[0] if len(b_vec) == 1 else b_vec[int(labels[a])]

    pos_l = [
        torch.relu(R.pml_margin(mat[a][p], beta_of(a), distance) + margin) for a, p, _ in trips
    ]
    neg_l = [
        torch.relu(R.pml_margin(beta_of(a), mat[a][n], distance) + margin) for a, _, n in trips
    ]
    losses = [x + y for x, y in zip(pos_l, neg_l, strict=True)]
    anchors = [a for a, _, _ in trips]
    reg = [beta_of(a) * nu for a in anchors] if b_vec is not None and len(b_vec) > 1 else None
    if reducer[0] == "divisor":
        div = sum(float(x.detach()) > 0 for x in pos_l) + sum(float(x.detach()) > 0 for x in neg_l)
        out = sum(losses) / div if div else _zero(emb)
        if reg is not None:
            out = out + (sum(reg) / div if div else 0.0)
    else:
        out = R.reduce(losses, anchors, None, "triplet", reducer, emb, labels, len(emb))
        if reg is not None:
            out = out + R.reduce(reg, anchors, None, "element", reducer, emb, labels, len(emb))
    if b_vec is not None and len(b_vec) == 1:
        out = out + b_vec[0] * nu
    return out


# ----------------------------------------------------------------------------------------------
# the table of losses
# ----------------------------------------------------------------------------------------------
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
    "lifted_structure": ref_lifted_structure,
    "generalized_lifted_structure": ref_generalized_lifted_structure,
    "circle": ref_circle,
    "intra_pair_variance": ref_intra_pair_variance,
    "tuplet_margin": ref_tuplet_margin,
    "snr_contrastive": ref_snr_contrastive,
    "margin": ref_margin,
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


def lab(values):
    return torch.tensor(values, dtype=torch.int64)


def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def value_and_grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    assert out.ndim == 0, f"loss must be 0-d, got {tuple(out.shape)}"
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    return out.detach(), [
        torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)
    ]


def assert_same(got, want, **tol):
    (gv, gg), (wv, wg) = got, want
    torch.testing.assert_close(gv, wv, **tol, msg=lambda m: f"value: {m}")
    for k, (a, b) in enumerate(zip(gg, wg, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, k=k: f"grad of input {k}: {m}")


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


# ----------------------------------------------------------------------------------------------
# 1. naive float64 reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name, layout, gen):
    labels = lab(LAYOUTS[layout])
    emb = randn(gen, len(labels), 5)
    for dist in ALLOWED[name][:2]:
        got = run("pf", name, emb, labels, **dist_kw(name, dist, "pf"), **HP[name])
        want = run("ref", name, emb, labels, **dist_kw(name, dist, "ref"), **HP[name])
        assert_same(got, want, **REF_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_with_ref_set(name, gen):
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 5), randn(gen, len(ref_labels), 5)
    kw = {"ref": ref, "ref_labels": ref_labels, **HP[name]}
    assert_same(run("pf", name, emb, labels, **kw), run("ref", name, emb, labels, **kw), **REF_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_defaults_match_reference(name, gen):
    """Called with (embeddings, labels) only: PML's defaults (reference defaults are PML's)."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 5)
    kw = {"beta": 1.2} if name == "margin" else {}
    assert_same(run("pf", name, emb, labels), run("ref", name, emb, labels, **kw), **REF_TOL)


def _subset(labels, gen, ref_labels=None):
    a1, p, a2, n = lmu.get_all_pairs_indices(labels, ref_labels)
    keep_p = torch.randperm(len(a1), generator=gen)[: max(2, len(a1) // 2)]
    keep_n = torch.randperm(len(a2), generator=gen)[: max(2, len(a2) // 3)]
    return a1[keep_p], p[keep_p], a2[keep_n], n[keep_n]


@pytest.mark.parametrize("kind", ["pairs", "triplets"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_with_indices_tuple(name, kind, gen):
    """Repeated pairs (triplets list (a, p) once per negative) must count as in PML."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 5)
    if kind == "pairs":
        it = _subset(labels, gen)
    else:
        a, p, n = lmu.get_all_triplets_indices(labels)
        keep = torch.randperm(len(a), generator=gen)[:40]
        it = (a[keep], p[keep], n[keep])
    kw = {"indices_tuple": it, **HP[name]}
    assert_same(run("pf", name, emb, labels, **kw), run("ref", name, emb, labels, **kw), **REF_TOL)


# ----------------------------------------------------------------------------------------------
# 2. PML 2.9.0 parity
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("mode", ["uneven", "singletons", "ref"])
@pytest.mark.parametrize("name", NAMES)
def test_pml_parity(name, mode, dtype, gen):
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


def test_lifted_structure_ref_set_deviation(gen):
    """Deviation (a): self mode equals PML; with a reference set pmlfunc follows the reference
    (column negatives) and PML's index mix gives a different number."""
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 6), randn(gen, len(ref_labels), 6)
    kw = {"ref": ref, "ref_labels": ref_labels, **HP["lifted_structure"]}
    got = run("pf", "lifted_structure", emb, labels, **kw)
    assert_same(got, run("ref", "lifted_structure", emb, labels, **kw), **REF_TOL)
    pml = run_pml("lifted_structure", emb, labels, **kw)
    assert not torch.allclose(got[0], pml[0])
    # the same rows as a separate set with ref_labels = labels: column p of a symmetric mask is
    # row p, so pmlfunc equals PML's self mode on the pairs other than the diagonal
    it = lmu.get_all_pairs_indices(labels)  # no (i, i) pairs
    sep = lifted_structure(emb, labels, ref_emb=emb, ref_labels=labels, indices_tuple=it)
    torch.testing.assert_close(sep, pml_l.LiftedStructureLoss()(emb, labels), **REF_TOL)


def _pml_tuple(kind, emb, labels, ref=None, ref_labels=None):
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


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", TUPLE_KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_pml_parity_indices_tuple(name, kind, dtype, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8, dtype=dtype)
    it = _pml_tuple(kind, emb, labels)
    pml_it = it.to_indices() if kind.startswith("pf") else it
    assert all(len(x) > 1 for x in pml_it), "keep clear of deviation (c)"
    got = run("pf", name, emb, labels, indices_tuple=it, **HP[name])
    want = run_pml(name, emb, labels, indices_tuple=pml_it, **HP[name])
    assert_same(got, want, **TOL[dtype])


@pytest.mark.parametrize("kind", ["pml_pairs", "pml_triplets", "pf_pairs", "pf_window"])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "lifted_structure"])
def test_pml_parity_indices_tuple_with_ref_set(name, kind, gen):
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 8), randn(gen, len(ref_labels), 8)
    it = _pml_tuple(kind, emb, labels, ref, ref_labels)
    pml_it = it.to_indices() if kind.startswith("pf") else it
    kw = {"ref": ref, "ref_labels": ref_labels, **HP[name]}
    got = run("pf", name, emb, labels, indices_tuple=it, **kw)
    want = run_pml(name, emb, labels, indices_tuple=pml_it, **kw)
    assert_same(got, want, **TOL[F64])


def _reducers():
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


# PML's matrix/log-sum-exp losses return (N, 1)-shaped losses: ClassWeightedReducer broadcasts
# them against (N,) weights and PerAnchorReducer fails; those cases use the loop reference.
PML_COLUMN_LOSSES = {"lifted_structure", "generalized_lifted_structure", "circle", "tuplet_margin"}


@pytest.mark.parametrize("red", list(_reducers()))
@pytest.mark.parametrize("name", NAMES)
def test_pml_parity_reducers(name, red, gen):
    if red == "divisor" and name != "margin":
        pytest.skip("only margin supplies a divisor")
    if red == "per_anchor" and name == "margin":
        pytest.skip("PML's PerAnchorReducer does not reduce triplets")
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8)
    pf_red, pml_red = _reducers()[red]
    for it in (None, _pml_tuple("pml_triplets", emb, labels)):
        got = run("pf", name, emb, labels, reducer=pf_red, indices_tuple=it, **HP[name])
        if red in ("class_weighted", "per_anchor") and name in PML_COLUMN_LOSSES:
            ref_red = (red, {"weights": pf_red.weights} if red == "class_weighted" else {})
            want = run("ref", name, emb, labels, reducer=ref_red, indices_tuple=it, **HP[name])
            assert_same(got, want, **REF_TOL)
            continue
        want = run_pml(name, emb, labels, reducer=pml_red, indices_tuple=it, **HP[name])
        if red == "per_anchor" and it is not None:
            # PML's value counts a repeated pair once (one B x B cell), but index_put's backward
            # sends the cell's gradient to every copy: pmlfunc matches the value, and its
            # gradient is the derivative of that value (gradcheck).
            torch.testing.assert_close(got[0], want[0], **TOL[F64])
            assert torch.autograd.gradcheck(
                lambda e, it=it: PF[name](e, labels, reducer=pf_red, indices_tuple=it, **HP[name]),
                (emb.clone().requires_grad_(True),),
            )
            continue
        assert_same(got, want, **TOL[F64])


@pytest.mark.parametrize("nu", [0.0, 0.1])
@pytest.mark.parametrize("num_classes", [None, 5])
def test_margin_learnable_beta_matches_pml(num_classes, nu, gen):
    """params from margin_init = PML's learn_beta=True (and num_classes): value, gradients of
    the embeddings and of beta."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8)
    params = margin_init(1.25, num_classes, dtype=F64)
    params["beta"] = params["beta"] + 0.05 * torch.arange(params["beta"].shape[0], dtype=F64)
    for red in ("divisor", "mean"):
        pf_red, pml_red = _reducers()[red]
        got = value_and_grads(
            lambda e, b, r=pf_red: margin(e, labels, {"beta": b}, nu=nu, margin=0.25, reducer=r),
            emb,
            params["beta"],
        )
        pml = pml_l.MarginLoss(
            margin=0.25, nu=nu, learn_beta=True, num_classes=num_classes, reducer=pml_red
        ).double()
        pml.beta.data = params["beta"].clone()
        e = emb.clone().requires_grad_(True)
        out = pml(e, labels).reshape(())
        want = (out.detach(), list(torch.autograd.grad(out, [e, pml.beta])))
        assert_same(got, want, **TOL[F64])
        ref = value_and_grads(
            lambda e, b, r=red: ref_margin(
                e, labels, {"beta": b}, nu=nu, margin=0.25, reducer=(r, {})
            ),
            emb,
            params["beta"],
        )
        assert_same(got, ref, **REF_TOL)
        assert got[1][1].abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# 3. gradcheck
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "circle"])
def test_gradcheck(name, with_ref, gen):
    labels = lab([0, 0, 1, 1, 1, 2, 3, 3])
    emb = randn(gen, 8, 5).requires_grad_(True)
    fn = PF[name]
    if with_ref:
        ref = randn(gen, 6, 5).requires_grad_(True)
        rl = lab([0, 1, 1, 4, 3, 2])
        assert torch.autograd.gradcheck(
            lambda e, r: fn(e, labels, ref_emb=r, ref_labels=rl, **HP[name]), (emb, ref)
        )
    else:
        assert torch.autograd.gradcheck(lambda e: fn(e, labels, **HP[name]), (emb,))


def test_gradcheck_margin_params(gen):
    labels = lab([0, 0, 1, 1, 1, 2, 3, 3])
    emb = randn(gen, 8, 5).requires_grad_(True)
    beta = (torch.tensor([1.0, 1.1, 1.2, 0.9], dtype=F64)).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda e, b: margin(e, labels, {"beta": b}, nu=0.1, reducer=pfr.mean()), (emb, beta)
    )


def test_circle_gradient_holds_weights_constant(gen):
    """Circle detaches α_p, α_n (PML, paper code), so plain gradcheck does not apply: the
    gradient must equal the gradient of the loss with those weights frozen, which gradcheck
    verifies on a loop version with the weights passed as constants."""
    labels = lab([0, 0, 1, 1, 1, 2, 3, 3])
    emb = randn(gen, 8, 5)
    hp = HP["circle"]
    m, gamma = hp["m"], hp["gamma"]
    s0 = torch.nn.functional.normalize(emb, dim=1) @ torch.nn.functional.normalize(emb, dim=1).t()
    pos = (labels[:, None] == labels[None, :]) & ~torch.eye(8, dtype=torch.bool)
    neg = labels[:, None] != labels[None, :]

    def frozen(e):
        s = torch.nn.functional.normalize(e, dim=1) @ torch.nn.functional.normalize(e, dim=1).t()
        vals = []
        for a in range(8):
            if not pos[a].any():
                vals.append(s[a, a] * 0)
                continue
            lp = torch.logsumexp(
                torch.stack(
                    [
                        -gamma * torch.relu(1 + m - s0[a, j]) * (s[a, j] - 1 + m)
                        for j in range(8)
                        if pos[a, j]
                    ]
                ),
                0,
            )
            ln = torch.logsumexp(
                torch.stack(
                    [
                        gamma * torch.relu(s0[a, j] + m) * (s[a, j] - m)
                        for j in range(8)
                        if neg[a, j]
                    ]
                ),
                0,
            )
            vals.append(torch.nn.functional.softplus(lp + ln))
        vals = torch.stack(vals)
        return vals.sum() / (vals > 0).sum()

    leaf = emb.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(frozen, (leaf,))
    got = value_and_grads(lambda e: circle(e, labels, **hp), emb)
    want = value_and_grads(frozen, emb)
    assert_same(got, want, **REF_TOL)


# ----------------------------------------------------------------------------------------------
# 4. torch.compile, torch.func, chunked
# ----------------------------------------------------------------------------------------------
# Inductor for the losses with their own graph shapes; the rest through dynamo's full-graph
# capture and AOT autograd only (the inductor codegen of their ops is shared and costs ~8 s each).
COMPILE_BACKEND = {
    "lifted_structure": "inductor",
    "tuplet_margin": "inductor",
    "margin": "inductor",
    "generalized_lifted_structure": "aot_eager",
    "circle": "aot_eager",
    "intra_pair_variance": "aot_eager",
    "snr_contrastive": "aot_eager",
}


@pytest.mark.compile
@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_equals_eager(name, gen):
    torch._dynamo.reset()
    backend = COMPILE_BACKEND[name]
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref = randn(gen, len(labels), 6, dtype=F32), randn(gen, len(ref_labels), 6, dtype=F32)

    def f(e, r):
        return PF[name](e, labels, ref_emb=r, ref_labels=ref_labels, **HP[name])

    got = value_and_grads(torch.compile(f, fullgraph=True, backend=backend), emb, ref)
    assert_same(got, value_and_grads(f, emb, ref), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", NAMES)
def test_func_grad_and_tensor_hyperparameters(name, gen):
    """torch.func.grad equals autograd; 0-d tensor hyper-parameters equal numbers and get
    gradients."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    hp = HP[name]
    g_func = torch.func.grad(lambda e: PF[name](e, labels, **hp))(emb)
    value, (g_auto,) = value_and_grads(lambda e: PF[name](e, labels, **hp), emb)
    torch.testing.assert_close(g_func, g_auto, rtol=1e-12, atol=1e-14)
    keys = list(hp)
    vals = [torch.tensor(float(hp[k]), dtype=F64, requires_grad=True) for k in keys]
    out = PF[name](emb, labels, **dict(zip(keys, vals, strict=True)))
    torch.testing.assert_close(out, value, rtol=1e-12, atol=1e-14)
    grads = torch.autograd.grad(out, vals, allow_unused=True)
    assert any(g is not None and g.abs() > 0 for g in grads)


@pytest.mark.parametrize("name", ["generalized_lifted_structure", "circle", "tuplet_margin"])
def test_chunked_value_and_grad(name, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    loss, g = pf.chunked.value_and_grad(PF[name], chunk_size=3)(emb, labels, **HP[name])
    want = value_and_grads(lambda e: PF[name](e, labels, **HP[name]), emb)
    assert_same((loss, [g]), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", [None, "pml_triplets", "pf_window"])
def test_chunked_margin(kind, gen):
    """margin splits over anchors with a chunkable reducer (not the default divisor())."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 6)
    it = None if kind is None else _pml_tuple(kind, emb, labels)
    kw = {"reducer": pfr.mean(), "indices_tuple": it, **HP["margin"]}
    loss, g = pf.chunked.value_and_grad(margin, chunk_size=4)(emb, labels, **kw)
    want = value_and_grads(lambda e: margin(e, labels, **kw), emb)
    assert_same((loss, [g]), want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="divisor"):
        pf.chunked.value_and_grad(margin, chunk_size=4)(emb, labels)
    with pytest.raises(ValueError, match="beta"):
        pf.chunked.value_and_grad(margin, chunk_size=4)(
            emb, labels, margin_init(), reducer=pfr.mean()
        )


def test_lifted_structure_self_pair_counts_row_once(gen):
    """A listed positive pair (a, a) sees row a's negatives once (PML's ``a2 == a | a2 == p``).
    Cosine similarity: the Lp gradient at d_aa = 0 is NaN in PML and the loop reference."""
    labels = lab([0, 0, 1, 1, 2])
    emb = randn(gen, 5, 4)
    it = (lab([0, 0, 2, 3]), lab([0, 1, 2, 2]), lab([0, 0, 1, 2, 3, 4]), lab([2, 4, 3, 0, 4, 1]))
    kw = {"indices_tuple": it, "neg_margin": 0.0, "pos_margin": 1.0}  # every hinge active
    got = run("pf", "lifted_structure", emb, labels, distance=pfd.cosine(), **kw)
    want = run("ref", "lifted_structure", emb, labels, distance=("cosine", {}), **kw)
    assert_same(got, want, **REF_TOL)
    want = run_pml("lifted_structure", emb, labels, distance=pml_d.CosineSimilarity(), **kw)
    assert_same(got, want, **TOL[F64])


@pytest.mark.parametrize("name", ["lifted_structure", "intra_pair_variance"])
def test_not_chunkable_raises(name, gen):
    emb, labels = randn(gen, 6, 4), lab([0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="cannot be chunked"):
        pf.chunked.value_and_grad(PF[name], chunk_size=2)(emb, labels)


@pytest.mark.parametrize("with_ref", [False, True], ids=["self", "ref"])
@pytest.mark.parametrize("name", NAMES)
def test_meta_device(name, with_ref):
    emb = torch.empty(16, 8, device="meta", requires_grad=True)
    labels = torch.empty(16, dtype=torch.int64, device="meta")
    kw = {}
    if with_ref:
        ref = torch.empty(12, 8, device="meta", requires_grad=True)
        kw = {"ref_emb": ref, "ref_labels": torch.empty(12, dtype=torch.int64, device="meta")}
    out = PF[name](emb, labels, **kw)
    assert out.device.type == "meta" and out.shape == () and out.dtype == emb.dtype
    out.backward()
    assert emb.grad is not None and emb.grad.shape == emb.shape


# ----------------------------------------------------------------------------------------------
# 5. edge cases
# ----------------------------------------------------------------------------------------------
EDGE = {
    "batch_of_one": [3],
    "no_positives": [0, 1, 2, 3, 4],
    "no_negatives": [1, 1, 1, 1, 1],
    "two_rows_same": [0, 0],
    "two_rows_distinct": [0, 1],
}


def finite(fn, *tensors):
    value, grads = value_and_grads(fn, *tensors)
    assert torch.isfinite(value), value
    assert all(torch.isfinite(g).all() for g in grads)
    return value, grads


@pytest.mark.parametrize("layout", list(EDGE))
@pytest.mark.parametrize("name", NAMES)
def test_edge_layouts(name, layout, gen):
    labels = lab(EDGE[layout])
    emb = randn(gen, len(labels), 4)
    got = finite(lambda e: PF[name](e, labels, **HP[name]), emb)
    assert_same(got, run("ref", name, emb, labels, **HP[name]), **REF_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_duplicate_rows_finite(name, gen):
    """Identical rows in one class and across classes: d = 0, cos = 1 (deviation (b))."""
    base = randn(gen, 4, 6)
    emb = torch.cat([base, base[:2], base[1:3]])
    labels = lab([0, 1, 2, 3, 0, 1, 5, 2])
    value, _ = finite(lambda e: PF[name](e, labels, **HP[name]), emb)
    want = REF[name](emb, labels, **HP[name])
    torch.testing.assert_close(value, want, rtol=1e-7, atol=1e-9)


def test_tuplet_margin_cosine_of_one_is_not_nan():
    """Deviation (b): PML gives NaN gradients for parallel rows; pmlfunc a finite value
    equal to PML's and a finite gradient."""
    emb = torch.tensor([[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.2, 1.0, 0.5]], dtype=F32)
    labels = lab([0, 0, 1])
    value, _ = finite(lambda e: tuplet_margin(e, labels), emb)
    pml_value, (pml_grad,) = value_and_grads(lambda e: pml_l.TupletMarginLoss()(e, labels), emb)
    assert torch.isfinite(pml_value) and not torch.isfinite(pml_grad).all()
    torch.testing.assert_close(value, pml_value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision(name, dtype, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 16, dtype=dtype)
    value, (g,) = finite(lambda e: PF[name](e, labels, **HP[name]), emb)
    assert value.dtype == dtype and g.dtype == dtype
    want = PF[name](emb.to(F64), labels, **HP[name])
    torch.testing.assert_close(value.to(F64), want, rtol=5e-2, atol=1e-2)


def test_margin_window_reducers_with_triplet_window(gen):
    """A TripletWindow supports the window-free reducers; value windows raise clearly."""
    labels = lab(UNEVEN)
    emb = randn(gen, len(labels), 8)
    window = pf.miners.triplet_margin(emb, labels, margin=0.4)
    for red in ("mean", "sum", "class_weighted"):
        pf_red, pml_red = _reducers()[red]
        got = run("pf", "margin", emb, labels, reducer=pf_red, indices_tuple=window, **HP["margin"])
        want = run_pml(
            "margin",
            emb,
            labels,
            reducer=pml_red,
            indices_tuple=window.to_indices(),
            **HP["margin"],
        )
        assert_same(got, want, **TOL[F64])
    with pytest.raises(ValueError, match="TripletWindow"):
        margin(emb, labels, indices_tuple=window, reducer=pfr.avg_nonzero())


# ----------------------------------------------------------------------------------------------
# 6. bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises_naming_argument(name):
    e, y = torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2])
    fn = PF[name]
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
    key = next(iter(HP[name]))
    with pytest.raises(TypeError, match=key):
        fn(e, y, **{key: "x"})
    with pytest.raises(ValueError, match=key):
        fn(e, y, **{key: torch.ones(2)})


@pytest.mark.parametrize(
    ("name", "wrong"),
    [
        ("circle", pfd.lp()),
        ("circle", pfd.dot()),
        ("tuplet_margin", pfd.lp()),
        ("snr_contrastive", pfd.lp()),
    ],
)
def test_wrong_distance_raises(name, wrong):
    with pytest.raises(ValueError, match="distance"):
        PF[name](torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2]), distance=wrong)


def test_positive_hyperparameters():
    e, y = torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="gamma"):
        circle(e, y, gamma=0.0)
    with pytest.raises(ValueError, match="scale"):
        tuplet_margin(e, y, scale=-1.0)


def test_margin_bad_params_and_options():
    e, y = torch.randn(6, 4), lab([0, 0, 1, 1, 2, 2])
    with pytest.raises(TypeError, match="params"):
        margin(e, y, [1.2])
    with pytest.raises(ValueError, match="beta"):
        margin(e, y, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="beta"):
        margin(e, y, {"beta": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="labels"):
        margin(e, y, margin_init(num_classes=2))  # label 2 out of range
    with pytest.raises(ValueError, match="triplets_per_anchor"):
        margin(e, y, triplets_per_anchor=10)
    with pytest.raises(ValueError, match="num_classes"):
        margin_init(num_classes=0)
    with pytest.raises(ValueError, match="labels"):
        margin(e, None, margin_init(num_classes=3), indices_tuple=lmu.get_all_pairs_indices(y))


# ----------------------------------------------------------------------------------------------
# 7. memory and docs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("lifted_structure", {}),
        ("lifted_structure", {"ref": True}),
        ("tuplet_margin", {}),
        ("margin", {"reducer": pfr.avg_nonzero()}),
        ("margin", {"reducer": pfr.threshold(0.1, 0.5)}),
    ],
)
def test_no_pair_by_pair_or_triplet_buffers(name, kw, gen):
    """Per-row forms: no tensor larger than two (B, M) blocks is ever created (the Lp kernel's
    exact-recompute gather is B × 8 × D = 3072 here; PML's P × N matrix would hold
    144 × 2112 entries, the triplets 6336)."""
    from tracking import LargestTensor

    b, m = 48, 48
    labels = torch.arange(b) // 4
    emb = randn(gen, b, 8).requires_grad_(True)
    call = dict(kw)
    if call.pop("ref", False):
        call.update(ref_emb=randn(gen, m, 8).requires_grad_(True), ref_labels=torch.arange(m) // 4)
    with LargestTensor() as rec:
        loss = PF[name](emb, labels, **call)
        loss.backward()
    assert torch.isfinite(loss)
    assert rec.largest <= 2 * b * m, rec.largest


def test_docstring_examples_run():
    """Every docstring example runs with only ``torch`` and ``pf`` in scope."""
    import doctest

    import pmlfunc.losses.pair_weighting as mod

    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(verbose=False)
    tests = [t for t in finder.find(mod, globs={"torch": torch, "pf": pf}) if t.examples]
    assert len(tests) >= 5
    for t in tests:
        runner.run(t)
    assert runner.failures == 0
