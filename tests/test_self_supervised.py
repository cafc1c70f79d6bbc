"""Tests for ``pmlfunc.losses.self_supervised``: ``vicreg`` and ``barlow_twins``.

Checked against a naive float64 loop reference (PML 2.9.0's semantics, tests/reference/) and
against PML 2.9.0's ``VICRegLoss`` (values and the gradients of both views), with reducers, wide
embeddings, tensor hyper-parameters, edge cases, ``vmap`` and bad input. The properties every
loss keeps are in test_conformance.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F32, F64, assert_same, assert_vmap_equals_a_loop, randn, value_and_grads
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import reducers as pml_reducers
from reference import self_supervised
from tracking import DispatchedOps

import pmlfunc as pf
import pmlfunc.reducers as pfr
from pmlfunc.losses import barlow_twins, vicreg

REF_TOL = {"rtol": 1e-9, "atol": 1e-12}
TOL = {F64: {"rtol": 1e-9, "atol": 1e-12}, F32: {"rtol": 2e-4, "atol": 2e-6}}

VICREG_HP = {"invariance_lambda": 3.0, "variance_mu": 5.0, "covariance_v": 0.7, "eps": 1e-3}


@pytest.mark.parametrize("reducer", ["mean", "sum", "avg_nonzero"])
def test_vicreg_reference(gen, reducer):
    z1, z2 = randn(gen, 6, 4) * 0.3, randn(gen, 6, 4) * 0.3  # variance below 1: hinges active
    pfr_red = {"mean": pfr.mean, "sum": pfr.sum, "avg_nonzero": pfr.avg_nonzero}[reducer]()
    got = value_and_grads(lambda a, b: vicreg(a, b, **VICREG_HP, reducer=pfr_red), z1, z2)
    want = value_and_grads(
        lambda a, b: self_supervised.vicreg(a, b, 3.0, 5.0, 0.7, 1e-3, reducer),
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
        assert out.dtype == torch.float32 and torch.isfinite(out)
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


def test_vicreg_vmap_equals_a_loop(gen):
    emb = randn(gen, 9, 4)

    assert_vmap_equals_a_loop(lambda x: vicreg(x, emb.flip(0)), emb)


# ----------------------------------------------------------------------------------------------
# barlow_twins: float64 loops, the global statistics under DDP (all-reduced, no gather)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hp",
    [{}, {"lambda_param": 0.3}, {"unbiased": False, "eps": 1e-5}, {"lambda_param": 0.0}],
    ids=["paper", "lambda", "batchnorm", "no-redundancy"],
)
def test_barlow_twins_equals_the_float64_loops_on_values_and_both_gradients(gen, hp):
    z1 = randn(gen, 7, 5)
    z2 = z1 + 0.7 * randn(gen, 7, 5)
    got = value_and_grads(lambda a, b: barlow_twins(a, b, **hp), z1, z2)
    want = value_and_grads(lambda a, b: self_supervised.barlow_twins(a, b, **hp), z1, z2)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("hp", [{}, {"unbiased": False, "eps": 1e-5}], ids=["paper", "batchnorm"])
def test_barlow_twins_written_out_backward_has_second_derivatives(gen, hp):
    """The one-process loss's backward is written out (``_BarlowTwins``); recorded, it gives
    the second derivatives of both views (gradgradcheck, float64)."""
    z1 = randn(gen, 7, 5).requires_grad_()
    z2 = (z1.detach() + 0.7 * randn(gen, 7, 5)).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: barlow_twins(a, b, **hp), (z1, z2))


def test_barlow_twins_tensor_hyper_parameters_get_their_gradients(gen):
    """Tensor ``lambda_param`` and ``eps`` take the composed path: the same loss and view
    gradients as floats, and gradients of their own (float64 loops for the values)."""
    z1, z2 = randn(gen, 7, 5), randn(gen, 7, 5)
    lam, eps = torch.tensor(0.3, dtype=F64), torch.tensor(1e-3, dtype=F64)
    got = value_and_grads(
        lambda a, b, lp, e: barlow_twins(a, b, lambda_param=lp, eps=e), z1, z2, lam, eps
    )
    want = value_and_grads(
        lambda a, b, lp, e: self_supervised.barlow_twins(a, b, lambda_param=lp, eps=e),
        z1,
        z2,
        lam,
        eps,
    )
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    floats = value_and_grads(lambda a, b: barlow_twins(a, b, lambda_param=0.3, eps=1e-3), z1, z2)
    assert_same(floats, (got[0], got[1][:2]), rtol=1e-10, atol=1e-12)


def test_barlow_twins_dispatches_few_ops():
    """Forward and backward at 512 × 128 in at most 64 aten ops (autograd's composed graph of
    the same loss: 106; each op costs a few µs on a CPU, where lightly's ``F.batch_norm`` form
    was faster before)."""
    a, b = torch.randn(512, 128, requires_grad=True), torch.randn(512, 128, requires_grad=True)
    with DispatchedOps() as rec:
        torch.autograd.grad(barlow_twins(a, b, unbiased=False, eps=1e-5), [a, b])
    assert rec.count <= 64, rec.names


def test_barlow_twins_is_zero_for_identical_decorrelated_views():
    """Two equal views whose dimensions are uncorrelated over the batch: ``C = I``, ``L = 0``."""
    z = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    torch.testing.assert_close(barlow_twins(z, z, unbiased=False), torch.tensor(0.0, dtype=F64))


def test_barlow_twins_low_precision_views_give_float32_statistics(gen):
    z1, z2 = randn(gen, 32, 6), randn(gen, 32, 6)
    got = barlow_twins(z1.to(torch.bfloat16), z2.to(torch.bfloat16))
    want = barlow_twins(z1.to(torch.bfloat16).double(), z2.to(torch.bfloat16).double())
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_barlow_twins_a_constant_dimension_without_eps_is_nan():
    z = torch.randn(6, 3, dtype=F64)
    z[:, 1] = 2.0
    assert torch.isnan(barlow_twins(z, torch.randn(6, 3, dtype=F64)))
    assert torch.isfinite(barlow_twins(z, torch.randn(6, 3, dtype=F64), eps=1e-5))


@pytest.mark.parametrize("sizes", [(3, 7), (0, 4, 6)], ids=["unequal", "an-empty-rank"])
def test_barlow_twins_under_global_objective_is_the_single_process_loss(gen, sizes):
    """Every rank's loss and both views' gradients equal one process's on the whole batch
    (each rank's statistics all-reduced: the mean, the variance and ``C`` of the global batch,
    where standardising each rank's rows on their own would not give it)."""
    z1 = randn(gen, 10, 4) + torch.arange(10, dtype=F64).unsqueeze(-1)  # ranks' means differ
    z2 = z1 + 0.5 * randn(gen, 10, 4)
    report = pf.testing.check_distributed(
        barlow_twins, z1, z2, world_size=len(sizes), sizes=sizes, rtol=1e-9, atol=1e-11,
        lambda_param=0.1,
    )  # fmt: skip
    assert set(report.grad_diffs) == {"emb_a", "emb_b"}


def test_barlow_twins_refuses_the_ring():
    with pytest.raises(ValueError, match=r"batch statistics.*exchange='gather'"):
        pf.distributed.global_objective(barlow_twins, exchange="ring")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"emb_b": torch.randn(5, 4, dtype=F64)}, ValueError, "as many"),
        ({"emb_b": torch.randn(6, 3, dtype=F64)}, ValueError, "embedding size"),
        ({"lambda_param": -1.0}, ValueError, "lambda_param"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"emb_a": torch.zeros(0, 4, dtype=F64)}, ValueError, "emb_a"),
        # one row (NaN, or with eps a finite D: lightly's batch norm refuses it too)
        (
            {"emb_a": torch.randn(1, 4, dtype=F64), "emb_b": torch.randn(1, 4, dtype=F64)},
            ValueError,
            "at least 2 rows in emb_a",
        ),
    ],
)
def test_barlow_twins_bad_input_raises_naming_the_argument(change, error, match):
    kw = {"emb_a": torch.randn(6, 4, dtype=F64), "emb_b": torch.randn(6, 4, dtype=F64), **change}
    with pytest.raises(error, match=match):
        barlow_twins(**kw)


@pytest.mark.parametrize(
    ("reducer", "sizes"),
    [("mean", (3, 7)), ("sum", (0, 4, 6)), ("avg_nonzero", (5, 5)), ("threshold", (2, 8))],
)
def test_vicreg_under_global_objective_is_the_single_process_loss(gen, reducer, sizes):
    """The invariance term's reducer (its normaliser and each rank's share summed), each view's
    variance and covariance of the global batch, all-reduced: every rank's loss and both views'
    gradients equal one process's on the whole batch, unequal and empty ranks included."""
    z1 = 0.3 * randn(gen, 10, 4) + torch.arange(10, dtype=F64).unsqueeze(-1) / 10
    z2 = z1 + 0.2 * randn(gen, 10, 4)
    red = {
        "mean": pfr.mean(),
        "sum": pfr.sum(),
        "avg_nonzero": pfr.avg_nonzero(),
        "threshold": pfr.threshold(low=0.05),
    }[reducer]
    report = pf.testing.check_distributed(
        vicreg, z1, z2, world_size=len(sizes), sizes=sizes, rtol=1e-9, atol=1e-11,
        reducer=red, **VICREG_HP,
    )  # fmt: skip
    assert set(report.grad_diffs) == {"embeddings", "ref_emb"}


