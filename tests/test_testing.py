"""pmlfunc.testing.check_distributed: spawned gloo ranks against one process, for correct losses
(the ring on four ranks, unequal shards) and for the classic distributed-gradient bugs."""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import pmlfunc as pf
from pmlfunc.testing import DistributedMismatch, DistributedReport, check_distributed

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

B, D = 16, 5


def _inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(B, D, generator=g, dtype=torch.float64)
    b = torch.randn(B, D, generator=g, dtype=torch.float64)
    return a, b, torch.randint(0, 4, (B,), generator=g)


NTXENT = functools.partial(pf.losses.ntxent, temperature=0.1)


def _detached_gather_ntxent(emb, labels):
    """The bug of a gather without autograd: other ranks' rows are constants, the own rows keep
    their gradient (so the loss is right and the gradient misses the cross-rank terms)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(emb) for _ in range(world)]
    dist.all_gather(parts, emb.detach().contiguous())
    labels_all = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(labels_all, labels)
    parts[rank] = emb
    return NTXENT(torch.cat(parts), torch.cat(labels_all))


def _world_scaled_ntxent(emb, labels):
    """The bug of rescaling by the world size on top of an autograd-aware gather."""
    return dist.get_world_size() * pf.distributed.global_objective(NTXENT)(emb, labels)


def _gathered_ntxent(emb, labels):
    """A caller's own distributed loss: here, right (pmlfunc's gather)."""
    return pf.distributed.global_objective(NTXENT)(emb, labels)


def _failing(emb, labels):
    raise RuntimeError("this rank's loss broke")


def _failing_on_rank_1(emb, labels):
    """Rank 1 raises before the gather; rank 0 waits for it in the call's first collective."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1's loss broke")
    return pf.distributed.global_objective(NTXENT)(emb, labels)


def _exiting_on_rank_1(emb, labels):
    if dist.get_rank() == 1:
        sys.exit(3)
    return pf.distributed.global_objective(NTXENT)(emb, labels)


def _dying_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(5)
    time.sleep(60)


def _slow_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def _temperature_grads(temperature: float, sizes: tuple[int, ...]):
    """Each rank's gradient of the global NT-Xent in a learnable temperature (anchors split
    over the ranks: each rank differentiates its own share)."""
    a, _, y = _inputs()
    rank = dist.get_rank()
    r0 = sum(sizes[:rank])
    t = torch.tensor(temperature, dtype=torch.float64, requires_grad=True)
    emb = a[r0 : r0 + sizes[rank]].clone().requires_grad_()
    loss = pf.distributed.global_objective(pf.losses.ntxent)(
        emb, y[r0 : r0 + sizes[rank]], temperature=t
    )
    loss.backward()
    return t.grad


def _one_rank_doubles_the_temperature_gradient(emb, labels, *, temperature):
    """A wrong distributed loss: the right value and embedding gradients, but rank 1's
    temperature gradient counts its share twice (every rank makes the same calls)."""
    objective = pf.distributed.global_objective(pf.losses.ntxent)
    loss = objective(emb, labels, temperature=temperature)
    extra = objective(emb.detach(), labels, temperature=temperature)  # reaches temperature only
    return loss + extra - extra.detach() if dist.get_rank() == 1 else loss


