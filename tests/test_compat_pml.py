"""``pmlfunc.compat.pml`` against pytorch-metric-learning 2.9.0 itself: for every compat class,
PML's class and the compat class are built with the same arguments, run on the same inputs
(float64 and float32) and compared on the value and the gradients of the embeddings and of
every parameter; the learnable losses' state dicts load into each other both ways (PML's names
and layouts) and a seeded construction draws PML's initial weights. Reference sets, mined
tuples from the compat miners (PML's tuples), every reducer, distance and regularizer. Every
compat loss, distance and reducer also runs on the meta device (built there, too)."""

from __future__ import annotations

import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from pytorch_metric_learning import regularizers as pml_regularizers

from pmlfunc.compat import pml
from pmlfunc.compat.pml import distances, losses, miners, reducers, regularizers

F64, F32 = torch.float64, torch.float32
B, M, D, C = 12, 9, 6, 4
TOL = {F64: {"rtol": 1e-9, "atol": 1e-11}, F32: {"rtol": 2e-4, "atol": 2e-5}}


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, D, generator=g, dtype=F64).to(dtype)
    labels = torch.arange(B) % C  # three rows a class
    ref = torch.randn(M, D, generator=g, dtype=F64).to(dtype)
    ref_labels = torch.arange(M) % C
    return emb, labels, ref, ref_labels


def run(loss, emb, *args, **kwargs):
    """The value and the gradients of the embeddings (and of a reference set and every
    parameter) of one call."""
    e = emb.clone().requires_grad_(True)
    extra = [kwargs["ref_emb"]] if kwargs.get("ref_emb") is not None else []
    if extra:
        extra[0] = extra[0].clone().requires_grad_(True)
        kwargs = {**kwargs, "ref_emb": extra[0]}
    value = loss(e, *args, **kwargs)
    params = [p for p in loss.parameters() if p.requires_grad]
    grads = torch.autograd.grad(value, [e, *extra, *params], allow_unused=True)
    return [value.detach(), *grads]


def assert_same(got, want, dtype):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None or (a == 0).all(), i
            continue
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, i=i: f"output {i}: {m}")


# ---------------------------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------------------------
# name -> (constructor kwargs, takes a reference set, takes indices_tuple)
BATCH = {
    "AngularLoss": ({}, True, True),
    "CircleLoss": ({}, True, True),
    "ContrastiveLoss": ({"pos_margin": 0.1, "neg_margin": 0.9}, True, True),
    "FastAPLoss": ({"num_bins": 6}, False, False),
    "GeneralizedLiftedStructureLoss": ({"neg_margin": 0.8}, True, True),
    "HistogramLoss": ({"n_bins": 8}, False, True),
    "InstanceLoss": ({"gamma": 16}, False, False),
    "IntraPairVarianceLoss": ({}, True, True),
    "LiftedStructureLoss": ({}, True, True),
    "MultiSimilarityLoss": ({"alpha": 2.0, "beta": 40.0}, True, True),
    "NCALoss": ({"softmax_scale": 2.0}, True, False),
    "NPairsLoss": ({}, False, True),
    "NTXentLoss": ({"temperature": 0.2}, True, True),
    "PNPLoss": ({"variant": "Dq"}, False, False),
    "RankedListLoss": ({"margin": 0.4, "Tn": 10.0}, False, False),
    "SignalToNoiseRatioContrastiveLoss": ({}, True, True),
    "SupConLoss": ({"temperature": 0.3}, True, True),
    "ThresholdConsistentMarginLoss": ({}, True, True),
    "TripletMarginLoss": ({}, True, True),  # PML 2.9.0's default margin 0.05
    "TupletMarginLoss": ({}, True, True),
    "MarginLoss": ({"nu": 0.1}, True, True),
}
# with a reference set PML 2.9.0 indexes the batch with reference indices (deliberate
# differences, docs/losses.md): pmlfunc's number, not PML's
DELIBERATE = ("LiftedStructureLoss", "ThresholdConsistentMarginLoss")
POSITIONAL = {"TripletMarginLoss": (0.3, True), "ContrastiveLoss": (0.05, 0.7)}


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("name", list(BATCH))
def test_batch_losses_equal_pmls(name, dtype):
    """Each batch loss: alone, against a reference set and with a miner's pairs or triplets."""
    kwargs, takes_ref, takes_tuple = BATCH[name]
    emb, labels, ref, ref_labels = inputs(dtype)
    ours = getattr(losses, name)(**kwargs).to(dtype)
    theirs = getattr(pml_losses, name)(**kwargs).to(dtype)
    calls = [{}]
    if takes_ref:
        calls.append({"ref_emb": ref, "ref_labels": ref_labels})
    if takes_tuple:
        mined = miners.TripletMarginMiner(margin=0.5)(emb, labels)
        if name in ("ContrastiveLoss", "GeneralizedLiftedStructureLoss", "NPairsLoss"):
            mined = miners.PairMarginMiner(0.3, 0.7)(emb, labels)
        calls.append({"indices_tuple": mined})
    for call in calls:
        if name in DELIBERATE and "ref_emb" in call:
            continue  # docs/losses.md, deliberate differences: PML indexes the batch there
        assert_same(run(ours, emb, labels, **call), run(theirs, emb, labels, **call), dtype)