# ----------------------------------------------------------------------------------------------
# negative cosine similarity (SimSiam, BYOL) and the hypersphere loss
# ----------------------------------------------------------------------------------------------
def test_negative_cosine_similarity_equals_the_float64_loops(gen):
    a, b = randn(gen, 6, 5), randn(gen, 6, 5)
    a[2] = 0.0  # a zero row: the cosine's ε keeps it finite (0)
    got = value_and_grads(lambda x, y: pf.losses.negative_cosine_similarity(x, y), a, b)
    want = value_and_grads(lambda x, y: self_supervised.negative_cosine_similarity(x, y), a, b)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


def test_sym_neg_cosine_similarity_equals_the_loops_and_sends_nothing_to_the_projections(gen):
    z0, p0, z1, p1 = (randn(gen, 6, 5) for _ in range(4))
    got = value_and_grads(pf.losses.sym_neg_cosine_similarity, z0, p0, z1, p1)
    want = value_and_grads(self_supervised.sym_neg_cosine_similarity, z0, p0, z1, p1)
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    assert not got[1][0].any() and not got[1][2].any()  # z0, z1: stop-gradient


@pytest.mark.parametrize("hp", [{}, {"t": 2.0, "lam": 0.5, "alpha": 1.0}], ids=["default", "hp"])
def test_hypersphere_equals_the_float64_loops(gen, hp):
    a = randn(gen, 7, 4)
    b = a + 0.3 * randn(gen, 7, 4)
    got = value_and_grads(lambda x, y: pf.losses.hypersphere(x, y, **hp), a, b)
    want = value_and_grads(lambda x, y: self_supervised.hypersphere(x, y, **hp), a, b)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


def test_hypersphere_uniformity_is_stable_at_a_high_temperature(gen):
    """``log mean exp(−t d²)`` as a log-sum-exp: at ``t = 500`` every exponential underflows in
    float32, the loss does not."""
    a, b = randn(gen, 8, 4, dtype=F32), randn(gen, 8, 4, dtype=F32)
    got = pf.losses.hypersphere(a, b, t=500.0)
    want = pf.losses.hypersphere(a.double(), b.double(), t=500.0)
    assert torch.isfinite(got)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("name", "args"),
    [("negative_cosine_similarity", 2), ("sym_neg_cosine_similarity", 4), ("hypersphere", 2)],
)
def test_two_view_losses_under_global_objective_are_the_single_process_loss(gen, name, args):
    """Means over rows all-reduced (the negative cosine similarities), or the views gathered
    (the hypersphere's uniformity reads every pair): unequal ranks and an empty one."""
    views = [randn(gen, 9, 4) for _ in range(args)]
    fn = getattr(pf.losses, name)
    report = pf.testing.check_distributed(
        fn, *views, world_size=3, sizes=(0, 4, 5), rtol=1e-9, atol=1e-11
    )
    assert len(report.grad_diffs) == args


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: pf.losses.negative_cosine_similarity(torch.randn(4, 3), torch.randn(5, 3)),
            ValueError,
            "as many",
        ),
        (
            lambda: pf.losses.negative_cosine_similarity(
                torch.randn(4, 3), torch.randn(4, 3), eps=0.0
            ),
            ValueError,
            "eps",
        ),
        (
            lambda: pf.losses.sym_neg_cosine_similarity(
                *(torch.randn(4, 3),) * 3, torch.randn(4, 2)
            ),
            ValueError,
            "p1",
        ),
        (
            lambda: pf.losses.hypersphere(torch.randn(1, 3), torch.randn(1, 3)),
            ValueError,
            "at least 2",
        ),
        (
            lambda: pf.losses.hypersphere(torch.randn(4, 3), torch.randn(4, 3), t=0.0),
            ValueError,
            "t",
        ),
        (
            lambda: pf.losses.hypersphere(torch.randn(4, 3), torch.randn(4, 3), lam=-1.0),
            ValueError,
            "lam",
        ),
    ],
)
def test_two_view_losses_bad_input_raises_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------------------------
# dino: the centre as explicit state
# ----------------------------------------------------------------------------------------------
def _dino_views(gen, n=6, v_t=2, v_s=4, k=5):
    return randn(gen, n, v_t, k), randn(gen, n, v_s, k), 0.1 * randn(gen, k)


@pytest.mark.parametrize(
    "hp",
    [
        {},
        {
            "teacher_temp": torch.tensor(0.07, dtype=F64),
            "student_temp": 0.2,
            "center_momentum": 0.5,
        },
    ],
    ids=["default", "scheduled-teacher-temperature"],
)
def test_dino_equals_the_float64_loops_on_loss_gradient_and_new_centre(gen, hp):
    teacher, student, center = _dino_views(gen)
    state = {"center": center.clone()}
    got = value_and_grads(lambda t, s: pf.losses.dino(t, s, state, **hp), teacher, student)
    want = value_and_grads(lambda t, s: self_supervised.dino(t, s, center, **hp), teacher, student)
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    assert not got[1][0].any()  # the teacher gets no gradient
    _, new = pf.losses.dino(teacher, student, state, **hp)
    torch.testing.assert_close(
        new["center"], self_supervised.dino(teacher, student, center, **hp)[1]
    )
    torch.testing.assert_close(state["center"], center)  # the state given is not changed
    assert not new["center"].requires_grad


def test_dino_centre_follows_its_momentum_over_steps(gen):
    """Ten steps with the same teacher outputs: the centre moves to their mean geometrically,
    ``c_k = (1 − m^k) · mean``."""
    teacher, student, _ = _dino_views(gen)
    state = pf.losses.dino_init(5, dtype=F64)
    for _ in range(10):
        _, state = pf.losses.dino(teacher, student, state, center_momentum=0.8)
    torch.testing.assert_close(state["center"], (1 - 0.8**10) * teacher.mean((0, 1)))


def dino_loss(teacher, student, state, **hp):
    """:func:`pf.losses.dino`'s loss alone (check_distributed compares a loss)."""
    return pf.losses.dino(teacher, student, state, **hp)[0]


def dino_loss_global(teacher, student, state, **hp):
    return pf.distributed.global_objective(pf.losses.dino)(teacher, student, state, **hp)[0]


def new_state_on_rank(name, first, second, state, sizes):
    """One rank's new state from ``global_objective(pf.losses.<name>)`` on its rows of the
    batch (a stateful loss of two batch arguments)."""
    import torch.distributed as dist

    r0 = sum(sizes[: dist.get_rank()])
    rows = slice(r0, r0 + sizes[dist.get_rank()])
    loss_fn = pf.distributed.global_objective(getattr(pf.losses, name))
    return loss_fn(first[rows], second[rows], state)[1]


def test_dino_under_global_objective_is_the_single_process_loss_and_centre(gen):
    """The means over rows and the centre's batch mean all-reduced: every rank's loss and the
    student's gradient, and every rank's new centre, equal one process's on the whole batch
    (ranks of 0, 2 and 4 rows)."""
    teacher, student, center = _dino_views(gen)
    state, sizes = {"center": center}, (0, 2, 4)
    pf.testing.check_distributed(
        dino_loss, teacher, student, state, world_size=3, sizes=sizes, rtol=1e-9, atol=1e-11,
        distributed_fn=dino_loss_global,
    )  # fmt: skip
    centres = pf.testing.spawn_ranks(
        new_state_on_rank, "dino", teacher, student, state, sizes, world_size=3
    )
    want = pf.losses.dino(teacher, student, state)[1]["center"]
    for got in centres:
        torch.testing.assert_close(got["center"], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"student_out": torch.randn(6, 1, 5)}, ValueError, "at least max"),
        ({"student_out": torch.randn(5, 4, 5)}, ValueError, "student_out must be"),
        ({"teacher_out": torch.randn(6, 5)}, ValueError, "teacher_out must be"),
        ({"state": {"center": torch.zeros(4)}}, ValueError, "center"),
        ({"state": {}}, TypeError, "dino_init"),
        ({"teacher_temp": 0.0}, ValueError, "teacher_temp"),
        ({"center_momentum": 1.5}, ValueError, "center_momentum"),
    ],
)
def test_dino_bad_input_raises_naming_the_argument(change, error, match):
    kw = {
        "teacher_out": torch.randn(6, 2, 5),
        "student_out": torch.randn(6, 4, 5),
        "state": pf.losses.dino_init(5),
        **change,
    }
    with pytest.raises(error, match=match):
        pf.losses.dino(**kw)


# ----------------------------------------------------------------------------------------------
# swav: Sinkhorn-Knopp codes of the global batch
# ----------------------------------------------------------------------------------------------
def _swav_crops(gen, n=6, v_h=2, v_l=3, k=4):
    return randn(gen, n, v_h, k).tanh(), randn(gen, n, v_l, k).tanh()


