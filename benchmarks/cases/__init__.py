"""Every benchmark case of the pytest-benchmark suite, as one registry for ``benchmarks.run``.

The cases are defined once, in ``bench_core`` (the five core losses), ``bench_miners`` (miners,
mined losses, separate vs reused matrices) and ``bench_extra`` (proxy loss, anchor-batched
losses); this module only gives them a common shape: an :class:`Entry` per (case,
implementation) whose ``make(emb, labels)`` returns ``(fn, params)``.

``kind`` says what ``fn(emb, labels)`` returns: ``"loss"`` (a scalar to differentiate with
respect to ``emb`` and ``params``), ``"mine"`` (a miner's result; no backward) or
``"value_and_grad"`` (an anchor-batched call that returns the loss and the gradient itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import bench_anchor_batched as bench_extra
from . import bench_core_losses as bench_core
from . import bench_miners

Make = Callable[[torch.Tensor, torch.Tensor], tuple[Callable[..., Any], list[torch.Tensor]]]


@dataclass(frozen=True)
class Entry:
    case: str
    impl: str
    kind: str
    make: Make
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def library(self) -> str:
        """``pmlfunc``, ``pml`` or ``floor`` (an impl name may add a variant: ``pmlfunc-full``)."""
        return self.impl.split("-")[0]


def _core() -> dict[str, dict[str, Entry]]:
    out: dict[str, dict[str, Entry]] = {}
    for case in bench_core.CASES:
        out[case] = {
            impl: Entry(
                case, impl, "loss", lambda e, y, c=case, i=impl: (bench_core.make_loss(c, i), [])
            )
            for impl in bench_core.IMPLS
        }
    return out


def _miners() -> dict[str, dict[str, Entry]]:
    out: dict[str, dict[str, Entry]] = {}
    for name, case in bench_miners.CASES.items():
        kind = "loss" if case.grad else "mine"
        out[name] = {
            impl: Entry(name, impl, kind, lambda e, y, m=member: (m.step(), []), dict(case.extra))
            for impl, member in case.impls.items()
        }
    return out


def _extra() -> dict[str, dict[str, Entry]]:
    return {
        name: {
            impl: Entry(name, impl, member.kind, member.make, dict(case.extra))
            for impl, member in case.members.items()
        }
        for name, case in bench_extra.CASES.items()
    }


def entries() -> dict[str, dict[str, Entry]]:
    """``{case: {impl: Entry}}`` in the suite's order."""
    return {**_core(), **_miners(), **_extra()}
