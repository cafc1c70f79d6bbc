r"""Checks users run on their own losses: is a distributed loss the global objective?

A distributed metric loss is right when, under DDP, training on ``W`` ranks does what training
on the whole batch in one process does. For a rank's embeddings ``x_r`` and DDP's averaging of
the parameter gradients, that is exactly:

- every rank returns the single-process loss ``L`` of the global batch;
- every rank's embeddings receive ``W · ∂L/∂x_r`` (DDP divides the sum over ranks by ``W``);
- a parameter of the loss (a logit scale, proxies), averaged over the ranks, receives
  ``∂L/∂θ``.

The classic bugs break the second rule by a factor: a gather without autograd (or of detached
copies) loses the cross-rank terms, and a loss multiplied (or a gradient divided) by the world
size scales everything. :func:`check_distributed` spawns ``W`` gloo processes on the CPU, runs a
loss on shards of the inputs and compares with one process on all of them.
"""

from __future__ import annotations

import inspect
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .losses._tiled import unpartial

__all__ = ["DistributedMismatch", "DistributedReport", "check_distributed", "spawn_ranks"]


class DistributedMismatch(AssertionError):
    """A distributed loss whose value or gradients differ from the single process's."""


@dataclass(frozen=True)
class DistributedReport:
    """What :func:`check_distributed` compared: the world size and every rank's batch size, the
    single-process loss, and the largest absolute differences (over ranks) of the loss and of
    each differentiated input's gradient (embeddings: ``grad_r / W`` against ``∂L/∂x_r``;
    parameters: the mean over ranks against ``∂L/∂θ``)."""

    world_size: int
    sizes: tuple[int, ...]
    loss: float
    loss_diff: float
    grad_diffs: dict[str, float] = field(default_factory=dict)


