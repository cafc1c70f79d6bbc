"""Tests for ``pmlfunc.losses.cross_modal``: CLIP and SigLIP, dense and on the tiled engine.

Values and gradients (both embedding sets, the logit scale and bias) equal float64 references
written from the papers (``tests/reference/cross_modal.py``); the tiled path equals the dense one
for every chunk size, in float64 and float32; the tiled path never creates a tensor larger than
``max(chunk × N, N × D)``; low-precision inputs give a float32 loss close to float64 even at
CLIP's largest scale. Compile, meta, ``torch.func.grad`` and gradcheck of the dense and tiled
paths are in ``test_conformance.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import cross_modal as ref
from tracking import LargestTensor

import pmlfunc as pf

F64, F32 = torch.float64, torch.float32
N, D = 11, 6
LOSSES = {"clip": pf.losses.clip, "siglip": pf.losses.siglip}
INITS = {"clip": pf.losses.clip_init, "siglip": pf.losses.siglip_init}
REFERENCES = {"clip": ref.clip, "siglip": ref.siglip}
REDUCERS = {"clip": ("mean", "sum"), "siglip": ("batch", "mean", "sum")}
UNEVEN = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 0]  # classes of 1, 2 and 3 pairs


def _reducer(name: str):
    return None if name == "batch" else getattr(pf.reducers, name)()


def _inputs(seed: int, bias: float | None, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, D, generator=g, dtype=F64).to(dtype)
    b = torch.randn(N, D, generator=g, dtype=F64).to(dtype)
    params = INITS["clip"](logit_scale=math.log(5.0), logit_bias=bias, dtype=F64)
    return a, b, params


def _value_and_grads(fn, a, b, params, **kw):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    loss = fn(a, b, leaves, **kw)
    return loss, torch.autograd.grad(loss, (a, b, *leaves.values()))


@pytest.mark.parametrize("labels", [None, UNEVEN], ids=["pairs", "labels"])
@pytest.mark.parametrize("bias", [None, 0.7], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("name", "reducer"), [(n, r) for n in LOSSES for r in REDUCERS[n]])
def test_dense_matches_the_paper_reference(name, reducer, bias, labels):
    a, b, params = _inputs(0, bias)
    y = None if labels is None else torch.tensor(labels)
    loss = LOSSES[name](a, b, params, labels=y, reducer=_reducer(reducer))
    expected = REFERENCES[name](a, b, float(params["logit_scale"]), bias, labels, reducer=reducer)
    assert loss.dtype == F64
    assert abs(float(loss) - expected) <= 1e-12 * max(1.0, abs(expected))


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("labels", [None, UNEVEN], ids=["pairs", "labels"])
@pytest.mark.parametrize("bias", [None, 0.7], ids=["no_bias", "bias"])
@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_tiled_equals_dense_values_and_gradients(name, bias, labels, chunk):
    """Every chunk size, dividing ``N`` or not (1, 4, 7, larger than ``N``): float64 to 1e-9,
    gradients of both sets, the scale and the bias included."""
    a, b, params = _inputs(1, bias)
    y = None if labels is None else torch.tensor(labels)
    for reducer in REDUCERS[name]:
        kw = {"labels": y, "reducer": _reducer(reducer)}
        dense = _value_and_grads(LOSSES[name], a, b, params, **kw)
        tiled = _value_and_grads(LOSSES[name], a, b, params, chunk_size=chunk, **kw)
        torch.testing.assert_close(tiled, dense, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_gradients_match_finite_differences_of_the_reference(name):
    """The gradient of the scale and of the bias against central differences of the float64
    reference (an independent check of the engine's ∂L/∂scale and ∂L/∂bias)."""
    a, b, params = _inputs(2, 0.3)
    _, grads = _value_and_grads(LOSSES[name], a, b, params, chunk_size=4)
    for i, key in enumerate(("logit_scale", "logit_bias")):
        h = 1e-6
        values = {k: float(v) for k, v in params.items()}
        up, down = dict(values), dict(values)
        up[key] += h
        down[key] -= h
        numeric = (
            REFERENCES[name](a, b, up["logit_scale"], up["logit_bias"])
            - REFERENCES[name](a, b, down["logit_scale"], down["logit_bias"])
        ) / (2 * h)
        assert abs(float(grads[2 + i]) - numeric) < 1e-6 * max(1.0, abs(numeric)), key


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_float32_tiled_equals_dense(name):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
    params = INITS[name]()
    dense = _value_and_grads(LOSSES[name], a, b, params)
    tiled = _value_and_grads(LOSSES[name], a, b, params, chunk_size=24)
    torch.testing.assert_close(tiled, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_memory_bound_of_the_tiled_path(name):
    """N = 256, chunk 16: the dense loss creates 256 × 256 tensors, the tiled loss nothing
    larger than max(chunk × N, N × D), in the forward or the backward."""
    g = torch.Generator().manual_seed(4)
    n, d, chunk = 256, 8, 16
    a = torch.randn(n, d, generator=g, requires_grad=True)
    b = torch.randn(n, d, generator=g, requires_grad=True)
    params = {k: v.requires_grad_() for k, v in INITS[name](logit_bias=-2.0).items()}
    bound = max(chunk * n, n * d)
    with LargestTensor() as rec:
        LOSSES[name](a, b, params, chunk_size=chunk).backward()
    assert rec.largest <= bound, (rec.largest, bound)
    assert all(p.grad is not None for p in (a, b, *params.values()))
    with LargestTensor() as rec:  # the check has teeth: the dense loss exceeds the bound
        LOSSES[name](a, b, params).backward()
    assert rec.largest >= n * n > bound


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_low_precision_is_float32_and_close_to_float64_at_the_largest_scale(name, dtype, chunk):
    """bf16/fp16 embeddings at ``logit_scale = log 100`` (CLIP's clamp): a finite float32 loss
    within 1e-2 (relative) of float64, and finite gradients."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    params = INITS[name](logit_scale=math.log(100.0))
    low_a, low_b = a.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    low = LOSSES[name](low_a, low_b, params, chunk_size=chunk)
    high = LOSSES[name](a.double(), b.double(), {k: v.double() for k, v in params.items()})
    assert low.dtype == F32 and torch.isfinite(low)
    assert abs(float(low.detach()) - float(high)) <= 1e-2 * abs(float(high))
    low.backward()
    assert torch.isfinite(low_a.grad).all() and torch.isfinite(low_b.grad).all()


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_max_logit_scale_clamps_inside_the_loss(name):
    a, b, _ = _inputs(6, None)
    big = {"logit_scale": torch.tensor(math.log(500.0), dtype=F64, requires_grad=True)}
    clamped = LOSSES[name](a, b, big, max_logit_scale=math.log(100.0))
    at_bound = LOSSES[name](a, b, {"logit_scale": torch.tensor(math.log(100.0), dtype=F64)})
    torch.testing.assert_close(clamped, at_bound)
    clamped.backward()
    assert big["logit_scale"].grad == 0  # above the bound: a zero gradient, as a clamp gives


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_a_nan_row_makes_the_loss_nan(name):
    a, b, params = _inputs(7, 0.1)
    a[3, 0] = float("nan")
    for chunk in (None, 4):
        assert torch.isnan(LOSSES[name](a, b, params, chunk_size=chunk))


def test_init_defaults_are_the_papers():
    clip, siglip = pf.losses.clip_init(), pf.losses.siglip_init()
    assert set(clip) == {"logit_scale"}  # CLIP has no bias; no None leaves in the pytree
    assert math.isclose(float(clip["logit_scale"].exp()), 1 / 0.07, rel_tol=1e-6)
    assert math.isclose(float(siglip["logit_scale"].exp()), 10.0, rel_tol=1e-6)
    assert float(siglip["logit_bias"]) == -10.0
    assert set(pf.losses.siglip_init(logit_bias=None)) == {"logit_scale"}


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_errors_name_the_argument(name):
    fn = LOSSES[name]
    a, b, params = _inputs(8, None)
    with pytest.raises(ValueError, match="as many rows"):
        fn(a, b[:-1], params)
    with pytest.raises(ValueError, match="embedding size"):
        fn(a, b[:, :-1], params)
    with pytest.raises(TypeError, match="logit_scale"):
        fn(a, b, {})
    with pytest.raises(ValueError, match="unknown entries"):
        fn(a, b, {**params, "temperature": torch.tensor(0.1, dtype=F64)})
    with pytest.raises(ValueError, match="0-d"):  # a shape error, as for every params entry
        fn(a, b, {"logit_scale": torch.ones(1, dtype=F64)})
    with pytest.raises(TypeError, match="floating point"):
        fn(a, b, {"logit_scale": torch.tensor(1)})
    with pytest.raises(ValueError, match="labels has length"):
        fn(a, b, params, labels=torch.zeros(N + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="reducer"):
        fn(a, b, params, reducer=pf.reducers.avg_nonzero())
    with pytest.raises(TypeError, match="reducer"):
        fn(a, b, params, reducer="mean")
    with pytest.raises(ValueError, match="chunk_size"):
        fn(a, b, params, chunk_size=0)
