"""Peak-memory measurement on CPU (and anywhere else), for tests and benchmarks.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, so this module offers two methods that
answer different questions:

:func:`peak_tensor_bytes` (in-process, exact, deterministic)
    Runs ``fn`` under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees every
    ATen op, including the backward ops run by autograd, the ops inside custom
    ``torch.autograd.Function`` s and those under ``torch.func`` transforms. Every storage an op
    creates is counted once (views share their base's storage) with its ``nbytes`` when it appears
    and taken off again when it is freed (a ``weakref.finalize`` on the storage, whose Python
    object lives exactly as long as the C++ storage). The result is the maximum of that running
    total: the peak of live tensor bytes *added* by the call, the analogue of
    ``torch.cuda.max_memory_allocated`` minus the memory allocated before the call.

    Limits: it ignores allocator overhead and fragmentation (glibc arenas, page rounding,
    CUDA caching-allocator blocks) and touches no real allocator, so it reports the same number
    every run; it counts only storages created by ATen ops *inside* the call (storages that
    existed before, tensors built from Python data, NumPy or DLPack, and the growth of a
    pre-existing storage by ``resize_``/``out=`` are not counted); memory that is not a tensor
    storage (oneDNN/MKL workspaces, autograd metadata, Python objects) is invisible; compiled
    code (``torch.compile``/Inductor) allocates its buffers outside the dispatcher and is not
    seen. Meta tensors are skipped. It slows every op by a few microseconds of Python.

:func:`peak_rss_bytes_subprocess` (out of process, what the operating system sees)
    Runs ``setup`` and then ``code`` in a fresh ``python -c`` process and returns how far the
    process's resident-set high-water mark rose while ``code`` ran. It includes everything the
    real allocator does (glibc arenas and ``mmap`` rounding, freed-but-retained heap, library
    workspaces, thread stacks), so it is the number to compare with a memory budget; it is
    noisier (a few hundred KiB) and only counts pages that were touched (``torch.empty`` without
    a write costs no RSS). Linux only.

Example:
    >>> import torch
    >>> from pmlfunc.memory import peak_tensor_bytes
    >>> _, peak = peak_tensor_bytes(lambda: torch.ones(1024).sum())
    >>> peak  # the 4 KiB vector and the 4-byte sum
    4100
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "LiveStorage",
    "TensorMemoryTracker",
    "peak_rss_bytes_subprocess",
    "peak_tensor_bytes",
]

T = TypeVar("T")


@dataclass(frozen=True)
class LiveStorage:
    """One storage alive at the peak: its size, the op that created it and that output's shape."""

    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


@dataclass
class _Entry:
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    finalizer: Any = field(default=None, repr=False)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or ``None`` where it has none we can count (meta, sparse, wrappers)."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor)]


