"""Tests for ``pmlfunc.miners``: fixed-shape miners at pytorch-metric-learning 2.9.0 parity.

Covered:
  1. the tuples of every deterministic miner equal PML's (as multisets), on float64 data with
     uneven classes, singletons, ``randint`` labels, a separate reference set and five distances;
  2. losses on our mined tuples equal PML's losses on PML's tuples (values and gradients);
  3. ``tuples_per_anchor=k``: a subset of the unbounded selection, ``min(k, count)`` per anchor,
     no duplicates, reproducible, uniform (frequencies over many seeds);
  4. the stochastic miners (``distance_weighted``, ``uniform_histogram``): validity,
     reproducibility and the sampling distribution;
  5. a loss on a mined result equals the loss on its ``.to_indices()`` tuple;
  6. miner → loss pipelines under ``torch.compile(fullgraph=True)``, ``torch.func.grad`` and on
     the meta device (each miner alone: test_conformance.py);
  7. one ``mat=`` shared by a miner and several losses;
  8. input errors;
  9. ``pf.chunked.value_and_grad`` on mined tuples.

Note: PML 2.9.0's ``DotProductSimilarity()`` normalises by default while ``pf.distances.dot()``
does not, so ``dot()`` is compared with ``DotProductSimilarity(normalize_embeddings=False)`` and
``dot(normalize=True)`` with ``DotProductSimilarity()``.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import assert_same, value_and_grads
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from scipy import stats

import pmlfunc as pf
from pmlfunc import miners
from pmlfunc.tuples import MinedPairs, MinedTriplets, TripletMask, TripletWindow

F64, F32 = torch.float64, torch.float32
TOL64 = {"rtol": 1e-10, "atol": 1e-12}
TOL32 = {"rtol": 2e-4, "atol": 2e-6}

# name -> (pmlfunc factory, PML factory)
DISTANCES = {
    "lp": (lambda: pf.distances.lp(), lambda: pml_distances.LpDistance()),
    "lp_raw": (
        lambda: pf.distances.lp(normalize=False),
        lambda: pml_distances.LpDistance(normalize_embeddings=False),
    ),
    "lp_sq": (lambda: pf.distances.lp(power=2), lambda: pml_distances.LpDistance(power=2)),
    "cosine": (lambda: pf.distances.cosine(), lambda: pml_distances.CosineSimilarity()),
    "dot": (
        lambda: pf.distances.dot(),
        lambda: pml_distances.DotProductSimilarity(normalize_embeddings=False),
    ),
    "dot_norm": (
        lambda: pf.distances.dot(normalize=True),
        lambda: pml_distances.DotProductSimilarity(),
    ),
}
LAYOUTS = ["uneven", "randint", "ref"]
UNEVEN = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 5, 5, 5]  # classes 2 and 4 are singletons


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def lab(values):
    return torch.tensor(values, dtype=torch.int64)


def make_data(layout, dtype=F64, seed=0):
    """``(emb, labels, ref_kw)``; ``ref_kw`` holds ``ref_emb``/``ref_labels`` for "ref"."""
    g = torch.Generator().manual_seed(seed)
    if layout == "uneven":
        emb = torch.randn(len(UNEVEN), 5, generator=g, dtype=F64)
        return emb.to(dtype), lab(UNEVEN), {}
    if layout == "randint":
        emb = torch.randn(20, 6, generator=g, dtype=F64)
        return emb.to(dtype), torch.randint(0, 5, (20,), generator=g), {}
    if layout == "ref":
        emb = torch.randn(12, 5, generator=g, dtype=F64)
        labels = torch.randint(0, 4, (12,), generator=g)
        ref = torch.randn(15, 5, generator=g, dtype=F64)
        ref_labels = torch.randint(0, 6, (15,), generator=g)  # classes 4, 5 unseen in the batch
        return emb.to(dtype), labels, {"ref_emb": ref.to(dtype), "ref_labels": ref_labels}
    raise ValueError(layout)


def pml_call(miner, emb, labels, ref_kw):
    if ref_kw:
        return miner(emb, labels, ref_kw["ref_emb"], ref_kw["ref_labels"])
    return miner(emb, labels)


def pml_matrix(pml_distance, emb, ref_kw):
    with torch.no_grad():
        return pml_distance(emb, ref_kw.get("ref_emb"))


def quantiles(mat, *qs):
    """Thresholds at the ``qs`` quantiles of the matrix's entries, each moved to the midpoint
    of the gap between the entries around it: a symmetric matrix holds every value twice, so a
    plain quantile often equals an entry, and which side of it that entry falls on is then
    decided by the last bit of rounding (pmlfunc's expansion against PML's direct difference),
    not by the selection rule under test."""
    flat = mat.reshape(-1).to(F64).sort().values
    scale = flat.abs().max().clamp_min(1.0)
    out = []
    for q in qs:
        tol = 1e-9 * scale
        low = flat[flat <= torch.quantile(flat, q) + tol][-1]  # the entry at the quantile
        high = flat[flat > low + tol][0]  # the next distinct entry
        out.append(float((low + high) / 2))
    return out


def multiset(*tensors):
    """Sorted list of index tuples: equal lists mean equal multisets."""
    return sorted(zip(*(t.tolist() for t in tensors), strict=True))


def assert_same_pairs(ours, theirs):
    a1, p, a2, n = ours.to_indices()
    t1, tp, t2, tn = theirs
    assert multiset(a1, p) == multiset(t1, tp), "positive pairs differ"
    assert multiset(a2, n) == multiset(t2, tn), "negative pairs differ"


def assert_same_triplets(ours, theirs):
    got = ours.to_indices()
    assert len(got) == 3
    assert multiset(*got) == multiset(*theirs), "triplets differ"


def seed(s):
    return torch.Generator().manual_seed(s)


def triplet_keys(indices, m):
    """Sorted int64 keys ``(a·M + p)·M + n``: a fast multiset of many triplets."""
    a, p, n = (t.long() for t in indices)
    return ((a * m + p) * m + n).sort().values


def triplet_counts_per_anchor(indices, batch_size):
    a = indices[0]
    return torch.bincount(a, minlength=batch_size)


# ----------------------------------------------------------------------------------------------
# 1. deterministic miners vs PML 2.9.0
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["low_high", "high_low"])
@pytest.mark.parametrize("dist", ["lp", "lp_raw", "lp_sq", "cosine", "dot", "dot_norm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pair_margin_matches_pml(layout, dist, config):
    emb, labels, ref_kw = make_data(layout)
    ours_d, pml_d = DISTANCES[dist]
    lo, hi = quantiles(pml_matrix(pml_d(), emb, ref_kw), 0.3, 0.7)
    pm, nm = (lo, hi) if config == "low_high" else (hi, lo)
    ours = miners.pair_margin(
        emb, labels, pos_margin=pm, neg_margin=nm, distance=ours_d(), **ref_kw
    )
    miner = pml_miners.PairMarginMiner(pos_margin=pm, neg_margin=nm, distance=pml_d())
    theirs = pml_call(miner, emb, labels, ref_kw)
    assert isinstance(ours, MinedPairs)
    assert len(theirs[0]) > 0 and len(theirs[2]) > 0  # a non-trivial selection
    assert_same_pairs(ours, theirs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pair_margin_defaults_match_pml(layout):
    emb, labels, ref_kw = make_data(layout)
    ours = miners.pair_margin(emb, labels, **ref_kw)
    theirs = pml_call(pml_miners.PairMarginMiner(), emb, labels, ref_kw)
    assert len(theirs[0]) > 0 and len(theirs[2]) > 0
    assert_same_pairs(ours, theirs)


@pytest.mark.parametrize("epsilon", [0.1, 0.3])
@pytest.mark.parametrize("dist", [None, "lp", "lp_raw", "lp_sq", "cosine", "dot"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_similarity_matches_pml(layout, dist, epsilon):
    emb, labels, ref_kw = make_data(layout)
    if dist is None:  # both default to cosine similarity
        ours = miners.multi_similarity(emb, labels, epsilon=epsilon, **ref_kw)
        miner = pml_miners.MultiSimilarityMiner(epsilon=epsilon)
    else:
        ours_d, pml_d = DISTANCES[dist]
        ours = miners.multi_similarity(emb, labels, epsilon=epsilon, distance=ours_d(), **ref_kw)
        miner = pml_miners.MultiSimilarityMiner(epsilon=epsilon, distance=pml_d())
    theirs = pml_call(miner, emb, labels, ref_kw)
    assert len(theirs[0]) > 0 and len(theirs[2]) > 0
    assert_same_pairs(ours, theirs)


STRATEGIES = ["hard", "semihard", "easy", "all"]
VALID_STRATEGIES = [
    (p, n)
    for p in STRATEGIES
    for n in STRATEGIES
    if not (p == n == "semihard") and {p, n} != {"all", "semihard"}
]
INVALID_STRATEGIES = [("semihard", "semihard"), ("all", "semihard"), ("semihard", "all")]


@pytest.mark.parametrize("dist", ["lp", "cosine", "lp_sq"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("pos_strategy", "neg_strategy"), VALID_STRATEGIES)
def test_batch_easy_hard_matches_pml(pos_strategy, neg_strategy, layout, dist):
    emb, labels, ref_kw = make_data(layout)
    ours_d, pml_d = DISTANCES[dist]
    ours = miners.batch_easy_hard(
        emb,
        labels,
        pos_strategy=pos_strategy,
        neg_strategy=neg_strategy,
        distance=ours_d(),
        **ref_kw,
    )
    miner = pml_miners.BatchEasyHardMiner(
        pos_strategy=pos_strategy, neg_strategy=neg_strategy, distance=pml_d()
    )
    theirs = pml_call(miner, emb, labels, ref_kw)
    assert len(theirs[0]) > 0
    assert_same_pairs(ours, theirs)


def test_batch_easy_hard_defaults_match_pml():
    emb, labels, _ = make_data("randint")
    ours = miners.batch_easy_hard(emb, labels)
    theirs = pml_miners.BatchEasyHardMiner()(emb, labels)
    assert len(theirs[0]) > 0
    assert_same_pairs(ours, theirs)


@pytest.mark.parametrize("which", ["pos", "neg", "both"])
@pytest.mark.parametrize("dist", ["lp", "cosine"])
@pytest.mark.parametrize(
    ("pos_strategy", "neg_strategy"),
    [
        ("easy", "semihard"),
        ("hard", "hard"),
        ("semihard", "easy"),
        ("all", "hard"),
        ("easy", "all"),
    ],
)
def test_batch_easy_hard_allowed_ranges_match_pml(pos_strategy, neg_strategy, dist, which):
    emb, labels, ref_kw = make_data("randint", seed=3)
    ours_d, pml_d = DISTANCES[dist]
    mat = pml_matrix(pml_d(), emb, ref_kw)
    kw = {}
    if which in ("pos", "both"):
        kw["allowed_pos_range"] = tuple(quantiles(mat, 0.15, 0.6))
    if which in ("neg", "both"):
        kw["allowed_neg_range"] = tuple(quantiles(mat, 0.3, 0.85))
    ours = miners.batch_easy_hard(
        emb, labels, pos_strategy=pos_strategy, neg_strategy=neg_strategy, distance=ours_d(), **kw
    )
    miner = pml_miners.BatchEasyHardMiner(
        pos_strategy=pos_strategy, neg_strategy=neg_strategy, distance=pml_d(), **kw
    )
    theirs = miner(emb, labels)
    # a range on a side that is not "all" must change the selection (PML ignores the range of
    # an "all" side), or this test would not test it
    unranged = pml_miners.BatchEasyHardMiner(
        pos_strategy=pos_strategy, neg_strategy=neg_strategy, distance=pml_d()
    )(emb, labels)
    changed = multiset(*theirs[:2]) != multiset(*unranged[:2]) or multiset(*theirs[2:]) != multiset(
        *unranged[2:]
    )
    ranged_sides = {"pos": pos_strategy, "neg": neg_strategy}
    if any(ranged_sides[s] != "all" for s in ranged_sides if which in (s, "both")):
        assert changed
    assert_same_pairs(ours, theirs)


@pytest.mark.parametrize(("pos_strategy", "neg_strategy"), INVALID_STRATEGIES)
def test_batch_easy_hard_invalid_combinations_raise_like_pml(pos_strategy, neg_strategy):
    emb, labels, _ = make_data("uneven")
    with pytest.raises(ValueError):
        pml_miners.BatchEasyHardMiner(pos_strategy=pos_strategy, neg_strategy=neg_strategy)
    with pytest.raises(ValueError, match="semihard"):
        miners.batch_easy_hard(emb, labels, pos_strategy=pos_strategy, neg_strategy=neg_strategy)


@pytest.mark.parametrize("dist", ["lp", "lp_raw", "lp_sq", "cosine", "dot"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_hard_matches_pml(layout, dist):
    emb, labels, ref_kw = make_data(layout)
    ours_d, pml_d = DISTANCES[dist]
    ours = miners.batch_hard(emb, labels, distance=ours_d(), **ref_kw)
    theirs = pml_call(pml_miners.BatchHardMiner(distance=pml_d()), emb, labels, ref_kw)
    assert isinstance(ours, MinedTriplets)
    assert ours.anchors.shape == (emb.shape[0],)  # one slot per anchor, invalid ones weight 0
    assert len(theirs[0]) > 0
    assert_same_triplets(ours, theirs)


@pytest.mark.parametrize("margin", [0.2, 0.0, 0.5])
@pytest.mark.parametrize("type_of_triplets", ["all", "hard", "semihard", "easy"])
@pytest.mark.parametrize("dist", ["lp", "lp_raw", "lp_sq", "cosine", "dot"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triplet_margin_matches_pml(layout, dist, type_of_triplets, margin):
    emb, labels, ref_kw = make_data(layout)
    ours_d, pml_d = DISTANCES[dist]
    ours = miners.triplet_margin(
        emb,
        labels,
        margin=margin,
        type_of_triplets=type_of_triplets,
        distance=ours_d(),
        **ref_kw,
    )
    miner = pml_miners.TripletMarginMiner(
        margin=margin, type_of_triplets=type_of_triplets, distance=pml_d()
    )
    theirs = pml_call(miner, emb, labels, ref_kw)
    assert isinstance(ours, TripletWindow)
    if not (type_of_triplets == "semihard" and margin == 0.0):  # that window is empty
        assert len(theirs[0]) > 0
    assert_same_triplets(ours, theirs)


def test_triplet_margin_defaults_match_pml():
    emb, labels, _ = make_data("uneven")
    assert_same_triplets(
        miners.triplet_margin(emb, labels), pml_miners.TripletMarginMiner()(emb, labels)
    )


def test_triplet_margin_tensor_margin_equals_float():
    emb, labels, _ = make_data("uneven")
    a = miners.triplet_margin(emb, labels, margin=torch.tensor(0.3), type_of_triplets="semihard")
    b = miners.triplet_margin(emb, labels, margin=0.3, type_of_triplets="semihard")
    assert multiset(*a.to_indices()) == multiset(*b.to_indices())
    assert len(b.to_indices()[0]) > 0


@pytest.mark.parametrize("angle", [20, 45])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_angular_matches_pml(layout, angle):
    emb, labels, ref_kw = make_data(layout)
    ours = miners.angular(emb, labels, angle=angle, **ref_kw)
    theirs = pml_call(pml_miners.AngularMiner(angle=angle), emb, labels, ref_kw)
    assert isinstance(ours, TripletMask)
    assert len(theirs[0]) > 0
    assert_same_triplets(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_angular_of_a_negative_equal_to_its_anchor_and_positive_is_pmls_epsilon_angle(dtype):
    """Three equal rows (anchor, positive, a negative of another class): both distances are
    PML's ``F.pairwise_distance`` of ``ε = 1e-6`` added to a zero difference, ``√D·ε``, so the
    angle is ``atan(1/2)`` ≈ 26.57° (not 90° as a zero centre distance would give): selected at
    20°, not at 30°. The rows are exact (unit basis vectors), so the Gram form's ``D·ε²`` term
    is the whole distance."""
    emb = torch.tensor(
        [[1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]], dtype=dtype
    )
    labels = lab([0, 0, 1, 1])
    for angle, selected in ((20, True), (30, False)):
        ours = miners.angular(emb, labels, angle=angle)
        theirs = pml_miners.AngularMiner(angle=angle)(emb, labels)
        assert_same_triplets(ours, theirs)
        assert bool(ours.mask[0, 1, 2]) is selected and bool(ours.mask[1, 0, 2]) is selected


@pytest.mark.parametrize("batch", [3, 12])
def test_packaged_triplets_match_pml(batch):
    emb = torch.randn(batch, 4, generator=seed(0), dtype=F64)
    labels = torch.arange(batch)
    ours = miners.embeddings_already_packaged_as_triplets(emb, labels)
    theirs = pml_miners.EmbeddingsAlreadyPackagedAsTriplets()(emb, labels)
    assert_same_triplets(ours, theirs)
    # labels are optional
    assert_same_triplets(miners.embeddings_already_packaged_as_triplets(emb), theirs)


@pytest.mark.parametrize("filter_percentage", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("dist", ["lp", "cosine", "lp_raw"])
@pytest.mark.parametrize("layout", ["uneven", "randint"])
def test_hdc_matches_pml_self_mode(layout, dist, filter_percentage):
    """Self mode: the matrix is symmetric, so a tied (i, j)/(j, i) pair can be split at the
    boundary either way: compare the counts and the selected values, not the indices."""
    emb, labels, ref_kw = make_data(layout)
    ours_d, pml_d = DISTANCES[dist]
    ours = miners.hdc(emb, labels, filter_percentage=filter_percentage, distance=ours_d())
    theirs = pml_miners.HDCMiner(filter_percentage=filter_percentage, distance=pml_d())(emb, labels)
    mat = pml_matrix(pml_d(), emb, ref_kw)
    a1, p, a2, n = ours.to_indices()
    t1, tp, t2, tn = theirs
    assert len(a1) == len(t1) > 0 and len(a2) == len(t2) > 0
    for mine, pml in (((a1, p), (t1, tp)), ((a2, n), (t2, tn))):
        assert len(set(multiset(*mine))) == len(mine[0])  # no pair twice
        torch.testing.assert_close(mat[mine].sort().values, mat[pml].sort().values, **TOL64)
    # the count follows ceil(fraction * #pairs)
    num_pos = int(((labels[:, None] == labels[None]).sum() - len(labels)).item())
    assert len(a1) == math.ceil(filter_percentage * num_pos)


@pytest.mark.parametrize("filter_percentage", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("dist", ["lp", "cosine"])
def test_hdc_matches_pml_with_reference_set(dist, filter_percentage):
    emb, labels, ref_kw = make_data("ref")
    ours_d, pml_d = DISTANCES[dist]
    ours = miners.hdc(emb, labels, filter_percentage=filter_percentage, distance=ours_d(), **ref_kw)
    miner = pml_miners.HDCMiner(filter_percentage=filter_percentage, distance=pml_d())
    theirs = pml_call(miner, emb, labels, ref_kw)
    assert len(theirs[0]) > 0
    assert_same_pairs(ours, theirs)


@pytest.mark.parametrize("labels", [list(range(6)), [2] * 6], ids=["all_distinct", "all_same"])
def test_no_triplets_mines_nothing_like_pml(labels):
    emb = torch.randn(6, 4, generator=seed(1), dtype=F64)
    labels = lab(labels)
    for ours, theirs in [
        (miners.batch_hard(emb, labels), pml_miners.BatchHardMiner()(emb, labels)),
        (miners.multi_similarity(emb, labels), pml_miners.MultiSimilarityMiner()(emb, labels)),
        (miners.triplet_margin(emb, labels), pml_miners.TripletMarginMiner()(emb, labels)),
        (miners.angular(emb, labels), pml_miners.AngularMiner()(emb, labels)),
        (miners.batch_easy_hard(emb, labels), pml_miners.BatchEasyHardMiner()(emb, labels)),
    ]:
        got = ours.to_indices()
        assert len(theirs[0]) == 0 and len(got[0]) == 0
        if len(got) == 4:
            assert_same_pairs(ours, theirs)
        else:
            assert_same_triplets(ours, theirs)


def test_large_batch_chunked_paths_match_pml():
    """B = 165: the angular cube, ``to_indices`` and the triplet loss's exact fallback all run
    in two anchor chunks of 154 and 11 rows (and bounded angular mining draws per chunk)."""
    g = seed(0)
    b = 165
    emb = torch.randn(b, 3, generator=g, dtype=F64)
    labels = torch.randint(0, 10, (b,), generator=g)
    ours = miners.angular(emb, labels, angle=35)
    theirs = pml_miners.AngularMiner(angle=35)(emb, labels)
    assert torch.equal(triplet_keys(ours.to_indices(), b), triplet_keys(theirs, b))
    window = miners.triplet_margin(emb, labels, margin=0.1, type_of_triplets="semihard")
    pml_window = pml_miners.TripletMarginMiner(margin=0.1, type_of_triplets="semihard")(emb, labels)
    assert torch.equal(triplet_keys(window.to_indices(), b), triplet_keys(pml_window, b))
    # the loss on a copy's window: the chunked exact evaluation
    mined = miners.triplet_margin(emb.clone(), labels, margin=0.1, type_of_triplets="semihard")
    got = value_and_grads(
        lambda x: pf.losses.triplet_margin(x, labels, margin=0.3, indices_tuple=mined), emb
    )
    pml_loss = pml_losses.TripletMarginLoss(margin=0.3)
    want = value_and_grads(lambda x: pml_loss(x, labels, indices_tuple=pml_window), emb)
    assert_same(got, want, **TOL64)
    # bounded angular mining across chunks
    k = 4
    bounded = miners.angular(emb, labels, angle=35, tuples_per_anchor=k, generator=seed(1))
    assert bounded.anchors.shape == (b * k,)
    got_idx = bounded.to_indices()
    keys = triplet_keys(got_idx, b)
    assert torch.isin(keys, triplet_keys(theirs, b)).all()
    assert len(keys.unique()) == len(keys)
    torch.testing.assert_close(
        triplet_counts_per_anchor(got_idx, b),
        triplet_counts_per_anchor(theirs, b).clamp_max(k),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "miner", ["pair_margin", "multi_similarity", "triplet_all", "batch_hard", "angular"]
)
def test_low_precision_mines_like_float32_of_the_same_values(miner, dtype):
    """Half-precision embeddings are mined in float32 (the compute dtype)."""
    emb, labels = loss_data()
    low = emb.to(dtype)
    fn = MINER_PAIRS[miner][0]
    got, want = fn(low, labels), fn(low.float(), labels)
    if isinstance(want, MinedPairs):
        assert got.pos.dtype == F32
        assert_same_pairs(got, want.to_indices())
    else:
        assert_same_triplets(got, want.to_indices())
    assert len(want.to_indices()[0]) > 0


# ----------------------------------------------------------------------------------------------
# 2. losses on our tuples == PML's losses on PML's tuples
# ----------------------------------------------------------------------------------------------
# name -> (our miner(emb, labels), PML miner factory)
MINER_PAIRS = {
    "pair_margin": (
        lambda x, y: miners.pair_margin(x, y, pos_margin=0.6, neg_margin=1.2),
        lambda: pml_miners.PairMarginMiner(pos_margin=0.6, neg_margin=1.2),
    ),
    "multi_similarity": (
        lambda x, y: miners.multi_similarity(x, y, epsilon=0.1),
        lambda: pml_miners.MultiSimilarityMiner(epsilon=0.1),
    ),
    "hdc_ref_free": (  # fraction 1.0: every pair, no tie-breaking involved
        lambda x, y: miners.hdc(x, y, filter_percentage=1.0),
        lambda: pml_miners.HDCMiner(filter_percentage=1.0),
    ),
    "triplet_all": (
        lambda x, y: miners.triplet_margin(x, y, margin=0.2),
        lambda: pml_miners.TripletMarginMiner(margin=0.2),
    ),
    "triplet_hard": (
        lambda x, y: miners.triplet_margin(x, y, margin=0.2, type_of_triplets="hard"),
        lambda: pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="hard"),
    ),
    "triplet_semihard": (
        lambda x, y: miners.triplet_margin(x, y, margin=0.2, type_of_triplets="semihard"),
        lambda: pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard"),
    ),
    "triplet_easy": (
        lambda x, y: miners.triplet_margin(x, y, margin=0.2, type_of_triplets="easy"),
        lambda: pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="easy"),
    ),
    "batch_hard": (lambda x, y: miners.batch_hard(x, y), lambda: pml_miners.BatchHardMiner()),
    "easy_semihard": (
        lambda x, y: miners.batch_easy_hard(x, y),
        lambda: pml_miners.BatchEasyHardMiner(),
    ),
    "hard_hard": (
        lambda x, y: miners.batch_easy_hard(x, y, pos_strategy="hard", neg_strategy="hard"),
        lambda: pml_miners.BatchEasyHardMiner(pos_strategy="hard", neg_strategy="hard"),
    ),
    "all_hard": (
        lambda x, y: miners.batch_easy_hard(x, y, pos_strategy="all", neg_strategy="hard"),
        lambda: pml_miners.BatchEasyHardMiner(pos_strategy="all", neg_strategy="hard"),
    ),
    "angular": (
        lambda x, y: miners.angular(x, y, angle=30),
        lambda: pml_miners.AngularMiner(angle=30),
    ),
    "packaged": (
        lambda x, y: miners.embeddings_already_packaged_as_triplets(x, y),
        lambda: pml_miners.EmbeddingsAlreadyPackagedAsTriplets(),
    ),
}

# loss -> (pmlfunc function, PML class, hyper-parameters)
LOSSES = {
    "triplet_margin": (pf.losses.triplet_margin, pml_losses.TripletMarginLoss, {"margin": 0.5}),
    "contrastive": (
        pf.losses.contrastive,
        pml_losses.ContrastiveLoss,
        {"pos_margin": 0.2, "neg_margin": 1.1},
    ),
    "multi_similarity": (
        pf.losses.multi_similarity,
        pml_losses.MultiSimilarityLoss,
        {"alpha": 2.0, "beta": 10.0, "base": 0.5},
    ),
    "ntxent": (pf.losses.ntxent, pml_losses.NTXentLoss, {"temperature": 0.3}),
    "supcon": (pf.losses.supcon, pml_losses.SupConLoss, {"temperature": 0.3}),
}

LOSS_MINER_CASES = [
    ("triplet_margin", m)
    for m in [
        "triplet_all",
        "triplet_hard",
        "triplet_semihard",
        "triplet_easy",
        "batch_hard",
        "pair_margin",
        "multi_similarity",
        "easy_semihard",
        "hard_hard",
        "all_hard",
        "angular",
        "packaged",
    ]
] + [
    (loss, m)
    for loss in ["contrastive", "multi_similarity", "ntxent", "supcon"]
    for m in ["pair_margin", "multi_similarity", "triplet_all", "batch_hard", "hdc_ref_free"]
]


def loss_data(dtype=F64, seed_=0, batch=15):
    g = torch.Generator().manual_seed(seed_)
    emb = torch.randn(batch, 6, generator=g, dtype=F64).to(dtype)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 5, 5, 5, 1][:batch])
    return emb, labels


def compare_with_pml(loss, miner, dtype=F64, pf_kw=None, pml_kw=None, detach_miner=False):
    pf_fn, pml_cls, hp = LOSSES[loss]
    our_miner, pml_miner_factory = MINER_PAIRS[miner]
    emb, labels = loss_data(dtype)
    pml_miner = pml_miner_factory()
    pml_loss = pml_cls(**hp, **(pml_kw or {}))

    def ours(x):
        mined = our_miner(x.detach().clone() if detach_miner else x, labels)
        return pf_fn(x, labels, indices_tuple=mined, **hp, **(pf_kw or {}))

    def theirs(x):
        return pml_loss(x, labels, indices_tuple=pml_miner(x, labels))

    want = value_and_grads(theirs, emb)
    assert want[0] != 0, "PML's loss is 0: the case tests nothing"
    assert_same(value_and_grads(ours, emb), want, **(TOL64 if dtype == F64 else TOL32))


@pytest.mark.parametrize(("loss", "miner"), LOSS_MINER_CASES)
def test_loss_on_mined_equals_pml(loss, miner):
    compare_with_pml(loss, miner)


@pytest.mark.parametrize(
    ("loss", "miner"),
    [
        ("triplet_margin", "triplet_all"),
        ("triplet_margin", "batch_hard"),
        ("contrastive", "pair_margin"),
        ("multi_similarity", "multi_similarity"),
    ],
)
def test_loss_on_mined_equals_pml_float32(loss, miner):
    compare_with_pml(loss, miner, dtype=F32)


REDUCER_CASES = {
    "mean": (lambda: pf.reducers.mean(), lambda: pml_reducers.MeanReducer()),
    "threshold": (
        lambda: pf.reducers.threshold(low=0.1),
        lambda: pml_reducers.ThresholdReducer(low=0.1),
    ),
}


@pytest.mark.parametrize("detach_miner", [False, True], ids=["same_emb", "other_emb"])
@pytest.mark.parametrize("reducer", ["mean", "threshold"])
@pytest.mark.parametrize("miner", ["triplet_all", "triplet_semihard", "triplet_hard"])
def test_triplet_window_reducers_equal_pml(miner, reducer, detach_miner):
    ours_r, pml_r = REDUCER_CASES[reducer]
    compare_with_pml(
        "triplet_margin",
        miner,
        pf_kw={"reducer": ours_r()},
        pml_kw={"reducer": pml_r()},
        detach_miner=detach_miner,
    )


@pytest.mark.parametrize("detach_miner", [False, True], ids=["same_emb", "other_emb"])
@pytest.mark.parametrize("option", ["smooth_loss", "swap"])
@pytest.mark.parametrize("miner", ["triplet_all", "triplet_semihard", "batch_hard", "angular"])
def test_triplet_loss_options_on_mined_equal_pml(miner, option, detach_miner):
    compare_with_pml(
        "triplet_margin",
        miner,
        pf_kw={option: True},
        pml_kw={option: True},
        detach_miner=detach_miner,
    )


@pytest.mark.parametrize("detach_miner", [False, True], ids=["same_emb", "other_emb"])
@pytest.mark.parametrize("loss_margin", [0.05, 0.15])
@pytest.mark.parametrize("miner", ["triplet_all", "triplet_semihard", "triplet_easy"])
def test_triplet_loss_margin_below_the_miners_equals_pml(miner, loss_margin, detach_miner):
    """A loss margin below the miner's (0.2): part of the window has zero hinge."""
    emb, labels = loss_data()
    our_miner, pml_miner_factory = MINER_PAIRS[miner]
    pml_miner, pml_loss = pml_miner_factory(), pml_losses.TripletMarginLoss(margin=loss_margin)

    def ours(x):
        mined = our_miner(x.detach().clone() if detach_miner else x, labels)
        return pf.losses.triplet_margin(x, labels, margin=loss_margin, indices_tuple=mined)

    want = value_and_grads(lambda x: pml_loss(x, labels, indices_tuple=pml_miner(x, labels)), emb)
    if miner != "triplet_easy":  # easy triplets (t > 0.2) have zero hinge for these margins
        assert want[0] > 0
    assert_same(value_and_grads(ours, emb), want, **TOL64)


