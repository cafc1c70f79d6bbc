r"""What the distributed entry points do before and around their collectives: agree, bound, attribute.

Every eager call of a distributed entry point (:func:`pmlfunc.distributed.global_objective` over
the gather or the ring, :func:`pmlfunc.distributed.value_and_grad`,
:func:`pmlfunc.distributed.cross_batch_memory`, :func:`pmlfunc.distributed.all_gather`) is a
:class:`Session` on its process group:

| step | what happens | on failure |
|---|---|---|
| local checks | the call is bound and validated on each rank, errors caught | carried into the agreement |
| :meth:`Session.agree` | one all-gather of a fixed-size int64 code per rank: the call counter, the entry point and loss, a hash of every argument's description (dtype, trailing shape, presence, hyper-parameters, params keys), an error flag, the batch sizes | the same exception on every rank: a rank's own validation error (its type, naming the rank), or ``ValueError`` naming the argument, the ranks and both values |
| exchanges (:meth:`Session.wait`) | each collective or point-to-point wait bounded by ``timeout`` | :class:`RankError` naming the rank that failed (its exception) or the ranks that never arrived |
| work between them (:meth:`Session.guard`) | an exception here is posted to the process group's store before it propagates | the peers' waits read it within ``POLL`` seconds |

The agreement is the call's first collective, so no data moves before every rank knows that every
other rank is about to exchange the same kinds of tensor (this is what keeps gloo from aborting a
process on mismatched sizes), and an error found on one rank is raised on all of them. A
disagreement found by the agreement leaves the process group usable; a failure after it does
not (peers may have posted transfers that will never complete): the session marks the group
*broken* and every later pmlfunc call on it raises at once.

Bounds and attribution (gloo, CPU): waits run on a helper thread while this one polls the
store every :data:`POLL` seconds, so a peer's posted failure is seen within that time and a
silent peer (dead, stuck elsewhere, or slower than ``timeout``) is reported after ``timeout``
seconds with the ranks that had not arrived. With NCCL, waits are asynchronous by design (the
host does not block on a transfer), so the bound is the process group's own timeout
(``init_process_group(timeout=...)`` with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); the agreement and
the posted failures work the same.

Under ``torch.compile`` none of this runs (it is host code): the compiled paths use the
functional collectives, and sizes must be equal.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DEFAULT_TIMEOUT", "POLL", "RankError", "Session", "describe"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a distributed entry point waits for the other ranks (every wait of a call)."""

POLL = 0.25
"""Seconds between two looks at the store while a wait is not done."""

# the collectives under their 2.13 names, or their older ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_MAGIC = 0x706D6C66  # "pmlf": a code from another library's collective is not ours
_BATCH_SLOTS = 8  # batch-sized tensors a call may exchange (emb_a, emb_b, labels, ...)
_CODE = 6 + _BATCH_SLOTS  # magic, counter, error flag, call hash, arguments hash, n batch


class RankError(RuntimeError):
    """Another rank of the process group failed, or did not arrive in time.

    ``ranks``: the ranks held responsible (those that posted a failure, else those that never
    reached the wait); ``timed_out``: whether this rank gave up after its ``timeout`` (else it
    read a posted failure, or the transport reported the peer gone). Once raised, the process
    group cannot be used by pmlfunc: destroy it and create a new one.
    """

    def __init__(self, message: str, ranks: Sequence[int] = (), *, timed_out: bool = False):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.timed_out = timed_out


@dataclass
class _GroupState:
    calls: int = 0  # pmlfunc sessions on this group so far (the same on every rank)
    broken: str | None = None  # why the group cannot be used any more


_STATES: dict[str, _GroupState] = {}


