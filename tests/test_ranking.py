"""Tests for ``pmlfunc.losses.ranking``: fast_ap, histogram, smooth_ap, pnp, dynamic_soft_margin.

Each loss is checked against a naive float64 loop reference (tests/reference/ranking.py; values
and gradients), PML 2.9.0 (values and full gradients, float64 and float32), ``gradcheck`` of its
temperatures, legal edge cases and bad input. The properties every loss keeps (gradcheck,
torch.func, compile, meta device, a docstring example) are in test_conformance.py.

Known PML 2.9.0 problems (tested against the reference instead of PML):
  (a) SmoothAP groups the batch into consecutive blocks of ``#classes`` rows: right only for
      class-sorted batches with as many samples per class as classes;
  (b) HistogramLoss indexes past its last node for a similarity of exactly 1 (duplicates);
  (c) DynamicSoftMarginLoss keeps the autograd graph in ``hist_`` (a second ``backward`` fails:
      the PML module's ``hist_`` is detached between steps here) and indexes out of range for
      ``d_ap − d_an ≥ min_val + (K−1)Δ``;
  (d) PML computes SmoothAP's AP in a float32 buffer and HistogramLoss's bin offsets in float32,
      so their float64 parity holds to ~1e-7 only.
"""

from __future__ import annotations

import pytest
import torch
from helpers import F32, F64, assert_same, lab, randn, value_and_grads
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from reference import ranking as ranking_ref

import pmlfunc as pf
import pmlfunc.losses.ranking as ranking
from pmlfunc.losses import (
    dynamic_soft_margin,
    dynamic_soft_margin_init_state,
    fast_ap,
    histogram,
    pnp,
    smooth_ap,
)

UNEVEN = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]
SINGLETONS = [5, 5, 1, 7, 7, 3]
REF_LABELS = [0, 1, 1, 5, 3, 3, 0, 2]
TOL = {F64: {"rtol": 1e-9, "atol": 1e-12}, F32: {"rtol": 2e-4, "atol": 2e-6}}
TOL_F32_BUFFER = {"rtol": 1e-5, "atol": 1e-7}  # PML's own float32 internals, see (d)


def pml_pairs(emb, labels):
    return pml_miners.PairMarginMiner(pos_margin=0.2, neg_margin=0.8)(emb, labels)


def pml_triplets(emb, labels):
    return pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="all")(emb, labels)


# ----------------------------------------------------------------------------------------------
# 1. loop references: values and gradients
# ----------------------------------------------------------------------------------------------
def test_fast_ap_matches_reference(gen):
    labels, ref_labels = lab(SINGLETONS), lab(REF_LABELS)
    emb, ref = randn(gen, 6, 4), randn(gen, 8, 4)
    assert_same(
        value_and_grads(lambda e: fast_ap(e, labels, num_bins=5), emb),
        value_and_grads(lambda e: ranking_ref.fast_ap(e, labels, num_bins=5), emb),
        **TOL[F64],
    )
    # A reference set (PML does not support one): rank the references for each query.
    assert_same(
        value_and_grads(
            lambda e, r: fast_ap(
                e, labels, ref_emb=r, ref_labels=ref_labels, distance=pf.distances.lp(power=1)
            ),
            emb,
            ref,
        ),
        value_and_grads(
            lambda e, r: ranking_ref.fast_ap(e, labels, r, ref_labels, power=1), emb, ref
        ),
        **TOL[F64],
    )


def test_histogram_matches_reference(gen):
    labels = lab([0, 0, 1, 1, 1, 2, 3])
    emb = randn(gen, 7, 4)
    assert_same(
        value_and_grads(lambda e: histogram(e, labels, n_bins=8), emb),
        value_and_grads(lambda e: ranking_ref.histogram(e, labels, 8), emb),
        **TOL[F64],
    )
    tup = lmu.get_all_pairs_indices(labels)
    tup = tuple(t[::2] for t in tup)  # a subset of the pairs
    assert_same(
        value_and_grads(lambda e: histogram(e, labels, n_bins=8, indices_tuple=tup), emb),
        value_and_grads(lambda e: ranking_ref.histogram(e, labels, 8, tup), emb),
        **TOL[F64],
    )