@pytest.mark.parametrize(
    ("loss_fn", "form"),
    [
        (functools.partial(pf.losses.ntxent, temperature=0.2, chunk_size=3), "self"),
        (functools.partial(pf.losses.supcon, temperature=0.2), "self"),
        (functools.partial(pf.losses.clip, chunk_size=3), "pair-labels"),
        (pf.losses.siglip, "pair"),
    ],
    ids=["ntxent-tiled", "supcon", "clip-tiled-labels", "siglip"],
)
def test_the_ring_on_four_ranks_with_unequal_shards_is_the_global_loss(loss_fn, form):
    a, b, y = _inputs()
    if form == "self":
        args, kwargs = (a, y), {}
    else:
        params = pf.losses.siglip_init(logit_scale=1.2, logit_bias=-1.5, dtype=torch.float64)
        args, kwargs = (a, b, params), ({"labels": y} if form == "pair-labels" else {})
    report = check_distributed(
        loss_fn, *args, world_size=4, exchange="ring", sizes=(5, 4, 4, 3), rtol=1e-9, atol=1e-12,
        **kwargs,
    )  # fmt: skip
    assert isinstance(report, DistributedReport)
    assert report.world_size == 4 and report.sizes == (5, 4, 4, 3)
    expected = {"embeddings"} if form == "self" else {"emb_a", "emb_b"}
    if form != "self":
        expected |= {"params['logit_scale']", "params['logit_bias']"}
    assert set(report.grad_diffs) == expected
    assert report.loss_diff < 1e-12 and max(report.grad_diffs.values()) < 1e-12


def test_the_gather_passes_with_the_callers_own_distributed_fn():
    a, _, y = _inputs()
    report = check_distributed(NTXENT, a, y, distributed_fn=_gathered_ntxent, rtol=1e-9)
    assert report.grad_diffs["embeddings"] < 1e-12


def test_a_gather_without_autograd_fails_as_missing_cross_rank_terms():
    a, _, y = _inputs()
    with pytest.raises(DistributedMismatch) as err:
        check_distributed(NTXENT, a, y, distributed_fn=_detached_gather_ntxent)
    message = str(err.value)
    assert "∂L/∂embeddings" in message and "1/world_size" in message
    assert "cross-rank gradient terms are missing" in message
    assert "the loss on rank" not in message  # the value itself is right


def test_a_loss_scaled_by_the_world_size_fails_as_scaled():
    a, _, y = _inputs()
    with pytest.raises(DistributedMismatch) as err:
        check_distributed(NTXENT, a, y, distributed_fn=_world_scaled_ntxent)
    message = str(err.value)
    assert "the loss on rank 0" in message and "the loss on rank 1" in message
    assert "scaled by the world size" in message and "∂L/∂embeddings" in message


def test_a_failing_rank_is_reported_with_its_traceback():
    # both ranks raise: whichever the harness sees first is reported (the other may be stopped
    # before its result is written), by its rank and with its traceback
    a, _, y = _inputs()
    with pytest.raises(
        RuntimeError,
        match=r"^rank [01] failed:\nTraceback(.|\n)*"
        r"in _failing(.|\n)*this rank's loss broke",
    ):
        check_distributed(NTXENT, a, y, distributed_fn=_failing)


def test_bad_arguments():
    a, _, y = _inputs()
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        check_distributed(NTXENT, a, y, world_size=1)
    with pytest.raises(ValueError, match="sizes must give each of the 2 ranks"):
        check_distributed(NTXENT, a, y, sizes=(10, 10))
    with pytest.raises(ValueError, match="sizes must give each of the 2 ranks"):
        check_distributed(NTXENT, a, y, sizes=(17, -1))
    with pytest.raises(TypeError, match="first argument must be a tensor"):
        check_distributed(NTXENT, [1, 2], y)
    with pytest.raises(TypeError, match="first argument must be a tensor with a batch dimension"):
        check_distributed(NTXENT, torch.tensor(1.0), y)  # 0-d: no batch dimension


def test_a_rank_that_raises_while_its_peer_waits_is_reported_within_seconds_with_its_traceback():
    a, _, y = _inputs()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        # the default timeout, 300 s, is not what ends it
        check_distributed(NTXENT, a, y, distributed_fn=_failing_on_rank_1)
    message = str(err.value)
    assert message.startswith("rank 1 failed:") and "rank 1's loss broke" in message
    assert "Traceback" in message and "ValueError" in message
    assert time.monotonic() - start < 60.0


