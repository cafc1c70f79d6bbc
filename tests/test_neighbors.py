"""Tests for the neighbourhood losses of ``pmlfunc.losses.neighbors``.

Every loss is checked against
  * a naive float64 loop reference written here (values and gradients);
  * pytorch-metric-learning 2.9.0 (values and full gradients, float64 and float32) over uneven and
    singleton classes, a reference set, PML-mined pairs/triplets, pmlfunc miner results, a few
    distances and reducers, wherever PML allows them;
  * ``torch.autograd.gradcheck``, ``torch.compile(fullgraph=True)``, the meta device, chunked
    gradients, legal edge cases and bad input.

Deliberate deviations from PML 2.9.0 (tested against the reference, not PML):
  (a) ``nca``: PML returns NaN (mean of nothing) when no anchor has a positive; pmlfunc 0.
      PML returns 0 for any batch of one, also against a reference set; pmlfunc scores it.
  (b) ``threshold_consistent_margin`` with ``ref_emb``: PML indexes the batch with reference
      indices (a bug); pmlfunc uses the reference rows.
  (c) ``manifold``: PML inverts in float32 even for float64 input (float64 parity is to ~1e-8);
      its random meta-classes come from the global RNG, pmlfunc's from ``generator=``
      (parity with PML on given meta-classes; the random path against the reference with the
      same draws); ``lambdaC=inf`` gives the context loss alone (PML: inf·loss).
"""

from __future__ import annotations

import functools
import math

import pytest
import reference as ref_impl
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers

import pmlfunc as pf
import pmlfunc.distances as pfd
import pmlfunc.reducers as pfr
from pmlfunc.losses import (
    angular,
    instance,
    manifold,
    manifold_init,
    manifold_meta_classes,
    nca,
    npairs,
    ranked_list,
    threshold_consistent_margin,
)

F64, F32 = torch.float64, torch.float32
TOL = {F64: {"rtol": 1e-9, "atol": 1e-11}, F32: {"rtol": 2e-4, "atol": 2e-6}}
REF_TOL = {"rtol": 1e-9, "atol": 1e-11}

UNEVEN = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]
SINGLETONS = [5, 5, 1, 7, 7, 3, 9]
REF_LABELS = [0, 1, 1, 5, 3, 3, 0, 2]
D = 5

DISTANCES = {  # name -> (pmlfunc, PML, reference spec)
    "lp": (pfd.lp, pml_distances.LpDistance, ("lp", {})),
    "lp_sq": (
        lambda: pfd.lp(power=2),
        lambda: pml_distances.LpDistance(power=2),
        ("lp", {"power": 2}),
    ),
    "cosine": (pfd.cosine, pml_distances.CosineSimilarity, ("cosine", {})),
    "dot": (
        pfd.dot,
        lambda: pml_distances.DotProductSimilarity(normalize_embeddings=False),
        ("dot", {}),
    ),
}
REDUCERS = {  # name -> (pmlfunc, PML, reference spec)
    "mean": (pfr.mean, pml_reducers.MeanReducer, ("mean", {})),
    "sum": (pfr.sum, pml_reducers.SumReducer, ("sum", {})),
    "avg_nonzero": (pfr.avg_nonzero, pml_reducers.AvgNonZeroReducer, ("avg_nonzero", {})),
}


# ----------------------------------------------------------------------------------------------
# naive float64 references (loops; PML 2.9.0 semantics, our documented fixes)
# ----------------------------------------------------------------------------------------------
def _zero(emb):
    return (emb * 0).sum()


def _sim(v, dist):
    return v if ref_impl.is_similarity(dist) else -v


def _setup(emb, labels, ref_emb, ref_labels, dist):
    self_mode = ref_emb is None
    ref = emb if self_mode else ref_emb
    rl = labels if self_mode else ref_labels
    return self_mode, ref, rl, ref_impl.distance_matrix(emb, ref, dist)


