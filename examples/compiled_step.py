"""A whole training step under ``torch.compile(fullgraph=True)``: encoder, pmlfunc loss, update.

The step is a pure function of (parameters, optimiser state, batch): ``torch.func.functional_call``
runs the encoder on an explicit parameter dict, ``torch.func.grad_and_value`` differentiates the
pmlfunc loss, and the SGD-with-momentum update is written out, so nothing in the step syncs with
the host and the whole of it compiles into one graph (a graph break would raise). The same step
runs eagerly first, and the two are compared.

Run: python examples/compiled_step.py [--steps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call, grad_and_value

import pmlfunc as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gradcache import load_data, make_encoder


def make_step(encoder: torch.nn.Module, lr: float, momentum: float, temperature: float):
    """``step(params, velocity, x, y) -> (params, velocity, loss)``, pure and compilable."""

    def loss_of(params, x, y):
        return pf.losses.supcon(functional_call(encoder, params, (x,)), y, temperature=temperature)

    def step(params, velocity, x, y):
        grads, loss = grad_and_value(loss_of)(params, x, y)
        velocity = {k: momentum * velocity[k] + grads[k] for k in params}
        params = {k: params[k] - lr * velocity[k] for k in params}
        return params, velocity, loss

    return step


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)

    x, y = load_data()
    encoder = make_encoder(seed=0)
    params = {k: v.detach() for k, v in encoder.named_parameters()}
    velocity = {k: torch.zeros_like(v) for k, v in params.items()}
    step = make_step(encoder, lr=0.05, momentum=0.9, temperature=0.1)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randperm(len(y), generator=gen)[: args.batch_size] for _ in range(args.steps)]

    start = time.perf_counter()
    compiled = torch.compile(step, fullgraph=True)
    p_c, v_c, loss_c = compiled(params, velocity, x[batches[0]], y[batches[0]])
    print(f"compiled the whole step in {time.perf_counter() - start:.1f} s (fullgraph=True)")
    p_e, v_e, loss_e = step(params, velocity, x[batches[0]], y[batches[0]])
    worst = max(
        float((a[k] - b[k]).abs().max()) for a, b in ((p_c, p_e), (v_c, v_e)) for k in params
    )
    print(
        f"step 1: compiled loss {float(loss_c):.5f}, eager {float(loss_e):.5f}; max parameter/velocity difference {worst:.1e}"
    )

    losses = [float(loss_c)]
    start = time.perf_counter()
    for i, rows in enumerate(batches[1:], start=2):
        p_c, v_c, loss = compiled(p_c, v_c, x[rows], y[rows])
        losses.append(float(loss))
        if i % 10 == 0:
            print(f"step {i:3d}  loss {loss:.4f}")
    steps_s = (time.perf_counter() - start) / max(1, len(batches) - 1)
    print(f"{steps_s * 1e3:.1f} ms per compiled step; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return worst


if __name__ == "__main__":
    main()
