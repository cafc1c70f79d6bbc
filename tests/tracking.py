"""Test helper: the largest tensor any aten op creates inside a block."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestTensor(TorchDispatchMode):
    """``with LargestTensor() as rec: ...`` then ``rec.largest`` is the largest numel created
    (forward and backward, custom autograd functions included)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class DispatchedOps(TorchDispatchMode):
    """``with DispatchedOps() as rec: ...`` then ``rec.count`` is the number of aten ops
    dispatched (forward and backward): on a CPU each costs a few µs of overhead, more after a
    large op has evicted the caches. ``rec.names`` counts them by name (``"index_select"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