def _tuple_pairs(labels, rl, self_mode, tup):
    return ref_impl.pairs(labels, rl, self_mode, tup)


def ref_nca(
    emb,
    labels,
    *,
    softmax_scale=1.0,
    distance=("lp", {"power": 2}),
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    self_mode, ref, rl, mat = _setup(emb, labels, ref_emb, ref_labels, distance)
    b, m = emb.shape[0], ref.shape[0]
    weights = [1.0] * b
    if indices_tuple is not None and any(len(t) for t in indices_tuple):
        t = [list(map(int, x)) for x in indices_tuple]
        idx = (t[0] if len(t) == 3 else t[0] + t[2]) if not self_mode else [i for x in t for i in x]
        counts = [idx.count(i) for i in range(b)]
        weights = [c / max(counts) for c in counts]
    losses, anchors = [], []
    for i in range(b):
        cols = [j for j in range(m) if not (self_mode and i == j)]
        z = {j: softmax_scale * _sim(mat[i][j], distance) for j in cols}
        mx = max(float(v.detach()) for v in z.values()) if z else 0.0
        den = sum(torch.exp(z[j] - mx) for j in cols)
        num = sum(torch.exp(z[j] - mx) for j in cols if int(labels[i]) == int(rl[j]))
        if not cols or not torch.is_tensor(num) or float(num.detach()) == 0.0:
            continue  # no positive: left out
        losses.append(-torch.log(num / den) * weights[i])
        anchors.append(i)
    return ref_impl.reduce(losses, anchors, None, "element", reducer, emb, labels, b)


def ref_npairs(emb, labels, *, distance=("cosine", {}), reducer=("mean", {}), indices_tuple=None):
    b = emb.shape[0]
    if indices_tuple is None:
        cand = [(i, j) for i in range(b) for j in range(b) if i != j and labels[i] == labels[j]]
    else:
        cand = list(zip(map(int, indices_tuple[0]), map(int, indices_tuple[1]), strict=True))
    chosen, seen = [], set()
    for a, p in cand:
        if int(labels[a]) not in seen:
            seen.add(int(labels[a]))
            chosen.append((a, p))
    losses = []
    for a, p in chosen:
        z = [_sim(ref_impl.pair_distance(emb[a], emb[q], distance), distance) for _, q in chosen]
        own = _sim(ref_impl.pair_distance(emb[a], emb[p], distance), distance)
        losses.append(torch.log(sum(torch.exp(v) for v in z)) - own)
    return ref_impl.reduce(losses, [a for a, _ in chosen], None, "element", reducer, emb, labels, b)


def _unit(x):
    return x / torch.sqrt(sum(x[k] ** 2 for k in range(x.shape[0])))


def ref_angular(
    emb,
    labels,
    *,
    alpha=40.0,
    reducer=("mean", {}),
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    self_mode, ref, rl, _ = _setup(emb, labels, ref_emb, ref_labels, ("lp", {}))
    pos, neg = _tuple_pairs(labels, rl, self_mode, indices_tuple)
    if not pos or not neg:
        return _zero(emb)
    t = math.tan(math.radians(alpha)) ** 2
    losses = []
    for a, p in pos:
        xa, xp = _unit(emb[a]), _unit(ref[p])
        terms = [
            4 * t * ((xa + xp) * ref[n]).sum() - 2 * (1 + t) * (xa * xp).sum()
            for n in range(ref.shape[0])
            if int(labels[a]) != int(rl[n])
        ]
        losses.append(torch.log(1 + sum(torch.exp(f) for f in terms)) if terms else _zero(emb))
    return ref_impl.reduce(
        losses, [a for a, _ in pos], [p for _, p in pos], "pos_pair", reducer, emb, labels, len(emb)
    )


def ref_instance(emb, labels, *, gamma=64.0, reducer=("mean", {})):
    classes = sorted(set(map(int, labels)))
    b = emb.shape[0]
    losses = []
    for i in range(b):
        z = [gamma * ref_impl.pair_distance(emb[i], emb[j], ("cosine", {})) for j in range(b)]
        t = classes.index(int(labels[i]))
        losses.append(torch.log(sum(torch.exp(v) for v in z)) - z[t])
    return ref_impl.reduce(losses, list(range(b)), None, "element", reducer, emb, labels, b)


def ref_ranked_list(
    emb,
    labels,
    *,
    margin,
    Tn,
    imbalance=0.5,
    alpha=None,
    Tp=0.0,
    distance=("lp", {}),
    reducer=("mean", {}),
):
    alpha = 1 + margin / 2 if alpha is None else alpha
    b = emb.shape[0]
    mat = ref_impl.distance_matrix(emb, emb, distance)
    losses = []
    for i in range(b):
        num_p = den_p = num_n = den_n = _zero(emb)
        for j in range(b):
            d = mat[i][j]
            if i == j or float(d) <= 0:
                continue
            if labels[i] == labels[j] and float(d) > alpha - margin:
                w = torch.exp(Tp * (d - (alpha - margin)))
                num_p, den_p = num_p + w * (d - (alpha - margin)), den_p + w
            if labels[i] != labels[j] and float(d) < alpha:
                w = torch.exp(Tn * (alpha - d))
                num_n, den_n = num_n + w * (alpha - d), den_n + w
        lp_ = num_p / (den_p + 1e-5 * b)
        ln_ = num_n / (den_n + 1e-5 * b)
        losses.append((1 - imbalance) * lp_ + imbalance * ln_)
    return ref_impl.reduce(losses, list(range(b)), None, "element", reducer, emb, labels, b)


def ref_tcm(
    emb,
    labels,
    *,
    lambda_plus=1.0,
    lambda_minus=1.0,
    margin_plus=0.9,
    margin_minus=0.5,
    ref_emb=None,
    ref_labels=None,
    indices_tuple=None,
):
    self_mode, _, rl, mat = _setup(emb, labels, ref_emb, ref_labels, ("cosine", {}))
    pos, neg = _tuple_pairs(labels, rl, self_mode, indices_tuple)
    pl = [margin_plus - mat[a][p] for a, p in pos if float(mat[a][p]) <= margin_plus]
    nl = [mat[a][n] - margin_minus for a, n in neg if float(mat[a][n]) >= margin_minus]
    out = _zero(emb)
    if pl:
        out = out + lambda_plus * sum(pl) / len(pl)
    if nl:
        out = out + lambda_minus * sum(nl) / len(nl)
    return out


def ref_manifold(emb, proxies, meta, *, lambdaC=1.0, alpha=0.8, margin=5e-4):
    n, k = emb.shape[0], proxies.shape[0]
    nodes = torch.cat([emb, proxies])
    size = n + k
    rows = []
    for i in range(size):
        row = []
        for j in range(size):
            c = ref_impl.pair_distance(nodes[i], nodes[j], ("cosine", {}))
            row.append(_zero(emb) if i == j else torch.exp(torch.clamp(c, min=0) / 0.5))
        rows.append(torch.stack(row))
    s = torch.stack(rows)
    deg = [sum(s[i][j] for j in range(size)) for i in range(size)]
    s_bar = torch.stack(
        [
            torch.stack([s[i][j] / torch.sqrt(deg[i] * deg[j]) for j in range(size)])
            for i in range(size)
        ]
    )
    f = (1 - alpha) * torch.linalg.inv(torch.eye(size, dtype=emb.dtype) - alpha * s_bar)

    def cos(u, v):
        return (u * v).sum() / (torch.sqrt((u * u).sum()) * torch.sqrt((v * v).sum()))

    def part(x):
        total = _zero(emb)
        for i in range(n):
            c = int(meta[i])
            terms = [x(i, q) - x(i, c) + margin for q in range(k) if q != c]
            total = total + torch.log(
                1 + sum((torch.exp(v) for v in terms if float(v) >= 0), _zero(emb))
            )
        return total / n

    loss_ctx = part(lambda i, q: cos(f[i], f[n + q]))
    if lambdaC == math.inf:
        return loss_ctx
    return part(lambda i, q: f[i][n + q]) + lambdaC * loss_ctx


# ----------------------------------------------------------------------------------------------
# specs and helpers
# ----------------------------------------------------------------------------------------------
SPECS = {
    "nca": {
        "fn": nca,
        "ref": ref_nca,
        "pml": pml_losses.NCALoss,
        "hp": {"softmax_scale": 2.0},
        "ref_set": True,
        "tuples": True,
        "distances": ["lp_sq", "lp", "cosine"],
        "reducers": ["sum", "avg_nonzero"],
    },
    "npairs": {
        "fn": npairs,
        "ref": ref_npairs,
        "pml": pml_losses.NPairsLoss,
        "hp": {},
        "ref_set": False,
        "tuples": True,
        "distances": ["cosine", "dot", "lp"],
        "reducers": ["sum"],
    },
    "angular": {
        "fn": angular,
        "ref": ref_angular,
        "pml": pml_losses.AngularLoss,
        "hp": {"alpha": 35.0},
        "ref_set": True,
        "tuples": True,
        "distances": [],
        "reducers": ["sum", "avg_nonzero"],
    },
    "instance": {
        "fn": instance,
        "ref": ref_instance,
        "pml": pml_losses.InstanceLoss,
        "hp": {"gamma": 8.0},
        "ref_set": False,
        "tuples": False,
        "distances": [],
        "reducers": ["sum"],
    },
    "ranked_list": {
        "fn": ranked_list,
        "ref": ref_ranked_list,
        "pml": pml_losses.RankedListLoss,
        "hp": {"margin": 0.6, "Tn": 3.0, "Tp": 1.5, "imbalance": 0.3},
        "ref_set": False,
        "tuples": False,
        "distances": ["lp_sq", "cosine"],
        "reducers": ["sum"],
    },
    "threshold_consistent_margin": {
        "fn": threshold_consistent_margin,
        "ref": ref_tcm,
        "pml": pml_losses.ThresholdConsistentMarginLoss,
        "hp": {"margin_plus": 0.5, "margin_minus": 0.1, "lambda_plus": 0.7},
        "ref_set": False,  # PML bug (b): reference only
        "tuples": True,
        "distances": [],
        "reducers": [],  # PML ignores its reducer
    },
}
NAMES = list(SPECS)
TUPLE_NAMES = [n for n in NAMES if SPECS[n]["tuples"]]


def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def lab(values):
    return torch.tensor(values, dtype=torch.int64)


def value_and_grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    assert out.ndim == 0, f"loss must be 0-d, got shape {tuple(out.shape)}"
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    return out.detach(), grads


def assert_same(got, want, **tol):
    (gv, gg), (wv, wg) = got, want
    torch.testing.assert_close(gv, wv.to(gv.dtype), **tol, msg=lambda m: f"value: {m}")
    for k, (a, b) in enumerate(zip(gg, wg, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, k=k: f"grad of input {k}: {m}")


def run_pf(name, emb, labels, ref=None, ref_labels=None, **kw):
    fn = SPECS[name]["fn"]
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb)
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb, ref
    )


def run_ref(name, emb, labels, ref=None, ref_labels=None, **kw):
    fn = SPECS[name]["ref"]
    if ref is None:
        return value_and_grads(lambda e: fn(e, labels, **kw), emb.to(F64))
    return value_and_grads(
        lambda e, r: fn(e, labels, ref_emb=r, ref_labels=ref_labels, **kw), emb.to(F64), ref.to(F64)
    )


def run_pml(name, emb, labels, ref=None, ref_labels=None, indices_tuple=None, **kw):
    loss_fn = SPECS[name]["pml"](**kw)
    if ref is None:
        return value_and_grads(lambda e: loss_fn(e, labels, indices_tuple), emb)
    return value_and_grads(
        lambda e, r: loss_fn(e, labels, indices_tuple, ref_emb=r, ref_labels=ref_labels), emb, ref
    )


def _data(gen, layout, dtype=F64, scale=1.0):
    labels = lab(layout)
    return randn(gen, len(labels), D, dtype=dtype) * scale, labels


# ----------------------------------------------------------------------------------------------
# 1. naive reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["uneven", "singletons"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name, layout, gen):
    emb, labels = _data(gen, UNEVEN if layout == "uneven" else SINGLETONS)
    hp = SPECS[name]["hp"]
    assert_same(run_pf(name, emb, labels, **hp), run_ref(name, emb, labels, **hp), **REF_TOL)


@pytest.mark.parametrize(
    "name", [n for n in NAMES if SPECS[n]["ref_set"]] + ["threshold_consistent_margin"]
)
def test_reference_set_matches_reference(name, gen):
    emb, labels = _data(gen, UNEVEN)
    ref, ref_labels = randn(gen, len(REF_LABELS), D), lab(REF_LABELS)
    hp = SPECS[name]["hp"]
    assert_same(
        run_pf(name, emb, labels, ref, ref_labels, **hp),
        run_ref(name, emb, labels, ref, ref_labels, **hp),
        **REF_TOL,
    )


def test_nca_without_any_positive_is_zero_not_nan(gen):
    """Deviation (a): PML gives NaN; pmlfunc and the reference give 0 with zero gradients."""
    emb, labels = _data(gen, [0, 1, 2, 3, 4])
    pml_v, _ = run_pml("nca", emb, labels)
    assert torch.isnan(pml_v)
    got = run_pf("nca", emb, labels)
    assert_same(got, run_ref("nca", emb, labels), **REF_TOL)
    assert got[0] == 0 and torch.count_nonzero(got[1][0]) == 0


def test_nca_drops_underflowing_anchors_like_pml(gen):
    emb, labels = _data(gen, UNEVEN)
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
    emb, labels = _data(gen, UNEVEN, scale=2.0)
    got = run_pf("angular", emb, labels, alpha=alpha)
    assert_same(got, run_ref("angular", emb, labels, alpha=alpha), **REF_TOL)
    assert_same(got, run_pml("angular", emb, labels, alpha=alpha), **TOL[F64])


# ----------------------------------------------------------------------------------------------
# 2. PML parity
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("layout", ["uneven", "singletons"])
@pytest.mark.parametrize("name", NAMES)
def test_pml_parity(name, layout, dtype, gen):
    emb, labels = _data(gen, UNEVEN if layout == "uneven" else SINGLETONS, dtype)
    hp = SPECS[name]["hp"]
    assert_same(run_pf(name, emb, labels, **hp), run_pml(name, emb, labels, **hp), **TOL[dtype])


@pytest.mark.parametrize("name", NAMES)
def test_pml_parity_defaults(name, gen):
    emb, labels = _data(gen, UNEVEN)
    hp = {"margin": 0.4, "Tn": 10.0} if name == "ranked_list" else {}
    assert_same(run_pf(name, emb, labels, **hp), run_pml(name, emb, labels, **hp), **TOL[F64])


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("name", [n for n in NAMES if SPECS[n]["ref_set"]])
def test_pml_parity_reference_set(name, dtype, gen):
    emb, labels = _data(gen, UNEVEN, dtype)
    ref, ref_labels = randn(gen, len(REF_LABELS), D, dtype=dtype), lab(REF_LABELS)
    hp = SPECS[name]["hp"]
    assert_same(
        run_pf(name, emb, labels, ref, ref_labels, **hp),
        run_pml(name, emb, labels, ref, ref_labels, **hp),
        **TOL[dtype],
    )


def _pml_mined(kind, emb, labels):
    if kind == "pairs":
        return pml_miners.PairMarginMiner(pos_margin=0.4, neg_margin=1.0)(emb, labels)
    return pml_miners.TripletMarginMiner(margin=0.3)(emb, labels)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("kind", ["pairs", "triplets"])
@pytest.mark.parametrize("name", TUPLE_NAMES)
def test_pml_parity_pml_tuples(name, kind, dtype, gen):
    emb, labels = _data(gen, UNEVEN, dtype)
    tup = _pml_mined(kind, emb, labels)
    assert len(tup[0]) > 0
    hp = SPECS[name]["hp"]
    got = run_pf(name, emb, labels, indices_tuple=tup, **hp)
    assert_same(got, run_pml(name, emb, labels, indices_tuple=tup, **hp), **TOL[dtype])
    if dtype == F64:
        assert_same(got, run_ref(name, emb, labels, indices_tuple=tup, **hp), **REF_TOL)


def _pf_mined(kind, emb, labels):
    if kind == "pair_margin":
        return pf.miners.pair_margin(emb, labels, pos_margin=0.4, neg_margin=1.0)
    if kind == "batch_hard":
        return pf.miners.batch_hard(emb, labels)
    return pf.miners.triplet_margin(emb, labels, margin=0.3)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("kind", ["pair_margin", "batch_hard", "triplet_window"])
@pytest.mark.parametrize("name", TUPLE_NAMES)
def test_pml_parity_pmlfunc_miner_results(name, kind, dtype, gen):
    # (triplet_window with nca checks the triplet-list sample counts of convert_to_weights)
    emb, labels = _data(gen, UNEVEN, dtype)
    mined = _pf_mined(kind, emb, labels)
    hp = SPECS[name]["hp"]
    got = run_pf(name, emb, labels, indices_tuple=mined, **hp)
    want = run_pml(name, emb, labels, indices_tuple=mined.to_indices(), **hp)
    assert_same(got, want, **TOL[dtype])


@pytest.mark.parametrize(("name", "dist"), [(n, d) for n in NAMES for d in SPECS[n]["distances"]])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_pml_parity_distances(name, dist, dtype, gen):
    emb, labels = _data(gen, UNEVEN, dtype)
    pf_d, pml_d, _ = DISTANCES[dist]
    hp = SPECS[name]["hp"]
    got = run_pf(name, emb, labels, distance=pf_d(), **hp)
    assert_same(got, run_pml(name, emb, labels, distance=pml_d(), **hp), **TOL[dtype])


@pytest.mark.parametrize(("name", "red"), [(n, r) for n in NAMES for r in SPECS[n]["reducers"]])
def test_pml_parity_reducers(name, red, gen):
    emb, labels = _data(gen, UNEVEN)
    pf_r, pml_r, _ = REDUCERS[red]
    hp = SPECS[name]["hp"]
    got = run_pf(name, emb, labels, reducer=pf_r(), **hp)
    assert_same(got, run_pml(name, emb, labels, reducer=pml_r(), **hp), **TOL[F64])


def test_tcm_other_reducer_acts_on_selected_pair_terms(gen):
    emb, labels = _data(gen, UNEVEN)
    hp = SPECS["threshold_consistent_margin"]["hp"]
    total = threshold_consistent_margin(emb, labels, reducer=pfr.sum(), **hp)
    mat = pfd.cosine()(emb)
    same = labels[:, None] == labels[None, :]
    off = ~torch.eye(len(labels), dtype=torch.bool)
    pos = (same & off & (mat <= 0.5)).to(F64)
    neg = (~same & (mat >= 0.1)).to(F64)
    want = 0.7 * (pos * (0.5 - mat)).sum() + (neg * (mat - 0.1)).sum()
    torch.testing.assert_close(total, want, **REF_TOL)


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
        lambda e, p: ref_manifold(e, p, meta, lambdaC=lam), emb, params["proxies"]
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


# ----------------------------------------------------------------------------------------------
# 3. gradcheck, chunked, compile, meta
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_gradcheck(name, gen):
    emb, labels = _data(gen, [0, 0, 1, 1, 1, 2])
    hp = SPECS[name]["hp"]
    fn = SPECS[name]["fn"]
    emb.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: fn(e, labels, **hp), (emb,))


