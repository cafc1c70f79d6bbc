"""A training step captured in a CUDA graph and replayed: encoder, pmlfunc loss, miner, update.

pmlfunc's losses and miners have static shapes and never sync with the host, so a whole step
(forward, a batch-hard miner, the triplet loss, backward, and an SGD update done in place on the
parameters) can be captured once with ``torch.cuda.graph`` and replayed for every batch: the
new batch is copied into the captured input tensors, and the seed of the bounded miner is a
tensor advanced in place. The replayed steps are compared with the same steps run eagerly.

On a machine without CUDA it says so and exits with status 0 (nothing can be captured).

Run: python examples/cuda_graph_step.py [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import pmlfunc as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gradcache import load_data, make_encoder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: CUDA-graph capture needs a CUDA device; nothing to do.")
        return 0
    device = torch.device("cuda")
    x_all, y_all = load_data()
    x_all, y_all = x_all.to(device), y_all.to(device)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randperm(len(y_all), generator=gen)[: args.batch_size] for _ in range(args.steps)
    ]
    lr = 0.05

    def train_step(encoder, x, y, seed):
        emb = encoder(x)
        mined = pf.miners.triplet_margin(emb, y, tuples_per_anchor=16, generator=seed)
        loss = pf.losses.triplet_margin(emb, y, margin=0.2, indices_tuple=mined)
        grads = torch.autograd.grad(loss, list(encoder.parameters()))
        with torch.no_grad():
            for p, g in zip(encoder.parameters(), grads, strict=True):
                p.sub_(lr * g)
        return loss.detach()

    # Eager reference.
    eager = make_encoder(seed=0).to(device)
    seed = torch.zeros((), dtype=torch.int64, device=device)
    eager_losses = []
    for rows in batches:
        seed.add_(1)
        eager_losses.append(float(train_step(eager, x_all[rows], y_all[rows], seed)))

    # Captured: static inputs, warm-up on a side stream, one capture, then replays.
    graphed = make_encoder(seed=0).to(device)
    static_x = x_all[batches[0]].clone()
    static_y = y_all[batches[0]].clone()
    seed = torch.zeros((), dtype=torch.int64, device=device)
    snapshot = [p.detach().clone() for p in graphed.parameters()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(graphed, static_x, static_y, seed)
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():  # undo the warm-up updates
        for p, s in zip(graphed.parameters(), snapshot, strict=True):
            p.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train_step(graphed, static_x, static_y, seed)
    with torch.no_grad():  # capture does not run the step: start from the same weights again
        for p, s in zip(graphed.parameters(), snapshot, strict=True):
            p.copy_(s)
    replayed = []
    for rows in batches:
        static_x.copy_(x_all[rows])
        static_y.copy_(y_all[rows])
        seed.add_(1)
        graph.replay()
        replayed.append(float(static_loss))
    worst = max(abs(a - b) for a, b in zip(eager_losses, replayed, strict=True))
    gap = max(
        float((a - b).abs().max())
        for a, b in zip(eager.parameters(), graphed.parameters(), strict=True)
    )
    print(f"{args.steps} replayed steps: loss {replayed[0]:.4f} -> {replayed[-1]:.4f}")
    print(f"largest difference from eager: loss {worst:.2e}, parameters {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
