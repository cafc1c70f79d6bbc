"""Train the digits embedding with DDP: each rank embeds a shard, the loss sees the global batch.

Run on CPU with two gloo ranks:

    torchrun --standalone --nproc_per_node=2 examples/ddp.py

Every step, each rank embeds its half of a global batch; ``pf.distributed.global_objective``
gathers the embeddings (autograd-aware) and labels and computes the loss of the *whole* batch,
and DDP averages the encoder's gradients. The result is the single-process gradient of the global
batch, which the script checks once at the start. Rank 0 prints the loss and the held-out
retrieval metrics. Started without torchrun it runs as one process (the same code path, with the
plain loss).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pmlfunc as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gradcache import load_data, make_encoder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    torch.manual_seed(0)
    x, y = load_data()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1200], order[1200:]
    encoder = make_encoder(seed=0)  # the same initial weights on every rank
    model = torch.nn.parallel.DistributedDataParallel(encoder) if launched else encoder
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = pf.distributed.global_objective(pf.losses.supcon)
    per_rank = args.batch_size // world

    def shard(rows: torch.Tensor) -> torch.Tensor:
        return rows[rank * per_rank : (rank + 1) * per_rank]

    # One check: the DDP gradient of the global objective is the single-process gradient.
    rows = train[: per_rank * world]
    loss = loss_fn(model(x[shard(rows)]), y[shard(rows)], temperature=0.1)
    loss.backward()
    got = torch.cat([p.grad.reshape(-1) for p in encoder.parameters()])
    reference = make_encoder(seed=0)
    pf.losses.supcon(reference(x[rows]), y[rows], temperature=0.1).backward()
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    gap = float((got - want).abs().max() / want.abs().max())
    optimizer.zero_grad()
    if rank == 0:
        print(
            f"{world} rank(s); DDP gradient vs single-process gradient: max relative gap {gap:.1e}"
        )
        assert gap < 1e-4, gap

    gen = torch.Generator().manual_seed(1)  # the same shuffles on every rank
    for epoch in range(1, args.epochs + 1):
        perm = train[torch.randperm(len(train), generator=gen)]
        total, steps = 0.0, 0
        for i in range(0, len(perm) - per_rank * world + 1, per_rank * world):
            rows = shard(perm[i : i + per_rank * world])
            loss = loss_fn(model(x[rows]), y[rows], temperature=0.1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        if rank == 0:
            with torch.no_grad():
                m = pf.evaluation.retrieval_metrics(encoder(x[test]), y[test])
            print(
                f"epoch {epoch}  loss {total / steps:6.3f}  P@1 {float(m['precision_at_1']):.3f}  "
                f"MAP@R {float(m['mean_average_precision_at_r']):.3f}"
            )
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
