"""``pmlfunc.compat.pml``'s wrappers, samplers and ``AccuracyCalculator`` against
pytorch-metric-learning 2.9.0 itself, on the same inputs.

- ``CrossBatchMemory``: values and embedding gradients equal PML's at every step while the
  memory fills and wraps around (float64), with no miner, a threshold miner and a per-anchor
  miner (equal once the memory is full: documented), for ``ContrastiveLoss`` and
  ``NTXentLoss``; the buffers, ``queue_idx`` and ``has_been_filled`` equal PML's; PML's state
  dict loads (both ways) and the next steps agree.
- ``MultipleLosses``: lists and dicts, weights, miners, a learnable sub-loss (its state dict
  names and gradients), a given ``indices_tuple``.
- Samplers: PML draws from NumPy's global generator and pmlfunc from torch's, so the index
  sequences are not PML's for any seed; here each compat sampler has PML's constructor
  (positional order), PML's ``len()`` and valid batches of PML's kind; ``TuplesToWeightsSampler``
  computes PML's weights exactly (deterministic miner, whole dataset) and draws only where they
  are positive.
- ``AccuracyCalculator``: every key equal to PML's ``AccuracyCalculator(knn_func=CustomKNN(
  CosineSimilarity()), kmeans_func=<pmlfunc's kmeans>)`` (PML without faiss needs both): same
  set and separate reference, ``ref_includes_query``, each ``k`` mode, ``avg_of_avgs``,
  ``return_per_class``, ``include``/``exclude``, a custom ``label_comparison_fn``, lone queries.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import samplers as pml_samplers
from pytorch_metric_learning.utils.accuracy_calculator import (
    AccuracyCalculator as PMLAccuracyCalculator,
)
from pytorch_metric_learning.utils.inference import CustomKNN
from torch.utils.data import TensorDataset

import pmlfunc as pf
from pmlfunc.compat import pml
from pmlfunc.compat.pml import distances, losses, miners, samplers, wrappers
from pmlfunc.compat.pml.utils import AccuracyCalculator
from pmlfunc.compat.pml.utils import accuracy_calculator as accuracy_module

F64 = torch.float64
D, S, B = 5, 20, 6  # 6-row batches through 20 slots: full at step 4, wrapping around
TOL = {"rtol": 1e-10, "atol": 1e-12}


def steps(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(B, D, generator=g, dtype=F64), torch.randint(0, 4, (B,), generator=g)


def value_and_grad(loss, emb, *args):
    e = emb.clone().requires_grad_(True)
    value = loss(e, *args)
    params = [p for p in loss.parameters() if p.requires_grad]
    return [value.detach(), *torch.autograd.grad(value, [e, *params])]


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------------------------------------
# CrossBatchMemory
# ---------------------------------------------------------------------------------------------
LOSSES = {"ContrastiveLoss": {"pos_margin": 0.1, "neg_margin": 0.8}, "NTXentLoss": {"temperature": 0.2}}  # fmt: skip
MINERS = {  # name -> (constructor args, first step compared)
    None: ((), 0),
    "PairMarginMiner": ((0.3, 0.7), 0),  # a threshold: equal from the first step
    "MultiSimilarityMiner": ((0.1,), 4),  # per anchor: equal once the memory is full (docs)
}


def memory_pair(loss_name, miner_name):
    def build(lib_losses, lib_miners):
        miner = None
        if miner_name is not None:
            miner = getattr(lib_miners, miner_name)(*MINERS[miner_name][0])
        loss = getattr(lib_losses, loss_name)(**LOSSES[loss_name])
        return lib_losses.CrossBatchMemory(loss, D, memory_size=S, miner=miner)

    return build(losses, miners).to(F64), build(pml_losses, pml_miners).to(F64)


def assert_same_memory(ours, theirs):
    torch.testing.assert_close(ours.embedding_memory, theirs.embedding_memory, rtol=0, atol=0)
    assert torch.equal(ours.label_memory, theirs.label_memory)
    assert ours.queue_idx == theirs.queue_idx
    assert ours.has_been_filled == theirs.has_been_filled


@pytest.mark.parametrize("miner_name", list(MINERS))
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_cross_batch_memory_equals_pmls_over_steps(loss_name, miner_name):
    ours, theirs = memory_pair(loss_name, miner_name)
    first = MINERS[miner_name][1]
    for step, (emb, labels) in enumerate(steps(9)):  # 54 rows through 20 slots
        got, want = value_and_grad(ours, emb, labels), value_and_grad(theirs, emb, labels)
        if step >= first:
            assert_same(got, want)
        assert_same_memory(ours, theirs)
    assert ours.has_been_filled and ours.queue_idx == 54 % S


def test_cross_batch_memory_loads_pmls_state_and_continues():
    """PML's state dict (the two buffers) loads strictly; the queue position is PML's
    attributes, not in its state dict, and is set the same way; PML loads ours back."""
    ours, theirs = memory_pair("NTXentLoss", "PairMarginMiner")
    data = list(steps(7, seed=3))
    for emb, labels in data[:2]:  # 12 of 20 slots: not yet full
        theirs(emb, labels)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    ours.queue_idx, ours.has_been_filled = theirs.queue_idx, theirs.has_been_filled
    assert_same_memory(ours, theirs)
    for emb, labels in data[2:5]:  # fills and wraps around
        assert_same(value_and_grad(ours, emb, labels), value_and_grad(theirs, emb, labels))
    assert_same_memory(ours, theirs)
    fresh = pml_losses.CrossBatchMemory(pml_losses.NTXentLoss(temperature=0.2), D, S).to(F64)
    fresh.miner = pml_miners.PairMarginMiner(0.3, 0.7)
    fresh.load_state_dict(ours.state_dict())
    fresh.queue_idx, fresh.has_been_filled = ours.queue_idx, ours.has_been_filled
    for emb, labels in data[5:]:
        assert_same(value_and_grad(ours, emb, labels), value_and_grad(fresh, emb, labels))


def test_cross_batch_memory_takes_pmlfunc_functions_and_follows_the_dtype():
    """A pmlfunc loss function (and miner function) in place of the compat classes; the
    memory is created float32, as PML's, and follows the embeddings' dtype at the first call;
    reset_queue empties it."""
    ours = losses.CrossBatchMemory(pf.losses.contrastive, D, S, pf.miners.pair_margin)
    theirs = pml_losses.CrossBatchMemory(
        pml_losses.ContrastiveLoss(), D, S, pml_miners.PairMarginMiner()
    )
    assert ours.embedding_memory.dtype == torch.float32
    for emb, labels in steps(5):
        assert_same(value_and_grad(ours, emb, labels), value_and_grad(theirs, emb, labels))
    assert ours.embedding_memory.dtype == F64
    assert_same_memory(ours, theirs)
    ours.reset_queue()
    assert ours.queue_idx == 0 and not ours.has_been_filled
    assert not ours.embedding_memory.any()


def test_cross_batch_memory_rejects_what_it_does_not_provide():
    emb, labels = next(steps(1))
    memory = losses.CrossBatchMemory(losses.ContrastiveLoss(), D, S)
    with pytest.raises(ValueError, match="enqueue_mask"):
        memory(emb, labels, enqueue_mask=torch.ones(B, dtype=torch.bool))
    with pytest.raises(ValueError, match="indices_tuple"):
        memory(emb, labels, indices_tuple=miners.BatchHardMiner()(emb, labels))
    with pytest.raises(ValueError, match="mutually exclusive"):
        memory(emb, labels, miners.BatchHardMiner()(emb, labels), torch.ones(B, dtype=torch.bool))
    with pytest.raises(ValueError, match="not supported for ArcFaceLoss"):
        losses.CrossBatchMemory(losses.ArcFaceLoss(4, D), D)
    with pytest.raises(TypeError, match="PML's ContrastiveLoss"):
        losses.CrossBatchMemory(pml_losses.ContrastiveLoss(), D)
    with pytest.raises(TypeError, match="PML's BatchHardMiner"):
        losses.CrossBatchMemory(losses.ContrastiveLoss(), D, miner=pml_miners.BatchHardMiner())
    with pytest.raises(TypeError, match="missing required argument"):
        losses.CrossBatchMemory(losses.ContrastiveLoss())
    with pytest.raises(ValueError, match="larger than the memory"):
        losses.CrossBatchMemory(losses.ContrastiveLoss(), D, 4)(emb, labels)
    assert losses.CrossBatchMemory.supported_losses() == (
        pml_losses.CrossBatchMemory.supported_losses()
    )
    assert losses.CrossBatchMemory is wrappers.CrossBatchMemory
    assert losses.MultipleLosses is wrappers.MultipleLosses


# ---------------------------------------------------------------------------------------------
# MultipleLosses
# ---------------------------------------------------------------------------------------------
def _batch(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=F64), torch.arange(n) % 4


def test_multiple_losses_with_a_dict_weights_and_miners_equal_pmls():
    def build(lib_losses, lib_miners):
        return lib_losses.MultipleLosses(
            {"tri": lib_losses.TripletMarginLoss(0.2), "con": lib_losses.ContrastiveLoss(),
             "ms": lib_losses.MultiSimilarityLoss()},
            miners={"tri": lib_miners.BatchHardMiner(), "ms": lib_miners.MultiSimilarityMiner()},
            weights={"tri": 1.0, "con": 0.5, "ms": 2.0},
        )  # fmt: skip

    emb, labels = _batch()
    ours, theirs = build(losses, miners), build(pml_losses, pml_miners)
    assert_same(value_and_grad(ours, emb, labels), value_and_grad(theirs, emb, labels))
    with pytest.raises(ValueError, match="indices_tuple cannot be given"):
        ours(emb, labels, miners.BatchHardMiner()(emb, labels))


def test_multiple_losses_with_a_list_a_learnable_loss_and_an_indices_tuple_equal_pmls():
    """A list with a ``None`` miner and the default weights, then without miners and with an
    ``indices_tuple``; ArcFace's ``W`` under PML's name ``losses.1.W``, loaded from PML."""

    def build(lib_losses, lib_miners, with_miners):
        sub = [lib_losses.NTXentLoss(0.3), lib_losses.ArcFaceLoss(4, D, scale=8.0)]
        found = [lib_miners.PairMarginMiner(0.3, 0.7), None] if with_miners else None
        return lib_losses.MultipleLosses(sub, found).to(F64)

    emb, labels = _batch(1)
    for with_miners in (True, False):
        ours = build(losses, miners, with_miners)
        theirs = build(pml_losses, pml_miners, with_miners)
        assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == ["losses.1.W"]
        ours.load_state_dict(theirs.state_dict())
        call = () if with_miners else (miners.TripletMarginMiner(0.5)(emb, labels),)
        got = value_and_grad(ours, emb, labels, *call)
        assert_same(got, value_and_grad(theirs, emb, labels, *call))
        assert len(got) == 3  # the value, the embeddings' and W's gradients
    weighted = losses.MultipleLosses([losses.NTXentLoss(0.3)], weights=[0.25])
    torch.testing.assert_close(weighted(emb, labels), 0.25 * losses.NTXentLoss(0.3)(emb, labels))


def test_multiple_losses_checks_its_arguments():
    with pytest.raises(ValueError, match="keys must match"):
        losses.MultipleLosses({"a": losses.NTXentLoss()}, weights={"b": 1.0})
    with pytest.raises(ValueError, match="same length"):
        losses.MultipleLosses([losses.NTXentLoss()], miners=[None, None])
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        losses.MultipleLosses([losses.NTXentLoss()], weight=[1.0])


# ---------------------------------------------------------------------------------------------
# samplers
# ---------------------------------------------------------------------------------------------
LABELS = torch.tensor([7] * 5 + [2] * 4 + [9] * 3 + [4] * 6 + [5] * 6)


def test_samplers_module_has_pmls_samplers():
    names = {n for n in dir(pml_samplers) if isinstance(getattr(pml_samplers, n), type)}
    assert names == set(samplers.__all__)
    for name in ("MPerClassSampler", "HierarchicalSampler", "FixedSetOfTriplets"):
        assert getattr(samplers, name) is getattr(pf.samplers, name)


@pytest.mark.parametrize(("m", "batch_size", "length"), [(3, 6, 60), (2, 8, 50), (3, None, 100)])
def test_m_per_class_sampler_has_pmls_length_and_batches(m, batch_size, length):
    ours = samplers.MPerClassSampler(LABELS, m, batch_size, length)  # PML's positional order
    theirs = pml_samplers.MPerClassSampler(LABELS, m, batch_size, length)
    np.random.seed(0)  # noqa: NPY002  (PML's draws: NumPy's global generator)
    streams = [list(ours), list(theirs)]
    assert len(ours) == len(theirs) == len(streams[0]) == len(streams[1])
    size = batch_size or m * len(set(LABELS.tolist()))
    for stream in streams:
        for start in range(0, len(stream) - size + 1, size):
            counts = Counter(LABELS[stream[start : start + size]].tolist())
            assert set(counts.values()) == {m} and len(counts) == size // m


def test_hierarchical_sampler_has_pmls_length_and_batches():
    inner = torch.arange(24) // 3  # 8 classes of 3
    labels = torch.stack([inner, inner // 2], 1)  # 4 super classes of 2 classes
    ours = samplers.HierarchicalSampler(labels, 8, 2, 3)
    theirs = pml_samplers.HierarchicalSampler(labels, 8, 2, 3)
    np.random.seed(0)  # noqa: NPY002
    batches = [list(ours), list(theirs)]
    assert len(ours) == len(theirs) == len(batches[0]) == len(batches[1]) == 6 * 3
    for sampled in batches:
        for batch in sampled:
            rows = labels[batch]
            assert len(batch) == 8 and len(set(rows[:, 1].tolist())) == 2
            assert set(Counter(rows[:, 0].tolist()).values()) == {2}


def test_fixed_set_of_triplets_has_pmls_length_and_valid_triplets():
    ours, theirs = samplers.FixedSetOfTriplets(LABELS, 10), pml_samplers.FixedSetOfTriplets(LABELS, 10)  # fmt: skip
    assert len(ours) == len(theirs) == 30
    for stream in (list(ours), list(theirs)):
        for a, p, n in zip(stream[::3], stream[1::3], stream[2::3], strict=True):
            assert LABELS[a] == LABELS[p] and LABELS[a] != LABELS[n]


def _model_and_dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 6, generator=g)
    labels = torch.arange(20) % 4
    model = torch.nn.Linear(6, D)
    with torch.no_grad():
        model.weight.copy_(torch.randn(D, 6, generator=g))
    return model, TensorDataset(x, labels)


def test_tuples_to_weights_sampler_computes_pmls_weights():
    model, dataset = _model_and_dataset()
    tester = {"batch_size": 7, "dataloader_num_workers": 0, "data_device": torch.device("cpu")}
    # PML's tester builds a faiss AccuracyCalculator unless given one
    pml_calc = PMLAccuracyCalculator(knn_func=CustomKNN(pml_distances.CosineSimilarity()))
    theirs = pml_samplers.TuplesToWeightsSampler(
        model, pml_miners.MultiSimilarityMiner(0.1), dataset, accuracy_calculator=pml_calc,
        **tester,
    )  # fmt: skip
    ours = samplers.TuplesToWeightsSampler(
        model, miners.MultiSimilarityMiner(0.1), dataset, accuracy_calculator=pml_calc, **tester,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    drawn, pml_drawn = list(ours), list(theirs)
    assert len(ours) == len(theirs) == len(drawn) == len(pml_drawn) == 20
    assert ours.weights is not None
    torch.testing.assert_close(ours.weights, theirs.weights, rtol=0, atol=0)
    assert ours.weights.min() < 1 and all(ours.weights[i] > 0 for i in drawn)
    subset = samplers.TuplesToWeightsSampler(
        model, pf.miners.multi_similarity, dataset, 8, dataloader_num_workers=0
    )
    assert len(subset) == len(list(subset)) == 8 and int((subset.weights > 0).sum()) <= 8
    with pytest.raises(ValueError, match="pca"):
        samplers.TuplesToWeightsSampler(model, miners.BatchHardMiner(), dataset, pca=2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        samplers.TuplesToWeightsSampler(model, miners.BatchHardMiner(), dataset, batchsize=2)


# ---------------------------------------------------------------------------------------------
# AccuracyCalculator
# ---------------------------------------------------------------------------------------------
KEYS = ["AMI", "NMI", "mean_average_precision", "mean_average_precision_at_r",
        "mean_reciprocal_rank", "precision_at_1", "r_precision"]  # fmt: skip


def pf_kmeans(x, num_clusters):
    return pf.evaluation.kmeans(x, num_clusters).assignments


def embedded(seed=0, sizes=(6, 5, 4, 3, 1), spread=1.2):
    """Clustered float32 embeddings (class sizes ``sizes``: the last a single, lone query)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.full((n,), 10 + 3 * c) for c, n in enumerate(sizes)])
    centres = torch.randn(len(sizes), 8, generator=g) * 2
    emb = centres[labels.div(3, rounding_mode="floor") - 3]
    emb = emb + spread * torch.randn(emb.shape, generator=g)
    perm = torch.randperm(len(labels), generator=g)
    return emb[perm], labels[perm]