@pytest.mark.parametrize("name", list(POSITIONAL))
def test_positional_arguments_are_pmls_order(name):
    emb, labels, _, _ = inputs(F64)
    args = POSITIONAL[name]
    ours, theirs = getattr(losses, name)(*args), getattr(pml_losses, name)(*args)
    assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)


def test_smooth_ap_equals_pmls():
    """SmoothAP needs as many rows per class as classes, in class order (PML's layout)."""
    emb = torch.randn(C * C, D, generator=torch.Generator().manual_seed(0), dtype=F64)
    labels = torch.arange(C).repeat_interleave(C)
    ours, theirs = losses.SmoothAPLoss(temperature=0.05), pml_losses.SmoothAPLoss(temperature=0.05)
    got, want = run(ours, emb, labels), run(theirs, emb, labels)
    assert got[0].dtype == F64  # PML returns float32 here: compare at its precision
    assert_same([g.float() for g in got], [w.float() for w in want], F32)


def test_vicreg_and_self_supervised_equal_pmls():
    emb, _, ref, _ = inputs(F64)
    ref = ref[: emb.shape[0] - 3].repeat(2, 1)[:B]
    vic = (losses.VICRegLoss(variance_mu=20.0), pml_losses.VICRegLoss(variance_mu=20.0))
    assert_same(run(vic[0], emb, ref_emb=ref), run(vic[1], emb, ref_emb=ref), F64)
    ours = losses.SelfSupervisedLoss(losses.NTXentLoss(temperature=0.2), symmetric=True)
    theirs = pml_losses.SelfSupervisedLoss(pml_losses.NTXentLoss(temperature=0.2))
    assert_same(run(ours, emb, ref_emb=ref), run(theirs, emb, ref_emb=ref), F64)


def test_dynamic_soft_margin_updates_its_histogram_like_pml():
    """Three calls: the same values each time, the histogram carried in the module."""
    ours, theirs = (
        losses.DynamicSoftMarginLoss(num_bins=8),
        pml_losses.DynamicSoftMarginLoss(num_bins=8),
    )
    ours, theirs = ours.to(F64), theirs
    for seed in range(3):
        emb, labels, _, _ = inputs(F64, seed)
        assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)
    torch.testing.assert_close(ours.hist_, theirs.hist_.to(F64), rtol=1e-9, atol=1e-12)
    assert "hist_" not in ours.state_dict()  # as in PML: not a parameter, not persistent