def test_a_rank_that_calls_sys_exit_is_reported_as_such():
    a, _, y = _inputs()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed:\nsys.exit\(3\) called"):
        check_distributed(NTXENT, a, y, distributed_fn=_exiting_on_rank_1)
    assert time.monotonic() - start < 60.0


def test_spawn_ranks_runs_two_ranks_by_default_and_returns_their_values_in_rank_order():
    assert pf.testing.spawn_ranks(dist.get_rank, timeout=120) == [0, 1]


def _ntxent_with_extras(emb, labels, unused, empty):
    """NT-Xent, with a float argument it never reads and an empty one."""
    return NTXENT(emb, labels)


def test_an_input_the_loss_does_not_reach_and_an_empty_one_have_zero_differences():
    a, _, y = _inputs()
    unused, empty = torch.randn(3, dtype=torch.float64), torch.empty(0, dtype=torch.float64)
    report = check_distributed(_ntxent_with_extras, a, y, unused, empty, rtol=1e-9)
    assert report.grad_diffs["unused"] == 0.0 and report.grad_diffs["empty"] == 0.0
    assert report.grad_diffs["emb"] < 1e-12


def _slightly_off_ntxent(emb, labels):
    """The global NT-Xent off by 1.5e-5 of itself: beyond the default rtol of 1e-5."""
    return (1 + 1.5e-5) * pf.distributed.global_objective(NTXENT)(emb, labels)


def test_a_loss_off_by_more_than_the_default_tolerance_fails():
    a, _, y = _inputs()
    with pytest.raises(DistributedMismatch, match="the loss on rank 0"):
        check_distributed(NTXENT, a, y, distributed_fn=_slightly_off_ntxent)
    check_distributed(NTXENT, a, y, distributed_fn=_slightly_off_ntxent, rtol=2e-5)


def test_spawn_ranks_names_a_rank_that_dies_without_a_result():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 5\)"):
        pf.testing.spawn_ranks(_dying_on_rank_1, world_size=2, timeout=120)
    assert time.monotonic() - start < 60.0


def test_spawn_ranks_names_the_ranks_still_running_at_its_timeout():
    # 8 s: rank 0 must start (the fork server may import torch first, 2 s) and return within
    # it on a loaded 2-core machine (with 3 s it was sometimes still starting, and was named too)
    with pytest.raises(TimeoutError, match=r"within 8 s: rank\(s\) \[1\] still running"):
        pf.testing.spawn_ranks(_slow_on_rank_1, world_size=2, timeout=8)


def _environment_and_parent(name: str) -> tuple[str | None, int]:
    print(f"rank {dist.get_rank()} writes here")
    print(f"rank {dist.get_rank()} warns here", file=sys.stderr)
    return os.environ.get(name), os.getppid()


