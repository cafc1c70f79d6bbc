"""Train the digits embedding with DDP: each rank embeds a shard, the loss sees the global batch.

Run on CPU with two gloo ranks:

    torchrun --standalone --nproc_per_node=2 examples/ddp.py
    torchrun --standalone --nproc_per_node=2 examples/ddp.py --loss clip --exchange ring

Every step, each rank embeds its half of a global batch and ``pf.distributed.global_objective``
computes the loss of the *whole* batch: ``--exchange gather`` (default) gathers the embeddings
(autograd-aware) and labels; ``--exchange ring`` keeps each rank's rows and passes the other
ranks' blocks around a ring (``--loss`` supcon, ntxent, clip or siglip; per-rank memory flat in
the world size). DDP averages the encoder's gradients. The result is the single-process gradient
of the global batch, which the script checks once at the start. ``clip``/``siglip`` pair each
image with a noisy view of itself (labels: the digit, so same-digit pairs are positives) and
learn the logit scale (and SigLIP's bias). Rank 0 prints the loss and the held-out retrieval
metrics. Started without torchrun it runs as one process (the same code path, the plain loss).
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

# the losses --loss chooses from; clip and siglip take two aligned sets and learnable params
LOSSES = {
    "supcon": pf.losses.supcon,
    "ntxent": pf.losses.ntxent,
    "clip": pf.losses.clip,
    "siglip": pf.losses.siglip,
}


def _init_params(loss: str) -> dict[str, torch.Tensor]:
    init = {"clip": pf.losses.clip_init, "siglip": pf.losses.siglip_init}.get(loss)
    return {} if init is None else {k: v.requires_grad_() for k, v in init().items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--loss", choices=sorted(LOSSES), default="supcon")
    parser.add_argument("--exchange", choices=pf.distributed.EXCHANGES, default="gather")
    parser.add_argument("--chunk-size", type=int, default=None, help="the tiled engine's tile rows")
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
    params = _init_params(args.loss)  # the same on every rank; every rank gets dL/dθ
    optimizer = torch.optim.Adam([*model.parameters(), *params.values()], lr=args.lr)
    loss_fn = pf.distributed.global_objective(LOSSES[args.loss], exchange=args.exchange)
    x_view = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    per_rank = args.batch_size // world

    def shard(rows: torch.Tensor) -> torch.Tensor:
        return rows[rank * per_rank : (rank + 1) * per_rank]

    def step_loss(fn, net, rows: torch.Tensor, p) -> torch.Tensor:
        kw = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
        if args.loss in ("clip", "siglip"):  # two aligned sets: an image and its noisy view
            return fn(net(x[rows]), net(x_view[rows]), p, labels=y[rows], **kw)
        return fn(net(x[rows]), y[rows], temperature=0.1, **kw)

    # One check: the DDP gradient of the global objective is the single-process gradient.
    rows = train[: per_rank * world]
    step_loss(loss_fn, model, shard(rows), params).backward()
    got = torch.cat([p.grad.reshape(-1) for p in [*encoder.parameters(), *params.values()]])
    reference, ref_params = make_encoder(seed=0), _init_params(args.loss)
    step_loss(LOSSES[args.loss], reference, rows, ref_params).backward()
    want = [p.grad.reshape(-1) for p in [*reference.parameters(), *ref_params.values()]]
    want = torch.cat(want)
    gap = float((got - want).abs().max() / want.abs().max())
    optimizer.zero_grad()
    if rank == 0:
        print(
            f"{world} rank(s), {args.loss}, exchange={args.exchange}; DDP gradient vs "
            f"single-process gradient: max relative gap {gap:.1e}"
        )
        assert gap < 1e-4, gap

    gen = torch.Generator().manual_seed(1)  # the same shuffles on every rank
    for epoch in range(1, args.epochs + 1):
        perm = train[torch.randperm(len(train), generator=gen)]
        total, steps = 0.0, 0
        for i in range(0, len(perm) - per_rank * world + 1, per_rank * world):
            rows = shard(perm[i : i + per_rank * world])
            loss = step_loss(loss_fn, model, rows, params)
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
    if launched:  # drop DDP (it holds the process group) before the group goes
        del model, optimizer
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
