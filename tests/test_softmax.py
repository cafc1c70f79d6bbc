"""Tests for ``pmlfunc.losses.contrastive_ext``: vicreg, decoupled_contrastive, multi_supcon,
selectively_contrastive_triplet.

Each loss is checked against a naive float64 loop reference written here (from the papers, or
PML 2.9.0's semantics for VICReg), values and gradients; against PML 2.9.0 where PML has it
(``VICRegLoss``; ``multi_supcon`` with one-hot labels is SupCon, so ``SupConLoss``); with
``gradcheck``, ``torch.compile(fullgraph=True)``, the meta device, edge cases and bad input.
The three PML-3-only losses have no PML 2.9.0 counterpart: their references are independent
transcriptions of the formulas (and, for DCL, of the paper's two-view equation).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers

import pmlfunc.distances as pfd
import pmlfunc.miners as pfm
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    decoupled_contrastive,
    multi_supcon,
    selectively_contrastive_triplet,
    vicreg,
)

F64, F32 = torch.float64, torch.float32
REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL = {F64: {"rtol": 1e-9, "atol": 1e-12}, F32: {"rtol": 2e-4, "atol": 2e-6}}

UNEVEN = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]  # 2 and 4 are singletons
REF_LABELS = [0, 1, 1, 5, 3, 3, 0, 2]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def lab(values):
    return torch.tensor(values, dtype=torch.int64)


def value_and_grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    assert out.ndim == 0
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    return out.detach(), grads


def assert_same(got, want, **tol):
    (gv, gg), (wv, wg) = got, want
    torch.testing.assert_close(gv, wv.to(gv.dtype), **tol, msg=lambda m: f"value: {m}")
    for k, (a, b) in enumerate(zip(gg, wg, strict=True)):
        torch.testing.assert_close(
            a, b.to(a.dtype), **tol, msg=lambda m, k=k: f"grad of input {k}: {m}"
        )


def _unit(x):
    norm = sum(x[k] * x[k] for k in range(x.shape[0])).sqrt()
    return x / norm


def ref_sim(x, y, distance):
    """Similarity of two rows, by loops: cosine, or minus the normalised Euclidean distance."""
    if distance == "cosine":
        u, v = _unit(x), _unit(y)
        return sum(u[k] * v[k] for k in range(u.shape[0]))
    if distance == "lp":
        u, v = _unit(x), _unit(y)
        return -(sum((u[k] - v[k]) ** 2 for k in range(u.shape[0])).sqrt())
    if distance == "dot":
        return sum(x[k] * y[k] for k in range(x.shape[0]))
    raise ValueError(distance)


def ref_pairs(labels, ref_labels, self_mode, indices_tuple=None):
    """(pos, neg) lists of (anchor, other), duplicates of an index tuple kept."""
    if indices_tuple is not None:
        t = [[int(v) for v in x] for x in indices_tuple]
        if len(t) == 3:
            a, p, n = t
            return list(zip(a, p, strict=True)), list(zip(a, n, strict=True))
        a1, p, a2, n = t
        return list(zip(a1, p, strict=True)), list(zip(a2, n, strict=True))
    pos, neg = [], []
    for i in range(len(labels)):
        for j in range(len(ref_labels)):
            if self_mode and i == j:
                continue
            (pos if int(labels[i]) == int(ref_labels[j]) else neg).append((i, j))
    return pos, neg


def _zero(e):
    return (e * 0).sum()


PF_DIST = {"cosine": pfd.cosine, "lp": pfd.lp, "dot": pfd.dot}


# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------
def ref_vicreg(z1, z2, lam=25.0, mu=25.0, nu=1.0, eps=1e-4, reducer="mean"):
    b, d = z1.shape

    def red(vals):
        if reducer == "sum":
            return sum(vals)
        if reducer == "avg_nonzero":
            kept = [v for v in vals if float(v.detach()) > 0]
            return sum(kept) / len(kept) if kept else _zero(z1)
        return sum(vals) / len(vals)

    inv = [lam * sum((z1[i, k] - z2[i, k]) ** 2 for k in range(d)) / d for i in range(b)]

    def var_terms(z):
        out = []
        for k in range(d):
            m = sum(z[i, k] for i in range(b)) / b
            var = sum((z[i, k] - m) ** 2 for i in range(b)) / (b - 1)
            out.append(mu * torch.relu(1 - (var + eps).sqrt()) / 2)
        return out

    def cov(z):
        means = [sum(z[i, k] for i in range(b)) / b for k in range(d)]
        total = _zero(z)
        for k in range(d):
            for m in range(d):
                if k != m:
                    c = sum((z[i, k] - means[k]) * (z[i, m] - means[m]) for i in range(b)) / (b - 1)
                    total = total + c * c
        return total / d

    return red(inv) + red(var_terms(z1)) + red(var_terms(z2)) + nu * (cov(z1) + cov(z2))


def ref_dcl(
    emb,
    labels,
    ref=None,
    ref_labels=None,
    *,
    temperature=0.1,
    sigma=None,
    distance="cosine",
    indices_tuple=None,
    reducer="mean",
):
    self_mode = ref is None
    other, other_labels = (emb, labels) if self_mode else (ref, ref_labels)
    pos, neg = ref_pairs(labels, other_labels, self_mode, indices_tuple)
    negs = {}
    for a, n in neg:
        negs.setdefault(a, []).append(n)
    kept = [(a, p) for a, p in pos if negs.get(a)]
    sim = {(a, j): ref_sim(emb[a], other[j], distance) for a, j in set(kept) | set(neg)}
    if sigma is not None and kept:
        mean_e = sum(torch.exp(sim[a, p] / sigma) for a, p in kept) / len(kept)
    terms = []
    for a, p in kept:
        w = 1.0 if sigma is None else 2 - torch.exp(sim[a, p] / sigma) / mean_e
        lse = torch.log(sum(torch.exp(sim[a, n] / temperature) for n in negs[a]))
        terms.append(-w * sim[a, p] / temperature + lse)
    if not terms:
        return _zero(emb)
    return sum(terms) if reducer == "sum" else sum(terms) / len(terms)


def ref_dcl_two_views(z1, z2, temperature, sigma):
    """The paper's symmetric two-view loss, transcribed: (1/2N) Σ_k Σ_i L_i^(k)."""
    n = z1.shape[0]
    u1 = [_unit(z1[i]) for i in range(n)]
    u2 = [_unit(z2[i]) for i in range(n)]

    def dot(x, y):
        return sum(x[k] * y[k] for k in range(x.shape[0]))

    if sigma is not None:
        mean_e = sum(torch.exp(dot(u1[j], u2[j]) / sigma) for j in range(n)) / n
    total = _zero(z1)
    for view, other in ((u1, u2), (u2, u1)):
        for i in range(n):
            s_pos = dot(view[i], other[i])
            w = 1.0 if sigma is None else 2 - torch.exp(s_pos / sigma) / mean_e
            neg = sum(
                torch.exp(dot(view[i], vv[j]) / temperature)
                for vv in (view, other)
                for j in range(n)
                if j != i
            )
            total = total + (-w * s_pos / temperature + torch.log(neg))
    return total / (2 * n)