# name -> (PML's constructor args, extra kwargs, PML's parameter names)
LEARNABLE = {
    "ArcFaceLoss": ((C, D), {"margin": 20.0, "scale": 8.0}, ["W"]),
    "CosFaceLoss": ((C, D), {"scale": 8.0}, ["W"]),
    "SphereFaceLoss": ((C, D), {"margin": 3}, ["W"]),
    "LargeMarginSoftmaxLoss": ((C, D), {"margin": 2, "scale": 2.0}, ["W"]),
    # PML's SubCenterArcFaceLoss takes its sizes by keyword only
    "SubCenterArcFaceLoss": (
        (),
        {"num_classes": C, "embedding_size": D, "scale": 8.0, "sub_centers": 2},
        ["W"],
    ),
    "NormalizedSoftmaxLoss": ((C, D), {"temperature": 0.3}, ["W"]),
    "ProxyAnchorLoss": ((C, D), {"alpha": 16.0}, ["proxies"]),
    "ProxyNCALoss": ((C, D), {"softmax_scale": 3.0}, ["proxies"]),
    "SoftTripleLoss": ((C, D), {"centers_per_class": 3, "la": 8.0, "gamma": 0.3}, ["fc"]),
    "P2SGradLoss": ((D, C), {}, ["weight"]),
    "MarginLoss": ((), {"learn_beta": True, "num_classes": C}, ["beta"]),
}


def test_margin_loss_with_a_fixed_beta_has_pmls_empty_state():
    """``MarginLoss()`` (``learn_beta=False``): ``beta`` a plain tensor as in PML, no parameter
    and no state_dict entry, so a checkpoint loads strictly both ways (a frozen parameter here
    made each side's load fail on ``beta``)."""
    emb, labels, _, _ = inputs(F64)
    theirs, ours = pml_losses.MarginLoss().double(), losses.MarginLoss().double()
    assert list(ours.state_dict()) == list(theirs.state_dict()) == []
    assert list(ours.parameters()) == list(theirs.parameters()) == []
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("name", list(LEARNABLE))
def test_learnable_losses_equal_pmls_with_each_others_state(name, dtype):
    """PML's state dict loads into the compat module (strict: the same names and shapes), and
    both give the same value and gradients, the parameters' included."""
    args, kwargs, names = LEARNABLE[name]
    emb, labels, _, _ = inputs(dtype)
    theirs = getattr(pml_losses, name)(*args, **kwargs).to(dtype)
    ours = getattr(losses, name)(*args, **kwargs).to(dtype)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == sorted(names)
    theirs.load_state_dict(ours.state_dict())  # ours into PML (strict) ...
    for key, value in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[key], value)
    theirs = getattr(pml_losses, name)(*args, **kwargs).to(dtype)
    ours.load_state_dict(theirs.state_dict())  # ... and PML's into ours
    assert_same(run(ours, emb, labels), run(theirs, emb, labels), dtype)
    if name not in ("P2SGradLoss", "MarginLoss"):  # PML: no indices_tuple / the same triplets
        mined = miners.MultiSimilarityMiner()(emb, labels)
        call = {"indices_tuple": mined}
        assert_same(run(ours, emb, labels, **call), run(theirs, emb, labels, **call), dtype)


@pytest.mark.parametrize("name", [n for n in LEARNABLE if n != "MarginLoss"])
def test_a_seeded_construction_draws_pmls_initial_weights(name):
    args, kwargs, names = LEARNABLE[name]
    torch.manual_seed(3)
    theirs = getattr(pml_losses, name)(*args, **kwargs)
    torch.manual_seed(3)
    ours = getattr(losses, name)(*args, **kwargs)
    for key in names:
        torch.testing.assert_close(ours.state_dict()[key], theirs.state_dict()[key], rtol=0, atol=0)


@pytest.mark.parametrize(
    "name", ["ArcFaceLoss", "CosFaceLoss", "SphereFaceLoss", "LargeMarginSoftmaxLoss",
             "SubCenterArcFaceLoss", "NormalizedSoftmaxLoss", "ProxyAnchorLoss"],
)  # fmt: skip
def test_get_logits_are_pmls(name):
    args, kwargs, _ = LEARNABLE[name]
    emb, _, _, _ = inputs(F64)
    theirs = getattr(pml_losses, name)(*args, **kwargs).to(F64)
    ours = getattr(losses, name)(*args, **kwargs).to(F64)
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours.get_logits(emb), theirs.get_logits(emb), rtol=1e-10, atol=0)