@pytest.mark.parametrize(
    "hp",
    [
        {},
        {"temperature": 0.3, "sinkhorn_iterations": 5, "sinkhorn_epsilon": 0.1},
        {"sinkhorn_iterations": 0},  # the codes times B still: each sample's sum 1 on average
    ],
    ids=["default", "hp", "no-iteration"],
)
@pytest.mark.parametrize("with_low", [True, False], ids=["low-resolution", "high-only"])
def test_swav_equals_the_float64_loops(gen, hp, with_low):
    high, low = _swav_crops(gen)
    ref_hp = {
        "temperature": hp.get("temperature", 0.1),
        "iterations": hp.get("sinkhorn_iterations", 3),
        "eps": hp.get("sinkhorn_epsilon", 0.05),
    }
    if with_low:
        got = value_and_grads(lambda h, lo: pf.losses.swav(h, lo, **hp), high, low)
        want = value_and_grads(lambda h, lo: self_supervised.swav(h, lo, **ref_hp), high, low)
    else:
        got = value_and_grads(lambda h: pf.losses.swav(h, **hp), high)
        want = value_and_grads(lambda h: self_supervised.swav(h, **ref_hp), high)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_swav_with_a_queue_equals_lightly(gen, dtype):
    """``queue_outputs``: earlier rows join the Sinkhorn equipartition and are dropped; lightly's
    ``SwaVLoss(...)(high, low, queue_outputs)`` with its lists stacked on dimension 1. Without a
    queue, lightly's too; with no Sinkhorn iteration, the codes times the rows (queue included),
    as lightly's and the authors'."""
    module = _lightly("swav_loss.py")
    high, low = _swav_crops(gen, n=6, v_h=2, v_l=3, k=4)
    high, low = high.to(dtype), low.to(dtype)
    queue = randn(gen, 10, 2, 4, dtype=dtype).tanh()
    for q, iterations in ((queue, 3), (None, 3), (queue, 0)):
        lightly = module.SwaVLoss(sinkhorn_iterations=iterations)

        def theirs(h, lo, q=q, lightly=lightly):
            queued = None if q is None else list(q.unbind(1))
            return lightly(list(h.unbind(1)), list(lo.unbind(1)), queued).squeeze()

        got = value_and_grads(
            lambda h, lo, q=q, it=iterations: pf.losses.swav(
                h, lo, queue_outputs=q, sinkhorn_iterations=it
            ),
            high,
            low,
        )
        assert_same(got, value_and_grads(theirs, high, low), **TOL[dtype])
    with_queue = pf.losses.swav(high, low, queue_outputs=queue)
    assert not torch.equal(with_queue, pf.losses.swav(high, low))  # the queue changed the codes


@pytest.mark.parametrize(
    ("queue", "error", "match"),
    [
        ([[1.0]], TypeError, "queue_outputs must be a torch.Tensor"),
        (torch.zeros(4, 3, 4, dtype=F64), ValueError, r"queue_outputs must be \(Q, 2, 4\)"),
        (torch.zeros(4, 2, 4, dtype=torch.long), TypeError, "queue_outputs must be floating"),
    ],
)
def test_swav_refuses_a_bad_queue_naming_it(gen, queue, error, match):
    high, low = _swav_crops(gen, n=6, v_h=2, v_l=3, k=4)
    with pytest.raises(error, match=match):
        pf.losses.swav(high, low, queue_outputs=queue)


def test_swav_codes_are_an_equipartition_of_the_batch(gen):
    """After many rounds each sample's codes sum to 1 and each prototype gets N/K of the
    batch."""
    from pmlfunc.losses.self_supervised import _sinkhorn

    high, _ = _swav_crops(gen, n=8, k=4)
    q = _sinkhorn(high, 0.5, 200)
    torch.testing.assert_close(q.sum(-1), torch.ones(8, 2, dtype=F64))
    torch.testing.assert_close(q.sum(0), torch.full((2, 4), 2.0, dtype=F64), rtol=1e-6, atol=1e-6)


def test_swav_under_global_objective_is_the_single_process_loss(gen):
    """Every Sinkhorn round's prototype sums and the means over rows all-reduced: ranks of 0,
    3 and 5 rows give one process's loss and gradients on the whole batch."""
    high, low = _swav_crops(gen, n=8)
    report = pf.testing.check_distributed(
        pf.losses.swav, high, low, world_size=3, sizes=(0, 3, 5), rtol=1e-9, atol=1e-11
    )
    assert set(report.grad_diffs) == {"high_resolution_outputs", "low_resolution_outputs"}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"low_resolution_outputs": None, "high_resolution_outputs": torch.randn(6, 1, 4)},
            ValueError,
            "at least 2 crops",
        ),
        (
            {"low_resolution_outputs": torch.randn(5, 3, 4)},
            ValueError,
            "low_resolution_outputs must be",
        ),
        (
            {"high_resolution_outputs": torch.randn(6, 4)},
            ValueError,
            "high_resolution_outputs must be",
        ),
        ({"sinkhorn_iterations": -1}, ValueError, "sinkhorn_iterations"),
        ({"sinkhorn_epsilon": 0.0}, ValueError, "sinkhorn_epsilon"),
        ({"temperature": -0.1}, ValueError, "temperature"),
    ],
)
def test_swav_bad_input_raises_naming_the_argument(change, error, match):
    kw = {
        "high_resolution_outputs": torch.randn(6, 2, 4),
        "low_resolution_outputs": torch.randn(6, 3, 4),
        **change,
    }
    with pytest.raises(error, match=match):
        pf.losses.swav(**kw)


# ----------------------------------------------------------------------------------------------
# tico: the running covariance as explicit state
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hp", [{}, {"beta": 0.5, "rho": 3.0}], ids=["default", "hp"])
def test_tico_equals_the_float64_loops_on_loss_gradients_and_new_covariance(gen, hp):
    za, zb = randn(gen, 6, 4), randn(gen, 6, 4)
    c0 = randn(gen, 4, 4)
    c0 = c0 @ c0.T / 4  # a covariance from earlier steps
    state = {"covariance": c0.clone()}
    got = value_and_grads(lambda a, b: pf.losses.tico(a, b, state, **hp), za, zb)
    want = value_and_grads(lambda a, b: self_supervised.tico(a, b, c0, **hp), za, zb)
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    _, new = pf.losses.tico(za, zb, state, **hp)
    torch.testing.assert_close(new["covariance"], self_supervised.tico(za, zb, c0, **hp)[1])
    torch.testing.assert_close(state["covariance"], c0)  # the state given is not changed
    assert not new["covariance"].requires_grad


def tico_loss(za, zb, state):
    """:func:`pf.losses.tico`'s loss alone (check_distributed compares a loss)."""
    return pf.losses.tico(za, zb, state)[0]


def tico_loss_global(za, zb, state):
    return pf.distributed.global_objective(pf.losses.tico)(za, zb, state)[0]


def test_tico_under_global_objective_is_the_single_process_loss_and_covariance(gen):
    """``ÂᵀÂ``, ``N`` and the means all-reduced: ranks of 0, 3 and 4 rows give one process's
    loss and gradients, and every rank the same new covariance."""
    za, zb = randn(gen, 7, 4), randn(gen, 7, 4)
    state, sizes = pf.losses.tico_init(4, dtype=F64), (0, 3, 4)
    pf.testing.check_distributed(
        tico_loss, za, zb, state, world_size=3, sizes=sizes, rtol=1e-9, atol=1e-11,
        distributed_fn=tico_loss_global,
    )  # fmt: skip
    got = pf.testing.spawn_ranks(new_state_on_rank, "tico", za, zb, state, sizes, world_size=3)
    want = pf.losses.tico(za, zb, state)[1]["covariance"]
    for new in got:
        torch.testing.assert_close(new["covariance"], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"state": {"covariance": torch.zeros(3, 3)}}, ValueError, "covariance"),
        ({"state": {}}, TypeError, "tico_init"),
        ({"beta": 1.5}, ValueError, "beta"),
        ({"rho": -1.0}, ValueError, "rho"),
        ({"emb_b": torch.randn(5, 4)}, ValueError, "as many"),
    ],
)
def test_tico_bad_input_raises_naming_the_argument(change, error, match):
    kw = {
        "emb_a": torch.randn(6, 4),
        "emb_b": torch.randn(6, 4),
        "state": pf.losses.tico_init(4),
        **change,
    }
    with pytest.raises(error, match=match):
        pf.losses.tico(**kw)


# ----------------------------------------------------------------------------------------------
# lightly's loss files, loaded one by one without the package's init (it imports torchvision;
# benchmarks/peers.py): the parity tests skip without lightly
# ----------------------------------------------------------------------------------------------
def _lightly(path: str):
    """lightly's ``loss/<path>``, its ``lightly.utils.dist`` import served by the file itself."""
    import types

    from benchmarks import peers

    try:
        root = peers.package_dir("lightly")
        dist = peers.load_file("lightly_dist", root / "utils" / "dist.py")
        utils = types.ModuleType("lightly.utils")
        utils.__path__ = []  # type: ignore[attr-defined]
        utils.dist = dist  # type: ignore[attr-defined]
        package = types.ModuleType("lightly")
        package.__path__ = []  # type: ignore[attr-defined]
        package.utils = utils  # type: ignore[attr-defined]
        aliases = {"lightly": package, "lightly.utils": utils, "lightly.utils.dist": dist}
        return peers.load_file(f"lightly_{path[:-3]}", root / "loss" / path, aliases)
    except peers.PeerUnavailable as err:
        pytest.skip(f"lightly: {err}")


