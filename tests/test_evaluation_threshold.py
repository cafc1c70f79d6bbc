"""Tests for pmlfunc.evaluation.select_threshold against a brute-force float64 loop over every
candidate threshold (tests/reference/evaluation.py), with ties in distance, NaN, similarities,
degenerate label sets, compile and meta."""

from __future__ import annotations

import math

import pytest
import torch
from reference import evaluation as ref

from pmlfunc.evaluation import ThresholdResult, select_threshold

METRICS = ("accuracy", "balanced_accuracy", "f1")


def check(distances, is_match, metric, similarity=False):
    got = select_threshold(distances, is_match, metric=metric, is_similarity=similarity)
    assert isinstance(got, ThresholdResult)
    best, winners = ref.best_threshold(distances, is_match, metric, similarity=similarity)
    assert got.score.dtype == torch.float64 and got.score.shape == ()
    assert got.threshold.dtype == distances.dtype and got.threshold.shape == ()
    assert got.score.item() == pytest.approx(best, abs=1e-12)
    # The returned threshold reaches the best score, and it is the strictest that does.
    t = got.threshold.item()
    assert ref.threshold_metric(distances, is_match, t, metric, similarity=similarity) == (
        pytest.approx(best, abs=1e-12)
    )
    assert t == winners[0]
    return got


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force_with_ties(metric, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    is_match = torch.rand(n, generator=g) < 0.4
    # Matches nearer on average; rounding to 0.1 makes many exact ties, across classes too.
    d = (torch.rand(n, generator=g) + 0.5 * (~is_match)).mul(10).round().div(10)
    check(d, is_match, metric)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("seed", range(6))
def test_similarities_and_any_shape(metric, seed):
    g = torch.Generator().manual_seed(100 + seed)
    is_match = torch.rand(5, 8, generator=g) < 0.3
    sim = (torch.rand(5, 8, generator=g) + 0.6 * is_match).mul(8).round().div(8).double()
    got = check(sim.flatten(), is_match.flatten(), metric, similarity=True)
    same = select_threshold(sim, is_match, metric=metric, is_similarity=True)
    assert torch.equal(same.threshold, got.threshold) and torch.equal(same.score, got.score)
    # A similarity is a negated distance: the same split, the threshold negated.
    neg = select_threshold(-sim, is_match, metric=metric)
    assert torch.equal(neg.threshold, -got.threshold) and torch.equal(neg.score, got.score)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("similarity", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_distance_gives_nan_threshold_and_score(metric, similarity, bad):
    d = torch.tensor([0.2, 0.7, 0.5, 0.1, 0.3, 0.9, 0.5])
    is_match = torch.tensor([1, 1, 0, 1, 0, 0, 1])
    check(d, is_match, metric, similarity)  # all finite: the brute-force best, not NaN
    d[4] = bad
    got = select_threshold(d, is_match, metric=metric, is_similarity=similarity)
    assert math.isnan(got.threshold.item()) and math.isnan(got.score.item())
    assert got.threshold.dtype == d.dtype and got.score.dtype == torch.float64


@pytest.mark.compile
def test_a_non_finite_distance_gives_nan_under_compile():
    torch._dynamo.reset()
    fn = torch.compile(lambda d, m: select_threshold(d, m, metric="f1"), fullgraph=True)
    d = torch.tensor([0.2, 0.7, math.nan, 0.1])
    got = fn(d, torch.tensor([True, False, True, False]))
    assert math.isnan(got.threshold.item()) and math.isnan(got.score.item())


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("flags", [[1, 1, 1, 1], [0, 0, 0, 0], [0], [1]])
def test_degenerate_label_sets(metric, flags):
    d = torch.tensor([0.3, 0.1, 0.3, 0.7])[: len(flags)]
    check(d, torch.tensor(flags, dtype=torch.bool), metric)


def test_no_match_at_all_is_threshold_minus_inf():
    # The nearest pairs are non-matches: predicting nothing is the most accurate.
    got = select_threshold(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([False, False, True]))
    assert got.threshold.item() == -math.inf and got.score.item() == pytest.approx(2 / 3)
    sim = select_threshold(
        torch.tensor([0.9, 0.8, 0.3]), torch.tensor([False, False, True]), is_similarity=True
    )
    assert sim.threshold.item() == math.inf


def test_perfectly_separable_pairs_score_one():
    d = torch.tensor([0.1, 0.2, 0.25, 0.6, 0.7])
    m = torch.tensor([True, True, True, False, False])
    for metric in METRICS:
        got = select_threshold(d, m, metric=metric)
        assert got.score.item() == 1.0 and got.threshold.item() == pytest.approx(0.25)


@pytest.mark.compile
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    d = torch.rand(50, generator=g).mul(10).round()
    m = torch.rand(50, generator=g) < 0.5
    fn = torch.compile(lambda d, m: select_threshold(d, m, metric="f1"), fullgraph=True)
    got, eager = fn(d, m), select_threshold(d, m, metric="f1")
    assert torch.equal(got.threshold, eager.threshold)
    assert torch.equal(got.score, eager.score)


def test_runs_on_meta_device():
    got = select_threshold(
        torch.empty(10, device="meta"), torch.empty(10, dtype=torch.bool, device="meta")
    )
    assert got.threshold.device.type == "meta" and got.score.shape == ()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: select_threshold([0.1], torch.tensor([True])), TypeError, "distances"),  # type: ignore[arg-type]
        (
            lambda: select_threshold(torch.tensor([1, 2]), torch.tensor([1, 0])),
            TypeError,
            "distances",
        ),
        (
            lambda: select_threshold(torch.tensor([]), torch.tensor([], dtype=torch.bool)),
            ValueError,
            "empty",
        ),
        (lambda: select_threshold(torch.rand(3), torch.rand(3)), TypeError, "is_match"),
        (
            lambda: select_threshold(torch.rand(3), torch.ones(4, dtype=torch.bool)),
            ValueError,
            "is_match",
        ),
        (lambda: select_threshold(torch.rand(3), [True] * 3), TypeError, "is_match"),  # type: ignore[arg-type]
        (
            lambda: select_threshold(torch.rand(3), torch.ones(3, dtype=torch.bool), metric="auc"),
            ValueError,
            "metric",
        ),
    ],
)
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
