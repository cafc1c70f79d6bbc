"""Ring vs gather: per-rank memory and step time of the global CLIP/SigLIP/MNRL loss as the world grows.

One command runs every world size (each under torchrun, gloo on CPU) and writes the table:

    python -m benchmarks.ring --world-sizes 2,4 --batch-size 1024 --dimensions 128 \\
        --markdown docs/benchmarks/ring.md --output /tmp/ring.json

Each rank holds ``--batch-size`` rows of two aligned sets (leaf embeddings, so the loss alone is
measured; ``retrieval``, ``multiple_negatives_ranking``, also ``--negatives`` hard negatives a
row) and runs ``pf.distributed.global_objective(loss, exchange=...)`` forward and backward:

- ``peak_mib``: the peak of live tensor bytes the loss's forward and backward add on the rank
  (:func:`pmlfunc.memory.peak_tensor_bytes`: every ATen op's storages, the received blocks and
  the gathered batch included), the slowest rank's;
- ``step_ms``: the median over ``--repeats`` of forward + backward (after ``--warmup``), ranks
  aligned by a barrier before each step, the slowest rank's.

With ``exchange="gather"`` every rank gathers the global batch and computes the whole loss (CLIP,
SigLIP and MNRL do not split over anchors): its matrix is ``global × global`` (MNRL's ``global ×
(1 + k) global``). The ring keeps a
``local × local`` tile and one block in flight. ``--chunk-size`` runs the tiled engine inside
either. On a machine with fewer cores than ranks the ranks share cores: step times then show the
communication pattern's cost, not a cluster's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pmlfunc as pf
from pmlfunc.memory import peak_tensor_bytes

LOSSES = {
    "clip": (pf.losses.clip, pf.losses.clip_init),
    "siglip": (pf.losses.siglip, pf.losses.siglip_init),
    "retrieval": (pf.losses.multiple_negatives_ranking, pf.losses.multiple_negatives_ranking_init),
}


def _step(objective, sets, params) -> torch.Tensor:
    """One forward and backward of the loss on fresh leaf embeddings (``sets``: the two
    aligned sets, and the hard negatives for ``retrieval``)."""
    leaves = [t.clone().requires_grad_() for t in sets]
    loss = objective(*leaves, params)
    loss.backward()
    return loss.detach()


def _rank_run(args: argparse.Namespace) -> None:
    """One rank's measurements (under torchrun); rank 0 writes the JSON."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(args.batch_size, args.dimensions, generator=g)
    b = torch.randn(args.batch_size, args.dimensions, generator=g)
    negatives = torch.randn(args.batch_size, args.negatives, args.dimensions, generator=g)
    rows = []
    for name in args.losses.split(","):
        fn, init = LOSSES[name]
        sets = (a, b, negatives) if name == "retrieval" else (a, b)
        if args.chunk_size:
            fn = functools.partial(fn, chunk_size=args.chunk_size)
        for exchange in args.exchanges.split(","):
            objective = pf.distributed.global_objective(fn, exchange=exchange)
            params = {k: v.requires_grad_() for k, v in init().items()}

            step = functools.partial(_step, objective, sets, params)

            dist.barrier()
            loss, peak = peak_tensor_bytes(step)
            times = []
            for i in range(args.warmup + args.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            mine = torch.tensor([peak / 2**20, statistics.median(times)], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            rows.append({
                "loss": name, "exchange": exchange, "world_size": world,
                "local_batch": args.batch_size, "global_batch": args.batch_size * world,
                "value": float(loss),
                "peak_mib": max(float(t[0]) for t in every),
                "step_ms": max(float(t[1]) for t in every),
                "ranks": [{"peak_mib": float(t[0]), "step_ms": float(t[1])} for t in every],
            })  # fmt: skip
    if rank == 0 and args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: on a loaded machine gloo's worker threads can
    # abort it ("terminate called without an active exception"); the results are written.
    sys.stdout.flush()
    os._exit(0)


def _launch(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Every world size under torchrun; the rows of all of them."""
    rows: list[dict] = []
    for world in [int(w) for w in args.world_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.json")
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={world}", "-m", "benchmarks.ring", "--rank-run",
                "--output", out, *argv,
            ]  # fmt: skip
            root = Path(__file__).resolve().parents[1]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=root)
            if done.returncode != 0:
                raise RuntimeError(f"world size {world} failed:\n{done.stderr[-4000:]}")
            rows += json.loads(Path(out).read_text())
    return rows


def markdown(rows: list[dict], command: str) -> str:
    """The table: per loss and world size, gather beside ring."""
    lines = [
        "<!-- written by benchmarks/ring.py; do not edit by hand -->",
        "",
        f"Command: `{command}`",
        "",
        "| loss | ranks | global batch | gather peak MiB | ring peak MiB | gather ms | ring ms | values equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keyed = {(r["loss"], r["world_size"], r["exchange"]): r for r in rows}
    for loss, world in sorted({(r["loss"], r["world_size"]) for r in rows}):
        gat, ring = keyed.get((loss, world, "gather")), keyed.get((loss, world, "ring"))
        if gat is None or ring is None:
            continue
        same = abs(gat["value"] - ring["value"]) <= 1e-4 * max(1.0, abs(gat["value"]))
        lines.append(
            f"| {loss} | {world} | {gat['global_batch']:,} | {gat['peak_mib']:.1f} | "
            f"{ring['peak_mib']:.1f} | {gat['step_ms']:.0f} | {ring['step_ms']:.0f} | "
            f"{'yes' if same else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--losses", default="clip,siglip")
    p.add_argument("--exchanges", default="gather,ring")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--dimensions", type=int, default=128)
    p.add_argument("--negatives", type=int, default=3, help="hard negatives a row (retrieval)")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--output", default=None, help="the rows as JSON")
    p.add_argument("--markdown", default=None, help="write the table here")
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_run:
        _rank_run(args)
        return None
    passed = [
        "--losses", args.losses, "--exchanges", args.exchanges,
        "--batch-size", str(args.batch_size), "--dimensions", str(args.dimensions),
        "--negatives", str(args.negatives),
        "--threads", str(args.threads), "--repeats", str(args.repeats),
        "--warmup", str(args.warmup),
    ]  # fmt: skip
    if args.chunk_size:
        passed += ["--chunk-size", str(args.chunk_size)]
    rows = _launch(args, passed)
    table = markdown(rows, "python -m benchmarks.ring " + " ".join(argv))
    print(table)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return rows


if __name__ == "__main__":
    main()