# ----------------------------------------------------------------------------------------------
# koleo: the nearest neighbour on the sphere
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hp", [{}, {"p": 1}, {"p": 3.0, "eps": 1e-3}], ids=["default", "l1", "p3-eps"]
)
def test_koleo_equals_the_float64_loops(gen, hp):
    x = randn(gen, 7, 5)
    x[3] = x[1]  # a duplicate row: its neighbour at distance 0 (ε keeps log and gradient finite)
    got = value_and_grads(lambda e: pf.losses.koleo(e, **hp), x)
    want = value_and_grads(lambda e: self_supervised.koleo(e, **hp), x)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("hp", [{}, {"p": 1, "eps": 1e-4}], ids=["default", "l1"])
def test_koleo_equals_lightly(gen, dtype, hp):
    lightly = _lightly("koleo_loss.py").KoLeoLoss(**hp)
    x = randn(gen, 12, 6, dtype=dtype)
    got = value_and_grads(lambda e: pf.losses.koleo(e, **hp), x)
    want = value_and_grads(lightly, x)
    assert_same(got, want, **TOL[dtype])


def test_koleo_nan_propagates_and_low_precision_is_float32(gen):
    x = randn(gen, 8, 4)
    bad = x.clone()
    bad[5, 2] = float("nan")
    assert torch.isnan(pf.losses.koleo(bad))
    got = pf.losses.koleo(x.to(torch.bfloat16))
    assert got.dtype == F32
    torch.testing.assert_close(
        got.double(), pf.losses.koleo(x.to(torch.bfloat16).double()), rtol=1e-5, atol=1e-6
    )


def koleo_of_the_gathered_batch(x):
    """The recipe for the global batch's neighbours: the loss of the gathered rows."""
    return pf.losses.koleo(pf.distributed.all_gather(x))


def test_koleo_of_all_gather_is_the_single_process_loss(gen):
    """``koleo(all_gather(x))`` on ranks of 3 and 6 rows: every rank's loss and gradient is one
    process's on the whole batch (koleo is per batch; this is the documented global form)."""
    x = randn(gen, 9, 4)
    pf.testing.check_distributed(
        pf.losses.koleo, x, world_size=2, sizes=(3, 6), rtol=1e-9, atol=1e-11,
        distributed_fn=koleo_of_the_gathered_batch,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"embeddings": torch.randn(1, 4)}, ValueError, "at least 2"),
        ({"embeddings": torch.randn(4, 2, 3)}, ValueError, "embeddings"),
        ({"embeddings": torch.ones(4, 3, dtype=torch.int64)}, TypeError, "embeddings"),
        ({"p": 0}, ValueError, "p"),
        ({"eps": -1e-3}, ValueError, "eps"),
    ],
)
def test_koleo_bad_input_raises_naming_the_argument(change, error, match):
    kw = {"embeddings": torch.randn(6, 4), **change}
    with pytest.raises(error, match=match):
        pf.losses.koleo(**kw)


# ----------------------------------------------------------------------------------------------
# mmcr: the nuclear norm of the centroids (singular values; the Gram matrix across ranks)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "hp"),
    [
        ((7, 3, 5), {}),
        ((4, 2, 6), {"lmda": 0.3}),  # fewer samples than dimensions
        ((6, 2, 4), {"lmda": 0.0, "normalize": False}),
        ((5, 3, 4), {"lmda": torch.tensor(0.1, dtype=F64), "momentum": True}),
    ],
    ids=["default", "wide", "lightly-unnormalised", "momentum-tensor-lmda"],
)
def test_mmcr_equals_the_float64_loops(gen, shape, hp):
    hp = dict(hp)
    z = randn(gen, *shape)
    if hp.pop("momentum", False):
        m = randn(gen, shape[0], 2, shape[2])
        got = value_and_grads(lambda a, b: pf.losses.mmcr(a, b, **hp), z, m)
        want = value_and_grads(lambda a, b: self_supervised.mmcr(a, b, **hp), z, m)
    else:
        got = value_and_grads(lambda a: pf.losses.mmcr(a, **hp), z)
        want = value_and_grads(lambda a: self_supervised.mmcr(a, **hp), z)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("lmda", [5e-3, 0.5])
def test_mmcr_equals_lightly(gen, dtype, lmda):
    """lightly's ``MMCRLoss(lmda)(online, momentum)`` is ``normalize=False``; on normalised
    views it is the default."""
    lightly = _lightly("mmcr_loss.py").MMCRLoss(lmda=lmda)
    online, momentum = randn(gen, 10, 2, 6, dtype=dtype), randn(gen, 10, 2, 6, dtype=dtype)
    got = value_and_grads(
        lambda a, b: pf.losses.mmcr(a, b, lmda=lmda, normalize=False), online, momentum
    )
    want = value_and_grads(lightly, online, momentum)
    assert_same(got, want, **TOL[dtype])
    unit = torch.nn.functional.normalize
    torch.testing.assert_close(
        pf.losses.mmcr(online, momentum, lmda=lmda),
        lightly(unit(online, dim=-1), unit(momentum, dim=-1)),
        **TOL[dtype],
    )


def test_mmcr_non_finite_views_give_nan_and_low_precision_is_float32(gen):
    z = randn(gen, 6, 2, 4)
    for value in (float("nan"), float("inf")):
        bad = z.clone()
        bad[2, 1, 0] = value
        for lmda in (0.0, 5e-3):
            for normalize in (True, False):
                assert torch.isnan(pf.losses.mmcr(bad, lmda=lmda, normalize=normalize))
    got = pf.losses.mmcr(z.to(torch.float16))
    assert got.dtype == F32
    torch.testing.assert_close(
        got.double(), pf.losses.mmcr(z.to(torch.float16).double()), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    ("rows", "sizes", "momentum"),
    [(10, (3, 7), True), (5, (0, 2, 3), True), (9, (4, 5), False)],
    ids=["tall-unequal", "wide-an-empty-rank", "no-momentum"],
)
def test_mmcr_under_global_objective_is_the_single_process_loss(gen, rows, sizes, momentum):
    """``CᵀC`` all-reduced (its eigenvalues' square roots, against one process's singular
    values of ``C``), the per-sample nuclear norms and ``N`` summed: every rank's loss and the
    gradients of both view sets equal one process's, with more samples than dimensions and
    with fewer (rank-deficient ``CᵀC``: its zero eigenvalues carry no gradient), and without
    the optional momentum views."""
    z = randn(gen, rows, 2, 6) + torch.arange(rows, dtype=F64).view(-1, 1, 1) / rows
    views = (z, randn(gen, rows, 2, 6)) if momentum else (z,)
    report = pf.testing.check_distributed(
        pf.losses.mmcr, *views, world_size=len(sizes), sizes=sizes, rtol=1e-9, atol=1e-11,
        lmda=0.2,
    )  # fmt: skip
    assert set(report.grad_diffs) == ({"embeddings", "momentum"} if momentum else {"embeddings"})


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"embeddings": torch.randn(6, 4)}, ValueError, "embeddings must be"),
        ({"embeddings": torch.zeros(0, 2, 4)}, ValueError, "no rows"),
        ({"momentum": torch.randn(5, 2, 4)}, ValueError, "momentum must be"),
        ({"momentum": torch.randn(6, 2, 4, dtype=F64)}, TypeError, "momentum"),
        ({"lmda": -1.0}, ValueError, "lmda"),
        ({"normalize": 1}, TypeError, "normalize"),
    ],
)
def test_mmcr_bad_input_raises_naming_the_argument(change, error, match):
    kw = {"embeddings": torch.randn(6, 2, 4), **change}
    with pytest.raises(error, match=match):
        pf.losses.mmcr(**kw)


# ----------------------------------------------------------------------------------------------
# sigreg: the Epps-Pulley statistic of random projections (sums over rows all-reduced)
# ----------------------------------------------------------------------------------------------
def _directions(seed: int, dim: int, count: int) -> torch.Tensor:
    from pmlfunc.losses.self_supervised import _sigreg_directions

    return _sigreg_directions(torch.tensor(seed), dim, count)


@pytest.mark.parametrize(
    ("shape", "hp"),
    [
        ((9, 4), {"num_vectors": 5}),
        ((6, 3, 4), {"num_vectors": 3, "knots": 5, "t_max": 2.0}),
        ((8, 5), {"num_vectors": 4, "knots": 2, "t_max": torch.tensor(1.5, dtype=F64)}),
    ],
    ids=["default-grid", "views", "two-knots-tensor-t_max"],
)
def test_sigreg_equals_the_float64_loops(gen, shape, hp):
    x = randn(gen, *shape)
    seed = torch.tensor(11)
    a = _directions(11, shape[-1], hp["num_vectors"])
    ref_hp = {"knots": hp.get("knots", 17), "t_max": float(hp.get("t_max", 3.0))}
    got = value_and_grads(lambda e: pf.losses.sigreg(e, generator=seed, **hp), x)
    want = value_and_grads(lambda e: self_supervised.sigreg(e, a, **ref_hp), x)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