def describe(value: Any, *, batch: bool = False) -> str:
    """A description of an argument that is the same text in every process for the same kind of
    value: tensors by dtype, device type, shape (``batch``: the leading size as ``*``) and
    whether they require grad (it decides which gradients travel in the backward),
    dicts by key, functions by qualified name, objects by their repr unless it shows an address."""
    if isinstance(value, Tensor):
        shape = ("*", *value.shape[1:]) if batch and value.ndim else tuple(value.shape)
        dims = ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "")
        grad = " requires_grad" if value.requires_grad else ""
        return (
            f"tensor {str(value.dtype).removeprefix('torch.')} {value.device.type} ({dims}){grad}"
        )
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, functools.partial):
        bound = [describe(v) for v in value.args]
        bound += [f"{k}={describe(v)}" for k, v in sorted(value.keywords.items())]
        return f"partial({', '.join([describe(value.func), *bound])})"
    name = getattr(value, "__qualname__", None)
    if callable(value) and name is not None:
        return f"{getattr(value, '__module__', '?')}.{name}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # pragma: no cover - no default store (a custom init): no attribution
        return None


class Session:
    """One eager call of a distributed entry point on ``group``: its agreement, bounded waits and
    failure reports (module docstring). ``what`` names the call in every message; ``timeout`` is
    the bound of every wait (seconds; ``None``: :data:`DEFAULT_TIMEOUT`)."""

    def __init__(self, group, what: str, timeout: float | None = None):
        self.group: Any = group or dist.group.WORLD
        self.what = what
        self.timeout = DEFAULT_TIMEOUT if timeout is None else self.check_timeout(timeout)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.threaded = dist.get_backend(self.group) == "gloo"
        self.key = f"pmlfunc/{getattr(self.group, 'group_name', '') or 'default'}/"
        self.state = _STATES.setdefault(self.key, _GroupState())
        if self.state.broken is not None:
            raise RankError(
                f"{what}: this process group cannot be used by pmlfunc any more "
                f"({self.state.broken}); destroy it and create a new one"
            )
        self.call = self.state.calls
        self.state.calls += 1
        self._store = _store()

    @staticmethod
    def check_timeout(timeout: object) -> float:
        """``timeout`` as seconds; ``ValueError`` unless it is a positive number."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    # ---------------------------------------------------------------- agreement
    def agree(
        self,
        arguments: Mapping[str, Any],
        *,
        batch: Sequence[str] = (),
        error: BaseException | None = None,
        device: torch.device | None = None,
    ) -> dict[str, list[int]]:
        """Agree with every rank on this call (one small all-gather, module docstring) and
        return every rank's leading size of each ``batch`` argument (absent: 0 rows).

        ``arguments``: the call's arguments by name (the ``batch`` ones described without their
        leading size); ``error``: this rank's local validation failure, raised here on this rank
        and reported on the others (then nothing else runs). Raises the same exception on every
        rank when any rank has an error or the descriptions differ."""
        if len(batch) > _BATCH_SLOTS:  # pragma: no cover - an entry point's own constant
            raise AssertionError(f"at most {_BATCH_SLOTS} batch arguments, got {batch}")
        described = {k: describe(v, batch=k in batch) for k, v in arguments.items()}
        sizes = [_rows(arguments.get(k)) for k in batch]
        code = [
            _MAGIC,
            self.call,
            int(error is not None),
            _hash(self.what),
            _hash(repr(sorted(described.items()))),
            len(batch),
            *sizes,
            *[0] * (_BATCH_SLOTS - len(batch)),
        ]
        comm = torch.device("cpu") if self.threaded or device is None else device
        mine = torch.tensor([code], dtype=torch.int64, device=comm)
        table = torch.empty((self.world, _CODE), dtype=torch.int64, device=comm)
        work = _ALL_GATHER(table, mine, group=self.group, async_op=True)
        self.wait([work], "agreeing on the call (its first collective)")
        rows = table.tolist()
        if any(r[2] for r in rows) or len({tuple(r[:6]) for r in rows}) > 1:
            self._disagree(rows, described, error)
        return {k: [r[6 + i] for r in rows] for i, k in enumerate(batch)}

    def _disagree(self, rows, described: dict[str, str], error: BaseException | None):
        """Raise on every rank: the failing ranks' errors, or the first argument that differs."""
        mine = (
            None if error is None else (type(error).__name__, str(error)),
            self.what,
            described,
        )
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)  # every rank is here: no bound
        failed = [(r, e) for r, (e, _, _) in enumerate(every) if e is not None]
        if failed:
            if error is not None:
                raise error
            r, (kind, text) = failed[0]
            more = "".join(f"; rank {q}: {k}: {t}" for q, (k, t) in failed[1:])
            exc = _BUILTIN.get(kind, ValueError)
            raise exc(f"{self.what} refused on rank {r}: {kind}: {text}{more}")
        message = _difference(every, [r[1] for r in rows])
        same = len({w for _, w, _ in every}) == 1  # else no rank's own name for the call
        raise ValueError(f"{self.what if same else 'pmlfunc'}: the ranks disagree: {message}")

    # ---------------------------------------------------------------- bounded waits
    def wait(self, works: Sequence[Any], where: str, peer: int | None = None) -> None:
        """Wait for ``works`` (``dist.Work``), at most ``timeout`` seconds, reading the store for
        posted failures every :data:`POLL` seconds; :class:`RankError` otherwise. ``where``
        says what is awaited; ``peer``: the rank a point-to-point transfer waits for."""
        if not self.threaded:  # NCCL: asynchronous waits; the group's timeout bounds them
            for w in works:
                w.wait()
            return
        done, failure = threading.Event(), []

        def run() -> None:
            try:
                for w in works:
                    w.wait()
            except BaseException as exc:  # reported by the waiting thread
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="pmlfunc-wait", daemon=True).start()
        start = time.monotonic()
        marked = False
        while not done.wait(POLL):
            if not marked:  # slow: say where this rank waits (read by a peer that times out)
                self._post("waiting", f"{self.call}\t{where}")
                marked = True
            self._raise_posted(where)
            if time.monotonic() - start >= self.timeout:
                self._raise_timeout(where, peer)
        if marked:
            self._post("waiting", "")  # no longer waiting
        if failure:  # the transport gave up (a peer's connection closed, gloo's own timeout)
            self._raise_posted(where)
            self._broken(f"{where}: {failure[0]}")
            who = "" if peer is None else f" (waiting for rank {peer})"
            raise RankError(
                f"{self.what}: rank {self.rank}'s transfer failed while {where}{who}: {failure[0]}",
                () if peer is None else (peer,),
            ) from failure[0]

    def all_reduce(self, t: Tensor, where: str, op=dist.ReduceOp.SUM) -> Tensor:
        """``t`` summed (``op``: or reduced so) over the ranks in place (bounded); returns ``t``."""
        self.wait([dist.all_reduce(t, op=op, group=self.group, async_op=True)], where)
        return t

    def gather_padded(self, x: Tensor, top: int, where: str) -> Tensor:
        """Every rank's ``x`` padded to ``top`` rows, concatenated in rank order (bounded)."""
        if x.shape[0] < top:
            x = torch.cat([x, x.new_zeros((top - x.shape[0], *x.shape[1:]))], 0)
        out = x.new_empty((self.world * top, *x.shape[1:]))
        work = _ALL_GATHER(out, x.contiguous(), group=self.group, async_op=True)
        self.wait([work], where)
        return out

    def reduce_scatter_padded(self, g: Tensor, top: int, where: str) -> Tensor:
        """``g`` (every rank's ``top`` padded rows in rank order) summed over the ranks; this
        rank's ``top`` rows of the sum (bounded)."""
        out = g.new_empty((top, *g.shape[1:]))
        work = _REDUCE_SCATTER(out, g.contiguous(), group=self.group, async_op=True)
        self.wait([work], where)
        return out

    # ---------------------------------------------------------------- failures
    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Post an exception raised inside to the store (peers waiting on this rank read it),
        mark the group broken, and let it propagate. A :class:`RankError` (a peer's failure seen
        here) is not this rank's failure: it only marks the group."""
        try:
            yield
        except RankError as exc:
            self._broken(str(exc))
            raise
        except BaseException as exc:
            text = f"{type(exc).__name__}: {exc}"
            self._post("failed", f"{self.call}\t{where}\t{text}", count=True)
            self._broken(f"rank {self.rank} failed while {where}: {text}")
            raise

    def _broken(self, why: str) -> None:
        if self.state.broken is None:
            self.state.broken = f"call #{self.call}, {self.what}: {why}"

    def _post(self, kind: str, value: str, count: bool = False) -> None:
        if self._store is None:
            return
        with contextlib.suppress(Exception):  # the store itself may be gone: nothing to tell
            self._store.set(f"{self.key}{kind}/{self.rank}", value)
            if count:
                self._store.add(f"{self.key}{kind}", 1)

    def _read(self, kind: str) -> dict[int, list[str]]:
        """Every rank's posted ``kind`` entry (rank -> its tab-separated fields)."""
        out: dict[int, list[str]] = {}
        if self._store is None:
            return out
        with contextlib.suppress(Exception):
            for r in range(self.world):
                key = f"{self.key}{kind}/{r}"
                if r != self.rank and self._store.check([key]):
                    out[r] = self._store.get(key).decode().split("\t")
        return out

    def _raise_posted(self, where: str) -> None:
        if self._store is None:
            return
        try:
            if not self._store.add(f"{self.key}failed", 0):
                return
        except Exception:
            return
        posted = self._read("failed")
        if not posted:
            return
        first = min(posted)
        call, at, text = (posted[first] + ["", "", ""])[:3]
        others = "".join(
            f"; rank {r} failed while {p[1]}: {p[2]}" for r, p in posted.items() if r != first
        )
        self._broken(f"rank {first} failed")
        raise RankError(
            f"{self.what}: rank {first} failed (in its pmlfunc call #{call}, while {at}): "
            f"{text}{others}. Rank {self.rank} stopped waiting while {where}.",
            sorted(posted),
        )

    def _raise_timeout(self, where: str, peer: int | None) -> None:
        waits = {r: p for r, p in self._read("waiting").items() if len(p) == 2}
        here = sorted(r for r, (call, _) in waits.items() if call == str(self.call))
        others = {r: p for r, p in waits.items() if r not in here}
        silent = [r for r in range(self.world) if r != self.rank and r not in waits]
        self._broken(f"timed out after {self.timeout:g} s while {where}")
        towards = "" if peer is None else f" (from rank {peer})"
        parts = [f"{self.what}: rank {self.rank} waited {self.timeout:g} s while {where}{towards}"]
        parts.append(f"in pmlfunc call #{self.call} on this process group")
        if here:
            parts.append(f"rank(s) {here} were waiting in it too")
        parts += [
            f"rank {r} is waiting in its call #{c} ({w})" for r, (c, w) in sorted(others.items())
        ]
        if others:
            parts.append(
                "the ranks are at different calls: one skipped a call or made an extra one"
            )
        if silent:
            parts.append(
                f"rank(s) {silent} never reached this call: a rank failed outside pmlfunc, is "
                "stuck in another collective, or is slower than the timeout (raise it with "
                "timeout=...)"
            )
        raise RankError("; ".join(parts) + ".", sorted([*others, *silent]), timed_out=True)