def ref_multi_supcon(
    emb,
    labels,
    ref=None,
    ref_labels=None,
    *,
    temperature=0.1,
    threshold=0.0,
    distance="cosine",
    indices_tuple=None,
    reducer="avg_nonzero",
):
    self_mode = ref is None
    other, other_labels = (emb, labels) if self_mode else (ref, ref_labels)
    b, m = emb.shape[0], other.shape[0]

    def jac(i, j):
        a = {k for k in range(labels.shape[1]) if float(labels[i, k]) > 0}
        c = {k for k in range(labels.shape[1]) if float(other_labels[j, k]) > 0}
        return len(a & c) / len(a | c) if (a | c) else 0.0

    if indices_tuple is not None:
        p_list, n_list = ref_pairs(None, None, self_mode, indices_tuple)
        pos_set, neg_set = set(p_list), set(n_list)
    else:
        pos_set, neg_set = set(), set()
        for i in range(b):
            for j in range(m):
                if self_mode and i == j:
                    continue
                (pos_set if jac(i, j) > threshold else neg_set).add((i, j))
    if not pos_set or not neg_set:
        return _zero(emb)
    losses = []
    for i in range(b):
        ps = [j for j in range(m) if (i, j) in pos_set]
        cand = [j for j in range(m) if (i, j) in pos_set or (i, j) in neg_set]
        if not ps:
            losses.append(_zero(emb))
            continue
        z = {j: ref_sim(emb[i], other[j], distance) / temperature for j in cand}
        lse = torch.log(sum(torch.exp(z[j]) for j in cand))
        losses.append(-sum(jac(i, p) * (z[p] - lse) for p in ps) / len(ps))
    if reducer == "mean":
        return sum(losses) / len(losses)
    kept = [v for v in losses if float(v.detach()) > 0]
    return sum(kept) / len(kept) if kept else _zero(emb)