def test_sigreg_directions_are_unit_seeded_and_isotropic():
    a = _directions(3, 8, 4096)
    torch.testing.assert_close(a.norm(dim=0), torch.ones(4096, dtype=F64))
    assert torch.equal(a, _directions(3, 8, 4096)) and not torch.equal(a, _directions(4, 8, 4096))
    # E[a aᵀ] = I / D for directions uniform on the sphere
    torch.testing.assert_close(a @ a.T / 4096, torch.eye(8, dtype=F64) / 8, rtol=0, atol=0.01)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, dtype=F64)
    assert pf.losses.sigreg(x, generator=g, num_vectors=3) != pf.losses.sigreg(
        x, generator=g, num_vectors=3
    )  # a Generator advances: new directions each call


def test_sigreg_is_small_for_gaussian_samples_and_large_for_collapsed_ones():
    g = torch.Generator().manual_seed(1)
    gaussian = torch.randn(512, 16, generator=g)
    seed = torch.tensor(2)
    assert pf.losses.sigreg(gaussian, generator=seed) < 1.0
    assert pf.losses.sigreg(0.1 * gaussian, generator=seed) > 20.0
    assert pf.losses.sigreg(gaussian + 2.0, generator=seed) > 20.0


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("views", [False, True], ids=["2d", "views"])
def test_sigreg_equals_lightly_with_the_same_directions(gen, dtype, views):
    """lightly's ``SIGReg(knots=9, t_max=2.5, num_vectors=6)`` with its random directions
    replaced by ours; its ``(V, N, D)`` input is ours transposed. lightly's grid is float32
    whatever the input (so float64 agrees to float32's rounding of ``exp(−t²/2)``)."""
    module = _lightly("lejepa_loss.py")
    lightly = module.SIGReg(knots=9, t_max=2.5, num_vectors=6)
    x = randn(gen, 10, 3, 5, dtype=dtype) if views else randn(gen, 10, 5, dtype=dtype)
    a = _directions(5, 5, 6).to(dtype)
    lightly._generate_unit_vectors = lambda device, dt, num_features: a
    seed = torch.tensor(5)
    got = value_and_grads(
        lambda e: pf.losses.sigreg(e, generator=seed, knots=9, t_max=2.5, num_vectors=6), x
    )
    want = value_and_grads(lambda e: lightly(e.transpose(0, 1) if views else e), x)
    assert_same(got, want, rtol=1e-6, atol=1e-7)


def test_sigreg_nan_propagates_and_low_precision_is_float32(gen):
    x = randn(gen, 8, 4)
    seed = torch.tensor(0)
    for value in (float("nan"), float("inf")):
        bad = x.clone()
        bad[3, 1] = value
        assert torch.isnan(pf.losses.sigreg(bad, generator=seed, num_vectors=4))
    got = pf.losses.sigreg(x.to(torch.bfloat16), generator=seed, num_vectors=4)
    want = pf.losses.sigreg(x.to(torch.bfloat16).double(), generator=seed, num_vectors=4)
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("views", [False, True], ids=["2d", "views"])
def test_sigreg_under_global_objective_is_the_single_process_loss(gen, views):
    """``Σ_n cos``, ``Σ_n sin`` and ``N`` all-reduced: ranks of 0, 4 and 7 rows (the same seed
    on each) give one process's loss and gradient on the whole batch."""
    x = randn(gen, 11, 2, 4) if views else randn(gen, 11, 4)
    report = pf.testing.check_distributed(
        pf.losses.sigreg, x, world_size=3, sizes=(0, 4, 7), rtol=1e-9, atol=1e-11,
        generator=torch.tensor(7), num_vectors=8, knots=9,
    )  # fmt: skip
    assert set(report.grad_diffs) == {"embeddings"}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"generator": None}, ValueError, "generator is required"),
        ({"generator": 3}, TypeError, "generator"),
        ({"embeddings": torch.randn(6)}, ValueError, "embeddings must be"),
        ({"embeddings": torch.zeros(0, 4)}, ValueError, "no rows"),
        ({"knots": 1}, ValueError, "knots"),
        ({"num_vectors": 0}, ValueError, "num_vectors"),
        ({"t_max": 0.0}, ValueError, "t_max"),
    ],
)
def test_sigreg_bad_input_raises_naming_the_argument(change, error, match):
    kw = {"embeddings": torch.randn(6, 4), "generator": torch.tensor(0), **change}
    with pytest.raises(error, match=match):
        pf.losses.sigreg(**kw)


# ----------------------------------------------------------------------------------------------
# ibot_patch: masked patch tokens, the centre as explicit state
# ----------------------------------------------------------------------------------------------
def _ibot_patches(gen, b=4, h=2, w=3, k=5):
    mask = torch.rand(b, h, w, generator=gen) < 0.5
    mask[0] = True  # every patch of image 0 masked
    mask[1] = False  # none of image 1: its term is 0 (the count clamped to 1)
    mask[2, 0, 0] = True
    teacher, student = randn(gen, b, h * w, k), randn(gen, b, h * w, k)
    return teacher, student, mask, 0.1 * randn(gen, k)


def _lightly_ibot():
    """lightly's ``ibot_loss.py``, its ``lightly.models.modules.center`` import served by the
    file itself."""
    import types

    from benchmarks import peers

    try:
        root = peers.package_dir("lightly")
        center = peers.load_file("lightly_center", root / "models" / "modules" / "center.py")
        names = ("lightly", "lightly.models", "lightly.models.modules")
        packages = {n: types.ModuleType(n) for n in names}
        for package in packages.values():
            package.__path__ = []  # type: ignore[attr-defined]
        aliases = {**packages, "lightly.models.modules.center": center}
        return peers.load_file("lightly_ibot_loss", root / "loss" / "ibot_loss.py", aliases)
    except peers.PeerUnavailable as err:
        pytest.skip(f"lightly: {err}")


@pytest.mark.parametrize(
    "hp",
    [
        {},
        {
            "teacher_temp": torch.tensor(0.07, dtype=F64),
            "student_temp": 0.2,
            "center_momentum": 0.5,
        },
    ],
    ids=["default", "scheduled-teacher-temperature"],
)
@pytest.mark.parametrize("layout", ["patches", "masked"])
def test_ibot_patch_equals_the_float64_loops_on_loss_gradient_and_new_centre(gen, hp, layout):
    teacher, student, mask, center = _ibot_patches(gen)
    flat = mask.flatten(1)
    state = {"center": center.clone()}

    def ours(t, s):
        if layout == "masked":  # lightly's layout: the masked patches in row-major order
            t, s = t[flat], s[flat]
        return pf.losses.ibot_patch(t, s, mask, state, **hp)

    got = value_and_grads(lambda t, s: ours(t, s)[0], teacher, student)
    want = value_and_grads(
        lambda t, s: self_supervised.ibot_patch(t, s, flat, center, **hp)[0], teacher, student
    )
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    assert not got[1][0].any()  # the teacher gets no gradient
    assert not got[1][1][~flat].any()  # nor the unmasked student patches
    new = ours(teacher, student)[1]["center"]
    torch.testing.assert_close(
        new, self_supervised.ibot_patch(teacher, student, flat, center, **hp)[1]
    )
    torch.testing.assert_close(state["center"], center)  # the state given is not changed
    assert not new.requires_grad


@pytest.mark.parametrize("dtype", [F64, F32])
def test_ibot_patch_equals_lightly_over_two_steps(gen, dtype):
    """lightly's ``IBOTPatchLoss`` on the masked patches (its centre updated by the first step,
    used by the second). Its teacher temperature is a float32 tensor (so ours is given that
    rounding) and its per-image weights ``1 / count`` are float32 whatever the input (so
    float64 agrees to float32's rounding of them); it does not detach the teacher (its callers
    do: the teacher's outputs are given detached here)."""
    module = _lightly_ibot()
    lightly = module.IBOTPatchLoss(output_dim=5, center_momentum=0.8)
    state = pf.losses.ibot_patch_init(5, dtype=dtype)
    hp = {"teacher_temp": float(torch.tensor(0.04)), "center_momentum": 0.8}
    for _ in range(2):
        teacher, student, mask, _ = _ibot_patches(gen)
        flat = mask.flatten(1)
        t, s = teacher.to(dtype)[flat], student.to(dtype)[flat]
        want = value_and_grads(lambda b, t=t, mask=mask: lightly(t, b, mask), s)
        got = value_and_grads(
            lambda b, t=t, mask=mask, state=state: pf.losses.ibot_patch(t, b, mask, state, **hp)[0],
            s,
        )
        assert_same(got, want, **(TOL[F32] if dtype == F32 else {"rtol": 1e-7, "atol": 1e-10}))
        state = pf.losses.ibot_patch(t, s, mask, state, **hp)[1]
        torch.testing.assert_close(
            state["center"], lightly.center.value.view(-1).to(dtype), **TOL[dtype]
        )


def test_ibot_patch_nan_propagates_low_precision_is_float32_and_no_mask_keeps_the_centre(gen):
    teacher, student, mask, center = _ibot_patches(gen)
    state = {"center": center}
    bad = student.clone()
    bad[1, 0, 2] = float("nan")  # an unmasked patch (image 1 has none masked)
    assert torch.isnan(pf.losses.ibot_patch(teacher, bad, mask, state)[0])
    bad = teacher.clone()
    bad[0, 0, 0] = float("nan")
    loss, new = pf.losses.ibot_patch(bad, student, mask, state)
    assert torch.isnan(loss) and torch.isnan(new["center"]).any()
    half = (teacher.to(torch.bfloat16), student.to(torch.bfloat16))
    got, new = pf.losses.ibot_patch(*half, mask, {"center": center.float()}, teacher_temp=0.5)
    want, _ = pf.losses.ibot_patch(
        *(x.double() for x in half), mask, {"center": center.float()}, teacher_temp=0.5
    )
    assert got.dtype == F32 and new["center"].dtype == F32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    none = torch.zeros_like(mask)
    loss, new = pf.losses.ibot_patch(teacher, student, none, state)
    assert loss == 0 and torch.equal(new["center"], center)


