"""A classifier loss with its class table sharded across gloo ranks: per-rank memory and step time
against one process holding the whole table.

    python -m benchmarks.sharded_classes [--classes 1000000] [--batch 512] [--dim 128]
        [--chunk 8192] [--worlds 1,2,4] [--steps 3] [--output FILE]

For each world size ``W`` (``1``: one process, the plain ``arcface(..., class_chunk_size=)``;
else ``pf.distributed.sharded_classes(arcface)`` on ``W`` CPU ranks spawned with
:func:`pmlfunc.testing.spawn_ranks`, each holding ``C / W`` classes
(:func:`pmlfunc.distributed.class_range`) and ``B / W`` rows), every rank reports:

- ``resident_mib``: its shard of the table plus the live-tensor peak of one step
  (:func:`pmlfunc.memory.peak_tensor_bytes`: the gathered rows, the tiles, the shard's gradient):
  what the loss needs on that rank;
- ``step_ms``: the median of ``--steps`` forward + backward steps (the ranks share this
  machine's cores: on a 2-core machine 4 ranks run at most two at a time, so the time is not the
  time on W devices).

Every rank's loss is checked equal to the one-process loss (the same batch and table, sliced).
Prints one JSON line per world size and a summary of the largest rank's resident memory over
the one-process figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import pmlfunc as pf
from pmlfunc.memory import peak_tensor_bytes

MIB = 2**20


def _inputs(classes: int, batch: int, dim: int):
    """The batch and the whole table, the same in every process."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, dim, generator=g)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return x, labels, pf.losses.arcface_init(classes, dim, generator=g)["weight"]


def _measure(loss_fn, x, labels, table, chunk: int, steps: int) -> dict[str, Any]:
    def step():
        xl, w = x.detach().requires_grad_(), table.detach().requires_grad_()
        loss = loss_fn(xl, labels, {"weight": w}, class_chunk_size=chunk)
        torch.autograd.grad(loss, (xl, w))
        return loss.detach()

    loss = step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    _, peak = peak_tensor_bytes(step)
    resident = table.numel() * table.element_size() + peak
    return {
        "loss": float(loss),
        "step_ms": round(statistics.median(times) * 1e3, 1),
        "resident_mib": round(resident / MIB, 1),
        "peak_step_mib": round(peak / MIB, 1),
    }


def on_rank(classes: int, batch: int, dim: int, chunk: int, steps: int) -> dict[str, Any]:
    """One rank's figures: its rows of the batch, its classes of the table."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, labels, whole = _inputs(classes, batch, dim)
    rows = torch.tensor_split(torch.arange(batch), world)[rank]
    start, stop = pf.distributed.class_range(classes)
    table = whole[start:stop].clone()
    del whole  # this rank keeps its shard only
    loss_fn = pf.distributed.sharded_classes(pf.losses.arcface)
    out = _measure(loss_fn, x[rows], labels[rows], table, chunk, steps)
    return {"rank": rank, "classes": stop - start, "rows": len(rows), **out}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        if world == 1:
            x, labels, table = _inputs(args.classes, args.batch, args.dim)
            ranks = [
                {"rank": 0, "classes": args.classes, "rows": args.batch,
                 **_measure(pf.losses.arcface, x, labels, table, args.chunk, args.steps)}
            ]  # fmt: skip
        else:
            ranks = pf.testing.spawn_ranks(
                on_rank, args.classes, args.batch, args.dim, args.chunk, args.steps,
                world_size=world, timeout=1800,
            )  # fmt: skip
        row = {"world": world, "classes": args.classes, "batch": args.batch, "dim": args.dim,
               "chunk": args.chunk, "ranks": ranks}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    losses = [r["loss"] for row in results for r in row["ranks"]]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        raise AssertionError(f"the ranks' losses differ from one process's: {losses}")
    base = max(r["resident_mib"] for r in results[0]["ranks"]) if results else 0.0
    for row in results:
        top = max(r["resident_mib"] for r in row["ranks"])
        slow = max(r["step_ms"] for r in row["ranks"])
        print(
            f"W={row['world']}: largest rank {top} MiB resident ({top / base:.2f}x one process), "
            f"slowest rank's step {slow} ms"
        )
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