@pytest.mark.parametrize(
    "miner", ["triplet_all", "triplet_hard", "triplet_semihard", "triplet_easy", "angular"]
)
def test_triplet_window_on_other_embeddings_equals_pml(miner):
    """Mined on a copy of the embeddings: the loss cannot use the sorted fast path (its matrix
    is not the miner's) and evaluates the window exactly, chunk by chunk."""
    compare_with_pml("triplet_margin", miner, detach_miner=True)


def test_triplet_window_on_different_values_equals_pml():
    """Mined on *different* embeddings than the loss sees: PML's loss on PML's triplets mined
    from those other values."""
    emb, labels = loss_data()
    other = emb + 0.3 * torch.randn(emb.shape, generator=seed(5), dtype=F64)
    pml_triplets = pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard")(
        other, labels
    )
    mined = miners.triplet_margin(other, labels, margin=0.2, type_of_triplets="semihard")
    assert multiset(*mined.to_indices()) == multiset(*pml_triplets)
    pml_loss = pml_losses.TripletMarginLoss(margin=0.5)
    want = value_and_grads(lambda x: pml_loss(x, labels, indices_tuple=pml_triplets), emb)
    got = value_and_grads(
        lambda x: pf.losses.triplet_margin(x, labels, margin=0.5, indices_tuple=mined), emb
    )
    assert want[0] > 0
    assert_same(got, want, **TOL64)