def ibot_patch_loss(teacher, student, mask, state, **hp):
    """:func:`pf.losses.ibot_patch`'s loss alone (check_distributed compares a loss)."""
    return pf.losses.ibot_patch(teacher, student, mask, state, **hp)[0]


def ibot_patch_loss_global(teacher, student, mask, state, **hp):
    fn = pf.distributed.global_objective(pf.losses.ibot_patch)
    return fn(teacher, student, mask, state, **hp)[0]


def ibot_centre_on_rank(teacher, student, mask, state, sizes):
    import torch.distributed as dist

    r0 = sum(sizes[: dist.get_rank()])
    rows = slice(r0, r0 + sizes[dist.get_rank()])
    fn = pf.distributed.global_objective(pf.losses.ibot_patch)
    return fn(teacher[rows], student[rows], mask[rows], state)[1]


def test_ibot_patch_under_global_objective_is_the_single_process_loss_and_centre(gen):
    """``B`` and the centre's sums over the masked patches all-reduced: ranks of 0, 2 and 5
    images (unequal masked counts) give one process's loss, student gradient and new centre."""
    teacher, student, mask, center = _ibot_patches(gen, b=7)
    state, sizes = {"center": center}, (0, 2, 5)
    flat = mask.flatten(1)
    pf.testing.check_distributed(
        ibot_patch_loss, teacher, student, flat, state, world_size=3, sizes=sizes, rtol=1e-9,
        atol=1e-11, distributed_fn=ibot_patch_loss_global,
    )  # fmt: skip
    centres = pf.testing.spawn_ranks(
        ibot_centre_on_rank, teacher, student, flat, state, sizes, world_size=3
    )
    want = pf.losses.ibot_patch(teacher, student, flat, state)[1]["center"]
    for got in centres:
        torch.testing.assert_close(got["center"], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"student_out": torch.randn(4, 5, 5)}, ValueError, "student_out must have"),
        ({"teacher_out": torch.randn(4, 6)}, ValueError, "student_out must have"),
        ({"mask": torch.ones(4, 6)}, TypeError, "mask must be a bool"),
        ({"mask": torch.ones(3, 6, dtype=torch.bool)}, ValueError, "mask must hold"),
        ({"mask": torch.ones(4, 2, 2, dtype=torch.bool)}, ValueError, "mask must hold"),
        ({"mask": torch.ones(24, dtype=torch.bool)}, ValueError, "mask must be"),
        ({"teacher_out": torch.randn(4, 6, 5, 1)}, ValueError, "teacher_out must be"),
        ({"state": {"center": torch.zeros(4)}}, ValueError, "center"),
        ({"state": {}}, TypeError, "ibot_patch_init"),
        ({"teacher_temp": 0.0}, ValueError, "teacher_temp"),
        ({"student_temp": -1.0}, ValueError, "student_temp"),
        ({"center_momentum": 1.5}, ValueError, "center_momentum"),
    ],
)
def test_ibot_patch_bad_input_raises_naming_the_argument(change, error, match):
    kw = {
        "teacher_out": torch.randn(4, 6, 5),
        "student_out": torch.randn(4, 6, 5),
        "mask": torch.rand(4, 2, 3) < 0.5,
        "state": pf.losses.ibot_patch_init(5),
        **change,
    }
    with pytest.raises(error, match=match):
        pf.losses.ibot_patch(**kw)


# ----------------------------------------------------------------------------------------------
# wmse: Cholesky whitening of random sub-batches (per batch: not a loss of global sums)
# ----------------------------------------------------------------------------------------------
def _wmse_orders(seed: int, w_iter: int, n: int) -> torch.Tensor:
    from pmlfunc.losses.self_supervised import _wmse_orders

    return _wmse_orders(torch.tensor(seed), w_iter, n)


@pytest.mark.parametrize(
    ("shape", "hp"),
    [
        ((6, 2, 3), {"w_size": 6}),
        ((12, 3, 2), {"w_size": 4, "w_iter": 2, "eps": 0.1}),
        ((8, 2, 2), {"w_size": 4, "eps": torch.tensor(0.05, dtype=F64)}),
    ],
    ids=["one-sub-batch", "three-views-two-iterations", "tensor-eps"],
)
def test_wmse_equals_the_float64_loops(gen, shape, hp):
    x = randn(gen, *shape)
    n, w_iter = shape[0], hp.get("w_iter", 1)
    orders = _wmse_orders(3, w_iter, n).tolist() if n > hp["w_size"] else [list(range(n))]
    eps = float(hp.get("eps", 0.0))
    got = value_and_grads(lambda e: pf.losses.wmse(e, generator=torch.tensor(3), **hp), x)
    want = value_and_grads(lambda e: self_supervised.wmse(e, orders, hp["w_size"], eps), x)
    assert_same(got, want, rtol=1e-10, atol=1e-12)


def test_wmse_orders_are_seeded_permutations():
    a = _wmse_orders(1, 3, 64)
    assert all(sorted(o) == list(range(64)) for o in a.tolist())
    assert not torch.equal(a[0], a[1])
    assert torch.equal(a, _wmse_orders(1, 3, 64)) and not torch.equal(a, _wmse_orders(2, 3, 64))
    x = torch.randn(16, 2, 3, dtype=F64)
    g = torch.Generator().manual_seed(0)
    assert pf.losses.wmse(x, generator=g, w_size=8) != pf.losses.wmse(x, generator=g, w_size=8)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(
    "hp", [{"w_size": 8}, {"w_size": 4, "w_iter": 2, "eps": 0.1}], ids=["one", "sub-batches"]
)
def test_wmse_equals_lightly_with_the_same_permutations(gen, dtype, hp, monkeypatch):
    """lightly's ``WMSELoss`` (training mode) with ``torch.randperm`` serving our orders; its
    input is the views concatenated, ``(V · N, D)``."""
    module = _lightly("wmse_loss.py")
    n, v, d = 16, 3, 2
    x = randn(gen, n, v, d, dtype=dtype)
    lightly = module.WMSELoss(embedding_dim=d, num_samples=v, **hp)
    orders = iter(_wmse_orders(9, hp.get("w_iter", 1), n))
    monkeypatch.setattr(torch, "randperm", lambda size: next(orders))
    want = value_and_grads(lambda e: lightly(e.transpose(0, 1).reshape(v * n, d)), x)
    got = value_and_grads(lambda e: pf.losses.wmse(e, generator=torch.tensor(9), **hp), x)
    assert_same(got, want, **TOL[dtype])


def test_wmse_whitens_each_sub_batch():
    """A view ``x U + b`` of another (``U`` upper triangular with a positive diagonal: the
    Cholesky factor's ``Uᵀ L``) whitens to the same rows in every sub-batch: loss 0."""
    x = torch.randn(32, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    u = torch.tensor([[2.0, 0.5, -1.0, 1.0], [0, 1, 0.3, 1], [0, 0, 3, 1], [0, 0, 0, 0.5]])
    views = torch.stack([x, x @ u.double() + 7.0], 1)
    loss = pf.losses.wmse(views, w_size=8, generator=torch.tensor(0))
    assert abs(float(loss)) < 1e-10


def test_wmse_nan_propagates_singular_covariances_are_nan_and_low_precision_is_float32(gen):
    x = randn(gen, 16, 2, 3)
    seed = torch.tensor(0)
    for value in (float("nan"), float("inf")):
        bad = x.clone()
        bad[5, 1, 2] = value
        assert torch.isnan(pf.losses.wmse(bad, generator=seed, w_size=8))
    flat = x.clone()
    flat[:, 0, 2] = 1.0  # a constant dimension: a singular covariance (lightly raises)
    assert torch.isnan(pf.losses.wmse(flat, generator=seed, w_size=8))
    assert torch.isfinite(pf.losses.wmse(flat, generator=seed, w_size=8, eps=0.1))
    got = pf.losses.wmse(x.to(torch.bfloat16), generator=seed, w_size=8)
    want = pf.losses.wmse(x.to(torch.bfloat16).double(), generator=seed, w_size=8)
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def wmse_of_the_gathered_batch(x, **hp):
    """The recipe for sub-batches of the global batch: the loss of the gathered rows."""
    return pf.losses.wmse(pf.distributed.all_gather(x), **hp)


def test_wmse_of_all_gather_is_the_single_process_loss(gen):
    """``wmse(all_gather(x))`` with the same seed on ranks of 4 and 12 rows: every rank's loss
    and gradient is one process's on the whole batch (the documented global form)."""
    x = randn(gen, 16, 2, 3)
    pf.testing.check_distributed(
        pf.losses.wmse, x, world_size=2, sizes=(4, 12), rtol=1e-9, atol=1e-11,
        distributed_fn=wmse_of_the_gathered_batch, generator=torch.tensor(4), w_size=8,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"generator": None}, ValueError, "generator is required"),
        ({"generator": 3}, TypeError, "generator"),
        ({"embeddings": torch.randn(16, 6)}, ValueError, "embeddings must be"),
        ({"embeddings": torch.randn(16, 1, 3)}, ValueError, "at least 2 views"),
        ({"embeddings": torch.ones(16, 2, 3, dtype=torch.int64)}, TypeError, "embeddings"),
        ({"embeddings": torch.randn(12, 2, 3)}, ValueError, "multiple of w_size"),
        ({"embeddings": torch.randn(4, 2, 3)}, ValueError, "multiple of w_size"),
        ({"w_size": 4}, ValueError, "w_size must be at least"),
        ({"w_size": 8.0}, TypeError, "w_size"),
        ({"w_iter": 0}, ValueError, "w_iter"),
        ({"eps": 1.5}, ValueError, "eps"),
        ({"eps": -0.1}, ValueError, "eps"),
    ],
)
def test_wmse_bad_input_raises_naming_the_argument(change, error, match):
    kw = {"embeddings": torch.randn(16, 2, 3), "generator": torch.tensor(0), "w_size": 8, **change}
    with pytest.raises(error, match=match):
        pf.losses.wmse(**kw)