@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here"
)
def test_spawn_ranks_forks_every_call_from_one_server_with_the_callers_environment_and_output(
    monkeypatch, capfd
):
    """The ranks of two calls have one parent that is not the caller (the fork server, which
    imported torch once), see the caller's environment as it is at each call, and write to
    the caller's standard output and error as they are at the call (here pytest's capture)."""
    with capfd.disabled():  # a fork server started now writes outside the capture
        pf.testing.spawn_ranks(dist.get_rank, timeout=120)
    monkeypatch.setenv("PMLFUNC_PROBE", "first")
    first = pf.testing.spawn_ranks(_environment_and_parent, "PMLFUNC_PROBE", timeout=120)
    monkeypatch.setenv("PMLFUNC_PROBE", "second")
    second = pf.testing.spawn_ranks(_environment_and_parent, "PMLFUNC_PROBE", timeout=120)
    assert [env for env, _ in first] == ["first", "first"]
    assert [env for env, _ in second] == ["second", "second"]
    parents = {parent for _, parent in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # spawned ranks: the caller
    out, err = capfd.readouterr()
    assert out.count("rank 0 writes here") == 2 and out.count("rank 1 writes here") == 2
    assert err.count("rank 0 warns here") == 2 and err.count("rank 1 warns here") == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes", [(4, 4, 4, 4), (7, 5, 4), (6, 5, 5), (2, 6, 5, 3)], ids=["4-equal", "3-unequal", "3-equal-ish", "4-unequal"]
)  # fmt: skip
def test_parameter_gradients_that_differ_by_rank_are_compared_by_their_mean(sizes):
    """A learnable temperature over the anchor-split gather: each rank's gradient is its own
    share (they differ), and check_distributed passes on their mean, the single-process
    gradient (comparing one rank's would fail)."""
    world = len(sizes)
    per_rank = torch.stack(
        pf.testing.spawn_ranks(_temperature_grads, 0.2, sizes, world_size=world, timeout=120)
    )
    a, _, y = _inputs()
    t = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(pf.losses.ntxent(a, y, temperature=t), t)
    assert float(per_rank.max() - per_rank.min()) > 1e-3 * abs(float(want))  # they differ
    torch.testing.assert_close(per_rank.mean(), want, rtol=1e-10, atol=1e-12)
    report = check_distributed(
        pf.losses.ntxent, a, y, world_size=world, sizes=sizes, rtol=1e-9, atol=1e-12,
        temperature=torch.tensor(0.2, dtype=torch.float64),
    )  # fmt: skip
    assert set(report.grad_diffs) == {"embeddings", "temperature"}
    assert report.grad_diffs["temperature"] < 1e-12