def test_triplet_window_on_embeddings_written_in_place_since_equals_pml():
    """Mined, then the same tensor's values changed in place (a buffer or queue updated
    between mining and the loss): its version counter tells the loss that its matrix is not
    the miner's, which it re-evaluates; PML's loss on the mined triplets and the new values.
    (The sorted fast path, chosen by the tensor object alone, read the miner's window as if it
    were the current values' and returned another number.)"""
    emb, labels = loss_data()
    x = emb.clone()
    mined = miners.triplet_margin(x, labels, margin=0.2, type_of_triplets="all")
    with torch.no_grad():
        x.copy_(emb + 0.5 * torch.randn(emb.shape, generator=seed(6), dtype=F64))
    pml_loss = pml_losses.TripletMarginLoss(margin=0.2)
    want = pml_loss(x, labels, indices_tuple=mined.to_indices())
    got = pf.losses.triplet_margin(x, labels, margin=0.2, indices_tuple=mined)
    assert want > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("type_of_triplets", ["all", "semihard"])
def test_triplet_window_loss_with_another_distance_equals_pml(type_of_triplets):
    """Window mined with ``lp()``, loss with ``cosine()``: the loss re-evaluates the window."""
    emb, labels = loss_data()
    pml_miner = pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets=type_of_triplets)
    pml_loss = pml_losses.TripletMarginLoss(margin=0.3, distance=pml_distances.CosineSimilarity())

    def ours(x):
        mined = miners.triplet_margin(x, labels, margin=0.2, type_of_triplets=type_of_triplets)
        return pf.losses.triplet_margin(
            x, labels, margin=0.3, distance=pf.distances.cosine(), indices_tuple=mined
        )

    want = value_and_grads(lambda x: pml_loss(x, labels, indices_tuple=pml_miner(x, labels)), emb)
    assert want[0] > 0
    assert_same(value_and_grads(ours, emb), want, **TOL64)