# ----------------------------------------------------------------------------------------------
# msn, pmsn: Sinkhorn-balanced targets on the prototypes, me-max or a power-law prior
# ----------------------------------------------------------------------------------------------
def _msn_views(gen, n=6, v=3, d=5, k=7):
    return randn(gen, n, v, d), randn(gen, n, d), randn(gen, k, d)


def _msn_pair(power):
    """``(pf loss, its keyword of the prior)`` for ``power`` (``None``: :func:`msn`)."""
    if power is None:
        return pf.losses.msn, {}
    return pf.losses.pmsn, {"power_law_exponent": power}


_MSN_HP = [
    ({}, {}),
    (
        {
            "temperature": 0.3,
            "sinkhorn_iterations": 5,
            "regularization_weight": 0.5,
            "target_sharpen_temperature": 0.5,
        },
        {"temperature": 0.3, "iterations": 5, "weight": 0.5, "sharpen": 0.5},
    ),
    (
        {"sinkhorn_iterations": 0, "temperature": torch.tensor(0.2, dtype=F64)},
        {"iterations": 0, "temperature": 0.2},
    ),
]


@pytest.mark.parametrize(("hp", "ref_hp"), _MSN_HP, ids=["default", "hp", "no-sinkhorn"])
@pytest.mark.parametrize("power", [None, 0.25, 1.0], ids=["msn", "pmsn", "pmsn-1"])
@pytest.mark.parametrize("layout", ["views", "lightly"])
def test_msn_equals_the_float64_loops(gen, hp, ref_hp, power, layout):
    anchors, targets, prototypes = _msn_views(gen)
    fn, prior = _msn_pair(power)

    def ours(a, t, c):
        if layout == "lightly":  # (V·N, D), view-major
            a = a.transpose(0, 1).reshape(-1, a.shape[-1])
        return fn(a, t, c, **hp, **prior)

    got = value_and_grads(ours, anchors, targets, prototypes)
    want = value_and_grads(
        lambda a, t, c: self_supervised.msn(a, t, c, **ref_hp, power=power),
        anchors,
        targets,
        prototypes,
    )
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    assert not got[1][1].any()  # the targets get no gradient


def test_msn_of_uniform_anchor_predictions_is_log_k(gen):
    """Anchors orthogonal to every prototype predict ``1/K`` everywhere: with ``λ = 0`` the loss
    is ``log K`` whatever the targets, as each image's Sinkhorn-balanced code sums to 1."""
    _, targets, prototypes = _msn_views(gen, n=8, k=4)
    uniform = torch.zeros(8, 2, 5, dtype=F64)
    uniform[..., 0] = 1.0
    c = prototypes.clone()
    c[:, 0] = 0.0  # every anchor orthogonal to every prototype: p uniform
    loss = pf.losses.msn(uniform, targets, c, regularization_weight=0.0, sinkhorn_iterations=50)
    torch.testing.assert_close(loss, torch.tensor(math.log(4), dtype=F64))


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # lightly's power law
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("power", [None, 0.25], ids=["msn", "pmsn"])
@pytest.mark.parametrize("defaults", [True, False], ids=["default", "hp"])
def test_msn_equals_lightly(gen, dtype, power, defaults):
    """lightly's ``MSNLoss`` / ``PMSNLoss`` on its ``(N·V, D)`` anchors: values and the
    gradients of the anchors and the prototypes (lightly builds the power law in float32: float64
    agrees to that rounding)."""
    module = _lightly("msn_loss.py")
    hp = {"temperature": 0.2, "sinkhorn_iterations": 4, "regularization_weight": 0.7}
    init = {} if defaults else hp
    fn, prior = _msn_pair(power)
    if power is None:
        lightly = module.MSNLoss(**init)
    else:
        import types

        from benchmarks import peers

        root = peers.package_dir("lightly")
        loss_pkg = types.ModuleType("lightly.loss")
        loss_pkg.__path__ = []  # type: ignore[attr-defined]
        aliases = {"lightly.loss": loss_pkg, "lightly.loss.msn_loss": module}
        pmsn = peers.load_file("lightly_pmsn_loss", root / "loss" / "pmsn_loss.py", aliases)
        lightly = pmsn.PMSNLoss(**init, power_law_exponent=power)
    sharpen = {} if defaults else {"target_sharpen_temperature": 0.4}
    anchors = randn(gen, 18, 6, dtype=dtype)
    targets, prototypes = randn(gen, 6, 6, dtype=dtype), randn(gen, 9, 6, dtype=dtype)
    got = value_and_grads(
        lambda a, c: fn(a, targets, c, **init, **sharpen, **prior), anchors, prototypes
    )
    want = value_and_grads(lambda a, c: lightly(a, targets, c, **sharpen), anchors, prototypes)
    tol = TOL[dtype] if dtype == F32 or power is None else {"rtol": 1e-5, "atol": 1e-8}
    assert_same(got, want, **tol)


@pytest.mark.parametrize("fn", [pf.losses.msn, pf.losses.pmsn], ids=["msn", "pmsn"])
def test_msn_nan_propagates_and_low_precision_is_float32(gen, fn):
    anchors, targets, prototypes = _msn_views(gen)
    for i, name in enumerate(("anchors", "targets", "prototypes")):
        args = [anchors.clone(), targets.clone(), prototypes.clone()]
        args[i].view(-1)[3] = float("nan")
        assert torch.isnan(fn(*args)), name
    half = [x.to(torch.bfloat16) for x in (anchors, targets, prototypes)]
    got = fn(*half)
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), fn(*(x.double() for x in half)), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(
        fn(half[0].requires_grad_(), half[1], half[2].requires_grad_()), (half[0], half[2])
    )
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("fn", [pf.losses.msn, pf.losses.pmsn], ids=["msn", "pmsn"])
def test_msn_under_global_objective_is_the_single_process_loss(gen, fn):
    """Every Sinkhorn round's prototype sums, the mean over rows and ``p̄`` all-reduced: ranks
    of 0, 3 and 5 images give one process's loss and the gradients of the anchors and the
    prototypes on the whole batch."""
    anchors, targets, prototypes = _msn_views(gen, n=8, k=5)
    report = pf.testing.check_distributed(
        fn, anchors, targets, prototypes, world_size=3, sizes=(0, 3, 5), rtol=1e-9, atol=1e-11
    )
    assert {"anchors", "prototypes"} <= set(report.grad_diffs)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"anchors": torch.randn(6, 2, 3)}, ValueError, "anchors must be"),
        ({"anchors": torch.randn(13, 4)}, ValueError, "anchors must be"),
        ({"anchors": torch.randn(6, 0, 4)}, ValueError, "anchors has no views"),
        ({"anchors": torch.ones(6, 2, 4, dtype=torch.int64)}, TypeError, "anchors"),
        ({"anchors": [[0.0] * 4] * 6}, TypeError, "anchors"),
        ({"targets": torch.randn(6, 2, 4)}, ValueError, "targets must be"),
        ({"targets": torch.randn(0, 4), "anchors": torch.randn(0, 2, 4)}, ValueError, "targets"),
        ({"prototypes": torch.randn(5, 3)}, ValueError, "prototypes must be"),
        ({"prototypes": torch.randn(0, 4)}, ValueError, "prototypes must be"),
        ({"prototypes": torch.ones(5, 4, dtype=torch.int32)}, TypeError, "prototypes"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"target_sharpen_temperature": -1.0}, ValueError, "target_sharpen_temperature"),
        ({"regularization_weight": -0.1}, ValueError, "regularization_weight"),
        ({"sinkhorn_iterations": -1}, ValueError, "sinkhorn_iterations"),
        ({"sinkhorn_iterations": 1.5}, TypeError, "sinkhorn_iterations"),
        ({"power_law_exponent": -0.5}, ValueError, "power_law_exponent"),
        ({"power_law_exponent": torch.tensor(0.5)}, TypeError, "power_law_exponent"),
    ],
)
def test_msn_bad_input_raises_naming_the_argument(change, error, match):
    kw = {
        "anchors": torch.randn(6, 2, 4),
        "targets": torch.randn(6, 4),
        "prototypes": torch.randn(5, 4),
        **change,
    }
    fn = pf.losses.pmsn if "power_law_exponent" in change else pf.losses.msn
    with pytest.raises(error, match=match):
        fn(**kw)