def test_gradcheck_manifold(gen):
    emb = randn(gen, 6, 3).requires_grad_(True)
    prox = randn(gen, 3, 3).requires_grad_(True)
    meta = lab([0, 1, 2, 2, 0, 1])
    assert torch.autograd.gradcheck(
        lambda e, p: manifold(e, None, {"proxies": p}, indices_tuple=meta, margin=0.05), (emb, prox)
    )


@pytest.mark.parametrize("name", NAMES)
def test_chunked_value_and_grad_equals_full(name, gen):
    emb, labels = _data(gen, UNEVEN)
    hp = SPECS[name]["hp"]
    fn = SPECS[name]["fn"]
    if name == "npairs":  # picks one pair per class over the whole batch: not per anchor
        with pytest.raises(ValueError, match="decompose"):
            pf.chunked.value_and_grad(fn, chunk_size=4)(emb, labels)
        return
    if name == "angular":  # chunking pre-normalises; angular needs the raw references
        with pytest.raises(ValueError, match="unnormalised"):
            pf.chunked.value_and_grad(fn, chunk_size=4)(emb, labels)
        return
    loss, grad = pf.chunked.value_and_grad(functools.partial(fn, **hp), chunk_size=4)(emb, labels)
    want = run_pf(name, emb, labels, **hp)
    assert_same((loss, [grad]), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["nca", "threshold_consistent_margin"])