@pytest.mark.parametrize("loss", LOSSES)
def test_multiplicities_equal_pml_loss_on_repeated_pairs(loss):
    """uniform_histogram's repeated draws: our loss on the multiplicities equals PML's loss on
    the index tuple that lists each pair as often as it was drawn."""
    pf_fn, pml_cls, hp = LOSSES[loss]
    emb, labels = loss_data()
    mined = miners.uniform_histogram(
        emb, labels, num_bins=3, pos_per_bin=12, neg_per_bin=12, generator=seed(4)
    )
    assert mined.pos.max() > 1 and mined.neg.max() > 1
    pml_loss = pml_cls(**hp)
    tup = mined.to_indices()
    want = value_and_grads(lambda x: pml_loss(x, labels, indices_tuple=tup), emb)
    got = value_and_grads(lambda x: pf_fn(x, labels, indices_tuple=mined, **hp), emb)
    assert want[0] != 0
    assert_same(got, want, **TOL64)


@pytest.mark.parametrize("miner", ["triplet_all", "pair_margin", "batch_hard"])
def test_mined_with_reference_set_loss_equals_pml(miner):
    emb, labels, ref_kw = make_data("ref")
    ref, ref_labels = ref_kw["ref_emb"], ref_kw["ref_labels"]
    ours_m = {
        "triplet_all": lambda x, r: miners.triplet_margin(
            x, labels, margin=0.3, ref_emb=r, ref_labels=ref_labels
        ),
        "pair_margin": lambda x, r: miners.pair_margin(
            x, labels, pos_margin=0.6, neg_margin=1.2, ref_emb=r, ref_labels=ref_labels
        ),
        "batch_hard": lambda x, r: miners.batch_hard(x, labels, ref_emb=r, ref_labels=ref_labels),
    }[miner]
    pml_m = {
        "triplet_all": lambda: pml_miners.TripletMarginMiner(margin=0.3),
        "pair_margin": lambda: pml_miners.PairMarginMiner(pos_margin=0.6, neg_margin=1.2),
        "batch_hard": lambda: pml_miners.BatchHardMiner(),
    }[miner]()
    pml_loss = pml_losses.TripletMarginLoss(margin=0.5)

    def ours(x, r):
        return pf.losses.triplet_margin(
            x, labels, margin=0.5, ref_emb=r, ref_labels=ref_labels, indices_tuple=ours_m(x, r)
        )

    def theirs(x, r):
        it = pml_m(x, labels, r, ref_labels)
        return pml_loss(x, labels, indices_tuple=it, ref_emb=r, ref_labels=ref_labels)

    want = value_and_grads(theirs, emb, ref)
    assert want[0] > 0
    assert_same(value_and_grads(ours, emb, ref), want, **TOL64)


