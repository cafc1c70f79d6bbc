"""Thin ``nn.Module`` wrappers for the learnable losses, for users who want modules.

A module owns its parameters (an ``nn.ParameterDict`` built from the loss's ``*_init``) and its
hyper-parameters; ``forward`` calls the pure function with ``dict(self.params)``. Everything the
function does (no in-place casts, fp32 accumulation, errors) holds for the module too.

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

__all__ = ["LearnableLoss"]


class LearnableLoss(nn.Module):
    """Base class: subclasses set ``loss`` and ``init`` (the pure loss and its ``*_init``)."""

    loss: ClassVar[Callable[..., Tensor]]
    init: ClassVar[Callable[..., dict[str, Tensor]]]

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        init_kwargs: dict[str, Any] | None = None,
        **hyper: Any,
    ) -> None:
        super().__init__()
        params = type(self).init(
            num_classes, embedding_size, generator=generator, dtype=dtype, **(init_kwargs or {})
        )
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in params.items()})
        self.hyper = dict(hyper)

    def forward(self, embeddings: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
        return type(self).loss(embeddings, labels, dict(self.params), **{**self.hyper, **kwargs})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyper.items())