def ref_sct(
    emb,
    labels,
    ref=None,
    ref_labels=None,
    *,
    temperature=0.1,
    penalty=1.0,
    hard_cutoff=None,
    distance="cosine",
    indices_tuple=None,
    reducer="mean",
):
    self_mode = ref is None
    other, other_labels = (emb, labels) if self_mode else (ref, ref_labels)
    pos, neg = ref_pairs(labels, other_labels, self_mode, indices_tuple)
    terms = []
    for a in range(emb.shape[0]):
        ps = sorted({p for aa, p in pos if aa == a})
        ns = sorted({n for aa, n in neg if aa == a})
        if not ps or not ns:
            continue
        sp = {p: ref_sim(emb[a], other[p], distance) for p in ps}
        sn = {n: ref_sim(emb[a], other[n], distance) for n in ns}
        s_ap = max(sp.values(), key=lambda v: float(v.detach()))  # the easiest positive
        s_an = max(sn.values(), key=lambda v: float(v.detach()))  # the hardest negative
        s_an_v, s_ap_v = float(s_an.detach()), float(s_ap.detach())
        hard = s_an_v > s_ap_v or (hard_cutoff is not None and s_an_v > hard_cutoff)
        if hard:
            terms.append(penalty * s_an)
        else:
            e_p, e_n = torch.exp(s_ap / temperature), torch.exp(s_an / temperature)
            terms.append(-torch.log(e_p / (e_p + e_n)))
    if not terms:
        return _zero(emb)
    return sum(terms) if reducer == "sum" else sum(terms) / len(terms)


def clustered(gen, labels, dim, spread=0.6, dtype=F64):
    """Rows near per-class centres: both easy and hard triplets occur."""
    centres = randn(gen, int(labels.max()) + 1, dim)
    return (centres[labels] + spread * randn(gen, len(labels), dim)).to(dtype)


def one_hot_multi(labels, num_classes=None):
    return F.one_hot(labels, num_classes).to(torch.int64)


def random_multi_hot(gen, rows, classes, p=0.4):
    return (torch.rand(rows, classes, generator=gen) < p).to(torch.int64)


# ----------------------------------------------------------------------------------------------
# VICReg
# ----------------------------------------------------------------------------------------------
VICREG_HP = {"invariance_lambda": 3.0, "variance_mu": 5.0, "covariance_v": 0.7, "eps": 1e-3}


@pytest.mark.parametrize("reducer", ["mean", "sum", "avg_nonzero"])
def test_vicreg_reference(gen, reducer):
    z1, z2 = randn(gen, 6, 4) * 0.3, randn(gen, 6, 4) * 0.3  # variance below 1: hinges active
    pfr_red = {"mean": pfr.mean, "sum": pfr.sum, "avg_nonzero": pfr.avg_nonzero}[reducer]()
    got = value_and_grads(lambda a, b: vicreg(a, b, **VICREG_HP, reducer=pfr_red), z1, z2)
    want = value_and_grads(
        lambda a, b: ref_vicreg(a, b, 3.0, 5.0, 0.7, 1e-3, reducer),
        z1,
        z2,
    )
    assert_same(got, want, **REF_TOL)


