"""Proxy loss: normalized-softmax with its weight gradients, pmlfunc vs PML 2.9.0 vs the floor.

Group ``proxy-b{B}`` (reference protocol, ``shared/reference/000_*``): ``temperature=0.1``, one
class per ``samples_per_class`` rows; ``pf.losses.normalized_softmax(e, y, params)`` vs PML's
``NormalizedSoftmaxLoss`` with the same initial weights (PML's layout transposed). The backward
takes the gradients of the embeddings and the weights. The untimed run checks that the two
losses agree (rtol 1e-3, ``benchmarks.cases._bodies.members_agree``).
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


CASES = by_name(
    Case(
        "proxy",
        {"pml": Member(_pml_proxy), "pmlfunc": Member(_pf_proxy), "floor": FLOOR},
        extra={"temperature": PROXY_TEMPERATURE},
    ),
)


@pytest.mark.parametrize(("case", "impl"), params(CASES.values()))
def bench_proxy_loss(benchmark, request, case: str, impl: str) -> None:
    members_agree(benchmark, request, CASES[case], impl)
