"""Proxy losses with their weight gradients, pmlfunc vs PML 2.9.0 vs the floor.

Group ``proxy-b{B}`` (reference protocol, ``shared/reference/000_*``): ``temperature=0.1``, one
class per ``samples_per_class`` rows; ``pf.losses.normalized_softmax(e, y, params)`` vs PML's
``NormalizedSoftmaxLoss`` with the same initial weights (PML's layout transposed). Groups
``proxy_nca-b{B}`` and ``p2s_grad-b{B}`` (issue 30: no loss slower than PML): PML's
``ProxyNCALoss`` and ``P2SGradLoss`` with their defaults, pmlfunc given the same weights. The
backward takes the gradients of the embeddings and the weights. The untimed run checks that the
two losses agree (rtol 1e-3, ``benchmarks.cases._bodies.members_agree``).
"""

from __future__ import annotations

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses

import pmlfunc as pf

from .. import common as C
from . import FLOOR, Case, Member, by_name, params
from ._bodies import members_agree

PROXY_TEMPERATURE = 0.1


def _proxy_weights(emb: torch.Tensor, labels: torch.Tensor) -> torch.nn.Module:
    num_classes = int(labels.max()) + 1 if labels.numel() else 1
    torch.manual_seed(C.SEED)  # PML draws its weights from the global generator
    return pml_losses.NormalizedSoftmaxLoss(
        num_classes, emb.shape[1], temperature=PROXY_TEMPERATURE
    ).to(device=emb.device, dtype=emb.dtype)


def _pf_proxy(emb, labels):
    pml = _proxy_weights(emb, labels)
    params = {"weight": pml.W.detach().t().contiguous().requires_grad_()}

    def loss(e, y):
        return pf.losses.normalized_softmax(e, y, params, temperature=PROXY_TEMPERATURE)

    return loss, [params["weight"]]


def _pml_proxy(emb, labels):
    pml = _proxy_weights(emb, labels)
    return (lambda e, y: pml(e, y)), [pml.W]


def _pml_module(emb, labels, make):
    num_classes = int(labels.max()) + 1 if labels.numel() else 1
    torch.manual_seed(C.SEED)  # PML draws its weights from the global generator
    return make(num_classes, emb.shape[1]).to(device=emb.device, dtype=emb.dtype)


# name -> (PML's module from (classes, D), its weight's attribute, PML's layout -> pmlfunc's
# (classes, D), pmlfunc's loss, its params key)
_PAIRED = {
    "proxy_nca": (
        pml_losses.ProxyNCALoss, "proxies", lambda w: w, pf.losses.proxy_nca, "proxies"
    ),
    "p2s_grad": (
        lambda c, d: pml_losses.P2SGradLoss(d, c), "weight", lambda w: w.t(),
        pf.losses.p2s_grad, "weight",
    ),
}  # fmt: skip


def _paired_members(name: str) -> dict[str, Member]:
    make, attr, to_pf, loss_fn, key = _PAIRED[name]

    def pml_member(emb, labels):
        module = _pml_module(emb, labels, make)
        return (lambda e, y: module(e, y)), [getattr(module, attr)]

    def pf_member(emb, labels):
        w = getattr(_pml_module(emb, labels, make), attr)
        params = {key: to_pf(w.detach()).contiguous().requires_grad_()}
        return (lambda e, y: loss_fn(e, y, params)), [params[key]]

    return {"pml": Member(pml_member), "pmlfunc": Member(pf_member), "floor": FLOOR}


CASES = by_name(
    Case(
        "proxy",
        {"pml": Member(_pml_proxy), "pmlfunc": Member(_pf_proxy), "floor": FLOOR},
        extra={"temperature": PROXY_TEMPERATURE},
    ),
    *(Case(name, _paired_members(name)) for name in _PAIRED),
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_proxy_loss(benchmark, request, case: str, impl: str) -> None:
    members_agree(benchmark, request, CASES[case], impl)
