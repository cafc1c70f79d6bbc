"""The self-supervised losses beside the matmul floor: time and memory.

One pytest-benchmark group, ``ssl-b{B}``: ``B`` rows (``PMLFUNC_BENCH_SSL_BATCH``, 512), ``D``
dimensions (``PMLFUNC_BENCH_SSL_DIM``, 128), float32, one thread, forward + backward:

- ``barlow_twins``, ``vicreg``: two views ``(B, D)``;
- ``dino``: 2 teacher and 6 student views ``(B, V, D)`` (``D`` the output dimension);
- ``swav``: 2 high- and 4 low-resolution crops' scores ``(B, V, D)`` (``D`` prototypes);
- ``floor``: the covariance losses' product ``(Z_aᵀ Z_b).sum()`` and its backward.

``extra_info["peak_tensor_mib"]`` is one step's live-tensor peak
(:func:`pmlfunc.memory.peak_tensor_bytes`). The untimed run (the normal ``pytest``) runs each
member at batch ``PMLFUNC_BENCH_SMOKE_SSL_BATCH`` (32).

Timed run::

    pytest benchmarks/cases/bench_self_supervised.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
"""

from __future__ import annotations

import torch

import pmlfunc as pf
from pmlfunc.memory import peak_tensor_bytes

from .. import common as C

BATCH = C.env_int("PMLFUNC_BENCH_SSL_BATCH", 512)
DIM = C.env_int("PMLFUNC_BENCH_SSL_DIM", 128)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_SSL_BATCH", 32)
THREADS = C.env_int("PMLFUNC_BENCH_THREADS", C.DEFAULT_THREADS)
MEMBERS = ("barlow_twins", "vicreg", "dino", "swav", "floor")
VIEWS = {"dino": (2, 6), "swav": (2, 4)}  # (teacher or high-resolution, the others)
MIB = 2**20


def pytest_generate_tests(metafunc) -> None:
    C.parametrize_members(metafunc, "ssl", MEMBERS, BATCH, SMOKE_BATCH)


def inputs(impl: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(C.SEED)
    if impl in VIEWS:
        first, second = VIEWS[impl]
        a, b = (torch.randn(batch, v, DIM, generator=g) for v in (first, second))
        return (a.tanh(), b.tanh()) if impl == "swav" else (a, b)
    return torch.randn(batch, DIM, generator=g), torch.randn(batch, DIM, generator=g)


def loss_of(impl: str):
    if impl == "dino":
        state = pf.losses.dino_init(DIM)
        # the student's views: the teacher's two crops first, then four more
        return lambda t, s: pf.losses.dino(t.detach(), s, state)[0]
    if impl == "floor":
        return lambda a, b: (a.T @ b).sum()
    return getattr(pf.losses, impl)


def bench_self_supervised(benchmark, request, batch: int, impl: str) -> None:
    a0, b0 = inputs(impl, batch)
    fn = loss_of(impl)

    def step() -> torch.Tensor:
        a, b = a0.detach().requires_grad_(), b0.detach().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        return loss.detach()

    with C.set_threads(THREADS):
        loss = C.measure(benchmark, request, step, costs=False)
        _, peak = peak_tensor_bytes(step)
    benchmark.extra_info.update(
        impl=impl, case="ssl", batch=batch, dim=DIM, threads=THREADS,
        loss_value=float(loss), peak_tensor_mib=round(peak / MIB, 1),
    )  # fmt: skip
    assert loss.ndim == 0 and torch.isfinite(loss)
