"""pmlfunc.samplers against pytorch-metric-learning 2.9.0's samplers, side by side over many seeds.

The random numbers differ (torch's generator, NumPy's global state in PML), so the comparison is
of properties: lengths equal exactly; every batch's class structure holds for both; coverage
statistics (how often each class and each sample is drawn) agree with each other and with their
exact expectation. Structure checks are written here from labels, never with pmlfunc."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import samplers as pml_samplers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

import pmlfunc as pf

SEEDS = range(50)
# 6 classes of uneven sizes (one singleton, two smaller than m=3), labels not 0..L-1
LABELS = torch.tensor([7] * 5 + [2] * 4 + [9] * 3 + [4] * 2 + [11] * 1 + [5] * 6)[
    torch.randperm(21, generator=torch.Generator().manual_seed(1))
]
SIZES = Counter(LABELS.tolist())


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seed_pml(seed: int) -> None:
    """PML's samplers draw from NumPy's global generator (``c_f.NUMPY_RANDOM``)."""
    np.random.seed(seed)  # noqa: NPY002


def pml_stream(sampler, seed: int) -> list:
    seed_pml(seed)
    return list(iter(sampler))


# ----------------------------------------------------------------------------- m_per_class


M_PER_CLASS_SETTINGS = [  # (m, batch_size, length_before_new_iter)
    (3, 6, 60),
    (3, 9, 100),
    (2, 12, 50),
    (1, 4, 10),
    (3, 18, 18),  # every class in every batch
    (4, 8, 8),  # one batch
    (3, None, 100),  # whole passes: 100 -> 90
    (3, None, 18),  # exactly one pass
    (2, None, 1000),
    (3, 3, 100_000),
]


@pytest.mark.parametrize("m, batch_size, length", M_PER_CLASS_SETTINGS)
def test_m_per_class_length_equals_pml_len_and_stream_length(m, batch_size, length):
    pml = pml_samplers.MPerClassSampler(LABELS, m, batch_size, length)
    ours = pf.samplers.MPerClassSampler(LABELS, m, batch_size, length, generator=gen())
    want = len(pml)
    assert len(ours) == want
    assert (
        pf.samplers.m_per_class_length(LABELS, m, batch_size, length_before_new_iter=length) == want
    )
    got = pf.samplers.m_per_class(
        LABELS, m, batch_size, generator=gen(), length_before_new_iter=length
    )
    assert got.shape == (want,) and got.dtype == torch.int64
    assert len(pml_stream(pml, 0)) == want  # PML's stream is as long as its len() here
    if batch_size is not None:
        assert want % batch_size == 0 and want == length - length % batch_size


def test_m_per_class_without_batch_size_is_len_long_where_pml_yields_a_whole_pass():
    """The one documented deviation: m·L = 18 > 10, PML's len() is 10 but it yields 18."""
    pml = pml_samplers.MPerClassSampler(LABELS, 3, None, 10)
    assert len(pml) == 10 and len(pml_stream(pml, 0)) == 18
    got = pf.samplers.m_per_class(LABELS, 3, generator=gen(), length_before_new_iter=10)
    assert got.shape == (10,)


def batch_structure(labels: torch.Tensor, batch: torch.Tensor, m: int) -> None:
    """m samples of each of len(batch)/m distinct classes; distinct samples for classes with at
    least m samples; with replacement (necessarily repeats) for smaller ones."""
    counts = Counter(labels[batch].tolist())
    assert len(counts) == len(batch) // m and set(counts.values()) == {m}, counts
    for c in counts:
        members = batch[labels[batch] == c]
        distinct = len(set(members.tolist()))
        assert distinct == m if SIZES[c] >= m else distinct <= SIZES[c]


@pytest.mark.parametrize("m, batch_size", [(3, 6), (2, 12), (3, 18)])
def test_every_batch_holds_m_samples_of_batch_size_over_m_classes_in_both(m, batch_size):
    for seed in SEEDS:
        pml = torch.tensor(
            pml_stream(pml_samplers.MPerClassSampler(LABELS, m, batch_size, 60), seed)
        )
        ours = pf.samplers.m_per_class(
            LABELS, m, batch_size, generator=gen(seed), length_before_new_iter=60
        )
        for stream in (pml, ours):
            for batch in stream.view(-1, batch_size):
                batch_structure(LABELS, batch, m)