def calculators(**kwargs):
    ours = AccuracyCalculator(kmeans_func=kwargs.pop("ours_kmeans", pf_kmeans), **kwargs)
    knn = CustomKNN(pml_distances.CosineSimilarity())
    return ours, PMLAccuracyCalculator(knn_func=knn, kmeans_func=pf_kmeans, **kwargs)


def assert_same_accuracy(got, want):
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, list):
            assert isinstance(got[key], list), key
            np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
        else:
            assert type(got[key]) is float, key
            assert math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-7) or (
                math.isnan(got[key]) and math.isnan(value)
            ), (key, got[key], value)


@pytest.mark.filterwarnings("ignore:You are computing")  # k=4: PML logs, pmlfunc warns
@pytest.mark.parametrize("k", [None, "max_bin_count", 4])
def test_accuracy_on_one_set_equals_pmls(k):
    emb, labels = embedded()
    ours, theirs = calculators(k=k)
    got = ours.get_accuracy(emb, labels)
    assert list(got) == KEYS
    assert_same_accuracy(got, theirs.get_accuracy(emb, labels))
    # the default k-means is the same pmlfunc kmeans (its fixed seed)
    default = AccuracyCalculator(k=k).get_accuracy(emb, labels)
    assert default == got


@pytest.mark.filterwarnings("ignore:You are computing")
@pytest.mark.parametrize("k", [None, "max_bin_count", 3])
def test_accuracy_against_a_reference_set_equals_pmls(k):
    emb, labels = embedded(1)
    ref, ref_labels = embedded(2, sizes=(4, 7, 2, 5, 3, 2), spread=1.0)
    ours, theirs = calculators(k=k)
    assert_same_accuracy(
        ours.get_accuracy(emb, labels, ref, ref_labels),
        theirs.get_accuracy(emb, labels, ref, ref_labels),
    )
    # the reference starts with the queries
    both, both_labels = torch.cat([emb, ref]), torch.cat([labels, ref_labels])
    assert_same_accuracy(
        ours.get_accuracy(emb, labels, both, both_labels, ref_includes_query=True),
        theirs.get_accuracy(emb, labels, both, both_labels, ref_includes_query=True),
    )


