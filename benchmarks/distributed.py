"""The distributed case: a linear encoder under DDP, full-batch contrastive loss of the global batch.

Run one process per device (gloo on CPU here; NCCL with ``--device cuda``):

    torchrun --standalone --nproc_per_node=2 -m benchmarks.distributed \\
        --batch-size 128 --dimensions 128 --output /tmp/pmlfunc-gloo.json

``--batch-size`` is per rank; the global batch is ``world × batch``. Each measured step builds a
fresh graph: ``forward_ms`` covers the encoder, the gather and the loss, ``backward_ms`` the
backward with its collectives and DDP's gradient all-reduce. A barrier aligns the ranks before
each step, outside the measured intervals. Two implementations run on the same inputs:

- ``pmlfunc``: ``pf.distributed.global_objective(pf.losses.contrastive)``;
- ``pml``: PML 2.9.0's ``DistributedLossWrapper(ContrastiveLoss())``.

Both use contrastive ``neg_margin=1.4`` and agree on the loss (checked before timing; PML
returns the world size times the global loss, since it gathers without autograd and rescales). The JSON
holds every rank's raw samples and medians, the spread, the global batch and the git revision;
compare the slowest rank's median (printed by rank 0).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pmlfunc as pf

from . import common as C


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _loss_fns(impl: str):
    if impl == "pmlfunc":
        return pf.distributed.global_objective(
            functools.partial(pf.losses.contrastive, neg_margin=C.CONTRASTIVE_NEG_MARGIN)
        )
    from pytorch_metric_learning.losses import ContrastiveLoss
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

    return DistributedLossWrapper(ContrastiveLoss(neg_margin=C.CONTRASTIVE_NEG_MARGIN))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict | None:
    launched = "RANK" in os.environ
    device = torch.device(args.device)
    if launched:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    x = C.make_embeddings(args.batch_size * world, args.dimensions, dtype=dtype, seed=C.SEED)
    labels = C.make_labels(args.batch_size * world, args.samples_per_class)
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    x_local, y_local = x[rows].to(device), labels[rows].to(device)

    results: dict[str, dict] = {}
    losses: dict[str, float] = {}
    for impl in ("pmlfunc", "pml"):
        torch.manual_seed(0)
        encoder = torch.nn.Linear(args.dimensions, args.dimensions).to(device=device, dtype=dtype)
        model = torch.nn.parallel.DistributedDataParallel(encoder) if launched else encoder
        loss_fn = _loss_fns(impl)
        fwd, bwd = [], []
        for i in range(args.warmup + args.repeats):
            model.zero_grad(set_to_none=True)
            if launched:
                dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_fn(model(x_local), y_local)
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            if i == 0:
                grads = [p.grad for p in encoder.parameters()]
                if not torch.isfinite(loss) or not all(torch.isfinite(g).all() for g in grads):
                    raise RuntimeError(f"{impl}: non-finite loss or gradient")
                losses[impl] = float(loss.detach())
            if i >= args.warmup:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
        total = [f + b for f, b in zip(fwd, bwd, strict=True)]
        results[impl] = {
            "forward_ms": fwd,
            "backward_ms": bwd,
            "median_ms": statistics.median(total),
            "min_ms": min(total),
            "max_ms": max(total),
        }
    # PML returns world × the global loss (it gathers without autograd and rescales instead).
    pml_global = losses["pml"] / world
    if abs(losses["pmlfunc"] - pml_global) > 1e-3 * max(1.0, abs(pml_global)):
        raise RuntimeError(
            f"losses differ: {losses} (PML's divided by the world size: {pml_global})"
        )

    gathered: list = [None] * world
    if launched:
        dist.all_gather_object(gathered, results)
        # DDP's reducer holds the process group: drop the last model before the group goes, or
        # gloo's threads can abort the interpreter's exit ("terminate called without an active
        # exception")
        del model, encoder
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    else:
        gathered = [results]
    if rank != 0:
        return None
    report = {
        "case": "distributed",
        "backend": "nccl" if device.type == "cuda" else ("gloo" if launched else "none"),
        "world_size": world,
        "batch_size_per_rank": args.batch_size,
        "global_batch_size": args.batch_size * world,
        "dimensions": args.dimensions,
        "samples_per_class": args.samples_per_class,
        "dtype": args.dtype,
        "threads": args.threads,
        "device": device.type,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "torch_version": torch.__version__,
        "git_revision": _git_revision(),
        "loss": losses,
        "ranks": gathered,
        "slowest_rank_median_ms": {
            impl: max(r[impl]["median_ms"] for r in gathered) for impl in results
        },
    }
    print(
        f"distributed contrastive, {world} rank(s) x {args.batch_size} "
        f"({report['backend']}): slowest-rank median forward+backward "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in report["slowest_rank_median_ms"].items())
    )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--dimensions", type=int, default=C.DEFAULT_DIM)
    p.add_argument("--samples-per-class", type=int, default=C.DEFAULT_SAMPLES_PER_CLASS)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", default=None, help="write the JSON report here (rank 0)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
