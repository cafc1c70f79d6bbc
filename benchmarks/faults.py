r"""Fault injection for the distributed entry points: what every rank sees, and when.

Each scenario runs on ``W`` fresh gloo processes (CPU, 127.0.0.1). A rank runs the scenario's
function, and the runner records what it returned or raised and the seconds from the scenario's
start (after a barrier) to that moment. A rank still running after ``--hang`` seconds is killed
and reported as waiting; a rank that dies (gloo's ``SIGABRT`` on mismatched sizes) is reported
with its signal. The ``check_distributed`` scenarios run :func:`pmlfunc.testing.check_distributed`
itself in this process, on a loss that fails on one rank.

    python -m benchmarks.faults                        # every scenario, a Markdown table
    python -m benchmarks.faults --scenario ring-fault  # one (or several, comma-separated)
    python -m benchmarks.faults --pg-timeout 10        # the process group's own timeout

Only public API is used (and one monkeypatch of the ring's tile walk to inject a fault inside the
ring), so the same command measures an older checkout: ``PYTHONPATH=/path/to/old python -m
benchmarks.faults``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

D = 8


def _pf():
    import pmlfunc as pf

    return pf


def _batch(n: int, d: int = D, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(dtype).requires_grad_(), torch.arange(n) % 3


def _dtype_mismatch(rank: int) -> str:
    pf = _pf()
    emb, labels = _batch(6, dtype=torch.float32 if rank == 0 else torch.float64)
    loss = pf.distributed.global_objective(pf.losses.ntxent)(emb, labels)
    loss.backward()
    return f"loss {float(loss.detach()):.4f}"


def _labels_dtype_mismatch(rank: int) -> str:
    pf = _pf()
    emb, labels = _batch(6)
    labels = labels.to(torch.int64 if rank == 0 else torch.int32)
    loss = pf.distributed.global_objective(pf.losses.supcon)(emb, labels)
    loss.backward()
    return f"loss {float(loss.detach()):.4f}"


def _ring_width_mismatch(rank: int) -> str:
    pf = _pf()
    a, _ = _batch(6, d=8 + rank)
    b, _ = _batch(6, d=8 + rank, seed=1)
    ring = pf.distributed.global_objective(pf.losses.clip, exchange="ring")
    loss = ring(a, b, pf.losses.clip_init())
    loss.backward()
    return f"loss {float(loss.detach()):.4f}"


def _labels_on_one_rank(rank: int) -> str:
    pf = _pf()
    a, labels = _batch(6)
    b, _ = _batch(6, seed=1)
    kw = {"labels": labels} if rank == 0 else {}
    loss = pf.distributed.global_objective(pf.losses.clip)(a, b, pf.losses.clip_init(), **kw)
    loss.backward()
    return f"loss {float(loss.detach()):.4f}"


def _empty(loss: str, exchange: str, rank: int) -> str:
    pf = _pf()
    emb, labels = _batch(0 if rank == 1 else 8)
    fn = functools.partial(getattr(pf.losses, loss), temperature=0.1)
    out = pf.distributed.global_objective(fn, exchange=exchange)(emb, labels)
    out.backward()
    return f"loss {float(out.detach()):.4f}, grad rows {tuple(emb.grad.shape)}"


def _ring_fault(rank: int) -> str:
    """Rank 1 raises inside the ring's second tile walk, catches it and carries on to its next
    step; rank 0 is inside the same ring call."""
    import pmlfunc._ring as ring_module

    pf = _pf()
    if rank == 1:
        real, calls = ring_module.block_forward, [0]

        def failing(*args: Any, **kwargs: Any):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected fault in rank 1's tile walk")
            return real(*args, **kwargs)

        ring_module.block_forward = failing
    a, _ = _batch(8)
    b, _ = _batch(8, seed=1)
    ring = pf.distributed.global_objective(pf.losses.clip, exchange="ring")
    params = pf.losses.clip_init()
    for step in range(2):
        try:
            ring(a, b, params).backward()
        except RuntimeError as err:
            if rank != 1 or step:
                raise
            print(f"rank 1 caught: {err}", file=sys.stderr)
    return "two steps done"


def _absent(rank: int) -> str:
    """Rank 1 never calls the loss (it sleeps past the bound); rank 0 waits in the call. With
    a pmlfunc that takes ``timeout=``, the bound is 10 s; otherwise the process group's."""
    import inspect

    pf = _pf()
    if rank == 1:
        time.sleep(25.0)
        return "slept 25 s"
    emb, labels = _batch(6)
    takes = "timeout" in inspect.signature(pf.distributed.global_objective).parameters
    fn = pf.distributed.global_objective(pf.losses.ntxent, **({"timeout": 10.0} if takes else {}))
    return f"loss {float(fn(emb, labels).detach()):.4f}"


