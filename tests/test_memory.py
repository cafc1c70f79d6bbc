"""pmlfunc.memory measures what it claims: known allocations, peaks vs. frees, views, autograd."""

from __future__ import annotations

import sys

import pytest
import torch

from pmlfunc.memory import TensorMemoryTracker, peak_rss_bytes_subprocess, peak_tensor_bytes

N = 2**24  # 16 Mi float32 = 64 MiB: large against the RSS noise of a fresh interpreter
MIB = 2**20

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS method is Linux")


# -- (a) live tensor bytes ----------------------------------------------------------------------


def test_tensor_bytes_known_allocation():
    _, peak = peak_tensor_bytes(lambda: torch.empty(N).fill_(1))
    assert peak == N * 4  # exact: one storage, nothing else


def test_tensor_bytes_result_and_kwargs():
    out, peak = peak_tensor_bytes(torch.full, (1000,), fill_value=2.0)
    assert torch.equal(out, torch.full((1000,), 2.0))
    assert peak == 4000


def test_tensor_bytes_two_live_buffers_vs_one_at_a_time():
    n = 2**20

    def both_alive():
        a = torch.ones(n)
        b = torch.ones(n)
        return float(a.sum()) + float(b.sum())

    def one_at_a_time():
        a = torch.ones(n)
        s = float(a.sum())
        del a
        b = torch.ones(n)
        return s + float(b.sum())

    r1, peak_both = peak_tensor_bytes(both_alive)
    r2, peak_one = peak_tensor_bytes(one_at_a_time)
    assert r1 == r2
    assert peak_both >= 2 * n * 4
    assert peak_one < 1.01 * n * 4 + 64  # the second buffer reuses none of the first's count
    assert peak_both - peak_one >= n * 4 - 64


def test_tensor_bytes_views_are_not_double_counted():
    n = 2**20

    def views():
        x = torch.ones(n)
        parts = [x[1:], x[::2], x.view(1024, -1), x.view(1024, -1).T, x.unsqueeze(0), x.detach()]
        x.view(1024, -1)[0].add_(1)  # in place on a view: no new storage either
        return sum(p.numel() for p in parts)

    _, peak = peak_tensor_bytes(views)
    assert peak == n * 4


def test_tensor_bytes_preexisting_storage_not_counted():
    x = torch.ones(2**20)
    _, peak = peak_tensor_bytes(lambda: x.mul_(2).view(-1, 2)[:, 0])  # in place + views
    assert peak == 0
    _, peak = peak_tensor_bytes(lambda: x * 2)  # a new output is counted
    assert peak == x.nbytes


def test_tensor_bytes_frees_are_subtracted():
    with TensorMemoryTracker() as mem:
        for _ in range(5):
            y = torch.ones(2**20)
            del y
        assert mem.current == 0
    assert mem.peak == 2**20 * 4


def test_tensor_bytes_resize_is_followed():
    def grow():
        out = torch.empty(0)
        torch.add(torch.ones(1000), 1, out=out)  # out= resizes the empty storage
        return out

    _, peak = peak_tensor_bytes(grow)
    assert peak >= 4000 + 4000  # the input and the resized output


def test_tensor_bytes_autograd_forward_backward():
    b, d = 512, 128
    emb = torch.randn(b, d, requires_grad=True)

    def step():
        loss = (emb @ emb.T).sum()
        (grad,) = torch.autograd.grad(loss, emb)
        return grad

    grad, peak = peak_tensor_bytes(step)
    assert peak >= b * b * 4  # the B x B output
    assert grad.shape == (b, d)

    # Saved tensors: exp() saves its B x B output for backward, and backward allocates another
    # B x B gradient while it is alive.
    def step_exp():
        loss = (emb @ emb.T).exp().mean()
        (grad,) = torch.autograd.grad(loss, emb)
        return grad

    with TensorMemoryTracker(record_peak=True) as mem:
        step_exp()
    assert mem.peak >= 2 * b * b * 4
    big = [s for s in mem.peak_storages if s.shape == (b, b)]
    assert len(big) >= 2 and any("exp" in s.op for s in big)


def test_tensor_bytes_custom_function_intermediates():
    n = 2**20

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            tmp = torch.exp(x)  # an intermediate that lives only inside forward
            ctx.save_for_backward(tmp)
            return (tmp * 2).sum()

        @staticmethod
        def backward(ctx, g):
            (tmp,) = ctx.saved_tensors
            scratch = tmp * 3  # an intermediate inside backward
            return g * scratch / 1.5

    x = torch.zeros(n, requires_grad=True)

    def run():
        (grad,) = torch.autograd.grad(Scaled.apply(x), x)
        return grad

    grad, peak = peak_tensor_bytes(run)
    torch.testing.assert_close(grad, torch.full((n,), 2.0))
    # forward: tmp and tmp * 2 alive together; backward: tmp, scratch and the result.
    assert peak >= 3 * n * 4


def test_tensor_bytes_under_torch_func():
    b, d = 256, 32
    emb = torch.randn(b, d)
    grad, peak = peak_tensor_bytes(torch.func.grad(lambda e: (e @ e.T).exp().mean()), emb)
    assert grad.shape == (b, d)
    assert peak >= 2 * b * b * 4


# -- (b) resident set in a fresh process --------------------------------------------------------


@linux_only
def test_rss_known_allocation():
    added = peak_rss_bytes_subprocess(f"x = torch.empty({N}).fill_(1)", "import torch")
    assert abs(added - N * 4) <= 0.03 * N * 4, added / MIB


@linux_only
def test_rss_untouched_and_setup_not_counted():
    # A big transient peak in setup is not charged to the code, and nothing touched: ~0.
    setup = f"import torch\ny = torch.empty({N}).fill_(1)\ndel y"
    added = peak_rss_bytes_subprocess("x = 1 + 1", setup)
    assert added < 0.03 * N * 4, added / MIB


@linux_only
def test_rss_transient_peak_is_seen():
    # Allocated and freed inside the code: the high-water mark still holds it.
    code = f"x = torch.empty({N}).fill_(1)\ns = float(x.sum())\ndel x"
    # The first reduction starts the thread pool (a few MiB of stacks): do it in setup.
    added = peak_rss_bytes_subprocess(code, "import torch\nfloat(torch.ones(2**16).sum())")
    assert abs(added - N * 4) <= 0.03 * N * 4, added / MIB


@linux_only
def test_rss_not_inherited_from_a_large_parent():
    # subprocess children inherit the parent's ru_maxrss; the measurement must not be fooled.
    big = torch.empty(2 * N).fill_(1)  # the caller holds 128 MiB
    added, info = peak_rss_bytes_subprocess(
        f"x = torch.empty({N // 2}).fill_(1)", "import torch", details=True
    )
    del big
    assert abs(added - N * 2) <= 0.05 * N * 2, (added / MIB, info)


@linux_only
def test_rss_child_error_is_reported():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        peak_rss_bytes_subprocess("1 / 0")