def test_sub_center_get_outliers_is_pmls():
    sizes = {"num_classes": C, "embedding_size": D, "sub_centers": 3}
    ours = losses.SubCenterArcFaceLoss(**sizes).to(F64)
    theirs = pml_losses.SubCenterArcFaceLoss(**sizes).to(F64)
    ours.load_state_dict(theirs.state_dict())
    emb, labels, _, _ = inputs(F64)
    got_idx, got_centres = ours.get_outliers(emb, labels, threshold=60)
    want_idx, want_centres = theirs.get_outliers(emb, labels, threshold=60)
    assert sorted(got_idx.tolist()) == sorted(want_idx.tolist())
    torch.testing.assert_close(got_centres, want_centres, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# distances, reducers, regularizers through a loss
# ---------------------------------------------------------------------------------------------
DISTANCES = [
    ("LpDistance", {}),
    ("LpDistance", {"p": 1, "power": 2}),
    ("LpDistance", {"normalize_embeddings": False}),
    ("CosineSimilarity", {}),
    ("DotProductSimilarity", {}),  # PML 2.9.0 normalises: so does the compat class
    ("DotProductSimilarity", {"normalize_embeddings": False}),
    ("SNRDistance", {}),
]


@pytest.mark.parametrize(("name", "kwargs"), DISTANCES)
def test_distances_equal_pmls_alone_and_in_a_loss(name, kwargs):
    emb, labels, ref, _ = inputs(F64)
    ours, theirs = getattr(distances, name)(**kwargs), getattr(pml_distances, name)(**kwargs)
    torch.testing.assert_close(ours(emb), theirs(emb), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours(emb, ref), theirs(emb, ref), rtol=1e-10, atol=1e-12)
    loss = losses.ContrastiveLoss(distance=ours)
    pml_loss = pml_losses.ContrastiveLoss(distance=getattr(pml_distances, name)(**kwargs))
    assert_same(run(loss, emb, labels), run(pml_loss, emb, labels), F64)


REDUCERS = [
    ("MeanReducer", ()),
    ("AvgNonZeroReducer", ()),
    ("SumReducer", ()),
    ("ThresholdReducer", (0.05, 0.9)),
    ("DivisorReducer", ()),
    ("PerAnchorReducer", ()),
    ("ClassWeightedReducer", (torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=F64),)),
]


@pytest.mark.parametrize("loss_name", ["ContrastiveLoss", "TripletMarginLoss", "ArcFaceLoss"])
@pytest.mark.parametrize(("name", "args"), REDUCERS)
def test_each_reducer_equals_pmls(name, args, loss_name):
    """A pair loss, a triplet loss and a classifier loss (elements) with each reducer."""
    if name == "DivisorReducer" or (name == "PerAnchorReducer" and loss_name == "ArcFaceLoss"):
        pytest.skip("PML 2.9.0: DivisorReducer needs a loss that supplies divisors")
    if name == "PerAnchorReducer" and loss_name == "TripletMarginLoss":
        pytest.skip(
            "PML 2.9.0 raises NotImplementedError (deliberate differences: pmlfunc reduces)"
        )
    emb, labels, _, _ = inputs(F64)
    sizes = (C, D) if loss_name == "ArcFaceLoss" else ()
    ours = getattr(losses, loss_name)(*sizes, reducer=getattr(reducers, name)(*args)).to(F64)
    theirs = getattr(pml_losses, loss_name)(*sizes, reducer=getattr(pml_reducers, name)(*args)).to(
        F64
    )
    if sizes:
        ours.load_state_dict(theirs.state_dict())
    assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)


def test_regularizers_equal_pmls():
    emb, labels, _, _ = inputs(F64)
    for ours_reg, pml_reg in (
        (regularizers.LpRegularizer(p=1), pml_regularizers.LpRegularizer(p=1)),
        (regularizers.ZeroMeanRegularizer(), pml_regularizers.ZeroMeanRegularizer()),
    ):
        ours = losses.ContrastiveLoss(embedding_regularizer=ours_reg, embedding_reg_weight=0.3)
        theirs = pml_losses.ContrastiveLoss(embedding_regularizer=pml_reg, embedding_reg_weight=0.3)
        assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)
    for ours_reg, pml_reg in (
        (regularizers.RegularFaceRegularizer(), pml_regularizers.RegularFaceRegularizer()),
        (regularizers.CenterInvariantRegularizer(), pml_regularizers.CenterInvariantRegularizer()),
    ):
        theirs = pml_losses.ArcFaceLoss(C, D, weight_regularizer=pml_reg).to(F64)
        ours = losses.ArcFaceLoss(C, D, weight_regularizer=ours_reg).to(F64)
        ours.load_state_dict(theirs.state_dict())
        assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)