def coverage(streams: list[torch.Tensor], batch_size: int, m: int):
    """Per class: the fraction of batches holding it; per sample: the fraction of its class's
    appearances in which it is drawn (over distinct draws); the mean distinct samples of a small
    class in a batch."""
    batches = torch.cat([s.view(-1, batch_size) for s in streams])
    classes = sorted(SIZES)
    has = torch.tensor([[bool((LABELS[b] == c).any()) for c in classes] for b in batches])
    class_freq = has.double().mean(0)
    sample_freq = torch.zeros(len(LABELS), dtype=torch.float64)
    for b in batches:
        sample_freq[b.unique()] += 1
    class_of = torch.tensor([classes.index(c) for c in LABELS.tolist()])
    sample_freq /= has.sum(0)[class_of].double()
    return class_freq, sample_freq


@pytest.mark.parametrize("m, batch_size", [(3, 6), (2, 4)])
def test_m_per_class_coverage_matches_pml_and_its_expectation(m, batch_size):
    length = 120
    pml = [
        torch.tensor(pml_stream(pml_samplers.MPerClassSampler(LABELS, m, batch_size, length), s))
        for s in SEEDS
    ]
    ours = [
        pf.samplers.m_per_class(
            LABELS, m, batch_size, generator=gen(s), length_before_new_iter=length
        )
        for s in SEEDS
    ]
    n_classes = len(SIZES)
    want_class = torch.full((n_classes,), (batch_size // m) / n_classes, dtype=torch.float64)
    # a sample of a class of size n is in a batch holding its class with probability
    # m/n (n >= m, no replacement) or 1 - (1 - 1/n)^m (n < m, with replacement)
    want_sample = torch.tensor(
        [m / SIZES[c] if SIZES[c] >= m else 1 - (1 - 1 / SIZES[c]) ** m for c in LABELS.tolist()],
        dtype=torch.float64,
    )
    stats = [coverage(pml, batch_size, m), coverage(ours, batch_size, m)]
    for class_freq, sample_freq in stats:  # 1,000+ batches: standard errors about 0.015
        torch.testing.assert_close(class_freq, want_class, atol=0.06, rtol=0)
        torch.testing.assert_close(sample_freq, want_sample, atol=0.12, rtol=0)
    torch.testing.assert_close(stats[0][0], stats[1][0], atol=0.08, rtol=0)


@pytest.mark.parametrize("m", [1, 3])
def test_without_batch_size_each_pass_holds_every_class_m_times_in_both(m):
    single = m * len(SIZES)
    for seed in SEEDS[:20]:
        pml = torch.tensor(pml_stream(pml_samplers.MPerClassSampler(LABELS, m, None, 100), seed))
        ours = pf.samplers.m_per_class(LABELS, m, generator=gen(seed), length_before_new_iter=100)
        assert pml.shape == ours.shape
        for stream in (pml, ours):
            for one_pass in stream.view(-1, single):
                batch_structure(LABELS, one_pass, m)
                assert len(Counter(LABELS[one_pass].tolist())) == len(SIZES)


def test_m_per_class_is_deterministic_given_the_generator_and_advances_it():
    a = pf.samplers.m_per_class(LABELS, 3, 6, generator=gen(5), length_before_new_iter=60)
    b = pf.samplers.m_per_class(LABELS, 3, 6, generator=gen(5), length_before_new_iter=60)
    assert torch.equal(a, b)
    g = gen(5)
    first = pf.samplers.m_per_class(LABELS, 3, 6, generator=g, length_before_new_iter=60)
    second = pf.samplers.m_per_class(LABELS, 3, 6, generator=g, length_before_new_iter=60)
    assert torch.equal(first, a) and not torch.equal(first, second)
    c = pf.samplers.m_per_class(LABELS, 3, 6, generator=gen(6), length_before_new_iter=60)
    assert not torch.equal(a, c)


def test_labels_as_a_list_or_numpy_array_or_on_another_dtype_give_the_same_epoch():
    want = pf.samplers.m_per_class(LABELS, 3, 6, generator=gen(4), length_before_new_iter=60)
    forms: list[Any] = [LABELS.tolist(), LABELS.numpy(), LABELS.int(), LABELS.to(torch.int16)]
    for labels in forms:
        got = pf.samplers.m_per_class(labels, 3, 6, generator=gen(4), length_before_new_iter=60)
        assert torch.equal(got, want)


def test_sampler_draws_a_fresh_epoch_per_iteration_and_replays_from_the_seed():
    s = pf.samplers.MPerClassSampler(LABELS, 3, 6, 60, generator=gen(3))
    e1, e2 = list(s), list(s)
    assert e1 != e2
    s2 = pf.samplers.MPerClassSampler(LABELS, 3, 6, 60, generator=gen(3))
    assert list(s2) == e1 and list(s2) == e2
    torch.manual_seed(0)
    d1 = list(
        pf.samplers.MPerClassSampler(LABELS, 3, 6, 60)
    )  # seeded from torch's global generator
    torch.manual_seed(0)
    assert list(pf.samplers.MPerClassSampler(LABELS, 3, 6, 60)) == d1


def test_m_per_class_sampler_in_a_dataloader_as_sampler_and_as_batch_sampler():
    x = torch.arange(len(LABELS), dtype=torch.float32)[:, None]
    ds = TensorDataset(x, LABELS)
    sampler = pf.samplers.MPerClassSampler(LABELS, 3, 9, 90, generator=gen(0))
    for loader in (
        DataLoader(ds, batch_size=9, sampler=sampler),
        DataLoader(ds, batch_sampler=BatchSampler(sampler, 9, drop_last=True)),
    ):
        batches = list(loader)
        assert len(loader) == len(batches) == 10
        for xb, yb in batches:
            assert torch.equal(LABELS[xb[:, 0].long()], yb)
            batch_structure(LABELS, xb[:, 0].long(), 3)


def test_large_dataset_epoch_is_fast_and_structured():
    labels = torch.randint(0, 2000, (50_000,), generator=gen(0))
    idx = pf.samplers.m_per_class(labels, 4, 64, generator=gen(1))
    assert idx.shape == (99_968,)
    b = labels[idx].view(-1, 64)
    s = b.sort(1).values
    assert bool((s.view(-1, 16, 4) == s.view(-1, 16, 4)[..., :1]).all())  # runs of exactly 4
    assert bool((s.view(-1, 16, 4)[:, 1:, 0] != s.view(-1, 16, 4)[:, :-1, 0]).all())


M_PER_CLASS_ERRORS = [  # (labels, m, batch_size, length, kwargs, exception, message, pml also rejects)
    (LABELS, 3, 8, 100, ValueError, "batch_size must be a multiple of m", True),
    (LABELS, 3, 21, 100, ValueError, r"m \* \(number of classes\) must be >= batch_size", True),
    (LABELS, 2, 14, 100, ValueError, "labels have 6", True),
    (LABELS, 3, 9, 8, ValueError, "length_before_new_iter must be >= batch_size", True),
    (torch.tensor([], dtype=torch.long), 2, 4, 100, ValueError, "labels is empty", True),
    (LABELS.view(3, 7), 3, 6, 100, ValueError, "labels must be 1-D", False),
    (LABELS.double(), 3, 6, 100, TypeError, "integer", False),
    ("0123", 1, 2, 100, TypeError, "labels must be a torch.Tensor", False),
    ([0.5, 1.0], 1, 2, 100, TypeError, "integer", False),
    (LABELS, 0, 6, 100, ValueError, "m must be an int >= 1", True),
    (LABELS, 3, 0, 100, ValueError, "batch_size must be an int >= 1", False),
    (LABELS, 3, None, 0, ValueError, "length_before_new_iter must be an int >= 1", False),
    (LABELS, 1.5, 3, 100, TypeError, "m must be an int", False),
]


@pytest.mark.parametrize(
    "labels, m, batch_size, length, exc, message, pml_rejects", M_PER_CLASS_ERRORS
)
def test_m_per_class_rejects_impossible_settings_with_a_clear_error(
    labels, m, batch_size, length, exc, message, pml_rejects
):
    with pytest.raises(exc, match=message):
        pf.samplers.m_per_class(
            labels, m, batch_size, generator=gen(), length_before_new_iter=length
        )
    with pytest.raises(exc, match=message):
        pf.samplers.MPerClassSampler(labels, m, batch_size, length, generator=gen())
    if pml_rejects:
        with pytest.raises(Exception):  # noqa: B017 (PML raises AssertionError or ZeroDivisionError)
            pml_samplers.MPerClassSampler(labels, m, batch_size, length)


@pytest.mark.parametrize(
    "generator, exc, message",
    [(None, ValueError, "generator is required"), (0, TypeError, "torch.Generator")],
)
def test_functions_need_an_explicit_cpu_generator(generator, exc, message):
    with pytest.raises(exc, match=message):
        pf.samplers.m_per_class(LABELS, 3, 6, generator=generator)
    with pytest.raises(exc, match=message):
        pf.samplers.fixed_set_of_triplets(LABELS, 3, generator=generator)


# ----------------------------------------------------------------------------- hierarchical

# 4 super labels with 3, 2, 4 and 1 classes; class sizes 1..4; inner labels repeat across supers
_ROWS = []
for sup, sizes in enumerate([[3, 1, 4], [2, 2], [4, 3, 1, 2], [3]]):
    for inner, n in enumerate(sizes):
        _ROWS += [[inner, sup * 10]] * n
H_LABELS = torch.tensor(_ROWS)[torch.randperm(len(_ROWS), generator=gen(2))]
H_CLASSES = Counter(map(tuple, H_LABELS.tolist()))  # (inner, super) -> size
H_SUPERS: dict[int, list[int]] = {}
for inner, sup in sorted(H_CLASSES):
    H_SUPERS.setdefault(sup, []).append(inner)


def check_hierarchical_batch(batch, batch_size, spc, k):
    """One batch: exactly k super labels; per super label a sub-batch within batch_size / k;
    int spc: each class spc times, min(#classes, sub / spc) classes, distinct samples where the
    class is big enough; "all": whole classes and no left-out class would have fit."""
    sub = batch_size // k
    rows = H_LABELS[batch]
    supers = sorted(set(rows[:, 1].tolist()))
    assert len(supers) == k
    for sup in supers:
        mine = batch[rows[:, 1] == sup]
        cls = Counter(H_LABELS[mine, 0].tolist())
        assert len(mine) <= sub
        if spc != "all":
            assert set(cls.values()) == {spc}
            assert len(cls) == min(len(H_SUPERS[sup]), sub // spc)
            for c in cls:
                members = mine[H_LABELS[mine, 0] == c].tolist()
                if H_CLASSES[(c, sup)] >= spc:
                    assert len(set(members)) == spc
        else:
            for c in cls:
                assert cls[c] == H_CLASSES[(c, sup)] and len(set(mine.tolist())) == len(mine)
            left = sub - len(mine)
            assert all(H_CLASSES[(c, sup)] > left for c in H_SUPERS[sup] if c not in cls)
    return tuple(supers)


H_SETTINGS = [  # (batch_size, samples_per_class, batches_per_super_tuple, super_classes_per_batch)
    (8, 2, 4, 2),
    (12, 2, 3, 2),
    (6, 1, 2, 3),
    (4, 4, 2, 1),
    (8, "all", 4, 2),
    (10, "all", 2, 2),
]


@pytest.mark.parametrize("batch_size, spc, bpst, k", H_SETTINGS)
def test_hierarchical_batches_have_pml_structure_and_count_in_both(batch_size, spc, bpst, k):
    kw = dict(batches_per_super_tuple=bpst, super_classes_per_batch=k)
    combos = Counter(itertools.combinations(sorted(H_SUPERS), k))
    for seed in SEEDS[:25]:
        seed_pml(seed)
        pml = pml_samplers.HierarchicalSampler(H_LABELS, batch_size, spc, **kw)
        pml_batches = [torch.tensor(b) for b in pml_stream(pml, seed)]
        ours = pf.samplers.hierarchical(H_LABELS, batch_size, spc, generator=gen(seed), **kw)
        assert len(ours) == len(pml_batches) == len(pml) == len(combos) * bpst
        assert pf.samplers.hierarchical_length(H_LABELS, batch_size, spc, **kw) == len(pml)
        for batches in (pml_batches, ours):
            seen = Counter(check_hierarchical_batch(b, batch_size, spc, k) for b in batches)
            assert seen == Counter({c: bpst for c in combos})
        if spc != "all":  # the batch sizes are fixed by the structure: same multiset
            assert sorted(map(len, ours)) == sorted(map(len, pml_batches))


@pytest.mark.parametrize("spc", [2, "all"])
def test_hierarchical_coverage_matches_pml(spc):
    """How often each (super, inner) class is drawn, over 50 epochs of both."""

    def class_freq(epochs):
        c: Counter[tuple] = Counter()
        for batches in epochs:
            for b in batches:
                c.update(set(map(tuple, H_LABELS[b].tolist())))
        total = sum(len(e) for e in epochs)
        return torch.tensor([c[key] / total for key in sorted(H_CLASSES)], dtype=torch.float64)

    pml_epochs, our_epochs = [], []
    for seed in SEEDS:
        seed_pml(seed)
        pml = pml_samplers.HierarchicalSampler(H_LABELS, 8, spc)
        pml_epochs.append([torch.tensor(b) for b in pml_stream(pml, seed)])
        our_epochs.append(pf.samplers.hierarchical(H_LABELS, 8, spc, generator=gen(seed)))
    torch.testing.assert_close(class_freq(our_epochs), class_freq(pml_epochs), atol=0.05, rtol=0)
    if spc == "all":  # the greedy fill: mean batch size agrees
        mean = [np.mean([len(b) for e in ep for b in e]) for ep in (pml_epochs, our_epochs)]
        assert abs(mean[0] - mean[1]) < 0.3


def test_hierarchical_sampler_as_a_dataloader_batch_sampler_with_fresh_epochs():
    x = torch.arange(len(H_LABELS), dtype=torch.float32)[:, None]
    s = pf.samplers.HierarchicalSampler(H_LABELS, 8, 2, generator=gen(0))
    loader = DataLoader(TensorDataset(x, H_LABELS), batch_sampler=s)
    e1 = [xb[:, 0].long() for xb, _ in loader]
    e2 = [xb[:, 0].long() for xb, _ in loader]
    assert len(loader) == len(e1) == 24
    for b in e1:
        check_hierarchical_batch(b, 8, 2, 2)
    assert any(not torch.equal(a, b) for a, b in zip(e1, e2, strict=True))
    again = pf.samplers.HierarchicalSampler(H_LABELS, 8, 2, generator=gen(0))
    assert list(again) == [b.tolist() for b in e1]  # the same seed replays the epoch


def test_hierarchical_columns_count_from_the_end_as_in_numpy():
    a = pf.samplers.hierarchical(H_LABELS, 8, 2, generator=gen(1))
    b = pf.samplers.hierarchical(H_LABELS, 8, 2, generator=gen(1), inner_label=-2, outer_label=-1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    swapped = H_LABELS.flip(1)
    c = pf.samplers.hierarchical(swapped, 8, 2, generator=gen(1), inner_label=1, outer_label=0)
    assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


H_ERRORS = [  # (labels, batch_size, spc, kwargs, exception, message, pml also rejects)
    (H_LABELS, 9, 2, {}, ValueError, "multiple of super_classes_per_batch", True),
    (H_LABELS, 8, 3, {}, ValueError, "multiple of samples_per_class", True),
    (H_LABELS, 8, 0, {}, ValueError, "samples_per_class must be an int >= 1", True),
    (H_LABELS, 8, "some", {}, ValueError, "samples_per_class must be an int or", False),
    (H_LABELS, 10, 2, {"super_classes_per_batch": 5}, ValueError, "4 distinct super labels", False),
    (H_LABELS[:, 0], 8, 2, {}, ValueError, "labels must be 2-D", True),
    (H_LABELS[:0], 8, 2, {}, ValueError, "labels is empty", False),
    (H_LABELS.float(), 8, 2, {}, TypeError, "integer", False),
    (H_LABELS, 8, 2, {"outer_label": 2}, IndexError, "outer_label=2 is not a column", True),
    (H_LABELS, 8, 2, {"inner_label": -3}, IndexError, "inner_label=-3 is not a column", True),
    (
        H_LABELS,
        8,
        2,
        {"batches_per_super_tuple": 0},
        ValueError,
        "batches_per_super_tuple must be an int >= 1",
        False,
    ),
]


@pytest.mark.parametrize("labels, batch_size, spc, kw, exc, message, pml_rejects", H_ERRORS)
def test_hierarchical_rejects_impossible_settings_with_a_clear_error(
    labels, batch_size, spc, kw, exc, message, pml_rejects
):
    with pytest.raises(exc, match=message):
        pf.samplers.hierarchical(labels, batch_size, spc, generator=gen(), **kw)
    with pytest.raises(exc, match=message):
        pf.samplers.HierarchicalSampler(labels, batch_size, spc, generator=gen(), **kw)
    if pml_rejects:
        with pytest.raises(Exception):  # noqa: B017 (PML asserts, or fails indexing)
            pml_samplers.HierarchicalSampler(labels, batch_size, spc, **kw)


# ----------------------------------------------------------------------------- fixed sets


def triplet_stats(t: torch.Tensor):
    """Anchor-class and negative-class frequencies, and how often anchor == positive."""
    classes = sorted(SIZES)
    a_cls = torch.tensor([classes.index(c) for c in LABELS[t[:, 0]].tolist()])
    n_cls = torch.tensor([classes.index(c) for c in LABELS[t[:, 2]].tolist()])
    L = len(classes)
    return (
        torch.bincount(a_cls, minlength=L).double() / len(t),
        torch.bincount(n_cls, minlength=L).double() / len(t),
        (t[:, 0] == t[:, 1]).double().mean(),
    )


def test_fixed_set_of_triplets_has_pml_structure_and_statistics():
    n = 200
    ours, pml = [], []
    for seed in SEEDS:
        t = pf.samplers.fixed_set_of_triplets(LABELS, n, generator=gen(seed))
        seed_pml(seed)
        p = torch.from_numpy(
            pml_samplers.FixedSetOfTriplets(LABELS, n).fixed_set_of_triplets.copy()
        )
        for x in (t, p):
            assert x.shape == (n, 3)
            la, lp, ln = LABELS[x[:, 0]], LABELS[x[:, 1]], LABELS[x[:, 2]]
            assert bool((la == lp).all()) and bool((la != ln).all())
            big = torch.tensor([SIZES[c] >= 2 for c in la.tolist()])
            assert bool((x[big, 0] != x[big, 1]).all()) and bool((x[~big, 0] == x[~big, 1]).all())
        ours.append(t)
        pml.append(p)
    so, sp = triplet_stats(torch.cat(ours)), triplet_stats(torch.cat(pml))
    L = len(SIZES)
    for s in (so, sp):  # 10,000 triplets: anchor and negative classes uniform, 1/L each
        torch.testing.assert_close(
            s[0], torch.full((L,), 1 / L, dtype=torch.float64), atol=0.015, rtol=0
        )
        torch.testing.assert_close(
            s[1], torch.full((L,), 1 / L, dtype=torch.float64), atol=0.015, rtol=0
        )
        torch.testing.assert_close(
            s[2], torch.tensor(1 / L, dtype=torch.float64), atol=0.015, rtol=0
        )


def test_fixed_set_of_triplets_sampler_yields_the_fixed_rows_shuffled_each_epoch():
    s = pf.samplers.FixedSetOfTriplets(LABELS, 30, generator=gen(0))
    pml = pml_samplers.FixedSetOfTriplets(LABELS, 30)
    assert len(s) == len(pml) == 90
    e1, e2 = torch.tensor(list(s)).view(-1, 3), torch.tensor(list(s)).view(-1, 3)
    rows = sorted(map(tuple, s.triplets.tolist()))
    assert sorted(map(tuple, e1.tolist())) == rows == sorted(map(tuple, e2.tolist()))
    assert not torch.equal(e1, e2)
    again = pf.samplers.FixedSetOfTriplets(LABELS, 30, generator=gen(0))
    assert torch.equal(again.triplets, s.triplets)


def test_fixed_set_of_pairs_are_positive_and_negative_with_uniform_classes():
    pos, neg = pf.samplers.fixed_set_of_pairs(LABELS, 6000, 5000, generator=gen(0))
    assert pos.shape == (6000, 2) and neg.shape == (5000, 2)
    assert bool((LABELS[pos[:, 0]] == LABELS[pos[:, 1]]).all()) and bool(
        (pos[:, 0] != pos[:, 1]).all()
    )
    assert bool((LABELS[neg[:, 0]] != LABELS[neg[:, 1]]).all())
    pairable = sorted(c for c in SIZES if SIZES[c] >= 2)
    freq = Counter(LABELS[pos[:, 0]].tolist())
    assert set(freq) == set(pairable)
    for c in pairable:  # uniform over the classes with two or more samples
        assert abs(freq[c] / 6000 - 1 / len(pairable)) < 0.02
    neg_freq = Counter(LABELS[neg.reshape(-1)].tolist())
    for c in SIZES:  # each class is one of a negative pair's two classes with probability 2/L
        assert abs(neg_freq[c] / 5000 - 2 / len(SIZES)) < 0.03
    p2, n2 = pf.samplers.fixed_set_of_pairs(LABELS, 6000, 5000, generator=gen(0))
    assert torch.equal(p2, pos) and torch.equal(n2, neg)


def test_fixed_set_of_pairs_sampler_and_defaults():
    pos, neg = pf.samplers.fixed_set_of_pairs(LABELS, 4, generator=gen(0))
    assert pos.shape == neg.shape == (4, 2)
    s = pf.samplers.FixedSetOfPairs(LABELS, 3, 5, generator=gen(1))
    assert len(s) == 16
    got = sorted(map(tuple, torch.tensor(list(s)).view(-1, 2).tolist()))
    assert got == sorted(map(tuple, torch.cat([s.pos_pairs, s.neg_pairs]).tolist()))


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (
            lambda: pf.samplers.fixed_set_of_triplets(torch.tensor([1, 1, 1]), 3, generator=gen()),
            ValueError,
            "at least 2 classes",
        ),
        (
            lambda: pf.samplers.fixed_set_of_triplets(LABELS, 0, generator=gen()),
            ValueError,
            "num_triplets must be an int >= 1",
        ),
        (
            lambda: pf.samplers.fixed_set_of_triplets(torch.tensor([]).long(), 3, generator=gen()),
            ValueError,
            "labels is empty",
        ),
        (
            lambda: pf.samplers.fixed_set_of_pairs(LABELS, 0, 0, generator=gen()),
            ValueError,
            "must be >= 1",
        ),
        (
            lambda: pf.samplers.fixed_set_of_pairs(torch.tensor([0, 1, 2]), 2, 0, generator=gen()),
            ValueError,
            "at least 2 samples",
        ),
        (
            lambda: pf.samplers.fixed_set_of_pairs(torch.tensor([0, 0]), 0, 2, generator=gen()),
            ValueError,
            "at least 2 classes",
        ),
        (
            lambda: pf.samplers.fixed_set_of_pairs(LABELS, -1, generator=gen()),
            ValueError,
            "num_pos_pairs must be an int >= 0",
        ),
    ],
)
def test_fixed_sets_reject_impossible_settings(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_pml_rejects_the_same_triplet_settings():
    with pytest.raises(ValueError):
        pml_samplers.FixedSetOfTriplets(torch.tensor([1, 1, 1]), 3)
    with pytest.raises(AssertionError):
        pml_samplers.FixedSetOfTriplets(LABELS, 0)


# ----------------------------------------------------------------------------- tuples to weights


def test_tuples_to_weights_equals_pml_convert_to_weights_scattered_into_the_dataset():
    g = gen(0)
    for _ in range(20):
        batch = int(torch.randint(5, 15, (), generator=g))
        t = tuple(torch.randint(batch, (8,), generator=g) for _ in range(3))
        y = torch.randint(3, (batch,), generator=g)
        want_batch = lmu.convert_to_weights(t, y, dtype=torch.float32)
        torch.testing.assert_close(pf.samplers.tuples_to_weights(t, batch), want_batch)
        indices = torch.randperm(30, generator=g)[:batch]
        want = torch.zeros(30)
        want[indices] = want_batch
        torch.testing.assert_close(pf.samplers.tuples_to_weights(t, 30, indices=indices), want)
    empty = tuple(torch.empty(0, dtype=torch.long) for _ in range(3))
    want = torch.zeros(6)
    want[torch.tensor([1, 4])] = 1
    torch.testing.assert_close(
        pf.samplers.tuples_to_weights(empty, 6, indices=torch.tensor([1, 4])), want
    )


def test_tuples_to_weights_takes_a_pmlfunc_miner_result():
    emb = torch.randn(12, 4, generator=gen(0))
    y = torch.arange(12) % 3
    mined = pf.miners.batch_hard(emb, y)
    pml_tuple = pml_miners.BatchHardMiner()(emb, y)
    torch.testing.assert_close(
        pf.samplers.tuples_to_weights(mined, 12),
        lmu.convert_to_weights(pml_tuple, y, dtype=torch.float32),
    )


def test_weighted_draws_in_proportion_and_never_a_zero_weight():
    w = torch.tensor([0.0, 1.0, 2.0, 0.0, 5.0])
    idx = pf.samplers.weighted(w, 40_000, generator=gen(0))
    freq = torch.bincount(idx, minlength=5).double() / 40_000
    torch.testing.assert_close(freq, (w / w.sum()).double(), atol=0.01, rtol=0)
    assert torch.equal(idx, pf.samplers.weighted(w, 40_000, generator=gen(0)))


def test_tuples_to_weights_sampler_matches_pml_weights_with_the_model_and_miner_outside():
    torch.manual_seed(0)
    x = torch.randn(40, 4, generator=gen(0))
    y = torch.arange(40) % 5
    ds = TensorDataset(x, y)
    model = torch.nn.Identity()
    miner = pml_miners.MultiSimilarityMiner(epsilon=0.1)
    calc = AccuracyCalculator(
        knn_func=CustomKNN(pml_distances.LpDistance())
    )  # PML's default needs faiss
    pml = pml_samplers.TuplesToWeightsSampler(
        model, miner, ds, batch_size=8, dataloader_num_workers=0, accuracy_calculator=calc
    )
    pml_draws = list(pml)
    ours = pf.samplers.TuplesToWeightsSampler(
        lambda idx: miner(x[idx], y[idx]), 40, generator=gen(1)
    )
    draws = list(ours)
    assert len(ours) == len(pml) == len(draws) == len(pml_draws) == 40
    assert ours.weights is not None and len(ours.weights.unique()) > 3  # the miner's counts vary
    torch.testing.assert_close(ours.weights, pml.weights.cpu())
    assert set(draws) <= set(ours.weights.nonzero().reshape(-1).tolist())
    sub = pf.samplers.TuplesToWeightsSampler(
        lambda idx: miner(x[idx], y[idx]), 40, 10, generator=gen(1)
    )
    assert len(sub) == len(list(sub)) == 10
    assert sub.weights is not None and int((sub.weights > 0).sum()) <= 10


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: pf.samplers.weighted(torch.zeros(3), 2, generator=gen()), ValueError, "all zero"),
        (
            lambda: pf.samplers.weighted(torch.tensor([1.0, -1.0]), 2, generator=gen()),
            ValueError,
            "non-negative",
        ),
        (
            lambda: pf.samplers.weighted(torch.tensor([1, 2]), 2, generator=gen()),
            TypeError,
            "floating-point",
        ),
        (
            lambda: pf.samplers.weighted(torch.ones(2), 0, generator=gen()),
            ValueError,
            "num_samples must be an int >= 1",
        ),
        (
            lambda: pf.samplers.tuples_to_weights((torch.tensor([0]),) * 3, 0),
            ValueError,
            "dataset_size must be an int >= 1",
        ),
        (
            lambda: pf.samplers.tuples_to_weights(
                (torch.tensor([0]),) * 3, 3, indices=torch.tensor([5])
            ),
            IndexError,
            r"indices\[0\] = 5 is out of range for dataset_size=3",
        ),
        (
            lambda: pf.samplers.tuples_to_weights((torch.tensor([4]),) * 3, 3),
            IndexError,
            "indices_tuple",
        ),
        (
            lambda: pf.samplers.TuplesToWeightsSampler(None, 3),  # type: ignore[arg-type]
            TypeError,
            "mine must be a callable",
        ),
    ],
)
def test_weights_reject_bad_input(call, exc, message):
    with pytest.raises(exc, match=message):
        call()