def test_a_parameter_gradient_wrong_on_one_rank_is_caught():
    a, _, y = _inputs()
    with pytest.raises(DistributedMismatch, match=r"∂L/∂temperature \(the mean over ranks\)"):
        check_distributed(
            pf.losses.ntxent, a, y, distributed_fn=_one_rank_doubles_the_temperature_gradient,
            temperature=torch.tensor(0.2, dtype=torch.float64),
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_the_ring_with_equal_shards_is_the_global_loss(world):
    """Equal shards on 3 and 4 ranks (the unequal ones above): CLIP with a learnable scale and
    bias, every value and gradient to float64 rounding."""
    g = torch.Generator().manual_seed(3)
    n = 4 * world
    a, b = (torch.randn(n, D, generator=g, dtype=torch.float64) for _ in range(2))
    params = pf.losses.siglip_init(logit_scale=0.7, logit_bias=-0.5, dtype=torch.float64)
    report = check_distributed(
        pf.losses.clip, a, b, params, world_size=world, exchange="ring", rtol=1e-10, atol=1e-12
    )
    assert report.sizes == (4,) * world
    assert max(report.grad_diffs.values()) < 1e-12 and report.loss_diff < 1e-12


def _weighted(loss_fn, weight, *args, **kwargs):
    """``weight`` times a loss: a sum of weighted losses sends the cotangent ``weight`` (not 1)
    back into each."""
    return weight * loss_fn(*args, **kwargs)


def _weighted_ring(loss_fn, weight, *args, **kwargs):
    return weight * pf.distributed.global_objective(loss_fn, exchange="ring")(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_fn", "form"),
    [
        (functools.partial(pf.losses.clip, chunk_size=3), "pair"),
        (functools.partial(pf.losses.ntxent, temperature=0.2, chunk_size=3), "self"),
    ],
    ids=["clip-tiled", "ntxent-tiled"],
)
def test_the_ring_inside_a_weighted_sum_receives_the_weight_as_its_cotangent(loss_fn, form):
    """``0.3 × ring loss`` (a term of a weighted sum) on 3 ranks: the backward gets the
    cotangent 0.3, not 1, and every gradient (rows, columns, the learnable scale and bias) is
    0.3 × the single process's, to float64 rounding."""
    a, b, y = _inputs()
    g = torch.Generator().manual_seed(5)
    a, b = a[:12], b[:12] + 0.1 * torch.randn(12, D, generator=g, dtype=torch.float64)
    if form == "self":
        args = (a, y[:12])
    else:
        args = (a, b, pf.losses.siglip_init(logit_scale=0.7, logit_bias=-0.5, dtype=torch.float64))
    report = check_distributed(
        functools.partial(_weighted, loss_fn, 0.3), *args, world_size=3,
        distributed_fn=functools.partial(_weighted_ring, loss_fn, 0.3), rtol=1e-10, atol=1e-12,
    )  # fmt: skip
    # positional arguments past the signature's named ones are named by their place
    want = {"args[0]"} if form == "self" else {"args[0]", "args[1]"}
    if form != "self":
        want |= {"args[2]['logit_scale']", "args[2]['logit_bias']"}
    assert set(report.grad_diffs) == want  # (the labels are no float: not differentiated)
    assert max(report.grad_diffs.values()) < 1e-12 and report.loss_diff < 1e-12


def _ring_transfers(loss_fn, form):
    """The number of transfers (``batch_isend_irecv`` calls) of one forward and backward of the
    ring loss on this rank."""
    calls = []
    real = dist.batch_isend_irecv

    def counting(ops):
        calls.append(len(ops))
        return real(ops)

    a, b, y = _inputs()
    rank = dist.get_rank()
    rows = slice(4 * rank, 4 * rank + 4)
    x = a[rows].clone().requires_grad_()
    if form == "self":
        args = (x, y[rows])
    else:
        args = (x, b[rows].clone().requires_grad_(), pf.losses.clip_init(dtype=torch.float64))
    objective = pf.distributed.global_objective(loss_fn, exchange="ring")
    dist.batch_isend_irecv = counting
    try:
        objective(*args).backward()
    finally:
        dist.batch_isend_irecv = real
    return len(calls)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_fn", "form", "walks"),
    [(pf.losses.clip, "pair", (True, True)), (pf.losses.ntxent, "self", (False, False, True))],
    ids=["clip", "ntxent"],
)
def test_the_ring_moves_each_block_w_minus_1_times_and_what_travels_with_it_w_times(
    loss_fn, form, walks
):
    """The module's walk on 3 ranks: in each walk a block makes W − 1 hops (it is not sent on
    after the last step) and what travels with it (CLIP's column statistics forward, the
    columns' gradient backward) W, the last one home. CLIP walks twice (forward, backward),
    both with statistics; NT-Xent's forward walks twice without them (the terms need each
    row's final log-sum-exp), its backward once with its columns' gradient."""
    world = 3
    want = sum(world - 1 + (world if travels else 0) for travels in walks)
    got = pf.testing.spawn_ranks(_ring_transfers, loss_fn, form, world_size=world, timeout=120)
    assert got == [want] * world


@pytest.mark.parametrize(
    ("loss_fn", "exchange", "sizes"),
    [
        (functools.partial(pf.losses.clip, chunk_size=3), "ring", (6, 0, 10)),
        (pf.losses.siglip, "gather", (0, 16)),
        (pf.losses.proxy_anchor, "gather", (16, 0)),
    ],
    ids=["clip-ring-tiled", "siglip-gather", "proxy_anchor-gather"],
)
def test_an_empty_rank_is_checked_like_any_other(loss_fn, exchange, sizes):
    a, b, y = _inputs()
    if loss_fn is pf.losses.proxy_anchor:
        params = pf.losses.proxy_anchor_init(num_classes=4, embedding_size=D, dtype=torch.float64)
        args = (a, y, params)
    else:
        args = (a, b, pf.losses.siglip_init(logit_scale=1.0, logit_bias=-1.0, dtype=torch.float64))
    report = check_distributed(
        loss_fn, *args, world_size=len(sizes), exchange=exchange, sizes=sizes, rtol=1e-9, atol=1e-12
    )
    assert report.sizes == sizes and max(report.grad_diffs.values()) < 1e-12