_BUILTIN: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "IndexError": IndexError,
    "KeyError": KeyError,
}


def _rows(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, Tensor) and value.ndim else 0


def _difference(every: list[Any], calls: list[int]) -> str:
    """The first thing that differs between the ranks' ``(error, what, described)``."""
    if len(set(calls)) > 1:
        counts = ", ".join(f"rank {r}: #{c}" for r, c in enumerate(calls))
        return (
            f"they are at different pmlfunc calls on this process group ({counts}): a rank "
            "skipped a call, or ran one the others did not"
        )
    whats = [w for _, w, _ in every]
    if len(set(whats)) > 1:
        return "different calls: " + "; ".join(f"rank {r}: {w}" for r, w in enumerate(whats))
    names = list(every[0][2])
    for _, _, d in every[1:]:
        names += [k for k in d if k not in names]
    for name in names:
        values = [d.get(name, "(not given)") for _, _, d in every]
        if len(set(values)) > 1:
            ranks = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            return f"{name} differs ({ranks}): {_rule(name, values)}"
    return "the arguments' descriptions differ"  # pragma: no cover - hashes of equal texts


def _rule(name: str, values: list[str]) -> str:
    """What every rank must do about ``name``, given how its descriptions differ."""
    if any(v in ("None", "(not given)") for v in values):
        return f"{name} is given on some ranks only; give it on every rank or on none"
    if all(v.startswith("tensor ") for v in values):
        return (
            f"every rank must pass {name} with the same dtype, device type, shape (apart from "
            "the batch size of a batch argument) and requires_grad"
        )
    return f"every rank must pass the same {name}"