# ----------------------------------------------------------------------------------------------
# 3. bounded mining: tuples_per_anchor=k
# ----------------------------------------------------------------------------------------------
BOUNDED_TRIPLET_MINERS = {
    "triplet_all": lambda x, y, **kw: miners.triplet_margin(x, y, margin=0.3, **kw),
    "triplet_hard": lambda x, y, **kw: miners.triplet_margin(
        x, y, margin=0.3, type_of_triplets="hard", **kw
    ),
    "triplet_semihard": lambda x, y, **kw: miners.triplet_margin(
        x, y, margin=0.3, type_of_triplets="semihard", **kw
    ),
    "triplet_easy": lambda x, y, **kw: miners.triplet_margin(
        x, y, margin=0.3, type_of_triplets="easy", **kw
    ),
    "angular": lambda x, y, **kw: miners.angular(x, y, angle=25, **kw),
}


@pytest.mark.parametrize("layout", ["uneven", "ref"])
@pytest.mark.parametrize("k", [1, 3, 32])
@pytest.mark.parametrize("miner", BOUNDED_TRIPLET_MINERS)
def test_bounded_triplets_are_a_uniform_subset(miner, k, layout):
    emb, labels, ref_kw = make_data(layout)
    fn = BOUNDED_TRIPLET_MINERS[miner]
    b = emb.shape[0]
    full = fn(emb, labels, **ref_kw).to_indices()
    full_set = set(multiset(*full))
    full_counts = triplet_counts_per_anchor(full, b)
    assert full_counts.max() > 3  # some anchor has more triplets than k for k in {1, 3}
    bounded = fn(emb, labels, tuples_per_anchor=k, generator=seed(11), **ref_kw)
    assert isinstance(bounded, MinedTriplets)
    for t in bounded:
        assert t.shape == (b * k,)
    assert set(bounded.valid.unique().tolist()) <= {0.0, 1.0}
    got = bounded.to_indices()
    triplets = multiset(*got)
    assert set(triplets) <= full_set, "a bounded triplet is not in the unbounded selection"
    assert len(set(triplets)) == len(triplets), "a triplet was drawn twice"
    counts = triplet_counts_per_anchor(got, b)
    torch.testing.assert_close(counts, full_counts.clamp_max(k))


@pytest.mark.parametrize("miner", BOUNDED_TRIPLET_MINERS)
def test_bounded_triplets_are_reproducible(miner):
    emb, labels, _ = make_data("randint")
    fn = BOUNDED_TRIPLET_MINERS[miner]

    def run(gen):
        return fn(emb, labels, tuples_per_anchor=3, generator=gen)

    def same(x, y):
        return all(torch.equal(a, b) for a, b in zip(x, y, strict=True))

    assert same(run(seed(5)), run(seed(5)))
    assert same(run(torch.tensor(123)), run(torch.tensor(123)))
    assert same(run(torch.tensor(123, dtype=torch.int32)), run(torch.tensor(123)))
    assert not same(run(seed(5)), run(seed(6)))
    assert not same(run(torch.tensor(1)), run(torch.tensor(2)))
    g = seed(5)  # one generator advances: two calls differ
    assert not same(run(g), run(g))