# ---------------------------------------------------------------------------------------------
# miners
# ---------------------------------------------------------------------------------------------
MINERS = {
    "MultiSimilarityMiner": {"epsilon": 0.2},
    "PairMarginMiner": {"pos_margin": 0.4, "neg_margin": 0.6},
    "TripletMarginMiner": {"margin": 0.3, "type_of_triplets": "semihard"},
    "BatchHardMiner": {},
    "BatchEasyHardMiner": {"pos_strategy": "hard", "neg_strategy": "hard"},
    "AngularMiner": {"angle": 30},
    "HDCMiner": {"filter_percentage": 0.4},
}


def _rows(indices):
    """A mined tuple as sorted lists of its rows: the triplets, or the positive and the
    negative pairs (the order is not PML's: docs/miners.md)."""
    groups = [indices] if len(indices) == 3 else [indices[:2], indices[2:]]
    return [sorted(zip(*(t.tolist() for t in g), strict=True)) for g in groups]


@pytest.mark.parametrize("ref", [False, True])
@pytest.mark.parametrize("name", list(MINERS))
def test_deterministic_miners_return_pmls_tuples(name, ref):
    emb, labels, ref_emb, ref_labels = inputs(F64, seed=1)
    call = {"ref_emb": ref_emb, "ref_labels": ref_labels} if ref else {}
    if ref and name == "HDCMiner":
        pytest.skip("HDC with a reference set: covered by test_miners")
    ours = getattr(miners, name)(**MINERS[name])(emb, labels, **call)
    theirs = getattr(pml_miners, name)(**MINERS[name])(emb, labels, **call)
    assert len(ours) == len(theirs)
    assert _rows(ours) == _rows(theirs)


def test_embeddings_already_packaged_as_triplets_is_pmls():
    emb, labels, _, _ = inputs(F64)
    ours = miners.EmbeddingsAlreadyPackagedAsTriplets()(emb, labels)
    theirs = pml_miners.EmbeddingsAlreadyPackagedAsTriplets()(emb, labels)
    assert _rows(ours) == _rows(theirs)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("DistanceWeightedMiner", {"cutoff": 0.5}), ("UniformHistogramMiner", {"num_bins": 5})],
)
def test_stochastic_miners_return_valid_tuples_of_pmls_kind(name, kwargs):
    """Different samples from PML's (counter-based draws): the same kind of tuple, every
    positive a same-label pair and every negative a different-label one."""
    emb, labels, _, _ = inputs(F64)
    ours = getattr(miners, name)(**kwargs)(emb, labels)
    theirs = getattr(pml_miners, name)(**kwargs)(emb, labels)
    assert len(ours) == len(theirs)
    if len(ours) == 3:
        a, p, n = ours
        assert (labels[a] == labels[p]).all() and (labels[a] != labels[n]).all()
    else:
        a1, p, a2, n = ours
        assert (labels[a1] == labels[p]).all() and (labels[a2] != labels[n]).all()


# ---------------------------------------------------------------------------------------------
# the module layer itself
# ---------------------------------------------------------------------------------------------
def test_every_class_pml_has_is_here_or_listed_as_not_provided():
    """The compat modules hold PML 2.9.0's classes by name, less the documented gaps."""
    not_provided = {"BatchedDistance", "MultipleReducers", "BaseDistance", "BaseReducer"}
    for ours, theirs in (
        (losses, pml_losses), (miners, pml_miners), (distances, pml_distances),
        (reducers, pml_reducers), (regularizers, pml_regularizers),
    ):  # fmt: skip
        names = {
            n for n in dir(theirs)
            if isinstance(getattr(theirs, n), type) and not n.startswith(("Base", "Generic"))
            and "Mixin" not in n
        }  # fmt: skip
        missing = names - set(ours.__all__) - not_provided
        assert not missing, (theirs.__name__, missing)
    assert pml.__all__ == [
        "distances", "losses", "miners", "reducers", "regularizers", "samplers", "utils", "wrappers",
    ]  # fmt: skip