PML_REDUCERS = {
    "default": (None, None),
    "sum": (pfr.sum, pml_reducers.SumReducer),
    "avg_nonzero": (pfr.avg_nonzero, pml_reducers.AvgNonZeroReducer),
    "threshold": (
        lambda: pfr.threshold(low=0.05),
        lambda: pml_reducers.ThresholdReducer(low=0.05),
    ),
}


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("reducer", list(PML_REDUCERS))
@pytest.mark.parametrize("defaults", [True, False])
def test_vicreg_pml(gen, dtype, reducer, defaults):
    z1, z2 = randn(gen, 10, 6, dtype=dtype) * 0.5, randn(gen, 10, 6, dtype=dtype) * 0.5
    pf_red, pml_red = PML_REDUCERS[reducer]
    hp = {} if defaults else VICREG_HP
    pml = pml_losses.VICRegLoss(**hp, **({} if pml_red is None else {"reducer": pml_red()}))
    got = value_and_grads(
        lambda a, b: vicreg(a, b, **hp, reducer=None if pf_red is None else pf_red()), z1, z2
    )
    want = value_and_grads(lambda a, b: pml(a, ref_emb=b), z1, z2)
    assert_same(got, want, **TOL[dtype])


def test_vicreg_wide_and_tensor_hyper(gen):
    # D > B (the usual VICReg regime) and hyper-parameters as 0-d tensors.
    z1, z2 = randn(gen, 5, 16), randn(gen, 5, 16)
    hp = {k: torch.tensor(v, dtype=F64) for k, v in VICREG_HP.items()}
    got = value_and_grads(lambda a, b: vicreg(a, b, **hp), z1, z2)
    pml = pml_losses.VICRegLoss(**VICREG_HP)
    want = value_and_grads(lambda a, b: pml(a, ref_emb=b), z1, z2)
    assert_same(got, want, **TOL[F64])


def test_vicreg_none_reducer_and_low_precision(gen):
    z1, z2 = randn(gen, 6, 4), randn(gen, 6, 4)
    terms = vicreg(z1, z2, reducer=pfr.none())
    assert set(terms) == {"invariance_loss", "variance_loss1", "variance_loss2", "covariance_loss"}
    assert terms["invariance_loss"]["losses"].shape == (6,)
    assert terms["variance_loss1"]["losses"].shape == (4,)
    assert terms["covariance_loss"]["losses"].ndim == 0
    total = sum(
        t["losses"].mean() if t["kind"] == "element" else t["losses"] for t in terms.values()
    )
    torch.testing.assert_close(total, vicreg(z1, z2))
    for dt in (torch.float16, torch.bfloat16):
        out = vicreg(z1.to(dt), z2.to(dt))
        assert out.dtype == dt and torch.isfinite(out)
        torch.testing.assert_close(
            out.float(), vicreg(z1.to(dt).float(), z2.to(dt).float()).float(), rtol=1e-2, atol=1e-2
        )


def test_vicreg_edge_cases(gen):
    # identical views, a constant column (zero variance: sqrt(eps) keeps the gradient finite),
    # the smallest batch, one dimension (no covariance pairs).
    z = randn(gen, 4, 3)
    z[:, 1] = 0.5
    for a, b in [(z, z), (z[:2], z[2:]), (z[:, :1], z[:, 1:2])]:
        v, (ga, gb) = value_and_grads(vicreg, a, b)
        assert torch.isfinite(v) and torch.isfinite(ga).all() and torch.isfinite(gb).all()
    v, _ = value_and_grads(vicreg, z[:, :1], z[:, 1:2])
    pml_v = pml_losses.VICRegLoss()(z[:, :1], ref_emb=z[:, 1:2])
    torch.testing.assert_close(v, pml_v)


def test_vicreg_gradcheck(gen):
    z1, z2 = randn(gen, 4, 3).requires_grad_(), randn(gen, 4, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: vicreg(a, b, **VICREG_HP), (z1, z2))


