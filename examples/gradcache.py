"""GradCache: train an encoder on a batch larger than its activations would allow.

A contrastive loss couples every embedding in the batch, so the batch cannot simply be split into
independent micro-batches. GradCache (Gao et al., "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup", RepL4NLP 2021) splits the step in three, and
``pf.chunked.gradcache`` runs them:

1. embed the whole batch **without** autograd, ``sub_batch`` rows at a time, recording the random
   state before each sub-batch: only the ``B x D`` embeddings are kept;
2. the loss on the cached embeddings and its gradient with respect to them; ``chunk_size=`` puts
   ``ntxent`` on the tiled engine, so no more than a ``chunk x B`` block of the pair matrix is
   alive at once (``pf.chunked.loss`` does the same for any chunkable loss);
3. re-embed sub-batch by sub-batch **with** autograd, from each sub-batch's recorded random state
   (dropout draws the same masks), and push the cached gradient through: the encoder's
   activations are held for one sub-batch at a time; then ``optimizer.step()``.

The parameter gradients equal those of one ``loss.backward()`` through the same forward (checked
below, with dropout on), as long as the encoder treats samples independently: no BatchNorm in
training mode (its statistics would depend on the sub-batch).

Runs on CPU in seconds with no downloads: scikit-learn's bundled 8x8 digits (random clusters if
scikit-learn is missing) and a small MLP with dropout.

Run: python examples/gradcache.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor, nn

import pmlfunc as pf
import pmlfunc.chunked  # pf.chunked, whether or not pmlfunc imports it

Loss = Callable[..., Tensor]


def load_data(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Features ``(N, 64)`` and integer labels: the digits data set, or 10 random clusters."""
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.as_tensor(digits.data, dtype=dtype) / 16.0
        y = torch.as_tensor(digits.target, dtype=torch.int64)
    except ImportError:  # pragma: no cover - scikit-learn is a test dependency
        gen = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (1800,), generator=gen)
        centres = torch.randn(10, 64, generator=gen, dtype=dtype)
        x = centres[y] + 0.5 * torch.randn(1800, 64, generator=gen, dtype=dtype)
    return x, y


def make_encoder(
    in_dim: int = 64,
    hidden: int = 256,
    emb_dim: int = 64,
    *,
    dropout: float = 0.0,
    seed: int = 0,
    dtype=torch.float32,
) -> nn.Module:
    """A small MLP encoder (no BatchNorm: each sample is embedded independently), with a dropout
    layer after the first activation when ``dropout > 0``."""
    torch.manual_seed(seed)
    layers = [nn.Linear(in_dim, hidden), nn.GELU()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, emb_dim)]
    return nn.Sequential(*layers).to(dtype)


def gradcache_backward(
    encoder: nn.Module,
    x: Tensor,
    labels: Tensor,
    *,
    loss_fn: Loss = pf.losses.ntxent,
    chunk_size: int = 128,
    sub_batch: int = 128,
    **loss_kwargs,
) -> Tensor:
    """One GradCache backward: accumulate the full-batch loss's gradient into ``encoder``'s ``.grad``.

    Returns the (detached) full-batch loss. Call ``optimizer.zero_grad()`` before and
    ``optimizer.step()`` after, as with ``loss.backward()``.
    """
    if loss_fn in (pf.losses.ntxent, pf.losses.supcon):  # the tiled engine's own chunk_size=
        loss_kwargs = {**loss_kwargs, "chunk_size": chunk_size}
    else:  # any other chunkable loss, chunked over anchors with a plain backward
        loss_fn = pf.chunked.loss(loss_fn, chunk_size)
    return pf.chunked.gradcache(
        encoder, x, lambda emb: loss_fn(emb, labels, **loss_kwargs), mini_batch=sub_batch
    )


def full_batch_backward(
    encoder: nn.Module,
    x: Tensor,
    labels: Tensor,
    *,
    loss_fn: Loss = pf.losses.ntxent,
    sub_batch: int | None = None,
    **loss_kwargs,
) -> Tensor:
    """The plain path GradCache must reproduce: one graph for the whole batch, ``loss.backward()``.

    With ``sub_batch``, the forward runs over the same sub-batches in the same order as
    GradCache's, so dropout draws the same masks from the same seed.
    """
    parts = [x] if sub_batch is None else list(x.split(sub_batch))
    loss = loss_fn(torch.cat([encoder(p) for p in parts]), labels, **loss_kwargs)
    loss.backward()
    return loss.detach()


def train_step(
    encoder: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    labels: Tensor,
    **kwargs,
) -> Tensor:
    """zero_grad, GradCache backward, optimizer step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = gradcache_backward(encoder, x, labels, **kwargs)
    optimizer.step()
    return loss


def compare_with_full_batch(
    x: Tensor, labels: Tensor, *, seed: int = 0, dropout: float = 0.1, **kwargs
) -> tuple[float, float, float]:
    """Gradients of two identical encoders from the same random seed, GradCache vs. one
    backward through the same forward.

    Returns ``(max |grad difference|, max |grad|, |loss difference|)`` over all parameters.
    """
    loss_kwargs = {k: v for k, v in kwargs.items() if k not in ("chunk_size", "sub_batch")}
    enc_a = make_encoder(x.shape[1], dropout=dropout, seed=seed, dtype=x.dtype)
    enc_b = make_encoder(x.shape[1], dropout=dropout, seed=seed, dtype=x.dtype)
    torch.manual_seed(seed + 1)
    loss_a = gradcache_backward(enc_a, x, labels, **kwargs)
    torch.manual_seed(seed + 1)
    loss_b = full_batch_backward(
        enc_b, x, labels, sub_batch=kwargs.get("sub_batch", 128), **loss_kwargs
    )
    diff = scale = 0.0
    for pa, pb in zip(enc_a.parameters(), enc_b.parameters(), strict=True):
        diff = max(diff, float((pa.grad - pb.grad).abs().max()))
        scale = max(scale, float(pb.grad.abs().max()))
    return diff, scale, float((loss_a - loss_b).abs())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--sub-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args(argv)

    x_all, y_all = load_data()
    gen = torch.Generator().manual_seed(0)
    opts = dict(chunk_size=args.chunk_size, sub_batch=args.sub_batch, temperature=args.temperature)

    # Once: GradCache gives the full-batch gradients.
    idx = torch.randperm(x_all.shape[0], generator=gen)[: args.batch]
    for dtype in (torch.float32, torch.float64):
        diff, scale, dloss = compare_with_full_batch(
            x_all[idx].to(dtype), y_all[idx], dropout=args.dropout, **opts
        )
        print(
            f"GradCache vs full-batch loss.backward() ({str(dtype).removeprefix('torch.')}): "
            f"max |grad diff| = {diff:.3e} (max |grad| = {scale:.3e}), |loss diff| = {dloss:.3e}"
        )

    encoder = make_encoder(x_all.shape[1], dropout=args.dropout)
    optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
    print(f"training: batch {args.batch}, chunk {args.chunk_size}, sub-batch {args.sub_batch}")
    for step in range(args.steps):
        idx = torch.randperm(x_all.shape[0], generator=gen)[: args.batch]
        loss = train_step(encoder, optimizer, x_all[idx], y_all[idx], **opts)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  ntxent {loss.item():.4f}")


if __name__ == "__main__":
    main()