def test_pml_arguments_are_checked_like_pmls_constructors():
    with pytest.raises(TypeError, match="unexpected keyword argument 'margn'"):
        losses.TripletMarginLoss(margn=0.1)
    with pytest.raises(TypeError, match="at most 4 positional"):
        losses.TripletMarginLoss(0.1, False, False, "all", 3)
    with pytest.raises(TypeError, match="missing required argument"):
        losses.ArcFaceLoss(num_classes=3)
    with pytest.raises(ValueError, match="triplets_per_anchor"):
        losses.TripletMarginLoss(triplets_per_anchor=5)(*inputs(F64)[:2])


# (class, attribute path, value set after construction): PML reads its attributes at every
# call; the compat objects took only the constructor's arguments and defaults into account (a
# temperature schedule, a swapped reducer or distance silently kept the old one)
AFTER_CONSTRUCTION = [
    ("TripletMarginLoss", "margin", 0.4),
    ("NTXentLoss", "temperature", 0.5),
    ("SupConLoss", "temperature", 0.5),
    ("ContrastiveLoss", "neg_margin", 0.5),
    ("MultiSimilarityLoss", "base", 0.8),
    ("TripletMarginLoss", "swap", True),
    ("CircleLoss", "gamma", 32),
    ("TupletMarginLoss", "scale", 16),
    ("ContrastiveLoss", "distance", "CosineSimilarity"),
    ("TripletMarginLoss", "reducer", "MeanReducer"),
    ("ContrastiveLoss", "embedding_regularizer", "LpRegularizer"),
    ("ContrastiveLoss", "distance.power", 2),
    ("ContrastiveLoss", "distance.normalize_embeddings", False),
    # PML's own units: radians (constructor: degrees), 1/γ
    ("ArcFaceLoss", "margin", 0.1745),
    ("TupletMarginLoss", "margin", 0.1745),
    ("AngularLoss", "alpha", torch.tensor(0.7854, dtype=F64)),  # PML's tan() needs a tensor
    ("SoftTripleLoss", "gamma", 20.0),
]


def _pair_after_construction(name):
    """PML's and the compat class built alike (learnable ones with PML's parameters copied)."""
    kwargs = {"distance": "LpDistance"} if name == "ContrastiveLoss" else {}
    if name in ("ArcFaceLoss", "SoftTripleLoss"):
        kwargs = {"num_classes": C, "embedding_size": D}
    if name == "AngularLoss":
        kwargs = {"alpha": 40}

    def build(lib, dist):
        made = {k: getattr(dist, v)() if k == "distance" else v for k, v in kwargs.items()}
        return getattr(lib, name)(**made)

    theirs, ours = build(pml_losses, pml_distances), build(losses, distances)
    if list(theirs.parameters()):
        theirs, ours = theirs.to(F64), ours.to(F64)
        ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize(("name", "path", "value"), AFTER_CONSTRUCTION, ids=lambda v: str(v))
