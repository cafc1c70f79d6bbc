"""GradCache: train an encoder on a batch larger than its activations would allow.

A contrastive loss couples every embedding in the batch, so the batch cannot simply be split into
independent micro-batches. GradCache (Gao et al., "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup", RepL4NLP 2021) splits the step in three:

1. embed the whole batch **without** autograd (``torch.no_grad()``, in sub-batches if need be):
   only the ``B x D`` embeddings are kept, no encoder activations;
2. take the loss and its gradient with respect to the embeddings,
   ``pf.chunked.value_and_grad(loss, chunk_size=...)(emb, labels)``, which never holds more than
   a ``chunk x B`` block of the pair matrix at once (anchor-chunked, equal to the full batch);
3. re-embed the batch in sub-batches **with** autograd and call ``sub_emb.backward(g[rows])``
   for each: the chain rule pushes the cached embedding gradient into the encoder's parameters,
   one sub-batch of activations at a time; then ``optimizer.step()``.

The parameter gradients equal those of a plain full-batch ``loss.backward()`` (checked below), as
long as the encoder treats samples independently and deterministically: no BatchNorm in training
mode (its statistics would depend on the sub-batch) and no dropout unless its RNG state is replayed
between steps 1 and 3.

Runs on CPU in seconds with no downloads: scikit-learn's bundled 8x8 digits (random clusters if
scikit-learn is missing) and a small MLP.

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
    in_dim: int = 64, hidden: int = 256, emb_dim: int = 64, *, seed: int = 0, dtype=torch.float32
) -> nn.Module:
    """A small MLP encoder (no BatchNorm, no dropout: each sample is embedded independently)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, emb_dim),
    ).to(dtype)  # fmt: skip


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
    # (1) Embed everything without a graph: only the B x D embeddings are kept.
    with torch.no_grad():
        emb = torch.cat([encoder(xs) for xs in x.split(sub_batch)])
    # (2) Loss and d loss / d embeddings, anchor-chunked: at most chunk x B of the pair matrix.
    value_and_grad = pf.chunked.value_and_grad(loss_fn, chunk_size=chunk_size)
    loss, grad_emb = value_and_grad(emb, labels, **loss_kwargs)
    # (3) Re-embed sub-batch by sub-batch with a graph and push the cached gradient through it.
    for rows in torch.arange(x.shape[0]).split(sub_batch):
        encoder(x[rows]).backward(grad_emb[rows])
    return loss.detach()


def full_batch_backward(
    encoder: nn.Module,
    x: Tensor,
    labels: Tensor,
    *,
    loss_fn: Loss = pf.losses.ntxent,
    **loss_kwargs,
) -> Tensor:
    """The plain path GradCache must reproduce: one graph for the whole batch, ``loss.backward()``."""
    loss = loss_fn(encoder(x), labels, **loss_kwargs)
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
    x: Tensor, labels: Tensor, *, seed: int = 0, **kwargs
) -> tuple[float, float, float]:
    """Gradients of two identical encoders, GradCache vs. full batch.

    Returns ``(max |grad difference|, max |grad|, |loss difference|)`` over all parameters.
    """
    loss_kwargs = {k: v for k, v in kwargs.items() if k not in ("chunk_size", "sub_batch")}
    enc_a = make_encoder(x.shape[1], seed=seed, dtype=x.dtype)
    enc_b = make_encoder(x.shape[1], seed=seed, dtype=x.dtype)
    loss_a = gradcache_backward(enc_a, x, labels, **kwargs)
    loss_b = full_batch_backward(enc_b, x, labels, **loss_kwargs)
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
    args = parser.parse_args(argv)

    x_all, y_all = load_data()
    gen = torch.Generator().manual_seed(0)
    opts = dict(chunk_size=args.chunk_size, sub_batch=args.sub_batch, temperature=args.temperature)

    # Once: GradCache gives the full-batch gradients.
    idx = torch.randperm(x_all.shape[0], generator=gen)[: args.batch]
    for dtype in (torch.float32, torch.float64):
        diff, scale, dloss = compare_with_full_batch(x_all[idx].to(dtype), y_all[idx], **opts)
        print(
            f"GradCache vs full-batch loss.backward() ({str(dtype).removeprefix('torch.')}): "
            f"max |grad diff| = {diff:.3e} (max |grad| = {scale:.3e}), |loss diff| = {dloss:.3e}"
        )

    encoder = make_encoder(x_all.shape[1])
    optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
    print(f"training: batch {args.batch}, chunk {args.chunk_size}, sub-batch {args.sub_batch}")
    for step in range(args.steps):
        idx = torch.randperm(x_all.shape[0], generator=gen)[: args.batch]
        loss = train_step(encoder, optimizer, x_all[idx], y_all[idx], **opts)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  ntxent {loss.item():.4f}")


if __name__ == "__main__":
    main()