def test_histogram_duplicates_fall_on_last_node(gen):
    """(b): a similarity of 1 makes PML index past its last node; here it is the last node."""
    labels = lab([0, 0, 1, 1])
    emb = randn(gen, 4, 3)
    emb = torch.cat([emb[:1], emb[:1], emb[2:]])  # two identical positives: s = 1
    with pytest.raises((IndexError, RuntimeError)):
        pml_losses.HistogramLoss(n_bins=10)(emb, labels)
    got = value_and_grads(lambda e: histogram(e, labels, n_bins=10), emb)
    want = value_and_grads(lambda e: ranking_ref.histogram(e, labels, 10), emb)
    assert_same(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout", [[0, 1, 0, 2, 1, 1, 2], [3, 3, 3, 3, 1, 1]])
def test_smooth_ap_matches_reference_any_layout(layout, gen):
    """Unsorted labels and unequal class sizes (PML rejects or mis-groups them: (a))."""
    labels = lab(layout)
    emb = randn(gen, len(layout), 4)
    tup = pml_pairs(emb, labels)
    for t in (None, tup):
        assert_same(
            value_and_grads(
                lambda e, t=t: smooth_ap(e, labels, temperature=0.2, indices_tuple=t), emb
            ),
            value_and_grads(lambda e, t=t: ranking_ref.smooth_ap(e, labels, 0.2, t), emb),
            **TOL[F64],
        )


def test_smooth_ap_pml_grouping_bug(gen):
    """(a): 2 classes × 4 samples: PML's blocks of 2 rows are not the classes."""
    labels = lab([0, 0, 0, 0, 1, 1, 1, 1])
    emb = randn(gen, 8, 5)
    ours = smooth_ap(emb, labels, temperature=0.1)
    torch.testing.assert_close(ours, ranking_ref.smooth_ap(emb, labels, 0.1), **TOL[F64])
    assert abs(float(pml_losses.SmoothAPLoss(temperature=0.1)(emb, labels)) - float(ours)) > 1e-3


@pytest.mark.parametrize("variant", ["O", "Ds", "Dq", "Iu", "Ib"])
def test_pnp_matches_reference(variant, gen):
    labels = lab([*SINGLETONS, 1])
    emb = randn(gen, 7, 4)
    hp = {"anneal": 0.2, "b": 3.0, "alpha": 1.5}
    assert_same(
        value_and_grads(lambda e: pnp(e, labels, variant=variant, **hp), emb),
        value_and_grads(lambda e: ranking_ref.pnp(e, labels, variant=variant, **hp), emb),
        **TOL[F64],
    )


def test_dynamic_soft_margin_matches_reference(gen):
    labels, ref_labels = lab([0, 0, 1, 1, 1, 2]), lab([1, 0, 2, 2, 3])
    hist = torch.zeros(10, dtype=F64)
    for step in range(3):
        emb, ref = randn(gen, 6, 16), randn(gen, 5, 16)
        state = {"hist": hist}
        got = value_and_grads(
            lambda e, r, s=state: dynamic_soft_margin(
                e, labels, s, ref_emb=r, ref_labels=ref_labels
            ),
            emb,
            ref,
        )
        want = value_and_grads(
            lambda e, r, h=hist: ranking_ref.dynamic_soft_margin(e, labels, h, r, ref_labels)[0],
            emb,
            ref,
        )
        assert_same(got, want, **TOL[F64])
        _, new = dynamic_soft_margin(emb, labels, state, ref_emb=ref, ref_labels=ref_labels)
        _, want_hist = ranking_ref.dynamic_soft_margin(emb, labels, hist, ref, ref_labels)
        torch.testing.assert_close(new["hist"], want_hist, **TOL[F64])
        hist = new["hist"]
        assert step == 0 or float(hist.sum()) == pytest.approx(1.0)


def test_dynamic_soft_margin_unlabelled_unequal_sizes(gen):
    """Matched rows without labels, B ≠ M: PML pads zero terms; here only the matched rows."""
    emb, ref = randn(gen, 5, 16), randn(gen, 7, 16)
    hist = torch.zeros(10, dtype=F64)
    got = value_and_grads(
        lambda e, r: dynamic_soft_margin(e, None, {"hist": hist}, ref_emb=r), emb, ref
    )
    want = value_and_grads(
        lambda e, r: ranking_ref.dynamic_soft_margin(e, None, hist, r)[0], emb, ref
    )
    assert_same(got, want, **TOL[F64])


PAIRS_OF_TWO = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # one positive per row of 16


@pytest.mark.parametrize("layout", [UNEVEN, PAIRS_OF_TWO])
def test_dynamic_soft_margin_product_equals_listed_triplets(layout, gen, monkeypatch):
    """The closed form over all triplets equals the same triplets listed explicitly: over every
    column (UNEVEN) and over each anchor's listed positive columns (few positives, CPU eager)."""
    listed = []
    real = ranking.sparse_rows
    monkeypatch.setattr(ranking, "sparse_rows", lambda pos: listed.append(real(pos)) or listed[-1])
    labels = lab(layout)
    emb = randn(gen, len(layout), 3)  # low dimension: values spread over many bins, clamps hit
    state = {"hist": torch.rand(10, generator=gen, dtype=F64)}
    trip = lmu.get_all_triplets_indices(labels)
    for min_val in (-2.0, -0.5):
        kw = {"min_val": min_val, "momentum": 0.3}
        got = value_and_grads(lambda e, kw=kw: dynamic_soft_margin(e, labels, state, **kw), emb)
        want = value_and_grads(
            lambda e, kw=kw: dynamic_soft_margin(e, labels, state, indices_tuple=trip, **kw), emb
        )
        assert_same(got, want, **TOL[F64])
        h1 = dynamic_soft_margin(emb, labels, state, **kw)[1]["hist"]
        h2 = dynamic_soft_margin(emb, labels, state, indices_tuple=trip, **kw)[1]["hist"]
        torch.testing.assert_close(h1, h2, **TOL[F64])
    assert (listed[0] is not None) == (layout == PAIRS_OF_TWO)


def test_dynamic_soft_margin_listed_positives_equal_every_column(gen):
    """CPU eager with few positives searches only their columns; under a torch.func transform
    (as under compile or on an accelerator) every column is searched: the same loss, gradient
    and state."""
    labels, emb = lab(PAIRS_OF_TWO), randn(gen, len(PAIRS_OF_TWO), 3)
    state = {"hist": torch.rand(10, generator=gen, dtype=F64)}
    eager = value_and_grads(lambda e: dynamic_soft_margin(e, labels, state, momentum=0.3), emb)
    grad, (value, new) = torch.func.grad_and_value(
        lambda e: dynamic_soft_margin(e, labels, state, momentum=0.3), has_aux=True
    )(emb)
    assert_same(eager, (value, [grad]), **TOL[F64])
    want = dynamic_soft_margin(emb, labels, state, momentum=0.3)[1]["hist"]
    torch.testing.assert_close(new["hist"], want, **TOL[F64])


# ----------------------------------------------------------------------------------------------
# 2. PML parity
# ----------------------------------------------------------------------------------------------
def _mined(kind, emb, labels):
    """(pmlfunc indices_tuple, PML indices_tuple)."""
    if kind is None:
        return None, None
    if kind == "pml_pairs":
        t = pml_pairs(emb, labels)
        return t, t
    if kind == "pml_triplets":
        t = pml_triplets(emb, labels)
        return t, t
    if kind == "pf_pairs":
        r = pf.miners.pair_margin(emb, labels, pos_margin=0.2, neg_margin=0.8)
        return r, r.to_indices()
    r = pf.miners.batch_hard(emb, labels)
    return r, r.to_indices()


MINED = [None, "pml_pairs", "pml_triplets", "pf_pairs", "pf_triplets"]


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("mined", MINED)
@pytest.mark.parametrize("layout", [UNEVEN, SINGLETONS])
def test_fast_ap_pml(layout, mined, dtype, gen):
    labels = lab(layout)
    emb = randn(gen, len(layout), 5, dtype=dtype)
    ours_t, pml_t = _mined(mined, emb, labels)
    got = value_and_grads(lambda e: fast_ap(e, labels, indices_tuple=ours_t), emb)
    want = value_and_grads(lambda e: pml_losses.FastAPLoss()(e, labels, pml_t), emb)
    assert_same(got, want, **TOL[dtype])


@pytest.mark.parametrize(
    ("dist", "red"),
    [("power1", "sum"), ("power2", "avg_nonzero"), ("power2", "threshold")],
)
def test_fast_ap_pml_distances_reducers(dist, red, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, 11, 5)
    power = 1 if dist == "power1" else 2
    reducers = {
        "sum": (pf.reducers.sum(), pml_reducers.SumReducer()),
        "avg_nonzero": (pf.reducers.avg_nonzero(), pml_reducers.AvgNonZeroReducer()),
        "threshold": (pf.reducers.threshold(low=0.3), pml_reducers.ThresholdReducer(low=0.3)),
    }[red]
    got = value_and_grads(
        lambda e: fast_ap(
            e, labels, num_bins=7, distance=pf.distances.lp(power=power), reducer=reducers[0]
        ),
        emb,
    )
    pml = pml_losses.FastAPLoss(
        num_bins=7, distance=pml_distances.LpDistance(power=power), reducer=reducers[1]
    )
    assert_same(got, value_and_grads(lambda e: pml(e, labels), emb), **TOL[F64])


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("mined", MINED)
@pytest.mark.parametrize("layout", [UNEVEN, SINGLETONS])
def test_histogram_pml(layout, mined, dtype, gen):
    labels = lab(layout)
    emb = randn(gen, len(layout), 5, dtype=dtype)
    ours_t, pml_t = _mined(mined, emb, labels)
    got = value_and_grads(lambda e: histogram(e, labels, n_bins=20, indices_tuple=ours_t), emb)
    want = value_and_grads(lambda e: pml_losses.HistogramLoss(n_bins=20)(e, labels, pml_t), emb)
    assert_same(got, want, **TOL[F32])  # (d): PML bins in float32 even for float64 input


def test_histogram_pml_defaults_and_delta(gen):
    labels = lab(UNEVEN)
    emb = randn(gen, 11, 5)
    for ours, pml in [({}, {}), ({"delta": 0.05}, {"delta": 0.05})]:
        got = value_and_grads(lambda e, o=ours: histogram(e, labels, **o), emb)
        want = value_and_grads(lambda e, p=pml: pml_losses.HistogramLoss(**p)(e, labels), emb)
        assert_same(got, want, **TOL[F32])  # (d)


@pytest.mark.parametrize("delta", [0.45, 0.6, 0.9, 3.0])
def test_histogram_refuses_a_delta_that_does_not_divide_2(gen, delta):
    """The nodes are ``−1, −1 + Δ, ..., 1``: a ``Δ`` that does not divide 2 leaves the last node
    short of +1, and a similarity above it was extrapolated (a "probability" of 1.05 where the
    estimate is 1). PML fails there; pmlfunc says which argument and why."""
    with pytest.raises(ValueError, match="delta must divide 2"):
        histogram(randn(gen, 6, 3), lab([0, 0, 1, 1, 2, 2]), delta=delta)


def _list_every_row(monkeypatch) -> list[bool]:
    """Make the CPU eager path list every anchor's columns (``sparse_rows`` takes only sparse
    rows by default, none in these small batches) and record, per ``sigmoid_ranks`` call,
    whether it ranked listed columns."""
    import pmlfunc._ops

    monkeypatch.setattr(pmlfunc._ops, "SPARSE_FRACTION", float("inf"))
    calls: list[bool] = []
    inner = ranking.sigmoid_ranks

    def spy(*args, **kwargs):
        calls.append(kwargs.get("cols") is not None)
        return inner(*args, **kwargs)

    monkeypatch.setattr(ranking, "sigmoid_ranks", spy)
    return calls


@pytest.mark.parametrize("listing", ["default", "listed"])
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("mined", [None, "pml_pairs", "pf_triplets"])
@pytest.mark.parametrize(
    "layout", [[0, 0, 0, 1, 1, 1, 2, 2, 2], [4, 4, 9, 9], [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4]
)
def test_smooth_ap_pml(layout, mined, dtype, listing, gen, monkeypatch):
    """Class-sorted batches with m samples per class = #classes (where PML is right: (a)); also
    with the ranks taken on each anchor's listed group members only (CPU eager, small
    classes)."""
    calls = _list_every_row(monkeypatch) if listing == "listed" else None
    labels = lab(layout)
    emb = randn(gen, len(layout), 5, dtype=dtype)
    ours_t, pml_t = _mined(mined, emb, labels)
    got = value_and_grads(
        lambda e: smooth_ap(e, labels, temperature=0.1, indices_tuple=ours_t), emb
    )
    want = value_and_grads(
        lambda e: pml_losses.SmoothAPLoss(temperature=0.1)(e, labels, pml_t), emb
    )
    assert_same(got, want, **(TOL_F32_BUFFER if dtype == F64 else TOL[dtype]))
    assert calls is None or (calls and all(calls))


def test_smooth_ap_pml_default_temperature_and_sum(gen):
    labels = lab([0, 0, 0, 1, 1, 1, 2, 2, 2])
    emb = randn(gen, 9, 5)
    got = value_and_grads(lambda e: smooth_ap(e, labels, reducer=pf.reducers.sum()), emb)
    pml = pml_losses.SmoothAPLoss(reducer=pml_reducers.SumReducer())
    assert_same(got, value_and_grads(lambda e: pml(e, labels), emb), **TOL_F32_BUFFER)


@pytest.mark.parametrize("listing", ["default", "listed"])
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("variant", ["O", "Ds", "Dq", "Iu", "Ib"])
@pytest.mark.parametrize("layout", [UNEVEN, SINGLETONS])
def test_pnp_pml(layout, variant, dtype, listing, gen, monkeypatch):
    """Also with the ranks taken on each anchor's listed positives only (CPU eager, small
    classes: the default at B = 512 with 4 per class)."""
    calls = _list_every_row(monkeypatch) if listing == "listed" else None
    labels = lab(layout)
    emb = randn(gen, len(layout), 5, dtype=dtype)
    hp = {"anneal": 0.05, "b": 3.0, "alpha": 2.0}
    got = value_and_grads(lambda e: pnp(e, labels, variant=variant, **hp), emb)
    want = value_and_grads(lambda e: pml_losses.PNPLoss(variant=variant, **hp)(e, labels), emb)
    assert_same(got, want, **TOL[dtype])
    assert calls is None or calls == [True]


def test_pnp_pml_defaults(gen):
    labels = lab(UNEVEN)
    emb = randn(gen, 11, 5)
    got = value_and_grads(lambda e: pnp(e, labels), emb)
    assert_same(got, value_and_grads(lambda e: pml_losses.PNPLoss()(e, labels), emb), **TOL[F64])


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("mined", MINED)
def test_dynamic_soft_margin_pml_steps(mined, dtype, gen):
    labels = lab(UNEVEN)
    pml = pml_losses.DynamicSoftMarginLoss()
    inputs = []
    for _ in range(3):
        emb = randn(gen, 11, 32, dtype=dtype)
        ours_t, pml_t = _mined(mined, emb, labels)
        inputs.append(((emb,), {"indices_tuple": ours_t}, (pml_t,)))

    def ours(e, state, indices_tuple):
        return dynamic_soft_margin(e, labels, state, indices_tuple=indices_tuple)

    def pml_call(e, t):
        return pml(e, labels, t)

    state = dynamic_soft_margin_init_state(dtype=dtype)
    for (emb,), kw, (pml_t,) in inputs:
        pml.hist_ = pml.hist_.detach()
        want = value_and_grads(lambda e, t=pml_t: pml_call(e, t), emb)
        got = value_and_grads(lambda e, s=state, kw=kw: ours(e, s, **kw), emb)
        assert_same(got, want, **TOL[dtype])
        state = ours(emb, state, **kw)[1]
        assert state["hist"].dtype == dtype
        torch.testing.assert_close(state["hist"], pml.hist_.detach(), **TOL[dtype])


@pytest.mark.parametrize("setting", ["ref_labels", "no_labels", "no_labels_self", "power2"])
def test_dynamic_soft_margin_pml_settings(setting, gen):
    labels, ref_labels = lab(UNEVEN), lab(REF_LABELS)
    kw = {"min_val": -1.5, "num_bins": 12, "momentum": 0.2}
    dist = (
        (pf.distances.lp(power=2), pml_distances.LpDistance(power=2))
        if setting == "power2"
        else (None, None)
    )
    pml = pml_losses.DynamicSoftMarginLoss(**kw, **({"distance": dist[1]} if dist[1] else {}))
    state = dynamic_soft_margin_init_state(12, dtype=F64)
    for _ in range(3):
        emb = randn(gen, 11, 32)
        ref = randn(gen, 8 if setting == "ref_labels" else 11, 32)
        pml.hist_ = pml.hist_.detach()
        if setting == "ref_labels":
            args, ours_kw, pml_call = (
                (emb, ref),
                {"ref_labels": ref_labels},
                lambda e, r: pml(e, labels, None, r, ref_labels),
            )
            lbl = labels
        elif setting == "no_labels":
            args, ours_kw, pml_call = (emb, ref), {}, lambda e, r: pml(e, None, None, r)
            lbl = None
        else:
            args, ours_kw, lbl = (emb,), {}, None if setting == "no_labels_self" else labels
            pml_call = (lambda e, y=lbl: pml(e, y)) if setting == "power2" else (lambda e: pml(e))

        def f(*t, s=state, lbl=lbl, ours_kw=ours_kw):
            extra = {"ref_emb": t[1], **ours_kw} if len(t) == 2 else {}
            return dynamic_soft_margin(t[0], lbl, s, distance=dist[0], **extra, **kw)

        got = value_and_grads(f, *args)
        if lbl is None:
            # PML fills the diagonal of its distance matrix in place: its backward fails, so
            # values come from PML and gradients from the loop reference.
            h0 = pml.hist_
            with pytest.raises(RuntimeError, match="inplace"):
                value_and_grads(pml_call, *args)
            pml.hist_ = h0
            with torch.no_grad():
                want_v = pml_call(*args)
            r = args[1] if len(args) == 2 else None
            want = (
                want_v,
                value_and_grads(
                    lambda *t, h=state["hist"], r=r: ranking_ref.dynamic_soft_margin(
                        t[0],
                        None,
                        h,
                        t[1] if r is not None else None,
                        min_val=-1.5,
                        k=12,
                        momentum=0.2,
                    )[0],
                    *args,
                )[1],
            )
        else:
            want = value_and_grads(pml_call, *args)
        assert_same(got, want, **TOL[F64])
        state = f(*args)[1]
        torch.testing.assert_close(state["hist"], pml.hist_.detach(), **TOL[F64])


# ----------------------------------------------------------------------------------------------
# 3. gradcheck of the temperatures, the chunked sigmoid ranks
# ----------------------------------------------------------------------------------------------
def test_gradcheck_with_respect_to_temperatures(gen):
    """The temperatures as 0-d tensors get the derivative of the loss (embeddings' gradients:
    test_conformance.py)."""
    labels = lab([0, 0, 1, 1, 1, 2])
    emb = randn(gen, 6, 3).requires_grad_(True)
    temp = torch.tensor(0.3, dtype=F64, requires_grad=True)
    checks = [
        (lambda e, t: smooth_ap(e, labels, temperature=t), (emb, temp)),
        (lambda e, t: pnp(e, labels, anneal=t, variant="Ds"), (emb, temp)),
    ]
    for fn, args in checks:
        assert torch.autograd.gradcheck(fn, args, eps=1e-7, atol=1e-6)


@pytest.mark.parametrize("listed", [False, True], ids=["every-column", "listed-columns"])
def test_sigmoid_ranks_chunks_equal_direct(gen, monkeypatch, listed):
    """The chunked function (any chunk size), on every column or on listed columns per anchor
    (repeats included), equals the direct B × M × M autograd formula read at those columns."""
    s = randn(gen, 7, 9).requires_grad_(True)
    w = (torch.rand(2, 7, 9, generator=gen, dtype=F64) > 0.4).to(F64)
    tau = torch.tensor(0.2, dtype=F64, requires_grad=True)
    cols = torch.randint(0, 9, (7, 4), generator=gen) if listed else None
    g = randn(gen, 2, 7, 9 if cols is None else 4)

    def direct(s, tau, clamp=None):
        z = (s.unsqueeze(-2) - s.unsqueeze(-1)) / tau
        if clamp is not None:
            z = z.clamp(-clamp, clamp)
        r = torch.einsum("ajk,qak->qaj", torch.sigmoid(z), w)
        return r if cols is None else r.gather(-1, cols.expand(2, -1, -1))

    for clamp in (None, 1.5):
        want = value_and_grads(lambda s, t, c=clamp: (direct(s, t, c) * g).sum(), s, tau)
        for chunk in (1, 2, 7):
            monkeypatch.setattr(
                ranking, "cube_chunk", lambda m, device=None, width=None, c=chunk: c
            )
            got = value_and_grads(
                lambda s, t, c=clamp: (
                    ranking.sigmoid_ranks(s, w, t, clamp=c, cols=cols) * g
                ).sum(),
                s,
                tau,
            )
            assert_same(got, want, **TOL[F64])


# ----------------------------------------------------------------------------------------------
# 4. meta device, dtypes
# ----------------------------------------------------------------------------------------------
def test_dynamic_soft_margin_unlabelled_and_its_state_on_meta():
    """Matched rows without labels (the labelled path: test_conformance.py), from a state made
    on meta."""
    emb = torch.empty(9, 4, device="meta")
    state = dynamic_soft_margin_init_state(device="meta")
    assert state["hist"].device.type == "meta"
    loss, new = dynamic_soft_margin(emb, None, state)
    assert loss.device.type == "meta" and loss.ndim == 0
    assert new["hist"].device.type == "meta" and new["hist"].shape == state["hist"].shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_returns_float32(dtype, gen):
    labels = lab(UNEVEN)
    emb = randn(gen, 11, 8)
    for fn in (fast_ap, histogram, smooth_ap, pnp):
        out = fn(emb.to(dtype), labels)
        assert out.dtype == torch.float32
        torch.testing.assert_close(
            out.float(), fn(emb.to(dtype).float(), labels).float(), rtol=1e-2, atol=1e-2
        )
    loss, state = dynamic_soft_margin(emb.to(dtype), labels)
    assert loss.dtype == torch.float32 and state["hist"].dtype == torch.float32
    loss, state = dynamic_soft_margin(emb.to(dtype), labels, {"hist": state["hist"].to(dtype)})
    assert loss.dtype == torch.float32 and state["hist"].dtype == dtype  # the state's own dtype


# ----------------------------------------------------------------------------------------------
# 5. legal edge cases
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout",
    [[0, 1, 2, 3, 4], [2, 2, 2, 2, 2], [7], [0, 0, 1, 1, 2]],
    ids=["no_pos", "one_class", "one", "dup"],
)
def test_edge_cases_finite(layout, gen):
    labels = lab(layout)
    emb = randn(gen, len(layout), 4)
    if len(layout) == 5:
        emb[1] = emb[0]  # duplicates
    fns = {
        "fast_ap": lambda e: fast_ap(e, labels),
        "histogram": lambda e: histogram(e, labels),
        "smooth_ap": lambda e: smooth_ap(e, labels),
        "pnp": lambda e: pnp(e, labels, variant="Dq"),
        "dsm": lambda e: dynamic_soft_margin(e, labels),
        "dsm_unlabelled": lambda e: dynamic_soft_margin(e, None),
    }
    for name, fn in fns.items():
        v, (g,) = value_and_grads(fn, emb)
        assert torch.isfinite(v) and torch.isfinite(g).all(), name
        if len(set(layout)) == len(layout) or len(set(layout)) == 1:  # no pos or no neg pair
            if name in ("fast_ap", "histogram", "pnp", "dsm"):
                assert float(v) == pytest.approx(0.0, abs=1e-12), name


def test_dynamic_soft_margin_without_triplets_keeps_state(gen):
    state = {"hist": torch.rand(10, generator=gen)}
    loss, new = dynamic_soft_margin(randn(gen, 4, 4, dtype=F32), lab([0, 1, 2, 3]), state)
    assert float(loss) == 0.0
    torch.testing.assert_close(new["hist"], state["hist"])


def test_dynamic_soft_margin_out_of_range_is_clamped(gen):
    """(c): d_ap − d_an near +2 (PML raises) lands in the last bin; the loss stays finite."""
    emb = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 1e-3]], dtype=F64)
    labels = lab([0, 0, 1])
    with pytest.raises(RuntimeError):
        pml_losses.DynamicSoftMarginLoss()(emb, labels)
    loss, state = dynamic_soft_margin(emb, labels)
    assert torch.isfinite(loss) and float(state["hist"][-1]) > 0.4