def test_chunked_with_reference_set(name, gen):
    emb, labels = _data(gen, UNEVEN)
    ref, ref_labels = randn(gen, len(REF_LABELS), D), lab(REF_LABELS)
    hp = SPECS[name]["hp"]
    vg = pf.chunked.value_and_grad(
        functools.partial(SPECS[name]["fn"], **hp), chunk_size=3, wrt=("embeddings", "ref_emb")
    )
    loss, grads = vg(emb, labels, ref_emb=ref, ref_labels=ref_labels)
    want = run_pf(name, emb, labels, ref, ref_labels, **hp)
    assert_same((loss, list(grads)), want, rtol=1e-10, atol=1e-12)


@pytest.mark.compile
@pytest.mark.parametrize("name", [*NAMES, "manifold"])
def test_compile_fullgraph_equals_eager(name, gen):
    torch._dynamo.reset()
    emb, labels = _data(gen, UNEVEN, F32)
    if name == "manifold":
        params = manifold_init(D, K, generator=gen)

        meta = manifold_meta_classes(torch.tensor(3), emb.shape[0], K)

        def f(e):  # given meta-classes: compiling the counter-based draws takes minutes here
            return manifold(e, None, params, indices_tuple=meta)
    else:
        hp, fn = SPECS[name]["hp"], SPECS[name]["fn"]
        mined = pf.miners.pair_margin(emb, labels, pos_margin=0.4, neg_margin=1.0)
        tup = mined if SPECS[name]["tuples"] else None

        def f(e):
            return fn(e, labels, indices_tuple=tup, **hp)

    got = value_and_grads(torch.compile(f, fullgraph=True), emb)
    assert_same(got, value_and_grads(f, emb), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [*NAMES, "manifold"])