def test_an_attribute_set_after_construction_takes_effect_as_in_pml(name, path, value):
    emb, labels, _, _ = inputs(F64)
    ours, theirs = _pair_after_construction(name)
    assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)  # before
    *owner, attr = path.split(".")
    for obj, lib in ((ours, pml), (theirs, None)):
        target = obj
        for part in owner:
            target = getattr(target, part)
        if isinstance(value, str):  # a class of the same family, each library's own
            family = {"CosineSimilarity": "distances", "MeanReducer": "reducers"}.get(
                value, "regularizers"
            )
            mod = (
                getattr(pml, family)
                if lib is pml
                else {
                    "distances": pml_distances,
                    "reducers": pml_reducers,
                    "regularizers": pml_regularizers,
                }[family]
            )
            setattr(target, attr, getattr(mod, value)())
        else:
            setattr(target, attr, value)
    if not owner and not isinstance(value, str):
        # the attribute itself reads as PML's (its units: radians, 1/γ)
        torch.testing.assert_close(
            torch.as_tensor(getattr(ours, attr), dtype=F64),
            torch.as_tensor(getattr(theirs, attr), dtype=F64),
        )
    assert_same(run(ours, emb, labels), run(theirs, emb, labels), F64)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("ArcFaceLoss", {"num_classes": C, "embedding_size": D, "margin": 20.0}),
        ("SubCenterArcFaceLoss", {"num_classes": C, "embedding_size": D}),
        ("TupletMarginLoss", {"margin": 5.73}),
        ("AngularLoss", {"alpha": 45}),
        ("SoftTripleLoss", {"num_classes": C, "embedding_size": D, "gamma": 0.1}),
    ],
)
def test_attributes_read_in_pmls_units(name, kwargs):
    """PML converts some arguments when it stores them (a margin in degrees to radians, γ to
    ``1/γ``): a logged or scheduled attribute means what it means in PML."""
    ours, theirs = getattr(losses, name)(**kwargs), getattr(pml_losses, name)(**kwargs)
    attr = "alpha" if name == "AngularLoss" else "gamma" if name == "SoftTripleLoss" else "margin"
    torch.testing.assert_close(
        torch.as_tensor(getattr(ours, attr), dtype=F64),
        torch.as_tensor(getattr(theirs, attr), dtype=F64),
    )


def _tuples(mined):
    """A miner's result as sorted lists of its pairs (``(a1, p)``, ``(a2, n)``) or triplets."""
    lists = [t.tolist() for t in mined]
    groups = [lists[:2], lists[2:]] if len(lists) == 4 else [lists]
    return [sorted(zip(*g, strict=True)) for g in groups]


def test_a_miners_and_a_self_supervised_wrappers_attributes_set_later_take_effect():
    emb, labels, _, _ = inputs(F64)
    for name, attr, value in (
        ("MultiSimilarityMiner", "epsilon", 0.5),
        ("TripletMarginMiner", "margin", 0.05),
        ("TripletMarginMiner", "type_of_triplets", "hard"),
        ("AngularMiner", "angle", 0.5236),  # radians, as PML holds it
    ):
        ours, theirs = getattr(miners, name)(), getattr(pml_miners, name)()
        setattr(ours, attr, value)
        setattr(theirs, attr, value)
        got, want = ours(emb, labels), theirs(emb, labels)
        assert _tuples(got) == _tuples(want), (name, attr)
    ours = losses.SelfSupervisedLoss(losses.NTXentLoss())
    theirs = pml_losses.SelfSupervisedLoss(pml_losses.NTXentLoss())
    ours.symmetric = theirs.symmetric = False
    ref = emb.flip(1)
    torch.testing.assert_close(ours(emb, ref), theirs(emb, ref), rtol=1e-9, atol=1e-11)


def _built(name):
    if name in LEARNABLE:
        args, kwargs, _ = LEARNABLE[name]
        return getattr(losses, name)(*args, **kwargs)
    return getattr(losses, name)(**BATCH[name][0])


@pytest.mark.parametrize("name", sorted({*BATCH, *LEARNABLE}))
def test_every_compat_loss_compiles_with_fullgraph(name):
    """The module adds nothing that breaks a graph: compiled (full graph, aot_eager) it gives
    the eager value and gradients."""
    emb, labels, _, _ = inputs(F32)
    loss = _built(name)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    assert_same(run(compiled, emb, labels), run(loss, emb, labels), F32)
    torch._dynamo.reset()