@pytest.mark.parametrize("generator", [None, seed(0), torch.tensor(3)], ids=["none", "gen", "t"])
def test_batch_hard_accepts_tuples_per_anchor(generator):
    """batch_hard has one triplet per anchor: k >= 1 changes nothing (no generator needed)."""
    emb, labels = loss_data()
    bounded = miners.batch_hard(emb, labels, tuples_per_anchor=2, generator=generator)
    want = miners.batch_hard(emb, labels)
    for got, exp in zip(bounded, want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("miner", ["angular", "distance_weighted", "triplet_margin"])
def test_bounded_length_is_batch_times_k_for_tiny_batches(miner):
    """k > M (distance_weighted's positives) and k > M² (angular's cube): still B·k slots,
    the extra ones invalid."""
    emb = torch.randn(4, 3, generator=seed(0), dtype=F64)
    labels = lab([0, 0, 1, 1])
    fn = getattr(miners, miner)
    mined = fn(emb, labels, tuples_per_anchor=32, generator=seed(0))
    for t in mined:
        assert t.shape == (4 * 32,)
    got = mined.to_indices()
    if miner == "distance_weighted":  # one triplet per positive pair (each anchor has one)
        assert got[0].tolist() == [0, 1, 2, 3] and got[1].tolist() == [1, 0, 3, 2]
    else:
        assert multiset(*got) == multiset(*fn(emb, labels).to_indices())


def _uniformity(draw, n_seeds):
    """Over seeds ``0..n_seeds-1``, per anchor: how often each triplet and each subset of
    triplets was drawn."""
    candidates, per_subset = {}, {}
    for s in range(n_seeds):
        by_anchor = {}
        for t in draw(torch.tensor(s)):
            by_anchor.setdefault(t[0], []).append(t)
        for a, ts in by_anchor.items():
            candidates.setdefault(a, Counter()).update(ts)
            per_subset.setdefault(a, Counter())[tuple(sorted(ts))] += 1
    return candidates, per_subset


def _assert_binomial(count, n, p, what):
    sd = math.sqrt(n * p * (1 - p))
    assert abs(count - n * p) <= 4.5 * sd, f"{what}: {count} draws of {n}, expected {n * p:.1f}"


@pytest.mark.parametrize("miner", ["triplet_all", "angular"])
def test_bounded_triplets_are_uniform(miner):
    """Six anchors with 6 candidate triplets each (2 positives × 3 negatives), k = 2: each
    triplet's inclusion frequency ≈ k/6, each 2-subset's ≈ 1/15 (within 4.5 sigma)."""
    emb = torch.randn(6, 3, generator=seed(2), dtype=F64)
    labels = lab([0, 0, 0, 1, 1, 1])
    if miner == "triplet_all":

        def fn(**kw):
            return miners.triplet_margin(emb, labels, margin=100.0, **kw)
    else:

        def fn(**kw):
            return miners.angular(emb, labels, angle=0.5, **kw)

    full = fn().to_indices()
    counts = triplet_counts_per_anchor(full, 6)
    assert (counts == 6).all(), "the case needs every triplet selected"
    k, n = 2, 3000

    def draw(s):
        return multiset(*fn(tuples_per_anchor=k, generator=s).to_indices())

    candidates, subsets = _uniformity(draw, n)
    assert set(candidates) == set(range(6))
    for a in range(6):
        assert set(candidates[a]) == {t for t in multiset(*full) if t[0] == a}
        for t, c in candidates[a].items():
            _assert_binomial(c, n, k / 6, f"triplet {t}")
        assert len(subsets[a]) == math.comb(6, k)
        for sub, c in subsets[a].items():
            _assert_binomial(c, n, 1 / math.comb(6, k), f"subset {sub}")


BOUNDED_PAIR_MINERS = {
    "pair_margin": lambda x, y, **kw: miners.pair_margin(
        x, y, pos_margin=0.5, neg_margin=1.3, **kw
    ),
    "multi_similarity": lambda x, y, **kw: miners.multi_similarity(x, y, epsilon=0.3, **kw),
    "hdc": lambda x, y, **kw: miners.hdc(x, y, filter_percentage=0.7, **kw),
    "all_all": lambda x, y, **kw: miners.batch_easy_hard(
        x, y, pos_strategy="all", neg_strategy="all", **kw
    ),
    "uniform_histogram": lambda x, y, **kw: miners.uniform_histogram(
        x, y, num_bins=5, pos_per_bin=10, neg_per_bin=20, **kw
    ),
}


@pytest.mark.parametrize("layout", ["randint", "ref"])
@pytest.mark.parametrize("k", [1, 3, 32])
@pytest.mark.parametrize("miner", BOUNDED_PAIR_MINERS)
def test_bounded_pairs_are_a_subset(miner, k, layout):
    emb, labels, ref_kw = make_data(layout)
    fn = BOUNDED_PAIR_MINERS[miner]
    stochastic = {"generator": seed(3)} if miner == "uniform_histogram" else {}
    full = fn(emb, labels, **stochastic, **ref_kw)
    bounded = fn(emb, labels, tuples_per_anchor=k, **ref_kw, generator=seed(3))
    assert isinstance(bounded, MinedPairs)
    for side_full, side in zip(full, bounded, strict=True):
        assert side.shape == side_full.shape
        assert set(side.unique().tolist()) <= {0.0, 1.0}
        assert (side <= (side_full > 0)).all(), "a bounded pair is not in the unbounded set"
        want = (side_full > 0).sum(-1).clamp_max(k)
        torch.testing.assert_close(side.sum(-1), want.to(side.dtype))
    # rows with more pairs than k (for k = 1 at least): the bound is exercised
    assert (full.pos > 0).sum(-1).max() > 1 and (full.neg > 0).sum(-1).max() > 3


def test_bounded_pairs_are_uniform_and_reproducible():
    emb, labels, _ = make_data("uneven")
    fn = BOUNDED_PAIR_MINERS["all_all"]
    k, n = 2, 1500
    pos_rows = (labels[:, None] == labels[None]).sum(-1) - 1
    a = int(pos_rows.argmax())  # an anchor of the class of 4: 3 positives
    assert pos_rows[a] == 3
    first = fn(emb, labels, tuples_per_anchor=k, generator=torch.tensor(0))
    again = fn(emb, labels, tuples_per_anchor=k, generator=torch.tensor(0))
    assert torch.equal(first.pos, again.pos) and torch.equal(first.neg, again.neg)
    pos_hits = torch.zeros(emb.shape[0], dtype=F64)
    neg_hits = torch.zeros(emb.shape[0], dtype=F64)
    for s in range(n):
        mined = fn(emb, labels, tuples_per_anchor=k, generator=torch.tensor(s))
        pos_hits += mined.pos[a]
        neg_hits += mined.neg[a]
    n_neg = int((labels != labels[a]).sum())
    for j in range(emb.shape[0]):
        if labels[j] == labels[a] and j != a:
            _assert_binomial(float(pos_hits[j]), n, k / 3, f"positive {j}")
        elif labels[j] != labels[a]:
            _assert_binomial(float(neg_hits[j]), n, k / n_neg, f"negative {j}")
        else:
            assert pos_hits[j] == 0 and neg_hits[j] == 0


# ----------------------------------------------------------------------------------------------
# 4. stochastic miners
# ----------------------------------------------------------------------------------------------
def lp_matrix(emb, ref=None):
    x = torch.nn.functional.normalize(emb.to(F64), dim=-1)
    y = x if ref is None else torch.nn.functional.normalize(ref.to(F64), dim=-1)
    return ((x[:, None] - y[None]) ** 2).sum(-1).sqrt()


@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("layout", ["uneven", "randint", "ref"])
def test_distance_weighted_triplets_are_valid(layout, k):
    emb, labels, ref_kw = make_data(layout, seed=4)
    emb = emb[:, :3]  # low dimension: many distances below the cutoff
    if ref_kw:
        ref_kw = {**ref_kw, "ref_emb": ref_kw["ref_emb"][:, :3]}
    ref_labels = ref_kw.get("ref_labels", labels)
    mat = lp_matrix(emb, ref_kw.get("ref_emb"))
    b, m = mat.shape
    kw = {} if k is None else {"tuples_per_anchor": k}
    mined = miners.distance_weighted(emb, labels, generator=seed(0), **kw, **ref_kw)
    assert isinstance(mined, MinedTriplets)
    assert mined.anchors.shape == (b * (m if k is None else k),)
    a, p, n = mined.to_indices()
    assert len(a) > 0
    assert (labels[a] == ref_labels[p]).all()
    assert (labels[a] != ref_labels[n]).all()
    assert (mat[a, n] < 1.4).all()
    if not ref_kw:
        assert (a != p).all()
    # every anchor with a positive and a reachable negative gets min(k, #positives) triplets
    pos = labels[:, None] == ref_labels[None]
    if not ref_kw:
        pos.fill_diagonal_(False)
    reachable = ((labels[:, None] != ref_labels[None]) & (mat < 1.4)).any(-1)
    want = pos.sum(-1) * reachable
    if k is not None:
        want = want.clamp_max(k)
        assert len(set(multiset(a, p))) == len(a), "a positive drawn twice for one anchor"
    else:
        assert multiset(a, p) == multiset(*torch.where(pos & reachable[:, None]))
    torch.testing.assert_close(torch.bincount(a, minlength=b), want)


def test_distance_weighted_is_reproducible():
    emb, labels, _ = make_data("randint")
    emb = emb[:, :3]

    def run(gen):
        return miners.distance_weighted(emb, labels, generator=gen)

    x, y = run(seed(1)), run(seed(1))
    assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    x, y = run(torch.tensor(9)), run(torch.tensor(9))
    assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    assert not torch.equal(run(seed(1)).negatives, run(seed(2)).negatives)


@pytest.mark.parametrize(("dim", "cutoff", "data_seed"), [(4, 0.5, 4), (6, 0.8, 7)])
def test_distance_weighted_negative_distribution(dim, cutoff, data_seed):
    """Per anchor, each negative's empirical frequency over many seeds matches
    ``w ∝ exp((2 − D)·log(max(d, c)) − ((D − 3)/2)·log(1 − max(d, c)²/4))`` on ``d < 1.4``."""
    labels = lab([0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    emb = torch.randn(len(labels), dim, generator=seed(data_seed), dtype=F64)
    mat = lp_matrix(emb)
    dc = mat.clamp_min(cutoff)
    log_w = (2 - dim) * torch.log(dc) - ((dim - 3) / 2) * torch.log(1 - 0.25 * dc**2)
    w = torch.exp(log_w) * (mat < 1.4) * (labels[:, None] != labels[None])
    w = w / w.sum(-1, keepdim=True)
    anchors = range(6)
    assert all(int((w[a] > 0).sum()) >= 3 for a in anchors), "need several reachable negatives"
    hits = torch.zeros(6, len(labels), dtype=F64)
    n_calls = 600
    for s in range(n_calls):
        a, _, n = miners.distance_weighted(
            emb, labels, cutoff=cutoff, generator=torch.tensor(s)
        ).to_indices()
        keep = a < 6
        hits.index_put_((a[keep], n[keep]), torch.ones(int(keep.sum()), dtype=F64), accumulate=True)
    draws = 5 * n_calls  # every anchor of class 0 has 5 positives, one negative each
    power = []
    for a in anchors:
        assert hits[a].sum() == draws
        support = w[a] > 0
        assert (hits[a][~support] == 0).all(), "drew a negative of weight 0"
        expected = draws * w[a][support]
        chi2 = float(((hits[a][support] - expected) ** 2 / expected).sum())
        df = int(support.sum()) - 1
        limit = stats.chi2.ppf(1 - 1e-6, df)
        assert chi2 < limit, f"anchor {a}: chi2 {chi2:.1f} > {limit:.1f}"
        # power: how far a uniform sampler's expected counts are from these
        uniform = draws / int(support.sum())
        power.append(float(((expected - uniform) ** 2 / uniform).sum()) / limit)
    assert max(power) > 3, "the weights are too flat: a uniform sampler would pass"


def _bins(values, num_bins):
    edges = torch.linspace(values.min(), values.max(), num_bins + 1, dtype=values.dtype)
    idx = torch.searchsorted(edges, values.contiguous(), right=True) - 1
    return idx.clamp(0, num_bins - 1)


@pytest.mark.parametrize("layout", ["uneven", "randint", "ref"])
@pytest.mark.parametrize("num_bins", [3, 10, 40])
def test_uniform_histogram_draws(layout, num_bins):
    emb, labels, ref_kw = make_data(layout)
    ref_labels = ref_kw.get("ref_labels", labels)
    mat = pml_matrix(pml_distances.LpDistance(), emb, ref_kw)
    pos_mask = labels[:, None] == ref_labels[None]
    if not ref_kw:
        pos_mask.fill_diagonal_(False)
    neg_mask = labels[:, None] != ref_labels[None]
    per = {"pos": 4, "neg": 7}
    mined = miners.uniform_histogram(
        emb,
        labels,
        num_bins=num_bins,
        pos_per_bin=per["pos"],
        neg_per_bin=per["neg"],
        generator=seed(1),
        **ref_kw,
    )
    for side, w, mask in (("pos", mined.pos, pos_mask), ("neg", mined.neg, neg_mask)):
        assert (w[~mask] == 0).all(), f"{side}: drew a pair that is not a {side} pair"
        assert (w == w.round()).all() and (w >= 0).all()
        bins = _bins(mat[mask], num_bins)
        nonempty = torch.bincount(bins, minlength=num_bins) > 0
        assert int(w.sum()) == per[side] * int(nonempty.sum())
        # every non-empty bin got exactly per_bin draws
        drawn_bins = torch.repeat_interleave(bins, w[mask].long())
        torch.testing.assert_close(
            torch.bincount(drawn_bins, minlength=num_bins), nonempty.long() * per[side]
        )
    again = miners.uniform_histogram(
        emb,
        labels,
        num_bins=num_bins,
        pos_per_bin=per["pos"],
        neg_per_bin=per["neg"],
        generator=seed(1),
        **ref_kw,
    )
    assert torch.equal(mined.pos, again.pos) and torch.equal(mined.neg, again.neg)
    other = miners.uniform_histogram(
        emb,
        labels,
        num_bins=num_bins,
        pos_per_bin=per["pos"],
        neg_per_bin=per["neg"],
        generator=seed(2),
        **ref_kw,
    )
    assert not torch.equal(mined.neg, other.neg)


def test_uniform_histogram_draws_uniformly_within_a_bin():
    """One bin: every pair equally likely (with replacement)."""
    emb, labels, _ = make_data("uneven")
    pos_mask = labels[:, None] == labels[None]
    pos_mask.fill_diagonal_(False)
    n_pairs = int(pos_mask.sum())
    total = torch.zeros(pos_mask.shape, dtype=F64)
    n_calls, per_bin = 200, 20
    for s in range(n_calls):
        total += miners.uniform_histogram(
            emb, labels, num_bins=1, pos_per_bin=per_bin, generator=torch.tensor(s)
        ).pos
    n = n_calls * per_bin
    assert total.sum() == n
    for c in total[pos_mask].tolist():
        _assert_binomial(c, n, 1 / n_pairs, "pair")


# ----------------------------------------------------------------------------------------------
# 5. multiplicities and to_indices
# ----------------------------------------------------------------------------------------------
def test_uniform_histogram_repeats_are_multiplicities():
    emb, labels, _ = make_data("uneven")
    mined = miners.uniform_histogram(
        emb, labels, num_bins=2, pos_per_bin=30, neg_per_bin=30, generator=seed(0)
    )
    assert mined.pos.max() > 1 and mined.neg.max() > 1
    a1, p, a2, n = mined.to_indices()
    assert len(a1) == int(mined.pos.sum()) == 60
    assert len(a2) == int(mined.neg.sum()) == 60
    for (a, b), c in Counter(multiset(a1, p)).items():
        assert mined.pos[a, b] == c
    for (a, b), c in Counter(multiset(a2, n)).items():
        assert mined.neg[a, b] == c


# name -> miner(emb, labels) for the to_indices consistency check
ALL_MINERS = {
    "pair_margin": lambda x, y: miners.pair_margin(x, y, pos_margin=0.6, neg_margin=1.2),
    "multi_similarity": lambda x, y: miners.multi_similarity(x, y),
    "hdc": lambda x, y: miners.hdc(x, y, filter_percentage=0.4),
    "uniform_histogram": lambda x, y: miners.uniform_histogram(
        x, y, num_bins=3, pos_per_bin=8, neg_per_bin=8, generator=seed(0)
    ),
    "easy_semihard": lambda x, y: miners.batch_easy_hard(x, y),
    "all_easy": lambda x, y: miners.batch_easy_hard(x, y, pos_strategy="all", neg_strategy="easy"),
    "batch_hard": lambda x, y: miners.batch_hard(x, y),
    "triplet_window": lambda x, y: miners.triplet_margin(x, y, margin=0.2),
    "triplet_k": lambda x, y: miners.triplet_margin(
        x, y, margin=0.2, tuples_per_anchor=3, generator=seed(0)
    ),
    "angular": lambda x, y: miners.angular(x, y, angle=30),
    "angular_k": lambda x, y: miners.angular(
        x, y, angle=30, tuples_per_anchor=2, generator=seed(0)
    ),
    "distance_weighted": lambda x, y: miners.distance_weighted(x, y, generator=seed(0)),
    "packaged": lambda x, y: miners.embeddings_already_packaged_as_triplets(x, y),
    "pair_margin_k": lambda x, y: miners.pair_margin(
        x, y, pos_margin=0.6, neg_margin=1.2, tuples_per_anchor=2, generator=seed(0)
    ),
}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("miner", ALL_MINERS)
def test_loss_on_mined_equals_loss_on_to_indices(miner, loss):
    pf_fn, _, hp = LOSSES[loss]
    emb, labels = loss_data()
    emb = emb[:12, :4]  # 12 rows (whole triplets for "packaged"); 4 dims: distance_weighted
    labels = labels[:12]
    mined = ALL_MINERS[miner](emb, labels)
    as_tuple = mined.to_indices()
    assert len(as_tuple[0]) > 0
    got = value_and_grads(lambda x: pf_fn(x, labels, indices_tuple=mined, **hp), emb)
    want = value_and_grads(lambda x: pf_fn(x, labels, indices_tuple=as_tuple, **hp), emb)
    assert want[0] != 0
    assert_same(got, want, **TOL64)


# ----------------------------------------------------------------------------------------------
# 6. miner → loss pipelines under torch.compile, torch.func, on meta
# ----------------------------------------------------------------------------------------------
def _pair_margin_triplet(x, y, s):
    mined = miners.pair_margin(x, y, pos_margin=0.6, neg_margin=1.2)
    return pf.losses.triplet_margin(x, y, margin=0.5, indices_tuple=mined)


def _batch_hard_triplet(x, y, s):
    return pf.losses.triplet_margin(x, y, margin=0.5, indices_tuple=miners.batch_hard(x, y))


def _window_triplet(x, y, s):
    mined = miners.triplet_margin(x, y, margin=0.2, type_of_triplets="semihard")
    return pf.losses.triplet_margin(x, y, margin=0.5, indices_tuple=mined)


def _bounded_triplet(x, y, s):
    mined = miners.triplet_margin(x, y, margin=0.3, tuples_per_anchor=3, generator=s)
    return pf.losses.triplet_margin(x, y, margin=0.5, indices_tuple=mined)


def _ms_ms(x, y, s):
    mined = miners.multi_similarity(x, y, epsilon=0.1)
    return pf.losses.multi_similarity(x, y, indices_tuple=mined)


def _distance_weighted_triplet(x, y, s):
    mined = miners.distance_weighted(x, y, generator=s)
    return pf.losses.triplet_margin(x, y, margin=0.5, indices_tuple=mined)


def _hdc_contrastive(x, y, s):
    mined = miners.hdc(x, y, filter_percentage=0.5)
    return pf.losses.contrastive(x, y, indices_tuple=mined)


def _uniform_histogram_contrastive(x, y, s):
    mined = miners.uniform_histogram(x, y, num_bins=4, generator=s)
    return pf.losses.contrastive(x, y, indices_tuple=mined)


def _angular_k_triplet(x, y, s):
    mined = miners.angular(x, y, angle=30, tuples_per_anchor=2, generator=s)
    return pf.losses.triplet_margin(x, y, margin=0.5, indices_tuple=mined)


def _easy_hard_ntxent(x, y, s):
    mined = miners.batch_easy_hard(x, y, pos_strategy="easy", neg_strategy="semihard")
    return pf.losses.ntxent(x, y, indices_tuple=mined, temperature=0.3)


PIPELINES = {
    "pair_margin->triplet": _pair_margin_triplet,
    "batch_hard->triplet": _batch_hard_triplet,
    "window->triplet": _window_triplet,
    "bounded_triplet->triplet": _bounded_triplet,
    "multi_similarity->multi_similarity": _ms_ms,
    "distance_weighted->triplet": _distance_weighted_triplet,
    "hdc->contrastive": _hdc_contrastive,
    "uniform_histogram->contrastive": _uniform_histogram_contrastive,
    "angular_k->triplet": _angular_k_triplet,
    "easy_hard->ntxent": _easy_hard_ntxent,
}
# Inductor's compile of the seed hash (pmlfunc._random) costs ~20 s per call site on a 2-core
# CPU with a cold cache (its lowering re-expands the hash's int64 expression tree), so the
# stochastic pipelines use aot_eager: full-graph capture (no graph break, no host sync),
# functionalisation and the compiled autograd graph, without code generation. Set their backend
# to "inductor" to check the hash's integer arithmetic in generated code (~45 s more).
COMPILED = [
    ("pair_margin->triplet", "inductor"),
    ("batch_hard->triplet", "inductor"),
    ("window->triplet", "inductor"),
    ("bounded_triplet->triplet", "aot_eager"),
    ("multi_similarity->multi_similarity", "inductor"),
    ("distance_weighted->triplet", "aot_eager"),
]


@pytest.mark.compile
@pytest.mark.parametrize(("name", "backend"), COMPILED)
def test_compile_fullgraph_equals_eager(name, backend):
    torch._dynamo.reset()
    fn = PIPELINES[name]
    emb, labels = loss_data(batch=14)
    s = torch.tensor(17)
    want = value_and_grads(lambda x: fn(x, labels, s), emb)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = value_and_grads(lambda x: compiled(x, labels, s), emb)
    assert want[0] != 0
    assert_same(got, want, **TOL64)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", PIPELINES)
def test_func_grad_equals_autograd(name):
    fn = PIPELINES[name]
    emb, labels = loss_data(batch=14)
    s = torch.tensor(17)
    value, (grad,) = value_and_grads(lambda x: fn(x, labels, s), emb)
    assert value != 0
    g = torch.func.grad(lambda x: fn(x, labels, s))(emb)
    torch.testing.assert_close(g, grad, **TOL64)


@pytest.mark.parametrize("name", PIPELINES)
def test_pipelines_on_meta(name):
    x = torch.empty(14, 6, device="meta", dtype=F64, requires_grad=True)
    y = torch.empty(14, dtype=torch.int64, device="meta")
    s = torch.tensor(3, device="meta")
    loss = PIPELINES[name](x, y, s)
    assert loss.device.type == "meta" and loss.shape == () and loss.dtype == F64


# ----------------------------------------------------------------------------------------------
# 7. one matrix shared by the miner and several losses
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dist", ["cosine", "lp"])
def test_shared_mat_equals_separate(dist):
    emb, labels = loss_data()
    make = DISTANCES[dist][0]

    def shared(x):
        mat = make()(x)
        mined = miners.multi_similarity(x, labels, distance=make(), mat=mat)
        window = miners.triplet_margin(x, labels, margin=0.3, distance=make(), mat=mat)
        return (
            pf.losses.multi_similarity(x, labels, distance=make(), indices_tuple=mined, mat=mat)
            + pf.losses.contrastive(
                x,
                labels,
                distance=make(),
                indices_tuple=mined,
                mat=mat,
                pos_margin=0.3 if dist == "lp" else 0.8,
                neg_margin=1.0 if dist == "lp" else 0.2,
            )
            + pf.losses.triplet_margin(
                x, labels, distance=make(), indices_tuple=window, mat=mat, margin=0.5
            )
        )

    def separate(x):
        mined = miners.multi_similarity(x, labels, distance=make())
        window = miners.triplet_margin(x, labels, margin=0.3, distance=make())
        return (
            pf.losses.multi_similarity(x, labels, distance=make(), indices_tuple=mined)
            + pf.losses.contrastive(
                x,
                labels,
                distance=make(),
                indices_tuple=mined,
                pos_margin=0.3 if dist == "lp" else 0.8,
                neg_margin=1.0 if dist == "lp" else 0.2,
            )
            + pf.losses.triplet_margin(x, labels, distance=make(), indices_tuple=window, margin=0.5)
        )

    want = value_and_grads(separate, emb)
    assert want[0] != 0
    assert_same(value_and_grads(shared, emb), want, **TOL64)


@pytest.mark.parametrize("miner", ["multi_similarity", "pair_margin", "triplet_margin", "hdc"])
def test_detached_mat_fine_for_miner_rejected_by_loss(miner):
    emb, labels = loss_data()
    x = emb.clone().requires_grad_(True)
    fn = getattr(miners, miner)
    dist = pf.distances.cosine() if miner == "multi_similarity" else pf.distances.lp()
    mat = dist(x).detach()
    with_mat = fn(x, labels, distance=dist, mat=mat)
    without = fn(x, labels, distance=dist)
    if isinstance(without, MinedPairs):
        assert_same_pairs(with_mat, without.to_indices())
    else:
        assert_same_triplets(with_mat, without.to_indices())
    assert len(without.to_indices()[0]) > 0
    with pytest.raises(ValueError, match="mat"):
        pf.losses.contrastive(x, labels, distance=dist, indices_tuple=with_mat, mat=mat)
    # with the embeddings detached a detached mat is fine
    pf.losses.contrastive(emb, labels, distance=dist, indices_tuple=with_mat, mat=mat)


# ----------------------------------------------------------------------------------------------
# 8. errors
# ----------------------------------------------------------------------------------------------
DET_MINERS = {
    "pair_margin": miners.pair_margin,
    "multi_similarity": miners.multi_similarity,
    "hdc": miners.hdc,
    "batch_easy_hard": miners.batch_easy_hard,
    "batch_hard": miners.batch_hard,
    "triplet_margin": miners.triplet_margin,
    "angular": miners.angular,
}
STOCHASTIC_MINERS = {
    "uniform_histogram": miners.uniform_histogram,
    "distance_weighted": miners.distance_weighted,
}
EVERY_MINER = {**DET_MINERS, **STOCHASTIC_MINERS}


def _gen_kw(name):
    return {"generator": seed(0)} if name in STOCHASTIC_MINERS else {}


@pytest.mark.parametrize("name", EVERY_MINER)
def test_error_labels_length(name):
    emb, labels = loss_data()
    with pytest.raises(ValueError, match="labels"):
        EVERY_MINER[name](emb, labels[:-1], **_gen_kw(name))


@pytest.mark.parametrize("name", EVERY_MINER)
def test_error_labels_none(name):
    emb, _ = loss_data()
    with pytest.raises(ValueError, match="labels"):
        EVERY_MINER[name](emb, None, **_gen_kw(name))


@pytest.mark.parametrize("name", [n for n in EVERY_MINER if n != "angular"])
def test_error_mat_shape(name):
    emb, labels = loss_data()
    mat = torch.zeros(emb.shape[0], emb.shape[0] + 1, dtype=F64)
    with pytest.raises(ValueError, match="mat"):
        EVERY_MINER[name](emb, labels, mat=mat, **_gen_kw(name))


@pytest.mark.parametrize("name", [n for n in EVERY_MINER if n != "batch_hard"])
@pytest.mark.parametrize(("k", "error"), [(0, ValueError), (-2, ValueError), (1.5, TypeError)])
def test_error_tuples_per_anchor(name, k, error):
    emb, labels = loss_data()
    with pytest.raises(error, match="tuples_per_anchor"):
        EVERY_MINER[name](emb, labels, tuples_per_anchor=k, generator=seed(0))


@pytest.mark.parametrize(("k", "error"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_error_tuples_per_anchor_batch_hard(k, error):
    emb, labels = loss_data()
    with pytest.raises(error, match="tuples_per_anchor"):
        miners.batch_hard(emb, labels, tuples_per_anchor=k)


def test_error_strategies():
    emb, labels = loss_data()
    with pytest.raises(ValueError, match="type_of_triplets"):
        miners.triplet_margin(emb, labels, type_of_triplets="semi-hard")
    with pytest.raises(ValueError, match="pos_strategy"):
        miners.batch_easy_hard(emb, labels, pos_strategy="hardest")
    with pytest.raises(ValueError, match="neg_strategy"):
        miners.batch_easy_hard(emb, labels, neg_strategy="medium")
    with pytest.raises(ValueError, match="semihard"):
        miners.batch_easy_hard(emb, labels, pos_strategy="semihard", neg_strategy="semihard")


@pytest.mark.parametrize(
    "call",
    [
        lambda x, y: miners.uniform_histogram(x, y),
        lambda x, y: miners.distance_weighted(x, y),
        lambda x, y: miners.triplet_margin(x, y, tuples_per_anchor=2),
        lambda x, y: miners.angular(x, y, tuples_per_anchor=2),
        lambda x, y: miners.pair_margin(x, y, tuples_per_anchor=2),
        lambda x, y: miners.multi_similarity(x, y, tuples_per_anchor=2),
    ],
)
def test_error_missing_generator(call):
    emb, labels = loss_data()
    with pytest.raises(ValueError, match="generator"):
        call(emb, labels)


@pytest.mark.parametrize(
    ("generator", "error"),
    [
        (7, TypeError),
        ("seed", TypeError),
        (torch.tensor(1.5), TypeError),
        (torch.tensor(True), TypeError),
        (torch.tensor(1 + 0j, dtype=torch.complex128), TypeError),
        (torch.tensor([1, 2]), ValueError),
    ],
)
def test_error_bad_generator(generator, error):
    emb, labels = loss_data()
    with pytest.raises(error, match="generator"):
        miners.distance_weighted(emb, labels, generator=generator)
    with pytest.raises(error, match="generator"):
        miners.triplet_margin(emb, labels, tuples_per_anchor=2, generator=generator)


def test_error_packaged_not_multiple_of_three():
    emb = torch.randn(10, 4, generator=seed(0), dtype=F64)
    with pytest.raises(ValueError, match="multiple of 3"):
        miners.embeddings_already_packaged_as_triplets(emb)


@pytest.mark.parametrize("fraction", [0, 0.0, 1.5, -0.2])
def test_error_hdc_filter_percentage(fraction):
    emb, labels = loss_data()
    with pytest.raises(ValueError, match="filter_percentage"):
        miners.hdc(emb, labels, filter_percentage=fraction)


def test_error_bad_ranges():
    emb, labels = loss_data()
    with pytest.raises(ValueError, match="allowed_pos_range"):
        miners.batch_easy_hard(emb, labels, allowed_pos_range=(0.1, 0.5, 0.9))


# ----------------------------------------------------------------------------------------------
# 9. chunked value and gradient on mined tuples
# ----------------------------------------------------------------------------------------------
CHUNK_CASES = {
    "batch_hard": lambda x, y: miners.batch_hard(x, y),
    "pair_margin": lambda x, y: miners.pair_margin(x, y, pos_margin=0.6, neg_margin=1.2),
    "window": lambda x, y: miners.triplet_margin(x, y, margin=0.2),
    "window_semihard": lambda x, y: miners.triplet_margin(
        x, y, margin=0.2, type_of_triplets="semihard"
    ),
    "angular": lambda x, y: miners.angular(x, y, angle=30),
    "triplet_k": lambda x, y: miners.triplet_margin(x, y, tuples_per_anchor=2, generator=seed(0)),
}


@pytest.mark.parametrize("loss", ["triplet_margin", "contrastive"])
@pytest.mark.parametrize("chunk_size", [5, 4])
@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunked_on_mined_equals_full(case, chunk_size, loss):
    fn = LOSSES[loss][0]
    emb, labels = loss_data()
    mined = CHUNK_CASES[case](emb, labels)
    want = value_and_grads(lambda x: fn(x, labels, indices_tuple=mined), emb)
    value, grad = pf.chunked.value_and_grad(fn, chunk_size=chunk_size)(
        emb, labels, indices_tuple=mined
    )
    assert want[0] != 0
    torch.testing.assert_close(value, want[0], **TOL64)
    torch.testing.assert_close(grad, want[1][0], **TOL64)