def test_vicreg_bad_input(gen):
    z = randn(gen, 4, 3)
    with pytest.raises(ValueError, match="ref_emb"):
        vicreg(z, None)
    with pytest.raises(ValueError, match="rows"):
        vicreg(z, z[:3])
    with pytest.raises(ValueError, match="embedding size"):
        vicreg(z, randn(gen, 4, 2))
    with pytest.raises(TypeError, match="dtype"):
        vicreg(z, z.float())
    with pytest.raises(ValueError, match="at least 2"):
        vicreg(z[:1], z[:1])
    with pytest.raises(ValueError, match="eps"):
        vicreg(z, z, eps=-1.0)
    with pytest.raises(TypeError, match="invariance_lambda"):
        vicreg(z, z, invariance_lambda="a")
    with pytest.raises(ValueError, match="labels"):
        vicreg(z, z, reducer=pfr.class_weighted(torch.ones(3)))


# ----------------------------------------------------------------------------------------------
# shared checks for the three label-based losses
# ----------------------------------------------------------------------------------------------
LABEL_LOSSES = {
    "decoupled_contrastive": (decoupled_contrastive, ref_dcl, {"temperature": 0.3}),
    "dclw": (decoupled_contrastive, ref_dcl, {"temperature": 0.3, "sigma": 0.5}),
    "selectively_contrastive_triplet": (
        selectively_contrastive_triplet,
        ref_sct,
        {"temperature": 0.2, "penalty": 0.7},
    ),
    "sct_cutoff": (
        selectively_contrastive_triplet,
        ref_sct,
        {"temperature": 0.2, "penalty": 1.3, "hard_cutoff": 0.3},
    ),
}


def _pf_call(fn, hp, distance=None, **kw):
    extra = {} if distance is None else {"distance": PF_DIST[distance]()}
    return lambda *a: fn(*a, **hp, **extra, **kw)


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
@pytest.mark.parametrize("distance", [None, "lp"])
@pytest.mark.parametrize(
    "layout", [UNEVEN, [0, 1, 0, 1, 1, 0, 0, 1], [5, 5, 1, 7, 7, 3]], ids=["uneven", "two", "sing"]
)
def test_label_losses_reference(gen, name, distance, layout):
    fn, ref, hp = LABEL_LOSSES[name]
    labels = lab(layout)
    emb = clustered(gen, labels, 5)
    got = value_and_grads(lambda e: _pf_call(fn, hp, distance)(e, labels), emb)
    want = value_and_grads(lambda e: ref(e, labels, **hp, distance=distance or "cosine"), emb)
    assert_same(got, want, **REF_TOL)


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
def test_label_losses_ref_set(gen, name):
    fn, ref, hp = LABEL_LOSSES[name]
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    emb, ref_emb = randn(gen, len(UNEVEN), 5), randn(gen, len(REF_LABELS), 5)
    got = value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **hp), emb, ref_emb
    )
    want = value_and_grads(lambda e, r: ref(e, labels, r, ref_labels, **hp), emb, ref_emb)
    assert_same(got, want, **REF_TOL)


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
@pytest.mark.parametrize("miner", ["pml_pairs", "pml_triplets", "pf_pairs", "pf_triplets"])
def test_label_losses_mined(gen, name, miner):
    fn, ref, hp = LABEL_LOSSES[name]
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    if miner == "pml_pairs":
        tup = pml_miners.PairMarginMiner(pos_margin=0.3, neg_margin=0.9)(emb, labels)
        given, listed = tup, tup
    elif miner == "pml_triplets":
        tup = pml_miners.TripletMarginMiner(margin=0.4, type_of_triplets="all")(emb, labels)
        given, listed = tup, tup
    elif miner == "pf_pairs":
        given = pfm.pair_margin(emb, labels, pos_margin=0.3, neg_margin=0.9)
        listed = given.to_indices()
    else:
        given = pfm.triplet_margin(
            emb, labels, margin=0.4, tuples_per_anchor=3, generator=torch.Generator().manual_seed(1)
        )
        listed = given.to_indices()
    assert len(listed[0]) > 0
    got = value_and_grads(lambda e: fn(e, labels, indices_tuple=given, **hp), emb)
    want = value_and_grads(lambda e: ref(e, labels, indices_tuple=listed, **hp), emb)
    assert_same(got, want, **REF_TOL)


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
def test_label_losses_float32(gen, name):
    fn, ref, hp = LABEL_LOSSES[name]
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    got = value_and_grads(lambda e: fn(e, labels, **hp), emb.float())
    want = value_and_grads(lambda e: ref(e, labels, **hp), emb)
    assert_same(got, want, **TOL[F32])
    half = fn(emb.to(torch.bfloat16), labels, **hp)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half)


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
def test_label_losses_gradcheck(gen, name):
    fn, _, hp = LABEL_LOSSES[name]
    labels = lab([0, 0, 1, 1, 2])
    emb = randn(gen, 5, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda e: fn(e, labels, **hp), (emb,))


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
def test_label_losses_meta(name):
    fn, _, hp = LABEL_LOSSES[name]
    emb = torch.empty(7, 4, device="meta")
    labels = torch.empty(7, dtype=torch.int64, device="meta")
    out = fn(emb, labels, **hp)
    assert out.device.type == "meta" and out.shape == ()