def test_inputs_not_modified(gen):
    labels = lab(UNEVEN)
    emb = randn(gen, 11, 4)
    state = dynamic_soft_margin_init_state(dtype=F64)
    before = (emb.clone(), state["hist"].clone())
    mat = pf.distances.lp()(emb)
    mat_before = mat.clone()
    dynamic_soft_margin(emb, None, state, mat=mat)
    fast_ap(emb, labels)
    torch.testing.assert_close(emb, before[0])
    torch.testing.assert_close(state["hist"], before[1])
    torch.testing.assert_close(mat, mat_before)  # PML fills the diagonal of mat in place


# ----------------------------------------------------------------------------------------------
# 6. bad input
# ----------------------------------------------------------------------------------------------
def test_bad_input(gen):
    labels = lab([0, 0, 1, 1])
    emb = randn(gen, 4, 3)
    ref = randn(gen, 4, 3)
    cases = [
        (ValueError, "distance", lambda: fast_ap(emb, labels, distance=pf.distances.cosine())),
        (
            ValueError,
            "labels",
            lambda: fast_ap(emb, None, indices_tuple=lmu.get_all_pairs_indices(labels)),
        ),
        (ValueError, "num_bins", lambda: fast_ap(emb, labels, num_bins=0)),
        (TypeError, "num_bins", lambda: fast_ap(emb, labels, num_bins=2.5)),
        (ValueError, "delta", lambda: histogram(emb, labels, n_bins=10, delta=0.3)),
        (ValueError, "reducer", lambda: histogram(emb, labels, reducer=pf.reducers.mean())),
        (ValueError, "ref_emb", lambda: histogram(emb, labels, ref_emb=ref, ref_labels=labels)),
        (ValueError, "ref_emb", lambda: smooth_ap(emb, labels, ref_emb=ref, ref_labels=labels)),
        (ValueError, "temperature", lambda: smooth_ap(emb, labels, temperature=0.0)),
        (ValueError, "variant", lambda: pnp(emb, labels, variant="X")),
        (
            ValueError,
            "indices_tuple",
            lambda: pnp(emb, labels, indices_tuple=lmu.get_all_pairs_indices(labels)),
        ),
        (ValueError, "ref_emb", lambda: pnp(emb, labels, ref_emb=ref, ref_labels=labels)),
        (ValueError, "embeddings", lambda: pnp(emb[0], labels)),
        (TypeError, "labels", lambda: smooth_ap(emb, labels.float())),
        (
            ValueError,
            "state",
            lambda: dynamic_soft_margin(emb, labels, {"hist": torch.zeros(5, dtype=F64)}),
        ),
        (TypeError, "state", lambda: dynamic_soft_margin(emb, labels, torch.zeros(10))),
        (ValueError, "num_bins", lambda: dynamic_soft_margin(emb, labels, num_bins=1)),
        (
            ValueError,
            "reducer",
            lambda: dynamic_soft_margin(emb, labels, reducer=pf.reducers.sum()),
        ),
        (
            ValueError,
            "distance",
            lambda: dynamic_soft_margin(emb, labels, distance=pf.distances.lp(normalize=False)),
        ),
        (
            ValueError,
            "ref_labels",
            lambda: dynamic_soft_margin(emb, None, ref_emb=ref, ref_labels=labels),
        ),
        (ValueError, "ref_emb", lambda: dynamic_soft_margin(emb, None, ref_emb=ref[:, :2])),
        (
            ValueError,
            "MinedPairs",
            lambda: dynamic_soft_margin(
                emb, labels, indices_tuple=pf.miners.triplet_margin(emb, labels)
            ),
        ),
    ]
    for exc, word, fn in cases:
        with pytest.raises(exc, match=word):
            fn()


@pytest.mark.parametrize(
    "distance",
    [pf.distances.lp(), pf.distances.dot(), pf.distances.snr()],
    ids=["lp", "dot", "snr"],
)
def test_histogram_refuses_a_distance_outside_its_bins(distance):
    """The bins cover similarities in [-1, 1]: another distance's values fell outside them and
    gave a "probability" of 16 (lp), 24 (dot) or 104 (snr); PML crashes with an index error."""
    emb, labels = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    with pytest.raises(ValueError, match=r"distance must be cosine\(\) or dot\(normalize=True\)"):
        pf.losses.histogram(emb, labels, distance=distance)
    pf.losses.histogram(emb, labels, distance=pf.distances.dot(normalize=True))
