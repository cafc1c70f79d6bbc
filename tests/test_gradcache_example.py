"""examples/gradcache.py: the GradCache step gives the encoder the full-batch gradients."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pmlfunc as pf

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gradcache.py"

pytest.importorskip("pmlfunc.chunked")


def _load_example():
    spec = importlib.util.spec_from_file_location("pmlfunc_example_gradcache", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load_example()


def _batch(n: int, dtype: torch.dtype, seed: int = 0):
    x, y = gc.load_data(dtype)
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
    return x[idx], y[idx]


def _grads(encoder):
    return [p.grad.clone() for p in encoder.parameters()]


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["float64", "float32"]
)
@pytest.mark.parametrize(
    ("batch", "chunk_size", "sub_batch"),
    [(256, 64, 64), (300, 77, 128)],  # even splits; chunk and sub-batch not dividing the batch
    ids=["even", "uneven"],
)
@pytest.mark.parametrize(
    ("loss_fn", "kw"),
    [("ntxent", {"temperature": 0.1}), ("contrastive", {"neg_margin": 0.8})],
    ids=["tiled-ntxent", "chunked-contrastive"],
)
def test_gradcache_step_equals_full_batch_backward(
    dtype, tol, batch, chunk_size, sub_batch, loss_fn, kw
):
    x, y = _batch(batch, dtype)
    enc_cache = gc.make_encoder(x.shape[1], dropout=0.2, seed=1, dtype=dtype)
    enc_full = gc.make_encoder(x.shape[1], dropout=0.2, seed=1, dtype=dtype)
    loss_fn = getattr(pf.losses, loss_fn)

    torch.manual_seed(3)
    loss_cache = gc.gradcache_backward(
        enc_cache, x, y, loss_fn=loss_fn, chunk_size=chunk_size, sub_batch=sub_batch, **kw
    )
    torch.manual_seed(3)
    loss_full = gc.full_batch_backward(enc_full, x, y, loss_fn=loss_fn, sub_batch=sub_batch, **kw)

    torch.testing.assert_close(loss_cache, loss_full, rtol=tol, atol=tol)
    for g_cache, g_full in zip(_grads(enc_cache), _grads(enc_full), strict=True):
        assert g_cache.dtype == dtype
        torch.testing.assert_close(g_cache, g_full, rtol=tol, atol=tol)


def test_compare_helper_and_train_step():
    x, y = _batch(256, torch.float64)
    diff, scale, dloss = gc.compare_with_full_batch(x, y, chunk_size=100, sub_batch=96)
    assert diff <= 1e-10 * max(scale, 1.0) and dloss <= 1e-10 and scale > 0

    encoder = gc.make_encoder(x.shape[1], seed=2, dtype=torch.float64)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.5)
    losses = [float(gc.train_step(encoder, optimizer, x, y, chunk_size=64)) for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # the cached gradient trains the encoder


def test_gradcache_example_runs():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3", "--batch", "256"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "max |grad diff|" in out and "step   2" in out
    assert "nan" not in out.lower()