@pytest.mark.parametrize("name", list(LABEL_LOSSES))
@pytest.mark.parametrize(
    "layout",
    [[3, 3, 3, 3], [0, 1, 2, 3], [0, 0, 0, 1], [1]],
    ids=["one_class", "all_distinct", "lone_neg", "single"],
)
def test_label_losses_edge_cases(gen, name, layout):
    fn, ref, hp = LABEL_LOSSES[name]
    labels = lab(layout)
    emb = randn(gen, len(layout), 3)
    emb_dup = torch.cat([emb, emb[:1]])  # a duplicate row (similarity exactly 1)
    labels_dup = torch.cat([labels, labels[:1]])
    for e, y in [(emb, labels), (emb_dup, labels_dup)]:
        got = value_and_grads(lambda x, y=y: fn(x, y, **hp), e)
        assert torch.isfinite(got[0]) and torch.isfinite(got[1][0]).all()
        want = value_and_grads(lambda x, y=y: ref(x, y, **hp), e)
        assert_same(got, want, rtol=1e-7, atol=1e-9)


def test_chunked_value_and_grad(gen):
    import pmlfunc.chunked as pfc

    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    for fn, hp in [
        (decoupled_contrastive, {"temperature": 0.3}),
        (selectively_contrastive_triplet, {"penalty": 0.5}),
    ]:
        v, g = pfc.value_and_grad(fn, chunk_size=4)(emb, labels, **hp)
        want = value_and_grads(lambda e, fn=fn, hp=hp: fn(e, labels, **hp), emb)
        assert_same((v, [g]), want, **TOL[F64])
    with pytest.raises(ValueError, match="sigma"):
        pfc.value_and_grad(decoupled_contrastive, chunk_size=4)(emb, labels, sigma=0.5)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["dclw", "sct_cutoff"])
def test_label_losses_compile(gen, name):
    fn, _, hp = LABEL_LOSSES[name]
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5, dtype=F32)
    compiled = torch.compile(lambda e, y: fn(e, y, **hp), fullgraph=True)
    torch.testing.assert_close(compiled(emb, labels), fn(emb, labels, **hp), rtol=1e-5, atol=1e-6)


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
    want = value_and_grads(lambda a, b: ref_dcl_two_views(a, b, 0.2, sigma), z1, z2)
    assert_same(got, want, **REF_TOL)


def test_dcl_relations(gen):
    labels = lab(UNEVEN)
    emb = randn(gen, len(UNEVEN), 5)
    # DCL drops the positive from NT-Xent's denominator: DCL ≤ NT-Xent term by term.
    from pmlfunc.losses import ntxent

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
        lambda e: ref_multi_supcon(e, labels, **kw, distance=distance or "cosine", reducer=reducer),
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
        lambda e, r: ref_multi_supcon(e, labels, r, ref_labels, temperature=0.3), emb, ref_emb
    )
    assert_same(got, want, **REF_TOL)
    tup = (lab([0, 0, 2, 3, 0]), lab([1, 1, 4, 5, 1]), lab([1, 2, 4, 6, 0]))  # a repeated triplet
    got = value_and_grads(lambda e: multi_supcon(e, labels, indices_tuple=tup), emb)
    want = value_and_grads(lambda e: ref_multi_supcon(e, labels, indices_tuple=tup), emb)
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


