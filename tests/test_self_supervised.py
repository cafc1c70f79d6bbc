"""Tests for ``pmlfunc.losses.self_supervised``: ``vicreg``.

Checked against a naive float64 loop reference (PML 2.9.0's semantics, tests/reference/) and
against PML 2.9.0's ``VICRegLoss`` (values and the gradients of both views), with reducers, wide
embeddings, tensor hyper-parameters, edge cases, ``vmap`` and bad input. The properties every
loss keeps are in test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import F32, F64, assert_same, assert_vmap_equals_a_loop, randn, value_and_grads
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import reducers as pml_reducers
from reference import self_supervised

import pmlfunc.reducers as pfr
from pmlfunc.losses import vicreg

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