RANK_SCENARIOS: dict[str, tuple[str, Callable[[int], str]]] = {
    "dtype": ("gather ntxent, embeddings float32 on rank 0, float64 on rank 1", _dtype_mismatch),
    "labels-dtype": ("gather supcon, labels int64 on rank 0, int32 on rank 1", _labels_dtype_mismatch),
    "ring-width": ("ring clip, embedding width 8 on rank 0, 9 on rank 1", _ring_width_mismatch),
    "labels-one-rank": ("gather clip, labels= on rank 0 only", _labels_on_one_rank),
    "empty-ntxent": ("gather ntxent, rank 1 has 0 rows", functools.partial(_empty, "ntxent", "gather")),
    "empty-supcon": ("gather supcon, rank 1 has 0 rows", functools.partial(_empty, "supcon", "gather")),
    "empty-ring": ("ring ntxent, rank 1 has 0 rows", functools.partial(_empty, "ntxent", "ring")),
    "ring-fault": ("ring clip, rank 1 raises inside the ring, catches it, carries on", _ring_fault),
    "absent": ("gather ntxent, rank 1 never calls it (timeout=10 where pmlfunc takes one)", _absent),
}  # fmt: skip


def _raising_loss(emb, labels):
    import torch.distributed as dist

    pf = _pf()
    if dist.is_initialized() and dist.get_rank() == 1:  # not in the single-process reference
        raise ValueError("injected failure on rank 1")
    return pf.distributed.global_objective(pf.losses.ntxent)(emb, labels)


def _exiting_loss(emb, labels):
    import torch.distributed as dist

    pf = _pf()
    if dist.is_initialized() and dist.get_rank() == 1:
        sys.exit(3)
    return pf.distributed.global_objective(pf.losses.ntxent)(emb, labels)


CHECK_SCENARIOS: dict[str, tuple[str, Callable[..., Any]]] = {
    "check-raises": ("check_distributed, the loss raises on rank 1", _raising_loss),
    "check-exit": ("check_distributed, the loss calls sys.exit(3) on rank 1", _exiting_loss),
}


def _rank_main(rank, world, port, pg_timeout, name, queue) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
    )
    dist.barrier()
    t0 = time.monotonic()
    try:
        outcome = "returned: " + RANK_SCENARIOS[name][1](rank)
    except BaseException as err:  # what this rank sees is the measurement
        outcome = f"{type(err).__name__}: {err}"
        if os.environ.get("PMLFUNC_FAULTS_TRACEBACK"):
            traceback.print_exc()
    queue.put((rank, outcome, time.monotonic() - t0))
    queue.close()
    queue.join_thread()  # the outcome is in the pipe before the process goes
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a peer may still be waiting in a collective


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_scenario(name: str, *, world: int = 2, pg_timeout: float = 1800.0, hang: float = 60.0):
    """Every rank's ``(rank, outcome, seconds)`` for one scenario of :data:`RANK_SCENARIOS`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, pg_timeout, name, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    start = time.monotonic()
    seen: dict[int, tuple[str, float]] = {}
    while len(seen) < world and time.monotonic() - start < hang + 30:
        try:
            rank, outcome, secs = queue.get(timeout=0.2)
            seen[rank] = (outcome, secs)
        except Exception:
            pass
        if all(not p.is_alive() for p in procs) and queue.empty():
            break
        if time.monotonic() - start > hang + 5:  # + start-up
            break
    for r, p in enumerate(procs):
        p.join(timeout=0.5)
        if r in seen:
            continue
        if p.exitcode is not None and p.exitcode < 0:
            seen[r] = (f"died: {signal.Signals(-p.exitcode).name}", float("nan"))
        elif p.exitcode is None:
            seen[r] = (f"still waiting after {hang:.0f} s (killed)", float("nan"))
        else:
            seen[r] = (f"exited with code {p.exitcode}", float("nan"))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [(r, *seen[r]) for r in range(world)]


def run_check_scenario(name: str, *, timeout: float = 60.0):
    """``(outcome, seconds)`` of :func:`pmlfunc.testing.check_distributed` on a failing loss."""
    pf = _pf()
    emb, labels = _batch(8)
    start = time.monotonic()
    try:
        pf.testing.check_distributed(
            CHECK_SCENARIOS[name][1], emb.detach().double(), labels, timeout=timeout
        )
        outcome = "passed"
    except BaseException as err:
        outcome = f"{type(err).__name__}: {err}"
    return outcome, time.monotonic() - start


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="all", help="comma-separated names, or all")
    parser.add_argument("--pg-timeout", type=float, default=1800.0, help="gloo's timeout (s)")
    parser.add_argument("--hang", type=float, default=60.0, help="kill a rank after this (s)")
    parser.add_argument("--width", type=int, default=200, help="outcome column width")
    args = parser.parse_args(argv)
    every = {**RANK_SCENARIOS, **CHECK_SCENARIOS}
    names = list(every) if args.scenario == "all" else args.scenario.split(",")
    rows: list[dict[str, Any]] = []
    print("| scenario | rank | what the rank sees | seconds |")
    print("|---|---|---|---|")
    for name in names:
        if name in RANK_SCENARIOS:
            out = run_rank_scenario(name, pg_timeout=args.pg_timeout, hang=args.hang)
            for rank, outcome, secs in out:
                rows.append({"scenario": name, "rank": rank, "outcome": outcome, "seconds": secs})
        else:
            outcome, secs = run_check_scenario(name, timeout=args.hang)
            rows.append({"scenario": name, "rank": "parent", "outcome": outcome, "seconds": secs})
        for row in rows:
            if row["scenario"] == name:
                print(
                    f"| {name}: {every[name][0]} | {row['rank']} | "
                    f"{_short(row['outcome'], args.width)} | {row['seconds']:.1f} |",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