@pytest.mark.parametrize("option", ["avg_of_avgs", "return_per_class"])
def test_per_class_averages_equal_pmls(option):
    emb, labels = embedded(3)
    ours, theirs = calculators(**{option: True}, exclude=("AMI", "NMI"))
    got = ours.get_accuracy(emb, labels)
    assert_same_accuracy(got, theirs.get_accuracy(emb, labels))
    assert option != "return_per_class" or len(got["precision_at_1"]) == 4  # the lone class out
    ref, ref_labels = embedded(4, sizes=(3, 3, 3, 3, 3))
    assert_same_accuracy(
        ours.get_accuracy(emb, labels, ref, ref_labels),
        theirs.get_accuracy(emb, labels, ref, ref_labels),
    )


def test_include_exclude_a_custom_label_comparison_and_a_knn_func_equal_pmls():
    emb, labels = embedded(5)
    ours, theirs = calculators(include=("precision_at_1", "r_precision", "NMI"))
    got = ours.get_accuracy(emb, labels, exclude=("NMI",))
    assert list(got) == ["precision_at_1", "r_precision"]
    assert_same_accuracy(got, theirs.get_accuracy(emb, labels, exclude=("NMI",)))

    def same_pair(x, y):  # labels 10, 13 are one group, 16, 19 another, 22 a third
        return (x - 10).div(6, rounding_mode="floor") == (y - 10).div(6, rounding_mode="floor")

    ours, theirs = calculators(exclude=("AMI", "NMI"), label_comparison_fn=same_pair)
    assert_same_accuracy(ours.get_accuracy(emb, labels), theirs.get_accuracy(emb, labels))
    want = calculators(exclude=("AMI", "NMI"))[1].get_accuracy(emb, labels)
    knn = CustomKNN(pml_distances.CosineSimilarity())  # PML's k-NN protocol, or a distance
    for knn_func in (knn, distances.CosineSimilarity(), pf.distances.cosine()):
        with_knn = AccuracyCalculator(exclude=("AMI", "NMI"), knn_func=knn_func)
        assert_same_accuracy(with_knn.get_accuracy(emb, labels), want)


