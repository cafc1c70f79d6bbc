"""pf.nn: thin modules over the learnable losses."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import pmlfunc as pf

MODULES = {
    "ProxyAnchor": (pf.nn.ProxyAnchor, {"margin": 0.1, "alpha": 32.0}),
    "ProxyNCA": (pf.nn.ProxyNCA, {}),
    "NormalizedSoftmax": (pf.nn.NormalizedSoftmax, {"temperature": 0.1}),
    "SoftTriple": (pf.nn.SoftTriple, {"centers_per_class": 3}),
    "P2SGrad": (pf.nn.P2SGrad, {}),
    "LargeMarginSoftmax": (pf.nn.LargeMarginSoftmax, {"margin": 3}),
    "SphereFace": (pf.nn.SphereFace, {}),
    "CosFace": (pf.nn.CosFace, {"margin": 0.3}),
    "ArcFace": (pf.nn.ArcFace, {"margin": 0.4}),
    "SubCenterArcFace": (pf.nn.SubCenterArcFace, {"sub_centers": 2}),
    "DynamicArcFace": (
        pf.nn.DynamicArcFace,
        {"margins": pf.losses.dynamic_arcface_margins(torch.arange(1.0, 7.0)), "sub_centers": 2},
    ),
}


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 5, generator=g, dtype=dtype)
    labels = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4, 5])
    return emb, labels


@pytest.mark.parametrize("name", MODULES)
def test_module_equals_pure_function_and_functional_call(name):
    cls, hyper = MODULES[name]
    module = cls(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64, **hyper)
    emb, labels = _data()
    loss = module(emb, labels)
    # The same numbers as the pure function on the same parameter dict.
    fn_hyper = {k: v for k, v in hyper.items() if k not in cls.init_keys}
    pure = cls.loss(emb, labels, {k: v.detach() for k, v in module.params.items()}, **fn_hyper)
    torch.testing.assert_close(loss, pure)
    loss.backward()
    # torch.func over the module's parameters equals autograd into .grad.
    named = {k: v.detach() for k, v in module.named_parameters()}
    grads = torch.func.grad(lambda p: functional_call(module, p, (emb, labels)))(named)
    for k, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
        torch.testing.assert_close(grads[k], p.grad)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_tensor_hyper_parameters_are_buffers_and_move_with_the_module():
    margins = pf.losses.dynamic_arcface_margins(torch.arange(1.0, 7.0))
    module = pf.nn.DynamicArcFace(6, 5, margins=margins, sub_centers=2)
    assert "margins" in dict(module.named_buffers())
    module = module.to(torch.float64)
    assert module.margins.dtype == torch.float64 and module.params["weight"].dtype == torch.float64
    state = module.state_dict()
    clone = pf.nn.DynamicArcFace(6, 5, margins=torch.zeros(6), sub_centers=2).to(torch.float64)
    clone.load_state_dict(state)
    emb, labels = _data()
    torch.testing.assert_close(clone(emb, labels), module(emb, labels))


def test_init_keys_reach_the_init_and_the_loss_reads_them_from_the_shapes():
    module = pf.nn.SubCenterArcFace(4, 8, sub_centers=5)
    assert module.params["weight"].shape == (4, 5, 8)
    assert "sub_centers" not in module.hyper
    module = pf.nn.SoftTriple(4, 8, centers_per_class=2)
    assert module.params["weight"].shape == (4, 2, 8)