def test_meta_device(name):
    emb = torch.empty(7, D, device="meta", requires_grad=True)
    labels = torch.zeros(7, dtype=torch.int64, device="meta")
    if name == "manifold":
        params = manifold_init(D, 3, device="meta")
        out = manifold(emb, None, params, generator=torch.tensor(1, device="meta"))
    else:
        out = SPECS[name]["fn"](emb, labels, **SPECS[name]["hp"])
    assert out.shape == () and out.device.type == "meta"
    (g,) = torch.autograd.grad(out, emb)
    assert g.shape == emb.shape


# ----------------------------------------------------------------------------------------------
# 4. edge cases, low precision, bad input
# ----------------------------------------------------------------------------------------------
EDGE = {
    "one_class": [3, 3, 3, 3],
    "all_distinct": [0, 1, 2, 3],
    "one_sample": [4],
    "duplicates": [0, 0, 1, 1],
}


@pytest.mark.parametrize("edge", list(EDGE))
@pytest.mark.parametrize("name", NAMES)
def test_edge_cases_finite_and_match_reference(name, edge, gen):
    emb, labels = _data(gen, EDGE[edge])
    if edge == "duplicates":
        emb = torch.cat([emb[:1], emb[:1], emb[2:3], emb[2:3]])
    hp = SPECS[name]["hp"]
    got = run_pf(name, emb, labels, **hp)
    assert torch.isfinite(got[0]) and torch.isfinite(got[1][0]).all()
    if edge != "duplicates":  # cosine/normalised-Euclidean gradients differ at d = 0
        assert_same(got, run_ref(name, emb, labels, **hp), **REF_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision(name, dtype, gen):
    emb, labels = _data(gen, UNEVEN)
    hp = SPECS[name]["hp"]
    low = SPECS[name]["fn"](emb.to(dtype), labels, **hp)
    full = SPECS[name]["fn"](emb.to(dtype).to(F32), labels, **hp)
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), full, rtol=1e-2, atol=1e-2)