def test_lone_queries_numpy_inputs_and_errors_are_pmls():
    emb, labels = embedded(6, sizes=(1, 1, 1, 1))  # every query alone in its class
    ours, theirs = calculators(exclude=("AMI", "NMI"))
    got = ours.get_accuracy(emb, labels)
    assert all(math.isnan(v) for v in got.values())
    assert_same_accuracy(got, theirs.get_accuracy(emb, labels))
    emb, labels = embedded(7)
    assert_same_accuracy(
        ours.get_accuracy(emb.numpy(), labels.numpy()), theirs.get_accuracy(emb, labels)
    )
    with pytest.raises(ValueError, match="must be equal to query"):
        ours.get_accuracy(emb, labels, emb.flip(0), labels, ref_includes_query=True)
    with pytest.raises(ValueError, match="same length"):
        ours.get_accuracy(emb, labels[1:])
    with pytest.raises(ValueError, match="Primary metrics"):
        AccuracyCalculator(include=("recall_at_5",))
    with pytest.raises(ValueError, match="mutually exclusive"):
        AccuracyCalculator(avg_of_avgs=True, return_per_class=True)
    with pytest.raises(ValueError, match="k must be"):
        AccuracyCalculator(k=0)
    with pytest.raises(NotImplementedError, match="clustering"):
        AccuracyCalculator(label_comparison_fn=torch.eq)
    with pytest.warns(UserWarning, match="max bin count"):
        AccuracyCalculator(k=2, exclude=("AMI", "NMI")).get_accuracy(emb, labels)

    class WithCustomMetric(AccuracyCalculator):
        def calculate_fancy(self, **kwargs):
            return 0.0

    with pytest.raises(NotImplementedError, match="fancy"):
        WithCustomMetric()
    assert pml.utils.AccuracyCalculator is accuracy_module.AccuracyCalculator
