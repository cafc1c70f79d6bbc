"""Two towers trained with CLIP's or SigLIP's loss on paired "modalities": the left and the right
half of each of scikit-learn's bundled digits.

Each digit (8×8 pixels) is cut into its left and its right 8×4 half; one MLP embeds left halves,
another right halves, and the pair ``(left_i, right_i)`` is the positive. The loss's learnable
logit scale (and SigLIP's bias) are trained with the towers, as CLIP and SigLIP do. After each
epoch the held-out halves are embedded and evaluated as cross-modal retrieval: for each left half,
is its own right half the nearest (pair recall@1) or among the 5 nearest (R@5), the same for each
right half (right→left R@1), and is the nearest right half of the same digit class (class
precision@1)? ``--chunk-size`` runs the tiled path: the same numbers in
``O(chunk × N)`` memory. Runs on CPU in seconds; nothing is downloaded.

Run: python examples/clip_pairs.py [--loss clip|siglip] [--chunk-size 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pmlfunc as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gradcache import load_data

LOSSES = {
    "clip": (pf.losses.clip, pf.losses.clip_init),
    "siglip": (pf.losses.siglip, pf.losses.siglip_init),
}


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The left and the right 8×4 half of each flattened 8×8 digit, ``(N, 32)`` each."""
    img = x.view(-1, 8, 8)
    return img[:, :, :4].reshape(-1, 32), img[:, :, 4:].reshape(-1, 32)


def tower(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))


def evaluate(left: nn.Module, right: nn.Module, xl, xr, y) -> dict[str, float]:
    """Cross-modal retrieval in both directions (``pf.evaluation.cross_modal_scores``: left
    halves as the images, right halves as their one caption each), and the class of each left
    half's nearest right half."""
    with torch.no_grad():
        el, er = left(xl), right(xr)
        s = pf.evaluation.cross_modal_scores(
            el, er, torch.arange(len(y)), metrics=("hit_rate@1", "hit_rate@5")
        )
        idx, _ = pf.evaluation.knn(el, er, k=1)
    l2r, r2l = s["image_to_text"], s["text_to_image"]
    return {
        "pair_recall_at_1": float(l2r["hit_rate@1"]),
        "pair_recall_at_5": float(l2r["hit_rate@5"]),
        "right_to_left_recall_at_1": float(r2l["hit_rate@1"]),
        "class_precision_at_1": float((y[idx[:, 0]] == y).float().mean()),
    }


def report(m: dict[str, float]) -> str:
    return (
        f"pair R@1 {m['pair_recall_at_1']:.3f}  R@5 {m['pair_recall_at_5']:.3f}  "
        f"right→left R@1 {m['right_to_left_recall_at_1']:.3f}  "
        f"class P@1 {m['class_precision_at_1']:.3f}"
    )


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=sorted(LOSSES), default="clip")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    x, y = load_data()
    xl, xr = halves(x)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))
    train, test = order[:1400], order[1400:]
    left, right = tower(args.seed), tower(args.seed + 1)
    loss_fn, init = LOSSES[args.loss]
    params = {k: nn.Parameter(v) for k, v in init().items()}
    optimizer = torch.optim.Adam(
        [*left.parameters(), *right.parameters(), *params.values()], lr=args.lr
    )
    gen = torch.Generator().manual_seed(args.seed + 2)

    history: dict[str, list[float]] = {"loss": []}
    start = time.perf_counter()
    m = evaluate(left, right, xl[test], xr[test], y[test])
    print(f"loss: {args.loss}; {len(train)} training and {len(test)} held-out pairs")
    print(f"epoch  0  loss      -  {report(m)}")
    for key, value in m.items():
        history.setdefault(key, []).append(value)
    for epoch in range(1, args.epochs + 1):
        perm = train[torch.randperm(len(train), generator=gen)]
        total, steps = 0.0, 0
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            rows = perm[i : i + args.batch_size]
            loss = loss_fn(left(xl[rows]), right(xr[rows]), params, chunk_size=args.chunk_size)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        m = evaluate(left, right, xl[test], xr[test], y[test])
        history["loss"].append(total / steps)
        for key, value in m.items():
            history[key].append(value)
        scale = float(params["logit_scale"].detach().exp())
        print(f"epoch {epoch:2d}  loss {total / steps:6.3f}  {report(m)}  scale {scale:6.2f}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return history


if __name__ == "__main__":
    main()
