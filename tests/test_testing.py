"""pmlfunc.testing.check_distributed: spawned gloo ranks against one process, for correct losses
(the ring on four ranks, unequal shards) and for the classic distributed-gradient bugs."""

from __future__ import annotations

import functools

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
    a, _, y = _inputs()
    with pytest.raises(RuntimeError, match=r"rank 0 failed:(.|\n)*this rank's loss broke"):
        check_distributed(NTXENT, a, y, distributed_fn=_failing)


def test_bad_arguments():
    a, _, y = _inputs()
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        check_distributed(NTXENT, a, y, world_size=1)
    with pytest.raises(ValueError, match="sizes must give each of the 2 ranks"):
        check_distributed(NTXENT, a, y, sizes=(10, 10))
    with pytest.raises(TypeError, match="first argument must be a tensor"):
        check_distributed(NTXENT, [1, 2], y)