def test_manifold_draws_from_the_global_rng_repeatably():
    """PML draws ManifoldLoss's meta-classes from the global RNG: so does the compat class
    (a seed for the function's generator), so a seeded call repeats (PML's samples differ)."""
    emb, _, _, _ = inputs(F64)
    loss = losses.ManifoldLoss(D, K=5).to(F64)
    values = []
    for _ in range(2):
        torch.manual_seed(7)
        values.append(loss(emb))
    assert values[0] == values[1] and values[0].isfinite()
    with pytest.raises(ValueError, match="labels"):
        loss(emb, torch.zeros(B, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# the meta device: static shapes, no host sync, modules built there without storage. Miners are
# left out: they return index tuples whose length depends on the data, which meta cannot know.
# ---------------------------------------------------------------------------------------------
META = torch.device("meta")
# the compat losses outside BATCH and LEARNABLE: (constructor, what a call takes)
META_OTHERS = {
    "CrossBatchMemory": (lambda: losses.CrossBatchMemory(losses.NTXentLoss(), D, 16), "labels"),
    "DynamicSoftMarginLoss": (lambda: losses.DynamicSoftMarginLoss(num_bins=8), "labels"),
    "ManifoldLoss": (lambda: losses.ManifoldLoss(D, K=5), "embeddings"),
    "MultipleLosses": (
        lambda: losses.MultipleLosses([losses.NTXentLoss(), losses.ContrastiveLoss()]),
        "labels",
    ),
    "SelfSupervisedLoss": (lambda: losses.SelfSupervisedLoss(losses.NTXentLoss()), "ref_emb"),
    "SmoothAPLoss": (lambda: losses.SmoothAPLoss(temperature=0.05), "labels"),
    "VICRegLoss": (lambda: losses.VICRegLoss(), "ref_emb"),
}


def test_the_meta_table_holds_every_compat_loss():
    assert {*BATCH, *LEARNABLE, *META_OTHERS} == set(losses.__all__)


@pytest.mark.parametrize("dtype", [F64, F32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(losses.__all__))
def test_every_compat_loss_runs_on_the_meta_device(name, dtype):
    """Built inside ``with torch.device("meta")`` (its parameters and buffers on meta), called on
    meta embeddings and labels: a 0-d meta loss (float32 for bfloat16 inputs), and a backward
    that gives the embeddings (and every parameter) a meta gradient."""
    with META:
        loss = (_built(name) if name not in META_OTHERS else META_OTHERS[name][0]()).to(dtype)
        rows = C * C if name == "SmoothAPLoss" else B  # SmoothAP: C rows a class, in order
        emb = torch.randn(rows, D, dtype=dtype, requires_grad=True)
        labels = torch.arange(rows) // C if name == "SmoothAPLoss" else torch.arange(B) % C
        other = torch.randn(rows, D, dtype=dtype)
    assert all(t.device == META for t in [*loss.parameters(), *loss.buffers()])
    takes = META_OTHERS[name][1] if name in META_OTHERS else "labels"
    if takes == "labels":
        value = loss(emb, labels)
    elif takes == "ref_emb":
        value = loss(emb, ref_emb=other)
    else:
        value = loss(emb)
    assert value.device == META and value.shape == ()
    assert value.dtype == (F32 if dtype == torch.bfloat16 else dtype)
    value.backward()
    assert emb.grad is not None and emb.grad.device == META and emb.grad.shape == emb.shape
    for p in loss.parameters():
        assert not p.requires_grad or p.grad is None or p.grad.device == META


@pytest.mark.parametrize(("name", "kwargs"), DISTANCES)
def test_compat_distances_run_on_the_meta_device(name, kwargs):
    dist = getattr(distances, name)(**kwargs)
    emb, ref = torch.randn(B, D, device=META), torch.randn(M, D, device=META)
    assert dist(emb).shape == (B, B) and dist(emb).device == META
    assert dist(emb, ref).shape == (B, M) and dist(emb, ref).device == META


@pytest.mark.parametrize("loss_name", ["ContrastiveLoss", "TripletMarginLoss", "ArcFaceLoss"])
@pytest.mark.parametrize(("name", "args"), REDUCERS)
def test_compat_reducers_run_on_the_meta_device(name, args, loss_name):
    if name == "DivisorReducer":
        pytest.skip(
            "only MarginLoss supplies divisors (its default reducer: the meta test of every "
            "loss runs it); these losses raise ValueError on every device alike"
        )
    args = tuple(a.to(META) if isinstance(a, torch.Tensor) else a for a in args)
    with META:
        sizes = (C, D) if loss_name == "ArcFaceLoss" else ()
        loss = getattr(losses, loss_name)(*sizes, reducer=getattr(reducers, name)(*args))
        emb = torch.randn(B, D, requires_grad=True)
        value = loss(emb, torch.arange(B) % C)
    assert value.device == META and value.shape == ()
    value.backward()
    assert emb.grad is not None and emb.grad.device == META