def test_tensor_hyperparameters_match_floats(gen):
    emb, labels = _data(gen, UNEVEN)
    for name in NAMES:
        hp = SPECS[name]["hp"]
        fn = SPECS[name]["fn"]
        as_t = {k: torch.tensor(v, dtype=F64) for k, v in hp.items()}
        torch.testing.assert_close(fn(emb, labels, **as_t), fn(emb, labels, **hp), **REF_TOL)


@pytest.mark.parametrize("name", [*NAMES, "manifold", "manifold_init"])
def test_docstring_example_runs(name):
    import doctest
    import types

    import pmlfunc.losses as module

    fn = getattr(module, name)
    globs = {"torch": torch, "pf": types.SimpleNamespace(losses=module)}
    tests = doctest.DocTestFinder().find(fn, name, globs=globs)
    assert tests and tests[0].examples, f"{name} has no example"
    runner = doctest.DocTestRunner()
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0


def test_bad_input(gen):
    emb, labels = _data(gen, UNEVEN)
    ref, ref_labels = randn(gen, 8, D), lab(REF_LABELS)
    with pytest.raises(ValueError, match="labels"):
        nca(emb, None, indices_tuple=_pml_mined("pairs", emb, labels))
    for fn in (npairs, instance, lambda *a, **k: ranked_list(*a, margin=0.4, Tn=1.0, **k)):
        with pytest.raises(ValueError, match="ref_emb"):
            fn(emb, labels, ref_emb=ref, ref_labels=ref_labels)
    for fn in (instance, lambda *a, **k: ranked_list(*a, margin=0.4, Tn=1.0, **k)):
        with pytest.raises(ValueError, match="indices_tuple"):
            fn(emb, labels, indices_tuple=_pml_mined("pairs", emb, labels))
    with pytest.raises(ValueError, match="distance"):
        angular(emb, labels, distance=pfd.cosine())
    with pytest.raises(ValueError, match="distance"):
        angular(emb, labels, distance=pfd.lp(power=2))
    with pytest.raises(ValueError, match="distance"):
        instance(emb, labels, distance=pfd.lp())
    with pytest.raises(ValueError, match="distance"):
        threshold_consistent_margin(emb, labels, distance=pfd.dot())
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