class TensorMemoryTracker(TorchDispatchMode):
    """Dispatch mode that tracks the live bytes of storages created while it is active.

    Use :func:`peak_tensor_bytes` for a one-shot measurement; use the tracker directly to read the
    running total (``current``), the peak (``peak``), or, with ``record_peak=True``, the storages
    alive at the peak (``peak_storages``, largest first) to see where memory goes::

        with TensorMemoryTracker(record_peak=True) as mem:
            loss = f(x); loss.backward()
        print(mem.peak, mem.peak_storages[:5])

    Counting stops when the ``with`` block exits; storages freed later do not change ``peak``.
    See the module docstring for what is and is not counted.
    """

    def __init__(self, *, record_peak: bool = False) -> None:
        super().__init__()
        self.record_peak = record_peak
        self.current = 0
        self.peak = 0
        self.peak_storages: list[LiveStorage] = []
        self._live: dict[int, _Entry] = {}
        self._lock = threading.RLock()
        self._active = False

    # -- bookkeeping -------------------------------------------------------------------------

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry.nbytes

    def _bump_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            if self.record_peak:
                self.peak_storages = sorted(
                    (
                        LiveStorage(e.nbytes, e.op, e.shape, e.dtype, e.device)
                        for e in self._live.values()
                    ),
                    key=lambda s: -s.nbytes,
                )

    def _track(self, t: torch.Tensor, op: str, input_keys: set[int]) -> None:
        storage = _storage(t)
        if storage is None:
            return
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:  # a view of, or an in-place op on, a storage we already count
            nbytes = storage.nbytes()
            if nbytes != entry.nbytes:  # resized (resize_, out=)
                self.current += nbytes - entry.nbytes
                entry.nbytes = nbytes
            return
        if key in input_keys:  # a view of / in-place op on a storage that predates the call
            return
        entry = _Entry(
            storage.nbytes(), op, tuple(t.shape), t.dtype, str(t.device)
        )  # new storage made by this op
        self._live[key] = entry
        self.current += entry.nbytes
        entry.finalizer = weakref.finalize(storage, self._freed, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        input_keys = set()
        for t in inputs:
            s = _storage(t)
            if s is not None:
                input_keys.add(s._cdata)
        out = func(*args, **kwargs)
        if self._active:
            with self._lock:
                op = str(func)
                for t in _tensors(out):
                    self._track(t, op, input_keys)
                for t in inputs:  # out= arguments and in-place ops may resize what we track
                    s = _storage(t)
                    if s is not None and s._cdata in self._live:
                        self._track(t, op, input_keys)
                self._bump_peak()
        return out

    def __enter__(self):
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            with self._lock:
                self._active = False
                for entry in self._live.values():
                    if entry.finalizer is not None:
                        entry.finalizer.detach()
                self._live.clear()


def peak_tensor_bytes(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, int]:
    """Call ``fn(*args, **kwargs)`` and return ``(result, peak)``.

    ``peak`` is the largest total size in bytes of the tensor storages created during the call
    and alive at the same time, counting each storage once however many views share it: the
    peak memory the call *adds* above what was allocated before it. It includes autograd's saved
    tensors and the backward pass when ``fn`` runs one, and intermediates inside custom autograd
    Functions and ``torch.func`` transforms. Deterministic; ignores allocator overhead; see the
    module docstring for the limits.

    Example:
        >>> import torch
        >>> _, peak = peak_tensor_bytes(lambda n: torch.empty(n).fill_(1.0), 1000)
        >>> peak
        4000
    """
    with TensorMemoryTracker() as tracker:
        result = fn(*args, **kwargs)
    return result, tracker.peak


# -- resident set, in a fresh process ------------------------------------------------------------

_MARKER = "__PMLFUNC_PEAK_RSS__"

# The child resets its own high-water mark after ``setup`` (``/proc/self/clear_refs`` "5", Linux
# >= 4.0) and reads VmHWM, the per-process peak resident set that ``ru_maxrss`` reports. It does not
# rely on ``getrusage`` alone: a child created by vfork/fork + exec (what ``subprocess`` does)
# inherits its parent's ``ru_maxrss``, so in a large parent (a pytest run that held a big tensor)
# ``ru_maxrss`` starts at the parent's peak and never moves. ``ru_maxrss`` is kept as the fallback
# where ``/proc`` is unavailable, and both are returned for inspection.
_CHILD = r"""
import gc, json, resource, sys

def _status():
    try:
        with open("/proc/self/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out if len(out) == 2 else None

def _reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

def _trim():
    # Give the heap memory that setup freed back to the OS (glibc), so the baseline is the memory
    # that is live, not live + whatever free heap glibc happened to keep (up to its trim threshold).
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass

_ns = {"__name__": "__main__"}
exec(compile(SETUP, "<setup>", "exec"), _ns)
gc.collect()
if TRIM:
    _trim()
_reset = _reset_hwm()
_before = _status()
_ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
exec(compile(CODE, "<code>", "exec"), _ns)
_after = _status()
_ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(MARKER + json.dumps({
    "reset": _reset,
    "hwm_before": _before and _before["VmHWM"],
    "rss_before": _before and _before["VmRSS"],
    "hwm_after": _after and _after["VmHWM"],
    "ru_maxrss_before": _ru_before,
    "ru_maxrss_after": _ru_after,
}))
"""


def peak_rss_bytes_subprocess(
    code: str,
    setup: str = "",
    *,
    timeout: float | None = 600.0,
    env: dict[str, str] | None = None,
    trim: bool = True,
    details: bool = False,
) -> int | tuple[int, dict[str, Any]]:
    """Peak resident memory that ``code`` adds, measured in a fresh ``python -c`` process.

    The child runs ``setup`` (imports, inputs: not measured), then records its resident-set
    high-water mark, runs ``code`` in the same namespace and records the mark again; the
    difference, in bytes, is returned. The high-water mark is the kernel's ``VmHWM``, which
    ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` reports in KiB on Linux; it is reset to the
    current resident set after ``setup`` (``/proc/self/clear_refs``), so a transient peak of
    ``setup`` does not hide the peak of ``code``. Where ``/proc`` is unavailable the difference
    of ``ru_maxrss`` is used (a lower bound, 0 if ``setup`` peaked higher).

    The number includes allocator overhead (glibc arenas and ``mmap`` page rounding, memory
    freed but kept by the allocator, oneDNN/MKL workspaces, thread stacks), i.e. what the
    operating system charges the process; only touched pages count. A fresh process means
    neither the caller's heap nor its threads distort it. Note that ``torch.set_num_threads``
    belongs in ``setup`` if the thread count matters.

    Args:
        code: Python source to measure.
        setup: Python source run first in the same namespace, not measured.
        timeout: seconds before the child is killed (``subprocess.TimeoutExpired``).
        env: environment for the child (default: the caller's).
        trim: after ``setup``, return the heap memory it freed to the OS (glibc ``malloc_trim``),
            so the result is the peak over the memory actually live. Without it, glibc keeps up
            to its trim threshold (tens of MiB once large blocks were freed) of free heap
            resident, which ``code`` then reuses without raising the mark: the result drops by a
            varying amount (seen: ±15 MiB around a 32 MiB peak).
        details: also return the raw readings (``dict``).

    Raises:
        RuntimeError: the child failed; the message carries its stderr.
    """
    program = (
        f"SETUP = {textwrap.dedent(setup)!r}\nCODE = {textwrap.dedent(code)!r}\n"
        f"MARKER = {_MARKER!r}\nTRIM = {bool(trim)!r}\n" + _CHILD
    )
    proc = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ) if env is None else env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"peak_rss_bytes_subprocess: child exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    match = re.search(re.escape(_MARKER) + r"(\{.*\})", proc.stdout)
    if match is None:
        raise RuntimeError(
            f"peak_rss_bytes_subprocess: no measurement in the child's output:\n{proc.stdout[-2000:]}"
        )
    info = json.loads(match.group(1))
    if info["hwm_after"] is not None and info["reset"]:
        added = info["hwm_after"] - info["hwm_before"]
    elif info["hwm_after"] is not None:  # no reset: the peak over the resident set at the start
        added = info["hwm_after"] - max(info["hwm_before"], info["rss_before"])
    else:
        added = info["ru_maxrss_after"] - info["ru_maxrss_before"]
    added = max(0, int(added))
    return (added, info) if details else added