def _lightly_vicregl():
    """lightly's ``vicregl_loss.py``, its ``vicreg_loss`` and ``lightly.utils.dist`` imports
    served by their files and ``lightly.models.utils.nearest_neighbors`` by its source (the rest
    of ``models/utils.py`` needs torchvision)."""
    import ast
    import types

    from benchmarks import peers

    try:
        root = peers.package_dir("lightly")
        dist = peers.load_file("lightly_dist", root / "utils" / "dist.py")
        names = ("lightly", "lightly.utils", "lightly.loss", "lightly.models")
        packages = {n: types.ModuleType(n) for n in names}
        for package in packages.values():
            package.__path__ = []  # type: ignore[attr-defined]
        packages["lightly.utils"].dist = dist  # type: ignore[attr-defined]
        aliases = {**packages, "lightly.utils.dist": dist}
        vicreg = peers.load_file("lightly_vicreg_loss", root / "loss" / "vicreg_loss.py", aliases)
        source = (root / "models" / "utils.py").read_text()
        (fn,) = (
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name == "nearest_neighbors"
        )
        utils = types.ModuleType("lightly.models.utils")
        exec(ast.get_source_segment(source, fn), {"torch": torch, "Tuple": tuple}, utils.__dict__)
        aliases = {**aliases, "lightly.loss.vicreg_loss": vicreg, "lightly.models.utils": utils}
        packages["lightly.models"].utils = utils  # type: ignore[attr-defined]
        return peers.load_file("lightly_vicregl_loss", root / "loss" / "vicregl_loss.py", aliases)
    except (peers.PeerUnavailable, ValueError) as err:
        pytest.skip(f"lightly: {err}")


# ----------------------------------------------------------------------------------------------
# vicregl: VICReg of the pooled views plus VICReg of matched feature-map locations
# ----------------------------------------------------------------------------------------------
VICREGL_HP = {"lambda_param": 3.0, "mu_param": 5.0, "nu_param": 0.7, "alpha": 0.6, "eps": 1e-3}


def _vicregl_views(gen, n=5, g=2, n_local=2, d=4, e=3, dtype=F64):
    """``(pooled, maps, grids)`` of ``g`` global views on a 3 × 3 grid and of ``n_local`` local
    views on a 2 × 2 grid."""
    glob = (randn(gen, n, g, d, dtype=dtype), randn(gen, n, g, 3, 3, e, dtype=dtype))
    g_grid = torch.rand(n, g, 3, 3, 2, generator=gen, dtype=F64).to(dtype)
    loc = (
        randn(gen, n, n_local, d, dtype=dtype),
        randn(gen, n, n_local, 2, 2, e, dtype=dtype),
    )
    l_grid = torch.rand(n, n_local, 2, 2, 2, generator=gen, dtype=F64).to(dtype)
    return glob, g_grid, loc, l_grid


@pytest.mark.parametrize("with_local", [True, False], ids=["local", "global-only"])
@pytest.mark.parametrize("num_matches", [(4, 2), (20, 4)], ids=["4-2", "default"])
def test_vicregl_equals_the_float64_loops(gen, with_local, num_matches):
    (gp, gm), gg, (lp, lm), lg = _vicregl_views(gen, g=3 if not with_local else 2)
    hp = {**VICREGL_HP, "num_matches": num_matches}
    ref_hp = {"lam": 3.0, "mu": 5.0, "nu": 0.7, "alpha": 0.6, "eps": 1e-3}
    if with_local:
        got = value_and_grads(
            lambda a, b, c, d: pf.losses.vicregl((a, b), gg, (c, d), lg, **hp), gp, gm, lp, lm
        )
        want = value_and_grads(
            lambda a, b, c, d: self_supervised.vicregl(
                a, b, gg, c, d, lg, **ref_hp, num_matches=num_matches
            ),
            gp,
            gm,
            lp,
            lm,
        )
    else:
        got = value_and_grads(lambda a, b: pf.losses.vicregl((a, b), gg, **hp), gp, gm)
        want = value_and_grads(
            lambda a, b: self_supervised.vicregl(a, b, gg, **ref_hp, num_matches=num_matches),
            gp,
            gm,
        )
    assert_same(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("hp", [{}, {**VICREGL_HP, "num_matches": (3, 2)}], ids=["default", "hp"])
def test_vicregl_equals_lightly(gen, dtype, hp):
    lightly = _lightly_vicregl().VICRegLLoss(**hp)
    (gp, gm), gg, (lp, lm), lg = _vicregl_views(gen, n=6, g=2, n_local=3, dtype=dtype)

    def theirs(a, b, c, d):
        return lightly(
            [(a[:, v], b[:, v]) for v in range(a.shape[1])],
            [gg[:, v] for v in range(a.shape[1])],
            [(c[:, v], d[:, v]) for v in range(c.shape[1])],
            [lg[:, v] for v in range(c.shape[1])],
        ).squeeze()

    got = value_and_grads(
        lambda a, b, c, d: pf.losses.vicregl((a, b), gg, (c, d), lg, **hp), gp, gm, lp, lm
    )
    assert_same(got, value_and_grads(theirs, gp, gm, lp, lm), **TOL[dtype])


def test_vicregl_nan_propagates_and_low_precision_is_float32(gen):
    (gp, gm), gg, (lp, lm), lg = _vicregl_views(gen)
    for k, t in enumerate((gp, gm, lp, lm)):  # a NaN in any input, a map's too (matched first)
        args = [gp, gm, lp, lm]
        args[k] = t.clone()
        args[k].view(-1)[7] = float("nan")
        assert torch.isnan(pf.losses.vicregl(args[:2], gg, args[2:], lg))
    low = [t.to(torch.bfloat16) for t in (gp, gm, lp, lm)]
    got = pf.losses.vicregl(low[:2], gg, low[2:], lg)
    assert got.dtype == F32
    want = pf.losses.vicregl([t.double() for t in low[:2]], gg, [t.double() for t in low[2:]], lg)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"global_view_features": torch.randn(5, 2, 4)}, TypeError, "global_view_features"),
        (
            {"global_view_features": (torch.randn(5, 4), torch.randn(5, 2, 3, 3, 3))},
            ValueError,
            r"global_view_features\[0\]",
        ),
        (
            {"global_view_features": (torch.randn(5, 2, 4), torch.randn(5, 3, 3, 3, 3))},
            ValueError,
            r"global_view_features\[1\]",
        ),
        (
            {
                "global_view_features": (torch.randn(1, 2, 4), torch.randn(1, 2, 3, 3, 3)),
                "global_view_grids": torch.rand(1, 2, 3, 3, 2),
            },
            ValueError,
            "at least 2 rows",
        ),
        (
            {"global_view_features": (torch.randn(5, 2, 4), torch.randn(5, 2, 3, 3, 3).double())},
            TypeError,
            r"global_view_features\[1\]",
        ),
        (
            {
                "global_view_features": (
                    torch.ones(5, 2, 4, dtype=torch.int64),
                    torch.randn(5, 2, 3, 3, 3),
                )
            },
            TypeError,
            r"global_view_features\[0\]",
        ),
        ({"global_view_grids": torch.rand(5, 2, 2, 2, 2)}, ValueError, "global_view_grids"),
        ({"global_view_grids": torch.rand(5, 2, 3, 3, 3)}, ValueError, "global_view_grids"),
        ({"local_view_grids": None}, ValueError, "local_view_grids"),
        ({"local_view_grids": torch.rand(5, 2, 3, 3, 2)}, ValueError, "local_view_grids"),
        (
            {"local_view_features": (torch.randn(5, 2, 6), torch.randn(5, 2, 2, 2, 3))},
            ValueError,
            "local_view_features",
        ),
        (
            {"local_view_features": (torch.randn(4, 2, 4), torch.randn(4, 2, 2, 2, 3))},
            ValueError,
            "local_view_features",
        ),
        (
            {
                "local_view_features": None,
                "local_view_grids": None,
                "global_view_features": (torch.randn(5, 1, 4), torch.randn(5, 1, 3, 3, 3)),
                "global_view_grids": torch.rand(5, 1, 3, 3, 2),
            },
            ValueError,
            "at least 2 views",
        ),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"alpha": "a"}, TypeError, "alpha"),
        ({"lambda_param": torch.ones(2)}, ValueError, "lambda_param"),
        ({"num_matches": 4}, TypeError, "num_matches"),
        ({"num_matches": (0, 4)}, ValueError, "num_matches"),
        ({"num_matches": (2.0, 4)}, TypeError, "num_matches"),
    ],
)
def test_vicregl_bad_input_raises_naming_the_argument(change, error, match):
    kw = {
        "global_view_features": (torch.randn(5, 2, 4), torch.randn(5, 2, 3, 3, 3)),
        "global_view_grids": torch.rand(5, 2, 3, 3, 2),
        "local_view_features": (torch.randn(5, 2, 4), torch.randn(5, 2, 2, 2, 3)),
        "local_view_grids": torch.rand(5, 2, 2, 2, 2),
        **change,
    }
    with pytest.raises(error, match=match):
        pf.losses.vicregl(**kw)