def check_distributed(
    loss_fn: Callable[..., Tensor],
    *args: Any,
    world_size: int = 2,
    exchange: str = "gather",
    distributed_fn: Callable[..., Tensor] | None = None,
    sizes: tuple[int, ...] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    timeout: float = 300.0,
    **kwargs: Any,
) -> DistributedReport:
    r"""Check that a loss run on ``world_size`` ranks is the single-process loss of the whole batch.

    Spawns ``world_size`` processes in a gloo process group on the CPU. Every tensor argument
    (top level, a value of a dict, or an element of a tuple or list) whose leading dimension is
    the batch size (that of the first argument) is sharded by rows, in rank order (``sizes``:
    every rank's rows; default as equal as possible); the other arguments reach every rank
    whole. Each rank calls ``distributed_fn`` (default:
    ``pf.distributed.global_objective(loss_fn, exchange=exchange)``) on its shards and calls
    ``backward`` on the result. Every floating-point tensor argument (at the same places) is
    differentiated and compared with one process's ``loss_fn`` on the whole inputs, by the
    rules of the module docstring.

    Args:
        loss_fn: the single-process loss, e.g. ``pf.losses.clip``. Picklable (a module-level
            function or a ``functools.partial`` of one): the ranks are new processes.
        *args: its positional arguments on the whole batch (float64 makes differences clear).
        world_size: the number of ranks (CPU processes; 4 fit on 2 cores).
        exchange: ``"gather"`` or ``"ring"`` for the default ``distributed_fn``.
        distributed_fn: your own distributed version of ``loss_fn`` (picklable), taking the same
            arguments on a rank's shards.
        sizes: every rank's batch size (unequal sizes test the padding paths).
        rtol, atol: the tolerances (``torch.allclose``) of the loss and every gradient.
        timeout: seconds before the ranks are stopped and ``TimeoutError`` raised.
        **kwargs: ``loss_fn``'s keyword arguments.

    Returns:
        a :class:`DistributedReport`.

    Raises:
        DistributedMismatch: (an ``AssertionError``) for a loss value or gradient out of
            tolerance, naming the input, the rank and the cause where a factor reveals it (the
            world size: missing cross-rank terms, or a scaled loss).
        RuntimeError: a rank failed (its traceback is in the message).

    Example (two CPU processes, a few seconds):
        >>> emb_a, emb_b = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
        >>> params = pf.losses.clip_init(dtype=torch.float64)
        >>> report = check_distributed(pf.losses.clip, emb_a, emb_b, params, exchange="ring")
        >>> sorted(report.grad_diffs)
        ['emb_a', 'emb_b', "params['logit_scale']"]
        >>> report.loss_diff < 1e-12 and max(report.grad_diffs.values()) < 1e-12
        True
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    names = _names(loss_fn, len(args))
    batch = _batch_size(args, kwargs)
    shard_sizes = _sizes(batch, world_size, sizes)
    expected_loss, expected = _single_process(loss_fn, args, kwargs, names)
    payload = (loss_fn, distributed_fn, exchange, args, kwargs, names, shard_sizes)
    results = spawn_ranks(_check_rank, payload, world_size=world_size, timeout=timeout)
    report = DistributedReport(
        world_size,
        tuple(shard_sizes),
        float(expected_loss),
        max(abs(float(r["loss"]) - float(expected_loss)) for r in results),
    )
    problems = []
    for rank, res in enumerate(results):
        if not torch.allclose(res["loss"], expected_loss, rtol=rtol, atol=atol):
            problems.append(
                f"the loss on rank {rank} is {float(res['loss']):.6g}, the single process's "
                f"{float(expected_loss):.6g}{_factor(res['loss'], expected_loss, world_size)}"
            )
    for name, want in expected.items():
        sharded = name in results[0]["sharded"]
        if sharded:  # per rank: grad_r / W against the rank's rows of ∂L/∂x
            got = torch.cat([res["grads"][name] for res in results]) / world_size
            where = "every rank's rows"
        else:  # DDP's average over ranks
            got = torch.stack([res["grads"][name] for res in results]).mean(0)
            where = "the mean over ranks"
        report.grad_diffs[name] = float((got - want).abs().max()) if want.numel() else 0.0
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            what = f"∂L/∂{name} ({where}"
            what += ", each rank's gradient divided by world_size)" if sharded else ")"
            problems.append(
                f"{what} differs from the single process's by up to "
                f"{report.grad_diffs[name]:.3g}{_factor(got, want, world_size)}"
            )
    if problems:
        raise DistributedMismatch(
            f"{_name(loss_fn)} on {world_size} ranks (batch sizes {shard_sizes}) is not the "
            "single-process loss of the whole batch:\n- " + "\n- ".join(problems)
        )
    return report


def _factor(got: Tensor, want: Tensor, world: int) -> str:
    """A diagnosis when ``got`` is ``want`` times a telling factor."""
    got, want = got.double().reshape(-1), want.double().reshape(-1)
    den = float(want @ want)
    if den == 0.0 or not torch.isfinite(got).all():
        return ""
    c = float(got @ want) / den
    if not torch.allclose(got, c * want, rtol=1e-4, atol=1e-9 * math.sqrt(den)):
        return ""
    if math.isclose(c, 1.0 / world, rel_tol=1e-3):
        return (
            f": it is 1/world_size ({c:.4g}) of it. The cross-rank gradient terms are missing (a "
            "gather without autograd, or of detached copies), or the gradient is divided by "
            "the world size"
        )
    if math.isclose(c, float(world), rel_tol=1e-3):
        return (
            f": it is world_size × ({c:.4g}) it. The loss or its gradient is scaled by the world "
            "size (DDP already averages over ranks)"
        )
    return f": it is {c:.4g} × it"


def _name(fn) -> str:
    fn = unpartial(fn)[0]
    return getattr(fn, "__name__", type(fn).__name__)


def _names(loss_fn, n_args: int) -> list[str]:
    """The names of the positional arguments (from ``loss_fn``'s signature where it has them)."""
    fn, bound, _ = unpartial(loss_fn)
    try:
        params = list(inspect.signature(fn).parameters.values())[len(bound) :]
    except (TypeError, ValueError):
        params = []
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [named[i] if i < len(named) else f"args[{i}]" for i in range(n_args)]


def _batch_size(args, kwargs) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(first, Tensor) or first.ndim == 0:
        raise TypeError("the first argument must be a tensor with a batch dimension")
    return first.shape[0]


def _sizes(batch: int, world: int, sizes) -> list[int]:
    if sizes is None:
        return [batch // world + (r < batch % world) for r in range(world)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or sum(sizes) != batch or min(sizes) < 0:
        raise ValueError(
            f"sizes must give each of the {world} ranks a number of rows (0 for an empty rank) "
            f"adding up to the batch size {batch}, got {sizes}"
        )
    return sizes


def _is_batch(v, batch: int) -> bool:
    return isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == batch


def _prepare(args, kwargs, names, batch, rows) -> tuple[list, dict, dict[str, Tensor], set[str]]:
    """The arguments for one process (``rows``: the shard, or ``None`` for the whole batch),
    every floating-point tensor a fresh leaf that requires grad, and those leaves by name."""
    leaves: dict[str, Tensor] = {}
    sharded: set[str] = set()

    def take(name: str, v):
        if isinstance(v, dict):
            return {k: take(f"{name}[{k!r}]", x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):  # e.g. a guide model's (anchors, positives, negatives)
            return type(v)(take(f"{name}[{i}]", x) for i, x in enumerate(v))
        if not isinstance(v, Tensor):
            return v
        if rows is not None and _is_batch(v, batch):
            v = v[rows[0] : rows[1]]
            sharded.add(name)
        v = v.detach().clone()
        if v.dtype.is_floating_point:
            leaves[name] = v.requires_grad_()
        return v

    new_args = [take(n, v) for n, v in zip(names, args, strict=True)]
    new_kwargs = {k: take(k, v) for k, v in kwargs.items()}
    return new_args, new_kwargs, leaves, sharded


def _single_process(loss_fn, args, kwargs, names):
    batch = _batch_size(args, kwargs)
    a, kw, leaves, _ = _prepare(args, kwargs, names, batch, None)
    loss = loss_fn(*a, **kw)
    return loss.detach(), _grads(loss, leaves)


def _grads(loss: Tensor, leaves: dict[str, Tensor]) -> dict[str, Tensor]:
    """``∂loss/∂leaf`` by name (zeros for a leaf the loss does not reach)."""
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {
        n: torch.zeros_like(v) if g is None else g
        for (n, v), g in zip(leaves.items(), grads, strict=True)
    }


def _check_rank(payload) -> dict[str, Any]:
    """One rank of :func:`check_distributed`: the loss on this rank's shards and its gradients."""
    import torch.distributed as dist

    from .distributed import global_objective

    loss_fn, distributed_fn, exchange, args, kwargs, names, sizes = payload
    rank = dist.get_rank()
    r0 = sum(sizes[:rank])
    batch = _batch_size(args, kwargs)
    a, kw, leaves, sharded = _prepare(args, kwargs, names, batch, (r0, r0 + sizes[rank]))
    fn = distributed_fn or global_objective(loss_fn, exchange=exchange)
    loss = fn(*a, **kw)
    return {"loss": loss.detach(), "grads": _grads(loss, leaves), "sharded": sharded}


def spawn_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0):
    """``fn(*args)`` on each of ``world_size`` new processes in one gloo process group (CPU);
    returns every rank's return value, in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); inside ``fn``,
    ``torch.distributed`` is initialised (``dist.get_rank()`` tells the rank) with ``timeout``
    as the process group's timeout. A rank that raises (or calls ``sys.exit``) makes this raise
    ``RuntimeError`` with its traceback as soon as it has failed (the other ranks are stopped;
    a rank that only saw a peer fail, :class:`pmlfunc.distributed.RankError`, is listed after
    the one that failed first); a rank that dies (a signal, ``os._exit``) raises
    ``RuntimeError`` naming it; ranks still running after ``timeout`` seconds are killed and
    ``TimeoutError`` names them, with any traceback already written. :func:`check_distributed`
    is built on it.

    The ranks are forked from multiprocessing's fork server, which imports ``pmlfunc`` (and
    torch) once per calling process (it is set to preload ``pmlfunc.testing``): the first call
    costs an import of torch, later calls a few tenths of a second, where a freshly spawned
    rank imports torch itself (2-4 s a call on a 2-core CPU). Each rank writes to the
    caller's standard output and error as they are at the call (a test's captured output)
    and sees the caller's environment variables as they are at the call (those read while
    torch is imported are the fork server's). Where a platform has no fork server, the ranks
    are spawned.

    Example (two CPU processes, a second or so):
        >>> spawn_ranks(torch.distributed.get_world_size, world_size=2)
        [2, 2]
    """
    import multiprocessing

    from torch.multiprocessing.spawn import ProcessExitedException, start_processes

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.get_context(method).set_forkserver_preload([__name__])
    streams = (_CallersFd(1), _CallersFd(2))
    with tempfile.TemporaryDirectory() as out_dir:
        setup = (_free_port(), world_size, dict(os.environ), streams)
        ctx = start_processes(
            _rank_main,
            args=(setup, fn, args, out_dir, timeout),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        assert ctx is not None  # join=False: start_processes returns the context
        deadline = time.monotonic() + timeout
        died: str | None = None  # a rank that ended without a result
        timed_out = False
        while True:
            try:
                if ctx.join(timeout=_POLL):
                    break
            except ProcessExitedException as exc:  # join has stopped the other ranks
                if _result(out_dir, exc.error_index) is None:
                    died = f"rank {exc.error_index} died ({_exit_reason(exc.exit_code)})"
                break
            if _failed_ranks(out_dir, world_size):
                break
            if all(_result(out_dir, r) is not None for r in range(world_size)):
                # every rank has its result: a rank that a failed peer left with a pending
                # transfer may never get through the closing barrier; give it a moment
                deadline = min(deadline, time.monotonic() + _GRACE)
            if time.monotonic() >= deadline:
                timed_out = True
                break
        _stop(ctx)
        done = {r: res for r in range(world_size) if (res := _result(out_dir, r)) is not None}
    failed = sorted(
        (r for r, res in done.items() if "traceback" in res),
        key=lambda r: (bool(done[r].get("peer")), r),  # the first failure before its echoes
    )
    reports = "".join(f"\nrank {r} failed:\n{done[r]['traceback']}" for r in failed)
    running = [r for r in range(world_size) if r not in done]
    if timed_out and running:
        raise TimeoutError(
            f"the {world_size} ranks did not finish within {timeout} s: rank(s) {running} "
            f"still running{reports}"
        )
    if died is not None:
        raise RuntimeError(died + reports)
    if failed:
        raise RuntimeError(reports.lstrip("\n"))
    if running:
        raise RuntimeError(f"rank(s) {running} ended without a result")
    return [done[r]["value"] for r in range(world_size)]


_POLL = 0.1  # seconds between two looks at the ranks' result files
_GRACE = 5.0  # seconds the ranks get to leave once every result is in


def _result(out_dir: str, rank: int) -> dict[str, Any] | None:
    path = os.path.join(out_dir, f"rank{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def _failed_ranks(out_dir: str, world: int) -> list[int]:
    return [r for r in range(world) if "traceback" in (_result(out_dir, r) or {})]


def _exit_reason(code: int) -> str:
    if code < 0:
        import signal

        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _stop(ctx) -> None:
    """Kill every rank still running and reap them."""
    for p in ctx.processes:  # (pyright infers [None] * n from torch's unannotated code)
        if p.is_alive():  # pyright: ignore[reportOptionalMemberAccess]
            p.kill()  # pyright: ignore[reportOptionalMemberAccess]
    for p in ctx.processes:
        p.join(timeout=5)  # pyright: ignore[reportOptionalMemberAccess]


class _CallersFd:
    """One of the caller's file descriptors, handed to a rank as it starts: pickled while
    multiprocessing starts the rank, it travels as a duplicated descriptor (over the fork
    server's socket, or inherited by a spawned rank), and unpickles to its number there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return (_detach_fd, (DupFd(self.fd),))


def _detach_fd(dup) -> int:
    return dup.detach()


def _rank_main(rank: int, setup, fn, args, out_dir: str, timeout: float) -> None:
    import datetime

    import torch.distributed as dist

    from ._agree import RankError

    port, world, environ, streams = setup
    for fd, callers in zip((1, 2), streams, strict=True):  # where the caller writes now
        os.dup2(callers, fd)
        os.close(callers)
    os.environ.clear()
    os.environ.update(environ)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    result: dict[str, Any] = {}
    try:
        result["value"] = fn(*args)
    except SystemExit as exc:  # a rank's sys.exit() is a failure to report, not a quiet end
        result["traceback"] = f"sys.exit({exc.code!r}) called:\n{traceback.format_exc()}"
    except BaseException as exc:  # reported by the parent as soon as the file is there
        result["traceback"] = traceback.format_exc()
        result["peer"] = isinstance(exc, RankError)  # it only saw another rank fail
    for stream in (sys.stdout, sys.stderr):  # os._exit below skips the interpreter's flush
        stream.flush()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)  # the parent never reads half a file
    if "traceback" in result:
        os._exit(1)  # no barrier: a peer may be waiting for this rank; the parent stops them
    # Every rank finishes its collectives before the group goes; then leave without the
    # interpreter's teardown, where gloo's worker threads have aborted ("terminate called
    # without an active exception") on a loaded 2-core machine. The result is saved.
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
