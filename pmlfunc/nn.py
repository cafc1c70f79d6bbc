"""Thin ``nn.Module`` wrappers for the learnable losses, for users who want modules.

A module owns its parameters (an ``nn.ParameterDict`` built by the loss's ``*_init``) and its
hyper-parameters (tensor-valued ones as buffers, so ``.to()`` moves them); ``forward`` calls the
pure function with ``dict(self.params)``. Everything the function guarantees (no in-place casts,
float32 accumulation, clear errors) holds for the module, and ``torch.func.functional_call``
swaps its parameters like any module's.

Example:
    >>> loss_fn = pf.nn.ProxyAnchor(num_classes=10, embedding_size=16, margin=0.1, alpha=32.0)
    >>> loss = loss_fn(torch.randn(8, 16), torch.randint(0, 10, (8,)))
    >>> loss.backward()  # gradients land in loss_fn.params["proxies"].grad
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import losses as L

__all__ = [
    "ArcFace",
    "CosFace",
    "DynamicArcFace",
    "LargeMarginSoftmax",
    "LearnableLoss",
    "NormalizedSoftmax",
    "P2SGrad",
    "ProxyAnchor",
    "ProxyNCA",
    "SoftTriple",
    "SphereFace",
    "SubCenterArcFace",
]


class LearnableLoss(nn.Module):
    """Base class: subclasses name the pure ``loss``, its ``init`` and the keyword arguments
    that go to ``init`` rather than to the loss (``init_keys``, e.g. ``sub_centers``)."""

    loss: ClassVar[Callable[..., Tensor]]
    init: ClassVar[Callable[..., dict[str, Tensor]]]
    init_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
        **hyper: Any,
    ) -> None:
        super().__init__()
        init_kwargs = {k: hyper.pop(k) for k in self.init_keys if k in hyper}
        params = type(self).init(
            num_classes,
            embedding_size,
            generator=generator,
            dtype=dtype,
            device=device,
            **init_kwargs,
        )
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in params.items()})
        self._tensor_hyper = []
        for k, v in list(hyper.items()):
            if isinstance(v, Tensor):
                self.register_buffer(k, v)
                self._tensor_hyper.append(k)
                del hyper[k]
        self.hyper = hyper

    def forward(self, embeddings: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
        hyper = {**self.hyper, **{k: getattr(self, k) for k in self._tensor_hyper}, **kwargs}
        return type(self).loss(embeddings, labels, dict(self.params), **hyper)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyper.items())


def _module(name: str, loss: Callable, init: Callable, init_keys: tuple[str, ...] = ()) -> type:
    doc = f"Module form of :func:`pmlfunc.losses.{loss.__name__}` (parameters from ``{init.__name__}``)."
    return type(
        name,
        (LearnableLoss,),
        {
            "loss": staticmethod(loss),
            "init": staticmethod(init),
            "init_keys": init_keys,
            "__doc__": doc,
            "__module__": __name__,
        },
    )


ProxyAnchor = _module("ProxyAnchor", L.proxy_anchor, L.proxy_anchor_init)
ProxyNCA = _module("ProxyNCA", L.proxy_nca, L.proxy_nca_init)
NormalizedSoftmax = _module("NormalizedSoftmax", L.normalized_softmax, L.normalized_softmax_init)
SoftTriple = _module("SoftTriple", L.soft_triple, L.soft_triple_init, ("centers_per_class",))
P2SGrad = _module("P2SGrad", L.p2s_grad, L.p2s_grad_init)
LargeMarginSoftmax = _module(
    "LargeMarginSoftmax", L.large_margin_softmax, L.large_margin_softmax_init
)
SphereFace = _module("SphereFace", L.sphereface, L.sphereface_init)
CosFace = _module("CosFace", L.cosface, L.cosface_init)
ArcFace = _module("ArcFace", L.arcface, L.arcface_init)
SubCenterArcFace = _module(
    "SubCenterArcFace", L.subcenter_arcface, L.subcenter_arcface_init, ("sub_centers",)
)
DynamicArcFace = _module(
    "DynamicArcFace", L.dynamic_arcface, L.dynamic_arcface_init, ("sub_centers",)
)