def test_multi_supcon_gradcheck_meta_edges(gen):
    labels = random_multi_hot(gen, 5, 3)
    labels[0] = 0
    emb = randn(gen, 5, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda e: multi_supcon(e, labels, temperature=0.5), (emb,))
    out = multi_supcon(
        torch.empty(6, 4, device="meta"), torch.empty(6, 3, dtype=torch.bool, device="meta")
    )
    assert out.device.type == "meta" and out.shape == ()
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
    assert half.dtype == torch.float16 and torch.isfinite(half)


@pytest.mark.compile
def test_multi_supcon_compile(gen):
    labels = random_multi_hot(gen, 8, 4)
    emb = randn(gen, 8, 5, dtype=F32)
    compiled = torch.compile(lambda e, y: multi_supcon(e, y, threshold=0.2), fullgraph=True)
    torch.testing.assert_close(
        compiled(emb, labels), multi_supcon(emb, labels, threshold=0.2), rtol=1e-5, atol=1e-6
    )


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


# ----------------------------------------------------------------------------------------------
# selectively_contrastive_triplet
# ----------------------------------------------------------------------------------------------
def test_sct_cases_and_authors_form(gen):
    # Both branches occur, and the default reducer is (L_easy + λ L_hard) / (N_easy + N_hard)
    # computed from the authors' formulation (easy positive, hard negative, log-softmax / 0.1).
    labels = lab(UNEVEN)
    emb = clustered(gen, labels, 3)
    e = F.normalize(emb, dim=1)
    s = e @ e.t()
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(UNEVEN), dtype=torch.bool)
    s_pos = s.masked_fill(~same | eye, -2).max(1)
    s_neg = s.masked_fill(same, -2).max(1)
    valid = (s_pos.values > -2) & (s_neg.values > -2)
    pos, neg = s_pos.values, s_neg.values
    hard = (neg > pos) & valid
    easy = (neg <= pos) & valid
    assert hard.any() and easy.any()
    trip = torch.stack([pos, neg], 1)
    easy_loss = -F.log_softmax(trip[easy] / 0.1, dim=1)[:, 0].sum()
    want = (easy_loss + 0.5 * neg[hard].sum()) / (hard.sum() + easy.sum())
    torch.testing.assert_close(selectively_contrastive_triplet(emb, labels, penalty=0.5), want)


def test_sct_bad_input(gen):
    emb, labels = randn(gen, 4, 3), lab([0, 0, 1, 1])
    with pytest.raises(ValueError, match="temperature"):
        selectively_contrastive_triplet(emb, labels, temperature=0.0)
    with pytest.raises(TypeError, match="penalty"):
        selectively_contrastive_triplet(emb, labels, penalty=None)
    with pytest.raises(ValueError, match="hard_cutoff"):
        selectively_contrastive_triplet(emb, labels, hard_cutoff=torch.ones(2))
    with pytest.raises(ValueError, match="labels and indices_tuple"):
        selectively_contrastive_triplet(emb)


# ----------------------------------------------------------------------------------------------
# torch.func
# ----------------------------------------------------------------------------------------------
def test_torch_func_grad_and_vmap(gen):
    emb, labels = randn(gen, 9, 4), lab([0, 0, 1, 1, 2, 2, 3, 3, 3])
    multi = random_multi_hot(gen, 9, 3)
    cases = [
        (lambda x: decoupled_contrastive(x, labels, sigma=0.5)),
        (lambda x: selectively_contrastive_triplet(x, labels, hard_cutoff=0.2)),
        (lambda x: multi_supcon(x, multi)),
        (lambda x: vicreg(x, emb.flip(0))),
    ]
    for fn in cases:
        _, (want,) = value_and_grads(fn, emb)
        torch.testing.assert_close(torch.func.grad(fn)(emb), want)
        batched = torch.func.vmap(fn)(torch.stack([emb, 2 * emb + 1]))
        torch.testing.assert_close(batched, torch.stack([fn(emb), fn(2 * emb + 1)]))
